//! What the node granted its live containers, kept where the node agents can read it.
//!
//! The NRI plugin writes one record per container it gave GPUs to, from what it verified at
//! creation (the signed allocation or the DRA record, never the container's environment), and
//! removes it when the container goes. These records are the node's own truth about who uses
//! which card now: after a plugin or runtime restart the plugin rebuilds its books and each
//! card's MPS ceiling from them, and the DRA plugin reads them before it prepares a claim, so
//! a card stays held while a live container uses it, even after that container's claim was
//! unprepared. The decisions that read them are here: [`double_grant`] at container creation
//! and [`check_card_use`] at a claim's preparation.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::enforcement::ShareLimits;
use crate::handoff::AllocatedDevice;

/// Where the NRI plugin keeps its grant records on the host by default (a tmpfs: containers do
/// not outlive a reboot, and neither do their records).
pub const DEFAULT_GRANTS_DIR: &str = "/run/tessera/grants";

/// One live container's grant.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Granted {
    /// Injected UUIDs, comma-separated (as in the `tessera.io/injected` annotation).
    pub uuids: String,
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub pod: String,
    /// Pod UID.
    #[serde(default)]
    pub pod_uid: String,
    /// Container name.
    pub container: String,
    /// Its devices, as verified at creation.
    pub devices: Vec<AllocatedDevice>,
    /// Stopped (exited or killed) but not removed yet: it holds no GPU any more (an init
    /// container that finished, a completed Job's container).
    #[serde(default)]
    pub stopped: bool,
    /// An MPS share: its limits, which its card's daemon ceiling must cover.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mps_share: Option<ShareLimits>,
    /// The DRA claims (uids) its devices come from, each with the UUIDs it gives.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub claims: BTreeMap<String, Vec<String>>,
    /// The user its process runs as, once seen at start (MPS serves one user per card).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<u32>,
    /// A share whose memory the driver holds on the container's cgroup (r615+).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup_memory: Option<CgroupMemory>,
    /// A share on a `hook` node: its window of the card's time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<crate::windows::CardWindow>,
}

/// A share's memory as the driver holds it on the container's cgroup: set when its process
/// starts, cleared when it stops.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CgroupMemory {
    /// The card.
    pub uuid: String,
    /// The share's memory, MiB.
    pub memory_mib: u64,
    /// The cgroup (full sysfs path) whose limit is set, once set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<PathBuf>,
}

impl Granted {
    /// `namespace/pod`.
    pub fn pod_key(&self) -> String {
        format!("{}/{}", self.namespace, self.pod)
    }

    /// Whether it holds device `uuid` through claim `claim`.
    fn holds_through(&self, claim: &str, uuid: &str) -> bool {
        self.claims.get(claim).is_some_and(|u| u.iter().any(|x| x == uuid))
    }
}

/// The exclusive use of a device: a whole card or a MIG device.
fn exclusive(d: &AllocatedDevice) -> bool {
    match d {
        AllocatedDevice::Gpu { exclusive, .. } => *exclusive,
        AllocatedDevice::Mig { .. } => true,
    }
}

/// Why granting `devices` to container `container` of pod `pod_uid` would hand out a device a
/// live container of another pod holds: a whole card or MIG device held by anyone, or a card
/// held whole. The extender never books that; a node that sees it (books gone wrong, a
/// replayed or forged record, a claim deallocated while its container still runs) refuses
/// rather than share an exclusive device. A pod's own containers may reuse its cards (an init
/// container's card, once it has finished); containers given a whole card through the same DRA
/// claim (`claims`: claim uid -> UUIDs it gives) share it by design, but a share claim serves
/// one live container at a time, since its limits hold for one container. Pods are told apart
/// by UID, not name: a recreated StatefulSet pod is another pod.
pub fn double_grant<'a>(
    live: impl IntoIterator<Item = (&'a str, &'a Granted)>,
    pod_uid: &str,
    container: &str,
    devices: &[AllocatedDevice],
    claims: &BTreeMap<String, Vec<String>>,
) -> Option<String> {
    for (held, t) in live.into_iter().filter(|(_, t)| !t.stopped) {
        // A share's limits are one container's: a share claim serves one live container at a
        // time, whatever pod it is in (two would each be held to the whole share).
        for d in devices.iter().filter(|d| !exclusive(d)) {
            let uuid = d.uuid();
            if let Some((claim, _)) = claims
                .iter()
                .find(|(claim, uuids)| uuids.iter().any(|u| u == uuid) && t.holds_through(claim, uuid))
            {
                return Some(format!(
                    "container {container:?}: the share of {uuid} that claim {claim} gives is used by container {} of pod {} \
                     ({held}); a share claim serves one container at a time (its limits hold for one container), so \
                     give each container a claim of its own",
                    t.container,
                    t.pod_key(),
                ));
            }
        }
        if !t.pod_uid.is_empty() && t.pod_uid == pod_uid {
            continue;
        }
        for d in devices {
            let uuid = d.uuid();
            let shared_claim = claims
                .iter()
                .any(|(claim, uuids)| uuids.iter().any(|u| u == uuid) && t.holds_through(claim, uuid));
            if shared_claim {
                continue;
            }
            let held_whole = t.devices.iter().any(|h| h.uuid() == uuid && exclusive(h));
            let holds = t.devices.iter().any(|h| h.uuid() == uuid);
            if holds && (exclusive(d) || held_whole) {
                return Some(format!(
                    "container {container:?}: {uuid} is held by container {} of pod {} ({held}) on this node{}; \
                     refusing a second grant of it (the extender's books and this node disagree)",
                    t.container,
                    t.pod_key(),
                    if held_whole { " as a whole card" } else { "" },
                ));
            }
        }
    }
    None
}

/// Who uses a card, as a claim's preparation must know it: a recorded claim or a live
/// container, whole or by a share, and its tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CardUse {
    /// The device's UUID (a card, or a MIG device).
    pub uuid: String,
    /// Held exclusively (a whole card, a MIG device).
    pub whole: bool,
    /// The tenant.
    pub tenant: String,
    /// The claim it comes through, if any.
    pub claim: Option<String>,
    /// Who, for people (`claim team-a/share`, `container main of pod team-a/trainer`).
    pub by: String,
}

impl CardUse {
    /// The uses of the devices of `t`, a live container of tenant `tenant`.
    pub fn of_container(t: &Granted, tenant: &str) -> Vec<CardUse> {
        if t.stopped {
            return Vec::new();
        }
        t.devices
            .iter()
            .map(|d| CardUse {
                uuid: d.uuid().to_string(),
                whole: exclusive(d),
                tenant: tenant.to_string(),
                claim: t
                    .claims
                    .iter()
                    .find(|(_, u)| u.iter().any(|x| x == d.uuid()))
                    .map(|(c, _)| c.clone()),
                by: format!("container {} of pod {}", t.container, t.pod_key()),
            })
            .collect()
    }

    /// The uses of the devices of `claim`, a recorded claim of tenant `tenant`.
    pub fn of_claim(claim: &crate::dra::PreparedClaim, tenant: &str) -> Vec<CardUse> {
        claim
            .devices
            .iter()
            .map(|d| CardUse {
                uuid: d.allocated.uuid().to_string(),
                whole: exclusive(&d.allocated),
                tenant: tenant.to_string(),
                claim: Some(claim.uid.clone()),
                by: format!("claim {}", claim.key()),
            })
            .collect()
    }
}

/// Refuses claim `claim` of tenant `tenant` when a device it would get is in use by anything
/// but the claim itself (`uses`: the node's other recorded claims and its live containers): a
/// whole card or MIG device used at all, a share of a card used whole, or (unless
/// `cross_tenant`, the node's opt-in [`crate::names::LABEL_CROSS_TENANT_SHARING`]) a share of
/// a card serving another tenant's shares. The scheduler's allocator sees neither tenants nor
/// containers that outlive their claim's allocation, so the node holds these at preparation;
/// the claim's pod waits, and the kubelet asks again.
pub fn check_card_use(
    claim: &crate::dra::PreparedClaim,
    tenant: &str,
    uses: &[CardUse],
    cross_tenant: bool,
) -> Result<(), String> {
    for d in &claim.devices {
        let uuid = d.allocated.uuid();
        let whole = exclusive(&d.allocated);
        for u in uses
            .iter()
            .filter(|u| u.uuid == uuid && u.claim.as_deref() != Some(claim.uid.as_str()))
        {
            if whole || u.whole {
                return Err(format!(
                    "claim {}: {uuid} is in use by {}{}; it is prepared once that is gone",
                    claim.key(),
                    u.by,
                    if u.whole { " as a whole device" } else { "" }
                ));
            }
            if !cross_tenant && u.tenant != tenant {
                return Err(format!(
                    "claim {}: card {uuid} already serves shares of tenant {:?} ({}); a card's shares go to one \
                     tenant (label the node {}=true to share cards between tenants)",
                    claim.key(),
                    u.tenant,
                    u.by,
                    crate::names::LABEL_CROSS_TENANT_SHARING
                ));
            }
        }
    }
    Ok(())
}

/// The grant records: one JSON file per container id, for root only.
#[derive(Debug, Clone)]
pub struct GrantStore {
    dir: PathBuf,
}

impl Default for GrantStore {
    /// The records under [`DEFAULT_GRANTS_DIR`].
    fn default() -> Self {
        Self::new(DEFAULT_GRANTS_DIR)
    }
}

/// Whether `s` can be a container id as runtimes make them (safe as a file name).
fn is_container_id(s: &str) -> bool {
    !s.is_empty() && s.len() <= 128 && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

impl GrantStore {
    /// The records under `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// The records' directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, id: &str) -> std::io::Result<PathBuf> {
        if is_container_id(id) {
            Ok(self.dir.join(format!("{id}.json")))
        } else {
            Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("container id {id:?} is not one a runtime makes"),
            ))
        }
    }

    /// Records container `id`'s grant (replacing an earlier record).
    pub fn put(&self, id: &str, granted: &Granted) -> std::io::Result<()> {
        let text = serde_json::to_vec(granted).map_err(std::io::Error::other)?;
        crate::files::write_atomic(&self.dir, &self.path(id)?, &text, 0o700, 0o600)
    }

    /// Container `id`'s grant, if recorded.
    pub fn get(&self, id: &str) -> std::io::Result<Option<Granted>> {
        match std::fs::read(self.path(id)?) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("container {id}: {e}"))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Forgets container `id` (no error when it was not recorded).
    pub fn remove(&self, id: &str) -> std::io::Result<()> {
        match std::fs::remove_file(self.path(id)?) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            Err(_) => Ok(()),
            Ok(()) => crate::files::sync_dir(&self.dir),
        }
    }

    /// Every record (container id -> grant); unreadable ones are named in the second list.
    pub fn list(&self) -> (BTreeMap<String, Granted>, Vec<String>) {
        let (mut out, mut bad) = (BTreeMap::new(), Vec::new());
        for e in std::fs::read_dir(&self.dir).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(id) = name.strip_suffix(".json").filter(|id| is_container_id(id)) else {
                continue;
            };
            match self.get(id) {
                Ok(Some(g)) => {
                    out.insert(id.to_string(), g);
                }
                Ok(None) => {}
                Err(err) => bad.push(format!("{}: {err}", e.path().display())),
            }
        }
        (out, bad)
    }

    /// Forgets every container not in `live` (after a restart: removals missed meanwhile).
    pub fn retain(&self, live: &std::collections::HashSet<String>) {
        let (all, _) = self.list();
        for id in all.keys().filter(|id| !live.contains(*id)) {
            let _ = self.remove(id);
        }
    }
}

#[cfg(test)]
mod tests;
