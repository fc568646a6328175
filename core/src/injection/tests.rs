use super::*;
use crate::handoff::{ContainerAllocation, SigningKeys};
use crate::request::ContainerRole;

fn keys() -> SigningKeys {
    SigningKeys::new("k", [("k".to_string(), vec![9u8; 32])]).unwrap()
}

fn share(uuid: &str, core: u32, mem: u64) -> AllocatedDevice {
    AllocatedDevice::Gpu {
        uuid: uuid.into(),
        index: 0,
        minor: 0,
        core_percent: core,
        memory_mib: mem,
        exclusive: false,
    }
}

fn whole(uuid: &str) -> AllocatedDevice {
    AllocatedDevice::Gpu {
        uuid: uuid.into(),
        index: 1,
        minor: 1,
        core_percent: 100,
        memory_mib: 81559,
        exclusive: true,
    }
}

fn pod(devices: Vec<(&str, Vec<AllocatedDevice>)>, limit: Option<u32>) -> BTreeMap<String, String> {
    let mut a = Allocation::new("node-a", "uid-1");
    a.core_limit = limit;
    for (name, d) in devices {
        a.containers.push(ContainerAllocation {
            name: name.into(),
            role: ContainerRole::App,
            devices: d,
        });
    }
    let s = keys().sign(&a);
    BTreeMap::from([
        (ANNOTATION_ALLOCATION.into(), s.allocation),
        (ANNOTATION_ALLOCATION_SIGNATURE.into(), s.signature),
    ])
}

fn asked(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (format!("{ALLOCATED_PREFIX}{k}"), v.to_string()))
        .collect()
}

fn ready(_: &str) -> Result<(), String> {
    Ok(())
}

fn ctx(k: &VerifyingKeys, mps: bool) -> NodeContext<'_> {
    NodeContext {
        node: "node-a",
        keys: k,
        enforcement: if mps {
            ShareEnforcement::Mps
        } else {
            ShareEnforcement::None
        },
        share_ready: &ready,
    }
}

#[test]
fn shares_get_limits_and_whole_cards_do_not() {
    let k = keys();
    let v = k.verifying();
    let p = pod(
        vec![
            ("s", vec![share("GPU-1", 30, 8192)]),
            ("w", vec![whole("GPU-2"), whole("GPU-3")]),
        ],
        Some(50),
    );
    let Injection::Grant(g) = decide(
        &ctx(&v, true),
        "uid-1",
        &p,
        "s",
        &asked(&[("gpu-core", "30"), ("gpu-memory", "8"), ("gpu-memory-mib", "8192")]),
    )
    .unwrap() else {
        panic!()
    };
    assert_eq!(g.cdi_devices, vec!["tessera.io/gpu=share-GPU-1"]);
    assert_eq!(g.env["TESSERA_GPU_CORE_LIMIT"], "50");
    assert_eq!(g.env["TESSERA_GPU_MEMORY_LIMIT_MIB"], "8192");
    assert_eq!(g.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "50");
    assert_eq!(g.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "GPU-1=8192M");
    assert_eq!(g.env["CUDA_VISIBLE_DEVICES"], "GPU-1");
    assert_eq!(g.env["NVIDIA_VISIBLE_DEVICES"], "void");
    assert_eq!(g.enforced_by, Some(ShareEnforcement::Mps));
    let Injection::Grant(g) = decide(&ctx(&v, false), "uid-1", &p, "w", &asked(&[("gpu-core", "200")])).unwrap() else {
        panic!()
    };
    assert_eq!(g.cdi_devices, vec!["tessera.io/gpu=GPU-2", "tessera.io/gpu=GPU-3"]);
    assert!(!g.env.contains_key("TESSERA_GPU_CORE_LIMIT"));
    assert_eq!(g.env["CUDA_VISIBLE_DEVICES"], "GPU-2,GPU-3");
    assert_eq!(g.enforced_by, None, "whole cards never go through MPS");
}

#[test]
fn mps_nodes_refuse_a_share_whose_daemon_is_down_and_unenforced_nodes_say_so() {
    let k = keys();
    let v = k.verifying();
    let p = pod(
        vec![("s", vec![share("GPU-1", 30, 8192)]), ("w", vec![whole("GPU-2")])],
        None,
    );
    let a = asked(&[("gpu-core", "30"), ("gpu-memory", "8"), ("gpu-memory-mib", "8192")]);
    let down = |uuid: &str| Err(format!("the MPS daemon of {uuid} is restarting"));
    let c = NodeContext {
        share_ready: &down,
        ..ctx(&v, true)
    };
    let e = decide(&c, "uid-1", &p, "s", &a).unwrap_err();
    assert_eq!(
        e.to_string(),
        "container \"s\": its share of GPU-1 cannot be enforced: the MPS daemon of GPU-1 is restarting; refusing the share"
    );
    // A whole card on the same node does not need the daemon.
    assert!(decide(&c, "uid-1", &p, "w", &asked(&[("gpu-core", "100")])).is_ok());
    // A node configured to run shares unenforced: granted, marked, no MPS variables.
    let Injection::Grant(g) = decide(&ctx(&v, false), "uid-1", &p, "s", &a).unwrap() else {
        panic!()
    };
    assert_eq!(g.enforced_by, Some(ShareEnforcement::None));
    assert!(!g.env.contains_key("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"));
    assert_eq!(g.env["TESSERA_GPU_MEMORY_LIMIT_MIB"], "8192");
}

#[test]
fn deny_by_default_and_refusals() {
    let k = keys();
    let v = k.verifying();
    let p = pod(vec![("s", vec![share("GPU-1", 30, 8192)])], None);
    // A container that asked for nothing gets nothing, with or without an allocation.
    assert_eq!(
        decide(&ctx(&v, false), "uid-1", &p, "sidecar", &BTreeMap::new()).unwrap(),
        Injection::Deny
    );
    assert_eq!(
        decide(&ctx(&v, false), "uid-1", &BTreeMap::new(), "x", &BTreeMap::new()).unwrap(),
        Injection::Deny
    );
    let a = asked(&[("gpu-core", "30")]);
    // Asked, but the allocation is missing / for another pod / node / forged.
    let e = decide(&ctx(&v, false), "uid-1", &BTreeMap::new(), "s", &a).unwrap_err();
    assert!(
        matches!(
            e,
            InjectionError::Handoff {
                source: HandoffError::Missing,
                ..
            }
        ),
        "{e}"
    );
    let e = decide(&ctx(&v, false), "uid-2", &p, "s", &a).unwrap_err();
    assert!(
        matches!(
            e,
            InjectionError::Handoff {
                source: HandoffError::WrongPod { .. },
                ..
            }
        ),
        "{e}"
    );
    let other_node = NodeContext {
        node: "node-b",
        ..ctx(&v, false)
    };
    assert!(matches!(
        decide(&other_node, "uid-1", &p, "s", &a),
        Err(InjectionError::Handoff {
            source: HandoffError::WrongNode { .. },
            ..
        })
    ));
    let mut forged = p.clone();
    forged.insert(
        ANNOTATION_ALLOCATION.into(),
        p[ANNOTATION_ALLOCATION].replace("\"core_percent\":30", "\"core_percent\":90"),
    );
    let e = decide(&ctx(&v, false), "uid-1", &forged, "s", &a).unwrap_err();
    assert!(e.to_string().contains("forged"), "{e}");
    // Asked, but not in the allocation; in the allocation, but not asked.
    assert!(matches!(
        decide(&ctx(&v, false), "uid-1", &p, "other", &a),
        Err(InjectionError::NotAllocated { .. })
    ));
    // Amounts differ.
    let e = decide(&ctx(&v, false), "uid-1", &p, "s", &asked(&[("gpu-core", "40")])).unwrap_err();
    assert_eq!(
        e.to_string(),
        "container \"s\": the kubelet allocated tessera.io/gpu-core=40 but the allocation gives 30"
    );
    let e = decide(
        &ctx(&v, false),
        "uid-1",
        &p,
        "s",
        &asked(&[("gpu-core", "30"), ("gpu-memory-mib", "4096")]),
    )
    .unwrap_err();
    assert!(e.to_string().contains("4096 MiB"), "{e}");
}

#[test]
fn mig_counts_per_profile() {
    let k = keys();
    let v = k.verifying();
    let mig = |u: &str| AllocatedDevice::Mig {
        uuid: u.into(),
        profile: "1g.5gb".parse().unwrap(),
        parent_uuid: "GPU-p".into(),
        parent_index: 0,
        gi: 1,
        ci: 0,
    };
    let p = pod(vec![("m", vec![mig("MIG-1"), mig("MIG-2")])], None);
    let a = asked(&[("mig-1g.5gb", "2"), ("mig-1g.5gb.ids", "MIG-9,MIG-8")]);
    let Injection::Grant(g) = decide(&ctx(&v, false), "uid-1", &p, "m", &a).unwrap() else {
        panic!()
    };
    assert_eq!(g.cdi_devices, vec!["tessera.io/gpu=MIG-1", "tessera.io/gpu=MIG-2"]);
    assert_eq!(g.env["CUDA_VISIBLE_DEVICES"], "MIG-1,MIG-2");
    assert!(decide(&ctx(&v, false), "uid-1", &p, "m", &asked(&[("mig-1g.5gb", "1")])).is_err());
    assert!(decide(&ctx(&v, false), "uid-1", &p, "m", &asked(&[("mig-2g.10gb", "2")])).is_err());
}

#[test]
fn the_image_keeps_its_library_path_and_gets_the_driver_programs() {
    let cdi = [
        "NVIDIA_VISIBLE_DEVICES=void".to_string(),
        "LD_LIBRARY_PATH=/usr/local/nvidia/lib64".into(),
    ];
    let grant = BTreeMap::from([("CUDA_VISIBLE_DEVICES".to_string(), "GPU-1".to_string())]);
    let image = [
        "PATH=/opt/conda/bin:/usr/bin".to_string(),
        "LD_LIBRARY_PATH=/opt/conda/lib:/usr/local/nvidia/lib64".into(),
    ];
    let env = final_env(&image, &cdi, &grant, Some("/usr/local/nvidia/bin"));
    assert_eq!(env["LD_LIBRARY_PATH"], "/usr/local/nvidia/lib64:/opt/conda/lib");
    assert_eq!(env["PATH"], "/opt/conda/bin:/usr/bin:/usr/local/nvidia/bin");
    assert_eq!(env["CUDA_VISIBLE_DEVICES"], "GPU-1");
    // No PATH in the image: the runtime's default, plus the driver's programs.
    let env = final_env(&[], &cdi, &grant, Some("/usr/local/nvidia/bin"));
    assert_eq!(env["PATH"], format!("{DEFAULT_PATH}:/usr/local/nvidia/bin"));
    assert_eq!(env["LD_LIBRARY_PATH"], "/usr/local/nvidia/lib64");
    // Per-file driver mounts (programs in /usr/bin): PATH is left alone.
    assert!(!final_env(&image, &cdi, &grant, None).contains_key("PATH"));
}
