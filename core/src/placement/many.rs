//! Evaluating a pod on many nodes at once: the verdicts nodes remember, the engine's own
//! threads for the nodes that meet a pod shape for the first time, and what is left to
//! remember once the caller's answer is out.

use std::sync::Arc;

use super::evaluate::{Evaluator, FragMemo, Verdict, policies, prefetch};
use super::fit::check_node_resources;
use super::terms::NodeTerms;
use super::threads::{self, threads_for};
use super::{ClusterState, Engine, EngineConfig, PodDemand, PolicyKind, ScoreMemo, memo};

/// Nodes a thread takes at a time when several evaluate: about eight blocks per thread, within
/// these bounds.
const PARALLEL_BLOCK: (usize, usize) = (16, 256);

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
            let verdict = ev.evaluate(n, pod, allowed).map(|(s, _)| s);
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
            // new one takes over a hundred) and placed by the program that runs the engine.
            match threads::helpers() {
                Some(pool) => {
                    threads::handing_out();
                    pool.in_place_scope(|scope| {
                        for _ in 1..threads {
                            scope.spawn(|_| {
                                threads::helper_working();
                                work();
                            });
                        }
                        threads::handed_out(threads - 1);
                        work();
                    })
                }
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
