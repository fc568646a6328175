//! Preparing a claim: what its allocation gives on this node, as the node records it.

use k8s_openapi::api::resource::v1 as resource;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use super::carve::{Carve, carvable, carve_of};
use super::{CAPACITY_CORES, CAPACITY_MEMORY, DRIVER, DraError, device_name};
use crate::handoff::AllocatedDevice;
use crate::inventory::{MadeInstance, NodeInventory};
use crate::quantity::Amount;

/// One device of a prepared claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PreparedDevice {
    /// The claim's requests this device serves.
    pub requests: Vec<String>,
    /// The pool (this node's name).
    pub pool: String,
    /// The slice device name.
    pub device: String,
    /// Which allocation of a shared device this is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share_id: Option<String>,
    /// What the container gets: a whole card, a share of one, or a MIG device.
    pub allocated: AllocatedDevice,
    /// The MIG instance created for the claim (dynamic MIG), destroyed when it is unprepared.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub carved: Option<Carve>,
}

/// A claim as the node prepared it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PreparedClaim {
    /// The claim's uid.
    pub uid: String,
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// The uids of the pods it was reserved for when it was prepared (`status.reservedFor`).
    /// A pod's reservation lasts as long as the pod, so these may use the claim without asking
    /// the API server again; a shared claim gains pods later, which are looked up.
    pub pods: Vec<String>,
    /// The secret a claim-wide marker carries (records of plugins before per-request markers;
    /// empty otherwise).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub token: String,
    /// Each request's marker token: only a container the kubelet gave that request's marker
    /// has it (see [`super::new_markers`]).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub markers: BTreeMap<String, String>,
    /// Its devices on this node.
    pub devices: Vec<PreparedDevice>,
}

impl PreparedClaim {
    /// `namespace/name`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// What claim `claim` (as the API server has it) gives on node `node` with cards `inv`. Only
/// results of Tessera's driver in this node's pool count; a device the node does not have now
/// (unknown, unhealthy, a card in MIG mode asked whole) refuses the claim. A result that
/// consumed less than the whole card's compute is a share, held to what it consumed.
pub fn prepare(
    inv: &NodeInventory,
    node: &str,
    asked_uid: &str,
    claim: &resource::ResourceClaim,
) -> Result<PreparedClaim, DraError> {
    prepare_with(inv, node, asked_uid, claim, &mut |_| {
        Err("this node creates no MIG instances".into())
    })
}

/// As [`prepare`], with `carve` creating the MIG instance of a result that names one a card
/// could create (dynamic MIG); it returns the instance made. On an error the instances made
/// so far are in no record: the caller destroys them.
pub fn prepare_with(
    inv: &NodeInventory,
    node: &str,
    asked_uid: &str,
    claim: &resource::ResourceClaim,
    carve: &mut dyn FnMut(&Carve) -> Result<MadeInstance, String>,
) -> Result<PreparedClaim, DraError> {
    let namespace = claim.metadata.namespace.clone().unwrap_or_default();
    let name = claim.metadata.name.clone().unwrap_or_default();
    let key = format!("{namespace}/{name}");
    let uid = claim.metadata.uid.clone().unwrap_or_default();
    if uid != asked_uid {
        return Err(DraError::Replaced {
            claim: key,
            asked: asked_uid.into(),
            found: uid,
        });
    }
    let status = claim.status.as_ref();
    let results = status
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_ref())
        .ok_or_else(|| DraError::NotAllocated { claim: key.clone() })?;
    let pods = status
        .and_then(|s| s.reserved_for.as_ref())
        .into_iter()
        .flatten()
        .filter(|r| r.resource == "pods" && r.api_group.as_deref().unwrap_or("").is_empty())
        .map(|r| r.uid.clone())
        .collect();
    let mut devices: Vec<PreparedDevice> = Vec::new();
    for r in results.iter().filter(|r| r.driver == DRIVER) {
        // Admin access is to a device others may be using, without their limits: a card's
        // share tenants would have a stranger beside them.
        if r.admin_access == Some(true) {
            return Err(DraError::AdminAccess {
                claim: key.clone(),
                device: r.device.clone(),
            });
        }
        let unknown = || DraError::UnknownDevice {
            claim: key.clone(),
            pool: r.pool.clone(),
            device: r.device.clone(),
            node: node.into(),
        };
        if r.pool != node {
            return Err(unknown());
        }
        // One device serving several requests of the claim is listed once.
        if let Some(d) = devices
            .iter_mut()
            .find(|d| d.device == r.device && d.share_id == r.share_id)
        {
            d.requests.push(r.request.clone());
            continue;
        }
        let planned = inv
            .gpus
            .iter()
            .filter(|g| g.health.is_healthy() && carvable(g))
            .find_map(|g| carve_of(g, &r.device).map(|c| (g, c)));
        let (allocated, carved) = match planned {
            Some((gpu, plan)) => {
                let m = carve(&plan).map_err(|reason| DraError::Carve {
                    claim: key.clone(),
                    device: r.device.clone(),
                    reason,
                })?;
                let allocated = AllocatedDevice::Mig {
                    uuid: m.uuid,
                    profile: plan.profile.clone(),
                    parent_uuid: gpu.uuid.clone(),
                    parent_index: gpu.index,
                    gi: m.gi,
                    ci: m.ci,
                };
                (allocated, Some(plan))
            }
            None => (allocated_device(inv, &key, r)?.ok_or_else(unknown)?, None),
        };
        // Two shares of one card in one claim: the node holds a claim's share of a card as one
        // container's limits, so it could give neither its own.
        if let AllocatedDevice::Gpu {
            uuid, exclusive: false, ..
        } = &allocated
            && devices
                .iter()
                .any(|d| !d.allocated.is_exclusive() && d.allocated.uuid() == uuid)
        {
            return Err(DraError::TwoSharesOfOneCard {
                claim: key.clone(),
                device: r.device.clone(),
            });
        }
        devices.push(PreparedDevice {
            requests: vec![r.request.clone()],
            pool: r.pool.clone(),
            device: r.device.clone(),
            share_id: r.share_id.clone(),
            allocated,
            carved,
        });
    }
    Ok(PreparedClaim {
        uid,
        namespace,
        name,
        pods,
        token: String::new(),
        markers: BTreeMap::new(),
        devices,
    })
}

/// The device result `r` names on this node, with the share it consumed; `None` when the node
/// has no such allocatable device.
fn allocated_device(
    inv: &NodeInventory,
    claim: &str,
    r: &resource::DeviceRequestAllocationResult,
) -> Result<Option<AllocatedDevice>, DraError> {
    for gpu in inv.gpus.iter().filter(|g| g.health.is_healthy()) {
        if gpu.mig_enabled {
            if let Some(m) = gpu
                .mig_devices
                .iter()
                .find(|m| device_name(gpu, Some((m.gi, m.ci))) == r.device)
            {
                return Ok(Some(AllocatedDevice::Mig {
                    uuid: m.uuid.clone(),
                    profile: m.profile.clone(),
                    parent_uuid: gpu.uuid.clone(),
                    parent_index: gpu.index,
                    gi: m.gi,
                    ci: m.ci,
                }));
            }
            continue;
        }
        if device_name(gpu, None) != r.device {
            continue;
        }
        let consumed = |name: &str| -> Result<Option<u64>, DraError> {
            let Some(v) = r.consumed_capacity.as_ref().and_then(|c| c.get(name)) else {
                return Ok(None);
            };
            let bad = |reason: String| DraError::Capacity {
                claim: claim.into(),
                device: r.device.clone(),
                name: name.into(),
                value: v.0.clone(),
                reason,
            };
            let amount = Amount::parse(&v.0).map_err(|e| bad(e.to_string()))?;
            let n = match name {
                CAPACITY_MEMORY => amount.ceil().div_ceil(1 << 20),
                _ => amount.as_integer().ok_or_else(|| bad("not a whole number".into()))?,
            };
            Ok(Some(n))
        };
        let cores = consumed(CAPACITY_CORES)?;
        let memory = consumed(CAPACITY_MEMORY)?;
        // No consumed capacity (a cluster without consumable capacity) or all of the card's
        // compute: the whole card, exclusively.
        let whole = cores.is_none_or(|c| c >= 100);
        if whole {
            return Ok(Some(AllocatedDevice::whole(gpu)));
        }
        let core_percent = u32::try_from(cores.unwrap_or(0)).unwrap_or(100);
        if core_percent == 0 {
            return Err(DraError::Capacity {
                claim: claim.into(),
                device: r.device.clone(),
                name: CAPACITY_CORES.into(),
                value: "0".into(),
                reason: "a share needs at least 1% of the card".into(),
            });
        }
        let memory_mib = memory.unwrap_or(gpu.memory_mib).min(gpu.memory_mib);
        return Ok(Some(AllocatedDevice::share(gpu, core_percent, memory_mib)));
    }
    Ok(None)
}
