//! The cluster as `kubectl tessera` shows it: each Tessera node's cards from its published
//! inventory, and on each card the pods whose hand-off allocation names it, checked against
//! the inventory (a device the node does not have is reported, not shown as allocated).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::ResourceClaim;
use serde::Serialize;
use tessera_core::dra;
use tessera_core::handoff::{AllocatedDevice, Allocation};
use tessera_core::inventory::{INVENTORY_VERSION, PublishedInventory};
use tessera_core::ledger::usage_of;
use tessera_core::names::{ANNOTATION_ALLOCATION, ANNOTATION_INVENTORY};
use tessera_core::placement::{CARD_MILLI, ClusterState, NodeState, PodDemand};
use tessera_core::quantity::Amount;
use tessera_core::request::{PodRequest, RequestOptions};

/// A pod's use of one card.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CardPod {
    /// `namespace/name`.
    pub pod: String,
    /// The container(s) using the card.
    pub containers: Vec<String>,
    /// What it holds there: `30% + 8192 MiB`, `whole`, `MIG 1g.5gb`.
    pub holds: String,
}

/// One card of a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CardView {
    /// NVML index.
    pub index: u32,
    /// `GPU-<uuid>`.
    pub uuid: String,
    /// Model.
    pub model: String,
    /// NUMA node.
    pub numa_node: Option<u32>,
    /// `Healthy`, or why not.
    pub health: String,
    /// Total memory, MiB.
    pub memory_mib: u64,
    /// Compute allocated, percent (100 for a whole card).
    pub core_allocated: u32,
    /// Memory allocated, MiB.
    pub memory_allocated_mib: u64,
    /// MIG devices `(used, total)`, when the card is in MIG mode.
    pub mig: Option<(usize, usize)>,
    /// Its compute mode (`default`, `exclusive-process`), when the node says.
    pub compute_mode: Option<String>,
    /// Pods on the card, sorted.
    pub pods: Vec<CardPod>,
    /// The tenants (namespaces) of those pods: one, unless the node shares cards between
    /// tenants.
    pub tenants: Vec<String>,
}

/// One Tessera node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NodeView {
    /// Node name.
    pub name: String,
    /// How it enforces shares.
    pub share_enforcement: String,
    /// Why its GPUs cannot be used, when they cannot.
    pub not_ready: Option<String>,
    /// Cards by index.
    pub cards: Vec<CardView>,
}

/// Every Tessera node, by name, and what did not add up.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ClusterView {
    /// Nodes publishing a Tessera inventory.
    pub nodes: Vec<NodeView>,
    /// Allocations that do not match their node's inventory, for people to look at.
    pub problems: Vec<String>,
    /// Nodes whose inventory annotation cannot be read, each with why (also among
    /// [`ClusterView::problems`]).
    #[serde(skip)]
    pub unreadable: Vec<String>,
}

/// A node's `tessera.io/inventory` annotation, or why it cannot be read: malformed, or of a
/// format newer than this build's (its node agents are newer than kubectl-tessera).
pub fn read_inventory(text: &str) -> Result<PublishedInventory, String> {
    #[derive(serde::Deserialize)]
    struct Versioned {
        version: u32,
    }
    if let Ok(Versioned { version }) = serde_json::from_str(text)
        && version > INVENTORY_VERSION
    {
        return Err(format!(
            "its {ANNOTATION_INVENTORY} annotation is of format version {version}, and this kubectl-tessera \
             reads version {INVENTORY_VERSION}: kubectl-tessera is older than the node agents (update it)"
        ));
    }
    PublishedInventory::decode(text).map_err(|e| format!("its {ANNOTATION_INVENTORY} annotation cannot be read: {e}"))
}

/// A pod's allocation, when it has a readable one.
pub fn allocation_of(pod: &Pod) -> Option<Result<Allocation, String>> {
    let v = pod.metadata.annotations.as_ref()?.get(ANNOTATION_ALLOCATION)?;
    Some(Allocation::decode(v).map_err(|e| e.to_string()))
}

/// `namespace/name`.
pub fn pod_key(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or("default"),
        pod.metadata.name.as_deref().unwrap_or_default()
    )
}

fn running(pod: &Pod) -> bool {
    !matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

/// What one device holds, for people.
pub fn holds(d: &AllocatedDevice) -> String {
    match d {
        AllocatedDevice::Gpu { exclusive: true, .. } => "whole".into(),
        AllocatedDevice::Gpu {
            core_percent,
            memory_mib,
            ..
        } => format!("{core_percent}% + {memory_mib} MiB"),
        AllocatedDevice::Mig { profile, .. } => format!("MIG {profile}"),
    }
}

impl ClusterView {
    /// The view of `nodes` (those without a Tessera inventory are left out) and `pods`.
    pub fn build(nodes: &[Node], pods: &[Pod]) -> Self {
        let mut problems = Vec::new();
        let mut unreadable = Vec::new();
        let mut views: BTreeMap<String, NodeView> = BTreeMap::new();
        // The engine's view of each node's cards, to charge pods by the engine's own rule.
        let mut cluster = ClusterState::new();
        let mut states: BTreeMap<String, NodeState> = BTreeMap::new();
        for n in nodes {
            let name = n.metadata.name.clone().unwrap_or_default();
            let Some(text) = n
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(ANNOTATION_INVENTORY))
            else {
                continue;
            };
            let inv = match read_inventory(text) {
                Ok(inv) => inv,
                Err(e) => {
                    unreadable.push(format!("node {name}: {e}"));
                    continue;
                }
            };
            let mut cards: Vec<CardView> = inv
                .gpus
                .iter()
                .map(|g| CardView {
                    index: g.index,
                    uuid: g.uuid.clone(),
                    model: g.model.clone(),
                    numa_node: g.numa_node,
                    health: match &g.health {
                        tessera_core::inventory::Health::Healthy => "Healthy".into(),
                        tessera_core::inventory::Health::Unhealthy { reason } => format!("Unhealthy: {reason}"),
                    },
                    memory_mib: g.memory_mib,
                    core_allocated: 0,
                    memory_allocated_mib: 0,
                    mig: g.mig_enabled.then_some((0, g.mig_devices.len())),
                    compute_mode: g.compute_mode.map(|m| m.to_string()),
                    pods: Vec::new(),
                    tenants: Vec::new(),
                })
                .collect();
            cards.sort_by_key(|c| c.index);
            states.insert(
                name.clone(),
                NodeState {
                    name: name.clone(),
                    cpu_milli: 0,
                    cpu_used: 0,
                    memory_bytes: 0,
                    memory_used: 0,
                    cards: cluster.cards_from_inventory(&inv.gpus),
                    schedulable: true,
                    enforcement: inv.share_enforcement,
                    cross_tenant: false,
                    topology: None,
                },
            );
            views.insert(
                name.clone(),
                NodeView {
                    name,
                    share_enforcement: inv.share_enforcement.to_string(),
                    not_ready: inv.not_ready.clone(),
                    cards,
                },
            );
        }
        for pod in pods.iter().filter(|p| running(p)) {
            let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) else {
                continue;
            };
            let key = pod_key(pod);
            let a = match allocation_of(pod) {
                None => continue,
                Some(Err(e)) => {
                    problems.push(format!("pod {key}: unreadable allocation: {e}"));
                    continue;
                }
                Some(Ok(a)) => a,
            };
            let Some(view) = views.get_mut(node) else {
                problems.push(format!(
                    "pod {key}: bound to {node}, which publishes no Tessera inventory"
                ));
                continue;
            };
            if a.node != node {
                problems.push(format!("pod {key}: allocation names node {}, pod is on {node}", a.node));
                continue;
            }
            add_pod(view, &states[node], pod, &key, &a, &mut problems);
        }
        for v in views.values_mut() {
            for c in &mut v.cards {
                c.pods.sort_by(|a, b| a.pod.cmp(&b.pod));
                c.tenants = c
                    .pods
                    .iter()
                    .filter_map(|p| p.pod.split_once('/'))
                    .map(|(ns, _)| ns.to_string())
                    .collect();
                c.tenants.dedup();
            }
        }
        problems.splice(0..0, unreadable.iter().cloned());
        Self {
            nodes: views.into_values().collect(),
            problems,
            unreadable,
        }
    }
}

impl ClusterView {
    /// Adds the DRA claims Tessera's driver allocated (`gpu.tessera.io` results, each in its
    /// node's pool): each card's compute and memory they consumed, and on each card the pods
    /// the claim is reserved for (or the claim itself while none is).
    pub fn add_claims(&mut self, claims: &[ResourceClaim]) {
        for claim in claims {
            let key = format!(
                "{}/{}",
                claim.metadata.namespace.as_deref().unwrap_or_default(),
                claim.metadata.name.as_deref().unwrap_or_default()
            );
            let status = claim.status.as_ref();
            let users: Vec<String> = status
                .and_then(|s| s.reserved_for.as_ref())
                .into_iter()
                .flatten()
                .filter(|r| r.resource == "pods")
                .map(|r| format!("{}/{}", claim.metadata.namespace.as_deref().unwrap_or_default(), r.name))
                .collect();
            let results = status
                .and_then(|s| s.allocation.as_ref())
                .and_then(|a| a.devices.as_ref())
                .and_then(|d| d.results.as_ref());
            for r in results.into_iter().flatten().filter(|r| r.driver == dra::DRIVER) {
                let Some(view) = self.nodes.iter_mut().find(|n| n.name == r.pool) else {
                    self.problems.push(format!(
                        "claim {key}: device {} of pool {}, which publishes no Tessera inventory",
                        r.device, r.pool
                    ));
                    continue;
                };
                let Some((card, mig)) = card_of(&r.device)
                    .and_then(|(index, mig)| view.cards.iter_mut().find(|c| c.index == index).map(|c| (c, mig)))
                else {
                    self.problems
                        .push(format!("claim {key}: node {} has no device {}", r.pool, r.device));
                    continue;
                };
                let consumed = |name: &str| {
                    r.consumed_capacity
                        .as_ref()
                        .and_then(|c| c.get(name))
                        .and_then(|q| Amount::parse(&q.0).ok())
                };
                let held = if mig {
                    if let Some((used, _)) = &mut card.mig {
                        *used += 1;
                    }
                    "MIG".to_string()
                } else {
                    let cores = consumed(dra::CAPACITY_CORES)
                        .and_then(|a| a.as_integer())
                        .unwrap_or(100);
                    if cores >= 100 {
                        card.core_allocated += 100;
                        card.memory_allocated_mib += card.memory_mib;
                        "whole".to_string()
                    } else {
                        let mib = consumed(dra::CAPACITY_MEMORY).map_or(card.memory_mib, |a| a.ceil() >> 20);
                        card.core_allocated += cores as u32;
                        card.memory_allocated_mib += mib;
                        format!("{cores}% + {mib} MiB")
                    }
                };
                let holders = if users.is_empty() {
                    vec![key.clone()]
                } else {
                    users.clone()
                };
                for pod in holders {
                    card.pods.push(CardPod {
                        pod,
                        containers: vec![],
                        holds: format!("{held} (DRA claim {key})"),
                    });
                }
                card.pods.sort_by(|a, b| a.pod.cmp(&b.pod));
                card.tenants = card
                    .pods
                    .iter()
                    .filter_map(|p| p.pod.split_once('/'))
                    .map(|(ns, _)| ns.to_string())
                    .collect();
                card.tenants.sort();
                card.tenants.dedup();
            }
        }
    }
}

/// The card index of a slice device name (`gpu-2`), and whether it names a MIG device of it
/// (`gpu-2-mig-9-0`).
fn card_of(device: &str) -> Option<(u32, bool)> {
    let rest = device.strip_prefix("gpu-")?;
    let (index, mig) = match rest.split_once("-mig-") {
        Some((i, _)) => (i, true),
        None => (rest, false),
    };
    Some((index.parse().ok()?, mig))
}

/// Charges `a` to the node's cards as the extender does (`ledger::usage_of`: per card, the
/// largest use over the pod's phases) and lists the pod on each card it holds.
fn add_pod(view: &mut NodeView, state: &NodeState, pod: &Pod, key: &str, a: &Allocation, problems: &mut Vec<String>) {
    let mut unknown = false;
    for c in &a.containers {
        for d in c
            .devices
            .iter()
            .filter(|d| !view.cards.iter().any(|card| card.uuid == d.card_uuid()))
        {
            unknown = true;
            problems.push(format!(
                "pod {key}: container {} has {} {}, which node {} does not have",
                c.name,
                if matches!(d, AllocatedDevice::Mig { .. }) {
                    "MIG device"
                } else {
                    "GPU"
                },
                d.uuid(),
                view.name
            ));
        }
    }
    if unknown {
        return;
    }
    let demand = match PodRequest::from_pod(pod, &RequestOptions::default()) {
        Ok(r) => PodDemand::from_request(&r),
        Err(e) => {
            problems.push(format!("pod {key}: {e}"));
            return;
        }
    };
    let usage = match usage_of(state, &demand, a) {
        Ok(u) => u,
        Err(e) => {
            problems.push(format!("pod {key}: {e}"));
            return;
        }
    };
    for (pos, u) in usage {
        // The inventory's cards and the engine's are in the same order, re-sorted by index.
        let uuid = &state.cards[pos].uuid;
        let Some(card) = view.cards.iter_mut().find(|c| &c.uuid == uuid) else {
            continue;
        };
        card.core_allocated += u.core_milli * 100 / CARD_MILLI;
        card.memory_allocated_mib += u.memory_mib;
        if let Some((used, _)) = &mut card.mig {
            *used += u.mig_slots.len();
        }
        let mut containers = Vec::new();
        let mut held = Vec::new();
        for c in &a.containers {
            for d in c.devices.iter().filter(|d| d.card_uuid() == uuid) {
                if !containers.contains(&c.name) {
                    containers.push(c.name.clone());
                }
                held.push(holds(d));
            }
        }
        card.pods.push(CardPod {
            pod: key.to_string(),
            containers,
            holds: held.join(", "),
        });
    }
}
