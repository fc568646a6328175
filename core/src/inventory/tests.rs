use std::path::Path;

use super::*;

fn builtin(name: &str) -> NodeInventory {
    FixtureSource::new(name).discover().unwrap()
}

#[test]
fn builtin_fixtures_describe_the_promised_nodes() {
    let h = builtin("h100x8");
    assert_eq!(h.gpus.len(), 8);
    assert!(
        h.gpus
            .iter()
            .all(|g| g.memory_mib == 81559 && !g.mig_enabled && g.model == "NVIDIA H100 80GB HBM3")
    );
    assert_eq!(h.gpus.iter().filter(|g| g.numa_node == Some(1)).count(), 4);

    let t = builtin("t4x2");
    assert_eq!(t.gpus.len(), 2);
    assert!(t.gpus.iter().all(|g| g.model == "Tesla T4"));

    let a = builtin("a100-mig");
    assert_eq!(a.gpus.len(), 4);
    let mig_counts: Vec<usize> = a.gpus.iter().map(|g| g.mig_devices.len()).collect();
    assert_eq!(mig_counts, [4, 7, 2, 0]);
    assert!(a.gpus[..3].iter().all(|g| g.mig_enabled));
    assert!(!a.gpus[3].mig_enabled);
    let profiles: std::collections::BTreeSet<String> = a
        .gpus
        .iter()
        .flat_map(|g| g.mig_devices.iter().map(|m| m.profile.to_string()))
        .collect();
    assert_eq!(
        profiles.into_iter().collect::<Vec<_>>(),
        ["1g.5gb", "2g.10gb", "3g.20gb", "4g.20gb"]
    );
}

#[test]
fn mig_capability_nodes_come_from_the_minors_table() {
    let a = builtin("a100-mig");
    let m = &a.gpus[0].mig_devices[0]; // gpu0 gi2 ci0
    assert_eq!((m.gi, m.ci), (2, 0));
    assert_eq!(m.gi_access.path, Path::new("/dev/nvidia-caps/nvidia-cap21"));
    assert_eq!((m.gi_access.major, m.gi_access.minor), (509, 21));
    assert_eq!(m.ci_access.minor, 22);
    let (parent, found) = a.mig_by_uuid(&m.uuid).unwrap();
    assert_eq!((parent.index, found.gi), (0, 2));
}

#[test]
fn control_devices_and_driver_files() {
    let dir = tempfile::tempdir().unwrap();
    let mut src = FixtureSource::new("t4x2");
    src.driver_root = Some(dir.path().to_path_buf());
    let inv = src.discover().unwrap();
    let paths: Vec<_> = inv.control_devices.iter().map(|d| d.path.to_str().unwrap()).collect();
    assert_eq!(
        paths,
        [
            "/dev/nvidiactl",
            "/dev/nvidia-modeset",
            "/dev/nvidia-uvm",
            "/dev/nvidia-uvm-tools"
        ]
    );
    let libcuda = inv
        .driver_files
        .iter()
        .find(|f| f.path.ends_with("libcuda.so.550.54.15"))
        .unwrap();
    assert_eq!(libcuda.kind, DriverFileKind::Library);
    assert_eq!(
        inv.host_path(libcuda),
        dir.path().join("usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15")
    );
    assert!(
        inv.driver_files
            .iter()
            .any(|f| f.kind == DriverFileKind::Binary && f.path.ends_with("nvidia-smi"))
    );
}

#[test]
fn bad_fixtures_name_the_field() {
    let text = include_str!("../../fixtures/t4x2.yaml");
    let dup = text.replacen("index: 1", "index: 0", 1);
    let e = Fixture::parse(&dup, Path::new("f.yaml"))
        .unwrap()
        .to_inventory(Path::new("f.yaml"), None)
        .unwrap_err();
    assert!(
        e.to_string().contains("gpus[1].index") && e.to_string().contains("duplicate"),
        "{e}"
    );

    let e = Fixture::parse("gpus: 3", Path::new("f.yaml")).unwrap_err();
    assert!(
        matches!(e, InventoryError::ParseFixture { .. }) && e.to_string().contains("f.yaml"),
        "{e}"
    );
    let e = Fixture::parse(&text.replace("memory_mib", "memory"), Path::new("f.yaml")).unwrap_err();
    assert!(e.to_string().contains("memory"), "{e}");

    let e = FixtureSource::new("/nonexistent/fixture.yaml").discover().unwrap_err();
    assert!(matches!(e, InventoryError::ReadFixture { .. }), "{e}");
}

/// Memory no card has and MIG profiles no card makes are refused, naming the fixture, the
/// card, the field and the value.
#[test]
fn absurd_fixture_values_name_the_card_and_field() {
    let mig = include_str!("../../fixtures/a100-mig.yaml");
    let dynamic = include_str!("../../fixtures/a100-dynamic-mig.yaml");
    let card0 = "card 0 (GPU-86a28f10-eff9-6d6d-74c9-10219c67b6c9)";
    let cases = [
        (
            mig.replacen("memory_mib: 40960", "memory_mib: 0", 1),
            format!("{card0}: memory_mib=0: a card has 1 to 16777216 MiB"),
        ),
        (
            mig.replacen("memory_mib: 40960", "memory_mib: 17179869184", 1),
            format!("{card0}: memory_mib=17179869184: a card has 1 to 16777216 MiB"),
        ),
        (
            mig.replacen(
                "profile: 3g.20gb, memory_mib: 19968",
                "profile: 3g.20gb, memory_mib: 99999",
                1,
            ),
            format!(
                "{card0}: mig_devices[0].memory_mib=99999: a MIG instance has memory, at most its card's 40960 MiB"
            ),
        ),
        (
            mig.replacen(
                "profile: 3g.20gb, memory_mib: 19968",
                "profile: 3g.20gb, memory_mib: 0",
                1,
            ),
            format!("{card0}: mig_devices[0].memory_mib=0"),
        ),
        (
            mig.replacen("profile: 3g.20gb", "profile: 7g.999gb", 1),
            format!("{card0}: mig_devices[0].profile=7g.999gb: its 999 GB are more than the card's 40960 MiB"),
        ),
        (
            dynamic.replacen("profile: 1g.5gb", "profile: 1g.50gb", 1),
            "mig_profiles[0].profile=1g.50gb: its 50 GB are more than the card's 40960 MiB".to_string(),
        ),
    ];
    for (text, want) in cases {
        let e = Fixture::parse(&text, Path::new("f.yaml"))
            .and_then(|f| f.to_inventory(Path::new("f.yaml"), None))
            .unwrap_err();
        let e = e.to_string();
        assert!(
            e.starts_with("fixture f.yaml: ") && e.contains(&want),
            "want {want}\n got {e}"
        );
    }
    // A profile no card makes is refused where it is read, naming where it is.
    let text = mig.replacen("profile: 3g.20gb", "profile: 9g.999gb", 1);
    let e = Fixture::parse(&text, Path::new("f.yaml")).unwrap_err().to_string();
    assert!(
        e.contains("f.yaml") && e.contains("gpus[0].mig_devices[0]") && e.contains("\"9g.999gb\" is not a MIG profile"),
        "{e}"
    );
    // Real cards' names fit their memory: an H100 of 81559 MiB serves 7g.80gb.
    let h100 =
        mig.replacen("profile: 3g.20gb", "profile: 7g.80gb", 1)
            .replacen("memory_mib: 40960", "memory_mib: 81559", 1);
    Fixture::parse(&h100, Path::new("f.yaml"))
        .unwrap()
        .to_inventory(Path::new("f.yaml"), None)
        .unwrap();
}

#[test]
fn mig_device_without_minor_entry_is_an_error() {
    let text = include_str!("../../fixtures/a100-mig.yaml").replace("  gpu0/gi2/access 21\n", "");
    let e = Fixture::parse(&text, Path::new("a.yaml"))
        .unwrap()
        .to_inventory(Path::new("a.yaml"), None)
        .unwrap_err();
    assert!(e.to_string().contains("gpu0/gi2/access"), "{e}");
}

#[test]
fn published_annotation_round_trips_and_checks_version() {
    let inv = builtin("a100-mig");
    let p = PublishedInventory::of(&inv);
    let back = PublishedInventory::decode(&p.encode()).unwrap();
    assert_eq!(back, p);
    assert_eq!(back.gpus, inv.gpus);
    let e = PublishedInventory::decode(&p.encode().replacen("\"version\":1", "\"version\":7", 1)).unwrap_err();
    assert!(e.to_string().contains("unsupported version 7"), "{e}");
    assert!(PublishedInventory::decode("{}").is_err());
}

/// How the driver holds share memory travels with the inventory; a node that does not say
/// (an older one) decodes as not saying.
#[test]
fn published_share_memory_round_trips_and_is_optional() {
    let inv = builtin("h100x8");
    let said = PublishedInventory::of(&inv).holding_share_memory(Some(ShareMemory {
        per_cgroup: true,
        detail: "per cgroup (driver 615.29.01, the kernel's dmem controller)".into(),
    }));
    let text = said.encode();
    assert!(text.contains("\"share_memory\":{\"per_cgroup\":true"), "{text}");
    assert_eq!(PublishedInventory::decode(&text).unwrap(), said);
    let silent = PublishedInventory::of(&inv);
    assert!(!silent.encode().contains("share_memory"));
    assert_eq!(PublishedInventory::decode(&silent.encode()).unwrap().share_memory, None);
}

/// Each card's compute mode, read from a fixture (as from NVML), travels with the inventory;
/// a node that does not say (an older one) decodes as not saying.
#[test]
fn published_compute_modes_round_trip_and_are_optional() {
    let text = Fixture::builtin_text("t4x2").unwrap().replacen(
        "    pci_bus_id:",
        "    compute_mode: exclusive-process\n    pci_bus_id:",
        1,
    );
    let inv = Fixture::parse(&text, Path::new("t4x2-modes"))
        .unwrap()
        .to_inventory(Path::new("t4x2-modes"), None)
        .unwrap();
    assert_eq!(
        inv.gpus.iter().map(|g| g.compute_mode).collect::<Vec<_>>(),
        [Some(ComputeMode::ExclusiveProcess), None]
    );
    let published = PublishedInventory::of(&inv).encode();
    assert_eq!(
        published.matches("\"compute_mode\":\"exclusive-process\"").count(),
        1,
        "{published}"
    );
    assert_eq!(PublishedInventory::decode(&published).unwrap().gpus, inv.gpus);
    let bad = text.replacen("exclusive-process", "exclusive", 1);
    let e = Fixture::parse(&bad, Path::new("t4x2-bad")).unwrap_err().to_string();
    assert!(e.contains("exclusive"), "{e}");
}

#[test]
fn model_constraints() {
    let gpu_model = "NVIDIA A100-SXM4-40GB";
    assert!(model_matches(gpu_model, "A100"));
    assert!(model_matches(gpu_model, "a100-sxm4-40gb"));
    assert!(model_matches(gpu_model, "NVIDIA A100-SXM4-40GB"));
    assert!(!model_matches(gpu_model, "A10"));
    assert!(!model_matches("NVIDIA A1000", "A100"));
    assert!(model_matches("Tesla T4", "Tesla"));
    assert!(model_matches("Tesla T4", "T4"));
    assert!(model_matches("Tesla T4", "tesla t4"));
    assert!(!model_matches("Tesla T4", "T"));
    assert!(model_matches("V100M16", "V100M16"));
    assert!(!model_matches("V100M16", ""));
}

/// The topology travels with the published inventory, small (an 8-GPU matrix adds about 400
/// bytes; the largest, 64 GPUs, stays under 24 KiB of the annotation's 256 KiB), and a fixture
/// whose matrix does not fit its GPUs is refused with the field named. A topology of a future
/// version is dropped, not the node's whole inventory.
#[test]
fn topology_is_published_bounded_and_checked() {
    use crate::topology::{GpuTopology, Link};
    let inv = builtin("a100-nvlink-pairs");
    let with = PublishedInventory::of(&inv);
    let back = PublishedInventory::decode(&with.encode()).unwrap();
    assert_eq!(back.topology, inv.topology);
    let mut without = with.clone();
    without.topology = None;
    let added = with.encode().len() - without.encode().len();
    assert!((300..500).contains(&added), "an 8-GPU matrix adds {added} bytes");
    let worst = GpuTopology::new(64, |_, _| Link::NvLink(18)).unwrap();
    let size = serde_json::to_string(&worst).unwrap().len();
    assert!(size < 24 << 10, "64 GPUs: {size} bytes");

    let future = with
        .encode()
        .replace("\"topology\":{\"version\":1", "\"topology\":{\"version\":9");
    let read = PublishedInventory::decode(&future).unwrap();
    assert_eq!(read.topology, None);
    assert_eq!(read.gpus, with.gpus);

    let text = include_str!("../../fixtures/l40s-pcie-switches.yaml");
    let short = text.replace("\"PHB PHB PIX X\"", "\"PHB PHB PIX\"");
    assert_ne!(short, text);
    let e = Fixture::parse(&short, Path::new("l.yaml"))
        .unwrap()
        .to_inventory(Path::new("l.yaml"), None)
        .unwrap_err();
    assert!(
        e.to_string().contains("topology") && e.to_string().contains("cells"),
        "{e}"
    );
}

#[test]
fn a_fixture_card_creates_and_destroys_instances_as_nvml_does() {
    let mut f = Fixture::builtin("a100-dynamic-mig").unwrap();
    let card = "GPU-1d3a8f42-5c6e-4b1f-9a27-0e8b3c4d5f61";
    let at = |start, size| MigPlacement { start, size };
    let a = f.create_mig_instance(card, 9, at(4, 4)).unwrap();
    // Overlapping, not a placement of the profile, not a profile of the card, no such card.
    for (profile, p, why) in [
        (19, at(5, 1), "overlaps"),
        (19, at(7, 1), "cannot be placed"),
        (99, at(0, 1), "no GPU instance profile"),
    ] {
        let err = f.create_mig_instance(card, profile, p).unwrap_err();
        assert!(err.contains(why), "{err}");
    }
    assert!(f.create_mig_instance("GPU-nope", 19, at(0, 1)).is_err());
    let b = f.create_mig_instance(card, 19, at(0, 1)).unwrap();
    assert_ne!(a.gi, b.gi);
    assert_ne!(a.uuid, b.uuid);
    // What the file says afterwards is what every reader sees: the instance, its
    // capabilities from the driver's standard minors table, its placement.
    let again = Fixture::parse(&f.to_yaml(), Path::new("x")).unwrap();
    let inv = again.to_inventory(Path::new("x"), None).unwrap();
    let m = inv.gpus[0].mig_devices.iter().find(|m| m.uuid == a.uuid).unwrap();
    assert_eq!((m.gi, m.ci, m.memory_mib), (a.gi, 0, 19968));
    assert_eq!(m.placement, Some(at(4, 4)));
    assert_eq!(m.gi_access.minor, 3 + 9 * a.gi);
    assert_eq!(m.ci_access.path, cap_path(3 + 9 * a.gi + 1));
    // Destroyed only as the instance it was: an id alone may name a later one.
    assert!(!f.destroy_mig_instance(card, a.gi, &b.uuid).unwrap());
    assert!(f.destroy_mig_instance(card, a.gi, &a.uuid).unwrap());
    assert!(!f.destroy_mig_instance(card, a.gi, &a.uuid).unwrap());
    f.create_mig_instance(card, 5, at(0, 4)).unwrap_err();
    assert!(f.destroy_mig_instance(card, b.gi, &b.uuid).unwrap());
    f.create_mig_instance(card, 0, at(0, 8)).unwrap();
}
