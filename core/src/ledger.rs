//! The ledger: what every pod holds on every node, the one account the extender places against.
//!
//! It is fed from two sides: node inventories and bound pods (from the API server, with their
//! signed allocations), and the extender's own reservations at bind time. Bookings are kept by
//! pod UID and independently of the node's card positions, so a node that is re-published
//! (a card turns unhealthy, the node restarts) is rebuilt from the bookings on it, and a pod
//! seen before its node is counted once the node appears.
//!
//! It also converts between the engine's plans (card positions) and hand-off allocations
//! (device UUIDs), in both directions.

mod names;
mod plain;

pub use names::NameList;

use std::collections::{BTreeSet, HashMap};

use rustc_hash::FxHashMap;
use thiserror::Error;

use crate::enforcement::ShareEnforcement;
use crate::handoff::{AllocatedDevice, Allocation, ContainerAllocation};
use crate::inventory::Gpu;
use crate::placement::{
    CARD_MILLI, CardUsage, ClusterState, Engine, EngineConfig, NodePlan, NodeState, PodDemand, PodUsage, ShareOwner,
    TargetWorkload, check_node_resources,
};

/// What a node offers, as the API server describes it.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeCapacity {
    /// Allocatable CPU, millicores.
    pub cpu_milli: u64,
    /// Allocatable memory, bytes.
    pub memory_bytes: u64,
    /// Its published GPUs (empty when it publishes none).
    pub gpus: Vec<Gpu>,
    /// False when cordoned.
    pub schedulable: bool,
    /// How the node holds shares to their limits (published with its inventory).
    pub share_enforcement: ShareEnforcement,
    /// How its GPUs are connected (published with its inventory).
    pub topology: Option<std::sync::Arc<crate::topology::GpuTopology>>,
    /// Whether its cards' shares may belong to different tenants (the node's label).
    pub cross_tenant: bool,
}

/// Whether a booking is confirmed by the API server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// Reserved by this extender while it binds; not yet seen bound.
    Reserved,
    /// Seen bound to the node.
    Bound,
}

/// One pod's hold on one node.
#[derive(Debug, Clone, PartialEq)]
pub struct Booking {
    /// Node name.
    pub node: String,
    /// What the pod needs (CPU, memory, and its containers and phases).
    pub demand: PodDemand,
    /// The cards it was given; `None` for pods without GPUs.
    pub allocation: Option<Allocation>,
    /// Reserved or bound.
    pub hold: Hold,
}

/// Why the ledger refused something.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LedgerError {
    /// The node is not known (no such node, or it was deleted).
    #[error("node {0:?} is not known to the extender")]
    UnknownNode(String),
    /// The pod does not fit on the node now.
    #[error("pod does not fit on node {node:?}: {reason}")]
    DoesNotFit {
        /// Node name.
        node: String,
        /// The engine's reason.
        reason: String,
    },
    /// An allocation names a device the node does not have.
    #[error("allocation for node {node:?} names device {uuid}, which the node does not publish")]
    UnknownDevice {
        /// Node name.
        node: String,
        /// The device UUID.
        uuid: String,
    },
    /// The pod is bound to another node (a stray or stale bind must not move its cards).
    #[error("pod is already bound to node {0:?}")]
    AlreadyBound(String),
    /// An allocation names a container the pod does not have (or gives cards to one that asked
    /// for none).
    #[error("allocation names container {0:?}, which asks for no GPU in the pod spec")]
    UnknownContainer(String),
}

/// Every node and every pod's hold on it.
#[derive(Debug, Clone)]
pub struct Ledger {
    engine: Engine,
    /// Pods that hold GPUs (or were reserved by this extender), by UID.
    bookings: HashMap<String, Booking>,
    /// Pods that hold no GPU: their CPU and memory only.
    plain: plain::PlainHolds,
    by_node: HashMap<String, BTreeSet<String>>,
    capacity: HashMap<String, NodeCapacity>,
    /// Live nodes' positions in the engine (the scheduler asks by name, thousands at a time).
    live: FxHashMap<String, usize>,
    /// Recent candidate lists resolved against `live`.
    resolved: names::ResolvedLists,
}

impl Ledger {
    /// An empty ledger placing with `config` against `workload`.
    pub fn new(config: EngineConfig, workload: &TargetWorkload) -> Self {
        Self {
            engine: Engine::new(Default::default(), workload, config),
            bookings: HashMap::new(),
            plain: plain::PlainHolds::default(),
            by_node: HashMap::new(),
            capacity: HashMap::new(),
            live: FxHashMap::default(),
            resolved: Default::default(),
        }
    }

    /// The engine, for evaluating nodes.
    pub fn engine(&mut self) -> &mut Engine {
        &mut self.engine
    }

    /// Changes to the nodes and the workload so far ([`Engine::changes`]).
    pub fn changes(&self) -> u64 {
        self.engine.changes()
    }

    /// The cluster as the engine sees it.
    pub fn cluster(&self) -> &ClusterState {
        &self.engine.cluster
    }

    /// Replaces the target workload.
    pub fn set_workload(&mut self, workload: &TargetWorkload) {
        self.engine.set_workload(workload);
    }

    /// A node's position in the engine, if it is known (and not deleted).
    pub fn node_index(&self, name: &str) -> Option<usize> {
        self.live.get(name).copied()
    }

    /// The position of each of `names` in the engine (`None`: not a live node). The last lists
    /// asked about are remembered while no node comes or goes.
    pub fn resolve_names(&mut self, names: &[&str]) -> std::sync::Arc<[Option<usize>]> {
        self.resolved.resolve(names, &self.live)
    }

    /// Number of known nodes.
    pub fn node_count(&self) -> usize {
        self.capacity.len()
    }

    /// A pod's booking, by UID.
    pub fn booking(&self, uid: &str) -> Option<&Booking> {
        self.bookings.get(uid)
    }

    /// Number of bookings (pods with and without GPUs).
    pub fn booking_count(&self) -> usize {
        self.bookings.len() + self.plain.len()
    }

    /// Adds or replaces a node and re-applies the bookings on it. Returns the bookings that
    /// name devices the node no longer has (counted without those devices).
    pub fn set_node(&mut self, name: &str, capacity: NodeCapacity) -> Vec<(String, LedgerError)> {
        if self.capacity.get(name) == Some(&capacity) {
            return Vec::new();
        }
        let models_before = self.engine.cluster.model_count();
        let cards = self.engine.cluster.cards_from_inventory(&capacity.gpus);
        let node = NodeState {
            name: name.to_string(),
            cpu_milli: capacity.cpu_milli,
            cpu_used: 0,
            memory_bytes: capacity.memory_bytes,
            memory_used: 0,
            cards,
            schedulable: capacity.schedulable,
            enforcement: capacity.share_enforcement,
            cross_tenant: capacity.cross_tenant,
            topology: capacity.topology.clone(),
        };
        let i = self.engine.cluster.add_node(node);
        self.capacity.insert(name.to_string(), capacity);
        if self.live.insert(name.to_string(), i) != Some(i) {
            self.resolved.invalidate();
        }
        let mut problems = Vec::new();
        for uid in self.by_node.get(name).cloned().unwrap_or_default() {
            let b = &self.bookings[&uid];
            if let Err(e) = apply(&mut self.engine.cluster.nodes[i], b, Direction::Commit) {
                problems.push((uid, e));
            }
        }
        let (cpu, memory) = self.plain.sum(name);
        let n = &mut self.engine.cluster.nodes[i];
        n.cpu_used += cpu;
        n.memory_used += memory;
        if self.engine.cluster.model_count() != models_before {
            // A new model: recompile the workload's model constraints.
            let workload = self.engine.workload().clone();
            self.engine.set_workload(&workload);
        }
        self.engine.node_changed(i);
        problems
    }

    /// Removes a node. Its bookings are kept (the pods still exist until they are deleted) and
    /// count again if the node comes back.
    pub fn remove_node(&mut self, name: &str) {
        if self.capacity.remove(name).is_none() {
            return;
        }
        self.live.remove(name);
        self.resolved.invalidate();
        if let Some(i) = self.engine.cluster.node_index(name) {
            let n = &mut self.engine.cluster.nodes[i];
            *n = NodeState {
                name: name.to_string(),
                cpu_milli: 0,
                cpu_used: 0,
                memory_bytes: 0,
                memory_used: 0,
                cards: Vec::new(),
                schedulable: false,
                enforcement: Default::default(),
                cross_tenant: false,
                topology: None,
            };
            self.engine.node_changed(i);
        }
    }

    /// Books `uid` (replacing any earlier booking of it). An allocation that does not map onto
    /// the node is refused and nothing changes.
    pub fn book(&mut self, uid: &str, booking: Booking) -> Result<(), LedgerError> {
        if let Some(i) = self.node_index(&booking.node) {
            // Check on a copy first so that a bad allocation changes nothing.
            let mut probe = self.engine.cluster.nodes[i].clone();
            if let Some(old) = self.bookings.get(uid).filter(|o| o.node == booking.node) {
                let _ = apply(&mut probe, old, Direction::Release);
            }
            apply(&mut probe, &booking, Direction::Commit)?;
        }
        self.unbook(uid);
        if let Some(i) = self.node_index(&booking.node) {
            apply(&mut self.engine.cluster.nodes[i], &booking, Direction::Commit).expect("checked on a copy");
            self.engine.node_changed(i);
        }
        self.by_node
            .entry(booking.node.clone())
            .or_default()
            .insert(uid.to_string());
        self.bookings.insert(uid.to_string(), booking);
        Ok(())
    }

    /// Records a pod that holds no GPU: `cpu_milli` and `memory` bytes on `node` (replacing
    /// any booking of it).
    pub fn book_plain(&mut self, uid: &str, node: &str, cpu_milli: u64, memory: u64) {
        let id = self.plain.node_id(node);
        let hold = plain::PlainHold {
            node: id,
            cpu_milli: u32::try_from(cpu_milli).unwrap_or(u32::MAX),
            memory,
        };
        if self.plain.get(uid) == Some(hold) {
            return;
        }
        self.unbook(uid);
        self.plain.insert(uid, hold);
        self.plain_delta(node, hold, Direction::Commit);
    }

    /// Applies or releases a plain hold on its node, if the node is live.
    fn plain_delta(&mut self, node: &str, h: plain::PlainHold, dir: Direction) {
        let Some(i) = self.node_index(node) else { return };
        let n = &mut self.engine.cluster.nodes[i];
        match dir {
            Direction::Commit => {
                n.cpu_used += u64::from(h.cpu_milli);
                n.memory_used += h.memory;
            }
            Direction::Release => {
                n.cpu_used = n.cpu_used.saturating_sub(u64::from(h.cpu_milli));
                n.memory_used = n.memory_used.saturating_sub(h.memory);
            }
        }
        self.engine.node_changed(i);
    }

    /// Removes a booking (or a plain hold) and frees what it held; the booking, when it was
    /// one.
    pub fn unbook(&mut self, uid: &str) -> Option<Booking> {
        if let Some(h) = self.plain.remove(uid) {
            let node = self.plain.node_name(h.node).to_string();
            self.plain_delta(&node, h, Direction::Release);
            return None;
        }
        let b = self.bookings.remove(uid)?;
        if let Some(set) = self.by_node.get_mut(&b.node) {
            set.remove(uid);
            if set.is_empty() {
                self.by_node.remove(&b.node);
            }
        }
        if let Some(i) = self.node_index(&b.node) {
            let _ = apply(&mut self.engine.cluster.nodes[i], &b, Direction::Release);
            self.engine.node_changed(i);
        }
        Some(b)
    }

    /// Marks a booking as bound.
    pub fn confirm(&mut self, uid: &str) {
        if let Some(b) = self.bookings.get_mut(uid) {
            b.hold = Hold::Bound;
        }
    }

    /// UIDs of every booking of a pod with GPUs (for reconciling against a fresh list).
    pub fn booked_uids(&self) -> Vec<String> {
        self.bookings.keys().cloned().collect()
    }

    /// Keeps only the plain holds of pods in `listed` (a fresh list); frees the others.
    pub fn retain_plain(&mut self, listed: &std::collections::HashSet<String>) {
        let keys: std::collections::HashSet<u128> = listed.iter().map(|u| plain::key(u)).collect();
        for h in self.plain.retain(|k| keys.contains(&k)) {
            let node = self.plain.node_name(h.node).to_string();
            self.plain_delta(&node, h, Direction::Release);
        }
    }

    /// Plans `demand` on `node` with the engine, reserves it under `uid` and returns the
    /// allocation. A pod already booked on that node gets its existing allocation back (a
    /// retried bind); one booked elsewhere is moved.
    pub fn reserve(
        &mut self,
        uid: &str,
        node: &str,
        demand: &PodDemand,
        core_limit: Option<u32>,
    ) -> Result<Option<Allocation>, LedgerError> {
        self.reserve_holding(uid, node, demand, demand, core_limit, &[], &[])
    }

    /// Reserves a pod some of whose containers keep devices already booked for them under other
    /// keys (a claim's retained GPU): `held` are those containers' devices and `handover` the
    /// bookings that hold them now. The rest of the pod (`planned`: `demand` without the held
    /// containers' cards) is planned beside them as [`Ledger::reserve`] does (which is this with
    /// nothing held); then the handed-over bookings give way to the pod's in one step, or, if
    /// booking fails, stay.
    #[allow(clippy::too_many_arguments)]
    pub fn reserve_holding(
        &mut self,
        uid: &str,
        node: &str,
        demand: &PodDemand,
        planned: &PodDemand,
        core_limit: Option<u32>,
        held: &[ContainerAllocation],
        handover: &[&str],
    ) -> Result<Option<Allocation>, LedgerError> {
        if let Some(b) = self.bookings.get(uid) {
            if b.node == node {
                return Ok(b.allocation.clone());
            }
            // A reservation elsewhere is a bind that failed or was given up: replaced. A pod
            // bound elsewhere keeps its cards.
            if b.hold == Hold::Bound {
                return Err(LedgerError::AlreadyBound(b.node.clone()));
            }
        }
        self.unbook(uid);
        let i = self
            .node_index(node)
            .ok_or_else(|| LedgerError::UnknownNode(node.to_string()))?;
        let does_not_fit = |reason: String| LedgerError::DoesNotFit {
            node: node.to_string(),
            reason,
        };
        if let Some(elsewhere) = handover
            .iter()
            .find_map(|k| self.bookings.get(*k).filter(|b| b.node != node))
        {
            return Err(does_not_fit(format!(
                "its containers' devices are held on node {:?}",
                elsewhere.node
            )));
        }
        let mut allocation = if planned.wants_cards() {
            let placement = self.engine.plan_on(i, planned).map_err(does_not_fit)?;
            Some(allocation_of(
                &self.engine.cluster.nodes[i],
                planned,
                &placement.plan,
                uid,
            ))
        } else {
            check_node_resources(&self.engine.cluster.nodes[i], planned).map_err(does_not_fit)?;
            None
        };
        if !held.is_empty() {
            let a = allocation.get_or_insert_with(|| Allocation::new(node.to_string(), uid));
            a.containers.extend(held.iter().cloned());
            a.containers
                .sort_by_key(|c| demand.containers.iter().position(|d| d.name == c.name));
        }
        if let Some(a) = &mut allocation {
            a.core_limit = core_limit;
        }
        let given_way: Vec<(String, Booking)> = handover
            .iter()
            .filter_map(|k| self.unbook(k).map(|b| (k.to_string(), b)))
            .collect();
        let booking = Booking {
            node: node.to_string(),
            demand: demand.clone(),
            allocation: allocation.clone(),
            hold: Hold::Reserved,
        };
        if let Err(e) = self.book(uid, booking) {
            for (k, b) in given_way {
                let _ = self.book(&k, b);
            }
            return Err(e);
        }
        Ok(allocation)
    }

    /// Whether `demand` fits on `node` once the pods `victims` are gone (their bookings are
    /// released on a copy; nothing changes).
    pub fn fits_without(&mut self, node: &str, demand: &PodDemand, victims: &[&str]) -> Result<(), String> {
        let i = self
            .node_index(node)
            .ok_or_else(|| format!("node {node:?} is not known"))?;
        let saved = self.engine.cluster.nodes[i].clone();
        for v in victims {
            if let Some(b) = self.bookings.get(*v).filter(|b| b.node == node) {
                let _ = apply(&mut self.engine.cluster.nodes[i], b, Direction::Release);
            } else if let Some(h) = self.plain.get(v).filter(|h| self.plain.node_name(h.node) == node) {
                let n = &mut self.engine.cluster.nodes[i];
                n.cpu_used = n.cpu_used.saturating_sub(u64::from(h.cpu_milli));
                n.memory_used = n.memory_used.saturating_sub(h.memory);
            }
        }
        self.engine.node_changed(i);
        let r = self.engine.plan_on(i, demand).map(|_| ());
        self.engine.cluster.nodes[i] = saved;
        self.engine.node_changed(i);
        r
    }
}

#[derive(Clone, Copy)]
enum Direction {
    Commit,
    Release,
}

fn apply(node: &mut NodeState, b: &Booking, dir: Direction) -> Result<(), LedgerError> {
    let usage = match &b.allocation {
        Some(a) => usage_of(node, &b.demand, a)?,
        None => PodUsage::new(),
    };
    match dir {
        Direction::Commit => crate::placement::commit_usage(node, &b.demand, &usage),
        Direction::Release => crate::placement::release_usage(node, &b.demand, &usage),
    }
    Ok(())
}

/// The hand-off allocation for a plan on `node`.
pub fn allocation_of(node: &NodeState, demand: &PodDemand, plan: &NodePlan, uid: &str) -> Allocation {
    let mut a = Allocation::new(node.name.clone(), uid);
    for cp in &plan.containers {
        let c = &demand.containers[cp.container];
        let devices = cp
            .cards
            .iter()
            .map(|assign| {
                let card = &node.cards[assign.card];
                match assign.mig_slot {
                    Some(s) => {
                        let slot = &card.mig.as_ref().expect("MIG slot on a MIG card")[s];
                        AllocatedDevice::Mig {
                            uuid: slot.uuid.clone(),
                            profile: slot.profile.clone(),
                            parent_uuid: card.uuid.clone(),
                            parent_index: card.index,
                            gi: slot.gi,
                            ci: slot.ci,
                        }
                    }
                    None => AllocatedDevice::Gpu {
                        uuid: card.uuid.clone(),
                        index: card.index,
                        minor: card.minor,
                        core_percent: assign.core_milli * 100 / CARD_MILLI,
                        memory_mib: assign.memory_mib,
                        exclusive: assign.exclusive,
                    },
                }
            })
            .collect();
        a.containers.push(ContainerAllocation {
            name: c.name.clone(),
            role: c.role,
            devices,
        });
    }
    a
}

/// What `allocation` takes of `node`'s cards: per card, the maximum over the pod's phases of
/// what the containers running together use (the same rule the engine plans with).
pub fn usage_of(node: &NodeState, demand: &PodDemand, allocation: &Allocation) -> Result<PodUsage, LedgerError> {
    let unknown = |uuid: &str| LedgerError::UnknownDevice {
        node: node.name.clone(),
        uuid: uuid.to_string(),
    };
    // Per container (by demand index): its devices as (card, core, memory, mig slot, share
    // user).
    type Held = (usize, u32, u64, Option<usize>, Option<ShareOwner>);
    let mut per_container: Vec<Vec<Held>> = vec![Vec::new(); demand.containers.len()];
    for ca in &allocation.containers {
        let ci = demand
            .containers
            .iter()
            .position(|c| c.name == ca.name)
            .ok_or_else(|| LedgerError::UnknownContainer(ca.name.clone()))?;
        for d in &ca.devices {
            let card = node
                .cards
                .iter()
                .position(|c| c.uuid == d.card_uuid())
                .ok_or_else(|| unknown(d.card_uuid()))?;
            per_container[ci].push(match d {
                AllocatedDevice::Gpu {
                    core_percent,
                    memory_mib,
                    exclusive,
                    ..
                } => (
                    card,
                    core_percent * CARD_MILLI / 100,
                    *memory_mib,
                    None,
                    (!exclusive).then_some(ShareOwner {
                        uid: demand.containers[ci].run_as_user,
                        tenant: demand.tenant,
                    }),
                ),
                AllocatedDevice::Mig { uuid, .. } => {
                    let slot = node.cards[card]
                        .mig
                        .as_ref()
                        .and_then(|s| s.iter().position(|m| &m.uuid == uuid))
                        .ok_or_else(|| unknown(uuid))?;
                    (card, 0, 0, Some(slot), None)
                }
            });
        }
    }
    let mut usage = PodUsage::new();
    for phase in &demand.phases {
        let mut phase_usage: PodUsage = PodUsage::new();
        for &ci in phase {
            for &(card, core, mem, slot, user) in &per_container[ci] {
                let u = phase_usage.entry(card).or_default();
                u.core_milli += core;
                u.memory_mib += mem;
                u.mig_slots.extend(slot);
                u.share_user = u.share_user.or(user);
            }
        }
        for (card, pu) in phase_usage {
            let u: &mut CardUsage = usage.entry(card).or_default();
            u.core_milli = u.core_milli.max(pu.core_milli);
            u.memory_mib = u.memory_mib.max(pu.memory_mib);
            u.share_user = u.share_user.or(pu.share_user);
            for s in pu.mig_slots {
                if !u.mig_slots.contains(&s) {
                    u.mig_slots.push(s);
                }
            }
        }
    }
    Ok(usage)
}

#[cfg(test)]
mod tests;
