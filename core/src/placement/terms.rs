//! What a share's evaluation reads of each node, kept compact until the node changes.
//!
//! A share on a node whose cards have owners ([`super::share`]) looks at each card that could
//! take it, and weighs each card by the node's fragmentation with that card changed, which
//! needs, per level of the target workload, the cards with room for it and the free compute of
//! the others. Both are the node's alone: a pod shape new to every node need not read every
//! card's full state again, nor recompute the terms, on each node; only on the nodes that
//! changed since ([`super::Engine::node_changed`] forgets them, as it forgets the node's
//! remembered verdict). The briefs of a node's cards are a few cache lines where its cards'
//! full state is a dozen, and they are laid out node after node, as a filter reads them.

use super::evaluate::prefetch;
use super::{ClusterState, Fragmentation, LevelTerms, NodeState, ShareUser};

/// Cards per node kept at least (nodes with more than every node had at the last reset are
/// evaluated from their full state).
const MIN_STRIDE: usize = 8;

/// What a share's card tier reads of one card that offers compute (healthy, not in MIG mode).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct CardBrief {
    /// Who the card's shares belong to.
    pub(super) share_user: Option<ShareUser>,
    /// Free and total memory, MiB.
    pub(super) memory_free: u32,
    pub(super) memory_mib: u32,
    /// Free compute, milli.
    pub(super) core_free: u16,
    pub(super) model: u16,
    /// Its position on the node.
    pub(super) index: u16,
}

impl CardBrief {
    /// The card's brief, when its figures fit one.
    fn of(index: usize, c: &super::CardState) -> Option<Self> {
        Some(Self {
            share_user: c.share_user,
            memory_free: u32::try_from(c.memory_free()).ok()?,
            memory_mib: u32::try_from(c.memory_mib).ok()?,
            core_free: u16::try_from(c.core_free()).ok()?,
            model: c.model,
            index: u16::try_from(index).ok()?,
        })
    }
}

/// A node's kept terms and card briefs.
#[derive(Debug, Clone, Copy)]
pub(super) struct Kept<'a> {
    /// The node's model (of its first card).
    pub(super) model: u16,
    /// Cards offering compute.
    pub(super) offering: usize,
    /// Their free compute and fragmentation terms.
    pub(super) terms: LevelTerms<'a>,
    /// Their briefs, in position order.
    pub(super) cards: &'a [CardBrief],
}

/// The kept terms and briefs of every node, laid out flat.
#[derive(Debug, Clone, Default)]
pub(super) struct NodeTerms {
    levels: usize,
    /// Card briefs kept per node.
    stride: usize,
    /// Per node: whether what is kept is the node as it is.
    fresh: Vec<bool>,
    /// Per node: model, cards offering compute, their free compute.
    head: Vec<(u16, u32, u64)>,
    /// Per node: the models of its healthy cards, a bit each (`None`: a model past 63).
    healthy_models: Vec<Option<u64>>,
    /// Per node and level: cards with room, free compute of the others.
    per_level: Vec<(u32, u64)>,
    /// Per node, `stride` slots: the briefs of its cards that offer compute.
    cards: Vec<CardBrief>,
}

impl NodeTerms {
    /// Forgets every node; levels of the workload from now on: `levels`.
    pub(super) fn reset(&mut self, levels: usize, cluster: &ClusterState) {
        self.levels = levels;
        self.stride = cluster
            .nodes
            .iter()
            .map(|n| n.cards.len())
            .max()
            .unwrap_or(0)
            .max(MIN_STRIDE);
        self.fresh.clear();
        self.head.clear();
        self.healthy_models.clear();
        self.per_level.clear();
        self.cards.clear();
        self.grow(cluster.nodes.len());
    }

    /// Forgets node `n` (it changed), making room for it when it is new.
    pub(super) fn forget(&mut self, n: usize) {
        self.grow(n + 1);
        self.fresh[n] = false;
    }

    /// Makes room for `nodes` nodes.
    pub(super) fn grow(&mut self, nodes: usize) {
        if self.fresh.len() < nodes {
            self.fresh.resize(nodes, false);
            self.head.resize(nodes, (0, 0, 0));
            self.healthy_models.resize(nodes, None);
            self.per_level.resize(nodes * self.levels, (0, 0));
            self.cards.resize(nodes * self.stride, CardBrief::default());
        }
    }

    /// Keeps what those of `nodes` that changed since are now; `frees` is scratch.
    pub(super) fn refresh(
        &mut self,
        frag: &Fragmentation,
        cluster: &ClusterState,
        nodes: impl Iterator<Item = usize>,
        frees: &mut Vec<u32>,
    ) {
        self.grow(cluster.nodes.len());
        for n in nodes {
            if !self.fresh[n] {
                self.fresh[n] = self.keep(frag, n, &cluster.nodes[n], frees);
            }
        }
    }

    /// Keeps node `n`; false when it does not fit the layout (it is then read in full).
    fn keep(&mut self, frag: &Fragmentation, n: usize, node: &NodeState, frees: &mut Vec<u32>) -> bool {
        if node.cards.len() > self.stride {
            return false;
        }
        let slots = &mut self.cards[n * self.stride..(n + 1) * self.stride];
        let mut offering = 0;
        for (i, c) in node.cards.iter().enumerate().filter(|(_, c)| c.offers_compute()) {
            let Some(brief) = CardBrief::of(i, c) else {
                return false;
            };
            slots[offering] = brief;
            offering += 1;
        }
        frees.clear();
        frees.extend(node.cards.iter().filter(|c| c.offers_compute()).map(|c| c.core_free()));
        let per_level = &mut self.per_level[n * self.levels..(n + 1) * self.levels];
        let idle = frag.level_terms(frees, per_level);
        self.head[n] = (node.model().unwrap_or(0), offering as u32, idle);
        self.healthy_models[n] = node
            .cards
            .iter()
            .filter(|c| c.healthy)
            .try_fold(0u64, |mask, c| Some(mask | 1u64.checked_shl(u32::from(c.model))?));
        true
    }

    /// Asks the CPU to bring node `n`'s terms and briefs into its cache ahead of their use.
    #[inline]
    pub(super) fn prefetch(&self, n: usize) {
        let offering = self.head.get(n).map_or(0, |h| h.1 as usize);
        let levels = self.per_level.get(n * self.levels..(n + 1) * self.levels);
        let cards = self.cards.get(n * self.stride..n * self.stride + offering);
        prefetch(levels.unwrap_or_default());
        prefetch(cards.unwrap_or_default());
    }

    /// Whether node `n` is kept as it is.
    #[inline]
    pub(super) fn is_kept(&self, n: usize) -> bool {
        self.fresh.get(n).copied().unwrap_or(false)
    }

    /// The models of node `n`'s healthy cards, a bit each, when it is kept as it is and they
    /// are all under 64.
    pub(super) fn healthy_models(&self, n: usize) -> Option<u64> {
        self.healthy_models
            .get(n)
            .copied()
            .flatten()
            .filter(|_| self.is_kept(n))
    }

    /// Node `n` as kept, when it has not changed since.
    pub(super) fn get(&self, n: usize) -> Option<Kept<'_>> {
        if !self.is_kept(n) {
            return None;
        }
        let (model, offering, idle) = self.head[n];
        let offering = offering as usize;
        Some(Kept {
            model,
            offering,
            terms: LevelTerms {
                idle,
                per_level: &self.per_level[n * self.levels..(n + 1) * self.levels],
            },
            cards: &self.cards[n * self.stride..n * self.stride + offering],
        })
    }
}
