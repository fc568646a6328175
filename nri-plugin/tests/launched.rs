//! Runtime-launched mode on real containerd (1.7 and 2.x): the plugin binary sits in the
//! runtime's NRI plugin directory as `10-tessera`, the runtime starts it with the socket on
//! fd 3 and an empty environment, and relaunches it after its own restart.

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;

use tessera_cdi_generator::spec::{self, SpecOptions};
use tessera_cdi_generator::writer::{SPEC_FILE, write_spec};
use tessera_core::handoff::{AllocatedDevice, Allocation, ContainerAllocation, SigningKeys};
use tessera_core::inventory::NodeInventory;
use tessera_core::names::{ANNOTATION_ALLOCATION, ANNOTATION_ALLOCATION_SIGNATURE};
use tessera_core::request::ContainerRole;
use tessera_tests::containerd::{ContainerSpec, Containerd, Version};
use tessera_tests::fake_node::{FakeNodePaths, fake_node};

const NODE: &str = "node-l";
const BIN: &str = env!("CARGO_BIN_EXE_tessera-nri-plugin");

/// Writes the `10-tessera` launcher (the runtime passes no arguments and no PATH, so a
/// wrapper supplies the flags) and the hand-off key.
fn install(c: &Containerd, work: &Path) -> anyhow::Result<()> {
    let keys = work.join("keys");
    std::fs::create_dir_all(&keys)?;
    std::fs::write(keys.join("active"), "k1\n")?;
    std::fs::write(keys.join("k1"), [7u8; 32])?;
    let launcher = c.dir().join("nri-plugins").join("10-tessera");
    std::fs::write(
        &launcher,
        format!(
            "#!/bin/sh\nexec {BIN} run --node-name {NODE} --keys-dir {} --cdi-dir {} 2>>{}\n",
            keys.display(),
            c.cdi_dir().display(),
            work.join("plugin.log").display()
        ),
    )?;
    std::fs::set_permissions(&launcher, std::fs::Permissions::from_mode(0o755))?;
    Ok(())
}

/// A fake H100 node under `work` with Tessera's CDI spec in the runtime's CDI directory and
/// the launcher installed.
fn prepare(c: &Containerd, work: &Path) -> anyhow::Result<NodeInventory> {
    let inv = fake_node("h100x8", work)?;
    let dev_root = FakeNodePaths::under(work).dev_root;
    let (_, text) = spec::render(
        &inv,
        &SpecOptions {
            dev_root,
            ..Default::default()
        },
    )?;
    write_spec(&c.cdi_dir(), SPEC_FILE, &text)?;
    install(c, work)?;
    Ok(inv)
}

/// Creates a container whose pod holds a signed allocation of GPU 2 and returns its GPU device
/// nodes after running it to a clean exit.
async fn injected_nodes(
    c: &mut Containerd,
    inv: &NodeInventory,
    name: &str,
    keys: &SigningKeys,
) -> anyhow::Result<Vec<String>> {
    let uid = format!("uid-{name}");
    let mut a = Allocation::new(NODE, &uid);
    a.containers.push(ContainerAllocation {
        name: "main".into(),
        role: ContainerRole::App,
        devices: vec![AllocatedDevice::whole(&inv.gpus[2])],
    });
    let s = keys.sign(&a);
    let pod = c
        .run_pod_with_uid(
            name,
            &uid,
            &[
                (ANNOTATION_ALLOCATION, &s.allocation),
                (ANNOTATION_ALLOCATION_SIGNATURE, &s.signature),
            ],
        )
        .await?;
    // The runtime waits for pre-installed plugins to register and synchronize before it
    // serves CRI, so the first container is already injected.
    let id = c
        .create_container(
            &pod,
            ContainerSpec::new("main", &["sh", "-c", "test -c /dev/nvidia2 && test ! -e /dev/nvidia0"])
                .annotation("tessera.io/allocated.gpu-core", "100"),
        )
        .await?;
    let spec = c.oci_spec(&id).await?;
    anyhow::ensure!(
        spec.annotations()
            .as_ref()
            .and_then(|a| a.get("tessera.io/injected"))
            .is_some(),
        "the container was not injected"
    );
    let (code, logs) = c.run_to_exit(&id).await?;
    anyhow::ensure!(code == 0, "container exited {code}: {logs}");
    Ok(spec
        .linux()
        .as_ref()
        .and_then(|l| l.devices().clone())
        .unwrap_or_default()
        .iter()
        .map(|d| d.path().display().to_string())
        .filter(|p| {
            p.strip_prefix("/dev/nvidia")
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        })
        .collect())
}

async fn launched(version: Version) -> anyhow::Result<()> {
    let mut c = Containerd::start(version).await?;
    let work = tempfile::tempdir()?;
    let inv = prepare(&c, work.path())?;
    // The runtime launches its plugins when NRI starts, so restart it with the launcher in place.
    c.stop_daemon();
    c.start_daemon().await?;
    let keys = SigningKeys::new("k1", [("k1".to_string(), vec![7u8; 32])])?;
    let log = || std::fs::read_to_string(work.path().join("plugin.log")).unwrap_or_default();

    let nodes = injected_nodes(&mut c, &inv, "first", &keys)
        .await
        .map_err(|e| anyhow::anyhow!("{e:#}\nplugin log:\n{}\nruntime log:\n{}", log(), c.log_tail(30)))?;
    assert_eq!(nodes, ["/dev/nvidia2"]);
    assert!(log().contains("registered with the runtime"), "{}", log());

    // The runtime restarts: the old process sees EOF and exits, the runtime launches a new one.
    c.stop_daemon();
    c.start_daemon().await?;
    let nodes = injected_nodes(&mut c, &inv, "second", &keys)
        .await
        .map_err(|e| anyhow::anyhow!("{e:#}\nplugin log:\n{}\nruntime log:\n{}", log(), c.log_tail(30)))?;
    assert_eq!(nodes, ["/dev/nvidia2"]);
    assert_eq!(log().matches("registered with the runtime").count(), 2, "{}", log());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn launched_by_containerd_1_7() -> anyhow::Result<()> {
    launched(Version::V1_7).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn launched_by_containerd_2() -> anyhow::Result<()> {
    launched(Version::V2).await
}

/// `tessera-nri-plugin check` against a real containerd: ready while it runs, a named failure
/// once it stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_reports_a_ready_node_and_a_stopped_runtime() -> anyhow::Result<()> {
    let mut c = Containerd::start(Version::V1_7).await?;
    let work = tempfile::tempdir()?;
    prepare(&c, work.path())?;
    let FakeNodePaths {
        driver_root: driver,
        dev_root: dev,
    } = FakeNodePaths::under(work.path());
    // The nodes' key as the chart ships it: the extender's Ed25519 public key (an HMAC secret,
    // which the launched plugin above verifies with, is the older kind and warns).
    let keys = work.path().join("public-keys");
    std::fs::create_dir_all(&keys)?;
    std::fs::write(
        keys.join("k1"),
        "-----BEGIN PUBLIC KEY-----\nMCowBQYDK2VwAyEA08aWN5LIdbKCx0D+TD4GJ9t0rC0XafHceh6LUkdbq3M=\n-----END PUBLIC KEY-----\n",
    )?;
    let check = |c: &Containerd| {
        std::process::Command::new(BIN)
            .arg("check")
            .arg("--socket")
            .arg(c.nri_socket())
            .arg("--containerd-config")
            .arg(c.dir().join("config.toml"))
            .arg("--crio-config")
            .arg(work.path().join("no-crio.conf"))
            .arg("--cdi-dir")
            .arg(c.cdi_dir())
            .arg("--keys-dir")
            .arg(&keys)
            .arg("--driver-root")
            .arg(&driver)
            .arg("--dev-root")
            .arg(&dev)
            .args(["--share-enforcement", "none"])
            .output()
    };
    let out = check(&c)?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{text}");
    for line in [
        "[ok  ] NRI socket",
        "[ok  ] containerd NRI",
        "[ok  ] containerd CDI",
        "[ok  ] CDI spec",
        "[ok  ] NVIDIA driver",
        "[WARN] share limits     share enforcement none",
        "[ok  ] hand-off keys",
    ] {
        assert!(text.contains(line), "missing {line:?} in:\n{text}");
    }
    c.stop_daemon();
    let out = check(&c)?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("[FAIL] NRI socket"), "{text}");
    Ok(())
}
