// Image names that `tessera-manifests --image` and the chart's values schema must judge alike
// (deploy/src/image.rs's unit test and deploy/tests/helm.rs read these lists).

/// Names both accept.
pub const GOOD: &[&str] = &[
    "tessera",
    "tessera:0.1.0",
    "ghcr.io/tessera-gpu/tessera:0.1.0",
    "registry.k8s.io/kube-scheduler:v1.36.2",
    "localhost/tessera",
    "localhost:5000/tessera:dev",
    "registry:5000/team/tessera",
    "Registry.Example.com/t:1",
    "my_registry.example.com/a__b/c-d--e/f.g:Tag_1.0-rc",
    "tessera@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
    "ghcr.io/t/tessera:0.1.0@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
];

/// Names both refuse.
pub const BAD: &[&str] = &[
    "",
    " ",
    "tessera 0.1",
    "Tessera",
    "Foo/bar",
    "ghcr.io/Tessera/tessera",
    "ghcr.io//tessera",
    "/tessera",
    "tessera/",
    "tessera:",
    "tessera:.tag",
    "tessera:-tag",
    "tessera@sha256:abc",
    "tessera@sha256",
    "-tessera",
    "tessera-",
    "tessera..x",
    "ghcr.io/tessera:{{.Tag}}",
    "ghcr.io/tessera:\"x\"",
    "ghcr.io/tessera:a'b",
    "ghcr.io\\tessera",
    "ghcr.io/tessera#x",
    "héllo",
    "ghcr.io/tessera:tag\n",
];
