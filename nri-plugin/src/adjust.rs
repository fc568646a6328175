//! Turns a decision and resolved CDI edits into an NRI `ContainerAdjustment`, applied directly
//! (device nodes, mounts, env, hooks), not as CDI adjustments: containerd 1.7 ignores those.

use std::collections::BTreeMap;

use tessera_core::enforcement::ANNOTATION_ENFORCED_BY;
use tessera_core::injection::{ANNOTATION_INJECTED, GPU_EXPOSING_ENV, Grant};
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

/// The adjustment for a granted container.
pub fn grant(grant: &Grant, edits: &Edits) -> api::ContainerAdjustment {
    let mut adj = api::ContainerAdjustment::new();
    let mut linux = api::LinuxContainerAdjustment::new();
    for d in &edits.devices {
        let mut dev = api::LinuxDevice::new();
        dev.path = d.path.clone();
        dev.type_ = d.kind.clone();
        dev.major = d.major;
        dev.minor = d.minor;
        if let Some(m) = d.file_mode {
            let mut fm = api::OptionalFileMode::new();
            fm.value = m;
            dev.file_mode = Some(fm).into();
        }
        if let Some(u) = d.uid {
            let mut o = api::OptionalUInt32::new();
            o.value = u;
            dev.uid = Some(o).into();
        }
        if let Some(g) = d.gid {
            let mut o = api::OptionalUInt32::new();
            o.value = g;
            dev.gid = Some(o).into();
        }
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
    // CDI env first, then the grant's (limits, visibility) which win.
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    for e in &edits.env {
        if let Some((k, v)) = e.split_once('=') {
            env.insert(k.into(), v.into());
        }
    }
    env.extend(grant.env.clone());
    adj.env = env.iter().map(|(k, v)| kv(k, v)).collect();
    if !edits.hooks.is_empty() {
        let mut hooks = api::Hooks::new();
        for h in &edits.hooks {
            let mut hook = api::Hook::new();
            hook.path = h.path.clone();
            hook.args = h.args.clone();
            hook.env = h.env.clone();
            if let Some(t) = h.timeout {
                let mut o = api::OptionalInt::new();
                o.value = t;
                hook.timeout = Some(o).into();
            }
            match h.stage {
                "prestart" => hooks.prestart.push(hook),
                "createRuntime" => hooks.create_runtime.push(hook),
                "createContainer" => hooks.create_container.push(hook),
                "startContainer" => hooks.start_container.push(hook),
                "poststart" => hooks.poststart.push(hook),
                _ => hooks.poststop.push(hook),
            }
        }
        adj.hooks = Some(hooks).into();
    }
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
