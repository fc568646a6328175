//! The hand-off: what the extender decided for a pod, as the signed pod annotations
//! `tessera.io/allocation` and `tessera.io/allocation-signature`. Every node component derives
//! what a container gets from this and the inventory, and nothing else.

mod keys;
#[cfg(test)]
mod tests;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::mig::MigProfile;
use crate::request::ContainerRole;

pub use keys::{
    ACTIVE_KEY_FILE, KeyDirStamp, KeyError, KeyKind, MIN_KEY_BYTES, SignedAllocation, SigningKeys, VerifyingKeys,
};

/// Version of the allocation format this build writes and reads.
pub const ALLOCATION_VERSION: u32 = 1;

/// One device given to a container.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum AllocatedDevice {
    /// A whole card or a share of one.
    Gpu {
        /// `GPU-<uuid>`.
        uuid: String,
        /// NVML index at bind time.
        index: u32,
        /// Device minor (`/dev/nvidia<minor>`).
        minor: u32,
        /// Guaranteed compute in percent (100 for whole cards; 0 = memory-only share).
        core_percent: u32,
        /// Memory in MiB (the card's total for whole cards).
        memory_mib: u64,
        /// A whole, exclusive card (no limits applied) rather than a share.
        exclusive: bool,
    },
    /// A MIG device.
    Mig {
        /// `MIG-<uuid>`.
        uuid: String,
        /// Its profile.
        profile: MigProfile,
        /// Parent `GPU-<uuid>`.
        parent_uuid: String,
        /// Parent NVML index.
        parent_index: u32,
        /// GPU instance id.
        gi: u32,
        /// Compute instance id.
        ci: u32,
    },
}

impl AllocatedDevice {
    /// All of `gpu`, exclusively.
    pub fn whole(gpu: &crate::inventory::Gpu) -> Self {
        AllocatedDevice::Gpu {
            uuid: gpu.uuid.clone(),
            index: gpu.index,
            minor: gpu.minor,
            core_percent: 100,
            memory_mib: gpu.memory_mib,
            exclusive: true,
        }
    }

    /// A share of `gpu`: `core_percent` of its compute and `memory_mib` of its memory.
    pub fn share(gpu: &crate::inventory::Gpu, core_percent: u32, memory_mib: u64) -> Self {
        AllocatedDevice::Gpu {
            uuid: gpu.uuid.clone(),
            index: gpu.index,
            minor: gpu.minor,
            core_percent,
            memory_mib,
            exclusive: false,
        }
    }

    /// The UUID of the device itself (GPU or MIG).
    pub fn uuid(&self) -> &str {
        match self {
            AllocatedDevice::Gpu { uuid, .. } | AllocatedDevice::Mig { uuid, .. } => uuid,
        }
    }

    /// Whether the device is held exclusively: a whole card or a MIG device (not a share).
    pub fn is_exclusive(&self) -> bool {
        match self {
            AllocatedDevice::Gpu { exclusive, .. } => *exclusive,
            AllocatedDevice::Mig { .. } => true,
        }
    }

    /// The physical card's UUID.
    pub fn card_uuid(&self) -> &str {
        match self {
            AllocatedDevice::Gpu { uuid, .. } => uuid,
            AllocatedDevice::Mig { parent_uuid, .. } => parent_uuid,
        }
    }
}

/// What one container was given.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContainerAllocation {
    /// Container name.
    pub name: String,
    /// Init, sidecar or app: decides which containers share a card at the same time.
    pub role: ContainerRole,
    /// Devices, in the order the container sees them.
    pub devices: Vec<AllocatedDevice>,
}

/// The extender's decision for one pod.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Allocation {
    /// Format version ([`ALLOCATION_VERSION`]).
    pub version: u32,
    /// The node the pod was bound to.
    pub node: String,
    /// The pod's UID.
    pub pod_uid: String,
    /// Hard compute ceiling for shares, from `tessera.io/core-limit`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub core_limit: Option<u32>,
    /// Per container (only containers given a GPU appear).
    pub containers: Vec<ContainerAllocation>,
}

impl Allocation {
    /// A new allocation in the current format.
    pub fn new(node: impl Into<String>, pod_uid: impl Into<String>) -> Self {
        Self {
            version: ALLOCATION_VERSION,
            node: node.into(),
            pod_uid: pod_uid.into(),
            core_limit: None,
            containers: Vec::new(),
        }
    }

    /// The annotation value: compact JSON, field order fixed by the types.
    pub fn encode(&self) -> String {
        serde_json::to_string(self).expect("allocation serializes")
    }

    /// Parses an annotation value: version first (so a newer format gets a clear error), then
    /// the content, then its internal consistency.
    pub fn decode(value: &str) -> Result<Self, HandoffError> {
        #[derive(Deserialize)]
        struct Versioned {
            version: u32,
        }
        let v: Versioned =
            serde_json::from_str(value).map_err(|e| HandoffError::Malformed { reason: e.to_string() })?;
        if v.version != ALLOCATION_VERSION {
            return Err(HandoffError::UnsupportedVersion {
                found: v.version,
                supported: ALLOCATION_VERSION,
            });
        }
        let a: Allocation =
            serde_json::from_str(value).map_err(|e| HandoffError::Malformed { reason: e.to_string() })?;
        a.check()?;
        Ok(a)
    }

    /// The allocation of a container, by name.
    pub fn container(&self, name: &str) -> Option<&ContainerAllocation> {
        self.containers.iter().find(|c| c.name == name)
    }

    fn check(&self) -> Result<(), HandoffError> {
        let bad = |reason: String| Err(HandoffError::Malformed { reason });
        let mut names = std::collections::BTreeSet::new();
        for c in &self.containers {
            if !names.insert(c.name.as_str()) {
                return bad(format!("container {:?} appears twice", c.name));
            }
            let mut seen = std::collections::BTreeSet::new();
            for d in &c.devices {
                if !seen.insert(d.uuid()) {
                    return bad(format!("container {:?} lists device {} twice", c.name, d.uuid()));
                }
                if let AllocatedDevice::Gpu {
                    uuid,
                    core_percent,
                    memory_mib,
                    exclusive,
                    ..
                } = d
                {
                    if *core_percent > 100 || (*exclusive && *core_percent != 100) {
                        return bad(format!(
                            "container {:?}: device {uuid} core_percent={core_percent}",
                            c.name
                        ));
                    }
                    if *core_percent == 0 && *memory_mib == 0 {
                        return bad(format!(
                            "container {:?}: device {uuid} has neither compute nor memory",
                            c.name
                        ));
                    }
                }
            }
        }
        if let Some(l) = self.core_limit
            && !(1..=100).contains(&l)
        {
            return bad(format!("core_limit={l}"));
        }
        Ok(())
    }
}

/// Why a hand-off was refused. Each cause is its own variant so callers (and users reading
/// events) can tell a forgery from a stale or misplaced allocation.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum HandoffError {
    /// The pod has no `tessera.io/allocation` annotation.
    #[error("pod has no {} annotation", crate::names::ANNOTATION_ALLOCATION)]
    Missing,
    /// The allocation is present but unsigned.
    #[error("{} is missing", crate::names::ANNOTATION_ALLOCATION_SIGNATURE)]
    MissingSignature,
    /// The signature annotation is not `v1.<key id>.<mac>` or `v2.<key id>.<signature>`.
    #[error(
        "{}={value:?} is not of the form v1.<key id>.<mac> or v2.<key id>.<signature>",
        crate::names::ANNOTATION_ALLOCATION_SIGNATURE
    )]
    MalformedSignature { value: String },
    /// Signed with a key this node does not have.
    #[error("allocation is signed with unknown key {key_id:?}")]
    UnknownKey { key_id: String },
    /// The MAC does not match: the allocation was altered or forged.
    #[error("allocation signature does not verify with key {key_id:?} (altered or forged)")]
    BadSignature { key_id: String },
    /// Not valid allocation JSON.
    #[error("{} is malformed: {reason}", crate::names::ANNOTATION_ALLOCATION)]
    Malformed { reason: String },
    /// A format version this build does not read.
    #[error("allocation version {found} is not supported (this build reads {supported})")]
    UnsupportedVersion { found: u32, supported: u32 },
    /// The allocation is for another node.
    #[error("allocation is for node {found:?}, not this node {expected:?}")]
    WrongNode { expected: String, found: String },
    /// The allocation is for another pod (copied annotations).
    #[error("allocation is for pod UID {found:?}, not this pod {expected:?}")]
    WrongPod { expected: String, found: String },
}
