//! Where a process's cgroup is, and what the cgroup v2 hierarchy offers.

use std::path::{Path, PathBuf};

/// Why a process's cgroup could not be found.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// Its `/proc/<pid>/cgroup` could not be read (the process is gone, or /proc is not the
    /// host's).
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// It has no cgroup v2 entry (`0::`): the node runs cgroup v1.
    #[error("{0} has no cgroup v2 entry (per-cgroup GPU memory needs cgroup v2)")]
    NotV2(PathBuf),
    /// Its cgroup is outside this process's cgroup namespace (the plugin does not run in the
    /// host's).
    #[error("{path} names {cgroup}, outside this process's cgroup namespace: run it in the host's")]
    OutsideNamespace { path: PathBuf, cgroup: String },
    /// The cgroup's directory is not under the hierarchy's root.
    #[error("cgroup {0} does not exist")]
    Missing(PathBuf),
}

/// The full sysfs path of process `pid`'s cgroup: its cgroup v2 entry in
/// `<proc_root>/<pid>/cgroup`, under `cgroup_root` (the host's `/sys/fs/cgroup`).
pub fn cgroup_of_process(proc_root: &Path, pid: u32, cgroup_root: &Path) -> Result<PathBuf, CgroupError> {
    let path = proc_root.join(pid.to_string()).join("cgroup");
    let text = std::fs::read_to_string(&path).map_err(|source| CgroupError::Read {
        path: path.clone(),
        source,
    })?;
    let cgroup = text
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .ok_or_else(|| CgroupError::NotV2(path.clone()))?;
    if cgroup.split('/').any(|part| part == "..") || !cgroup.starts_with('/') {
        return Err(CgroupError::OutsideNamespace {
            path,
            cgroup: cgroup.to_string(),
        });
    }
    let full = cgroup_root.join(cgroup.trim_start_matches('/'));
    if !full.is_dir() {
        return Err(CgroupError::Missing(full));
    }
    Ok(full)
}

/// The full sysfs path of a container's cgroup: its process `pid`'s cgroup v2 entry, or, where
/// that is outside this process's cgroup namespace (a node agent in a namespace of its own),
/// the runtime's `cgroups_path` for it (`slice:prefix:name` under systemd, else a path) under
/// `cgroup_root`, which must then show the host's whole hierarchy.
pub fn cgroup_of_container(
    proc_root: &Path,
    pid: u32,
    cgroups_path: &str,
    cgroup_root: &Path,
) -> Result<PathBuf, CgroupError> {
    match cgroup_of_process(proc_root, pid, cgroup_root) {
        Err(CgroupError::OutsideNamespace { .. }) if !cgroups_path.is_empty() => {
            let full = cgroup_root.join(runtime_cgroup(cgroups_path).trim_start_matches('/'));
            if full.is_dir() {
                Ok(full)
            } else {
                Err(CgroupError::Missing(full))
            }
        }
        other => other,
    }
}

/// A runtime's `cgroups_path` as a path under the hierarchy's root: systemd's
/// `kubepods-besteffort-pod1.slice:cri-containerd:ID` is
/// `kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1.slice/cri-containerd-ID.scope`.
fn runtime_cgroup(cgroups_path: &str) -> String {
    let parts: Vec<&str> = cgroups_path.split(':').collect();
    let [slice, prefix, name] = parts[..] else {
        return cgroups_path.to_string();
    };
    let mut path = String::new();
    if let Some(stem) = slice.strip_suffix(".slice").filter(|s| !s.is_empty() && *s != "-") {
        let words: Vec<&str> = stem.split('-').collect();
        for n in 1..=words.len() {
            path.push('/');
            path.push_str(&words[..n].join("-"));
            path.push_str(".slice");
        }
    }
    let unit = if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}-{name}")
    };
    format!("{path}/{unit}.scope")
}

/// Whether the kernel's `dmem` controller (Linux 6.14+) is in the hierarchy at `cgroup_root`.
pub fn dmem_controller(cgroup_root: &Path) -> bool {
    std::fs::read_to_string(cgroup_root.join("cgroup.controllers"))
        .is_ok_and(|c| c.split_whitespace().any(|w| w == "dmem"))
}

/// Where this process's mount namespace has the cgroup v2 hierarchy (`/sys/fs/cgroup` on a
/// cgroup v2 host, `/sys/fs/cgroup/unified` on a hybrid one), from `/proc/self/mountinfo`.
pub fn cgroup2_root() -> Option<PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    info.lines().find_map(|l| {
        let (mount, fs) = l.split_once(" - ")?;
        if fs.split_whitespace().next() != Some("cgroup2") {
            return None;
        }
        mount.split_whitespace().nth(4).map(PathBuf::from)
    })
}
