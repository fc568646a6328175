//! Dynamic Resource Allocation (Kubernetes 1.34+): the devices a node publishes in its
//! ResourceSlice, what an allocated claim gives a container, and the node's record of the
//! claims it prepared.
//!
//! A card is one device with consumable capacity (`cores` in percent, `memory`): the scheduler
//! hands out a whole card (a request that names no capacity consumes all of it) or shares of
//! it, each recorded in the claim's allocation as `consumedCapacity`. A carved MIG device is a
//! device of its own. Preparing a claim records what it was given on the node (a file only
//! root writes) and gives the container a CDI marker that names the claim; Tessera's NRI plugin
//! turns the record into devices and limits exactly as it does for a signed allocation, so a
//! DRA share is held by the same enforcement (MPS or the hook) as any other share.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use k8s_openapi::api::resource::v1 as resource;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde::{Deserialize, Serialize};
use thiserror::Error;

mod carve;

pub use carve::{
    Carve, CarveLedger, Carving, carvable, carve_of, counter_set, counter_set_name, foreign, placement_device_name,
};

use crate::cdi::{CdiDevice, CdiEdits, CdiSpec};
use crate::handoff::AllocatedDevice;
use crate::inventory::{Gpu, MadeInstance, MigDevice, NodeInventory};
use crate::quantity::Amount;

/// The DRA driver name: DeviceClasses select `device.driver == "gpu.tessera.io"`.
pub const DRIVER: &str = "gpu.tessera.io";
/// Consumable capacity of a card: guaranteed compute, in percent of the card.
pub const CAPACITY_CORES: &str = "cores";
/// Consumable capacity of a card: memory.
pub const CAPACITY_MEMORY: &str = "memory";
/// CDI kind of the claim markers the DRA plugin hands the kubelet.
pub const CLAIM_CDI_KIND: &str = "tessera.io/claim";
/// Prefix of the environment variable a claim marker sets (`TESSERA_DRA_CLAIM_<uid>`).
pub const MARKER_ENV_PREFIX: &str = "TESSERA_DRA_CLAIM_";
/// The kubelet's plugin registry directory (where the registration socket goes).
pub const REGISTRY_DIR: &str = "/var/lib/kubelet/plugins_registry";
/// The DRA plugin's own directory (its DRA socket), as the kubelet sees it.
pub const PLUGIN_DIR: &str = "/var/lib/kubelet/plugins/gpu.tessera.io";
/// Default directory of the node's prepared-claim records.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/tessera/dra";

/// Why a claim cannot be prepared, or a container cannot have it.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DraError {
    /// The claim has no allocation (the scheduler has not allocated it).
    #[error("claim {claim}: not allocated")]
    NotAllocated {
        /// `namespace/name`.
        claim: String,
    },
    /// The API server's claim is another object than the kubelet asked for.
    #[error("claim {claim}: the kubelet asked for uid {asked}, the API server has uid {found}")]
    Replaced {
        /// `namespace/name`.
        claim: String,
        /// The uid the kubelet named.
        asked: String,
        /// The uid found.
        found: String,
    },
    /// A result names a device this node does not have (or one not allocatable now).
    #[error("claim {claim}: device {device:?} of pool {pool:?} is not a device of node {node}")]
    UnknownDevice {
        /// `namespace/name`.
        claim: String,
        /// The pool named.
        pool: String,
        /// The device named.
        device: String,
        /// This node.
        node: String,
    },
    /// A consumed capacity that is no quantity, or not in the card's units.
    #[error("claim {claim}: device {device:?}: consumedCapacity {name}={value:?} is invalid: {reason}")]
    Capacity {
        /// `namespace/name`.
        claim: String,
        /// The device.
        device: String,
        /// The capacity's name.
        name: String,
        /// Its value.
        value: String,
        /// Why.
        reason: String,
    },
    /// A MIG instance the claim was allocated could not be created.
    #[error("claim {claim}: device {device:?}: cannot create its MIG instance: {reason}")]
    Carve {
        /// `namespace/name`.
        claim: String,
        /// The device.
        device: String,
        /// Why.
        reason: String,
    },
    /// The node's record of a claim cannot be read.
    #[error("claim {uid}: its record on this node cannot be read: {error}")]
    Unreadable {
        /// The claim's uid.
        uid: String,
        /// Why.
        error: String,
    },
    /// A container's marker for a claim does not carry the token the node gave the claim's
    /// marker (the container wrote it into its own environment).
    #[error(
        "claim {claim} ({uid}): the container's marker does not carry the claim's token; a container gets a claim only through the kubelet"
    )]
    WrongToken {
        /// `namespace/name`.
        claim: String,
        /// The claim's uid.
        uid: String,
    },
    /// A container would get a share and another device (two shares, or a share and a whole
    /// card): one container's limits are one share's.
    #[error(
        "claims {claims:?} give one container a share of a card and other devices ({devices}); a container may hold one share, alone"
    )]
    SeveralShares {
        /// The claims' `namespace/name`s.
        claims: Vec<String>,
        /// The devices, for people.
        devices: String,
    },
    /// A container names a claim that was not prepared on this node.
    #[error("claim {uid} is not prepared on this node")]
    NotPrepared {
        /// The claim's uid.
        uid: String,
    },
    /// A container names a claim of another namespace (a pod can only use its own
    /// namespace's claims).
    #[error("claim {claim} ({uid}) is not a claim of namespace {namespace}")]
    OtherNamespace {
        /// `namespace/name`.
        claim: String,
        /// The claim's uid.
        uid: String,
        /// The pod's namespace.
        namespace: String,
    },
}

/// The slice device name of a card (`gpu-0`) and of a MIG device (`gpu-0-mig-1-0`).
pub fn device_name(gpu: &Gpu, mig: Option<(u32, u32)>) -> String {
    match mig {
        None => format!("gpu-{}", gpu.index),
        Some((gi, ci)) => format!("gpu-{}-mig-{gi}-{ci}", gpu.index),
    }
}

fn string(s: &str) -> resource::DeviceAttribute {
    resource::DeviceAttribute {
        string: Some(s.to_string()),
        ..Default::default()
    }
}

fn int(i: i64) -> resource::DeviceAttribute {
    resource::DeviceAttribute {
        int: Some(i),
        ..Default::default()
    }
}

fn boolean(b: bool) -> resource::DeviceAttribute {
    resource::DeviceAttribute {
        bool: Some(b),
        ..Default::default()
    }
}

fn q(s: String) -> Quantity {
    Quantity(s)
}

/// The taint an unhealthy card's devices carry in the slice (`NoSchedule`: claims already
/// allocated keep them, the scheduler allocates them to no new claim).
pub const UNHEALTHY_TAINT: &str = "gpu.tessera.io/unhealthy";

/// What a node publishes: its devices, and the counter sets its partitionable devices draw
/// on (in slices of their own: a slice holds devices or counters, not both).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Published {
    /// The devices.
    pub devices: Vec<resource::Device>,
    /// The cards' counter sets (dynamic MIG).
    pub counter_sets: Vec<resource::CounterSet>,
}

/// The devices node `inv` publishes: every card that is not in MIG mode, shareable by
/// consumable capacity (`cores` 1..100 in steps of 1, `memory` in steps of `memory_unit_mib`,
/// a request naming neither takes the whole card), and every carved MIG device. The devices of
/// an unhealthy card carry [`UNHEALTHY_TAINT`] until it recovers (an API server that does not
/// serve device taints drops them: [`untainted`] is what to publish there).
pub fn slice_devices(inv: &NodeInventory, memory_unit_mib: u64) -> Vec<resource::Device> {
    publish(inv, memory_unit_mib, false, &[]).devices
}

/// What node `inv` publishes: as [`slice_devices`], except that with `dynamic_mig` (the
/// node's [`crate::names::LABEL_DYNAMIC_MIG`]) a card in MIG mode whose profiles are known is
/// offered as every instance it could create, over its counter set; `ours` are the instances
/// Tessera created (the others are offered as they are, the placements they cover not at all).
pub fn publish(inv: &NodeInventory, memory_unit_mib: u64, dynamic_mig: bool, ours: &[Carve]) -> Published {
    let unit = memory_unit_mib.max(1);
    let mut out = Published::default();
    for gpu in &inv.gpus {
        let first = out.devices.len();
        if dynamic_mig && carvable(gpu) {
            let common = common_attributes(inv, gpu);
            out.devices
                .extend(foreign(gpu, ours).map(|m| mig_device(gpu, m, &common)));
            out.devices.extend(carve::placement_devices(gpu, ours, &common));
            out.counter_sets.push(counter_set(gpu, ours));
        } else {
            push_card_devices(inv, gpu, unit, ours, &mut out.devices);
        }
        if let crate::inventory::Health::Unhealthy { .. } = &gpu.health {
            for d in &mut out.devices[first..] {
                d.taints = Some(vec![resource::DeviceTaint {
                    key: UNHEALTHY_TAINT.into(),
                    value: None,
                    effect: "NoSchedule".into(),
                    time_added: None,
                }]);
            }
        }
    }
    out
}

fn common_attributes(inv: &NodeInventory, gpu: &Gpu) -> BTreeMap<String, resource::DeviceAttribute> {
    BTreeMap::from([
        ("uuid".to_string(), string(&gpu.uuid)),
        ("model".to_string(), string(&gpu.model)),
        ("index".to_string(), int(i64::from(gpu.index))),
        ("driverVersion".to_string(), string(&inv.driver_version)),
    ])
}

/// The device of MIG instance `m` of `gpu`, as it is.
fn mig_device(gpu: &Gpu, m: &MigDevice, common: &BTreeMap<String, resource::DeviceAttribute>) -> resource::Device {
    let mut attributes = common.clone();
    attributes.insert("uuid".into(), string(&m.uuid));
    attributes.insert("parentUUID".into(), string(&gpu.uuid));
    attributes.insert("type".into(), string("mig"));
    attributes.insert("profile".into(), string(&m.profile.to_string()));
    attributes.insert("shareable".into(), boolean(false));
    resource::Device {
        name: device_name(gpu, Some((m.gi, m.ci))),
        attributes: Some(attributes),
        capacity: Some(BTreeMap::from([(
            CAPACITY_MEMORY.to_string(),
            resource::DeviceCapacity {
                value: q(format!("{}Mi", m.memory_mib)),
                request_policy: None,
            },
        )])),
        ..Default::default()
    }
}

/// `devices` without the tainted ones: for an API server that drops device taints (the
/// feature off), where a tainted device would be offered as if healthy.
pub fn untainted(devices: &[resource::Device]) -> Vec<resource::Device> {
    devices.iter().filter(|d| d.taints.is_none()).cloned().collect()
}

/// The devices of one card: its MIG devices when in MIG mode (but those Tessera created for
/// claims, `ours`, which the claims hold), else the card.
fn push_card_devices(
    inv: &NodeInventory,
    gpu: &crate::inventory::Gpu,
    unit: u64,
    ours: &[Carve],
    out: &mut Vec<resource::Device>,
) {
    let common = common_attributes(inv, gpu);
    if gpu.mig_enabled {
        out.extend(foreign(gpu, ours).map(|m| mig_device(gpu, m, &common)));
        return;
    }
    let mut attributes = common;
    attributes.insert("type".into(), string("gpu"));
    attributes.insert("shareable".into(), boolean(true));
    // The memory a share may ask: whole units, the default (and most) all whole units.
    let max_memory = (gpu.memory_mib / unit).max(1) * unit;
    let capacity = BTreeMap::from([
        (
            CAPACITY_CORES.to_string(),
            resource::DeviceCapacity {
                value: q("100".into()),
                request_policy: Some(resource::CapacityRequestPolicy {
                    default: Some(q("100".into())),
                    valid_range: Some(resource::CapacityRequestPolicyRange {
                        min: q("1".into()),
                        max: Some(q("100".into())),
                        step: Some(q("1".into())),
                    }),
                    valid_values: None,
                }),
            },
        ),
        (
            CAPACITY_MEMORY.to_string(),
            resource::DeviceCapacity {
                value: q(format!("{}Mi", gpu.memory_mib.max(unit))),
                request_policy: Some(resource::CapacityRequestPolicy {
                    default: Some(q(format!("{max_memory}Mi"))),
                    valid_range: Some(resource::CapacityRequestPolicyRange {
                        min: q(format!("{unit}Mi")),
                        max: Some(q(format!("{max_memory}Mi"))),
                        step: Some(q(format!("{unit}Mi"))),
                    }),
                    valid_values: None,
                }),
            },
        ),
    ]);
    out.push(resource::Device {
        name: device_name(gpu, None),
        attributes: Some(attributes),
        capacity: Some(capacity),
        allow_multiple_allocations: Some(true),
        ..Default::default()
    });
}

/// Every device the node has in DRA terms, with why it is unhealthy (`None`: healthy): each
/// card not in MIG mode, each MIG instance and each instance a card could create (unhealthy
/// with its card).
pub fn device_health(inv: &NodeInventory) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    for gpu in &inv.gpus {
        let why = match &gpu.health {
            crate::inventory::Health::Healthy => None,
            crate::inventory::Health::Unhealthy { reason } => Some(reason.clone()),
        };
        if gpu.mig_enabled {
            out.extend(
                gpu.mig_devices
                    .iter()
                    .map(|m| (device_name(gpu, Some((m.gi, m.ci))), why.clone())),
            );
            for info in &gpu.mig_profiles {
                out.extend(
                    info.placements
                        .iter()
                        .map(|p| (placement_device_name(gpu, info, *p), why.clone())),
                );
            }
        } else {
            out.push((device_name(gpu, None), why));
        }
    }
    out
}

/// The name of node `node`'s ResourceSlice.
pub fn slice_name(node: &str) -> String {
    format!("{node}-{DRIVER}")
}

/// Devices per slice: the API's limit where devices have taints or consume counters (128
/// otherwise; one limit keeps a node's layout stable as cards go unhealthy).
pub const DEVICES_PER_SLICE: usize = 64;
/// Counter sets per slice (the API's limit).
pub const COUNTER_SETS_PER_SLICE: usize = 8;

/// Node `node`'s ResourceSlices, all of one pool named after the node at `generation`: the
/// counter sets [`COUNTER_SETS_PER_SLICE`] at a time (`-counters-0`, ...), then the devices
/// [`DEVICES_PER_SLICE`] at a time (the first slice named [`slice_name`], the others with
/// `-1`, `-2`, ... after it; one empty slice for a node without devices).
pub fn slices(node: &str, generation: i64, published: &Published) -> Vec<resource::ResourceSlice> {
    // (name, devices, counter sets): a slice holds one or the other.
    type Content = (Option<Vec<resource::Device>>, Option<Vec<resource::CounterSet>>);
    let mut specs: Vec<(String, Content)> = Vec::new();
    let base = slice_name(node);
    let chunks: Vec<&[resource::Device]> = if published.devices.is_empty() {
        vec![&[]]
    } else {
        published.devices.chunks(DEVICES_PER_SLICE).collect()
    };
    // Counters first: written in this order, a new layout's devices never name a counter set
    // that is not there yet.
    for (i, chunk) in published.counter_sets.chunks(COUNTER_SETS_PER_SLICE).enumerate() {
        specs.push((format!("{base}-counters-{i}"), (None, Some(chunk.to_vec()))));
    }
    for (i, chunk) in chunks.into_iter().enumerate() {
        let name = if i == 0 { base.clone() } else { format!("{base}-{i}") };
        specs.push((name, (Some(chunk.to_vec()), None)));
    }
    let count = specs.len() as i64;
    specs
        .into_iter()
        .map(|(name, (devices, shared_counters))| resource::ResourceSlice {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                name: Some(name),
                ..Default::default()
            },
            spec: resource::ResourceSliceSpec {
                driver: DRIVER.into(),
                node_name: Some(node.into()),
                pool: resource::ResourcePool {
                    name: node.into(),
                    generation,
                    resource_slice_count: count,
                },
                devices,
                shared_counters,
                ..Default::default()
            },
        })
        .collect()
}

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
    /// The uids of the pods it was reserved for when it was prepared (`status.reservedFor`,
    /// for people: a shared claim gains pods later).
    pub pods: Vec<String>,
    /// The secret the claim's marker carries: only a container the kubelet gave the marker
    /// has it (see [`new_token`]).
    #[serde(default)]
    pub token: String,
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

/// The cards `claim` holds shares of (whole cards and MIG devices are not shared).
fn shared_cards(claim: &PreparedClaim) -> impl Iterator<Item = &str> {
    claim.devices.iter().filter_map(|d| match &d.allocated {
        AllocatedDevice::Gpu {
            uuid, exclusive: false, ..
        } => Some(uuid.as_str()),
        _ => None,
    })
}

/// Refuses `claim`, of tenant `tenant`, when a card it holds a share of already serves shares
/// of another tenant among `prepared` (each with its tenant): a card's shares go to one tenant
/// unless `cross_tenant` (its node's opt-in, [`crate::names::LABEL_CROSS_TENANT_SHARING`]).
/// The scheduler's allocator knows no tenants, so the node holds this rule at prepare.
pub fn check_tenancy(
    claim: &PreparedClaim,
    tenant: &str,
    prepared: &[(PreparedClaim, String)],
    cross_tenant: bool,
) -> Result<(), String> {
    if cross_tenant {
        return Ok(());
    }
    for card in shared_cards(claim) {
        for (other, other_tenant) in prepared {
            if other.uid != claim.uid && other_tenant != tenant && shared_cards(other).any(|c| c == card) {
                return Err(format!(
                    "claim {}: card {card} already serves shares of tenant {other_tenant:?} (claim {}); \
                     a card's shares go to one tenant (label the node {}=true to share cards between tenants)",
                    claim.key(),
                    other.key(),
                    crate::names::LABEL_CROSS_TENANT_SHARING
                ));
            }
        }
    }
    Ok(())
}

/// Whether `s` can be an object uid (letters, digits and `-`, at most 64): what makes it safe
/// as a file name.
pub fn is_uid(s: &str) -> bool {
    !s.is_empty() && s.len() <= 64 && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// The environment variable of claim `uid`'s marker.
pub fn marker_env(uid: &str) -> String {
    format!("{MARKER_ENV_PREFIX}{}", uid.replace('-', "_"))
}

/// The CDI device name of claim `uid`'s marker (qualified: `tessera.io/claim=<uid>`).
pub fn marker_device(uid: &str) -> String {
    format!("{CLAIM_CDI_KIND}={uid}")
}

/// The CDI spec file name of claim `uid`'s marker.
pub fn marker_file(uid: &str) -> String {
    format!("tessera.io-claim-{uid}.json")
}

/// A fresh marker token: 128 random bits, hex.
pub fn new_token() -> String {
    use ring::rand::SecureRandom as _;
    let mut bytes = [0u8; 16];
    ring::rand::SystemRandom::new()
        .fill(&mut bytes)
        .expect("the system's random source works");
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The CDI spec of claim `uid`'s marker: one device that sets `TESSERA_DRA_CLAIM_<uid>` to the
/// claim's token.
pub fn marker_spec(uid: &str, token: &str) -> CdiSpec {
    let mut spec = CdiSpec {
        cdi_version: String::new(),
        kind: CLAIM_CDI_KIND.into(),
        devices: vec![CdiDevice {
            name: uid.into(),
            annotations: BTreeMap::new(),
            container_edits: CdiEdits {
                env: vec![format!("{}={token}", marker_env(uid))],
                ..Default::default()
            },
        }],
        container_edits: CdiEdits::default(),
    };
    spec.cdi_version = spec.minimum_version().into();
    spec
}

/// The claims a container's environment names through markers (`KEY=value` entries): each
/// claim's uid and the token its marker carries.
pub fn marked_claims(env: &[String]) -> Vec<(String, String)> {
    let mut marks: Vec<(String, String)> = env
        .iter()
        .filter_map(|e| e.split_once('='))
        .filter_map(|(k, v)| Some((k.strip_prefix(MARKER_ENV_PREFIX)?.replace('_', "-"), v.to_string())))
        .filter(|(uid, _)| is_uid(uid))
        .collect();
    marks.sort();
    marks.dedup();
    marks
}

/// What the claims a container's markers name give it: their devices and the claims' uids.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ClaimedDevices {
    /// The devices, each once.
    pub devices: Vec<AllocatedDevice>,
    /// The claims' uids.
    pub claims: Vec<String>,
}

/// The devices the claims `marks` (uid, token) give a container of a pod in `namespace`, from
/// the node's records: every claim must be prepared here, be of the pod's namespace (Kubernetes
/// lets a pod use only its own namespace's claims) and be named with the token the node gave its
/// marker (only the kubelet hands that to a container); a share comes alone.
pub fn devices_for(
    store: &ClaimStore,
    namespace: &str,
    marks: &[(String, String)],
) -> Result<ClaimedDevices, DraError> {
    let mut out = ClaimedDevices::default();
    let (mut keys, mut raw, mut shares) = (Vec::new(), 0usize, 0usize);
    for (uid, token) in marks {
        let claim = store
            .get(uid)
            .map_err(|e| DraError::Unreadable {
                uid: uid.clone(),
                error: e.to_string(),
            })?
            .ok_or_else(|| DraError::NotPrepared { uid: uid.clone() })?;
        if claim.namespace != namespace {
            return Err(DraError::OtherNamespace {
                claim: claim.key(),
                uid: uid.clone(),
                namespace: namespace.into(),
            });
        }
        use subtle::ConstantTimeEq as _;
        if claim.token.is_empty() || !bool::from(claim.token.as_bytes().ct_eq(token.as_bytes())) {
            return Err(DraError::WrongToken {
                claim: claim.key(),
                uid: uid.clone(),
            });
        }
        keys.push(claim.key());
        out.claims.push(uid.clone());
        for d in claim.devices {
            raw += 1;
            shares += usize::from(matches!(d.allocated, AllocatedDevice::Gpu { exclusive: false, .. }));
            if !out.devices.contains(&d.allocated) {
                out.devices.push(d.allocated);
            }
        }
    }
    if shares > 0 && raw > 1 {
        return Err(DraError::SeveralShares {
            claims: keys,
            devices: out
                .devices
                .iter()
                .map(|d| d.uuid().to_string())
                .collect::<Vec<_>>()
                .join(", "),
        });
    }
    Ok(out)
}

/// The node's prepared-claim records: one JSON file per claim uid, written whole (temporary
/// file and rename) in a directory only root can write.
#[derive(Debug, Clone)]
pub struct ClaimStore {
    dir: PathBuf,
}

impl Default for ClaimStore {
    /// The records under [`DEFAULT_STATE_DIR`].
    fn default() -> Self {
        Self::new(Path::new(DEFAULT_STATE_DIR))
    }
}

impl ClaimStore {
    /// The records under `state_dir/claims`.
    pub fn new(state_dir: &Path) -> Self {
        Self {
            dir: state_dir.join("claims"),
        }
    }

    /// The records' directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, uid: &str) -> Option<PathBuf> {
        is_uid(uid).then(|| self.dir.join(format!("{uid}.json")))
    }

    /// Claim `uid`'s record, if the node prepared it.
    pub fn get(&self, uid: &str) -> std::io::Result<Option<PreparedClaim>> {
        let Some(path) = self.path(uid) else { return Ok(None) };
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{}: {e}", path.display()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Records `claim` (replacing an earlier record of it).
    pub fn put(&self, claim: &PreparedClaim) -> std::io::Result<()> {
        let path = self.path(&claim.uid).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("claim uid {:?} is invalid", claim.uid),
            )
        })?;
        let text = serde_json::to_vec_pretty(claim).map_err(std::io::Error::other)?;
        write_atomic(&self.dir, &path, &text, 0o700, 0o600)
    }

    /// Forgets claim `uid` (no error when it was not recorded).
    pub fn remove(&self, uid: &str) -> std::io::Result<()> {
        let Some(path) = self.path(uid) else { return Ok(()) };
        match std::fs::remove_file(path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// Every recorded claim (unreadable records are skipped and named in the error list).
    pub fn list(&self) -> (Vec<PreparedClaim>, Vec<String>) {
        let (mut claims, mut bad) = (Vec::new(), Vec::new());
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return (claims, bad);
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(uid) = name.strip_suffix(".json") else {
                continue;
            };
            match self.get(uid) {
                Ok(Some(c)) => claims.push(c),
                Ok(None) => {}
                Err(err) => bad.push(err.to_string()),
            }
        }
        claims.sort_by(|a, b| a.uid.cmp(&b.uid));
        (claims, bad)
    }
}

/// Writes `bytes` to `path` in `dir` through a temporary file and a rename, so a reader never
/// sees half a file; the directory is created with mode `dir_mode`, the file gets `file_mode`.
pub fn write_atomic(dir: &Path, path: &Path, bytes: &[u8], dir_mode: u32, file_mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
    std::fs::DirBuilder::new().recursive(true).mode(dir_mode).create(dir)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(file_mode)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests;
