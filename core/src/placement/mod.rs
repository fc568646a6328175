//! The placement engine: node tier (which node), then card tier (which cards on it).
//!
//! The extender uses it online (filter / prioritize / bind) and the simulator replays traces
//! through exactly the same code. Policies are chosen per cluster and overridable per pod for
//! each tier ([`PolicyKind`]); `fgd` follows the published FGD simulator's scoring, and
//! `mosaic` is Tessera's own policy (see `docs/placement.md`).

mod demand;
mod evaluate;
mod fit;
mod frag;
mod many;
mod memo;
mod refusal;
mod rng;
mod share;
mod state;
mod terms;
#[cfg(test)]
mod tests;
mod threads;

use std::fmt;

pub use demand::{CardDemand, ContainerDemand, PodDemand};
pub use evaluate::Verdict;
pub(crate) use evaluate::prefetch;
pub use fit::{
    CardAssign, CardUsage, ContainerPlacement, NodePlan, PodUsage, ShareChooser, check_node_resources,
    commit as commit_usage, plan_node, release as release_usage,
};
pub use frag::{
    ChangeBase, ClassSums, Fragmentation, NodeShape, TargetWorkload, WorkloadClass, WorkloadLearner, fgd_score,
};
pub use rng::Rng;
pub use state::{CARD_MILLI, CardState, ClusterState, MigSlot, NodeState, ShareOwner, ShareRefusal, ShareUser, Tenant};
pub use threads::{HelperPlacement, WAIT_AT_MOST, Woken, place_helpers, wake_helpers};

use crate::enforcement::ShareEnforcement;
use crate::policy::PolicyKind;
use evaluate::{Evaluator, Scratch};
use frag::LevelTerms;
use many::Unsettled;
use memo::{ScoreMemo, VerdictMemo};
use terms::NodeTerms;

/// Engine settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// Default node-tier policy.
    pub node_policy: PolicyKind,
    /// Default card-tier policy.
    pub gpu_policy: PolicyKind,
    /// Seed for `random` and for breaking ties.
    pub seed: u64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            node_policy: PolicyKind::Mosaic,
            gpu_policy: PolicyKind::Mosaic,
            seed: 0,
        }
    }
}

/// A chosen node and plan.
#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    /// Node position in [`ClusterState::nodes`].
    pub node: usize,
    /// Cards per container.
    pub plan: NodePlan,
    /// The node's score.
    pub score: f64,
}

/// No node fits; the reason for each node examined.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unschedulable {
    /// `(node name, reason)`.
    pub reasons: Vec<(String, String)>,
}

impl fmt::Display for Unschedulable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "0/{} nodes fit", self.reasons.len())?;
        let mut counts: std::collections::BTreeMap<&str, usize> = std::collections::BTreeMap::new();
        for (_, r) in &self.reasons {
            *counts.entry(r.as_str()).or_default() += 1;
        }
        for (r, n) in counts {
            write!(f, "; {n} node(s): {r}")?;
        }
        Ok(())
    }
}

/// What was decided for a simple pod on one node (one container, one phase).
#[derive(Debug, Clone, Copy)]
enum SimpleChoice {
    NoCards,
    Share { card: usize, memory_mib: u64 },
    Whole,
}

/// The placement engine.
#[derive(Debug, Clone)]
pub struct Engine {
    /// The cluster and what is committed on it.
    pub cluster: ClusterState,
    config: EngineConfig,
    scratch: Scratch,
    workload: TargetWorkload,
    node_frag: Vec<Option<f64>>,
    /// Per node, its verdicts for the last few pod shapes (or GPU asks).
    score_memo: VerdictMemo,
    /// What share evaluations read of each node (card briefs, fragmentation terms), kept
    /// while the node does not change.
    terms: NodeTerms,
    /// Changes told to the engine (nodes, workload): see [`Engine::changes`].
    changes: u64,
    /// What the last evaluation found that the memos are yet to take ([`Engine::settle`]).
    unsettled: Option<Unsettled>,
    /// [`Unsettled::done`]'s buffer once settled, for the next evaluation.
    spare: Vec<Option<many::Evaluated>>,
}

/// A share chooser for the general (multi-container) path.
struct PolicyChooser<'a> {
    policy: PolicyKind,
    frag: &'a mut Fragmentation,
    rng: &'a mut Rng,
    cpu_after: u64,
}

impl ShareChooser for PolicyChooser<'_> {
    fn choose(
        &mut self,
        node: &NodeState,
        free: &[(u32, u64)],
        candidates: &[usize],
        core: u32,
        _memory: &[u64],
    ) -> usize {
        let model = node.model().unwrap_or(0);
        let frees: Vec<u32> = (0..node.cards.len())
            .filter(|&i| node.cards[i].offers_compute())
            .map(|i| free[i].0)
            .collect();
        let pos = |card: usize| (0..card).filter(|&i| node.cards[i].offers_compute()).count();
        match self.policy {
            PolicyKind::Random => candidates[self.rng.below(candidates.len() as u64) as usize],
            PolicyKind::Spread => *candidates
                .iter()
                .max_by_key(|&&i| (free[i].0, free[i].1, usize::MAX - i))
                .expect("non-empty"),
            PolicyKind::Binpack | PolicyKind::Bestfit => *candidates
                .iter()
                .min_by_key(|&&i| (free[i].0, free[i].1, i))
                .expect("non-empty"),
            PolicyKind::Fgd | PolicyKind::Mosaic => {
                let before = self.frag.eval(model, self.cpu_after, &frees);
                let mut best = (f64::NEG_INFINITY, candidates[0]);
                for &c in candidates {
                    let mut after = frees.clone();
                    after[pos(c)] -= core;
                    let fa = self.frag.eval(model, self.cpu_after, &after);
                    let s = if self.policy == PolicyKind::Fgd {
                        fgd_score(before, fa)
                    } else {
                        mosaic_card_score(self.frag, before, fa, free[c].0, core)
                    };
                    if s > best.0 {
                        best = (s, c);
                    }
                }
                best.1
            }
        }
    }
}

/// Mosaic's card score: least fragmentation growth; then the card whose remainder the target
/// workload is most likely to fill completely (expected waste, see
/// [`Fragmentation::card_waste`]); then the fullest card.
fn mosaic_card_score(frag: &Fragmentation, before: f64, after: f64, core_free: u32, core: u32) -> f64 {
    let left = core_free - core;
    let waste_growth = frag.card_waste(left) - frag.card_waste(core_free);
    (before - after) - waste_growth * 1e-3 - f64::from(left) * 1e-9
}

impl Engine {
    /// An engine over `cluster`, measuring fragmentation against `workload`.
    pub fn new(cluster: ClusterState, workload: &TargetWorkload, config: EngineConfig) -> Self {
        let frag = Fragmentation::new(workload, &cluster);
        let n = cluster.nodes.len();
        let mut terms = NodeTerms::default();
        terms.reset(frag.levels(), &cluster);
        Self {
            cluster,
            config,
            scratch: Scratch::new(frag, config.seed),
            workload: workload.clone(),
            node_frag: vec![None; n],
            score_memo: VerdictMemo::new(n),
            terms,
            changes: 0,
            unsettled: None,
            spare: Vec::new(),
        }
    }

    /// The settings.
    pub fn config(&self) -> EngineConfig {
        self.config
    }

    /// The target workload fragmentation is measured against.
    pub fn workload(&self) -> &TargetWorkload {
        &self.workload
    }

    /// Replaces the target workload (e.g. from a [`WorkloadLearner`]).
    pub fn set_workload(&mut self, workload: &TargetWorkload) {
        self.scratch.frag = Fragmentation::new(workload, &self.cluster);
        self.scratch.runs_key = None;
        self.terms.reset(self.scratch.frag.levels(), &self.cluster);
        self.workload = workload.clone();
        self.node_frag.iter_mut().for_each(|f| *f = None);
        self.score_memo.clear();
        self.unsettled = None;
        self.changes += 1;
    }

    /// How many changes the engine has been told of (a node, the workload; each forgets
    /// remembered verdicts). While it stays the same, a pod whose verdicts the engine
    /// [remembers](Engine::remembers) gets the same verdicts again.
    pub fn changes(&self) -> u64 {
        self.changes
    }

    /// Whether the engine remembers `pod`'s verdicts: its policies are deterministic.
    pub fn remembers(&self, pod: &PodDemand) -> bool {
        let (node_policy, gpu_policy) = evaluate::policies(&self.config, pod);
        node_policy != PolicyKind::Random && gpu_policy != PolicyKind::Random
    }

    /// [`NodeState::could_take`] for node `n`, from what is kept of the node where it can be:
    /// a filter of a busy cluster asks it of every node refused, whose cards it then need not
    /// read.
    pub fn could_take(&self, n: usize, pod: &PodDemand, allowed: &[bool]) -> bool {
        let node = &self.cluster.nodes[n];
        let Some(healthy) = self.terms.healthy_models(n) else {
            return node.could_take(pod, allowed);
        };
        // Every healthy card's model is under 64: later models do not matter.
        let allowed = allowed
            .iter()
            .take(64)
            .enumerate()
            .fold(0u64, |mask, (m, &a)| mask | (u64::from(a) << m));
        node.schedulable
            && pod.enforcement_ok(node.enforcement).is_ok()
            && (!pod.wants_cards() || healthy & allowed != 0)
    }

    /// Tells the engine a node changed outside [`Engine::commit`] / [`Engine::release`].
    pub fn node_changed(&mut self, node: usize) {
        self.settle();
        if self.node_frag.len() < self.cluster.nodes.len() {
            self.node_frag.resize(self.cluster.nodes.len(), None);
        }
        self.node_frag[node] = None;
        self.score_memo.forget(node);
        self.terms.forget(node);
        self.changes += 1;
    }

    /// Fragmentation of one node now, milli-GPU.
    pub fn node_fragmentation(&mut self, node: usize) -> f64 {
        self.evaluator().node_fragmentation(node)
    }

    /// Fragmentation of the whole cluster, milli-GPU.
    pub fn cluster_fragmentation(&mut self) -> f64 {
        (0..self.cluster.nodes.len()).map(|n| self.node_fragmentation(n)).sum()
    }

    fn policies(&self, pod: &PodDemand) -> (PolicyKind, PolicyKind) {
        evaluate::policies(&self.config, pod)
    }

    fn is_simple(pod: &PodDemand) -> bool {
        pod.containers.len() <= 1
            && pod.phases.len() <= 1
            && pod
                .containers
                .first()
                .is_none_or(|c| !matches!(c.cards, CardDemand::Mig(_)))
    }

    /// Scores `pod` on node `n` (higher is better), or says why it does not fit.
    pub fn score_node(&mut self, n: usize, pod: &PodDemand, allowed: &[bool]) -> Result<f64, String> {
        self.evaluate(n, pod, allowed).map(|(s, _)| s)
    }

    /// Makes room in the per-node memos for every node, once they hold what the last
    /// evaluation found.
    fn grow_memos(&mut self) {
        self.settle();
        if self.node_frag.len() < self.cluster.nodes.len() {
            self.node_frag.resize(self.cluster.nodes.len(), None);
        }
        self.score_memo.grow(self.cluster.nodes.len());
        self.terms.grow(self.cluster.nodes.len());
    }

    /// An evaluator over this engine's cluster, scratch and memos.
    fn evaluator(&mut self) -> Evaluator<'_> {
        self.grow_memos();
        Evaluator {
            cluster: &self.cluster,
            config: self.config,
            s: &mut self.scratch,
            node_frag: evaluate::FragMemo::Own(&mut self.node_frag),
            terms: &self.terms,
        }
    }

    fn evaluate(&mut self, n: usize, pod: &PodDemand, allowed: &[bool]) -> Result<(f64, Option<SimpleChoice>), String> {
        self.evaluator().evaluate(n, pod, allowed).map_err(|r| r.to_string())
    }

    fn plan_general(
        &mut self,
        n: usize,
        pod: &PodDemand,
        allowed: &[bool],
        gpu_policy: PolicyKind,
    ) -> Result<NodePlan, String> {
        self.evaluator().plan_general(n, pod, allowed, gpu_policy)
    }

    /// The plan for `pod` on node `n` (card tier only).
    pub fn plan_on(&mut self, n: usize, pod: &PodDemand) -> Result<Placement, String> {
        let allowed = self.cluster.allowed_models(pod.gpu_models.as_deref());
        let (score, choice) = self.evaluate(n, pod, &allowed)?;
        let plan = match choice {
            Some(c) => self.simple_plan(n, pod, c),
            None => {
                let (_, gpu_policy) = self.policies(pod);
                self.plan_general(n, pod, &allowed, gpu_policy)?
            }
        };
        Ok(Placement { node: n, plan, score })
    }

    fn simple_plan(&self, n: usize, pod: &PodDemand, choice: SimpleChoice) -> NodePlan {
        let node = &self.cluster.nodes[n];
        let allowed = self.cluster.allowed_models(pod.gpu_models.as_deref());
        let cards = match (choice, pod.containers.first().map(|c| &c.cards)) {
            (SimpleChoice::Share { card, memory_mib }, Some(CardDemand::Share { core_milli, .. })) => {
                vec![CardAssign {
                    card,
                    core_milli: *core_milli,
                    memory_mib,
                    exclusive: false,
                    mig_slot: None,
                }]
            }
            (SimpleChoice::Whole, Some(demand @ CardDemand::Whole { .. })) => {
                // Same rule as the general path (NUMA-aware), which the fit check guarantees.
                let single = PodDemand {
                    containers: pod.containers.clone(),
                    phases: vec![vec![0]],
                    gpu_models: pod.gpu_models.clone(),
                    ..Default::default()
                };
                let _ = demand;
                let mut noop = FirstChooser;
                let plan = plan_node(node, &single, &allowed, &mut noop).expect("checked by evaluate");
                return NodePlan {
                    containers: plan.containers,
                    usage: plan.usage,
                };
            }
            _ => Vec::new(),
        };
        let mut usage = PodUsage::new();
        for a in &cards {
            let u = usage.entry(a.card).or_default();
            u.core_milli += a.core_milli;
            u.memory_mib += a.memory_mib;
        }
        let containers = if pod.containers.is_empty() {
            Vec::new()
        } else {
            vec![ContainerPlacement { container: 0, cards }]
        };
        NodePlan { containers, usage }
    }

    /// Picks the best node for `pod` (ties: the first in scan order) and plans it. Does not
    /// commit.
    pub fn schedule(&mut self, pod: &PodDemand) -> Result<Placement, Unschedulable> {
        let allowed = self.cluster.allowed_models(pod.gpu_models.as_deref());
        // Ties go to the first node in scan order, as in the published simulator (which
        // shuffles the node order per seed). Keeping a stable order also consolidates load.
        let mut best: Option<(f64, usize, Option<SimpleChoice>)> = None;
        let mut reasons = Vec::new();
        self.refresh_terms(pod, 0..self.cluster.nodes.len());
        for n in 0..self.cluster.nodes.len() {
            match self.evaluate(n, pod, &allowed) {
                Err(r) => reasons.push((n, r)),
                Ok((s, choice)) => {
                    if best.as_ref().is_none_or(|(b, _, _)| s > *b) {
                        best = Some((s, n, choice));
                    }
                }
            }
        }
        let Some((score, n, choice)) = best else {
            return Err(Unschedulable {
                reasons: reasons
                    .into_iter()
                    .map(|(n, r)| (self.cluster.nodes[n].name.clone(), r))
                    .collect(),
            });
        };
        let plan = match choice {
            Some(c) => self.simple_plan(n, pod, c),
            None => {
                let (_, gpu_policy) = self.policies(pod);
                self.plan_general(n, pod, &allowed, gpu_policy)
                    .expect("evaluated as fitting")
            }
        };
        Ok(Placement { node: n, plan, score })
    }

    /// Commits a placement.
    pub fn commit(&mut self, pod: &PodDemand, placement: &Placement) {
        fit::commit(&mut self.cluster.nodes[placement.node], pod, &placement.plan.usage);
        self.node_changed(placement.node);
    }

    /// Releases a committed placement.
    pub fn release(&mut self, pod: &PodDemand, placement: &Placement) {
        fit::release(&mut self.cluster.nodes[placement.node], pod, &placement.plan.usage);
        self.node_changed(placement.node);
    }
}

struct FirstChooser;

impl ShareChooser for FirstChooser {
    fn choose(&mut self, _: &NodeState, _: &[(u32, u64)], candidates: &[usize], _: u32, _: &[u64]) -> usize {
        candidates[0]
    }
}

/// Mosaic's node score. GPU tasks: FGD's (fragmentation growth through FGD's sigmoid, ties to
/// the first node in scan order). CPU-only tasks: exact growth, then the node with the fewest
/// idle GPUs, so that CPU on GPU-rich nodes is kept for the GPU tasks that will need it.
///
/// GPU tasks were once scored by the growth in linear 120-milli steps: +0.1 point on the
/// default trace, but -0.2 on the share-heavy one (a share's growth is a few hundred milli at
/// most; steps that wide tie most nodes and the first in order takes the share), while FGD's
/// sigmoid resolves 40 milli near zero (docs/placement.md, "What did not work").
fn mosaic_node_score(before: f64, after: f64, gpu_free_after: u64, wants_cards: bool) -> f64 {
    if wants_cards {
        fgd_score(before, after)
    } else {
        (before - after) - gpu_free_after as f64 * 1e-3
    }
}

/// A node as it would be after a placement.
struct NodeAfter {
    cpu_free: u64,
    cpu_total: u64,
    gpu_free: u64,
    gpu_capacity: u64,
}

/// The node-tier score of a placement; `frag_after` is evaluated only for the policies that
/// use fragmentation.
fn node_score(
    policy: PolicyKind,
    rng: &mut Rng,
    before: f64,
    frag_after: impl FnOnce() -> f64,
    after: &NodeAfter,
    pod: &PodDemand,
) -> f64 {
    match policy {
        PolicyKind::Fgd => fgd_score(before, frag_after()),
        PolicyKind::Mosaic => mosaic_node_score(before, frag_after(), after.gpu_free, pod.wants_cards()),
        _ => {
            let cpu_util = 1.0 - after.cpu_free as f64 / after.cpu_total.max(1) as f64;
            simple_node_score(
                policy,
                rng,
                after.cpu_free,
                after.gpu_free,
                after.gpu_capacity,
                cpu_util,
            )
        }
    }
}

/// Node scores of the policies that need no fragmentation.
fn simple_node_score(
    policy: PolicyKind,
    rng: &mut Rng,
    cpu_free_after: u64,
    gpu_free_after: u64,
    capacity: u64,
    cpu_util_after: f64,
) -> f64 {
    let gpu_util_after = if capacity == 0 {
        0.0
    } else {
        1.0 - gpu_free_after as f64 / capacity as f64
    };
    match policy {
        PolicyKind::Binpack => gpu_util_after + cpu_util_after * 1e-3,
        PolicyKind::Spread => -(gpu_util_after + cpu_util_after * 1e-3),
        PolicyKind::Random => rng.unit(),
        // The published simulator's best-fit: least weighted remaining CPU and GPU after the
        // placement, on its 0..100 integer scale.
        PolicyKind::Bestfit => {
            let left = 0.5 * cpu_free_after as f64 / 128_000.0 + 0.5 * gpu_free_after as f64 / 8_000.0;
            ((1.0 - left) * 100.0).trunc()
        }
        PolicyKind::Fgd | PolicyKind::Mosaic => unreachable!("scored with fragmentation"),
    }
}
