//! Enforced shares end to end on real containerd (1.7 and 2.x), with the real supervisor
//! running NVIDIA's real MPS control daemon per card (535, no GPU needed): a share container is
//! connected to its card's daemon (its control socket alone, the card's bounded shm as
//! /dev/shm, the limits from its allocation), a whole card is not, and once the daemon is down
//! a share is refused at creation, saying why. A tenant that brings NVIDIA's control client in
//! its own image cannot stop the daemon, hold its lock, write beside its socket or fill the
//! node's memory through /dev/shm.

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_cdi_generator::spec::{self, SpecOptions};
use tessera_cdi_generator::writer::{SPEC_FILE, write_spec};
use tessera_core::enforcement::{ANNOTATION_ENFORCED_BY, MPS_PIPE_IN_CONTAINER, MpsLayout, ShareEnforcement};
use tessera_core::handoff::{AllocatedDevice, SigningKeys};
use tessera_nri_plugin::plugin::{PluginConfig, TesseraPlugin};
use tessera_nri_plugin::session::{self, Identity};
use tessera_tests::containerd::{ContainerSpec, Containerd, Pod, Runtimes, Version};
use tessera_tests::fake_node::fake_node;
use tessera_tests::nvidia::{Branch, Userspace};

const BIN: &str = env!("CARGO_BIN_EXE_tessera-mps-supervisor");
const NODE: &str = "node-mps";
/// Each card's shm tmpfs in this test, MiB.
const SHM_MIB: u64 = 64;
const TENANT_IMAGE: &str = "docker.io/tessera/mps-tenant:test";

/// A tenant's image: busybox, Debian's C library and NVIDIA's control client (a tenant can bring
/// any program; this one speaks the daemon's protocol).
fn tenant_image(work: &std::path::Path) -> anyhow::Result<std::path::PathBuf> {
    let u = Userspace::get()?;
    let rootfs = work.join("rootfs");
    u.rootfs_with_libc6(&rootfs)?;
    std::fs::create_dir_all(rootfs.join("bin"))?;
    std::fs::copy(Runtimes::get()?.busybox(), rootfs.join("bin/busybox"))?;
    for applet in ["sh", "ls", "cat", "echo", "env", "touch", "dd", "rm", "sleep", "true"] {
        std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet))?;
    }
    std::fs::copy(u.mps_control(Branch::R535), rootfs.join("bin/nvidia-cuda-mps-control"))?;
    let tar = work.join("tenant.tar");
    tessera_tests::containerd::pack_image(&rootfs, TENANT_IMAGE, &tar)?;
    Ok(tar)
}

/// What the card's real daemon answers to `cmd` (asked as root, on the host).
fn ask(layout: &MpsLayout, uuid: &str, cmd: &str) -> String {
    use std::io::Write as _;
    // The daemon serves one control connection at a time and the supervisor's own checks run
    // beside this one: a client that met a busy daemon answers nothing and is asked again.
    for _ in 0..40 {
        let mut child = Command::new(Userspace::get().unwrap().mps_control(Branch::R535))
            .env("CUDA_MPS_PIPE_DIRECTORY", layout.pipe_dir(uuid))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        writeln!(child.stdin.take().unwrap(), "{cmd}").unwrap();
        let answer = String::from_utf8_lossy(&child.wait_with_output().unwrap().stdout)
            .trim()
            .to_string();
        if !answer.is_empty() {
            return answer;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    String::new()
}

struct Supervisor(Child);

impl Supervisor {
    fn start(layout: &MpsLayout) -> Self {
        let control = Userspace::get().unwrap().mps_control(Branch::R535);
        Self(
            Command::new(BIN)
                .args(["run", "--fixture", "h100x8", "--check-secs", "1", "--shm-mib"])
                .arg(SHM_MIB.to_string())
                .arg("--control-binary")
                .arg(control)
                .arg("--mps-root")
                .arg(&layout.root)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        )
    }

    fn stop(mut self) {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.0.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        self.0.wait().unwrap();
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        // SIGTERM first: the supervisor stops its daemons (a SIGKILL would orphan them).
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.0.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while self.0.try_wait().ok().flatten().is_none() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn pod(c: &mut Containerd, keys: &SigningKeys, name: &str, device: AllocatedDevice) -> anyhow::Result<Pod> {
    c.run_signed_pod(keys, NODE, name, device).await
}

fn share_spec(cmd: &str) -> ContainerSpec {
    share_spec_of(cmd, 30, 8192)
}

/// A share container as the device plugin's Allocate annotates it.
fn share_spec_of(cmd: &str, core: u32, mib: u64) -> ContainerSpec {
    ContainerSpec::new("main", &["sh", "-c", cmd])
        .annotation("tessera.io/allocated.gpu-core", &core.to_string())
        .annotation("tessera.io/allocated.gpu-memory", &(mib / 1024).to_string())
        .annotation("tessera.io/allocated.gpu-memory-mib", &mib.to_string())
}

async fn mps(version: Version) -> anyhow::Result<()> {
    let mut c = Containerd::start(version).await?;
    let root = tempfile::tempdir()?;
    let inv = fake_node("h100x8", root.path())?;
    let layout = MpsLayout::new(root.path().join("mps"));
    // MPS nodes preload the CUDA hook (what it holds is hook/tests/nri_hook.rs's to show).
    let hook = tessera_core::enforcement::HookLayout::new(root.path().join("hook"));
    tessera_tests::mps::install_placeholder_hook(&hook)?;
    let opts = SpecOptions {
        dev_root: root.path().join("host"),
        enforcement: ShareEnforcement::Mps,
        mps: layout.clone(),
        hook: hook.clone(),
        ..Default::default()
    };
    write_spec(&c.cdi_dir(), SPEC_FILE, &spec::render(&inv, &opts)?.1)?;
    let keys = SigningKeys::new("k1", [("k1".to_string(), vec![5u8; 32])])?;
    let cdi_dir = c.cdi_dir();
    let plugin = |enforcement| {
        Arc::new(TesseraPlugin::new(PluginConfig {
            node: NODE.into(),
            keys: keys.verifying(),
            cdi_dirs: vec![cdi_dir.clone()],
            enforcement,
            mps: layout.clone(),
            hook: hook.clone(),
            claims: Default::default(),
        }))
    };
    let p = plugin(ShareEnforcement::Mps);
    let mut synced = p.synchronized();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let id = Identity {
        name: "tessera".into(),
        idx: "10".into(),
    };
    let task = tokio::spawn(session::run_external(c.nri_socket(), id.clone(), p, async move {
        let _ = stop_rx.await;
    }));
    tokio::time::timeout(Duration::from_secs(15), synced.wait_for(|n| *n > 0)).await??;

    let gpu = inv.gpus[0].clone();
    let sup = Supervisor::start(&layout);
    let deadline = Instant::now() + Duration::from_secs(20);
    while layout.ready(&gpu.uuid, std::time::SystemTime::now()).is_err() {
        anyhow::ensure!(Instant::now() < deadline, "the MPS daemon of GPU 0 never got ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A mark in the card's shm directory: what the share container sees as /dev/shm.
    std::fs::write(layout.shm_dir(&gpu.uuid).join("tessera-mark"), &gpu.uuid)?;

    // A share: connected to its card's daemon, limited by its allocation.
    let share = AllocatedDevice::share(&gpu, 30, 8192);
    let pd = pod(&mut c, &keys, "share", share.clone()).await?;
    let cid = c
        .create_container(
            &pd,
            share_spec("env; echo shm=$(cat /dev/shm/tessera-mark); ls \"$CUDA_MPS_PIPE_DIRECTORY\""),
        )
        .await?;
    let s = c.oci_spec(&cid).await?;
    assert_eq!(
        s.annotations()
            .as_ref()
            .and_then(|a| a.get(ANNOTATION_ENFORCED_BY))
            .map(String::as_str),
        Some("mps")
    );
    let (code, out) = c.run_to_exit(&cid).await?;
    assert_eq!(code, 0, "{out}");
    let env: BTreeMap<&str, &str> = out.lines().filter_map(|l| l.split_once('=')).collect();
    assert_eq!(
        env.get("CUDA_MPS_PIPE_DIRECTORY"),
        Some(&MPS_PIPE_IN_CONTAINER),
        "{out}"
    );
    assert_eq!(env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"), Some(&"30"), "{out}");
    let mem = format!("{}=8192M", gpu.uuid);
    assert_eq!(
        env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"),
        Some(&mem.as_str()),
        "{out}"
    );
    // /dev/shm is the card's MPS shm, and the pipe directory holds the real daemon's socket.
    assert_eq!(env.get("shm"), Some(&gpu.uuid.as_str()), "{out}");
    assert!(out.lines().any(|l| l == "control"), "{out}");
    let mounts = tessera_tests::containerd::mount_destinations(&s);
    assert!(
        !mounts.iter().any(|m| m.starts_with(layout.root.to_str().unwrap())),
        "no path of the supervisor's own reaches the container: {mounts:?}"
    );

    // The card's daemon holds the share's limits itself (a client that drops its variables
    // gets no more), set before the container was created.
    let defaults = || {
        (
            ask(&layout, &gpu.uuid, "get_default_active_thread_percentage"),
            ask(&layout, &gpu.uuid, "get_default_device_pinned_mem_limit 0"),
        )
    };
    // The container above has exited: nothing on the card any more, the daemon is closed.
    let deadline = Instant::now() + Duration::from_secs(10);
    while defaults() != ("1.0".into(), "1M".into()) {
        anyhow::ensure!(Instant::now() < deadline, "the ceiling stayed at {:?}", defaults());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A share that keeps running: its limits, set before its creation returned.
    let keep = pod(&mut c, &keys, "keep", share.clone()).await?;
    let keep_id = c.create_container(&keep, share_spec("sleep 3600")).await?;
    assert_eq!(defaults(), ("30.0".into(), "8G".into()));

    // A tenant beside it, with NVIDIA's control client in its image: it reaches the daemon
    // (MPS clients must), read-only, and sees nothing of the pipe directory but the socket;
    // `quit` is refused even to its root (it has no control_privileged); it cannot write
    // beside the socket; its /dev/shm is the card's tmpfs, which fills at its size.
    let work = tempfile::tempdir()?;
    c.import_image(&tenant_image(work.path())?)?;
    let tenant = pod(&mut c, &keys, "tenant", share.clone()).await?;
    // The control client answers nothing now and then on a loaded machine (seen once in CI's
    // 2 cores): an empty answer is asked again, a few times.
    let script = format!(
        "cd \"$CUDA_MPS_PIPE_DIRECTORY\"; echo pipe=$(ls -A); \
         ask() {{ for i in 1 2 3 4 5; do a=$(echo \"$1\" | nvidia-cuda-mps-control); [ -n \"$a\" ] && break; sleep 1; done; echo \"$a\"; }}; \
         echo get=$(ask get_default_active_thread_percentage); \
         echo quit=$(ask quit); \
         touch x 2>/dev/null && echo write=yes || echo write=no; \
         dd if=/dev/zero of=/dev/shm/fill bs=1M count={} 2>/dev/null && echo shm=unbounded || echo shm=full; \
         rm -f /dev/shm/fill",
        SHM_MIB + 16
    );
    let tid = c
        .create_container(&tenant, share_spec(&script).image(TENANT_IMAGE))
        .await?;
    let (code, out) = c.run_to_exit(&tid).await?;
    assert_eq!(code, 0, "{out}");
    let said: BTreeMap<&str, &str> = out.lines().filter_map(|l| l.split_once('=')).collect();
    assert_eq!(said.get("pipe"), Some(&"control"), "{out}");
    assert_eq!(said.get("get"), Some(&"30.0"), "{out}");
    assert_eq!(
        said.get("quit"),
        Some(&"Not enough privilege to execute quit command"),
        "{out}"
    );
    assert_eq!(said.get("write"), Some(&"no"), "{out}");
    assert_eq!(said.get("shm"), Some(&"full"), "{out}");
    // The daemon still runs and holds the ceiling.
    assert_eq!(defaults(), ("30.0".into(), "8G".into()));
    c.remove_pod(&tenant).await?;

    // A larger share on the same card: the ceiling is the largest of them, in each dimension.
    let big = pod(&mut c, &keys, "big", AllocatedDevice::share(&gpu, 50, 4096)).await?;
    let big_id = c.create_container(&big, share_spec_of("true", 50, 4096)).await?;
    assert_eq!(defaults(), ("50.0".into(), "8G".into()));
    // It goes: the ceiling comes back down to the share that remains.
    let _ = c.run_to_exit(&big_id).await?;
    c.remove_pod(&big).await?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while defaults().0 != "30.0" {
        anyhow::ensure!(Instant::now() < deadline, "the ceiling stayed at {:?}", defaults());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    c.remove_pod(&keep).await?;
    let _ = keep_id;

    // A whole card on the same node: no MPS.
    let pd = pod(&mut c, &keys, "whole", AllocatedDevice::whole(&inv.gpus[1])).await?;
    let cid = c
        .create_container(
            &pd,
            ContainerSpec::new(
                "main",
                &["sh", "-c", "env; test ! -e /dev/shm/tessera-mark && echo own-shm"],
            )
            .annotation("tessera.io/allocated.gpu-core", "100"),
        )
        .await?;
    let (code, out) = c.run_to_exit(&cid).await?;
    assert_eq!(code, 0, "{out}");
    assert!(!out.contains("CUDA_MPS_") && out.contains("own-shm"), "{out}");

    // The daemons stop: the next share is refused, saying why.
    sup.stop();
    let pd = pod(&mut c, &keys, "late", share.clone()).await?;
    let err = c.create_container(&pd, share_spec("true")).await.unwrap_err();
    let err = format!("{err:#}");
    assert!(
        err.contains(&format!("its share of {} cannot be enforced", gpu.uuid)) && err.contains("is stopped"),
        "{err}"
    );
    let _ = stop_tx.send(());
    task.await?;

    // A node configured to run shares unenforced: admitted, and marked so.
    let p = plugin(ShareEnforcement::None);
    let mut synced = p.synchronized();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(session::run_external(c.nri_socket(), id, p, async move {
        let _ = stop_rx.await;
    }));
    tokio::time::timeout(Duration::from_secs(15), synced.wait_for(|n| *n > 0)).await??;
    let pd = pod(&mut c, &keys, "unenforced", share).await?;
    let cid = c.create_container(&pd, share_spec("true")).await?;
    let s = c.oci_spec(&cid).await?;
    assert_eq!(
        s.annotations()
            .as_ref()
            .and_then(|a| a.get(ANNOTATION_ENFORCED_BY))
            .map(String::as_str),
        Some("none")
    );
    let _ = stop_tx.send(());
    task.await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mps_shares_on_containerd_1_7() -> anyhow::Result<()> {
    mps(Version::V1_7).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mps_shares_on_containerd_2() -> anyhow::Result<()> {
    mps(Version::V2).await
}
