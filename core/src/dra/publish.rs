//! What a node offers: its cards and MIG devices as ResourceSlice devices, in slices of the
//! API's sizes.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1 as resource;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::carve::{self, Carve, carvable, counter_set, foreign, placement_device_name};
use super::{CAPACITY_CORES, CAPACITY_MEMORY, DRIVER};
use crate::inventory::{Gpu, MigDevice, NodeInventory};

/// The slice device name of a card (`gpu-0`) and of a MIG device (`gpu-0-mig-1-0`).
pub fn device_name(gpu: &Gpu, mig: Option<(u32, u32)>) -> String {
    match mig {
        None => format!("gpu-{}", gpu.index),
        Some((gi, ci)) => format!("gpu-{}-mig-{gi}-{ci}", gpu.index),
    }
}

pub(super) fn string(s: &str) -> resource::DeviceAttribute {
    resource::DeviceAttribute {
        string: Some(s.to_string()),
        ..Default::default()
    }
}

pub(super) fn int(i: i64) -> resource::DeviceAttribute {
    resource::DeviceAttribute {
        int: Some(i),
        ..Default::default()
    }
}

pub(super) fn boolean(b: bool) -> resource::DeviceAttribute {
    resource::DeviceAttribute {
        bool: Some(b),
        ..Default::default()
    }
}

pub(super) fn q(s: String) -> Quantity {
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
