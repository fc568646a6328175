//! The node's GPU inventory: cards, MIG devices, device nodes and driver files.
//!
//! Two sources sit behind [`InventorySource`]: `tessera_node`'s NVML source (real hardware)
//! and [`FixtureSource`] (a YAML file describing a fake node, for tests and machines without a
//! GPU).

mod annotation;
mod error;
mod fixture;
mod mig_error;
mod mig_minors;

use std::collections::BTreeSet;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::mig::MigProfile;
use crate::topology::GpuTopology;

pub use crate::driver::{DriverFile, DriverFileKind, FoundBy};
pub use annotation::{INVENTORY_VERSION, PublishedInventory, ShareMemory};
pub use error::InventoryError;
pub use fixture::{BUILTIN_FIXTURES, Fixture, FixtureMigInstances, FixtureSource, HealthEvent, cap_path};
pub use mig_error::MigError;
pub use mig_minors::{MIG_MINORS_PATH, MigMinors};

/// Anything that can tell what GPUs a node has.
pub trait InventorySource {
    /// Reads the node's inventory now.
    fn discover(&self) -> Result<NodeInventory, InventoryError>;
}

/// Creates and destroys MIG instances on the node's cards (dynamic MIG): NVML on a node
/// with GPUs (`tessera_node`), [`FixtureMigInstances`] on a fixture node.
pub trait MigPartitioner: Send + Sync {
    /// Creates a GPU instance of NVML profile `profile_id` at `placement` on card
    /// `parent_uuid`, with one compute instance covering it.
    fn create(&self, parent_uuid: &str, profile_id: u32, placement: MigPlacement) -> Result<MadeInstance, MigError>;

    /// Destroys GPU instance `gi` of card `parent_uuid` and its compute instances when it is
    /// still MIG device `uuid`, or, having lost its compute instances, still of NVML profile
    /// `profile_id` at `placement` (done when it is gone already, or the id now names another
    /// instance: ids are reused).
    fn destroy(
        &self,
        parent_uuid: &str,
        gi: u32,
        uuid: &str,
        profile_id: u32,
        placement: MigPlacement,
    ) -> Result<(), MigError>;
}

/// A character device node.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct DeviceNode {
    /// Path, the same on the host and in the container (`/dev/nvidia0`).
    pub path: PathBuf,
    /// Major number.
    pub major: u32,
    /// Minor number.
    pub minor: u32,
}

/// Whether a GPU may be handed out.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "lowercase")]
pub enum Health {
    /// Usable.
    #[default]
    Healthy,
    /// Not usable, with why (e.g. "XID 79").
    Unhealthy {
        /// What made it unhealthy.
        reason: String,
    },
}

impl Health {
    /// True when healthy.
    pub fn is_healthy(&self) -> bool {
        matches!(self, Health::Healthy)
    }
}

/// One MIG device (a compute instance inside a GPU instance).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigDevice {
    /// Position among the parent's MIG devices (`<gpu>:<index>` in CDI names).
    pub index: u32,
    /// `MIG-<uuid>`.
    pub uuid: String,
    /// GPU instance id.
    pub gi: u32,
    /// Compute instance id.
    pub ci: u32,
    /// Profile, e.g. `1g.10gb`.
    pub profile: MigProfile,
    /// Memory in MiB.
    pub memory_mib: u64,
    /// `/dev/nvidia-caps/nvidia-cap<m>` for GI access.
    pub gi_access: DeviceNode,
    /// `/dev/nvidia-caps/nvidia-cap<m>` for CI access.
    pub ci_access: DeviceNode,
    /// Where its GPU instance sits on the card, when the source knows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<MigPlacement>,
}

/// A MIG instance just created: a GPU instance with one compute instance covering it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MadeInstance {
    /// GPU instance id.
    pub gi: u32,
    /// Compute instance id.
    pub ci: u32,
    /// `MIG-<uuid>`.
    pub uuid: String,
}

/// Where a GPU instance sits on its card: memory slices `start..start + size`
/// (`nvmlGpuInstancePlacement_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct MigPlacement {
    /// First memory slice.
    pub start: u32,
    /// Memory slices.
    pub size: u32,
}

impl MigPlacement {
    /// The memory slices it covers.
    pub fn slices(&self) -> std::ops::Range<u32> {
        self.start..self.start.saturating_add(self.size)
    }

    /// True when the two share a memory slice.
    pub fn overlaps(&self, other: &MigPlacement) -> bool {
        self.start < other.start.saturating_add(other.size) && other.start < self.start.saturating_add(self.size)
    }
}

/// A GPU instance profile a card in MIG mode can create, as NVML describes it
/// (`nvmlGpuInstanceProfileInfo_t` and `nvmlDeviceGetGpuInstancePossiblePlacements_v2`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigProfileInfo {
    /// The profile (`3g.20gb`), named as NVIDIA names it.
    pub profile: MigProfile,
    /// NVML's GPU instance profile id (`nvmlGpuInstanceProfileInfo_t.id`).
    pub id: u32,
    /// Memory of an instance, MiB.
    pub memory_mib: u64,
    /// Compute (GPU) slices of an instance (`sliceCount`).
    pub slices: u32,
    /// Video decoders of an instance.
    #[serde(default)]
    pub decoders: u32,
    /// Video encoders of an instance.
    #[serde(default)]
    pub encoders: u32,
    /// JPEG decoders of an instance.
    #[serde(default)]
    pub jpeg_decoders: u32,
    /// Optical flow accelerators of an instance.
    #[serde(default)]
    pub ofas: u32,
    /// Where an instance can be created.
    pub placements: Vec<MigPlacement>,
}

/// One physical GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gpu {
    /// NVML index.
    pub index: u32,
    /// Device minor (`/dev/nvidia<minor>`).
    pub minor: u32,
    /// `GPU-<uuid>`.
    pub uuid: String,
    /// Model name as NVML reports it (`NVIDIA A100-SXM4-40GB`).
    pub model: String,
    /// Total memory in MiB.
    pub memory_mib: u64,
    /// NUMA node, when known.
    pub numa_node: Option<u32>,
    /// The CPUs close to it, as a Linux CPU list (`0-31,64-95`), when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_affinity: Option<String>,
    /// PCI bus id (`0000:07:00.0`).
    pub pci_bus_id: String,
    /// Health.
    #[serde(default)]
    pub health: Health,
    /// `/dev/nvidia<minor>`.
    pub device: DeviceNode,
    /// MIG mode is on: the card is not offered whole.
    #[serde(default)]
    pub mig_enabled: bool,
    /// MIG devices (only when `mig_enabled`).
    #[serde(default)]
    pub mig_devices: Vec<MigDevice>,
    /// The GPU instance profiles it can create (only when `mig_enabled`; empty when the source
    /// does not say).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mig_profiles: Vec<MigProfileInfo>,
    /// The card's compute mode (`None`: the source did not say).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_mode: Option<ComputeMode>,
}

/// A card's compute mode, as NVML names it (`nvmlComputeMode_t`). In `default` mode any
/// process may open its own context on the card: on a node that holds shares with MPS, a
/// process that does not go through the card's MPS daemon (an empty
/// `CUDA_MPS_PIPE_DIRECTORY`) gets the card whole. In `exclusive-process` mode the MPS
/// daemon is the card's one context and every CUDA process goes through it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ComputeMode {
    /// Any number of contexts, from any process.
    Default,
    /// One context per thread (deprecated by NVIDIA).
    ExclusiveThread,
    /// No contexts at all.
    Prohibited,
    /// One process's contexts (the MPS server's, under MPS).
    ExclusiveProcess,
}

impl std::fmt::Display for ComputeMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Default => "default",
            Self::ExclusiveThread => "exclusive-thread",
            Self::Prohibited => "prohibited",
            Self::ExclusiveProcess => "exclusive-process",
        })
    }
}

impl Gpu {
    /// True when `constraint` (one entry of `tessera.io/gpu-model`) names this GPU's model:
    /// equal ignoring case and a leading `NVIDIA `, or a prefix of it ending at `-` or a space
    /// (`A100` matches `NVIDIA A100-SXM4-40GB`, not `A1000`).
    pub fn model_matches(&self, constraint: &str) -> bool {
        model_matches(&self.model, constraint)
    }
}

/// See [`Gpu::model_matches`].
pub fn model_matches(model: &str, constraint: &str) -> bool {
    // NVML names carry a brand prefix ("NVIDIA A100-SXM4-40GB", "Tesla T4"); users write
    // either the full name or the model ("A100", "T4").
    let strip = |s: &str| {
        let s = s.trim().to_ascii_lowercase();
        ["nvidia ", "tesla "]
            .iter()
            .find_map(|p| s.strip_prefix(p).map(str::to_string))
            .unwrap_or(s)
    };
    let c = strip(constraint);
    if c.is_empty() {
        return false;
    }
    let full = model.trim().to_ascii_lowercase();
    [full.clone(), strip(&full)]
        .iter()
        .any(|m| *m == c || (m.starts_with(&c) && matches!(m.as_bytes()[c.len()], b'-' | b' ')))
}

/// Everything a node component needs to know about the node's GPUs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInventory {
    /// Kernel driver version (`550.54.15`).
    pub driver_version: String,
    /// CUDA driver API version (`12.4`), when known.
    pub cuda_version: Option<String>,
    /// GPUs, by index.
    pub gpus: Vec<Gpu>,
    /// Control device nodes: nvidiactl, nvidia-uvm, nvidia-uvm-tools, nvidia-modeset.
    pub control_devices: Vec<DeviceNode>,
    /// Host directory the driver files live under (`/` on a normal host, `/run/nvidia/driver`
    /// with the GPU operator's driver container).
    pub driver_root: PathBuf,
    /// Driver files to mount read-only.
    pub driver_files: Vec<DriverFile>,
    /// Why the driver's files cannot serve GPU containers, when the source found out (NVML's
    /// driver search: no libcuda, a libcuda of another version).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver_error: Option<String>,
    /// How the GPUs are connected (row i = `gpus[i]`), when the source knows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topology: Option<GpuTopology>,
}

impl NodeInventory {
    /// Host path of a driver file.
    pub fn host_path(&self, file: &DriverFile) -> PathBuf {
        file.host_path(&self.driver_root)
    }

    /// Whether GPU containers can run with this inventory's driver files: the source's own
    /// finding, and in any case a libcuda among the libraries. The error is for operators.
    pub fn driver_check(&self) -> Result<(), String> {
        if let Some(e) = &self.driver_error {
            return Err(e.clone());
        }
        let libcuda = self
            .driver_files
            .iter()
            .any(|f| f.kind == DriverFileKind::Library && f.stem().as_deref() == Some("libcuda"));
        if libcuda {
            Ok(())
        } else {
            Err(format!(
                "no libcuda among the {} driver file(s) under driver root {}: GPU containers could not run CUDA",
                self.driver_files.len(),
                self.driver_root.display()
            ))
        }
    }

    /// The link between `gpus[a]` and `gpus[b]`: from the topology, else their NUMA nodes.
    pub fn link(&self, a: usize, b: usize) -> Option<crate::topology::Link> {
        crate::topology::link_between(self.topology.as_ref(), |i| self.gpus.get(i)?.numa_node, a, b)
    }

    /// The GPU with this UUID.
    pub fn gpu_by_uuid(&self, uuid: &str) -> Option<&Gpu> {
        self.gpus.iter().find(|g| g.uuid == uuid)
    }

    /// The MIG device with this UUID and its parent.
    pub fn mig_by_uuid(&self, uuid: &str) -> Option<(&Gpu, &MigDevice)> {
        self.gpus
            .iter()
            .find_map(|g| g.mig_devices.iter().find(|m| m.uuid == uuid).map(|m| (g, m)))
    }

    /// Every device node the inventory names (control, GPUs, MIG capabilities).
    pub fn all_device_nodes(&self) -> BTreeSet<&DeviceNode> {
        let mut nodes: BTreeSet<&DeviceNode> = self.control_devices.iter().collect();
        for g in &self.gpus {
            nodes.insert(&g.device);
            for m in &g.mig_devices {
                nodes.insert(&m.gi_access);
                nodes.insert(&m.ci_access);
            }
        }
        nodes
    }

    /// Checks the invariants every consumer relies on; the error names the field and value.
    pub fn validate(&self) -> Result<(), InventoryError> {
        let invalid = |field: String, value: String, reason: &str| InventoryError::Invalid {
            field,
            value,
            reason: reason.to_string(),
        };
        let mut indices = BTreeSet::new();
        let mut minors = BTreeSet::new();
        let mut uuids = BTreeSet::new();
        for (i, g) in self.gpus.iter().enumerate() {
            let at = |f: &str| format!("gpus[{i}].{f}");
            if !indices.insert(g.index) {
                return Err(invalid(at("index"), g.index.to_string(), "duplicate GPU index"));
            }
            if !minors.insert(g.minor) {
                return Err(invalid(at("minor"), g.minor.to_string(), "duplicate device minor"));
            }
            if !g.uuid.starts_with("GPU-") || !uuids.insert(g.uuid.clone()) {
                return Err(invalid(at("uuid"), g.uuid.clone(), "must be a unique GPU-<uuid>"));
            }
            if g.memory_mib == 0 {
                return Err(invalid(at("memory_mib"), "0".into(), "must be positive"));
            }
            if !g.mig_enabled && !g.mig_devices.is_empty() {
                return Err(invalid(
                    at("mig_devices"),
                    g.mig_devices.len().to_string(),
                    "MIG devices on a GPU without MIG mode",
                ));
            }
            let mut ids = BTreeSet::new();
            let mut mig_indices = BTreeSet::new();
            for (j, m) in g.mig_devices.iter().enumerate() {
                let at = |f: &str| format!("gpus[{i}].mig_devices[{j}].{f}");
                if !m.uuid.starts_with("MIG-") || !uuids.insert(m.uuid.clone()) {
                    return Err(invalid(at("uuid"), m.uuid.clone(), "must be a unique MIG-<uuid>"));
                }
                if !ids.insert((m.gi, m.ci)) {
                    return Err(invalid(
                        at("ci"),
                        format!("gi {} ci {}", m.gi, m.ci),
                        "duplicate GPU/compute instance",
                    ));
                }
                if !mig_indices.insert(m.index) {
                    return Err(invalid(at("index"), m.index.to_string(), "duplicate MIG index"));
                }
                if m.memory_mib == 0 || m.memory_mib > g.memory_mib {
                    return Err(invalid(
                        at("memory_mib"),
                        m.memory_mib.to_string(),
                        "must be within the parent's memory",
                    ));
                }
            }
            if !g.mig_enabled && !g.mig_profiles.is_empty() {
                return Err(invalid(
                    at("mig_profiles"),
                    g.mig_profiles.len().to_string(),
                    "MIG profiles on a GPU without MIG mode",
                ));
            }
            let mut profile_ids = BTreeSet::new();
            let mut profile_names = BTreeSet::new();
            for (j, p) in g.mig_profiles.iter().enumerate() {
                let at = |f: &str| format!("gpus[{i}].mig_profiles[{j}].{f}");
                if !profile_ids.insert(p.id) {
                    return Err(invalid(at("id"), p.id.to_string(), "duplicate profile id"));
                }
                // Device names are made of the profile's name: two of one name would clash.
                if !profile_names.insert(p.profile.to_string()) {
                    return Err(invalid(at("profile"), p.profile.to_string(), "duplicate profile name"));
                }
                if p.slices == 0 || p.memory_mib == 0 || p.memory_mib > g.memory_mib {
                    return Err(invalid(
                        at("memory_mib"),
                        format!("{} MiB, {} slices", p.memory_mib, p.slices),
                        "must be positive and within the card",
                    ));
                }
                if let Some(bad) = p
                    .placements
                    .iter()
                    .find(|pl| pl.size == 0 || pl.start.saturating_add(pl.size) > 64)
                {
                    return Err(invalid(
                        at("placements"),
                        format!("{}:{}", bad.start, bad.size),
                        "a placement covers 1 to 64 memory slices from its start",
                    ));
                }
            }
        }
        if let Some(t) = &self.topology
            && t.len() != self.gpus.len()
        {
            return Err(invalid(
                "topology".into(),
                format!("{} rows", t.len()),
                &format!("must have one row per GPU ({})", self.gpus.len()),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
