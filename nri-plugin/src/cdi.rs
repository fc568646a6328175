//! Resolves CDI device names against the specs on disk (container-device-interface crate
//! cache) into the edits to apply. Results are memoised per name set and the cache is
//! refreshed only when a spec file changes, so CreateContainer stays fast.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use container_device_interface::cache::{Cache, new_cache, with_auto_refresh};
use container_device_interface::spec_dirs::with_spec_dirs;
use oci_spec::runtime as oci;

/// A device node to add.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceEdit {
    /// Path in the container.
    pub path: String,
    /// `c` or `b`.
    pub kind: String,
    /// Major.
    pub major: i64,
    /// Minor.
    pub minor: i64,
    /// File mode.
    pub file_mode: Option<u32>,
    /// Owner.
    pub uid: Option<u32>,
    /// Group.
    pub gid: Option<u32>,
}

/// A mount to add.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEdit {
    /// Container path.
    pub destination: String,
    /// Host path.
    pub source: String,
    /// Type (`bind`).
    pub kind: String,
    /// Options.
    pub options: Vec<String>,
}

/// A hook to add, with the OCI stage it runs in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HookEdit {
    /// `prestart`, `createRuntime`, `createContainer`, `startContainer`, `poststart`, `poststop`.
    pub stage: &'static str,
    /// Program.
    pub path: String,
    /// Arguments.
    pub args: Vec<String>,
    /// Environment.
    pub env: Vec<String>,
    /// Timeout, seconds.
    pub timeout: Option<i64>,
}

/// All edits of a set of CDI devices (spec-wide edits included).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Edits {
    /// Device nodes.
    pub devices: Vec<DeviceEdit>,
    /// Mounts.
    pub mounts: Vec<MountEdit>,
    /// `KEY=value`.
    pub env: Vec<String>,
    /// Hooks.
    pub hooks: Vec<HookEdit>,
}

/// The resolver.
pub struct CdiResolver {
    dirs: Vec<PathBuf>,
    cache: Arc<Mutex<Cache>>,
    stamp: Vec<(PathBuf, Option<SystemTime>)>,
    memo: HashMap<Vec<String>, Edits>,
}

fn empty_spec() -> oci::Spec {
    let mut spec = oci::Spec::default();
    spec.set_mounts(None);
    spec.set_hooks(None);
    let mut process = oci::Process::default();
    process.set_env(None);
    spec.set_process(Some(process));
    let mut linux = oci::Linux::default();
    linux.set_devices(None);
    linux.set_resources(None);
    spec.set_linux(Some(linux));
    spec
}

fn hooks_of(stage: &'static str, hooks: &Option<Vec<oci::Hook>>) -> Vec<HookEdit> {
    hooks
        .iter()
        .flatten()
        .map(|h| HookEdit {
            stage,
            path: h.path().display().to_string(),
            args: h.args().clone().unwrap_or_default(),
            env: h.env().clone().unwrap_or_default(),
            timeout: h.timeout(),
        })
        .collect()
}

impl CdiResolver {
    /// A resolver over `dirs` (later directories win, as in CDI).
    pub fn new(dirs: Vec<PathBuf>) -> Self {
        let names: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let cache = new_cache(vec![with_spec_dirs(&refs), with_auto_refresh(false)]);
        Self {
            dirs,
            cache,
            stamp: Vec::new(),
            memo: HashMap::new(),
        }
    }

    fn current_stamp(&self) -> Vec<(PathBuf, Option<SystemTime>)> {
        let mut out = Vec::new();
        for d in &self.dirs {
            let Ok(entries) = std::fs::read_dir(d) else { continue };
            for e in entries.flatten() {
                let p = e.path();
                if matches!(p.extension().and_then(|x| x.to_str()), Some("json" | "yaml")) {
                    out.push((p, e.metadata().and_then(|m| m.modified()).ok()));
                }
            }
        }
        out.sort();
        out
    }

    /// The edits for `names` (fully qualified CDI names).
    pub fn resolve(&mut self, names: &[String]) -> Result<Edits, String> {
        let stamp = self.current_stamp();
        if stamp != self.stamp {
            let mut cache = self.cache.lock().map_err(|_| "CDI cache poisoned".to_string())?;
            cache.refresh().map_err(|e| format!("refreshing CDI specs: {e}"))?;
            self.stamp = stamp;
            self.memo.clear();
        }
        if let Some(e) = self.memo.get(names) {
            return Ok(e.clone());
        }
        let mut spec = empty_spec();
        {
            let mut cache = self.cache.lock().map_err(|_| "CDI cache poisoned".to_string())?;
            cache
                .inject_devices(Some(&mut spec), names.to_vec())
                .map_err(|e| e.to_string())?;
        }
        let mut edits = Edits::default();
        if let Some(linux) = spec.linux() {
            for d in linux
                .devices()
                .iter()
                .flatten()
                .filter(|d| !d.path().as_os_str().is_empty())
            {
                edits.devices.push(DeviceEdit {
                    path: d.path().display().to_string(),
                    kind: d.typ().as_str().to_string(),
                    major: d.major(),
                    minor: d.minor(),
                    file_mode: d.file_mode(),
                    uid: d.uid(),
                    gid: d.gid(),
                });
            }
        }
        // The CDI library seeds an empty mount and device entry when the lists start empty.
        for m in spec
            .mounts()
            .iter()
            .flatten()
            .filter(|m| !m.destination().as_os_str().is_empty())
        {
            edits.mounts.push(MountEdit {
                destination: m.destination().display().to_string(),
                source: m.source().as_ref().map(|s| s.display().to_string()).unwrap_or_default(),
                kind: m.typ().clone().unwrap_or_else(|| "bind".into()),
                options: m.options().clone().unwrap_or_default(),
            });
        }
        if let Some(p) = spec.process() {
            edits.env = p.env().clone().unwrap_or_default();
        }
        if let Some(h) = spec.hooks() {
            edits.hooks.extend(hooks_of("prestart", h.prestart()));
            edits.hooks.extend(hooks_of("createRuntime", h.create_runtime()));
            edits.hooks.extend(hooks_of("createContainer", h.create_container()));
            edits.hooks.extend(hooks_of("startContainer", h.start_container()));
            edits.hooks.extend(hooks_of("poststart", h.poststart()));
            edits.hooks.extend(hooks_of("poststop", h.poststop()));
        }
        self.memo.insert(names.to_vec(), edits.clone());
        Ok(edits)
    }
}
