//! Golden CDI specs for the built-in fixtures, MIG reconfiguration, and failure handling.
//! Regenerate the golden files with `UPDATE_GOLDEN=1 cargo test -p tessera-cdi-generator`.

mod support;

use std::path::Path;

use tessera_cdi_generator::daemon::{DaemonConfig, Generator};
use tessera_cdi_generator::spec::{self, SpecOptions};
use tessera_cdi_generator::writer::{SPEC_FILE, WriteOutcome};
use tessera_core::inventory::{FixtureSource, InventorySource};

fn golden(name: &str) {
    let inv = FixtureSource::new(name).discover().unwrap();
    let (_, text) = spec::render(&inv, &SpecOptions::default()).unwrap();
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(format!("{name}.json"));
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, &text).unwrap();
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(text, expected, "{name}: generated spec differs from {}", path.display());
}

/// The daemon's settings for a fixture node: CDI specs in `cdi_dir`, polled every `secs`.
fn fixture_daemon(cdi_dir: std::path::PathBuf, secs: u64) -> DaemonConfig {
    DaemonConfig {
        cdi_dir,
        spec: SpecOptions::default(),
        interval: std::time::Duration::from_secs(secs),
        node_name: None,
        bundle: None,
        check_host_paths: None,
        share_memory: None,
    }
}

#[test]
fn golden_h100x8() {
    golden("h100x8");
}

#[test]
fn golden_a100_mig() {
    golden("a100-mig");
}

#[test]
fn golden_t4x2() {
    golden("t4x2");
}

fn names(text: &str) -> Vec<String> {
    let v: serde_json::Value = serde_json::from_str(text).unwrap();
    v["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn spec_shape_for_the_mig_fixture() {
    let inv = FixtureSource::new("a100-mig").discover().unwrap();
    let (spec, text) = spec::render(&inv, &SpecOptions::default()).unwrap();
    let n = names(&text);
    // GPUs 0-2 are in MIG mode: offered only as MIG devices; GPU 3 whole, by index and UUID,
    // and as a share.
    assert!(!n.contains(&"0".to_string()) && !n.contains(&"share-0".to_string()));
    for name in [
        "3",
        &inv.gpus[3].uuid,
        "share-3",
        "0:0",
        "1:6",
        "2:1",
        &inv.gpus[1].mig_devices[0].uuid,
        "all",
    ] {
        assert!(n.contains(&name.to_string()), "{name} missing from {n:?}");
    }
    assert_eq!(n.len(), 13 * 2 + 2 * 2 + 1);
    assert_eq!(spec.cdi_version, "0.6.0", "annotations need 0.6.0");
    let ctl: Vec<&str> = spec
        .container_edits
        .device_nodes
        .iter()
        .map(|d| d.path.as_str())
        .collect();
    assert_eq!(
        ctl,
        [
            "/dev/nvidiactl",
            "/dev/nvidia-modeset",
            "/dev/nvidia-uvm",
            "/dev/nvidia-uvm-tools"
        ]
    );
    assert!(
        spec.container_edits
            .env
            .contains(&"NVIDIA_VISIBLE_DEVICES=void".to_string())
    );
    let mounts: Vec<&str> = spec
        .container_edits
        .mounts
        .iter()
        .map(|m| m.container_path.as_str())
        .collect();
    assert!(mounts.contains(&"/usr/local/nvidia/lib64/libcuda.so.1"), "{mounts:?}");
    assert!(mounts.contains(&"/usr/bin/nvidia-smi"));
    assert!(
        spec.container_edits
            .mounts
            .iter()
            .all(|m| m.options.contains(&"ro".to_string()))
    );
}

#[test]
fn mig_reconfiguration_replaces_the_mig_devices() {
    let dir = tempfile::tempdir().unwrap();
    let fixture = dir.path().join("node.yaml");
    let original = tessera_core::inventory::BUILTIN_FIXTURES
        .iter()
        .find(|(n, _)| *n == "a100-mig")
        .unwrap()
        .1;
    std::fs::write(&fixture, original).unwrap();
    let config = fixture_daemon(dir.path().join("cdi"), 1);
    let source = FixtureSource::new(&fixture);
    let mut g = Generator::default();
    let (first, _) = g.step(&source, &config).unwrap();
    assert_eq!(first.outcome, WriteOutcome::Written);
    let (again, _) = g.step(&source, &config).unwrap();
    assert_eq!(again.outcome, WriteOutcome::Unchanged);
    assert!(again.added.is_empty() && again.removed.is_empty());

    // GPU 2 goes from 4g.20gb + 3g.20gb to one 7g.40gb instance.
    let inv = source.discover().unwrap();
    let old_uuids: Vec<String> = inv.gpus[2].mig_devices.iter().map(|m| m.uuid.clone()).collect();
    let start = original.find("  - index: 2\n").unwrap();
    let end = original.find("  - index: 3\n").unwrap();
    let new_gpu2 = original[start..end]
        .lines()
        .filter(|l| !l.trim_start().starts_with("- { index:"))
        .map(|l| format!("{l}\n"))
        .collect::<String>()
        + "      - { index: 0, uuid: MIG-7a7a7a7a-0000-4000-8000-000000000002, gi: 0, ci: 0, profile: 7g.40gb, memory_mib: 40192 }\n";
    std::fs::write(
        &fixture,
        format!("{}{}{}", &original[..start], new_gpu2, &original[end..]),
    )
    .unwrap();
    let (changed, _) = g.step(&source, &config).unwrap();
    assert_eq!(changed.outcome, WriteOutcome::Written);
    // "2:0" stays (now naming the new instance); "2:1" goes.
    assert_eq!(
        changed.added,
        vec!["MIG-7a7a7a7a-0000-4000-8000-000000000002".to_string()]
    );
    let mut expected_removed = vec!["2:1".to_string()];
    expected_removed.extend(old_uuids);
    expected_removed.sort();
    assert_eq!(changed.removed, expected_removed);
    let text = std::fs::read_to_string(config.cdi_dir.join(SPEC_FILE)).unwrap();
    assert!(!text.contains(&inv.gpus[2].mig_devices[1].uuid));
    assert!(
        text.contains("nvidia-cap274"),
        "gpu2/gi0 access minor from the table: {text}"
    );

    // A broken fixture: error, and the previous spec stays.
    std::fs::write(&fixture, "gpus: [").unwrap();
    let err = g.step(&source, &config).unwrap_err();
    assert!(format!("{err:#}").contains("node.yaml"), "{err:#}");
    assert_eq!(std::fs::read_to_string(config.cdi_dir.join(SPEC_FILE)).unwrap(), text);
}

/// What Tessera writes, checked by the `container-device-interface` crate (the CDI reference
/// rules in Rust): it parses, validates, and needs exactly the cdiVersion Tessera declares. For
/// every fixture, every enforcement mode, with and without a device root.
#[test]
fn every_spec_passes_the_cdi_crate() {
    use tessera_core::enforcement::ShareEnforcement;
    for fixture in ["h100x8", "a100-mig", "t4x2"] {
        let inv = FixtureSource::new(fixture).discover().unwrap();
        for enforcement in [ShareEnforcement::None, ShareEnforcement::Mps, ShareEnforcement::Hook] {
            for dev_root in ["/", "/host"] {
                let opts = SpecOptions {
                    dev_root: dev_root.into(),
                    enforcement,
                    ..Default::default()
                };
                let (spec, text) = spec::render(&inv, &opts).unwrap();
                support::cdi_crate_accepts(&text, &spec.cdi_version, &format!("{fixture} {enforcement} {dev_root}"));
            }
        }
    }
}

/// A MIG instance the DRA plugin made is listed at once, not at the next poll: the plugin
/// writes the claim's marker into the CDI directory right after, and the generator reads the
/// cards again when that directory changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_in_the_cdi_directory_reads_the_cards_again() {
    let dir = tempfile::tempdir().unwrap();
    let fixture = dir.path().join("node.yaml");
    let mut f = tessera_core::inventory::Fixture::builtin("a100-dynamic-mig").unwrap();
    let card = "GPU-1d3a8f42-5c6e-4b1f-9a27-0e8b3c4d5f61";
    let at = |start| tessera_core::inventory::MigPlacement { start, size: 1 };
    let first = f.create_mig_instance(card, 19, at(0)).unwrap();
    std::fs::write(&fixture, f.to_yaml()).unwrap();
    let cdi = dir.path().join("cdi");
    std::fs::create_dir_all(&cdi).unwrap();
    let config = fixture_daemon(cdi.clone(), 3600);
    let lists = |uuid: &str| {
        std::fs::read_to_string(cdi.join(SPEC_FILE)).is_ok_and(|t| t.contains(&format!("\"name\": \"{uuid}\"")))
    };
    // Only the CDI directory is watched here: the fixture changing is not seen on its own.
    let run = tokio::spawn(tessera_cdi_generator::daemon::run(
        Box::new(FixtureSource::new(&fixture)),
        vec![cdi.clone()],
        config,
    ));
    let until = |what: &'static str, f: &dyn Fn() -> bool| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !f() {
            assert!(std::time::Instant::now() < deadline, "{what}");
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    };
    until("the first spec", &|| lists(&first.uuid));
    let second = f.create_mig_instance(card, 19, at(1)).unwrap();
    std::fs::write(&fixture, f.to_yaml()).unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    assert!(!lists(&second.uuid), "read again without a change in the CDI directory");
    std::fs::write(cdi.join("tessera.io-claim-x.json"), "{}").unwrap();
    until("the new instance after the marker", &|| lists(&second.uuid));
    run.abort();
}

/// A dynamic-MIG node whose last instance is destroyed has no spec, not one naming the
/// instance that is gone; the next instance brings it back.
#[test]
fn the_spec_goes_with_the_last_mig_instance() {
    let dir = tempfile::tempdir().unwrap();
    let fixture = dir.path().join("node.yaml");
    let mut f = tessera_core::inventory::Fixture::builtin("a100-dynamic-mig").unwrap();
    let card = "GPU-1d3a8f42-5c6e-4b1f-9a27-0e8b3c4d5f61";
    let at = tessera_core::inventory::MigPlacement { start: 0, size: 8 };
    let made = f.create_mig_instance(card, 0, at).unwrap();
    std::fs::write(&fixture, f.to_yaml()).unwrap();
    let config = fixture_daemon(dir.path().join("cdi"), 1);
    let source = FixtureSource::new(&fixture);
    let mut g = Generator::default();
    let spec_file = dir.path().join("cdi").join(SPEC_FILE);
    assert_eq!(g.step(&source, &config).unwrap().0.outcome, WriteOutcome::Written);
    assert!(std::fs::read_to_string(&spec_file).unwrap().contains(&made.uuid));
    assert!(f.destroy_mig_instance(card, made.gi, &made.uuid).unwrap());
    std::fs::write(&fixture, f.to_yaml()).unwrap();
    let (gone, _) = g.step(&source, &config).unwrap();
    assert_eq!(gone.outcome, WriteOutcome::Removed);
    assert!(gone.removed.contains(&made.uuid), "{gone:?}");
    assert!(!spec_file.exists());
    assert_eq!(g.step(&source, &config).unwrap().0.outcome, WriteOutcome::Unchanged);
    let again = f.create_mig_instance(card, 0, at).unwrap();
    std::fs::write(&fixture, f.to_yaml()).unwrap();
    assert_eq!(g.step(&source, &config).unwrap().0.outcome, WriteOutcome::Written);
    assert!(std::fs::read_to_string(&spec_file).unwrap().contains(&again.uuid));
}
