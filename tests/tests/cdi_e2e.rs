//! The generated CDI spec on real containerd (1.7 and 2.x): CRI CreateContainer with Tessera's
//! CDI names gives exactly the expected device nodes, cgroup rules, mounts and env, and the
//! containers run.

use std::collections::BTreeSet;

use tessera_cdi_generator::spec::{self, SpecOptions};
use tessera_cdi_generator::writer::{SPEC_FILE, write_spec};
use tessera_tests::containerd::{ContainerSpec, Containerd, Version};
use tessera_tests::fake_node::{FakeNodePaths, fake_node};

fn gpu_nodes(spec: &oci_spec::runtime::Spec) -> BTreeSet<String> {
    spec.linux()
        .as_ref()
        .and_then(|l| l.devices().clone())
        .unwrap_or_default()
        .iter()
        .map(|d| d.path().display().to_string())
        .filter(|p| p.starts_with("/dev/nvidia"))
        .collect()
}

fn allowed(spec: &oci_spec::runtime::Spec, major: i64, minor: i64) -> bool {
    spec.linux()
        .as_ref()
        .and_then(|l| l.resources().as_ref())
        .and_then(|r| r.devices().clone())
        .unwrap_or_default()
        .iter()
        .any(|r| r.allow() && r.major() == Some(major) && r.minor() == Some(minor))
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| s.to_string()).collect()
}

async fn cdi_on(version: Version) -> anyhow::Result<()> {
    let mut c = Containerd::start(version).await?;
    let root = tempfile::tempdir()?;
    let inv = fake_node("a100-mig", root.path())?;
    let dev_root = FakeNodePaths::under(root.path()).dev_root;
    let (_, text) = spec::render(
        &inv,
        &SpecOptions {
            dev_root,
            ..Default::default()
        },
    )?;
    write_spec(&c.cdi_dir(), SPEC_FILE, &text)?;

    let control = [
        "/dev/nvidiactl",
        "/dev/nvidia-modeset",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
    ];
    let mig = &inv.gpus[1].mig_devices[2];
    let (gi_cap, ci_cap) = (
        mig.gi_access.path.display().to_string(),
        mig.ci_access.path.display().to_string(),
    );
    let cases: Vec<(&str, String, BTreeSet<String>, &str)> = vec![
        (
            "whole",
            "tessera.io/gpu=3".into(),
            set(&["/dev/nvidia3"]),
            "test -c /dev/nvidia3 && test ! -e /dev/nvidia0",
        ),
        (
            "byuuid",
            format!("tessera.io/gpu={}", inv.gpus[3].uuid),
            set(&["/dev/nvidia3"]),
            "test -c /dev/nvidia3",
        ),
        (
            "all",
            "tessera.io/gpu=all".into(),
            set(&["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia2", "/dev/nvidia3"]),
            "test -c /dev/nvidia0 && test -c /dev/nvidia3",
        ),
        (
            "mig",
            "tessera.io/gpu=1:2".into(),
            set(&["/dev/nvidia1"]),
            "test -c /dev/nvidia1 && test ! -e /dev/nvidia3",
        ),
        (
            "share",
            "tessera.io/gpu=share-3".into(),
            set(&["/dev/nvidia3"]),
            "test -c /dev/nvidia3",
        ),
    ];
    let pod = c.run_pod("cdi", &[]).await?;
    for (name, cdi, gpus, check) in cases {
        let script = format!(
            "{check} && test -c /dev/nvidiactl && test -f /usr/local/nvidia/lib64/libcuda.so.1 && test -f /usr/bin/nvidia-smi && test \"$NVIDIA_VISIBLE_DEVICES\" = void"
        );
        let id = c
            .create_container(&pod, ContainerSpec::new(name, &["sh", "-c", &script]).cdi(&cdi))
            .await?;
        let oci = c.oci_spec(&id).await?;
        let mut expected = gpus.clone();
        expected.extend(control.iter().map(|s| s.to_string()));
        let mut got = gpu_nodes(&oci);
        let caps: BTreeSet<String> = got
            .iter()
            .filter(|p| p.starts_with("/dev/nvidia-caps/"))
            .cloned()
            .collect();
        got.retain(|p| !p.starts_with("/dev/nvidia-caps/"));
        assert_eq!(got, expected, "{name}: device nodes");
        match name {
            "mig" => assert_eq!(caps, set(&[&gi_cap, &ci_cap]), "mig caps"),
            "all" => assert_eq!(caps.len(), 13 * 2, "every MIG device's caps"),
            _ => assert!(caps.is_empty(), "{name}: {caps:?}"),
        }
        for dev in &expected {
            let n = inv
                .all_device_nodes()
                .into_iter()
                .find(|d| d.path.display().to_string() == *dev)
                .unwrap();
            assert!(
                allowed(&oci, i64::from(n.major), i64::from(n.minor)),
                "{name}: no cgroup rule for {dev}"
            );
        }
        let mounts = tessera_tests::containerd::mount_destinations(&oci);
        assert!(
            mounts.contains(&"/usr/local/nvidia/lib64/libcuda.so.1".to_string()),
            "{name}: {mounts:?}"
        );
        let env = oci.process().as_ref().and_then(|p| p.env().clone()).unwrap_or_default();
        assert!(
            env.contains(&"LD_LIBRARY_PATH=/usr/local/nvidia/lib64".to_string()),
            "{name}: {env:?}"
        );
        let (code, logs) = c.run_to_exit(&id).await?;
        assert_eq!(code, 0, "{name}: {logs}");
    }
    c.remove_pod(&pod).await?;
    Ok(())
}

#[tokio::test]
async fn cdi_spec_on_containerd_1_7() -> anyhow::Result<()> {
    cdi_on(Version::V1_7).await
}

#[tokio::test]
async fn cdi_spec_on_containerd_2() -> anyhow::Result<()> {
    cdi_on(Version::V2).await
}
