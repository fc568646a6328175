//! What the engine places: a pod's CPU, memory and per-container card demands.

use crate::enforcement::{EnforcementRequirement, ShareEnforcement};
use crate::mig::MigProfile;
use crate::policy::PolicyKind;
use crate::request::{ContainerRole, GpuDemand, PodRequest};
use crate::topology::LinkRequirement;

use super::state::CARD_MILLI;

/// What one container needs of the cards.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum CardDemand {
    /// A share of one card: compute in milli (0 = memory only) and memory (`None` = in
    /// proportion to the compute on the chosen card).
    Share {
        /// Guaranteed compute, milli.
        core_milli: u32,
        /// Memory, MiB.
        memory_mib: Option<u64>,
    },
    /// Whole, idle cards.
    Whole {
        /// How many.
        cards: u32,
        /// Minimum memory per card, MiB.
        min_memory_mib: Option<u64>,
    },
    /// MIG devices: `(profile, count)` pairs.
    Mig(Vec<(MigProfile, u32)>),
}

impl CardDemand {
    /// Compute this demand takes in milli, counting whole cards as 1000 each (MIG: 0).
    pub fn gpu_milli(&self) -> u64 {
        match self {
            CardDemand::Share { core_milli, .. } => u64::from(*core_milli),
            CardDemand::Whole { cards, .. } => u64::from(*cards) * u64::from(CARD_MILLI),
            CardDemand::Mig(_) => 0,
        }
    }
}

/// One container that needs cards.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ContainerDemand {
    /// Container name.
    pub name: String,
    /// When it runs.
    pub role: ContainerRole,
    /// What it needs.
    pub cards: CardDemand,
    /// The user it runs as, when the pod says (one user per shared card on MPS nodes).
    pub run_as_user: Option<u32>,
}

/// A pod as the engine places it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct PodDemand {
    /// Effective CPU request, millicores.
    pub cpu_milli: u64,
    /// Effective memory request, bytes.
    pub memory_bytes: u64,
    /// Allowed GPU models (`None` = any).
    pub gpu_models: Option<Vec<String>>,
    /// Containers that need cards.
    pub containers: Vec<ContainerDemand>,
    /// Which containers run at the same time (indices into `containers`).
    pub phases: Vec<Vec<usize>>,
    /// Node-tier policy override.
    pub node_policy: Option<PolicyKind>,
    /// Card-tier policy override.
    pub gpu_policy: Option<PolicyKind>,
    /// The share enforcement the pod requires of its node.
    pub share_enforcement: Option<EnforcementRequirement>,
    /// How well each container's whole cards must be connected (`None`: the best set is
    /// preferred, any will do).
    pub gpu_link: Option<LinkRequirement>,
    /// The pod's tenant (its shares join only cards of the same tenant, unless the node shares
    /// cards between tenants).
    pub tenant: super::Tenant,
}

impl PodDemand {
    /// A single-container pod, the shape of the Alibaba trace's tasks.
    pub fn single(cpu_milli: u64, memory_bytes: u64, cards: Option<CardDemand>) -> Self {
        let containers: Vec<ContainerDemand> = cards
            .into_iter()
            .map(|cards| ContainerDemand {
                name: "main".into(),
                role: ContainerRole::App,
                cards,
                run_as_user: None,
            })
            .collect();
        let phases = vec![(0..containers.len()).collect()];
        Self {
            cpu_milli,
            memory_bytes,
            containers,
            phases,
            ..Default::default()
        }
    }

    /// The demand of a parsed pod request.
    pub fn from_request(req: &PodRequest) -> Self {
        let mut containers = Vec::new();
        let mut index_of = vec![None; req.containers.len()];
        for (i, c) in req.containers.iter().enumerate() {
            let cards = match &c.gpu {
                GpuDemand::None => continue,
                GpuDemand::Share(s) => CardDemand::Share {
                    core_milli: s.core_percent * (CARD_MILLI / 100),
                    memory_mib: s.memory_mib,
                },
                GpuDemand::Whole { cards, min_memory_mib } => CardDemand::Whole {
                    cards: *cards,
                    min_memory_mib: *min_memory_mib,
                },
                GpuDemand::Mig(m) => CardDemand::Mig(m.iter().map(|d| (d.profile.clone(), d.count)).collect()),
            };
            index_of[i] = Some(containers.len());
            containers.push(ContainerDemand {
                name: c.name.clone(),
                role: c.role,
                cards,
                run_as_user: c.run_as_user,
            });
        }
        let phases = req
            .phases()
            .into_iter()
            .map(|p| p.into_iter().filter_map(|i| index_of[i]).collect::<Vec<_>>())
            .filter(|p: &Vec<usize>| !p.is_empty())
            .collect();
        Self {
            cpu_milli: req.effective_cpu_milli(),
            memory_bytes: req.effective_memory_bytes(),
            gpu_models: req.gpu_models.clone(),
            containers,
            phases,
            node_policy: req.node_policy,
            gpu_policy: req.gpu_policy,
            share_enforcement: req.share_enforcement,
            gpu_link: req.gpu_link,
            tenant: Default::default(),
        }
    }

    /// True when some container asks for a share of a card.
    pub fn wants_share(&self) -> bool {
        self.containers
            .iter()
            .any(|c| matches!(c.cards, CardDemand::Share { .. }))
    }

    /// Whether a node enforcing shares with `mode` meets the pod's requirement (pods without
    /// shares require nothing).
    pub fn enforcement_ok(&self, mode: ShareEnforcement) -> Result<(), String> {
        match self.share_enforcement {
            Some(req) if self.wants_share() => req.check(mode),
            _ => Ok(()),
        }
    }

    /// True when some container needs cards.
    pub fn wants_cards(&self) -> bool {
        !self.containers.is_empty()
    }

    /// Total compute the pod asks for in milli (what "arrived GPU request" counts).
    pub fn gpu_milli(&self) -> u64 {
        self.phases
            .iter()
            .map(|p| p.iter().map(|&i| self.containers[i].cards.gpu_milli()).sum::<u64>())
            .max()
            .unwrap_or(0)
    }

    /// The pod's shape for fragmentation accounting: (milli per card, cards).
    pub fn shape(&self) -> (u32, u32) {
        let mut best = (0u32, 0u32);
        for c in &self.containers {
            let s = match &c.cards {
                CardDemand::Share { core_milli, .. } => (*core_milli, 1),
                CardDemand::Whole { cards, .. } => (CARD_MILLI, *cards),
                CardDemand::Mig(_) => continue,
            };
            if u64::from(s.0) * u64::from(s.1) > u64::from(best.0) * u64::from(best.1) {
                best = s;
            }
        }
        best
    }
}
