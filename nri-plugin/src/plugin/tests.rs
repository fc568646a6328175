use super::*;
use tessera_core::enforcement::MpsCeiling;
use tessera_core::handoff::AllocatedDevice;

#[test]
fn a_key_added_to_the_secret_is_picked_up_without_a_restart() {
    use tessera_cdi_generator::spec::{self, SpecOptions};
    use tessera_core::handoff::{AllocatedDevice, Allocation, ContainerAllocation};
    use tessera_core::inventory::{FixtureSource, InventorySource};
    use tessera_core::names::{ANNOTATION_ALLOCATION, ANNOTATION_ALLOCATION_SIGNATURE};

    let dir = tempfile::tempdir().unwrap();
    let (keys_dir, cdi_dir) = (dir.path().join("keys"), dir.path().join("cdi"));
    std::fs::create_dir_all(&keys_dir).unwrap();
    std::fs::create_dir_all(&cdi_dir).unwrap();
    std::fs::write(keys_dir.join("active"), "k1").unwrap();
    std::fs::write(keys_dir.join("k1"), [1u8; 32]).unwrap();
    let inv = FixtureSource {
        fixture: "h100x8".into(),
        driver_root: None,
    }
    .discover()
    .unwrap();
    let (_, text) = spec::render(&inv, &SpecOptions::default()).unwrap();
    std::fs::write(cdi_dir.join("tessera.io-gpu.json"), text).unwrap();
    let plugin = TesseraPlugin::new(PluginConfig {
        node: "n".into(),
        keys: VerifyingKeys::from_dir(&keys_dir).unwrap(),
        cdi_dirs: vec![cdi_dir],
        enforcement: ShareEnforcement::None,
        mps: MpsLayout::default(),
        hook: HookLayout::default(),
        claims: Default::default(),
    })
    .reloading_keys_from(keys_dir.clone());

    // The extender starts signing with k2 (rotation step 2).
    let k2 =
        tessera_core::handoff::SigningKeys::new("k2", [("k1".into(), vec![1u8; 32]), ("k2".into(), vec![2u8; 32])])
            .unwrap();
    let g = &inv.gpus[0];
    let mut a = Allocation::new("n", "uid");
    a.containers.push(ContainerAllocation {
        name: "c".into(),
        role: tessera_core::request::ContainerRole::App,
        devices: vec![AllocatedDevice::whole(g)],
    });
    let signed = k2.sign(&a);
    let mut pod = api::PodSandbox::new();
    pod.uid = "uid".into();
    pod.annotations.insert(ANNOTATION_ALLOCATION.into(), signed.allocation);
    pod.annotations
        .insert(ANNOTATION_ALLOCATION_SIGNATURE.into(), signed.signature);
    let mut ctr = api::Container::new();
    ctr.name = "c".into();
    ctr.annotations
        .insert("tessera.io/allocated.gpu-core".into(), "100".into());

    // The node has not seen k2 yet: refused, naming the key.
    let err = plugin.adjust(&pod, &ctr).unwrap_err().to_string();
    assert!(err.contains("unknown key \"k2\""), "{err}");
    // The Secret gains k2 (step 1 reaches the node): the next container verifies.
    std::fs::write(keys_dir.join("k2"), [2u8; 32]).unwrap();
    let adj = plugin.adjust(&pod, &ctr).unwrap();
    assert!(
        adj.linux
            .devices
            .iter()
            .any(|d| d.path == format!("/dev/nvidia{}", g.minor))
    );
}

/// A container created from a DRA claim (the marker the DRA plugin handed the kubelet, in
/// its environment) gets the claim's devices and limits from the node's record, as a
/// signed allocation's; a marker naming a claim the node did not prepare, another
/// namespace's claim, or a claim next to Tessera's extended resources is refused.
#[test]
fn a_dra_claims_container_gets_what_the_node_recorded_and_nothing_else() {
    use tessera_cdi_generator::spec::{self, SpecOptions};
    use tessera_core::dra::{self, ClaimStore};
    use tessera_core::inventory::{FixtureSource, InventorySource};

    let dir = tempfile::tempdir().unwrap();
    let inv = FixtureSource::new("h100x8").discover().unwrap();
    let (_, text) = spec::render(&inv, &SpecOptions::default()).unwrap();
    std::fs::write(dir.path().join("tessera.io-gpu.json"), text).unwrap();
    let store = ClaimStore::new(&dir.path().join("dra"));
    let plugin = TesseraPlugin::new(PluginConfig {
        node: "n".into(),
        keys: tessera_core::handoff::SigningKeys::new("k", [("k".into(), vec![5u8; 32])])
            .unwrap()
            .verifying(),
        cdi_dirs: vec![dir.path().to_path_buf()],
        enforcement: ShareEnforcement::None,
        mps: MpsLayout::default(),
        hook: HookLayout::default(),
        claims: store.clone(),
    });
    let g = &inv.gpus[2];
    let token = dra::new_token();
    record(
        &store,
        ("u-1", "share", &["p"]),
        (
            "gpu-2",
            Some("s".into()),
            AllocatedDevice::Gpu {
                uuid: g.uuid.clone(),
                index: g.index,
                minor: g.minor,
                core_percent: 30,
                memory_mib: 4096,
                exclusive: false,
            },
        ),
        &token,
    );
    let pod = |ns: &str| {
        let mut p = api::PodSandbox::new();
        p.uid = "p".into();
        p.name = "trainer".into();
        p.namespace = ns.into();
        p
    };
    let ctr = |id: &str, uid: &str, token: &str| {
        let mut c = api::Container::new();
        c.id = id.into();
        c.name = "main".into();
        c.env = vec![format!("{}={token}", dra::marker_env(uid, "gpu")), "PATH=/bin".into()];
        c
    };
    let adj = plugin.adjust(&pod("team-a"), &ctr("c1", "u-1", &token)).unwrap();
    let env: BTreeMap<String, String> = adj.env.iter().map(|kv| (kv.key.clone(), kv.value.clone())).collect();
    assert_eq!(env["CUDA_VISIBLE_DEVICES"], g.uuid);
    assert_eq!(
        (
            env["TESSERA_GPU_CORE_LIMIT"].as_str(),
            env["TESSERA_GPU_MEMORY_LIMIT_MIB"].as_str()
        ),
        ("30", "4096")
    );
    assert!(
        adj.linux
            .devices
            .iter()
            .any(|d| d.path == format!("/dev/nvidia{}", g.minor))
    );
    assert_eq!(plugin.tracked()["c1"].uuids, g.uuid);

    let refused = |p: &api::PodSandbox, c: &api::Container| plugin.adjust(p, c).unwrap_err().to_string();
    assert!(
        refused(&pod("team-b"), &ctr("c2", "u-1", &token))
            .contains("claim team-a/share (u-1) is not a claim of namespace team-b")
    );
    assert!(refused(&pod("team-a"), &ctr("c3", "u-9", &token)).contains("claim u-9 is not prepared on this node"));
    // A pod of the namespace that writes the marker itself has no token.
    assert!(refused(&pod("team-a"), &ctr("c5", "u-1", "u-1")).contains("does not carry the claim's token"));
    let mut both = ctr("c4", "u-1", &token);
    both.annotations
        .insert("tessera.io/allocated.gpu-core".into(), "30".into());
    assert!(refused(&pod("team-a"), &both).contains("ask through one or the other"));
    // A second container naming the share claim (a sidecar of the same pod) would be held to
    // the whole share too: refused while the first lives.
    assert!(
        refused(&pod("team-a"), &ctr("c8", "u-1", &token)).contains("a share claim serves one container at a time")
    );

    // A whole card's claim reserved for two pods: both get the card (a shared claim is
    // not a double grant).
    let w = &inv.gpus[3];
    let whole_token = dra::new_token();
    record(
        &store,
        ("u-w", "whole", &["p", "q"]),
        ("gpu-3", None, AllocatedDevice::whole(w)),
        &whole_token,
    );
    let mut other = pod("team-a");
    other.name = "evaluator".into();
    other.uid = "q".into();
    plugin.adjust(&pod("team-a"), &ctr("c6", "u-w", &whole_token)).unwrap();
    plugin.adjust(&other, &ctr("c7", "u-w", &whole_token)).unwrap();
    assert_eq!(plugin.tracked()["c7"].uuids, w.uuid);
}

/// A card a live container of one pod holds whole is granted to no other pod, even on a
/// validly signed record (books gone wrong, a replayed signature): refused, naming the
/// holder; a share is not put on it either; two shares may share a card; once the holder
/// has stopped, the card is granted again.
#[test]
fn a_card_held_whole_is_granted_to_no_other_pod() {
    use tessera_cdi_generator::spec::{self, SpecOptions};
    use tessera_core::handoff::{Allocation, ContainerAllocation, SigningKeys};
    use tessera_core::inventory::{FixtureSource, InventorySource};
    use tessera_core::names::{ANNOTATION_ALLOCATION, ANNOTATION_ALLOCATION_SIGNATURE};

    let dir = tempfile::tempdir().unwrap();
    let inv = FixtureSource::new("h100x8").discover().unwrap();
    let (_, text) = spec::render(&inv, &SpecOptions::default()).unwrap();
    std::fs::write(dir.path().join("tessera.io-gpu.json"), text).unwrap();
    let keys = SigningKeys::new("k", [("k".into(), vec![5u8; 32])]).unwrap();
    let plugin = TesseraPlugin::new(PluginConfig {
        node: "n".into(),
        keys: keys.verifying(),
        cdi_dirs: vec![dir.path().to_path_buf()],
        enforcement: ShareEnforcement::None,
        mps: MpsLayout::default(),
        hook: HookLayout::default(),
        claims: Default::default(),
    });
    let g = &inv.gpus[0];
    let create = |name: &str, device: AllocatedDevice, core: &str| {
        let uid = format!("uid-{name}");
        let mut a = Allocation::new("n", &uid);
        a.containers.push(ContainerAllocation {
            name: "c".into(),
            role: tessera_core::request::ContainerRole::App,
            devices: vec![device],
        });
        let signed = keys.sign(&a);
        let mut pod = api::PodSandbox::new();
        pod.uid = uid;
        pod.name = name.into();
        pod.namespace = format!("team-{name}");
        pod.annotations.insert(ANNOTATION_ALLOCATION.into(), signed.allocation);
        pod.annotations
            .insert(ANNOTATION_ALLOCATION_SIGNATURE.into(), signed.signature);
        let mut ctr = api::Container::new();
        ctr.name = "c".into();
        ctr.id = format!("ctr-{name}");
        ctr.annotations
            .insert("tessera.io/allocated.gpu-core".into(), core.into());
        if core != "100" {
            ctr.annotations
                .insert("tessera.io/allocated.gpu-memory".into(), "4".into());
        }
        plugin.adjust(&pod, &ctr)
    };
    create("first", AllocatedDevice::whole(g), "100").unwrap();
    let err = create("second", AllocatedDevice::whole(g), "100")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&g.uuid) && err.contains("team-first/first") && err.contains("refusing a second grant"),
        "{err}"
    );
    let err = create("third", AllocatedDevice::share(g, 30, 4096), "30")
        .unwrap_err()
        .to_string();
    assert!(err.contains("as a whole card"), "{err}");
    // Shares side by side on another card.
    let other = &inv.gpus[1];
    create("s1", AllocatedDevice::share(other, 30, 4096), "30").unwrap();
    create("s2", AllocatedDevice::share(other, 30, 4096), "30").unwrap();
    // A whole card over live shares: refused too.
    assert!(create("w", AllocatedDevice::whole(other), "100").is_err());
    // The holder stops: its card is free on this node.
    plugin.stopped("ctr-first");
    create("second", AllocatedDevice::whole(g), "100").unwrap();
}

/// A key removed from the mounted Secret stops verifying at the next container, without a
/// restart: the kubelet's atomic update (a new `..data` directory, the link swapped) is
/// noticed, as is a plain directory losing the file.
#[test]
fn a_key_removed_from_the_secret_stops_verifying() {
    use std::os::unix::fs::symlink;
    use tessera_cdi_generator::spec::{self, SpecOptions};
    use tessera_core::handoff::{Allocation, ContainerAllocation, SigningKeys};
    use tessera_core::inventory::{FixtureSource, InventorySource};
    use tessera_core::names::{ANNOTATION_ALLOCATION, ANNOTATION_ALLOCATION_SIGNATURE};

    let inv = FixtureSource::new("h100x8").discover().unwrap();
    let (_, text) = spec::render(&inv, &SpecOptions::default()).unwrap();
    let old = SigningKeys::new("k1", [("k1".into(), vec![1u8; 32])]).unwrap();
    for kubelet_layout in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let (keys_dir, cdi_dir) = (dir.path().join("keys"), dir.path().join("cdi"));
        std::fs::create_dir_all(&keys_dir).unwrap();
        std::fs::create_dir_all(&cdi_dir).unwrap();
        std::fs::write(cdi_dir.join("tessera.io-gpu.json"), &text).unwrap();
        // As the kubelet writes a Secret volume: files in a timestamped directory, `..data`
        // linking to it, and each key a link through `..data`.
        let write = |generation: &str, keys: &[(&str, u8)]| {
            if kubelet_layout {
                let data = keys_dir.join(generation);
                std::fs::create_dir_all(&data).unwrap();
                for (k, b) in keys {
                    std::fs::write(data.join(k), [*b; 32]).unwrap();
                }
                let tmp = keys_dir.join("..data_tmp");
                symlink(generation, &tmp).unwrap();
                std::fs::rename(&tmp, keys_dir.join("..data")).unwrap();
                for e in std::fs::read_dir(&keys_dir).unwrap().flatten() {
                    let name = e.file_name().to_string_lossy().into_owned();
                    if !name.starts_with('.') && !keys.iter().any(|(k, _)| *k == name) {
                        std::fs::remove_file(e.path()).unwrap();
                    }
                }
                for (k, _) in keys {
                    let _ = symlink(format!("..data/{k}"), keys_dir.join(k));
                }
            } else {
                for e in std::fs::read_dir(&keys_dir).unwrap().flatten() {
                    std::fs::remove_file(e.path()).unwrap();
                }
                for (k, b) in keys {
                    std::fs::write(keys_dir.join(k), [*b; 32]).unwrap();
                }
            }
        };
        write("..2026_11_24_01", &[("k1", 1), ("k2", 2)]);
        let plugin = TesseraPlugin::new(PluginConfig {
            node: "n".into(),
            keys: VerifyingKeys::from_dir(&keys_dir).unwrap(),
            cdi_dirs: vec![cdi_dir],
            enforcement: ShareEnforcement::None,
            mps: MpsLayout::default(),
            hook: HookLayout::default(),
            claims: Default::default(),
        })
        .reloading_keys_from(keys_dir.clone());
        let create = |n: usize| {
            let mut a = Allocation::new("n", format!("uid-{n}"));
            a.containers.push(ContainerAllocation {
                name: "c".into(),
                role: tessera_core::request::ContainerRole::App,
                devices: vec![AllocatedDevice::whole(&inv.gpus[n])],
            });
            let signed = old.sign(&a);
            let mut pod = api::PodSandbox::new();
            pod.uid = format!("uid-{n}");
            pod.name = format!("p{n}");
            pod.annotations.insert(ANNOTATION_ALLOCATION.into(), signed.allocation);
            pod.annotations
                .insert(ANNOTATION_ALLOCATION_SIGNATURE.into(), signed.signature);
            let mut ctr = api::Container::new();
            ctr.name = "c".into();
            ctr.id = format!("ctr-{n}");
            ctr.annotations
                .insert("tessera.io/allocated.gpu-core".into(), "100".into());
            plugin.adjust(&pod, &ctr)
        };
        create(0).unwrap();
        // The Secret loses k1 (rotation's last step).
        std::thread::sleep(std::time::Duration::from_millis(20));
        write("..2026_11_24_02", &[("k2", 2)]);
        let err = create(1).unwrap_err().to_string();
        assert!(
            err.contains("unknown key \"k1\""),
            "kubelet layout {kubelet_layout}: {err}"
        );
    }
}

#[test]
fn subscribes_only_to_old_events() {
    assert_eq!(event_mask(), 0x8 | 0x20 | 0x200 | 0x400);
    assert!(event_mask() <= 0x7FF);
}

/// A node for the tests below: a fixture's cards and their CDI spec, the DRA records, the
/// MPS daemons' states (every card's daemon ready, holding whatever ceiling is wanted), the
/// grant records and a /proc of its own.
pub(super) struct Node {
    pub(super) dir: tempfile::TempDir,
    pub(super) inv: tessera_core::inventory::NodeInventory,
    keys: tessera_core::handoff::SigningKeys,
}

impl Node {
    pub(super) fn new() -> Self {
        use tessera_cdi_generator::spec::{self, SpecOptions};
        use tessera_core::inventory::{FixtureSource, InventorySource};
        let dir = tempfile::tempdir().unwrap();
        let inv = FixtureSource::new("h100x8").discover().unwrap();
        let (_, text) = spec::render(&inv, &SpecOptions::default()).unwrap();
        std::fs::create_dir_all(dir.path().join("cdi")).unwrap();
        std::fs::write(dir.path().join("cdi/tessera.io-gpu.json"), text).unwrap();
        let keys = tessera_core::handoff::SigningKeys::new("k", [("k".into(), vec![5u8; 32])]).unwrap();
        Self { dir, inv, keys }
    }

    fn store(&self) -> tessera_core::dra::ClaimStore {
        tessera_core::dra::ClaimStore::new(&self.dir.path().join("dra"))
    }

    fn mps(&self) -> MpsLayout {
        MpsLayout::new(self.dir.path().join("mps"))
    }

    pub(super) fn proc_root(&self) -> PathBuf {
        self.dir.path().join("proc")
    }

    /// The node's hook layout, with the library and its preload file in place.
    pub(super) fn hook_installed(&self) -> HookLayout {
        let hook = HookLayout::new(self.dir.path().join("hook"));
        std::fs::create_dir_all(hook.root.join("lib")).unwrap();
        std::fs::write(hook.library(), b"").unwrap();
        std::fs::write(hook.preload(), b"").unwrap();
        hook
    }

    /// A plugin of this node, as the DaemonSet runs it (grant records kept), started anew.
    pub(super) fn plugin(&self, enforcement: ShareEnforcement) -> TesseraPlugin {
        TesseraPlugin::new(PluginConfig {
            node: "n".into(),
            keys: self.keys.verifying(),
            cdi_dirs: vec![self.dir.path().join("cdi")],
            enforcement,
            mps: self.mps(),
            hook: HookLayout::new(self.dir.path().join("hook")),
            claims: self.store(),
        })
        .recording_grants_in(tessera_core::granted::GrantStore::new(self.dir.path().join("grants")))
        .reading_users_under(self.proc_root())
    }

    /// Every card's MPS daemon ready, holding the ceiling the plugin wants (as the supervisor
    /// does within 100 ms), and the CUDA hook installed (as the CDI generator does).
    pub(super) fn daemons_hold_the_wanted_ceilings(&self) {
        let library = self.dir.path().join("libtessera-cuda-hook.so");
        std::fs::write(&library, b"the hook").unwrap();
        HookLayout::new(self.dir.path().join("hook")).install(&library).unwrap();
        tessera_tests::mps::hold_wanted_ceilings(&self.mps(), self.inv.gpus.iter().map(|g| g.uuid.as_str())).unwrap();
    }

    /// Pod `name` (uid `uid-<name>`) signed `device` for its container `c`, and that container
    /// (id `ctr-<name>`) with `env`.
    pub(super) fn signed(
        &self,
        name: &str,
        device: AllocatedDevice,
        env: &[&str],
    ) -> (api::PodSandbox, api::Container) {
        use tessera_core::handoff::{Allocation, ContainerAllocation};
        use tessera_core::names::{ANNOTATION_ALLOCATION, ANNOTATION_ALLOCATION_SIGNATURE};
        let uid = format!("uid-{name}");
        let mut a = Allocation::new("n", &uid);
        let core = match &device {
            AllocatedDevice::Gpu { core_percent, .. } => *core_percent,
            AllocatedDevice::Mig { .. } => 0,
        };
        let share = matches!(device, AllocatedDevice::Gpu { exclusive: false, .. });
        a.containers.push(tessera_core::handoff::ContainerAllocation {
            name: "c".into(),
            role: tessera_core::request::ContainerRole::App,
            devices: vec![device],
        });
        let _: &ContainerAllocation = &a.containers[0];
        let signed = self.keys.sign(&a);
        let mut pod = api::PodSandbox::new();
        pod.id = format!("sandbox-{name}");
        pod.uid = uid;
        pod.name = name.into();
        pod.namespace = "team-a".into();
        pod.annotations.insert(ANNOTATION_ALLOCATION.into(), signed.allocation);
        pod.annotations
            .insert(ANNOTATION_ALLOCATION_SIGNATURE.into(), signed.signature);
        let mut ctr = api::Container::new();
        ctr.name = "c".into();
        ctr.id = format!("ctr-{name}");
        ctr.pod_sandbox_id = pod.id.clone();
        ctr.annotations
            .insert("tessera.io/allocated.gpu-core".into(), core.to_string());
        if share {
            ctr.annotations
                .insert("tessera.io/allocated.gpu-memory".into(), "4".into());
        }
        ctr.env = env.iter().map(|e| e.to_string()).collect();
        (pod, ctr)
    }
}

/// After the plugin (or the runtime) restarts, each card's MPS ceiling is rebuilt from what the
/// plugin granted, never from the `CUDA_MPS_*` variables a container carries, which its
/// tenant writes: a whole card's container that sets 100% and 80 GiB does not lift the ceiling
/// of the card's shares. Shown with the grant records, and without them (a plugin that kept
/// none: the pods' verified allocations). Fails when the rebuild reads the environment.
#[tokio::test]
async fn a_restarted_plugin_rebuilds_ceilings_from_what_it_granted_not_from_env() {
    let node = Node::new();
    node.daemons_hold_the_wanted_ceilings();
    let (share_card, whole_card) = (&node.inv.gpus[0], &node.inv.gpus[1]);
    let lift = [
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100".to_string(),
        format!("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={}=81920M", share_card.uuid),
    ];
    let lift: Vec<&str> = lift.iter().map(String::as_str).collect();
    let containers = [
        node.signed("share", AllocatedDevice::share(share_card, 30, 4096), &[]),
        node.signed("whole", AllocatedDevice::whole(whole_card), &lift),
    ];
    let first = node.plugin(ShareEnforcement::Mps);
    for (pod, ctr) in &containers {
        first.adjust(pod, ctr).unwrap();
    }
    let held = first.ceiling(&share_card.uuid);
    assert_eq!((held.active_thread_percentage, held.pinned_memory_mib), (30, 4096));
    // The runtime reports the containers as they run: the whole card's with the share's
    // variables its tenant set, the share's with Tessera's (as set at creation).
    let pods: Vec<api::PodSandbox> = containers.iter().map(|(p, _)| p.clone()).collect();
    let mut running: Vec<api::Container> = containers.iter().map(|(_, c)| c.clone()).collect();
    running[0].env.extend(lift.iter().map(|e| e.to_string()));
    for records in [true, false] {
        if !records {
            std::fs::remove_dir_all(node.dir.path().join("grants")).unwrap();
        }
        let restarted = node.plugin(ShareEnforcement::Mps);
        restarted.rebuild(&pods, &running);
        let c = restarted.ceiling(&share_card.uuid);
        assert_eq!(
            (c.active_thread_percentage, c.pinned_memory_mib),
            (30, 4096),
            "records kept: {records}"
        );
        assert_eq!(
            restarted.ceiling(&whole_card.uuid),
            MpsCeiling::CLOSED,
            "records kept: {records}"
        );
        let written = node.mps().read_ceiling(&share_card.uuid).unwrap().unwrap();
        assert_eq!(written.active_thread_percentage, 30);
        assert_eq!(
            restarted.tracked()["ctr-whole"].devices,
            [AllocatedDevice::whole(whole_card)]
        );
    }
}

/// A DRA claim's card stays held while its container lives, also after the claim was
/// unprepared (its pod deleted while the container still stops, or a copied marker) and the
/// plugin restarted: the grant record, not the claim's, says who holds the card. Before, the
/// restarted plugin found no record of the claim and granted the card again.
#[test]
fn a_card_stays_held_by_a_live_container_after_its_claim_and_the_plugin_are_gone() {
    use tessera_core::dra;
    let node = Node::new();
    let card = &node.inv.gpus[4];
    let token = dra::new_token();
    let store = node.store();
    record(
        &store,
        ("u-1", "whole", &["uid-trainer"]),
        ("gpu-4", None, AllocatedDevice::whole(card)),
        &token,
    );
    let mut pod = api::PodSandbox::new();
    (pod.id, pod.uid, pod.name, pod.namespace) = ("s1".into(), "uid-trainer".into(), "trainer".into(), "team-a".into());
    let mut ctr = api::Container::new();
    (ctr.id, ctr.name, ctr.pod_sandbox_id) = ("ctr-1".into(), "main".into(), "s1".into());
    ctr.env = vec![format!("{}={token}", dra::marker_env("u-1", "gpu"))];
    node.plugin(ShareEnforcement::None).adjust(&pod, &ctr).unwrap();
    store.remove("u-1").unwrap();
    let restarted = node.plugin(ShareEnforcement::None);
    restarted.rebuild(std::slice::from_ref(&pod), std::slice::from_ref(&ctr));
    let (other_pod, other) = node.signed("next", AllocatedDevice::whole(card), &[]);
    let err = restarted.adjust(&other_pod, &other).unwrap_err().to_string();
    assert!(err.contains("team-a/trainer") && err.contains(&card.uuid), "{err}");
}

/// Reservations as a test sets them.
#[derive(Default)]
struct FakeReservations {
    /// `namespace/name` -> the pods the claim is reserved for.
    claims: std::collections::HashMap<String, Vec<String>>,
    /// How long the API server takes to answer.
    delay: std::time::Duration,
    /// How many times it was asked.
    asked: std::sync::atomic::AtomicUsize,
}

#[async_trait::async_trait]
impl Reservations for FakeReservations {
    async fn reserved_for(&self, namespace: &str, name: &str) -> Result<(String, Vec<String>), String> {
        self.asked.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tokio::time::sleep(self.delay).await;
        self.claims
            .get(&format!("{namespace}/{name}"))
            .map(|pods| ("u-1".to_string(), pods.clone()))
            .ok_or_else(|| format!("claim {namespace}/{name} not found"))
    }
}

/// A claim's marker is no bearer token: a second pod of the namespace that copies the first's
/// marker (its token included) into its own spec gets nothing, because the claim is not
/// reserved for it; a pod the claim gains later (a shared claim) is looked up on the API
/// server and gets the claim. Fails when the grant does not ask whom the claim is reserved for.
#[tokio::test]
async fn a_copied_marker_gives_nothing_to_a_pod_the_claim_is_not_reserved_for() {
    use tessera_core::dra;
    let node = Node::new();
    let card = &node.inv.gpus[5];
    let token = dra::new_token();
    record(
        &node.store(),
        ("u-1", "whole", &["uid-first"]),
        ("gpu-5", None, AllocatedDevice::whole(card)),
        &token,
    );
    let reserved = std::sync::Arc::new(FakeReservations {
        claims: [("team-a/whole".to_string(), vec!["uid-first".into(), "uid-later".into()])].into(),
        ..Default::default()
    });
    let plugin = node
        .plugin(ShareEnforcement::None)
        .looking_up_reservations(reserved.clone());
    let container = |pod_name: &str| {
        let mut pod = api::PodSandbox::new();
        (pod.uid, pod.name, pod.namespace) = (format!("uid-{pod_name}"), pod_name.into(), "team-a".into());
        let mut ctr = api::Container::new();
        (ctr.id, ctr.name) = (format!("ctr-{pod_name}"), "main".into());
        ctr.env = vec![format!("{}={token}", dra::marker_env("u-1", "gpu"))];
        (pod, ctr)
    };
    let (pod, ctr) = container("first");
    plugin.create(&pod, &ctr).await.unwrap();
    let (pod, ctr) = container("copycat");
    let err = plugin.create(&pod, &ctr).await.unwrap_err().to_string();
    assert!(err.contains("is not reserved for this pod"), "{err}");
    let (pod, ctr) = container("later");
    plugin.create(&pod, &ctr).await.unwrap();
    assert_eq!(plugin.tracked()["ctr-later"].devices, [AllocatedDevice::whole(card)]);
    // A forged token costs no lookup: the API server is asked only about markers the node
    // made (first: listed in the record; copycat and later: asked once each).
    let asked = || reserved.asked.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(asked(), 2);
    let (pod, mut ctr) = container("forger");
    ctr.env = vec![format!("{}=0000", dra::marker_env("u-1", "gpu"))];
    assert!(
        plugin
            .create(&pod, &ctr)
            .await
            .unwrap_err()
            .to_string()
            .contains("does not carry the claim's token")
    );
    assert_eq!(asked(), 2);
    // After a restart, the copycat's container (valid token, no grant record: it was refused)
    // is not booked from its environment: the claim is not reserved for it.
    let (copy_pod, copy) = container("copycat");
    let restarted = node.plugin(ShareEnforcement::None);
    restarted.rebuild(&[copy_pod], &[copy]);
    assert!(restarted.tracked().is_empty(), "{:?}", restarted.tracked());
}

/// A slow API server cannot hold a container's creation past the runtime's patience (which
/// drops a plugin that answers late, and creates containers without it): the lookups of a
/// container's claims (five here, each named with its real token) run together within 300 ms,
/// and a claim not known to be reserved for the pod by then is refused. Before, they ran one
/// after another, 400 ms each.
#[tokio::test]
async fn a_slow_api_server_does_not_hold_a_creation_up() {
    let node = Node::new();
    let mut env = Vec::new();
    let mut claims = std::collections::HashMap::new();
    for i in 0..5 {
        let (uid, name) = (format!("u-{i}"), format!("whole-{i}"));
        let token = tessera_core::dra::new_token();
        record(
            &node.store(),
            (&uid, &name, &["uid-first"]),
            (&format!("gpu-{i}"), None, AllocatedDevice::whole(&node.inv.gpus[i])),
            &token,
        );
        env.push(format!("{}={token}", tessera_core::dra::marker_env(&uid, "gpu")));
        claims.insert(format!("team-a/{name}"), vec!["uid-first".to_string()]);
    }
    let slow = std::sync::Arc::new(FakeReservations {
        claims,
        delay: std::time::Duration::from_secs(10),
        ..Default::default()
    });
    let plugin = node.plugin(ShareEnforcement::None).looking_up_reservations(slow);
    let mut pod = api::PodSandbox::new();
    (pod.uid, pod.name, pod.namespace) = ("uid-later".into(), "later".into(), "team-a".into());
    let mut ctr = api::Container::new();
    (ctr.id, ctr.name, ctr.env) = ("ctr-later".into(), "main".into(), env);
    let began = std::time::Instant::now();
    let err = plugin.create(&pod, &ctr).await.unwrap_err().to_string();
    assert!(
        began.elapsed() < std::time::Duration::from_secs(1),
        "{:?}",
        began.elapsed()
    );
    assert!(err.contains("is not reserved for this pod"), "{err}");
}

/// A grant that cannot be recorded is not made: the record is how a restarted plugin and the
/// DRA plugin know the container holds its card.
#[test]
fn a_grant_that_cannot_be_recorded_is_refused() {
    let node = Node::new();
    std::fs::write(node.dir.path().join("grants"), b"not a directory").unwrap();
    let plugin = node.plugin(ShareEnforcement::None);
    let (pod, ctr) = node.signed("whole", AllocatedDevice::whole(&node.inv.gpus[0]), &[]);
    let err = plugin.adjust(&pod, &ctr).unwrap_err().to_string();
    assert!(err.contains("cannot record its grant"), "{err}");
    assert!(plugin.tracked().is_empty());
}

/// MPS serves one user per card: a share whose process starts as another user than the card's
/// live shares is refused at start, naming the share it would hold up; the same user starts,
/// and once the other user's share has stopped, the card takes the new user. Fails without the
/// check at StartContainer.
#[tokio::test]
async fn a_share_of_another_user_is_refused_at_start() {
    let node = Node::new();
    node.daemons_hold_the_wanted_ceilings();
    let card = &node.inv.gpus[2];
    let plugin = node.plugin(ShareEnforcement::Mps);
    let proc_status = |pid: u32, uid: u32| {
        let dir = node.proc_root().join(pid.to_string());
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("status"),
            format!("Name:\tpython\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n"),
        )
        .unwrap();
    };
    let start = |name: &str, pid: u32, uid: u32| {
        let (pod, mut ctr) = node.signed(name, AllocatedDevice::share(card, 20, 4096), &[]);
        plugin.adjust(&pod, &ctr).unwrap();
        node.daemons_hold_the_wanted_ceilings();
        proc_status(pid, uid);
        ctr.pid = pid;
        plugin.starting(&ctr)
    };
    start("root", 101, 0).unwrap();
    let err = start("app", 102, 1000).unwrap_err().to_string();
    assert!(
        err.contains("uid 1000") && err.contains("uid 0") && err.contains("team-a/root"),
        "{err}"
    );
    start("root-too", 103, 0).unwrap();
    plugin.stopped("ctr-root");
    plugin.stopped("ctr-root-too");
    start("app-again", 104, 1000).unwrap();
    // A whole card's container is no MPS client: its user is not asked.
    let (pod, mut ctr) = node.signed("whole", AllocatedDevice::whole(&node.inv.gpus[3]), &[]);
    plugin.adjust(&pod, &ctr).unwrap();
    ctr.pid = 999_999;
    plugin.starting(&ctr).unwrap();
}

/// In hook mode a share's accounting directory is a small tmpfs of the container's own, not a
/// host directory: what a tenant writes there cannot fill the node's /run (shown through the
/// real runtimes in hook/tests/nri_hook.rs).
#[tokio::test]
async fn a_hooked_share_gets_its_accounting_in_a_tmpfs_of_its_own() {
    let node = Node::new();
    let hook = node.hook_installed();
    let plugin = node.plugin(ShareEnforcement::Hook);
    let (pod, ctr) = node.signed("s", AllocatedDevice::share(&node.inv.gpus[0], 30, 4096), &[]);
    let adj = plugin.adjust(&pod, &ctr).unwrap();
    let state = adj
        .mounts
        .iter()
        .find(|m| m.destination == HOOK_STATE_IN_CONTAINER)
        .expect("the state mount");
    assert_eq!((state.type_.as_str(), state.source.as_str()), ("tmpfs", "tmpfs"));
    assert!(state.options.contains(&"size=256k".to_string()), "{:?}", state.options);
    assert!(!hook.container_dir("ctr-s").join("state").exists());
}

/// Records claim `uid` (`team-a/<name>`, reserved for `pods`) as the DRA plugin prepares it: its
/// request `gpu` served by slice device `device` (share id, what it gives), with marker `token`.
fn record(
    store: &tessera_core::dra::ClaimStore,
    (uid, name, pods): (&str, &str, &[&str]),
    (device, share_id, allocated): (&str, Option<String>, AllocatedDevice),
    token: &str,
) {
    use tessera_core::dra::{PreparedClaim, PreparedDevice};
    store
        .put(&PreparedClaim {
            uid: uid.into(),
            namespace: "team-a".into(),
            name: name.into(),
            pods: pods.iter().map(|p| p.to_string()).collect(),
            token: String::new(),
            markers: [("gpu".to_string(), token.to_string())].into(),
            devices: vec![PreparedDevice {
                requests: vec!["gpu".into()],
                pool: "n".into(),
                device: device.into(),
                share_id,
                allocated,
                carved: None,
            }],
        })
        .unwrap();
}
