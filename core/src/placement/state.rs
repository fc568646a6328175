//! The cluster as the placement engine sees it: nodes with CPU, memory and cards, and what is
//! committed on each.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::enforcement::ShareEnforcement;
use crate::inventory::{Gpu, model_matches};
use crate::mig::MigProfile;
use crate::topology::{CardSet, GpuTopology, Link, LinkRequirement, choose_set, link_between};

/// Compute of one card in milli-GPU (the engine's unit; 10 milli = 1 % of `tessera.io/gpu-core`).
pub const CARD_MILLI: u32 = 1000;

/// A MIG device slot on a card.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigSlot {
    /// `MIG-<uuid>`.
    pub uuid: String,
    /// Profile.
    pub profile: MigProfile,
    /// GPU instance id.
    pub gi: u32,
    /// Compute instance id.
    pub ci: u32,
    /// Given to a pod.
    pub used: bool,
}

/// One card and what is committed on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CardState {
    /// `GPU-<uuid>` (or a synthetic id in simulations).
    pub uuid: String,
    /// NVML index.
    pub index: u32,
    /// Device minor.
    pub minor: u32,
    /// Interned model id (see [`ClusterState::model_name`]).
    pub model: u16,
    /// Total memory, MiB.
    pub memory_mib: u64,
    /// NUMA node.
    pub numa: Option<u32>,
    /// Healthy cards only are offered.
    pub healthy: bool,
    /// Committed compute, milli.
    pub core_used: u32,
    /// Committed memory, MiB.
    pub memory_used: u64,
    /// `Some` when the card is in MIG mode: only its MIG devices are offered.
    pub mig: Option<Vec<MigSlot>>,
    /// Who the card's shares belong to (user and tenant), and how many pods hold a share on
    /// it.
    pub share_user: Option<ShareUser>,
}

/// A tenant: who a pod belongs to when cards are shared between teams (the pod's namespace, or
/// a group of namespaces). Kept as a digest of its name (the first 64 bits of its SHA-256, so a
/// namespace name cannot be chosen to pass for another tenant's): placement compares tenants
/// and never needs a name, and a refusal never names another tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Tenant(pub u64);

impl Tenant {
    /// Pods that name no tenant (the simulator's): all one tenant.
    pub const UNNAMED: Tenant = Tenant(0);

    /// The tenant named `name`.
    pub fn named(name: &str) -> Self {
        use sha2::{Digest as _, Sha256};
        let d = Sha256::digest(name.as_bytes());
        let mut first = [0u8; 8];
        first.copy_from_slice(&d[..8]);
        Tenant(u64::from_le_bytes(first).max(1))
    }

    /// The tenant of a namespace's pods: the group its [`crate::names::LABEL_TENANT`] label
    /// names, when set, else the namespace alone. A group is never a namespace's own tenant
    /// (group `a` and an unlabelled namespace `a` are two tenants).
    pub fn of_namespace(namespace: &str, label: Option<&str>) -> Self {
        match label.map(str::trim).filter(|l| !l.is_empty()) {
            // ':' is in no namespace name.
            Some(group) => Self::named(&format!("group:{group}")),
            None => Self::named(namespace),
        }
    }
}

/// Who runs a share: its user (`runAsUser`, `None` when the pod does not say) and its tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ShareOwner {
    /// `runAsUser`, when the pod says.
    pub uid: Option<u32>,
    /// The pod's tenant.
    pub tenant: Tenant,
}

/// Who a card's shares belong to (that of the first share placed) and how many pods hold a
/// share on the card.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ShareUser {
    /// `runAsUser`, when the pods say.
    pub uid: Option<u32>,
    /// Their tenant.
    pub tenant: Tenant,
    /// Pods with a share on the card.
    pub pods: u32,
}

/// Why a card does not take a share that has room on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ShareRefusal {
    /// MPS serves one user per card, and the card's shares run as this one.
    OtherUser(Option<u32>),
    /// The card's shares belong to another tenant and the node does not share cards between
    /// tenants.
    OtherTenant,
}

impl CardState {
    /// Free compute, milli.
    pub fn core_free(&self) -> u32 {
        CARD_MILLI.saturating_sub(self.core_used)
    }

    /// Free memory, MiB.
    pub fn memory_free(&self) -> u64 {
        self.memory_mib.saturating_sub(self.memory_used)
    }

    /// Offered for shares and whole allocations (healthy, not in MIG mode).
    pub fn offers_compute(&self) -> bool {
        self.healthy && self.mig.is_none()
    }

    /// Nothing committed on it.
    pub fn is_idle(&self) -> bool {
        self.core_used == 0 && self.memory_used == 0
    }

    /// Whether a share of `owner` may join this card on a node enforcing with `mode` that
    /// shares cards between tenants or not: a card's shares belong to one tenant unless the
    /// node opts in, and MPS serves one user per card.
    pub fn admits(&self, mode: ShareEnforcement, cross_tenant: bool, owner: ShareOwner) -> Result<(), ShareRefusal> {
        ShareUser::admits(self.share_user.as_ref(), mode, cross_tenant, owner)
    }
}

impl ShareUser {
    /// [`CardState::admits`] for a card whose shares are `user`'s (`None`: it holds none).
    pub fn admits(
        user: Option<&ShareUser>,
        mode: ShareEnforcement,
        cross_tenant: bool,
        owner: ShareOwner,
    ) -> Result<(), ShareRefusal> {
        let Some(u) = user else {
            return Ok(());
        };
        if !cross_tenant && u.tenant != owner.tenant {
            return Err(ShareRefusal::OtherTenant);
        }
        if mode == ShareEnforcement::Mps && u.uid != owner.uid {
            return Err(ShareRefusal::OtherUser(u.uid));
        }
        Ok(())
    }
}

/// One node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeState {
    /// Node name.
    pub name: String,
    /// Allocatable CPU, millicores.
    pub cpu_milli: u64,
    /// Committed CPU, millicores.
    pub cpu_used: u64,
    /// Allocatable memory, bytes.
    pub memory_bytes: u64,
    /// Committed memory, bytes.
    pub memory_used: u64,
    /// Cards, by index.
    pub cards: Vec<CardState>,
    /// False for cordoned / not-ready nodes.
    pub schedulable: bool,
    /// How the node holds shares to their limits.
    pub enforcement: ShareEnforcement,
    /// Whether one card's shares may belong to different tenants (the operator's opt-in,
    /// [`crate::names::LABEL_CROSS_TENANT_SHARING`]).
    pub cross_tenant: bool,
    /// How its cards are connected (by card position), when the node publishes it.
    pub topology: Option<Arc<GpuTopology>>,
}

impl NodeState {
    /// The link between cards `a` and `b`: from the node's topology, else from the cards' NUMA
    /// nodes; `None` when neither says.
    pub fn link(&self, a: usize, b: usize) -> Option<Link> {
        link_between(self.topology.as_deref(), |i| self.cards.get(i)?.numa, a, b)
    }

    /// Chooses `want` of the `idle` cards for one container (see [`choose_set`]); on a node
    /// that publishes no topology and no NUMA nodes, simply the lowest positions.
    pub fn choose_cards(
        &self,
        idle: &[usize],
        want: usize,
        require: Option<LinkRequirement>,
    ) -> Result<CardSet, String> {
        let knows_links = self.topology.is_some() || self.cards.iter().any(|c| c.numa.is_some());
        if knows_links || require.is_some() || want > idle.len() {
            return choose_set(|a, b| self.link(a, b), idle, want, require);
        }
        let mut cards = idle[..want].to_vec();
        if !cards.is_sorted() {
            cards.sort_unstable();
        }
        Ok(CardSet { cards, worst: None })
    }

    /// Free CPU, millicores.
    pub fn cpu_free(&self) -> u64 {
        self.cpu_milli.saturating_sub(self.cpu_used)
    }

    /// Free memory, bytes.
    pub fn memory_free(&self) -> u64 {
        self.memory_bytes.saturating_sub(self.memory_used)
    }

    /// Free compute over all cards that offer it, milli.
    pub fn gpu_free_milli(&self) -> u64 {
        self.cards
            .iter()
            .filter(|c| c.offers_compute())
            .map(|c| u64::from(c.core_free()))
            .sum()
    }

    /// Compute capacity of cards that offer it, milli.
    pub fn gpu_capacity_milli(&self) -> u64 {
        self.cards.iter().filter(|c| c.offers_compute()).count() as u64 * u64::from(CARD_MILLI)
    }

    /// The node's model (of its first card), for nodes with one model.
    pub fn model(&self) -> Option<u16> {
        self.cards.first().map(|c| c.model)
    }

    /// Whether evicting pods could ever make room for `pod` here: the node is schedulable and,
    /// when the pod wants cards, has a healthy card of an `allowed` model.
    pub fn could_take(&self, pod: &super::PodDemand, allowed: &[bool]) -> bool {
        self.schedulable
            && pod.enforcement_ok(self.enforcement).is_ok()
            && (!pod.wants_cards()
                || self
                    .cards
                    .iter()
                    .any(|c| c.healthy && allowed.get(usize::from(c.model)).copied().unwrap_or(false)))
    }
}

/// All nodes plus the interned model names.
#[derive(Debug, Clone, Default)]
pub struct ClusterState {
    /// Nodes, in the order the engine scans them.
    pub nodes: Vec<NodeState>,
    models: Vec<String>,
    by_name: BTreeMap<String, usize>,
}

impl ClusterState {
    /// An empty cluster.
    pub fn new() -> Self {
        Self::default()
    }

    /// Interns a model name.
    pub fn model_id(&mut self, model: &str) -> u16 {
        if let Some(i) = self.models.iter().position(|m| m == model) {
            return i as u16;
        }
        self.models.push(model.to_string());
        (self.models.len() - 1) as u16
    }

    /// A model's name.
    pub fn model_name(&self, id: u16) -> &str {
        &self.models[usize::from(id)]
    }

    /// Number of interned models.
    pub fn model_count(&self) -> usize {
        self.models.len()
    }

    /// Which interned models each entry of `constraints` allows (`None` = all).
    pub fn allowed_models(&self, constraints: Option<&[String]>) -> Vec<bool> {
        self.models
            .iter()
            .map(|m| constraints.is_none_or(|cs| cs.iter().any(|c| model_matches(m, c))))
            .collect()
    }

    /// Adds a node; a node of the same name is replaced.
    pub fn add_node(&mut self, node: NodeState) -> usize {
        if let Some(&i) = self.by_name.get(&node.name) {
            self.nodes[i] = node;
            return i;
        }
        self.by_name.insert(node.name.clone(), self.nodes.len());
        self.nodes.push(node);
        self.nodes.len() - 1
    }

    /// A node's position, by name.
    pub fn node_index(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    /// Reorders the nodes (the simulator shuffles them per seed).
    pub fn reorder(&mut self, order: &[usize]) {
        let mut nodes: Vec<Option<NodeState>> = std::mem::take(&mut self.nodes).into_iter().map(Some).collect();
        self.nodes = order
            .iter()
            .map(|&i| nodes[i].take().expect("order is a permutation"))
            .collect();
        self.by_name = self
            .nodes
            .iter()
            .enumerate()
            .map(|(i, n)| (n.name.clone(), i))
            .collect();
    }

    /// Cards for a node from its published inventory.
    pub fn cards_from_inventory(&mut self, gpus: &[Gpu]) -> Vec<CardState> {
        gpus.iter()
            .map(|g| CardState {
                uuid: g.uuid.clone(),
                index: g.index,
                minor: g.minor,
                model: self.model_id(&g.model),
                memory_mib: g.memory_mib,
                numa: g.numa_node,
                healthy: g.health.is_healthy(),
                core_used: 0,
                memory_used: 0,
                share_user: None,
                mig: g.mig_enabled.then(|| {
                    g.mig_devices
                        .iter()
                        .map(|m| MigSlot {
                            uuid: m.uuid.clone(),
                            profile: m.profile.clone(),
                            gi: m.gi,
                            ci: m.ci,
                            used: false,
                        })
                        .collect()
                }),
            })
            .collect()
    }

    /// Total compute capacity of all cards that offer it, milli.
    pub fn gpu_capacity_milli(&self) -> u64 {
        self.nodes.iter().map(NodeState::gpu_capacity_milli).sum()
    }

    /// Committed compute over all cards, milli.
    pub fn gpu_used_milli(&self) -> u64 {
        self.nodes
            .iter()
            .flat_map(|n| n.cards.iter().filter(|c| c.offers_compute()))
            .map(|c| u64::from(c.core_used))
            .sum()
    }
}
