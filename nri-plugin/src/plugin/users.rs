//! MPS serves one user per card: a starting share runs as the user of its card's other shares.
//!
//! A card's MPS daemon runs one server at a time, for one user; a client of another user waits
//! until that server's clients have all gone, and while it waits its card's shares of the first
//! user cannot start new work either. The extender keeps a card's shares to one `runAsUser`,
//! but a pod that sets none runs as its image's user, and DRA's allocator knows no users. So
//! when an MPS share's container starts (its process exists, already switched to its user),
//! its user is read from the host's /proc and compared with the users of the card's other live
//! shares: a different one is refused, naming the share it would lock out. **Open**: a process
//! that switches user later (a root container's `setuid`) is not seen.

use std::path::Path;

use tessera_proto::nri::api;
use tracing::debug;

use super::{Refusal, TesseraPlugin};

/// The effective uid of process `pid`, from `<proc_root>/<pid>/status`.
fn uid_of(proc_root: &Path, pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(proc_root.join(pid.to_string()).join("status")).ok()?;
    let line = status.lines().find_map(|l| l.strip_prefix("Uid:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// A process of container `id`: `pid` when the runtime gave it, else one found by its cgroup.
pub(super) fn process_of(proc_root: &Path, id: &str, pid: u32) -> Option<u32> {
    if pid != 0 {
        return Some(pid);
    }
    std::fs::read_dir(proc_root)
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .find(|p| tessera_node::telemetry::container_of_pid(proc_root, *p, [id]).is_some())
}

impl TesseraPlugin {
    /// StartContainer: refuses an MPS share whose process runs as another user than the live
    /// shares of its card, and notes its user. A container whose process cannot be found starts
    /// (the rule keeps shares from locking each other out; it is no limit).
    pub(super) fn starting(&self, container: &api::Container) -> Result<(), Refusal> {
        let Some(share) = self.books.get(&container.id).and_then(|t| t.mps_share) else {
            return Ok(());
        };
        let Some(uid) =
            process_of(&self.proc_root, &container.id, container.pid).and_then(|p| uid_of(&self.proc_root, p))
        else {
            debug!(
                container = container.id,
                "the starting share's process is not found: its user is not checked"
            );
            return Ok(());
        };
        self.books
            .claim_user(&container.id, &share.uuid, uid)
            .map_err(|(other, other_uid)| Refusal::OtherUser {
                container: container.name.clone(),
                uid,
                card: share.uuid.clone(),
                other_uid,
                other,
            })
    }
}
