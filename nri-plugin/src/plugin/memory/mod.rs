//! A share's GPU memory held on its container's cgroup, where the driver can (r615+).
//!
//! The driver charges every allocation to the cgroup of the process that makes it, so one limit
//! on the container's cgroup holds all its processes together, whatever their count or user,
//! and nothing in the container can lift it. A new cgroup inherits no limit, and the runtime
//! makes the container's cgroup at creation: so the limit is set at StartContainer, when the
//! process exists but has not run the container's program, from the signed allocation (or the
//! DRA record) booked at creation; a container whose limit cannot be set, or does not read
//! back as set, does not start. It is cleared when the container stops (a soft limit left on
//! a cgroup the kernel's dmem controller keeps would protect memory for nothing).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tessera_core::enforcement::ShareLimits;
use tessera_core::granted::CgroupMemory;
use tessera_node::memory_limits::{CgroupMemoryLimits, cgroup_of_container};
use tessera_proto::nri::api;
use tracing::{debug, info, warn};

use super::{MemoryNotHeld, Refusal, TesseraPlugin};

/// The driver's per-cgroup limits and where the host's cgroup v2 hierarchy is.
#[derive(Clone)]
pub(super) struct PerCgroup {
    pub(super) limits: Arc<dyn CgroupMemoryLimits>,
    pub(super) cgroup_root: PathBuf,
}

/// Bytes in `mib` MiB.
fn bytes(mib: u64) -> u64 {
    mib.saturating_mul(1 << 20)
}

impl TesseraPlugin {
    /// The share to hold on the container's cgroup, when this node holds memory per cgroup.
    pub(super) fn cgroup_memory_of(&self, share: Option<&ShareLimits>) -> Option<CgroupMemory> {
        self.per_cgroup.as_ref()?;
        share.map(|s| CgroupMemory {
            uuid: s.uuid.clone(),
            memory_mib: s.memory_mib,
            cgroup: None,
        })
    }

    /// StartContainer: sets the share's memory limit on the container's cgroup and reads it
    /// back; an error refuses the start.
    pub(super) fn limit_memory(&self, container: &api::Container) -> Result<(), Refusal> {
        let (Some(per), Some(mut held)) = (
            self.per_cgroup.as_ref(),
            self.books.get(&container.id).and_then(|t| t.cgroup_memory),
        ) else {
            return Ok(());
        };
        let refuse = |source: MemoryNotHeld| Refusal::Memory {
            container: container.name.clone(),
            memory_mib: held.memory_mib,
            uuid: held.uuid.clone(),
            source: Box::new(source),
        };
        let pid = super::users::process_of(&self.proc_root, &container.id, container.pid)
            .ok_or_else(|| refuse(MemoryNotHeld::NoProcess))?;
        let cgroups_path = container.linux.as_ref().map_or("", |l| l.cgroups_path.as_str());
        let cgroup =
            cgroup_of_container(&self.proc_root, pid, cgroups_path, &per.cgroup_root).map_err(|e| refuse(e.into()))?;
        let want = bytes(held.memory_mib);
        per.limits
            .set(&held.uuid, &cgroup, want, want)
            .map_err(|e| refuse(e.into()))?;
        match per.limits.get(&held.uuid, &cgroup) {
            Ok(Some(got)) if got.hard == want => {}
            Ok(got) => {
                let _ = per.limits.clear(&held.uuid, &cgroup);
                return Err(refuse(MemoryNotHeld::ReadBack {
                    got: got.map_or("no limit".to_string(), |l| format!("a hard limit of {} bytes", l.hard)),
                    want,
                }));
            }
            Err(e) => {
                let _ = per.limits.clear(&held.uuid, &cgroup);
                return Err(refuse(e.into()));
            }
        }
        info!(
            container = container.name,
            uuid = held.uuid,
            memory_mib = held.memory_mib,
            cgroup = %cgroup.display(),
            "the share's memory is held on its container's cgroup"
        );
        held.cgroup = Some(cgroup);
        self.books.update(&container.id, |t| t.cgroup_memory = Some(held));
        Ok(())
    }

    /// Clears container `id`'s limit, if one was set (Stop, and Remove when no Stop came).
    pub(super) fn unlimit_memory(&self, id: &str, held: Option<CgroupMemory>) {
        let (Some(per), Some(held)) = (self.per_cgroup.as_ref(), held) else {
            return;
        };
        let Some(cgroup) = held.cgroup.as_deref() else {
            return;
        };
        clear(per, id, &held.uuid, cgroup);
        self.books.update(id, |t| {
            if let Some(m) = t.cgroup_memory.as_mut() {
                m.cgroup = None;
            }
        });
    }
}

fn clear(per: &PerCgroup, id: &str, uuid: &str, cgroup: &Path) {
    match per.limits.clear(uuid, cgroup) {
        Ok(()) => debug!(container = id, cgroup = %cgroup.display(), "the share's memory limit is cleared"),
        // A removed cgroup takes its limits with it.
        Err(e) if !cgroup.exists() => debug!(container = id, error = %e, "the container's cgroup is gone"),
        Err(e) => warn!(container = id, error = %e, "cannot clear the container's GPU memory limit"),
    }
}

#[cfg(test)]
mod tests;
