//! Each node's verdicts for the last few pod shapes it was asked about, until it changes.
//!
//! A lookup reads one cache line per node (the keys of its slots) and a store writes one slot:
//! a new shape goes over the oldest, a shape asked again over its own slot. A filter of a shape
//! new to every node stores a verdict on each of them, so the layout matters as much as the
//! lookup.

use std::sync::Arc;

use super::PodDemand;
use super::evaluate::Verdict;

/// Pod shapes (or GPU asks) each node remembers its verdict for: a cluster's pods ask for a few
/// dozen things of its GPUs (24 in the public trace's first 3,000 pods) in turns.
pub(super) const MEMO_SHAPES: usize = 4;

/// A node's verdict for a pod shape evaluated on it.
#[derive(Debug, Clone)]
pub(super) struct ScoreMemo {
    /// The pod, or its GPU ask alone (CPU and memory zero) where the verdict may be its cards'.
    pub(super) pod: Arc<PodDemand>,
    /// The CPU and memory of the pod evaluated: the verdict is its own.
    pub(super) cpu_milli: u64,
    pub(super) memory_bytes: u64,
    /// Where the verdict is what the node's cards said for the GPU ask, the number of class CPU
    /// thresholds the node's CPU left met: a pod of other CPU and memory that passes the
    /// resource check and leaves as many gets the same verdict.
    pub(super) cpu_rank: Option<usize>,
    pub(super) verdict: Verdict,
}

/// Every node's remembered verdicts.
#[derive(Debug, Clone, Default)]
pub(super) struct VerdictMemo {
    /// Per node, the key of each slot ([`EMPTY`] where none).
    keys: Vec<[u64; MEMO_SHAPES]>,
    /// Per node, the slot a new shape takes next (the one stored longest ago).
    next: Vec<u8>,
    slots: Vec<[Option<ScoreMemo>; MEMO_SHAPES]>,
}

/// The key of an empty slot ([`key`] never gives it).
const EMPTY: u64 = 0;

/// The memo key of `pod` (a hash of it; the memo compares the pod itself too).
pub(super) fn key(pod: &PodDemand) -> u64 {
    use std::hash::BuildHasher as _;
    rustc_hash::FxBuildHasher.hash_one(pod).max(EMPTY + 1)
}

impl VerdictMemo {
    /// A memo of `nodes` nodes, remembering nothing.
    pub(super) fn new(nodes: usize) -> Self {
        let mut memo = Self::default();
        memo.grow(nodes);
        memo
    }

    /// Makes room for `nodes` nodes.
    pub(super) fn grow(&mut self, nodes: usize) {
        if self.keys.len() < nodes {
            self.keys.resize(nodes, [EMPTY; MEMO_SHAPES]);
            self.next.resize(nodes, 0);
            self.slots.resize(nodes, [const { None }; MEMO_SHAPES]);
        }
    }

    /// Forgets what node `n` remembered (it changed), making room for it when it is new.
    pub(super) fn forget(&mut self, n: usize) {
        self.grow(n + 1);
        self.keys[n] = [EMPTY; MEMO_SHAPES];
        self.next[n] = 0;
        self.slots[n] = [const { None }; MEMO_SHAPES];
    }

    /// Forgets every node.
    pub(super) fn clear(&mut self) {
        for n in 0..self.keys.len() {
            self.forget(n);
        }
    }

    /// Node `n`'s verdict for the shape of memo key `key`, when remembered.
    #[inline]
    pub(super) fn get(&self, n: usize, key: u64) -> Option<&ScoreMemo> {
        let j = self.keys.get(n)?.iter().position(|&k| k == key)?;
        self.slots[n][j].as_ref()
    }

    /// Remembers node `n`'s verdict for the shape of memo key `key`: over the shape's earlier
    /// verdict, else over the oldest.
    pub(super) fn put(&mut self, n: usize, key: u64, memo: ScoreMemo) {
        self.grow(n + 1);
        let j = match self.keys[n].iter().position(|&k| k == key) {
            Some(j) => j,
            None => {
                let j = usize::from(self.next[n]);
                self.next[n] = ((j + 1) % MEMO_SHAPES) as u8;
                self.keys[n][j] = key;
                j
            }
        };
        self.slots[n][j] = Some(memo);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memo(score: f64) -> ScoreMemo {
        ScoreMemo {
            pod: Arc::new(PodDemand::single(0, 0, None)),
            cpu_milli: 0,
            memory_bytes: 0,
            cpu_rank: None,
            verdict: Ok(score),
        }
    }

    fn score(m: &VerdictMemo, n: usize, key: u64) -> Option<f64> {
        m.get(n, key).map(|m| *m.verdict.as_ref().expect("a score"))
    }

    /// A new shape goes over the one first stored longest ago; a shape stored again keeps its
    /// slot and takes the new verdict; nodes and forgetting are each node's own.
    #[test]
    fn a_node_keeps_its_last_shapes_and_forgets_them_when_it_changes() {
        let mut m = VerdictMemo::new(2);
        for k in 1..=MEMO_SHAPES as u64 {
            m.put(0, k, memo(k as f64));
        }
        m.put(0, 2, memo(20.0));
        m.put(0, 9, memo(9.0));
        assert_eq!(score(&m, 0, 1), None, "the oldest went");
        assert_eq!(score(&m, 0, 2), Some(20.0));
        assert_eq!(score(&m, 0, 9), Some(9.0));
        for k in 3..=MEMO_SHAPES as u64 {
            assert_eq!(score(&m, 0, k), Some(k as f64));
        }
        // Shape 2 kept its slot, the next oldest: it goes next, and no slot holds it twice.
        m.put(0, 10, memo(10.0));
        assert_eq!(score(&m, 0, 2), None);
        assert_eq!(score(&m, 0, 3), Some(3.0));
        assert_eq!(score(&m, 1, 2), None, "another node's");
        m.put(1, 2, memo(7.0));
        m.forget(0);
        assert_eq!(score(&m, 0, 2), None);
        assert_eq!(score(&m, 1, 2), Some(7.0));
        m.put(5, 3, memo(3.0));
        assert_eq!(score(&m, 5, 3), Some(3.0), "a new node makes room");
        m.clear();
        assert_eq!(score(&m, 1, 2), None);
        assert_eq!(key(&PodDemand::single(0, 0, None)), key(&PodDemand::single(0, 0, None)));
        assert_ne!(key(&PodDemand::single(0, 0, None)), EMPTY);
    }
}
