//! Candidate node names to engine positions, remembered for the last lists asked about: the
//! scheduler sends the same thousands of names with every pod, and looking each up again costs
//! more than the verdicts the engine remembers.

use std::collections::VecDeque;
use std::sync::Arc;

/// Lists remembered (the filter list and the prioritize list of the pod being scheduled).
const KEEP: usize = 2;

/// Node positions, in the order of a candidate list.
pub type Positions = Arc<[Option<usize>]>;

/// The positions of recent candidate lists, valid while no node comes or goes.
#[derive(Debug, Clone, Default)]
pub struct ResolvedLists {
    /// Each list's names (length-prefixed, so that different lists never read the same) and
    /// their positions; most recent first.
    lists: VecDeque<(Vec<u8>, Positions)>,
}

impl ResolvedLists {
    /// Forgets every list (a node came or went).
    pub fn invalidate(&mut self) {
        self.lists.clear();
    }

    /// The position of each of `names` (`lookup` for a list not seen lately).
    pub fn resolve(&mut self, names: &[&str], lookup: impl Fn(&str) -> Option<usize>) -> Positions {
        let mut key = Vec::with_capacity(names.iter().map(|n| n.len() + 4).sum());
        for n in names {
            key.extend_from_slice(&(n.len() as u32).to_le_bytes());
            key.extend_from_slice(n.as_bytes());
        }
        if let Some(i) = self.lists.iter().position(|(k, _)| *k == key) {
            let hit = self.lists.remove(i).expect("found");
            let positions = hit.1.clone();
            self.lists.push_front(hit);
            return positions;
        }
        let positions: Positions = names.iter().map(|n| lookup(n)).collect();
        self.lists.push_front((key, positions.clone()));
        self.lists.truncate(KEEP);
        positions
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_are_remembered_until_invalidated_and_never_confused() {
        let calls = std::cell::Cell::new(0);
        let lookup = |n: &str| {
            calls.set(calls.get() + 1);
            n.strip_prefix('n').and_then(|i| i.parse().ok())
        };
        let mut r = ResolvedLists::default();
        assert_eq!(&*r.resolve(&["n1", "n2", "x"], lookup), &[Some(1), Some(2), None]);
        assert_eq!(&*r.resolve(&["n1", "n2", "x"], lookup), &[Some(1), Some(2), None]);
        assert_eq!(calls.get(), 3, "the second time is remembered");
        // Same bytes, split differently: a different list.
        assert_eq!(&*r.resolve(&["n1n2", "x"], lookup), &[None, None]);
        assert_eq!(calls.get(), 5);
        r.invalidate();
        r.resolve(&["n1", "n2", "x"], lookup);
        assert_eq!(calls.get(), 8);
        // Only the last two lists are kept.
        r.resolve(&["n3"], lookup);
        r.resolve(&["n4"], lookup);
        r.resolve(&["n1", "n2", "x"], lookup);
        assert_eq!(calls.get(), 13);
    }
}
