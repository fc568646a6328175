//! The `tessera.io/inventory` node annotation: what the extender needs of a node's inventory.

use serde::{Deserialize, Serialize};

use super::{Gpu, InventoryError, NodeInventory};
use crate::enforcement::ShareEnforcement;
use crate::topology::GpuTopology;

/// Current version of the published inventory format.
pub const INVENTORY_VERSION: u32 = 1;

/// The inventory as published on the Node object (GPUs only: the cluster needs no driver paths).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublishedInventory {
    /// Format version; readers reject versions they do not know.
    pub version: u32,
    /// Kernel driver version.
    pub driver_version: String,
    /// GPUs with their health and MIG devices.
    pub gpus: Vec<Gpu>,
    /// Why the node cannot run GPU containers although it has GPUs (its driver's files are
    /// unusable: no libcuda); the extender places no GPU pod there while this is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_ready: Option<String>,
    /// How the node holds shares to their limits (`unknown` for nodes that do not say).
    #[serde(default)]
    pub share_enforcement: ShareEnforcement,
    /// How the GPUs are connected (row i = `gpus[i]`); one of a version this build cannot read
    /// is taken as absent, not as a broken inventory.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "crate::topology::deserialize_lenient"
    )]
    pub topology: Option<GpuTopology>,
    /// How the driver holds share containers' GPU memory (absent: the node did not say).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share_memory: Option<ShareMemory>,
}

/// Whether a node's driver holds each container's GPU memory on its cgroup (NVIDIA r615+), and
/// what the node found (the driver's version and backend, or why not).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShareMemory {
    /// The driver sets limits per cgroup.
    pub per_cgroup: bool,
    /// The node's words, e.g. `per cgroup (driver 615.29.01, the kernel's dmem controller)`.
    pub detail: String,
}

impl PublishedInventory {
    /// The published view of an inventory; not ready when its driver check fails.
    pub fn of(inventory: &NodeInventory) -> Self {
        Self {
            version: INVENTORY_VERSION,
            driver_version: inventory.driver_version.clone(),
            gpus: inventory.gpus.clone(),
            not_ready: inventory.driver_check().err(),
            share_enforcement: ShareEnforcement::Unknown,
            topology: inventory.topology.clone(),
            share_memory: None,
        }
    }

    /// The same, saying how the driver holds share memory.
    pub fn holding_share_memory(mut self, held: Option<ShareMemory>) -> Self {
        self.share_memory = held;
        self
    }

    /// The same, saying how the node enforces shares.
    pub fn enforced_by(mut self, mode: ShareEnforcement) -> Self {
        self.share_enforcement = mode;
        self
    }

    /// Encodes the annotation value.
    pub fn encode(&self) -> String {
        serde_json::to_string(self).expect("inventory serializes")
    }

    /// Decodes an annotation value, rejecting unknown versions.
    pub fn decode(value: &str) -> Result<Self, InventoryError> {
        #[derive(Deserialize)]
        struct Versioned {
            version: u32,
        }
        let invalid = |reason: String| InventoryError::Invalid {
            field: crate::names::ANNOTATION_INVENTORY.to_string(),
            value: value.chars().take(80).collect(),
            reason,
        };
        let v: Versioned = serde_json::from_str(value).map_err(|e| invalid(e.to_string()))?;
        if v.version != INVENTORY_VERSION {
            return Err(invalid(format!(
                "unsupported version {} (this build reads {INVENTORY_VERSION})",
                v.version
            )));
        }
        serde_json::from_str(value).map_err(|e| invalid(e.to_string()))
    }
}
