//! What the GPUs are doing now: per card its memory and SM use, and the processes on it with
//! theirs. Two sources sit behind [`TelemetrySource`]: [`NvmlTelemetry`] (the driver) and
//! [`FixtureTelemetry`] (a YAML file, for tests and GPU-less machines). [`container_of_pid`]
//! attributes a process to a container through its cgroup.

mod nvml;
pub mod xid;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use nvml::NvmlTelemetry;

/// One process using a card.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProcessSample {
    /// Host pid.
    pub pid: u32,
    /// GPU memory it holds, MiB.
    #[serde(default)]
    pub memory_mib: u64,
    /// Its share of the card's SMs over the last sample, percent.
    #[serde(default)]
    pub sm_percent: u32,
}

/// One card now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuSample {
    /// NVML index.
    pub index: u32,
    /// `GPU-<uuid>`.
    pub uuid: String,
    /// Model name.
    pub model: String,
    /// Total memory, MiB.
    pub memory_total_mib: u64,
    /// Memory in use, MiB.
    pub memory_used_mib: u64,
    /// SM utilization over the last sample, percent.
    pub sm_percent: u32,
    /// The card answers (NVML reads succeed).
    #[serde(default = "answers")]
    pub healthy: bool,
    /// Critical XID errors seen since the source started.
    #[serde(default)]
    pub xid_errors: u64,
    /// Processes with a context on it.
    #[serde(default)]
    pub processes: Vec<ProcessSample>,
}

fn answers() -> bool {
    true
}

/// Anything that can tell what the cards are doing.
pub trait TelemetrySource: Send + Sync {
    /// A sample of every card.
    fn sample(&self) -> Result<Vec<GpuSample>, String>;
}

/// Samples from a YAML file (`gpus: [ { index, uuid, model, memory_total_mib, memory_used_mib,
/// sm_percent, processes: [ { pid, memory_mib, sm_percent } ] } ]`), re-read on every sample so a test can change it.
#[derive(Debug, Clone)]
pub struct FixtureTelemetry {
    /// The file.
    pub path: PathBuf,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TelemetryFile {
    gpus: Vec<GpuSample>,
}

impl TelemetrySource for FixtureTelemetry {
    fn sample(&self) -> Result<Vec<GpuSample>, String> {
        let text = std::fs::read_to_string(&self.path).map_err(|e| format!("{}: {e}", self.path.display()))?;
        let f: TelemetryFile = serde_yaml::from_str(&text).map_err(|e| format!("{}: {e}", self.path.display()))?;
        Ok(f.gpus)
    }
}

/// The container (one of `containers`, by id) that process `pid` runs in, from its cgroup
/// (`<proc_root>/<pid>/cgroup`): runtimes name the container's cgroup after its id
/// (`cri-containerd-<id>.scope`, `crio-<id>.scope`, `.../<id>` with cgroupfs).
pub fn container_of_pid<'a>(
    proc_root: &Path,
    pid: u32,
    containers: impl IntoIterator<Item = &'a str>,
) -> Option<&'a str> {
    let cgroup = std::fs::read_to_string(proc_root.join(pid.to_string()).join("cgroup")).ok()?;
    let path = cgroup.lines().find_map(|l| l.splitn(3, ':').nth(2))?;
    let leaf = path.rsplit('/').next().unwrap_or(path);
    containers.into_iter().find(|id| {
        !id.is_empty() && (leaf == *id || leaf.ends_with(&format!("-{id}.scope")) || path.contains(&format!("/{id}/")))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn processes_map_to_containers_by_cgroup() {
        let proc = tempfile::tempdir().unwrap();
        let write = |pid: u32, text: &str| {
            std::fs::create_dir_all(proc.path().join(pid.to_string())).unwrap();
            std::fs::write(proc.path().join(pid.to_string()).join("cgroup"), text).unwrap();
        };
        let (a, b, c) = ("aaaa1111", "bbbb2222", "cccc3333");
        // containerd with systemd cgroups (v2), CRI-O, cgroupfs driver (v1 lines).
        write(
            10,
            "0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-aaaa1111.scope\n",
        );
        write(11, "0::/kubepods.slice/kubepods-besteffort.slice/crio-bbbb2222.scope\n");
        write(
            12,
            "12:memory:/kubepods/burstable/pod9/cccc3333\n11:cpu:/kubepods/burstable/pod9/cccc3333\n",
        );
        write(13, "0::/system.slice/nvidia-persistenced.service\n");
        let ids = [a, b, c];
        assert_eq!(container_of_pid(proc.path(), 10, ids), Some(a));
        assert_eq!(container_of_pid(proc.path(), 11, ids), Some(b));
        assert_eq!(container_of_pid(proc.path(), 12, ids), Some(c));
        assert_eq!(container_of_pid(proc.path(), 13, ids), None, "not a container");
        assert_eq!(container_of_pid(proc.path(), 99, ids), None, "gone");
    }

    #[test]
    fn fixture_samples_are_read_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.yaml");
        std::fs::write(
            &path,
            "gpus:\n  - { index: 0, uuid: GPU-1, model: T4, memory_total_mib: 15360, memory_used_mib: 9000, sm_percent: 40, processes: [ { pid: 7, memory_mib: 8000, sm_percent: 30 } ] }\n",
        )
        .unwrap();
        let s = FixtureTelemetry { path: path.clone() }.sample().unwrap();
        assert_eq!(
            s[0].processes[0],
            ProcessSample {
                pid: 7,
                memory_mib: 8000,
                sm_percent: 30
            }
        );
        std::fs::write(
            &path,
            "gpus: [ { index: 0, uuid: GPU-1, model: T4, memory_total_mib: 1, memory_used: 1, sm_percent: 0 } ]\n",
        )
        .unwrap();
        assert!(FixtureTelemetry { path }.sample().unwrap_err().contains("memory_used"));
    }
}
