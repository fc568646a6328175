//! The harness itself, on both containerd versions: a hand-written CDI spec with a fake char
//! device reaches the container's OCI spec (device node, cgroup allow rule, env) and the
//! container starts and exits 0.

use nix::sys::stat::{Mode, SFlag, makedev, mknod};
use oci_spec::runtime::LinuxDeviceType;
use tessera_tests::containerd::{ContainerSpec, Containerd, Version};

const FAKE_MAJOR: i64 = 241;
const FAKE_MINOR: i64 = 7;

async fn smoke(version: Version) -> anyhow::Result<()> {
    let mut c = Containerd::start(version).await?;
    let v = c.cri_version().await?;
    println!(
        "{version:?}: package {} reports {} {}",
        c.package_version(),
        v.runtime_name,
        v.runtime_version
    );
    match version {
        Version::V1_7 => assert!(v.runtime_version.starts_with("1.7."), "{v:?}"),
        Version::V2 => assert!(v.runtime_version.starts_with("2."), "{v:?}"),
    }

    let host_dev = c.dir().join("fake0");
    mknod(
        &host_dev,
        SFlag::S_IFCHR,
        Mode::from_bits_truncate(0o666),
        makedev(FAKE_MAJOR as u64, FAKE_MINOR as u64),
    )?;
    let spec = serde_json::json!({
        "cdiVersion": "0.6.0",
        "kind": "tessera.io/test",
        "devices": [{
            "name": "dev0",
            "containerEdits": {
                "deviceNodes": [{
                    "path": "/dev/tessera-fake0",
                    "hostPath": host_dev,
                    "type": "c",
                    "major": FAKE_MAJOR,
                    "minor": FAKE_MINOR,
                    "permissions": "rw"
                }],
                "env": ["TESSERA_SMOKE=from-cdi"]
            }
        }]
    });
    std::fs::write(
        c.cdi_dir().join("tessera.io-test.json"),
        serde_json::to_vec_pretty(&spec)?,
    )?;

    let pod = c.run_pod("smoke", &[("example.com/pod", "yes")]).await?;
    let id = c
        .create_container(
            &pod,
            ContainerSpec::new(
                "main",
                &["sh", "-c", "test -c /dev/tessera-fake0 && echo \"$TESSERA_SMOKE\""],
            )
            .cdi("tessera.io/test=dev0"),
        )
        .await?;
    let oci = c.oci_spec(&id).await?;
    let linux = oci.linux().as_ref().expect("linux section");
    let dev = linux
        .devices()
        .iter()
        .flatten()
        .find(|d| d.path().to_str() == Some("/dev/tessera-fake0"))
        .expect("device node injected");
    assert_eq!(
        (dev.typ(), dev.major(), dev.minor()),
        (LinuxDeviceType::C, FAKE_MAJOR, FAKE_MINOR)
    );
    let allowed = linux
        .resources()
        .as_ref()
        .and_then(|r| r.devices().as_ref())
        .expect("device cgroup rules");
    assert!(
        allowed
            .iter()
            .any(|r| r.allow() && r.major() == Some(FAKE_MAJOR) && r.minor() == Some(FAKE_MINOR)),
        "no allow rule for {FAKE_MAJOR}:{FAKE_MINOR}: {allowed:?}"
    );
    let env = oci.process().as_ref().and_then(|p| p.env().clone()).unwrap_or_default();
    assert!(env.iter().any(|e| e == "TESSERA_SMOKE=from-cdi"), "{env:?}");

    let (code, logs) = c.run_to_exit(&id).await?;
    assert_eq!((code, logs.trim()), (0, "from-cdi"));

    // A container without the CDI device gets neither the node nor the env.
    let plain = c
        .create_container(
            &pod,
            ContainerSpec::new("plain", &["sh", "-c", "test ! -e /dev/tessera-fake0"]),
        )
        .await?;
    let oci = c.oci_spec(&plain).await?;
    let devices = oci
        .linux()
        .as_ref()
        .and_then(|l| l.devices().clone())
        .unwrap_or_default();
    assert!(devices.iter().all(|d| d.path().to_str() != Some("/dev/tessera-fake0")));
    assert_eq!(c.run_to_exit(&plain).await?.0, 0);
    c.remove_pod(&pod).await?;
    Ok(())
}

#[tokio::test]
async fn containerd_1_7_runs_a_cdi_container() -> anyhow::Result<()> {
    smoke(Version::V1_7).await
}

#[tokio::test]
async fn containerd_2_runs_a_cdi_container() -> anyhow::Result<()> {
    smoke(Version::V2).await
}
