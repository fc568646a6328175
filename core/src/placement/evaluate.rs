//! Evaluating a pod on one node: the filter verdict and the score.

use std::sync::Arc;

use super::fit::{NodePlan, PodUsage, check_node_resources, plan_node};
use super::frag::{ChangeTable, Runs};
use super::refusal::Refusals;
use super::terms::NodeTerms;
use super::{
    CARD_MILLI, CardDemand, ClusterState, Engine, EngineConfig, Fragmentation, NodeAfter, NodeShape, NodeState,
    PodDemand, PolicyChooser, Rng, ShareEnforcement, SimpleChoice, Tenant, fgd_score, fit, mosaic_card_score,
    node_score,
};
use crate::policy::PolicyKind;
use crate::topology::{CardSet, Link, worst_link};

/// A node's verdict for a pod: its score, or why the pod does not fit.
pub type Verdict = Result<f64, Arc<str>>;

/// The nodes' remembered fragmentation as an evaluation reads and writes it.
pub(super) enum FragMemo<'a> {
    /// The engine's own memo (one thread).
    Own(&'a mut [Option<f64>]),
    /// The engine's memo, read by one of several threads, and the last node this thread
    /// worked out (taken after each node and written back once all are done).
    Shared {
        kept: &'a [Option<f64>],
        fresh: Option<(usize, f64)>,
    },
}

impl FragMemo<'_> {
    pub(super) fn get(&self, n: usize) -> Option<f64> {
        match self {
            Self::Own(memo) => memo[n],
            Self::Shared { kept, fresh } => fresh.filter(|f| f.0 == n).map(|f| f.1).or(kept[n]),
        }
    }

    fn set(&mut self, n: usize, f: f64) {
        match self {
            Self::Own(memo) => memo[n] = Some(f),
            Self::Shared { fresh, .. } => *fresh = Some((n, f)),
        }
    }

    /// Node `n`'s fragmentation, where it was worked out since the last call.
    pub(super) fn take_fresh(&mut self, n: usize) -> Option<f64> {
        match self {
            Self::Own(_) => None,
            Self::Shared { fresh, .. } => fresh.take().filter(|f| f.0 == n).map(|f| f.1),
        }
    }
}

/// What evaluating a node writes besides its verdict: the fragmentation model (with its memo),
/// the random source, and scratch space.
#[derive(Debug, Clone)]
pub(super) struct Scratch {
    pub(super) frag: Fragmentation,
    pub(super) rng: Rng,
    shape: NodeShape,
    positions: Vec<usize>,
    sums: super::ClassSums,
    /// Cards a share may take (positions) and their free compute and memory; free compute
    /// per card that offers it.
    pub(super) pool: Vec<usize>,
    pub(super) pool_free: Vec<(u32, u64)>,
    pub(super) frees: Vec<u32>,
    /// A node's terms for one-card changes.
    pub(super) base: super::ChangeBase,
    /// The classes that run on a node of the (model, cards, CPU rank) in `runs_key`.
    pub(super) runs: Runs,
    pub(super) runs_key: Option<(u16, usize, usize)>,
    /// A node's one-card changes.
    pub(super) table: ChangeTable,
    /// The refusals' texts, one per reason.
    pub(super) refusals: Refusals,
}

impl Scratch {
    pub(super) fn new(frag: Fragmentation, seed: u64) -> Self {
        Self {
            frag,
            rng: Rng::new(seed),
            shape: NodeShape::default(),
            positions: Vec::new(),
            sums: Default::default(),
            pool: Vec::new(),
            pool_free: Vec::new(),
            frees: Vec::new(),
            base: Default::default(),
            runs: Runs::default(),
            runs_key: None,
            table: ChangeTable::default(),
            refusals: Refusals::default(),
        }
    }

    /// A copy for another thread: the same model with an empty memo (deterministic policies
    /// only, so the random source is never drawn from).
    pub(super) fn fork(&self) -> Self {
        Self {
            frag: self.frag.without_memo(),
            rng: self.rng.clone(),
            shape: NodeShape::default(),
            positions: Vec::new(),
            sums: Default::default(),
            pool: Vec::new(),
            pool_free: Vec::new(),
            frees: Vec::new(),
            base: Default::default(),
            runs: Runs::default(),
            runs_key: None,
            table: ChangeTable::default(),
            refusals: Refusals::default(),
        }
    }
}

/// The (node, card) policies that apply to `pod`.
pub(super) fn policies(config: &EngineConfig, pod: &PodDemand) -> (PolicyKind, PolicyKind) {
    (
        pod.node_policy.unwrap_or(config.node_policy),
        pod.gpu_policy.unwrap_or(config.gpu_policy),
    )
}

/// Evaluates pods on the nodes of one cluster state.
pub(super) struct Evaluator<'a> {
    pub(super) cluster: &'a ClusterState,
    pub(super) config: EngineConfig,
    pub(super) s: &'a mut Scratch,
    /// Each node's fragmentation now, memoised.
    pub(super) node_frag: FragMemo<'a>,
    /// Each node's fragmentation terms, where fresh.
    pub(super) terms: &'a NodeTerms,
}

impl Evaluator<'_> {
    fn policies(&self, pod: &PodDemand) -> (PolicyKind, PolicyKind) {
        policies(&self.config, pod)
    }

    /// Fragmentation of node `n` now, milli-GPU.
    pub(super) fn node_fragmentation(&mut self, n: usize) -> f64 {
        if let Some(f) = self.node_frag.get(n) {
            return f;
        }
        let f = self.s.frag.of_node(&self.cluster.nodes[n]);
        self.node_frag.set(n, f);
        f
    }

    /// The card a share goes to on `node` under `gpu_policy` (`before`: the node's
    /// fragmentation now; `cpu_after`: its free CPU once the pod is placed), with the card's
    /// fragmentation after when the policy computed it; or why no card fits.
    fn best_share_card(
        &mut self,
        node: &NodeState,
        (core, memory_mib): (u32, Option<u64>),
        (gpu_policy, before, cpu_after): (PolicyKind, f64, u64),
        allowed: &[bool],
    ) -> Result<(SimpleChoice, Option<f64>), String> {
        let model_ok = |i: usize| allowed.get(usize::from(node.cards[i].model)).copied().unwrap_or(false);
        let mut best: Option<(f64, usize, u64, f64)> = None;
        let mut ties = 0u64;
        let mut fallback: Option<(u32, u64)> = None;
        // Cards in the same state score the same (the first is kept on ties), so the
        // fragmentation policies evaluate each state once.
        let dedupe = matches!(gpu_policy, PolicyKind::Fgd | PolicyKind::Mosaic);
        // Each card tried changes one card: its fragmentation after is an O(classes)
        // update of the node's by-class sums.
        if dedupe {
            self.s
                .frag
                .sums(&mut self.s.sums, self.s.shape.model, cpu_after, &self.s.shape.frees);
        }
        let mut seen: [(u32, u64, u64); 16] = [(0, 0, 0); 16];
        let mut n_seen = 0;
        for (i, c) in node.cards.iter().enumerate() {
            if !c.offers_compute() || !model_ok(i) {
                continue;
            }
            let mem = fit::share_memory(memory_mib, c.memory_mib, core);
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
            let mut after = f64::NAN;
            let s = match gpu_policy {
                PolicyKind::Binpack | PolicyKind::Bestfit => {
                    -(f64::from(c.core_free()) * 1e9 + c.memory_free() as f64) / 1e12
                }
                PolicyKind::Spread => (f64::from(c.core_free()) * 1e9 + c.memory_free() as f64) / 1e12,
                PolicyKind::Random => 0.0,
                PolicyKind::Fgd | PolicyKind::Mosaic => {
                    after = self
                        .s
                        .frag
                        .after_change(&self.s.sums, c.core_free(), c.core_free() - core);
                    if gpu_policy == PolicyKind::Fgd {
                        fgd_score(before, after)
                    } else {
                        mosaic_card_score(&self.s.frag, before, after, c.core_free(), core)
                    }
                }
            };
            match best {
                Some((b, ..)) if s < b => {}
                Some((b, ..)) if s == b => {
                    // Random picks uniformly among all; the others keep the first.
                    if gpu_policy == PolicyKind::Random {
                        ties += 1;
                        if self.s.rng.below(ties + 1) == 0 {
                            best = Some((s, i, mem, after));
                        }
                    }
                }
                _ => {
                    ties = 0;
                    best = Some((s, i, mem, after));
                }
            }
        }
        match best {
            Some((_, card, memory_mib, after)) => Ok((
                SimpleChoice::Share { card, memory_mib },
                Some(after).filter(|a| !a.is_nan()),
            )),
            None => {
                let needs = format!(
                    "needs {}, {}",
                    fit::pct(core),
                    memory_mib.map_or_else(|| "memory in proportion".to_string(), fit::gib)
                );
                Err(match fallback {
                    Some((cf, mf)) => {
                        format!("best card has {} core, {} free; {needs}", fit::pct(cf), fit::gib(mf))
                    }
                    None if node.cards.is_empty() => "node has no GPU".into(),
                    None => "no usable card of an allowed model".into(),
                })
            }
        }
    }

    /// Scores `pod` on node `n` (higher is better), or says why it does not fit.
    pub(super) fn evaluate(
        &mut self,
        n: usize,
        pod: &PodDemand,
        allowed: &[bool],
    ) -> Result<(f64, Option<SimpleChoice>), Arc<str>> {
        let cluster = self.cluster;
        let (node_policy, gpu_policy) = self.policies(pod);
        // MPS nodes keep one user per shared card, and a card's shares belong to one tenant
        // unless the node opts in: the general path's card tier knows those rules, and
        // `owned_share` takes its steps for one share without building a plan. (Pods that name
        // no tenant, the simulator's, are all one tenant.)
        let node = &cluster.nodes[n];
        let owned_share = pod.wants_share()
            && (node.enforcement == ShareEnforcement::Mps || (!node.cross_tenant && pod.tenant != Tenant::UNNAMED));
        if owned_share && let Some(verdict) = self.owned_share(n, pod, allowed, (node_policy, gpu_policy)) {
            return verdict.map(|score| (score, None));
        }
        if !Engine::is_simple(pod) || owned_share {
            return self
                .general(n, pod, allowed, (node_policy, gpu_policy))
                .map(|score| (score, None))
                .map_err(Arc::from);
        }
        let node = &cluster.nodes[n];
        check_node_resources(node, pod)?;
        pod.enforcement_ok(node.enforcement)?;
        let needs_frag = matches!(node_policy, PolicyKind::Fgd | PolicyKind::Mosaic)
            || matches!(gpu_policy, PolicyKind::Fgd | PolicyKind::Mosaic);
        let before = if needs_frag { self.node_fragmentation(n) } else { 0.0 };
        let node = &cluster.nodes[n];
        self.s.shape.fill(node);
        self.s.positions.clear();
        let mut p = 0;
        for c in &node.cards {
            self.s.positions.push(p);
            if c.offers_compute() {
                p += 1;
            }
        }
        let cpu_after = node.cpu_free() - pod.cpu_milli;
        let mut bonus = 0.0;
        // The chosen card's fragmentation after, when the card tier computed it.
        let mut chosen_after: Option<f64> = None;
        let model_ok = |i: usize| allowed.get(usize::from(node.cards[i].model)).copied().unwrap_or(false);
        let (choice, removed_milli) = match pod.containers.first().map(|c| &c.cards) {
            None => (SimpleChoice::NoCards, 0u64),
            Some(CardDemand::Share { core_milli, memory_mib }) => {
                let ask = (*core_milli, *memory_mib);
                let (choice, after) = self.best_share_card(node, ask, (gpu_policy, before, cpu_after), allowed)?;
                chosen_after = after;
                (choice, u64::from(*core_milli))
            }
            Some(CardDemand::Whole { cards, min_memory_mib }) => {
                let idle: Vec<usize> = node
                    .cards
                    .iter()
                    .enumerate()
                    .filter(|(i, c)| {
                        c.offers_compute()
                            && model_ok(*i)
                            && c.is_idle()
                            && min_memory_mib.is_none_or(|m| c.memory_mib >= m)
                    })
                    .map(|(i, _)| i)
                    .collect();
                if node.cards.is_empty() {
                    return Err("node has no GPU".into());
                }
                // The set the card tier will take (same rule, `fit::place_container`).
                let set = node.choose_cards(&idle, *cards as usize, pod.gpu_link)?;
                bonus = link_bonus(&set);
                for &i in &set.cards {
                    self.s.shape.frees[self.s.positions[i]] = 0;
                }
                (SimpleChoice::Whole, u64::from(*cards) * u64::from(CARD_MILLI))
            }
            Some(CardDemand::Mig(_)) => unreachable!("MIG pods take the general path"),
        };
        if let SimpleChoice::Share { card, .. } = choice {
            let core = u32::try_from(removed_milli).expect("share is at most one card");
            self.s.shape.frees[self.s.positions[card]] -= core;
        }
        let after = NodeAfter {
            cpu_free: cpu_after,
            cpu_total: node.cpu_milli,
            gpu_free: node.gpu_free_milli() - removed_milli,
            gpu_capacity: node.gpu_capacity_milli(),
        };
        let (frag, shape, rng) = (&mut self.s.frag, &self.s.shape, &mut self.s.rng);
        let score = node_score(
            node_policy,
            rng,
            before,
            || chosen_after.unwrap_or_else(|| frag.eval(shape.model, cpu_after, &shape.frees)),
            &after,
            pod,
        );
        Ok((score + bonus, Some(choice)))
    }

    /// The general path's verdict: plans the pod on node `n` (every container and phase), then
    /// scores the plan.
    pub(super) fn general(
        &mut self,
        n: usize,
        pod: &PodDemand,
        allowed: &[bool],
        (node_policy, gpu_policy): (PolicyKind, PolicyKind),
    ) -> Result<f64, String> {
        let cluster = self.cluster;
        let plan = self.plan_general(n, pod, allowed, gpu_policy)?;
        let score = self.score_plan(n, pod, &plan.usage, node_policy);
        let node = &cluster.nodes[n];
        let bonus: f64 = plan
            .containers
            .iter()
            .filter(|c| c.cards.iter().all(|a| a.exclusive && a.mig_slot.is_none()))
            .map(|c| {
                let cards: Vec<usize> = c.cards.iter().map(|a| a.card).collect();
                link_bonus(&CardSet {
                    worst: worst_link(|a, b| node.link(a, b), &cards),
                    cards,
                })
            })
            .sum();
        Ok(score + bonus)
    }

    pub(super) fn plan_general(
        &mut self,
        n: usize,
        pod: &PodDemand,
        allowed: &[bool],
        gpu_policy: PolicyKind,
    ) -> Result<NodePlan, String> {
        let cluster = self.cluster;
        let node = &cluster.nodes[n];
        let mut chooser = PolicyChooser {
            policy: gpu_policy,
            frag: &mut self.s.frag,
            rng: &mut self.s.rng,
            cpu_after: node.cpu_free().saturating_sub(pod.cpu_milli),
        };
        plan_node(node, pod, allowed, &mut chooser)
    }

    fn score_plan(&mut self, n: usize, pod: &PodDemand, usage: &PodUsage, node_policy: PolicyKind) -> f64 {
        let cluster = self.cluster;
        let before = if matches!(node_policy, PolicyKind::Fgd | PolicyKind::Mosaic) {
            self.node_fragmentation(n)
        } else {
            0.0
        };
        let mut after_node = cluster.nodes[n].clone();
        fit::commit(&mut after_node, pod, usage);
        let after = NodeAfter {
            cpu_free: after_node.cpu_free(),
            cpu_total: after_node.cpu_milli,
            gpu_free: after_node.gpu_free_milli(),
            gpu_capacity: after_node.gpu_capacity_milli(),
        };
        let (frag, rng) = (&mut self.s.frag, &mut self.s.rng);
        node_score(node_policy, rng, before, || frag.of_node(&after_node), &after, pod)
    }
}

/// Scale of the topology tie-break: small enough never to outweigh a policy's own difference
/// between two nodes, so topology only orders nodes the policy finds equal.
const LINK_BONUS: f64 = 1e-9;

/// The node-tier preference for a multi-card set: the better its worst link, the higher
/// (nothing for single cards or unknown links, so nodes that publish no topology are not
/// ranked by it).
fn link_bonus(set: &CardSet) -> f64 {
    match set.worst {
        Some(w) if set.cards.len() >= 2 => f64::from(Link::WORST_COST - w.cost()) * LINK_BONUS,
        _ => 0.0,
    }
}

/// Asks the CPU to bring `items` into its cache (a hint; nothing where there is no such
/// instruction).
#[inline]
pub(crate) fn prefetch<T>(items: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let start = items.as_ptr().cast::<i8>();
        for offset in (0..std::mem::size_of_val(items)).step_by(64) {
            // SAFETY: a prefetch is a hint that never faults; the address is in `items`.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(start.wrapping_add(offset)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = items;
}
