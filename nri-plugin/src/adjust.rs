//! Turns a decision and resolved CDI edits into an NRI `ContainerAdjustment`, applied directly
//! (device nodes, mounts, env), not as CDI adjustments: containerd 1.7 ignores those.

use tessera_core::cdi::{BIN_DIR, DRIVER_DIR};
use tessera_core::enforcement::ANNOTATION_ENFORCED_BY;
use tessera_core::injection::{ANNOTATION_INJECTED, GPU_EXPOSING_ENV, Grant, final_env};
use tessera_proto::nri::api;

use crate::cdi::Edits;

fn kv(key: &str, value: &str) -> api::KeyValue {
    let mut k = api::KeyValue::new();
    k.key = key.into();
    k.value = value.into();
    k
}

/// A bind mount of a host path (read-only, or read-write).
pub fn bind(host: &std::path::Path, container: &str, read_only: bool) -> api::Mount {
    let mut m = api::Mount::new();
    m.destination = container.into();
    m.source = host.display().to_string();
    m.type_ = "bind".into();
    m.options = [
        if read_only { "ro" } else { "rw" },
        "nosuid",
        "nodev",
        "rbind",
        "rprivate",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    m
}

/// A tmpfs of its own at `container`, `size_kib` at most, open to every user of the container
/// (sticky, as /tmp): what is written there counts against nothing on the host.
pub fn tmpfs(container: &str, size_kib: u64) -> api::Mount {
    let mut m = api::Mount::new();
    m.destination = container.into();
    m.source = "tmpfs".into();
    m.type_ = "tmpfs".into();
    m.options = ["nosuid", "nodev", "noexec", &format!("size={size_kib}k"), "mode=1777"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    m
}

/// The adjustment for a granted container (`container_env`: what it has before).
pub fn grant(grant: &Grant, edits: &Edits, container_env: &[String]) -> api::ContainerAdjustment {
    let mut adj = api::ContainerAdjustment::new();
    let mut linux = api::LinuxContainerAdjustment::new();
    for d in &edits.devices {
        let mut dev = api::LinuxDevice::new();
        dev.path = d.path.clone();
        dev.type_ = d.kind.clone();
        dev.major = d.major;
        dev.minor = d.minor;
        linux.devices.push(dev);
    }
    adj.linux = Some(linux).into();
    for m in &edits.mounts {
        let mut mount = api::Mount::new();
        mount.destination = m.destination.clone();
        mount.source = m.source.clone();
        mount.type_ = m.kind.clone();
        mount.options = m.options.clone();
        adj.mounts.push(mount);
    }
    // With the driver mounted as one bundle, its programs are in <bundle>/bin.
    let bundle = edits.mounts.iter().any(|m| m.destination == DRIVER_DIR);
    let env = final_env(container_env, &edits.env, &grant.env, bundle.then_some(BIN_DIR));
    adj.env = env.iter().map(|(k, v)| kv(k, v)).collect();
    adj.annotations
        .insert(ANNOTATION_INJECTED.into(), grant.uuids.join(","));
    if let Some(mode) = grant.enforced_by {
        adj.annotations.insert(ANNOTATION_ENFORCED_BY.into(), mode.to_string());
    }
    adj
}

/// The adjustment for a container without GPUs: GPU device nodes it carries are removed and
/// GPU-exposing env is set to values that expose nothing (see [`GPU_EXPOSING_ENV`]).
pub fn deny(container: &api::Container) -> api::ContainerAdjustment {
    let mut adj = api::ContainerAdjustment::new();
    let mut linux = api::LinuxContainerAdjustment::new();
    if let Some(l) = container.linux.as_ref() {
        for d in &l.devices {
            if d.path.starts_with("/dev/nvidia") {
                let mut dev = api::LinuxDevice::new();
                dev.path = format!("-{}", d.path);
                linux.devices.push(dev);
            }
        }
    }
    if !linux.devices.is_empty() {
        adj.linux = Some(linux).into();
    }
    for e in &container.env {
        let (key, value) = e.split_once('=').unwrap_or((e.as_str(), ""));
        if let Some((_, neutral)) = GPU_EXPOSING_ENV.iter().find(|(k, _)| *k == key)
            && value != *neutral
        {
            adj.env.push(kv(key, neutral));
        }
    }
    adj
}
