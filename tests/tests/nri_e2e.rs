//! The NRI plugin on real containerd (1.7 and 2.x): every container gets exactly what its
//! signed allocation says, and nothing without one.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use tessera_cdi_generator::spec::{self, SpecOptions};
use tessera_cdi_generator::writer::{SPEC_FILE, write_spec};
use tessera_core::handoff::{AllocatedDevice, Allocation, ContainerAllocation, SigningKeys};
use tessera_core::inventory::NodeInventory;
use tessera_core::names::{ANNOTATION_ALLOCATION, ANNOTATION_ALLOCATION_SIGNATURE};
use tessera_core::request::ContainerRole;
use tessera_nri_plugin::plugin::{PluginConfig, TesseraPlugin};
use tessera_nri_plugin::session::{self, Identity};
use tessera_tests::containerd::{ContainerSpec, Containerd, Pod, Version};
use tessera_tests::fake_node::fake_node;

const NODE: &str = "node-a";

struct Env {
    c: Containerd,
    keys: SigningKeys,
    root: tempfile::TempDir,
    h100: NodeInventory,
    a100: NodeInventory,
}

impl Env {
    async fn new(version: Version) -> anyhow::Result<Self> {
        let c = Containerd::start(version).await?;
        let root = tempfile::tempdir()?;
        let (h100, a100) = (fake_node("h100x8", root.path())?, fake_node("a100-mig", root.path())?);
        let keys = SigningKeys::new("k1", [("k1".to_string(), vec![42u8; 32])])?;
        let env = Self {
            c,
            keys,
            root,
            h100,
            a100,
        };
        env.use_spec(&env.h100)?;
        Ok(env)
    }

    fn use_spec(&self, inv: &NodeInventory) -> anyhow::Result<()> {
        self.use_spec_with(inv, None)
    }

    /// The spec for `inv`, with the driver as one bundle when given.
    fn use_spec_with(&self, inv: &NodeInventory, bundle: Option<std::path::PathBuf>) -> anyhow::Result<()> {
        let (_, text) = spec::render(
            inv,
            &SpecOptions {
                dev_root: self.root.path().join("host"),
                driver_bundle: bundle,
                ..Default::default()
            },
        )?;
        write_spec(&self.c.cdi_dir(), SPEC_FILE, &text)?;
        Ok(())
    }

    fn plugin(&self) -> Arc<TesseraPlugin> {
        Arc::new(TesseraPlugin::new(PluginConfig {
            node: NODE.into(),
            keys: self.keys.verifying(),
            cdi_dirs: vec![self.c.cdi_dir()],
            enforcement: tessera_core::enforcement::ShareEnforcement::None,
            mps: Default::default(),
            hook: Default::default(),
            claims: Default::default(),
        }))
    }

    async fn pod(
        &mut self,
        name: &str,
        node: &str,
        containers: Vec<(&str, Vec<AllocatedDevice>)>,
        core_limit: Option<u32>,
    ) -> anyhow::Result<Pod> {
        let uid = format!("uid-{name}");
        let mut a = Allocation::new(node, &uid);
        a.core_limit = core_limit;
        for (c, devices) in containers {
            a.containers.push(ContainerAllocation {
                name: c.into(),
                role: ContainerRole::App,
                devices,
            });
        }
        let s = self.keys.sign(&a);
        self.c
            .run_pod_with_uid(
                name,
                &uid,
                &[
                    (ANNOTATION_ALLOCATION, &s.allocation),
                    (ANNOTATION_ALLOCATION_SIGNATURE, &s.signature),
                ],
            )
            .await
    }
}

fn whole(inv: &NodeInventory, i: usize) -> AllocatedDevice {
    AllocatedDevice::whole(&inv.gpus[i])
}

fn share(inv: &NodeInventory, i: usize, core: u32, mem: u64) -> AllocatedDevice {
    AllocatedDevice::share(&inv.gpus[i], core, mem)
}

fn nodes(spec: &oci_spec::runtime::Spec) -> BTreeSet<String> {
    spec.linux()
        .as_ref()
        .and_then(|l| l.devices().clone())
        .unwrap_or_default()
        .iter()
        .map(|d| d.path().display().to_string())
        .filter(|p| {
            p.strip_prefix("/dev/nvidia")
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        })
        .collect()
}

fn env_of(spec: &oci_spec::runtime::Spec) -> Vec<String> {
    spec.process()
        .as_ref()
        .and_then(|p| p.env().clone())
        .unwrap_or_default()
}

fn has_env(spec: &oci_spec::runtime::Spec, kv: &str) -> bool {
    env_of(spec).iter().any(|e| e == kv)
}

async fn wait_sync(rx: &mut tokio::sync::watch::Receiver<u64>, above: u64) -> anyhow::Result<()> {
    tokio::time::timeout(Duration::from_secs(15), rx.wait_for(|n| *n > above)).await??;
    Ok(())
}

async fn run_checked(c: &mut Containerd, id: &str) -> anyhow::Result<()> {
    let (code, logs) = c.run_to_exit(id).await?;
    anyhow::ensure!(code == 0, "container {id} exited {code}: {logs}");
    Ok(())
}

/// Runs a container whose command prints its environment, and checks what it really saw: no
/// GPU through any stack's variable (not merely that a removal was asked for).
async fn assert_gpu_env_neutralised(c: &mut Containerd, id: &str) -> anyhow::Result<()> {
    let (code, out) = c.run_to_exit(id).await?;
    anyhow::ensure!(code == 0, "container {id} exited {code}: {out}");
    let env: BTreeMap<&str, &str> = out.lines().filter_map(|l| l.split_once('=')).collect();
    assert_eq!(env.get("NVIDIA_VISIBLE_DEVICES"), Some(&"void"), "{out}");
    // Set and empty: CUDA sees no device ("" hides them all; unset would show all).
    assert_eq!(env.get("CUDA_VISIBLE_DEVICES"), Some(&""), "{out}");
    Ok(())
}

async fn nri(version: Version) -> anyhow::Result<()> {
    let mut e = Env::new(version).await?;
    let plugin = e.plugin();
    let mut synced = plugin.synchronized();
    let socket = e.c.nri_socket();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let id = Identity {
        name: "tessera".into(),
        idx: "10".into(),
    };
    let task = tokio::spawn(session::run_external(
        socket.clone(),
        id.clone(),
        plugin.clone(),
        async move {
            let _ = stop_rx.await;
        },
    ));
    wait_sync(&mut synced, 0).await?;

    let h = e.h100.clone();
    // Whole card.
    let pod = e.pod("whole", NODE, vec![("main", vec![whole(&h, 3)])], None).await?;
    let cid =
        e.c.create_container(
            &pod,
            ContainerSpec::new(
                "main",
                &[
                    "sh",
                    "-c",
                    "test -c /dev/nvidia3 && test ! -e /dev/nvidia0 && test -f /usr/local/nvidia/lib64/libcuda.so.1",
                ],
            )
            .annotation("tessera.io/allocated.gpu-core", "100"),
        )
        .await?;
    let s = e.c.oci_spec(&cid).await?;
    assert_eq!(nodes(&s), BTreeSet::from(["/dev/nvidia3".to_string()]));
    assert!(
        has_env(&s, &format!("CUDA_VISIBLE_DEVICES={}", h.gpus[3].uuid)) && has_env(&s, "NVIDIA_VISIBLE_DEVICES=void")
    );
    assert!(
        !env_of(&s).iter().any(|v| v.starts_with("TESSERA_GPU_CORE_LIMIT")),
        "whole cards get no limits"
    );
    assert_eq!(
        s.annotations()
            .as_ref()
            .and_then(|a| a.get("tessera.io/injected"))
            .map(String::as_str),
        Some(h.gpus[3].uuid.as_str())
    );
    run_checked(&mut e.c, &cid).await?;

    // Two whole cards.
    let pod = e
        .pod("two", NODE, vec![("main", vec![whole(&h, 4), whole(&h, 5)])], None)
        .await?;
    let cid =
        e.c.create_container(
            &pod,
            ContainerSpec::new("main", &["sh", "-c", "test -c /dev/nvidia4 && test -c /dev/nvidia5"])
                .annotation("tessera.io/allocated.gpu-core", "200"),
        )
        .await?;
    assert_eq!(
        nodes(&e.c.oci_spec(&cid).await?),
        BTreeSet::from(["/dev/nvidia4".to_string(), "/dev/nvidia5".to_string()])
    );
    run_checked(&mut e.c, &cid).await?;

    // A share with limits.
    let pod = e
        .pod("share", NODE, vec![("main", vec![share(&h, 0, 30, 8192)])], Some(50))
        .await?;
    let cid = e.c.create_container(
        &pod,
        ContainerSpec::new("main", &["sh", "-c", "test -c /dev/nvidia0 && test \"$TESSERA_GPU_CORE_LIMIT\" = 50 && test \"$TESSERA_GPU_MEMORY_LIMIT_MIB\" = 8192"])
            .annotation("tessera.io/allocated.gpu-core", "30")
            .annotation("tessera.io/allocated.gpu-memory", "8")
            .annotation("tessera.io/allocated.gpu-memory-mib", "8192"),
    ).await?;
    let s = e.c.oci_spec(&cid).await?;
    assert_eq!(nodes(&s), BTreeSet::from(["/dev/nvidia0".to_string()]));
    assert!(has_env(&s, "TESSERA_GPU_CORE_LIMIT=50") && has_env(&s, "TESSERA_GPU_MEMORY_LIMIT_MIB=8192"));
    run_checked(&mut e.c, &cid).await?;

    // Two containers, each on its own card; a third container in the pod gets nothing.
    let pod = e
        .pod(
            "pair",
            NODE,
            vec![("a", vec![whole(&h, 1)]), ("b", vec![whole(&h, 2)])],
            None,
        )
        .await?;
    let a =
        e.c.create_container(
            &pod,
            ContainerSpec::new("a", &["sh", "-c", "test -c /dev/nvidia1 && test ! -e /dev/nvidia2"])
                .annotation("tessera.io/allocated.gpu-core", "100"),
        )
        .await?;
    let b =
        e.c.create_container(
            &pod,
            ContainerSpec::new("b", &["sh", "-c", "test -c /dev/nvidia2 && test ! -e /dev/nvidia1"])
                .annotation("tessera.io/allocated.gpu-core", "100"),
        )
        .await?;
    // The third container asks for nothing and carries the env other GPU stacks read.
    let side =
        e.c.create_container(
            &pod,
            ContainerSpec::new("side", &["env"])
                .env("NVIDIA_VISIBLE_DEVICES", "all")
                .env("CUDA_VISIBLE_DEVICES", "0"),
        )
        .await?;
    assert_eq!(
        nodes(&e.c.oci_spec(&a).await?),
        BTreeSet::from(["/dev/nvidia1".to_string()])
    );
    assert_eq!(
        nodes(&e.c.oci_spec(&b).await?),
        BTreeSet::from(["/dev/nvidia2".to_string()])
    );
    assert!(nodes(&e.c.oci_spec(&side).await?).is_empty());
    for id in [a, b] {
        run_checked(&mut e.c, &id).await?;
    }
    assert_gpu_env_neutralised(&mut e.c, &side).await?;

    // A pod with no allocation at all, asking for nothing: no GPU, GPU env neutralised.
    let plain = e.c.run_pod("plain", &[]).await?;
    let cid =
        e.c.create_container(
            &plain,
            ContainerSpec::new("main", &["sh", "-c", "test ! -e /dev/nvidiactl && env"])
                .env("NVIDIA_VISIBLE_DEVICES", "all")
                .env("CUDA_VISIBLE_DEVICES", "0,1")
                .env("NVIDIA_DRIVER_CAPABILITIES", "all"),
        )
        .await?;
    assert!(nodes(&e.c.oci_spec(&cid).await?).is_empty());
    assert_gpu_env_neutralised(&mut e.c, &cid).await?;

    // Forged, other node, and asked-but-unallocated containers fail to create, saying why.
    let pod = e
        .pod("forged", NODE, vec![("main", vec![share(&h, 6, 10, 1024)])], None)
        .await?;
    let mut forged_cfg = pod.config.clone();
    let v = forged_cfg.annotations.get_mut(ANNOTATION_ALLOCATION).unwrap();
    *v = v.replace("\"core_percent\":10", "\"core_percent\":100");
    let forged =
        e.c.run_pod_with_uid(
            "forged2",
            "uid-forged",
            &forged_cfg
                .annotations
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect::<Vec<_>>(),
        )
        .await?;
    let err =
        e.c.create_container(
            &forged,
            ContainerSpec::new("main", &["true"]).annotation("tessera.io/allocated.gpu-core", "100"),
        )
        .await
        .unwrap_err();
    assert!(format!("{err:#}").contains("forged"), "{err:#}");
    let other = e
        .pod("other", "node-b", vec![("main", vec![whole(&h, 7)])], None)
        .await?;
    let err =
        e.c.create_container(
            &other,
            ContainerSpec::new("main", &["true"]).annotation("tessera.io/allocated.gpu-core", "100"),
        )
        .await
        .unwrap_err();
    assert!(format!("{err:#}").contains("node-b"), "{err:#}");
    let err =
        e.c.create_container(
            &plain,
            ContainerSpec::new("sneaky", &["true"]).annotation("tessera.io/allocated.gpu-core", "100"),
        )
        .await
        .unwrap_err();
    assert!(format!("{err:#}").contains("no tessera.io/allocation"), "{err:#}");

    // MIG: switch the node's spec to the A100 fixture.
    e.use_spec(&e.a100.clone())?;
    let a100 = e.a100.clone();
    let m = &a100.gpus[1].mig_devices[2];
    let mig = AllocatedDevice::Mig {
        uuid: m.uuid.clone(),
        profile: m.profile.clone(),
        parent_uuid: a100.gpus[1].uuid.clone(),
        parent_index: 1,
        gi: m.gi,
        ci: m.ci,
    };
    let mig_device = mig.clone();
    let pod = e.pod("mig", NODE, vec![("main", vec![mig])], None).await?;
    let cid =
        e.c.create_container(
            &pod,
            ContainerSpec::new("main", &["sh", "-c", "test -c /dev/nvidia1 && test ! -e /dev/nvidia0"])
                .annotation("tessera.io/allocated.mig-1g.5gb", "1"),
        )
        .await?;
    let s = e.c.oci_spec(&cid).await?;
    assert_eq!(nodes(&s), BTreeSet::from(["/dev/nvidia1".to_string()]));
    let caps: BTreeSet<String> = s
        .linux()
        .as_ref()
        .and_then(|l| l.devices().clone())
        .unwrap_or_default()
        .iter()
        .map(|d| d.path().display().to_string())
        .filter(|p| p.starts_with("/dev/nvidia-caps/"))
        .collect();
    assert_eq!(
        caps,
        BTreeSet::from([
            m.gi_access.path.display().to_string(),
            m.ci_access.path.display().to_string()
        ])
    );
    assert!(has_env(&s, &format!("CUDA_VISIBLE_DEVICES={}", m.uuid)));
    run_checked(&mut e.c, &cid).await?;
    assert!(plugin.injected().contains_key(&cid));
    // The node's metrics know whose container it is and what it holds.
    let t = &plugin.tracked()[&cid];
    assert_eq!((t.container.as_str(), &t.devices), ("main", &vec![mig_device]), "{t:?}");
    assert!(!t.pod.is_empty() && !t.namespace.is_empty(), "{t:?}");
    // It exited: the runtime says so (StopContainer), and the metrics stop counting it.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !plugin.tracked()[&cid].stopped {
        anyhow::ensure!(std::time::Instant::now() < deadline, "never told the container stopped");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Runtime restart: the plugin reconnects (a new Synchronize) and the next container is
    // still injected.
    let before = *synced.borrow();
    e.c.stop_daemon();
    e.c.start_daemon().await?;
    wait_sync(&mut synced, before).await?;
    let pod = e
        .pod("after-restart", NODE, vec![("main", vec![whole(&a100, 3)])], None)
        .await?;
    let cid =
        e.c.create_container(
            &pod,
            ContainerSpec::new("main", &["sh", "-c", "test -c /dev/nvidia3"])
                .annotation("tessera.io/allocated.gpu-core", "100"),
        )
        .await?;
    assert_eq!(
        nodes(&e.c.oci_spec(&cid).await?),
        BTreeSet::from(["/dev/nvidia3".to_string()])
    );
    run_checked(&mut e.c, &cid).await?;

    // A fresh plugin (as after a plugin restart) learns running containers from Synchronize.
    let pod = e
        .pod("running", NODE, vec![("main", vec![whole(&a100, 3)])], None)
        .await?;
    let cid =
        e.c.create_container(
            &pod,
            ContainerSpec::new("main", &["sleep", "600"]).annotation("tessera.io/allocated.gpu-core", "100"),
        )
        .await?;
    e.c.cri()?
        .start_container(tessera_proto::cri::StartContainerRequest {
            container_id: cid.clone(),
        })
        .await?;
    let _ = stop_tx.send(());
    task.await?;
    let fresh = e.plugin();
    let mut fresh_synced = fresh.synchronized();
    let (stop2, stop2_rx) = tokio::sync::oneshot::channel::<()>();
    let task2 = tokio::spawn(session::run_external(socket.clone(), id, fresh.clone(), async move {
        let _ = stop2_rx.await;
    }));
    wait_sync(&mut fresh_synced, 0).await?;
    let known = fresh.injected();
    assert_eq!(
        known.get(&cid).map(String::as_str),
        Some(a100.gpus[3].uuid.as_str()),
        "{known:?}"
    );
    // Rebuilt from Synchronize: the pod's names and the allocation's devices.
    let t = &fresh.tracked()[&cid];
    assert!(
        !t.pod.is_empty() && t.devices.iter().any(|d| d.card_uuid() == a100.gpus[3].uuid),
        "{t:?}"
    );
    let _ = stop2.send(());
    task2.await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nri_plugin_on_containerd_1_7() -> anyhow::Result<()> {
    nri(Version::V1_7).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nri_plugin_on_containerd_2() -> anyhow::Result<()> {
    nri(Version::V2).await
}

/// The driver as one bundle: a single mount at /usr/local/nvidia (firmware apart) instead of
/// one per file; the container finds libcuda and the driver's programs, and keeps its own
/// LD_LIBRARY_PATH.
async fn bundle(version: Version) -> anyhow::Result<()> {
    let mut e = Env::new(version).await?;
    let h = e.h100.clone();
    let dir = tessera_cdi_generator::bundle::prepare(&h, std::path::Path::new("/"), &e.root.path().join("bundles"))?;
    e.use_spec_with(&h, Some(dir.clone()))?;
    let plugin = e.plugin();
    let mut synced = plugin.synchronized();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(session::run_external(
        e.c.nri_socket(),
        Identity {
            name: "tessera".into(),
            idx: "10".into(),
        },
        plugin,
        async move {
            let _ = stop_rx.await;
        },
    ));
    wait_sync(&mut synced, 0).await?;
    let pod = e.pod("bundle", NODE, vec![("main", vec![whole(&h, 2)])], None).await?;
    let cid =
        e.c.create_container(
            &pod,
            ContainerSpec::new(
                "main",
                &[
                    "sh",
                    "-c",
                    "test -f /usr/local/nvidia/lib64/libcuda.so.1 && test -f /usr/local/nvidia/bin/nvidia-smi && env",
                ],
            )
            .annotation("tessera.io/allocated.gpu-core", "100")
            .env("LD_LIBRARY_PATH", "/opt/app/lib"),
        )
        .await?;
    let s = e.c.oci_spec(&cid).await?;
    let driver_mounts: BTreeSet<String> = s
        .mounts()
        .iter()
        .flatten()
        .filter(|m| m.source().as_ref().is_some_and(|p| p.starts_with(e.root.path())))
        .map(|m| m.destination().display().to_string())
        .collect();
    assert_eq!(
        driver_mounts,
        BTreeSet::from(
            [
                "/lib/firmware/nvidia/550.54.15/gsp_ga10x.bin",
                "/lib/firmware/nvidia/550.54.15/gsp_tu10x.bin",
                "/usr/local/nvidia"
            ]
            .map(String::from)
        ),
        "one mount for the driver, firmware apart"
    );
    let (code, out) = e.c.run_to_exit(&cid).await?;
    assert_eq!(code, 0, "{out}");
    let env: BTreeMap<&str, &str> = out.lines().filter_map(|l| l.split_once('=')).collect();
    assert_eq!(
        env.get("LD_LIBRARY_PATH"),
        Some(&"/usr/local/nvidia/lib64:/opt/app/lib"),
        "{out}"
    );
    assert_eq!(env.get("PATH"), Some(&"/bin:/usr/bin:/usr/local/nvidia/bin"), "{out}");
    let _ = stop_tx.send(());
    task.await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn driver_bundle_on_containerd_1_7() -> anyhow::Result<()> {
    bundle(Version::V1_7).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn driver_bundle_on_containerd_2() -> anyhow::Result<()> {
    bundle(Version::V2).await
}
