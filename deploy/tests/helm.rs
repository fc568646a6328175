//! The Helm chart in deploy/chart/tessera, rendered by Helm's own binary (v4.2.3,
//! scripts/fetch-helm.sh), gives exactly the objects `tessera-manifests` renders for the same
//! settings, under every choice of share enforcement, DRA and driver root; Helm refuses bad
//! values naming them.

use std::path::{Path, PathBuf};
use std::process::Command;

use tessera_core::enforcement::ShareEnforcement;
use tessera_deploy::{ManifestOptions, objects};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap()
}

/// Helm's binary: `TESSERA_HELM`, or where scripts/fetch-helm.sh puts it.
fn helm() -> PathBuf {
    let helm = std::env::var_os("TESSERA_HELM")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(".cache/helm/v4.2.3/helm"));
    assert!(
        helm.is_file(),
        "no Helm at {}: run scripts/fetch-helm.sh (scripts/test.sh does)",
        helm.display()
    );
    helm
}

/// `helm template` of the checked-in chart: its stdout, or its stderr as the error.
fn template(namespace: &str, set: &[(&str, String)]) -> Result<String, String> {
    let mut cmd = Command::new(helm());
    cmd.args(["template", "tessera"])
        .arg(root().join("deploy/chart/tessera"))
        .args(["--namespace", namespace, "--include-crds"])
        // Helm keeps no state of ours: its caches and config in a directory of the test's.
        .env("HELM_CACHE_HOME", std::env::temp_dir().join("tessera-helm-test/cache"))
        .env(
            "HELM_CONFIG_HOME",
            std::env::temp_dir().join("tessera-helm-test/config"),
        )
        .env("HELM_DATA_HOME", std::env::temp_dir().join("tessera-helm-test/data"));
    for (k, v) in set {
        // Strings as strings; numbers and booleans as what they are.
        let flag = if matches!(*k, "replicas" | "dra" | "exclusiveProcess" | "percentageOfNodesToScore") {
            "--set"
        } else {
            "--set-string"
        };
        cmd.arg(flag).arg(format!("{k}={v}"));
    }
    let out = cmd.output().expect("helm runs");
    if out.status.success() {
        Ok(String::from_utf8(out.stdout).unwrap())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// The documents of a YAML stream, sorted by kind and name (Helm orders by kind).
fn sorted(mut docs: Vec<serde_json::Value>) -> Vec<serde_json::Value> {
    docs.retain(|d| !d.is_null());
    docs.sort_by_key(|d| format!("{}/{}", d["kind"], d["metadata"]["name"]));
    docs
}

fn parse(stream: &str) -> Vec<serde_json::Value> {
    use serde::Deserialize;
    sorted(
        serde_yaml::Deserializer::from_str(stream)
            .map(|doc| serde_json::Value::deserialize(doc).expect("helm renders YAML"))
            .collect(),
    )
}

#[test]
fn the_chart_renders_what_the_renderer_does_under_every_choice() {
    let _ = helm();
    // The defaults: values.yaml as it is.
    let defaults = ManifestOptions::default();
    let chart = parse(&template(&defaults.namespace, &[]).unwrap());
    assert_eq!(chart, sorted(objects(&defaults)), "default values");

    let mut compared = 0;
    for share_enforcement in [ShareEnforcement::Mps, ShareEnforcement::Hook, ShareEnforcement::None] {
        for (dra, driver_root, exclusive_process) in [
            (false, None, false),
            (false, Some("/run/nvidia/driver"), false),
            (true, None, false),
            (true, Some("/run/nvidia/driver"), false),
            (false, None, true),
            (true, Some("/run/nvidia/driver"), true),
        ] {
            if exclusive_process && share_enforcement != ShareEnforcement::Mps {
                continue;
            }
            {
                let opts = ManifestOptions {
                    namespace: "gpu-sharing".into(),
                    image: "registry.example.com:5000/tessera:dev".into(),
                    scheduler_image: "registry.example.com/kube-scheduler:v1.34.1".into(),
                    replicas: 3,
                    driver_root: driver_root.map(String::from),
                    share_enforcement,
                    nri_socket: "/run/containerd/nri/nri.sock".into(),
                    cdi_dir: "/etc/cdi".into(),
                    dra,
                    exclusive_process,
                    percentage_of_nodes_to_score: if dra { 0 } else { 35 },
                    ..ManifestOptions::default()
                };
                let set = [
                    ("image", opts.image.clone()),
                    ("schedulerImage", opts.scheduler_image.clone()),
                    ("replicas", opts.replicas.to_string()),
                    ("driverRoot", driver_root.unwrap_or_default().to_string()),
                    ("shareEnforcement", share_enforcement.to_string()),
                    ("nriSocket", opts.nri_socket.clone()),
                    ("cdiDir", opts.cdi_dir.clone()),
                    ("dra", dra.to_string()),
                    ("exclusiveProcess", exclusive_process.to_string()),
                    (
                        "percentageOfNodesToScore",
                        opts.percentage_of_nodes_to_score.to_string(),
                    ),
                ];
                let chart = parse(&template(&opts.namespace, &set).unwrap());
                let want = sorted(objects(&opts));
                assert_eq!(chart.len(), want.len(), "{set:?}: objects");
                for (c, w) in chart.iter().zip(&want) {
                    assert_eq!(c, w, "{set:?}");
                }
                compared += 1;
            }
        }
    }
    assert_eq!(compared, 14);
}

#[test]
fn helm_refuses_bad_values_naming_them() {
    // Exclusive-process mode without MPS: refused, naming both.
    let out = Command::new(helm())
        .args(["template", "tessera"])
        .arg(root().join("deploy/chart/tessera"))
        .args(["--set", "exclusiveProcess=true", "--set", "shareEnforcement=hook"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("shareEnforcement") && err.contains("mps"),
        "{err}"
    );
    for (key, value, flag) in [
        ("shareEnforcement", "nope", "--set-string"),
        ("replicas", "0", "--set"),
        ("replicas", "two", "--set-string"),
        ("driverRoot", "run/nvidia/driver", "--set-string"),
        ("nriSocket", "/var/run/nri/", "--set-string"),
        ("cdiDir", "etc/cdi", "--set-string"),
        ("image", "", "--set-string"),
        ("schedulerImage", "a b", "--set-string"),
        ("dra", "yes", "--set-string"),
        ("imagee", "x", "--set-string"),
        ("exclusiveProcess", "1", "--set-string"),
        ("percentageOfNodesToScore", "101", "--set"),
        ("percentageOfNodesToScore", "-1", "--set"),
        ("percentageOfNodesToScore", "all", "--set-string"),
    ] {
        let out = Command::new(helm())
            .args(["template", "tessera"])
            .arg(root().join("deploy/chart/tessera"))
            .arg(flag)
            .arg(format!("{key}={value}"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{key}={value:?} rendered");
        assert!(
            err.contains("values don't meet the specifications of the schema") && err.contains(key),
            "{key}={value:?}: {err}"
        );
    }
}

#[path = "image_names.rs"]
mod image_names;

/// `tessera-manifests --image` and the chart's values schema judge image names by one rule:
/// each name of the lists is accepted by both or refused by both (the values are given in a
/// file, so Helm reads each name exactly, escapes and commas included).
#[test]
fn the_flag_and_the_chart_judge_image_names_alike() {
    let dir = std::env::temp_dir().join(format!("tessera-image-names-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let values = dir.join("values.json");
    let names = image_names::GOOD.iter().map(|n| (*n, true));
    let mut mismatches = Vec::new();
    for (name, good) in names.chain(image_names::BAD.iter().map(|n| (*n, false))) {
        for (flag, key) in [("--image", "image"), ("--scheduler-image", "schedulerImage")] {
            let out = Command::new(env!("CARGO_BIN_EXE_tessera-manifests"))
                .arg(format!("{flag}={name}"))
                .args(["--out", dir.join("out.yaml").to_str().unwrap()])
                .output()
                .unwrap();
            let cli = out.status.success();
            let err = String::from_utf8_lossy(&out.stderr);
            if !cli && !err.contains(&format!("{flag}={name:?}: not an image reference")) {
                mismatches.push(format!("{flag}={name:?}: the refusal does not name it: {err}"));
            }
            std::fs::write(&values, serde_json::json!({ key: name }).to_string()).unwrap();
            let out = Command::new(helm())
                .args(["template", "tessera"])
                .arg(root().join("deploy/chart/tessera"))
                .arg("-f")
                .arg(&values)
                .env("HELM_CACHE_HOME", dir.join("cache"))
                .env("HELM_CONFIG_HOME", dir.join("config"))
                .env("HELM_DATA_HOME", dir.join("data"))
                .output()
                .unwrap();
            let chart = out.status.success();
            let err = String::from_utf8_lossy(&out.stderr);
            if !chart && !err.contains("values don't meet the specifications of the schema") {
                // Let through by the schema, broken in a template.
                let line = err.lines().next().unwrap_or_default();
                mismatches.push(format!("{key}={name:?}: the schema lets it through to break: {line}"));
            } else if (cli, chart) != (good, good) {
                mismatches.push(format!("{key}={name:?}: flag {cli}, chart {chart}, want {good}"));
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(mismatches.is_empty(), "{}", mismatches.join("\n"));
}
