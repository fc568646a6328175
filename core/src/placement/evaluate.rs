//! Evaluating a pod on one node (the filter verdict and the score) and on many nodes at once,
//! on several threads when many nodes meet a pod shape for the first time.

use std::sync::{Arc, OnceLock};

use super::fit::{NodePlan, PodUsage, check_node_resources, plan_node};
use super::terms::NodeTerms;
use super::{
    CARD_MILLI, CardDemand, ClusterState, Engine, EngineConfig, Fragmentation, NodeAfter, NodeShape, NodeState,
    PodDemand, PolicyChooser, Rng, ScoreMemo, ShareEnforcement, SimpleChoice, Tenant, fgd_score, fit, memo,
    mosaic_card_score, node_score,
};
use crate::policy::PolicyKind;
use crate::topology::{CardSet, Link, worst_link};

/// A node's verdict for a pod: its score, or why the pod does not fit.
pub type Verdict = Result<f64, Arc<str>>;

/// Below this many nodes to evaluate, one thread does it (threads cost more than they save).
const PARALLEL_MIN_NODES: usize = 512;

/// Nodes a thread takes at a time when several evaluate: about eight blocks per thread, within
/// these bounds.
const PARALLEL_BLOCK: (usize, usize) = (16, 256);

/// At most this many threads evaluate one request.
const MAX_THREADS: usize = 8;

/// What an evaluation of many nodes found that the memos are yet to take
/// ([`Engine::settle`]).
#[derive(Debug, Clone)]
pub(super) struct Unsettled {
    /// The pod as the memo keeps it (the pod or its GPU ask), its CPU and memory; `None`
    /// where its verdicts are not remembered (random policies).
    memo: Option<(Arc<PodDemand>, u64, u64)>,
    /// The nodes evaluated, and what each gave.
    nodes: Vec<usize>,
    done: Vec<Option<Evaluated>>,
}

/// What evaluating one node gives: its verdict, the number of class CPU thresholds the node's
/// CPU left meets where the verdict is its cards' for the pod's GPU ask (see [`card_tier`]),
/// and the node's fragmentation now where the evaluation worked it out.
pub(super) type Evaluated = (Verdict, Option<usize>, Option<f64>);

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
    fn take_fresh(&mut self, n: usize) -> Option<f64> {
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
    /// The pool's distinct free compute, the first card that has each, and each one's
    /// fragmentation once the share takes it.
    pub(super) froms: Vec<u32>,
    pub(super) firsts: Vec<usize>,
    pub(super) afters: Vec<f64>,
    pub(super) frees: Vec<u32>,
    /// A node's terms for one-card changes.
    pub(super) base: super::ChangeBase,
    /// Per class, whether it runs on a node of the (model, cards, CPU rank) in `runs_key`.
    pub(super) runs: Vec<bool>,
    pub(super) runs_key: Option<(u16, usize, usize)>,
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
            froms: Vec::new(),
            firsts: Vec::new(),
            afters: Vec::new(),
            frees: Vec::new(),
            base: Default::default(),
            runs: Vec::new(),
            runs_key: None,
        }
    }

    /// A copy for another thread: the same model with an empty memo (deterministic policies
    /// only, so the random source is never drawn from).
    fn fork(&self) -> Self {
        Self {
            frag: self.frag.without_memo(),
            rng: self.rng.clone(),
            shape: NodeShape::default(),
            positions: Vec::new(),
            sums: Default::default(),
            pool: Vec::new(),
            pool_free: Vec::new(),
            froms: Vec::new(),
            firsts: Vec::new(),
            afters: Vec::new(),
            frees: Vec::new(),
            base: Default::default(),
            runs: Vec::new(),
            runs_key: None,
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
    ) -> Result<(f64, Option<SimpleChoice>), String> {
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
                .map(|score| (score, None));
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

/// How many nodes ahead of the one evaluated [`prefetch_node`] asks for.
const PREFETCH_AHEAD: usize = 8;

/// Asks the CPU to bring what evaluating node `n` reads into its cache ahead of its
/// evaluation: its kept briefs and terms where the pod's evaluation reads them (`briefs`) and
/// they are kept, else its cards. A node's cards are a heap block of their own, which the
/// hardware prefetcher cannot guess (a profile put half of an evaluation's own time on their
/// first load); asking for them where only the briefs are read filled the memory bus with
/// loads nothing used (a third of a new share shape's filter in the extender).
#[inline]
fn prefetch_node(cluster: &ClusterState, terms: &NodeTerms, n: usize, briefs: bool) {
    if briefs && terms.is_kept(n) {
        terms.prefetch(n);
    } else {
        prefetch(&cluster.nodes[n].cards);
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

/// The threads that evaluate beside the calling thread: one fewer than the threads a request
/// may use (cores, at most [`MAX_THREADS`]), kept between requests; `None` on one core, or
/// where they could not be started (requests are then evaluated on the calling thread).
///
/// A pool of its own, not rayon's global one: the global pool has a thread per core, and
/// with the calling thread working too, one more thread than cores wants to run. On a
/// 2-core machine, filters back to back on the engine alone, the helper woken for a
/// request started within 60 µs in nine requests out of ten with a pool of one, and more
/// than a millisecond late (after the calling thread had done every node) in one of ten
/// with a pool of two. (Beside the extender's HTTP threads it is still that late in about
/// one request of ten: the calling thread then does every node alone.)
fn helpers() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let helpers = cores.min(MAX_THREADS) - 1;
        if helpers == 0 {
            return None;
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(helpers)
            .thread_name(|i| format!("tessera-eval-{i}"))
            .build()
            .map_err(|e| tracing::warn!("evaluating on one thread: the helper threads did not start: {e}"))
            .ok()
    })
    .as_ref()
}

/// How many threads to evaluate `misses` nodes on (the calling thread and helpers).
fn threads_for(misses: usize) -> usize {
    if misses < PARALLEL_MIN_NODES {
        return 1;
    }
    let threads = helpers().map_or(1, |p| p.current_num_threads() + 1);
    threads.min(misses / (PARALLEL_MIN_NODES / 2)).max(1)
}

impl Engine {
    /// Computes the fragmentation terms of those of `nodes` that changed since, when `pod` is
    /// a share whose card is chosen by fragmentation (the only use of the terms).
    pub(super) fn refresh_terms(&mut self, pod: &PodDemand, nodes: impl Iterator<Item = usize>) {
        if !reads_terms(&self.config, pod) {
            return;
        }
        let s = &mut self.scratch;
        self.terms.refresh(&s.frag, &self.cluster, nodes, &mut s.frees);
    }

    /// Filters and scores `nodes` for `pod`: per node, its score or why it does not fit.
    ///
    /// Each node remembers its verdicts for the last few pod shapes it was asked about until
    /// it changes (or the workload does): the scheduler asks filter and then prioritize for the
    /// same pod, consecutive pods of one workload have the same shape, and a cluster's pods
    /// take turns among a few GPU asks. Nodes without a remembered verdict are evaluated on
    /// several threads when there are many of them and the policies are deterministic; the
    /// verdicts are the same as on one thread. Their verdicts are remembered at
    /// [`Engine::settle`], which the caller may leave until its answer is out.
    pub fn evaluate_nodes(&mut self, pod: &PodDemand, nodes: &[usize]) -> Vec<(usize, Verdict)> {
        let remembered = self.remembered(pod, nodes);
        let misses = remembered.iter().filter(|v| v.is_none()).count();
        self.evaluate_rest(pod, nodes, remembered, threads_for(misses))
    }

    /// The remembered verdict of each of `nodes` for `pod`, where there is one.
    ///
    /// For a pod whose verdict depends on its CPU and memory only through the node's resource
    /// check and the class CPU thresholds the CPU left meets ([`card_tier`]), a node remembers
    /// the verdict of its cards for the pod's GPU ask: a later pod of the same ask and other
    /// CPU and memory (most pods of a mixed cluster) is checked for resources and reuses it.
    fn remembered(&mut self, pod: &PodDemand, nodes: &[usize]) -> Vec<Option<Verdict>> {
        self.grow_memos();
        let (node_policy, gpu_policy) = policies(&self.config, pod);
        if node_policy == PolicyKind::Random || gpu_policy == PolicyKind::Random {
            return vec![None; nodes.len()];
        }
        let tier = card_tier(&self.config, pod);
        let ask = tier.as_ref().unwrap_or(pod);
        let key = memo::key(ask);
        let (cluster, frag) = (&self.cluster, &self.scratch.frag);
        // Nodes evaluated together share one copy of the pod: compare it once.
        let mut same: Option<&Arc<PodDemand>> = None;
        nodes
            .iter()
            .map(|&n| {
                let m = self.score_memo.get(n, key)?;
                if !same.is_some_and(|s| Arc::ptr_eq(s, &m.pod)) {
                    if *m.pod != *ask {
                        return None;
                    }
                    same = Some(&m.pod);
                }
                if (m.cpu_milli, m.memory_bytes) == (pod.cpu_milli, pod.memory_bytes) {
                    return Some(m.verdict.clone());
                }
                let rank = m.cpu_rank?;
                let node = &cluster.nodes[n];
                // The evaluation checks the node's resources first.
                if let Err(e) = check_node_resources(node, pod) {
                    return Some(Err(Arc::from(e)));
                }
                (rank == frag.cpu_rank(node.cpu_free() - pod.cpu_milli)).then(|| m.verdict.clone())
            })
            .collect()
    }

    /// [`Engine::evaluate_nodes`] on at most `threads` threads.
    #[cfg(test)]
    pub(super) fn evaluate_nodes_on(
        &mut self,
        pod: &PodDemand,
        nodes: &[usize],
        threads: usize,
    ) -> Vec<(usize, Verdict)> {
        let remembered = self.remembered(pod, nodes);
        self.evaluate_rest(pod, nodes, remembered, threads)
    }

    /// Evaluates the nodes without a remembered verdict on at most `threads` threads, and
    /// remembers their verdicts.
    fn evaluate_rest(
        &mut self,
        pod: &PodDemand,
        nodes: &[usize],
        mut out: Vec<Option<Verdict>>,
        threads: usize,
    ) -> Vec<(usize, Verdict)> {
        let allowed = self.cluster.allowed_models(pod.gpu_models.as_deref());
        let (node_policy, gpu_policy) = policies(&self.config, pod);
        let deterministic = node_policy != PolicyKind::Random && gpu_policy != PolicyKind::Random;
        let misses: Vec<usize> = (0..nodes.len()).filter(|&i| out[i].is_none()).collect();
        self.refresh_terms(pod, misses.iter().map(|&i| nodes[i]));
        let briefs = reads_terms(&self.config, pod);
        let tier = card_tier(&self.config, pod);
        let threads = if deterministic {
            threads.clamp(1, misses.len().max(1))
        } else {
            1
        };
        // The last evaluation's buffer, settled: a new one of this size is fresh pages each time.
        let mut done = std::mem::take(&mut self.spare);
        done.resize_with(misses.len(), || None);
        let (cluster, allowed, misses) = (&self.cluster, &allowed, &misses);
        // The `k`th miss's evaluation, with what the memo keeps of it, worked out while the
        // node is in the cache.
        let by_cards = tier.is_some();
        let step = |ev: &mut Evaluator<'_>, k: usize| -> Evaluated {
            let n = nodes[misses[k]];
            let verdict = ev.evaluate(n, pod, allowed).map(|(s, _)| s).map_err(Arc::from);
            let node = &cluster.nodes[n];
            // A failed resource check is this pod's alone; otherwise the verdict is what the
            // cards said.
            let rank = (by_cards && check_node_resources(node, pod).is_ok())
                .then(|| ev.s.frag.cpu_rank(node.cpu_free() - pod.cpu_milli));
            (verdict, rank, ev.node_frag.take_fresh(n))
        };
        if threads == 1 {
            let mut ev = Evaluator {
                cluster,
                config: self.config,
                s: &mut self.scratch,
                node_frag: FragMemo::Own(&mut self.node_frag),
                terms: &self.terms,
            };
            for (k, slot) in done.iter_mut().enumerate() {
                if let Some(&ahead) = misses.get(k + PREFETCH_AHEAD) {
                    prefetch_node(cluster, ev.terms, nodes[ahead], briefs);
                }
                *slot = Some(step(&mut ev, k));
            }
        } else {
            let (config, scratch, node_frag, terms) = (self.config, &self.scratch, &self.node_frag, &self.terms);
            // Threads take the next block of nodes as they come free, so one that starts late
            // leaves its blocks to those already running; each fills the verdicts of its
            // blocks, on its copy of the scratch. Which thread evaluates a node does not change
            // its verdict.
            let block = (misses.len() / (threads * 8)).clamp(PARALLEL_BLOCK.0, PARALLEL_BLOCK.1);
            let blocks = std::sync::Mutex::new(done.chunks_mut(block).enumerate());
            let work = || {
                let mut s = scratch.fork();
                let mut ev = Evaluator {
                    cluster,
                    config,
                    s: &mut s,
                    node_frag: FragMemo::Shared {
                        kept: node_frag,
                        fresh: None,
                    },
                    terms,
                };
                loop {
                    let next = blocks.lock().unwrap_or_else(|p| p.into_inner()).next();
                    let Some((b, slots)) = next else {
                        break;
                    };
                    let from = b * block;
                    let to = from + slots.len();
                    for (k, slot) in (from..to).zip(slots) {
                        if k + PREFETCH_AHEAD < to {
                            prefetch_node(cluster, terms, nodes[misses[k + PREFETCH_AHEAD]], briefs);
                        }
                        *slot = Some(step(&mut ev, k));
                    }
                }
            };
            // The calling thread works too rather than wait; the others are the helpers, kept
            // between requests (a parked thread wakes in tens of microseconds here, where a
            // new one takes over a hundred).
            match helpers() {
                Some(pool) => pool.in_place_scope(|scope| {
                    for _ in 1..threads {
                        scope.spawn(|_| work());
                    }
                    work();
                }),
                None => work(),
            }
        }
        for (&i, done) in misses.iter().zip(&done) {
            out[i] = done.as_ref().map(|d| d.0.clone());
        }
        if !misses.is_empty() {
            self.unsettled = Some(Unsettled {
                memo: deterministic.then(|| {
                    (
                        Arc::new(tier.unwrap_or_else(|| pod.clone())),
                        pod.cpu_milli,
                        pod.memory_bytes,
                    )
                }),
                nodes: misses.iter().map(|&i| nodes[i]).collect(),
                done,
            });
        }
        nodes
            .iter()
            .zip(out)
            .map(|(&n, v)| (n, v.expect("every node has a verdict")))
            .collect()
    }

    /// Writes what the last evaluation of many nodes found into the memos, where it has not
    /// yet: the nodes' fragmentation worked out on other threads, and the verdicts when the
    /// policies are deterministic (for the pod's GPU ask where the verdict is the cards').
    ///
    /// [`Engine::evaluate_nodes`] answers before it remembers (a store on every node of a
    /// shape new to them took a sixth of a 5,000-node filter, on the calling thread alone):
    /// a caller that has its answer to give, the extender, gives it and then calls this; any
    /// other use of the engine calls it first, so what is remembered is what it would have
    /// been.
    pub fn settle(&mut self) {
        let Some(u) = self.unsettled.take() else {
            return;
        };
        let key = u.memo.as_ref().map(|(shared, ..)| memo::key(shared));
        let mut done = u.done;
        for (&n, done) in u.nodes.iter().zip(done.drain(..)) {
            let (verdict, cpu_rank, frag) = done.expect("every node without a verdict was evaluated");
            if frag.is_some() {
                self.node_frag[n] = frag;
            }
            if let (Some((shared, cpu_milli, memory_bytes)), Some(key)) = (&u.memo, key) {
                self.score_memo.put(
                    n,
                    key,
                    ScoreMemo {
                        pod: shared.clone(),
                        cpu_milli: *cpu_milli,
                        memory_bytes: *memory_bytes,
                        cpu_rank,
                        verdict,
                    },
                );
            }
        }
        self.spare = done;
    }

    /// Whether an evaluation left something for [`Engine::settle`] to remember.
    pub fn unsettled(&self) -> bool {
        self.unsettled.is_some()
    }
}

/// Whether evaluating `pod` reads the nodes' kept card briefs and fragmentation terms: a share
/// whose card is chosen by fragmentation.
fn reads_terms(config: &EngineConfig, pod: &PodDemand) -> bool {
    let (_, gpu_policy) = policies(config, pod);
    pod.wants_share() && matches!(gpu_policy, PolicyKind::Fgd | PolicyKind::Mosaic)
}

/// The pod's GPU ask (its CPU and memory set to zero) when its verdict on any node is the
/// node's resource check, then a verdict that depends on its CPU only through the number of
/// class CPU thresholds the node's CPU left meets: node policies that weigh fragmentation (the
/// others weigh CPU use), and pods that take the owned-share or the simple path on every node
/// (the general path's refusals do not all come after the resource check).
fn card_tier(config: &EngineConfig, pod: &PodDemand) -> Option<PodDemand> {
    let (node_policy, gpu_policy) = policies(config, pod);
    let weighs_fragmentation = matches!(node_policy, PolicyKind::Fgd | PolicyKind::Mosaic);
    let simple = Engine::is_simple(pod) && (!pod.wants_share() || super::share::owned_form(pod).is_some());
    (weighs_fragmentation && gpu_policy != PolicyKind::Random && simple).then(|| PodDemand {
        cpu_milli: 0,
        memory_bytes: 0,
        ..pod.clone()
    })
}
