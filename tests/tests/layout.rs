//! The crate layout docs/architecture.md draws, held: core decides and does no node I/O, the
//! simulator builds without the Kubernetes client stack, and no crate reaches up a layer.
//! Read from `cargo metadata` (the manifests as Cargo sees them, dependencies of every kind).

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

/// Each workspace crate's dependencies that are built into it (normal and build ones; not the
/// dev-dependencies of its tests), by name.
fn built_dependencies() -> BTreeMap<String, BTreeSet<String>> {
    let out = Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--no-deps", "--offline"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("running cargo metadata");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let deps = p["dependencies"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|d| d["kind"].as_str() != Some("dev"))
                .map(|d| d["name"].as_str().unwrap().to_string())
                .collect();
            (p["name"].as_str().unwrap().to_string(), deps)
        })
        .collect()
}

#[test]
fn core_decides_and_does_no_node_io() {
    let deps = built_dependencies();
    let core = &deps["tessera-core"];
    for io in ["nvml-wrapper", "nix", "libc", "tokio", "kube", "tempfile"] {
        assert!(!core.contains(io), "tessera-core depends on {io}: {core:?}");
    }
    let tessera: Vec<_> = core.iter().filter(|d| d.starts_with("tessera")).collect();
    assert!(tessera.is_empty(), "tessera-core depends on {tessera:?}");
}

#[test]
fn the_simulator_builds_on_core_alone() {
    let deps = built_dependencies();
    let sim = &deps["tessera-simulator"];
    let tessera: Vec<_> = sim.iter().filter(|d| d.starts_with("tessera")).collect();
    assert_eq!(tessera, ["tessera-core"], "{sim:?}");
    for k8s in ["kube", "k8s-openapi", "tokio", "hyper", "rustls", "axum"] {
        assert!(!sim.contains(k8s), "tessera-simulator depends on {k8s}");
    }
}

#[test]
fn no_crate_reaches_up_a_layer() {
    let deps = built_dependencies();
    // Layers as docs/architecture.md draws them: a crate may use only crates of the layers
    // above its own.
    let layers: &[&[&str]] = &[
        &["tessera-core", "tessera-proto"],
        &["tessera-node", "tessera-api", "tessera-simulator", "kubectl-tessera"],
        &["tessera-claims", "tessera-deploy"],
        &[
            "tessera-cdi-generator",
            "tessera-device-plugin",
            "tessera-dra-plugin",
            "tessera-nri-plugin",
            "tessera-mps",
            "tessera-cuda-hook",
        ],
        &["tessera-extender"],
    ];
    let layer_of = |name: &str| layers.iter().position(|l| l.contains(&name));
    for (name, uses) in &deps {
        let Some(mine) = layer_of(name) else { continue };
        for d in uses {
            if let Some(theirs) = layer_of(d) {
                assert!(theirs < mine, "{name} (layer {mine}) uses {d} (layer {theirs})");
            }
        }
    }
    // Every crate of the workspace but the tests is placed.
    for name in deps.keys().filter(|n| *n != "tessera-tests") {
        assert!(
            layer_of(name).is_some(),
            "{name} is in no layer of docs/architecture.md"
        );
    }
}
