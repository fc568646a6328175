//! Candidate node names to engine positions, remembered for the last lists asked about: the
//! scheduler sends the same thousands of names with every pod, and looking each up again costs
//! more than the verdicts the engine remembers. A list not seen lately is looked up in an index
//! laid out for thousands of lookups in a row.

use std::collections::VecDeque;
use std::hash::BuildHasher as _;
use std::sync::Arc;

use rustc_hash::{FxBuildHasher, FxHashMap};

/// Lists remembered (the filter list and the prioritize list of the pod being scheduled).
const KEEP: usize = 2;

/// Node positions, in the order of a candidate list.
pub type Positions = Arc<[Option<usize>]>;

/// Names in one buffer, each after its length (so that two different lists never read the
/// same): a candidate list kept without a `String` per name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NameList(Vec<u8>);

impl NameList {
    /// The list of `names`, in order.
    pub fn new<'a>(names: impl IntoIterator<Item = &'a str>) -> Self {
        let mut buf = Vec::new();
        for n in names {
            buf.extend_from_slice(&(n.len() as u32).to_le_bytes());
            buf.extend_from_slice(n.as_bytes());
        }
        Self(buf)
    }

    /// The names, in order.
    pub fn iter(&self) -> impl Iterator<Item = &str> {
        let mut buf = self.0.as_slice();
        std::iter::from_fn(move || {
            let (len, rest) = buf.split_first_chunk::<4>()?;
            let (name, rest) = rest.split_at(u32::from_le_bytes(*len) as usize);
            buf = rest;
            Some(std::str::from_utf8(name).expect("written from a str"))
        })
    }

    /// Whether the list is exactly `names`, in order (compared as bytes: the names need not be
    /// read back as text).
    pub fn is(&self, names: &[&str]) -> bool {
        let mut buf = self.0.as_slice();
        for n in names {
            let Some((len, rest)) = buf.split_first_chunk::<4>() else {
                return false;
            };
            let Some((name, rest)) = rest.split_at_checked(u32::from_le_bytes(*len) as usize) else {
                return false;
            };
            if name != n.as_bytes() {
                return false;
            }
            buf = rest;
        }
        buf.is_empty()
    }
}

/// The positions of recent candidate lists, valid while no node comes or goes.
#[derive(Debug, Clone, Default)]
pub struct ResolvedLists {
    /// Each list's names and their positions; most recent first.
    lists: VecDeque<(NameList, Positions)>,
    /// The live names, laid out for lookups; `None` until a list needs it after a change.
    index: Option<NameIndex>,
}

impl ResolvedLists {
    /// Forgets every list (a node came or went).
    pub fn invalidate(&mut self) {
        self.lists.clear();
        self.index = None;
    }

    /// The position of each of `names` among the `live` ones (`None`: not live).
    pub fn resolve(&mut self, names: &[&str], live: &FxHashMap<String, usize>) -> Positions {
        if let Some(i) = self.lists.iter().position(|(k, _)| k.is(names)) {
            let hit = self.lists.remove(i).expect("found");
            let positions = hit.1.clone();
            self.lists.push_front(hit);
            return positions;
        }
        let positions = self.index.get_or_insert_with(|| NameIndex::new(live)).positions(names);
        self.lists
            .push_front((NameList::new(names.iter().copied()), positions.clone()));
        self.lists.truncate(KEEP);
        positions
    }
}

/// Live node names and their positions in two flat buffers: an open-addressing table of
/// (name, hash tag) words and the names' bytes side by side, in position order. A lookup reads
/// a table word or two and the name it points at. The ledger's map keeps a `String` per
/// name somewhere on the heap: in the extender a list of 5,000 names not seen before took
/// 0.5 to 1.3 ms to look up there, a cache miss or two per name.
#[derive(Debug, Clone)]
struct NameIndex {
    /// `EMPTY`, or the name's place in `names` (high half) and its hash's low half.
    table: Vec<u64>,
    /// `64 - log2(table.len())`: a hash's high bits choose its first slot.
    shift: u32,
    /// Per name: its position, and where its bytes are in `bytes`.
    names: Vec<(usize, u32, u32)>,
    bytes: Vec<u8>,
}

/// A free slot (no name has `u32::MAX` names before it).
const EMPTY: u64 = u64::MAX;

/// Names whose table slot a lookup asks the CPU for ahead of its own.
const AHEAD: usize = 8;

fn hash(name: &str) -> u64 {
    FxBuildHasher.hash_one(name)
}

impl NameIndex {
    fn new(live: &FxHashMap<String, usize>) -> Self {
        let mut by_position: Vec<(&str, usize)> = live.iter().map(|(n, &p)| (n.as_str(), p)).collect();
        by_position.sort_unstable_by_key(|&(_, p)| p);
        let slots = (by_position.len() * 2).next_power_of_two().max(16);
        let mut index = Self {
            table: vec![EMPTY; slots],
            shift: 64 - slots.trailing_zeros(),
            names: Vec::with_capacity(by_position.len()),
            bytes: Vec::with_capacity(by_position.iter().map(|(n, _)| n.len()).sum()),
        };
        for (name, position) in by_position {
            let h = hash(name);
            let mut slot = index.first_slot(h);
            while index.table[slot] != EMPTY {
                slot = (slot + 1) & (slots - 1);
            }
            index.table[slot] = ((index.names.len() as u64) << 32) | (h & 0xFFFF_FFFF);
            index
                .names
                .push((position, index.bytes.len() as u32, name.len() as u32));
            index.bytes.extend_from_slice(name.as_bytes());
        }
        index
    }

    fn first_slot(&self, h: u64) -> usize {
        (h >> self.shift) as usize
    }

    /// The position of `name` (of hash `h`), if live.
    fn get(&self, name: &str, h: u64) -> Option<usize> {
        let mask = self.table.len() - 1;
        let mut slot = self.first_slot(h);
        loop {
            let word = self.table[slot];
            if word == EMPTY {
                return None;
            }
            if word & 0xFFFF_FFFF == h & 0xFFFF_FFFF {
                let (position, start, len) = self.names[(word >> 32) as usize];
                if &self.bytes[start as usize..(start + len) as usize] == name.as_bytes() {
                    return Some(position);
                }
            }
            slot = (slot + 1) & mask;
        }
    }

    /// The position of each of `names`, each name's first slot asked for a few names ahead.
    fn positions(&self, names: &[&str]) -> Positions {
        let hashes: Vec<u64> = names.iter().map(|n| hash(n)).collect();
        names
            .iter()
            .zip(&hashes)
            .enumerate()
            .map(|(k, (name, &h))| {
                if let Some(&ahead) = hashes.get(k + AHEAD) {
                    crate::placement::prefetch(std::slice::from_ref(&self.table[self.first_slot(ahead)]));
                }
                self.get(name, h)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(names: &[(&str, usize)]) -> FxHashMap<String, usize> {
        names.iter().map(|&(n, p)| (n.to_string(), p)).collect()
    }

    #[test]
    fn lists_are_remembered_until_invalidated_and_never_confused() {
        let mut map = live(&[("n1", 1), ("n2", 2)]);
        let mut r = ResolvedLists::default();
        assert_eq!(&*r.resolve(&["n1", "n2", "x"], &map), &[Some(1), Some(2), None]);
        // Until told, the lists and the index stand for the names as they were.
        map.insert("x".into(), 7);
        map.insert("n3".into(), 3);
        assert_eq!(&*r.resolve(&["n1", "n2", "x"], &map), &[Some(1), Some(2), None]);
        assert_eq!(&*r.resolve(&["n3"], &map), &[None]);
        // Same bytes, split differently: a different list.
        assert_eq!(&*r.resolve(&["n1n2", "x"], &map), &[None, None]);
        r.invalidate();
        assert_eq!(&*r.resolve(&["n1", "n2", "x"], &map), &[Some(1), Some(2), Some(7)]);
        // Only the last two lists are kept: the first is looked up again, in a new index.
        r.resolve(&["n3"], &map);
        r.resolve(&["n2"], &map);
        map.insert("n1".into(), 9);
        r.invalidate();
        assert_eq!(&*r.resolve(&["n1", "n2", "x"], &map), &[Some(9), Some(2), Some(7)]);
    }

    #[test]
    fn name_lists_read_back_as_written_and_compare_whole() {
        let names = ["n1", "", "nødé-2", "n1"];
        let list = NameList::new(names);
        assert_eq!(list.iter().collect::<Vec<_>>(), names);
        assert!(list.is(&names));
        assert!(!list.is(&names[..3]), "a prefix is another list");
        assert!(!list.is(&["n1", "", "nødé-2", "n1", "n1"]));
        assert!(!list.is(&["n1", "", "nødé-", "2n1"]));
        assert!(NameList::new([]).is(&[]));
        assert_eq!(NameList::new([]).iter().count(), 0);
    }

    /// The index answers as the map does, for every live name and for names that are not live
    /// (prefixes and extensions of live ones, the empty name), in any order.
    #[test]
    fn the_index_finds_what_the_map_holds() {
        let mut map = FxHashMap::default();
        for i in 0..3000usize {
            // Positions with gaps (nodes that went), names of many lengths.
            map.insert(format!("node-{}{}", "x".repeat(i % 37), i), i * 2 + 1);
        }
        map.insert(String::new(), 0);
        let index = NameIndex::new(&map);
        let mut asked: Vec<String> = map.keys().cloned().collect();
        for i in (0..3000).step_by(7) {
            asked.push(format!("node-{}{}", "x".repeat(i % 37), i + 3000));
            asked.push(
                format!("node-{}{}", "x".repeat(i % 37), i)
                    .trim_end_matches(char::is_numeric)
                    .to_string(),
            );
            asked.push(format!("node-{}{}0", "x".repeat(i % 37), i));
        }
        asked.reverse();
        let names: Vec<&str> = asked.iter().map(String::as_str).collect();
        let expected: Vec<Option<usize>> = names.iter().map(|n| map.get(*n).copied()).collect();
        assert_eq!(&*index.positions(&names), expected.as_slice());
        assert!(expected.iter().filter(|p| p.is_none()).count() > 1000);
        assert_eq!(
            &*NameIndex::new(&FxHashMap::default()).positions(&["a", ""]),
            &[None, None]
        );
    }
}
