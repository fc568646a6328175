//! The placement engine: node tier (which node), then card tier (which cards on it).
//!
//! The extender uses it online (filter / prioritize / bind) and the simulator replays traces
//! through exactly the same code. Policies are chosen per cluster and overridable per pod for
//! each tier ([`PolicyKind`]); `fgd` follows the published FGD simulator's scoring, and
//! `mosaic` is Tessera's own policy (see `docs/placement.md`).

mod demand;
mod fit;
mod frag;
mod rng;
mod state;
#[cfg(test)]
mod tests;

use std::fmt;

pub use demand::{CardDemand, ContainerDemand, PodDemand};
pub use fit::{
    CardAssign, CardUsage, ContainerPlacement, NodePlan, PodUsage, ShareChooser, check_node_resources,
    commit as commit_usage, plan_node, release as release_usage,
};
pub use frag::{Fragmentation, NodeShape, TargetWorkload, WorkloadClass, WorkloadLearner, fgd_score};
pub use rng::Rng;
pub use state::{CARD_MILLI, CardState, ClusterState, MigSlot, NodeState, ShareUser};

use crate::enforcement::ShareEnforcement;
use crate::policy::PolicyKind;

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

/// A node's verdict for the last pod shape evaluated on it.
#[derive(Debug, Clone)]
struct ScoreMemo {
    key: u64,
    pod: std::sync::Arc<PodDemand>,
    verdict: Result<f64, String>,
}

/// The placement engine.
#[derive(Debug, Clone)]
pub struct Engine {
    /// The cluster and what is committed on it.
    pub cluster: ClusterState,
    config: EngineConfig,
    rng: Rng,
    frag: Fragmentation,
    workload: TargetWorkload,
    node_frag: Vec<Option<f64>>,
    score_memo: Vec<Option<ScoreMemo>>,
    shape: NodeShape,
    positions: Vec<usize>,
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
        Self {
            cluster,
            config,
            rng: Rng::new(config.seed),
            frag,
            workload: workload.clone(),
            node_frag: vec![None; n],
            score_memo: vec![None; n],
            shape: NodeShape::default(),
            positions: Vec::new(),
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
        self.frag = Fragmentation::new(workload, &self.cluster);
        self.workload = workload.clone();
        self.node_frag.iter_mut().for_each(|f| *f = None);
        self.score_memo.iter_mut().for_each(|f| *f = None);
    }

    /// Tells the engine a node changed outside [`Engine::commit`] / [`Engine::release`].
    pub fn node_changed(&mut self, node: usize) {
        if self.node_frag.len() < self.cluster.nodes.len() {
            self.node_frag.resize(self.cluster.nodes.len(), None);
            self.score_memo.resize(self.cluster.nodes.len(), None);
        }
        self.node_frag[node] = None;
        self.score_memo[node] = None;
    }

    /// Fragmentation of one node now, milli-GPU.
    pub fn node_fragmentation(&mut self, node: usize) -> f64 {
        if self.node_frag.len() < self.cluster.nodes.len() {
            self.node_frag.resize(self.cluster.nodes.len(), None);
        }
        if let Some(f) = self.node_frag[node] {
            return f;
        }
        let f = self.frag.of_node(&self.cluster.nodes[node]);
        self.node_frag[node] = Some(f);
        f
    }

    /// Fragmentation of the whole cluster, milli-GPU.
    pub fn cluster_fragmentation(&mut self) -> f64 {
        (0..self.cluster.nodes.len()).map(|n| self.node_fragmentation(n)).sum()
    }

    fn policies(&self, pod: &PodDemand) -> (PolicyKind, PolicyKind) {
        (
            pod.node_policy.unwrap_or(self.config.node_policy),
            pod.gpu_policy.unwrap_or(self.config.gpu_policy),
        )
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

    fn evaluate(&mut self, n: usize, pod: &PodDemand, allowed: &[bool]) -> Result<(f64, Option<SimpleChoice>), String> {
        let (node_policy, gpu_policy) = self.policies(pod);
        // MPS nodes keep one user per shared card: the general path's card tier knows that rule.
        let mps_share = self.cluster.nodes[n].enforcement == ShareEnforcement::Mps && pod.wants_share();
        if !Self::is_simple(pod) || mps_share {
            let plan = self.plan_general(n, pod, allowed, gpu_policy)?;
            let score = self.score_plan(n, pod, &plan.usage, node_policy);
            return Ok((score, None));
        }
        let node = &self.cluster.nodes[n];
        check_node_resources(node, pod)?;
        pod.enforcement_ok(node.enforcement)?;
        let needs_frag = matches!(node_policy, PolicyKind::Fgd | PolicyKind::Mosaic)
            || matches!(gpu_policy, PolicyKind::Fgd | PolicyKind::Mosaic);
        let before = if needs_frag { self.node_fragmentation(n) } else { 0.0 };
        let node = &self.cluster.nodes[n];
        self.shape.fill(node);
        self.positions.clear();
        let mut p = 0;
        for c in &node.cards {
            self.positions.push(p);
            if c.offers_compute() {
                p += 1;
            }
        }
        let cpu_after = node.cpu_free() - pod.cpu_milli;
        let model_ok = |i: usize| allowed.get(usize::from(node.cards[i].model)).copied().unwrap_or(false);
        let (choice, removed_milli) = match pod.containers.first().map(|c| &c.cards) {
            None => (SimpleChoice::NoCards, 0u64),
            Some(CardDemand::Share { core_milli, memory_mib }) => {
                let core = *core_milli;
                let mut best: Option<(f64, usize, u64)> = None;
                let mut ties = 0u64;
                let mut fallback: Option<(u32, u64)> = None;
                // Cards in the same state score the same (the first is kept on ties), so the
                // fragmentation policies evaluate each state once.
                let dedupe = matches!(gpu_policy, PolicyKind::Fgd | PolicyKind::Mosaic);
                let mut seen: [(u32, u64, u64); 16] = [(0, 0, 0); 16];
                let mut n_seen = 0;
                for (i, c) in node.cards.iter().enumerate() {
                    if !c.offers_compute() || !model_ok(i) {
                        continue;
                    }
                    let mem = memory_mib.unwrap_or(c.memory_mib * u64::from(core) / u64::from(CARD_MILLI));
                    if c.core_free() < core || c.memory_free() < mem {
                        if fallback.is_none_or(|f| (c.core_free(), c.memory_free()) > f) {
                            fallback = Some((c.core_free(), c.memory_free()));
                        }
                        continue;
                    }
                    if dedupe {
                        let state = (c.core_free(), c.memory_free(), mem);
                        if seen[..n_seen].contains(&state) {
                            continue;
                        }
                        if n_seen < seen.len() {
                            seen[n_seen] = state;
                            n_seen += 1;
                        }
                    }
                    let s = match gpu_policy {
                        PolicyKind::Binpack | PolicyKind::Bestfit => {
                            -(f64::from(c.core_free()) * 1e9 + c.memory_free() as f64) / 1e12
                        }
                        PolicyKind::Spread => (f64::from(c.core_free()) * 1e9 + c.memory_free() as f64) / 1e12,
                        PolicyKind::Random => 0.0,
                        PolicyKind::Fgd | PolicyKind::Mosaic => {
                            let pos = self.positions[i];
                            self.shape.frees[pos] -= core;
                            let after = self.frag.eval(self.shape.model, cpu_after, &self.shape.frees);
                            self.shape.frees[pos] += core;
                            if gpu_policy == PolicyKind::Fgd {
                                fgd_score(before, after)
                            } else {
                                mosaic_card_score(&self.frag, before, after, c.core_free(), core)
                            }
                        }
                    };
                    match best {
                        Some((b, _, _)) if s < b => {}
                        Some((b, _, _)) if s == b => {
                            // Random picks uniformly among all; the others keep the first.
                            if gpu_policy == PolicyKind::Random {
                                ties += 1;
                                if self.rng.below(ties + 1) == 0 {
                                    best = Some((s, i, mem));
                                }
                            }
                        }
                        _ => {
                            ties = 0;
                            best = Some((s, i, mem));
                        }
                    }
                }
                match best {
                    Some((_, card, memory_mib)) => (SimpleChoice::Share { card, memory_mib }, u64::from(core)),
                    None => {
                        let needs = format!(
                            "needs {}, {}",
                            fit::pct(core),
                            memory_mib.map_or_else(|| "memory in proportion".to_string(), fit::gib)
                        );
                        return Err(match fallback {
                            Some((cf, mf)) => {
                                format!("best card has {} core, {} free; {needs}", fit::pct(cf), fit::gib(mf))
                            }
                            None if node.cards.is_empty() => "node has no GPU".into(),
                            None => "no usable card of an allowed model".into(),
                        });
                    }
                }
            }
            Some(CardDemand::Whole { cards, min_memory_mib }) => {
                let idle = node
                    .cards
                    .iter()
                    .enumerate()
                    .filter(|(i, c)| {
                        c.offers_compute()
                            && model_ok(*i)
                            && c.is_idle()
                            && min_memory_mib.is_none_or(|m| c.memory_mib >= m)
                    })
                    .count();
                if idle < *cards as usize {
                    return Err(if node.cards.is_empty() {
                        "node has no GPU".into()
                    } else {
                        format!("needs {cards} idle whole GPU(s), {idle} idle")
                    });
                }
                // Which idle cards are taken does not change the node's shape.
                let mut left = *cards;
                for (i, c) in node.cards.iter().enumerate() {
                    if left > 0 && c.offers_compute() && model_ok(i) && c.is_idle() {
                        self.shape.frees[self.positions[i]] = 0;
                        left -= 1;
                    }
                }
                (SimpleChoice::Whole, u64::from(*cards) * u64::from(CARD_MILLI))
            }
            Some(CardDemand::Mig(_)) => unreachable!("MIG pods take the general path"),
        };
        if let SimpleChoice::Share { card, .. } = choice {
            let core = u32::try_from(removed_milli).expect("share is at most one card");
            self.shape.frees[self.positions[card]] -= core;
        }
        let after = NodeAfter {
            cpu_free: cpu_after,
            cpu_total: node.cpu_milli,
            gpu_free: node.gpu_free_milli() - removed_milli,
            gpu_capacity: node.gpu_capacity_milli(),
        };
        let (frag, shape, rng) = (&mut self.frag, &self.shape, &mut self.rng);
        let score = node_score(
            node_policy,
            rng,
            before,
            || frag.eval(shape.model, cpu_after, &shape.frees),
            &after,
            pod,
        );
        Ok((score, Some(choice)))
    }

    fn plan_general(
        &mut self,
        n: usize,
        pod: &PodDemand,
        allowed: &[bool],
        gpu_policy: PolicyKind,
    ) -> Result<NodePlan, String> {
        let node = &self.cluster.nodes[n];
        let mut chooser = PolicyChooser {
            policy: gpu_policy,
            frag: &mut self.frag,
            rng: &mut self.rng,
            cpu_after: node.cpu_free().saturating_sub(pod.cpu_milli),
        };
        plan_node(node, pod, allowed, &mut chooser)
    }

    fn score_plan(&mut self, n: usize, pod: &PodDemand, usage: &PodUsage, node_policy: PolicyKind) -> f64 {
        let before = if matches!(node_policy, PolicyKind::Fgd | PolicyKind::Mosaic) {
            self.node_fragmentation(n)
        } else {
            0.0
        };
        let mut after_node = self.cluster.nodes[n].clone();
        fit::commit(&mut after_node, pod, usage);
        let after = NodeAfter {
            cpu_free: after_node.cpu_free(),
            cpu_total: after_node.cpu_milli,
            gpu_free: after_node.gpu_free_milli(),
            gpu_capacity: after_node.gpu_capacity_milli(),
        };
        let (frag, rng) = (&mut self.frag, &mut self.rng);
        node_score(node_policy, rng, before, || frag.of_node(&after_node), &after, pod)
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

    /// Filters and scores `nodes` for `pod`: per node, its score or why it does not fit.
    ///
    /// Each node remembers its verdict for the last pod shape it was asked about until it
    /// changes (or the workload does): the scheduler asks filter and then prioritize for the
    /// same pod, and consecutive pods of one workload have the same shape.
    pub fn evaluate_nodes(&mut self, pod: &PodDemand, nodes: &[usize]) -> Vec<(usize, Result<f64, String>)> {
        let allowed = self.cluster.allowed_models(pod.gpu_models.as_deref());
        let (node_policy, gpu_policy) = self.policies(pod);
        let deterministic = node_policy != PolicyKind::Random && gpu_policy != PolicyKind::Random;
        let key = {
            use std::hash::BuildHasher as _;
            rustc_hash::FxBuildHasher.hash_one(pod)
        };
        if self.score_memo.len() < self.cluster.nodes.len() {
            self.score_memo.resize(self.cluster.nodes.len(), None);
            self.node_frag.resize(self.cluster.nodes.len(), None);
        }
        let shared = std::sync::Arc::new(pod.clone());
        nodes
            .iter()
            .map(|&n| {
                if deterministic
                    && let Some(m) = &self.score_memo[n]
                    && m.key == key
                    && *m.pod == *pod
                {
                    return (n, m.verdict.clone());
                }
                let verdict = self.evaluate(n, pod, &allowed).map(|(s, _)| s);
                if deterministic {
                    self.score_memo[n] = Some(ScoreMemo {
                        key,
                        pod: shared.clone(),
                        verdict: verdict.clone(),
                    });
                }
                (n, verdict)
            })
            .collect()
    }

    /// Picks the best node for `pod` (ties: the first in scan order) and plans it. Does not
    /// commit.
    pub fn schedule(&mut self, pod: &PodDemand) -> Result<Placement, Unschedulable> {
        let allowed = self.cluster.allowed_models(pod.gpu_models.as_deref());
        // Ties go to the first node in scan order, as in the published simulator (which
        // shuffles the node order per seed). Keeping a stable order also consolidates load.
        let mut best: Option<(f64, usize, Option<SimpleChoice>)> = None;
        let mut reasons = Vec::new();
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

/// Width of Mosaic's fragmentation steps, milli-GPU: placements whose fragmentation growth
/// differs by less than this are equally good, and the first node in scan order wins, which
/// keeps filling the same nodes (consolidation) instead of chasing noise.
const MOSAIC_STEP: f64 = 120.0;

/// Mosaic's node score. GPU tasks: fragmentation growth in [`MOSAIC_STEP`] steps. CPU-only
/// tasks: exact growth, then the node with the fewest idle GPUs, so that CPU on GPU-rich nodes
/// is kept for the GPU tasks that will need it.
fn mosaic_node_score(before: f64, after: f64, gpu_free_after: u64, wants_cards: bool) -> f64 {
    if wants_cards {
        ((before - after) / MOSAIC_STEP).floor()
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
