//! `ElasticGPU`: what a claim was given — the node, the cards or MIG devices and the amounts —
//! bound to the claim as a PersistentVolume is to its claim. Cluster-scoped; named
//! `egpu-<claim uid>` so that a claim's GPU is found again from the claim alone.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use tessera_core::handoff::AllocatedDevice;

use crate::class::ReclaimPolicy;

/// What an ElasticGPU holds.
#[derive(CustomResource, Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "tessera.io",
    version = "v1alpha1",
    kind = "ElasticGPU",
    root = "ElasticGpu",
    plural = "elasticgpus",
    singular = "elasticgpu",
    shortname = "egpu",
    doc = "The GPU a claim was given: node, devices and amounts, bound to the claim.",
    status = "ElasticGpuStatus",
    printcolumn = r#"{"name":"Status","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Claim","type":"string","jsonPath":".spec.claimRef.name"}"#,
    printcolumn = r#"{"name":"Node","type":"string","jsonPath":".spec.nodeName"}"#,
    printcolumn = r#"{"name":"GPU","type":"string","jsonPath":".spec.devices[*].index"}"#,
    printcolumn = r#"{"name":"Pod","type":"string","jsonPath":".status.pod"}"#,
    printcolumn = r#"{"name":"Reclaim","type":"string","jsonPath":".spec.reclaimPolicy"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct ElasticGpuSpec {
    /// The resources it stands for (`tessera.io/*`, as the claim's became).
    #[schemars(schema_with = "crate::quantity_map")]
    pub capacity: BTreeMap<String, Quantity>,
    /// The node its devices are on.
    pub node_name: String,
    /// The claim it is bound to.
    pub claim_ref: ClaimRef,
    /// Copied from the claim's class when it was created.
    #[serde(default)]
    pub reclaim_policy: ReclaimPolicy,
    /// The devices, in the order the container sees them.
    pub devices: Vec<GpuDevice>,
}

/// The claim an ElasticGPU is bound to.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ClaimRef {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its UID (a claim deleted and created again under the same name is another claim).
    pub uid: String,
}

/// One device of an ElasticGPU: a whole card, a share of one, or a MIG device.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuDevice {
    /// `GPU-<uuid>`, or `MIG-<uuid>` for a MIG device.
    pub uuid: String,
    /// The card's NVML index.
    pub index: u32,
    /// The card's device minor (`/dev/nvidia<minor>`); none for MIG devices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minor: Option<u32>,
    /// Guaranteed compute, percent of the card (100 for a whole card, 0 for MIG).
    #[serde(default)]
    pub core_percent: u32,
    /// Memory, MiB (0 for MIG: the profile says).
    #[serde(default, rename = "memoryMiB")]
    pub memory_mib: u64,
    /// A whole, exclusive card.
    #[serde(default)]
    pub exclusive: bool,
    /// The MIG device's place, for MIG devices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<MigPlace>,
}

/// Where a MIG device is.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigPlace {
    /// The profile (`1g.10gb`).
    pub profile: String,
    /// The parent card's `GPU-<uuid>`.
    #[serde(rename = "parentUUID")]
    pub parent_uuid: String,
    /// GPU instance id.
    pub gi: u32,
    /// Compute instance id.
    pub ci: u32,
}

/// The life of an ElasticGPU, as a PersistentVolume's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ElasticGpuPhase {
    /// Being created.
    #[default]
    Pending,
    /// Not bound to a claim.
    Available,
    /// Bound to its claim: its devices are booked for the claim, used by a pod or not.
    Bound,
    /// Its claim is gone (Retain): kept for the administrator, no longer booked.
    Released,
    /// Its devices cannot be found on the node any more.
    Failed,
}

/// Where an ElasticGPU stands.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ElasticGpuStatus {
    /// Pending, Available, Bound, Released or Failed.
    #[serde(default)]
    pub phase: ElasticGpuPhase,
    /// The pod using it now (`namespace/name`), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    /// Why it is in this phase, when that needs saying.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// Why a recorded device cannot be read back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("ElasticGPU device {uuid}: {reason}")]
pub struct BadDevice {
    /// The device.
    pub uuid: String,
    /// What is wrong with it.
    pub reason: String,
}

impl From<&AllocatedDevice> for GpuDevice {
    fn from(d: &AllocatedDevice) -> Self {
        match d {
            AllocatedDevice::Gpu {
                uuid,
                index,
                minor,
                core_percent,
                memory_mib,
                exclusive,
            } => GpuDevice {
                uuid: uuid.clone(),
                index: *index,
                minor: Some(*minor),
                core_percent: *core_percent,
                memory_mib: *memory_mib,
                exclusive: *exclusive,
                mig: None,
            },
            AllocatedDevice::Mig {
                uuid,
                profile,
                parent_uuid,
                parent_index,
                gi,
                ci,
            } => GpuDevice {
                uuid: uuid.clone(),
                index: *parent_index,
                minor: None,
                core_percent: 0,
                memory_mib: 0,
                exclusive: false,
                mig: Some(MigPlace {
                    profile: profile.to_string(),
                    parent_uuid: parent_uuid.clone(),
                    gi: *gi,
                    ci: *ci,
                }),
            },
        }
    }
}

impl TryFrom<&GpuDevice> for AllocatedDevice {
    type Error = BadDevice;

    fn try_from(d: &GpuDevice) -> Result<Self, BadDevice> {
        Ok(match &d.mig {
            None => AllocatedDevice::Gpu {
                uuid: d.uuid.clone(),
                index: d.index,
                minor: d.minor.ok_or_else(|| BadDevice {
                    uuid: d.uuid.clone(),
                    reason: "a GPU device needs its minor".into(),
                })?,
                core_percent: d.core_percent,
                memory_mib: d.memory_mib,
                exclusive: d.exclusive,
            },
            Some(m) => AllocatedDevice::Mig {
                uuid: d.uuid.clone(),
                profile: m
                    .profile
                    .parse()
                    .map_err(|e: tessera_core::mig::BadMigProfile| BadDevice {
                        uuid: d.uuid.clone(),
                        reason: format!("MIG profile {:?} is invalid: {e}", m.profile),
                    })?,
                parent_uuid: m.parent_uuid.clone(),
                parent_index: d.index,
                gi: m.gi,
                ci: m.ci,
            },
        })
    }
}

impl ElasticGpu {
    /// The name of the ElasticGPU of the claim with `claim_uid`.
    pub fn name_for(claim_uid: &str) -> String {
        format!("egpu-{claim_uid}")
    }

    /// Its devices as the hand-off has them.
    pub fn allocated_devices(&self) -> Result<Vec<AllocatedDevice>, BadDevice> {
        self.spec.devices.iter().map(AllocatedDevice::try_from).collect()
    }

    /// Its phase (Pending when it has no status yet).
    pub fn phase(&self) -> ElasticGpuPhase {
        self.status.as_ref().map(|s| s.phase).unwrap_or_default()
    }
}
