//! Hook mode end to end on real containerd (1.7 and 2.x): a share container gets the library,
//! a read-only /etc/ld.so.preload naming it and its own limits; a glibc program in it, using
//! the node's (fake) driver as CUDA programs do, is stopped at the share by the preloaded hook.
//! Whole cards are not hooked; a node without the library installed refuses shares; a removed
//! container's files go.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use tessera_cdi_generator::spec::{self, SpecOptions};
use tessera_cdi_generator::writer::{SPEC_FILE, write_spec};
use tessera_core::enforcement::{
    ANNOTATION_ENFORCED_BY, HOOK_AGENT_IN_CONTAINER, HOOK_LIBRARY_IN_CONTAINER, HOOK_PID_SOCKET,
    HOOK_STATE_IN_CONTAINER, HookLayout, ShareEnforcement,
};
use tessera_core::handoff::{AllocatedDevice, SigningKeys};
use tessera_core::inventory::{FixtureSource, InventorySource, NodeInventory};
use tessera_node::inventory::create_device_nodes;
use tessera_nri_plugin::plugin::{PluginConfig, TesseraPlugin};
use tessera_nri_plugin::session::{self, Identity};
use tessera_tests::containerd::{ContainerSpec, Containerd, Pod, Version};

const NODE: &str = "node-hook";
const IMAGE: &str = "docker.io/tessera/cuda-client:test";

/// A node whose driver files are the fake driver (so the spec mounts it as libcuda.so.1).
fn node(root: &Path) -> anyhow::Result<NodeInventory> {
    let inv = FixtureSource {
        fixture: "t4x2".into(),
        driver_root: Some(root.join("driver")),
    }
    .discover()?;
    let b = common::built();
    for f in &inv.driver_files {
        let p = inv.host_path(f);
        std::fs::create_dir_all(p.parent().unwrap())?;
        match f.stem().as_deref() {
            Some("libcuda") => std::fs::copy(b.lib_dir.join("libcuda.so.1"), &p).map(|_| ())?,
            Some("libnvidia-ml") => std::fs::copy(b.lib_dir.join("libnvidia-ml.so.1"), &p).map(|_| ())?,
            _ => std::fs::write(&p, b"fake")?,
        }
    }
    create_device_nodes(&inv, &root.join("host"))?;
    Ok(inv)
}

/// An image with the client, busybox's shell (to run several clients in one container) and the
/// C library they need (from this machine).
fn image(work: &Path) -> anyhow::Result<std::path::PathBuf> {
    let rootfs = work.join("rootfs");
    std::fs::create_dir_all(rootfs.join("bin"))?;
    std::fs::copy(
        tessera_tests::containerd::Runtimes::get()?.busybox(),
        rootfs.join("bin/busybox"),
    )?;
    for applet in ["sh", "wait", "sleep", "cat"] {
        std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet))?;
    }
    std::fs::create_dir_all(rootfs.join("tmp"))?;
    let client = common::built().lib_dir.join("client_dl");
    std::fs::copy(&client, rootfs.join("bin/client"))?;
    let ldd = Command::new("ldd").arg(&client).output()?;
    let listed = String::from_utf8_lossy(&ldd.stdout).into_owned();
    // Every glibc package ships libpthread.so.0 and libdl.so.2 (stubs from 2.34 on); the
    // shipped hook, built for glibc 2.28, needs them, so an image like the ones users run has
    // them.
    // The loader under its library directory too, as in distribution images: a dlmopen into
    // a new namespace loads it by name.
    let compat = [
        "/lib/x86_64-linux-gnu/libpthread.so.0",
        "/lib/x86_64-linux-gnu/libdl.so.2",
        "/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
    ]
    .into_iter()
    .filter(|p| Path::new(p).exists());
    for lib in listed.split_whitespace().filter(|w| w.starts_with('/')).chain(compat) {
        let dest = rootfs.join(lib.trim_start_matches('/'));
        std::fs::create_dir_all(dest.parent().unwrap())?;
        std::fs::copy(lib, dest)?;
    }
    let tar = work.join("image.tar");
    tessera_tests::containerd::pack_image(&rootfs, IMAGE, &tar)?;
    Ok(tar)
}

async fn pod(c: &mut Containerd, keys: &SigningKeys, name: &str, device: AllocatedDevice) -> anyhow::Result<Pod> {
    c.run_signed_pod(keys, NODE, name, device).await
}

fn client(args: &[&str], amounts: &[(&str, &str)]) -> ContainerSpec {
    let mut cmd = vec!["/bin/client"];
    cmd.extend_from_slice(args);
    let mut s = ContainerSpec::new("main", &cmd)
        .image(IMAGE)
        .env("FAKE_GPU_STATE", "/tmp/fake-gpu")
        .env("FAKE_GPU_MEMORY_MIB", "16384");
    for (k, v) in amounts {
        s = s.annotation(&format!("tessera.io/allocated.{k}"), v);
    }
    s
}

const SHARE: [(&str, &str); 3] = [("gpu-core", "30"), ("gpu-memory", "8"), ("gpu-memory-mib", "8192")];

fn kv(out: &str) -> BTreeMap<&str, &str> {
    out.lines().filter_map(|l| l.split_once('=')).collect()
}

async fn hook_mode(version: Version) -> anyhow::Result<()> {
    let mut c = Containerd::start(version).await?;
    let work = tempfile::tempdir()?;
    let inv = node(work.path())?;
    c.import_image(&image(work.path())?)?;
    let layout = HookLayout::new(work.path().join("hook"));
    let opts = SpecOptions {
        dev_root: work.path().join("host"),
        enforcement: ShareEnforcement::Hook,
        hook: layout.clone(),
        ..Default::default()
    };
    write_spec(&c.cdi_dir(), SPEC_FILE, &spec::render(&inv, &opts)?.1)?;
    let keys = SigningKeys::new("k1", [("k1".to_string(), vec![3u8; 32])])?;
    let (stop_tx, task) = start_plugin(&c, &keys, ShareEnforcement::Hook, (Default::default(), layout.clone())).await?;
    let gpu = inv.gpus[0].clone();
    let share = AllocatedDevice::share(&gpu, 30, 8192);

    // Not installed yet: the share is refused, saying so.
    let p = pod(&mut c, &keys, "early", share.clone()).await?;
    let err = format!(
        "{:#}",
        c.create_container(&p, client(&["info"], &SHARE)).await.unwrap_err()
    );
    assert!(err.contains("the CUDA hook is not installed"), "{err}");

    // Installed: the program sees the share as its card and cannot allocate past it.
    assert!(layout.install(&common::hook_lib())?);
    let p = pod(&mut c, &keys, "share", share.clone()).await?;
    let cid = c.create_container(&p, client(&["info"], &SHARE)).await?;
    let s = c.oci_spec(&cid).await?;
    assert_eq!(
        s.annotations()
            .as_ref()
            .and_then(|a| a.get(ANNOTATION_ENFORCED_BY))
            .map(String::as_str),
        Some("hook")
    );
    let preload = s
        .mounts()
        .iter()
        .flatten()
        .find(|m| m.destination() == Path::new("/etc/ld.so.preload"))
        .expect("ld.so.preload mounted");
    assert!(preload.options().iter().flatten().any(|o| o == "ro"));
    assert_eq!(
        std::fs::read_to_string(preload.source().as_ref().unwrap())?.trim(),
        HOOK_LIBRARY_IN_CONTAINER
    );
    let (code, out) = c.run_to_exit(&cid).await?;
    assert_eq!(code, 0, "{out}");
    let info = kv(&out);
    assert_eq!(info.get("total"), Some(&(8192u64 << 20).to_string().as_str()), "{out}");
    let config = std::fs::read_to_string(layout.container_dir(&cid).join("config"))?;
    assert!(
        config.contains(&format!("uuid={}", gpu.uuid)) && config.contains("memory_limit_mib=8192"),
        "{config}"
    );
    assert!(config.contains("core_limit=30"), "{config}");

    // Its own host-pid socket, in its own agent directory (read-only): the node agent tells
    // each process its host pid (not the pid it sees in its own namespace), and nothing
    // of it is shared with another container (no card-wide lock one tenant could hold).
    let p = pod(&mut c, &keys, "hostpid", share.clone()).await?;
    let socket = format!("{HOOK_AGENT_IN_CONTAINER}/{HOOK_PID_SOCKET}");
    let cid = c
        .create_container(&p, client(&["hostpid", &socket, "1500"], &SHARE))
        .await?;
    let spec = c.oci_spec(&cid).await?;
    let agent = spec
        .mounts()
        .iter()
        .flatten()
        .find(|m| m.destination() == Path::new(HOOK_AGENT_IN_CONTAINER))
        .expect("the agent directory mounted");
    assert!(agent.options().iter().flatten().any(|o| o == "ro"));
    assert_eq!(agent.source().as_deref(), Some(layout.agent_dir(&cid).as_path()));
    c.start_container(&cid).await?;
    let host_pid = c.task_pid(&cid).await?.to_string();
    let (code, out) = c.wait_for_exit(&cid).await?;
    assert_eq!(code, 0, "{out}");
    let told = kv(&out);
    assert_eq!(told.get("host_pid"), Some(&host_pid.as_str()), "{out}");
    assert_ne!(
        told.get("pid"),
        told.get("host_pid"),
        "inside, its own pid namespace: {out}"
    );
    let sources = |s: &oci_spec::runtime::Spec| -> Vec<PathBuf> {
        s.mounts()
            .iter()
            .flatten()
            .filter(|m| m.destination().starts_with("/run/tessera"))
            // A tmpfs is the container's own, whatever its source's name.
            .filter(|m| m.typ().as_deref() != Some("tmpfs"))
            .filter_map(|m| m.source().clone())
            .collect()
    };
    let p2 = pod(&mut c, &keys, "beside", share.clone()).await?;
    let other = c.create_container(&p2, client(&["info"], &SHARE)).await?;
    let (mine, theirs) = (sources(&spec), sources(&c.oci_spec(&other).await?));
    assert!(
        mine.len() >= 2 && !mine.iter().any(|m| theirs.contains(m)),
        "{mine:?} / {theirs:?}"
    );

    let p = pod(&mut c, &keys, "fill", share.clone()).await?;
    let cid = c.create_container(&p, client(&["fill", "512"], &SHARE)).await?;
    let (code, out) = c.run_to_exit(&cid).await?;
    assert_eq!(code, 0, "{out}");
    assert_eq!(kv(&out).get("allocated_mib"), Some(&"8192"), "{out}");

    // A tenant that fills its accounting directory fills a tmpfs of its own, of a fixed size:
    // the write stops there, and nothing of it lands on the host (before, the directory was
    // the host's /run, open to all, unbounded).
    let p = pod(&mut c, &keys, "flood", share.clone()).await?;
    let flood = ContainerSpec::new(
        "main",
        &[
            "sh",
            "-c",
            &format!(
                "dd if=/dev/zero of={HOOK_STATE_IN_CONTAINER}/fill bs=1k count=4096 2>/dev/null; \
                 echo written=$(wc -c < {HOOK_STATE_IN_CONTAINER}/fill)"
            ),
        ],
    );
    let flood = SHARE
        .iter()
        .fold(flood, |s, (k, v)| s.annotation(&format!("tessera.io/allocated.{k}"), v));
    let cid = c.create_container(&p, flood).await?;
    let (code, out) = c.run_to_exit(&cid).await?;
    assert_eq!(code, 0, "{out}");
    let written: u64 = kv(&out)
        .get("written")
        .and_then(|w| w.trim().parse().ok())
        .unwrap_or(u64::MAX);
    assert!(
        written <= tessera_core::enforcement::HOOK_STATE_TMPFS_KIB * 1024,
        "the tenant wrote {written} bytes into its accounting directory: {out}"
    );
    let on_host: u64 = walk(&layout.root.join("containers"))
        .iter()
        .map(|f| f.metadata().map_or(0, |m| m.len()))
        .sum();
    assert!(
        on_host < 64 << 10,
        "{on_host} bytes in the containers' host directories"
    );

    // A whole card: no hook.
    let p = pod(&mut c, &keys, "whole", AllocatedDevice::whole(&inv.gpus[1])).await?;
    let cid = c
        .create_container(&p, client(&["fill", "1024"], &[("gpu-core", "100")]))
        .await?;
    assert!(
        !c.oci_spec(&cid)
            .await?
            .mounts()
            .iter()
            .flatten()
            .any(|m| m.destination() == Path::new("/etc/ld.so.preload"))
    );
    let (code, out) = c.run_to_exit(&cid).await?;
    assert_eq!(code, 0, "{out}");
    assert_eq!(kv(&out).get("allocated_mib"), Some(&"16384"), "{out}");

    // Removing a container removes its hook files.
    let dir = layout.container_dir(&cid);
    c.remove_pod(&p).await?;
    let share_pods: Vec<_> = std::fs::read_dir(layout.root.join("containers"))?.flatten().collect();
    assert!(!dir.exists() && !share_pods.is_empty());
    let _ = stop_tx.send(());
    task.await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hook_mode_on_containerd_1_7() -> anyhow::Result<()> {
    hook_mode(Version::V1_7).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hook_mode_on_containerd_2() -> anyhow::Result<()> {
    hook_mode(Version::V2).await
}

/// Every file under `dir`.
fn walk(dir: &Path) -> Vec<std::fs::DirEntry> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            out.extend(walk(&e.path()));
        } else {
            out.push(e);
        }
    }
    out
}

/// A node enforcing shares with MPS on `version`: the fake driver, the client image, the hook
/// installed, a stand-in daemon per card, Tessera's spec and the hand-off keys.
struct MpsNode {
    c: Containerd,
    inv: NodeInventory,
    hook: HookLayout,
    mps: tessera_core::enforcement::MpsLayout,
    keys: SigningKeys,
    _daemons: std::sync::mpsc::Sender<()>,
    _work: tempfile::TempDir,
}

async fn mps_node(version: Version) -> anyhow::Result<MpsNode> {
    use tessera_core::enforcement::MpsLayout;
    let c = Containerd::start(version).await?;
    let work = tempfile::tempdir()?;
    let inv = node(work.path())?;
    c.import_image(&image(work.path())?)?;
    let hook = HookLayout::new(work.path().join("hook"));
    assert!(hook.install(&common::hook_lib())?);
    let mps = MpsLayout::new(work.path().join("mps"));
    let daemons = tessera_tests::mps::stand_in_daemons(mps.clone(), inv.gpus.iter().map(|g| g.uuid.clone()).collect());
    let opts = SpecOptions {
        dev_root: work.path().join("host"),
        enforcement: ShareEnforcement::Mps,
        hook: hook.clone(),
        mps: mps.clone(),
        ..Default::default()
    };
    write_spec(&c.cdi_dir(), SPEC_FILE, &spec::render(&inv, &opts)?.1)?;
    let keys = SigningKeys::new("k1", [("k1".to_string(), vec![3u8; 32])])?;
    Ok(MpsNode {
        c,
        inv,
        hook,
        mps,
        keys,
        _daemons: daemons,
        _work: work,
    })
}

/// A container of a 30% + 4 GiB share running three clients that each fill it in 256 MiB
/// chunks and hold for 3 s, with `env` besides the fake GPU's.
fn three_fills(env: &[(&str, &str)]) -> ContainerSpec {
    let amounts = [("gpu-core", "30"), ("gpu-memory", "4"), ("gpu-memory-mib", "4096")];
    let three = (0..3)
        .map(|_| "/bin/client fill 256 3000 &")
        .collect::<Vec<_>>()
        .join(" ");
    let spec = ContainerSpec::new("main", &["sh", "-c", &format!("{three} wait")])
        .image(IMAGE)
        .env("FAKE_GPU_STATE", "/tmp/fake-gpu")
        .env("FAKE_GPU_MEMORY_MIB", "16384");
    let spec = env.iter().fold(spec, |s, (k, v)| s.env(k, v));
    amounts
        .iter()
        .fold(spec, |s, (k, v)| s.annotation(&format!("tessera.io/allocated.{k}"), v))
}

/// A container of a 30% + 4 GiB share running three clients that each launch kernels for 4 s
/// on the fake card served as MPS serves it (each process at the percentage the NRI plugin
/// gives it, side by side), printing the work the card did between 1.5 s and 3.5 s.
fn three_launches() -> ContainerSpec {
    let amounts = [("gpu-core", "30"), ("gpu-memory", "4"), ("gpu-memory-mib", "4096")];
    let three = (0..3)
        .map(|_| "/bin/client launch 4000 100 &")
        .collect::<Vec<_>>()
        .join(" ");
    let script = format!("{three} sleep 1.5; /bin/client work; sleep 2; /bin/client work; wait");
    let spec = ContainerSpec::new("main", &["sh", "-c", &script])
        .image(IMAGE)
        .env("FAKE_GPU_STATE", "/tmp/fake-gpu")
        .env("FAKE_GPU_MEMORY_MIB", "16384")
        .env("FAKE_MPS", "1")
        .env("FAKE_QUEUE_MS", "100");
    amounts
        .iter()
        .fold(spec, |s, (k, v)| s.annotation(&format!("tessera.io/allocated.{k}"), v))
}

/// The card's busy share between the two `work` readings of [`three_launches`], percent.
fn busy_between(out: &str) -> f64 {
    let values = |k: &str| -> Vec<f64> {
        out.lines()
            .filter_map(|l| l.strip_prefix(k))
            .map(|v| v.trim().parse().unwrap())
            .collect()
    };
    let (w, t) = (values("work_ns="), values("at_ns="));
    assert!(w.len() == 2 && t.len() == 2, "{out}");
    100.0 * (w[1] - w[0]) / (t[1] - t[0])
}

/// What each of the three clients allocated, MiB, and their sum.
fn allocated(out: &str) -> (Vec<u64>, u64) {
    let each: Vec<u64> = out
        .lines()
        .filter_map(|l| l.strip_prefix("allocated_mib="))
        .map(|v| v.trim().parse().unwrap())
        .collect();
    assert_eq!(each.len(), 3, "{out}");
    let together = each.iter().sum();
    (each, together)
}

/// On MPS nodes a share container's processes together stay within its memory: MPS limits each
/// process alone (three processes of a 30% + 8 GiB share held 21,504 MiB on an H100 with driver
/// 580), so the hook is preloaded there too and holds the container's memory as one budget,
/// whatever its processes' count. Three processes of one 4 GiB share fill at once, here with
/// the fake driver (which knows nothing of MPS) and a stand-in for the card's daemon (the rule
/// is the hook's and the NRI plugin's). Without the hook on MPS nodes they hold three times the
/// share.
///
/// Their compute too: MPS caps each process at the share's SMs (three busy processes of a 30%
/// share took 0.95x of an H100), so the plugin configures the hook to have the container's
/// processes take turns on the card. Three processes launching at once on the fake card,
/// served as MPS serves it, have it busy about 30% together; with the hook configured as on
/// `hook` nodes (a throttle that reads NVML, which sees no MPS client) they have it 90% busy.
async fn mps_mode_holds_a_containers_processes_together(version: Version) -> anyhow::Result<()> {
    let mut n = mps_node(version).await?;
    let (stop_tx, task) = start_plugin(&n.c, &n.keys, ShareEnforcement::Mps, (n.mps.clone(), n.hook.clone())).await?;
    let share = AllocatedDevice::share(&n.inv.gpus[0], 30, 4096);
    let p = pod(&mut n.c, &n.keys, "three", share).await?;
    let spec = three_fills(&[]);
    let c = &mut n.c;
    let cid = c.create_container(&p, spec).await?;
    let oci = c.oci_spec(&cid).await?;
    assert_eq!(
        oci.annotations()
            .as_ref()
            .and_then(|a| a.get(ANNOTATION_ENFORCED_BY))
            .map(String::as_str),
        Some("mps")
    );
    let (code, out) = c.run_to_exit(&cid).await?;
    assert_eq!(code, 0, "{out}");
    let (each, together) = allocated(&out);
    assert!(
        (3584..=4096).contains(&together),
        "three processes of a 4 GiB share held {together} MiB together ({each:?})"
    );

    let p = pod(c, &n.keys, "turns", AllocatedDevice::share(&n.inv.gpus[0], 30, 4096)).await?;
    let cid = c.create_container(&p, three_launches()).await?;
    let (code, out) = c.run_to_exit(&cid).await?;
    assert_eq!(code, 0, "{out}");
    let busy = busy_between(&out);
    assert!(
        (20.0..=33.0).contains(&busy),
        "three processes of a 30% share had the card {busy:.1}% busy together: {out}"
    );
    let _ = stop_tx.send(());
    task.await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mps_mode_holds_a_containers_processes_together_on_containerd_1_7() -> anyhow::Result<()> {
    mps_mode_holds_a_containers_processes_together(Version::V1_7).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mps_mode_holds_a_containers_processes_together_on_containerd_2() -> anyhow::Result<()> {
    mps_mode_holds_a_containers_processes_together(Version::V2).await
}

/// Where the driver holds memory per cgroup (r615+), a share's processes together stay within
/// its memory even when they go around the preloaded hook: three processes that load the
/// driver with `dlmopen` into a link namespace of their own (where no preloaded library is)
/// fill a 4 GiB share at once, against the fake driver, which charges each allocation to the
/// cgroup of the process that makes it, as r615 does. The NRI plugin set the limit on the
/// container's cgroup at its start, from the signed allocation; it goes with the container.
/// Without the limit they hold three times the share.
async fn per_cgroup_limits_hold_processes_that_bypass_the_hook(version: Version) -> anyhow::Result<()> {
    use tessera_node::memory_limits::NvmlMemoryLimits;
    let mut n = mps_node(version).await?;
    let built = common::built();
    let nvml = NvmlMemoryLimits::open(Some(&built.lib_dir.join("libnvidia-ml.so.1")))?;
    let layouts = (n.mps.clone(), n.hook.clone());
    let (stop_tx, task, plugin) =
        start_plugin_with(&n.c, &n.keys, ShareEnforcement::Mps, layouts, Some(Arc::new(nvml))).await?;
    let p = pod(
        &mut n.c,
        &n.keys,
        "bypass",
        AllocatedDevice::share(&n.inv.gpus[0], 30, 4096),
    )
    .await?;
    let limits = built.lib_dir.join("limits");
    let spec = three_fills(&[("CLIENT_DLMOPEN", "1"), ("FAKE_NVML_LIMITS", "/run/fake-nvml-limits")])
        .ro_mount(&limits.display().to_string(), "/run/fake-nvml-limits");
    let c = &mut n.c;
    let cid = c.create_container(&p, spec).await?;
    c.start_container(&cid).await?;
    let held = plugin
        .tracked()
        .get(&cid)
        .and_then(|t| t.cgroup_memory.clone())
        .and_then(|m| m.cgroup)
        .expect("the limit is set before the container starts");
    let ino = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&held)?);
    let file = limits.join(format!("ino-{ino}"));
    let set = std::fs::read_to_string(&file)?;
    assert!(set.ends_with(" 4294967296 4294967296\n"), "{set:?}");
    let (code, out) = c.wait_for_exit(&cid).await?;
    assert_eq!(code, 0, "{out}");
    let (each, together) = allocated(&out);
    assert!(
        (3584..=4096).contains(&together),
        "three processes around the hook held {together} MiB of a 4 GiB share together ({each:?})"
    );
    // Gone with the container: cleared at its stop (containerd 2 tells NRI of an exit), or
    // with its cgroup, which takes its limits along (NVML's documentation; containerd 1.7
    // tells NRI nothing until the container is removed, after its cgroup).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while file.exists() && held.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "the exited container's limit stays"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = stop_tx.send(());
    task.await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_cgroup_limits_hold_processes_that_bypass_the_hook_on_containerd_1_7() -> anyhow::Result<()> {
    per_cgroup_limits_hold_processes_that_bypass_the_hook(Version::V1_7).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_cgroup_limits_hold_processes_that_bypass_the_hook_on_containerd_2() -> anyhow::Result<()> {
    per_cgroup_limits_hold_processes_that_bypass_the_hook(Version::V2).await
}

/// Runs the NRI plugin (in `enforcement`, with `layouts`) against `c` until the returned sender
/// is dropped or sent to; returns once it has synchronised.
async fn start_plugin(
    c: &Containerd,
    keys: &SigningKeys,
    enforcement: ShareEnforcement,
    (mps, hook): (tessera_core::enforcement::MpsLayout, HookLayout),
) -> anyhow::Result<(tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<()>)> {
    start_plugin_with(c, keys, enforcement, (mps, hook), None)
        .await
        .map(|(stop, task, _)| (stop, task))
}

type Started = (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
    Arc<TesseraPlugin>,
);

/// [`start_plugin`], holding shares' memory per cgroup through `per_cgroup` when given.
async fn start_plugin_with(
    c: &Containerd,
    keys: &SigningKeys,
    enforcement: ShareEnforcement,
    (mps, hook): (tessera_core::enforcement::MpsLayout, HookLayout),
    per_cgroup: Option<Arc<dyn tessera_node::memory_limits::CgroupMemoryLimits>>,
) -> anyhow::Result<Started> {
    let mut plugin = TesseraPlugin::new(PluginConfig {
        node: NODE.into(),
        keys: keys.verifying(),
        cdi_dirs: vec![c.cdi_dir()],
        enforcement,
        mps,
        hook,
        claims: Default::default(),
    });
    if let Some(limits) = per_cgroup {
        let root = tessera_node::memory_limits::cgroup2_root().expect("a cgroup v2 hierarchy");
        plugin = plugin.holding_memory_per_cgroup(limits, root);
    }
    let plugin = Arc::new(plugin);
    let mut synced = plugin.synchronized();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let id = Identity {
        name: "tessera".into(),
        idx: "10".into(),
    };
    let task = tokio::spawn(session::run_external(c.nri_socket(), id, plugin.clone(), async move {
        let _ = stop_rx.await;
    }));
    tokio::time::timeout(Duration::from_secs(15), synced.wait_for(|n| *n > 0)).await??;
    Ok((stop_tx, task, plugin))
}
