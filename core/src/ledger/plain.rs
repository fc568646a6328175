//! Pods that hold no GPU: most of a cluster's pods. Only their CPU and memory count against
//! their node (the node tier weighs them), so each is kept in 16 bytes under a 128-bit key of
//! its UID, with per-node sums to re-apply when a node is re-published.

use std::hash::{BuildHasher as _, Hasher as _};

use rustc_hash::FxHashMap;

/// A pod's CPU and memory on its node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlainHold {
    /// The node (an id from [`PlainHolds::node_id`]).
    pub node: u32,
    /// CPU, millicores.
    pub cpu_milli: u32,
    /// Memory, bytes.
    pub memory: u64,
}

/// The key of a pod UID: its 128 bits when it is a UUID (as the API server assigns them),
/// else a 128-bit hash of it.
pub fn key(uid: &str) -> u128 {
    let hex: String = uid.chars().filter(|c| *c != '-').collect();
    if hex.len() == 32
        && let Ok(k) = u128::from_str_radix(&hex, 16)
    {
        return k;
    }
    let half = |seed: u64| {
        let mut h = rustc_hash::FxBuildHasher.build_hasher();
        h.write_u64(seed);
        h.write(uid.as_bytes());
        h.finish()
    };
    (u128::from(half(0x9e37_79b9_7f4a_7c15)) << 64) | u128::from(half(0xc2b2_ae3d_27d4_eb4f))
}

/// Every pod without a GPU, by UID key.
#[derive(Debug, Clone, Default)]
pub struct PlainHolds {
    holds: FxHashMap<u128, PlainHold>,
    node_ids: FxHashMap<String, u32>,
    node_names: Vec<String>,
    /// Per node id: CPU and memory of its plain pods.
    sums: Vec<(u64, u64)>,
}

impl PlainHolds {
    /// The id of a node name (interned; nodes are few).
    pub fn node_id(&mut self, name: &str) -> u32 {
        if let Some(&id) = self.node_ids.get(name) {
            return id;
        }
        let id = self.node_names.len() as u32;
        self.node_names.push(name.to_string());
        self.node_ids.insert(name.to_string(), id);
        self.sums.push((0, 0));
        id
    }

    /// A node's name by id.
    pub fn node_name(&self, id: u32) -> &str {
        &self.node_names[id as usize]
    }

    /// Records `uid`'s hold; returns the one it replaces.
    pub fn insert(&mut self, uid: &str, hold: PlainHold) -> Option<PlainHold> {
        let old = self.holds.insert(key(uid), hold);
        if let Some(o) = old {
            self.sub(o);
        }
        let s = &mut self.sums[hold.node as usize];
        s.0 += u64::from(hold.cpu_milli);
        s.1 += hold.memory;
        old
    }

    fn sub(&mut self, h: PlainHold) {
        let s = &mut self.sums[h.node as usize];
        s.0 = s.0.saturating_sub(u64::from(h.cpu_milli));
        s.1 = s.1.saturating_sub(h.memory);
    }

    /// Removes `uid`'s hold.
    pub fn remove(&mut self, uid: &str) -> Option<PlainHold> {
        let h = self.holds.remove(&key(uid))?;
        self.sub(h);
        Some(h)
    }

    /// `uid`'s hold.
    pub fn get(&self, uid: &str) -> Option<PlainHold> {
        self.holds.get(&key(uid)).copied()
    }

    /// CPU and memory of a node's plain pods.
    pub fn sum(&self, node: &str) -> (u64, u64) {
        self.node_ids.get(node).map_or((0, 0), |&id| self.sums[id as usize])
    }

    /// Drops the holds whose key `keep` rejects; returns them.
    pub fn retain(&mut self, keep: impl Fn(u128) -> bool) -> Vec<PlainHold> {
        let gone: Vec<u128> = self.holds.keys().copied().filter(|k| !keep(*k)).collect();
        let mut out = Vec::with_capacity(gone.len());
        for k in gone {
            if let Some(h) = self.holds.remove(&k) {
                self.sub(h);
                out.push(h);
            }
        }
        out
    }

    /// Number of holds.
    pub fn len(&self) -> usize {
        self.holds.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_sums_and_replacement() {
        assert_eq!(
            key("00000000-0000-4000-8000-000000000001"),
            0x0000_0000_0000_4000_8000_0000_0000_0001
        );
        assert_ne!(key("uid-a"), key("uid-b"));
        assert_eq!(key("uid-a"), key("uid-a"));
        let mut p = PlainHolds::default();
        let (a, b) = (p.node_id("a"), p.node_id("b"));
        p.insert(
            "p1",
            PlainHold {
                node: a,
                cpu_milli: 500,
                memory: 1 << 30,
            },
        );
        p.insert(
            "p2",
            PlainHold {
                node: a,
                cpu_milli: 250,
                memory: 1 << 20,
            },
        );
        assert_eq!(p.sum("a"), (750, (1 << 30) + (1 << 20)));
        // Moved to b.
        let old = p.insert(
            "p1",
            PlainHold {
                node: b,
                cpu_milli: 500,
                memory: 1 << 30,
            },
        );
        assert_eq!(old.map(|o| o.node), Some(a));
        assert_eq!((p.sum("a"), p.sum("b")), ((250, 1 << 20), (500, 1 << 30)));
        assert_eq!(p.remove("p2").map(|h| h.cpu_milli), Some(250));
        assert_eq!(p.sum("a"), (0, 0));
        let keep = key("p1");
        p.insert(
            "p3",
            PlainHold {
                node: a,
                cpu_milli: 1,
                memory: 1,
            },
        );
        assert_eq!(p.retain(|k| k == keep).len(), 1);
        assert_eq!((p.len(), p.sum("a")), (1, (0, 0)));
        assert_eq!(p.sum("nowhere"), (0, 0));
        assert_eq!(p.node_name(b), "b");
    }
}
