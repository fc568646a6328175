//! The extender's command line refuses nonsense, naming the flag and the value.

use std::process::Command;

/// `manifests` renders nothing Kubernetes would refuse or that would point nowhere; `serve`
/// takes no zero where one is meaningless.
#[test]
fn manifests_and_serve_refuse_nonsense_naming_the_flag() {
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_tessera-extender"))
            .args(args)
            .env("RUST_BACKTRACE", "0")
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
            out.stdout.len(),
        )
    };
    for (args, want) in [
        (
            &["manifests", "--namespace", "Bad_NS!"][..],
            "--namespace=\"Bad_NS!\": not a namespace name",
        ),
        (
            &["manifests", "--image", ""][..],
            "--image=\"\": not an image reference",
        ),
        (
            &["manifests", "--driver-root", "run/nvidia/driver"][..],
            "--driver-root=\"run/nvidia/driver\": must be an absolute host path",
        ),
        (
            &["manifests", "--nri-socket", "nri.sock"][..],
            "--nri-socket=\"nri.sock\": must be an absolute host path",
        ),
        (
            &["manifests", "--nri-socket", "/var/run/nri/"][..],
            "must name the socket, not its directory",
        ),
        (
            &["manifests", "--cdi-dir", "etc/cdi"][..],
            "--cdi-dir=\"etc/cdi\": must be an absolute host path",
        ),
    ] {
        let (code, stderr, printed) = run(args);
        assert_eq!((code, printed), (Some(1), 0), "{args:?}: {stderr}");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
    }
    for flag in ["--memory-unit-mib", "--lease-duration-s"] {
        let (code, stderr, _) = run(&["serve", flag, "0"]);
        assert_eq!(code, Some(2), "{flag}: {stderr}");
        assert!(stderr.contains(flag) && stderr.contains("'0'"), "{flag}: {stderr}");
    }
    let (code, _, printed) = run(&["manifests", "--namespace", "gpu-system"]);
    assert_eq!(code, Some(0));
    assert!(printed > 0);
}
