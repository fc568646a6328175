//! The scores a filter worked out, kept for the prioritize call that follows it.
//!
//! kube-scheduler asks prioritize, right after filter, about the same pod and the nodes that
//! passed. Prioritize used to look those nodes up again and read their verdicts back from the
//! engine; now the filter keeps its own (the nodes that fit, in order, with their scores), the
//! reply is written as soon as the filter has answered, while the scheduler reads that answer,
//! and prioritize sends it when the pod, the nodes and what the verdicts came from (the
//! cluster's [`Stamp`]) are as they were. Otherwise prioritize works the scores out afresh.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, OnceLock};

use axum::body::Bytes;
use tessera_core::placement::PodDemand;

use super::cluster::{PodAsk, Stamp, scale_scores};
use super::wire::host_scores_json;

/// Filters kept: the pod being scheduled and the one before it.
const KEEP: usize = 2;

/// One filter's scores, for the prioritize after it.
#[derive(Debug)]
pub struct Kept {
    demand: PodDemand,
    uid: Option<String>,
    stamp: Stamp,
    /// The nodes that fit, in the candidates' order, each name after its length.
    names: Vec<u8>,
    scores: Vec<f64>,
    reply: OnceLock<Bytes>,
}

/// The names of a buffer of length-prefixed names.
fn names(mut buf: &[u8]) -> impl Iterator<Item = &str> {
    std::iter::from_fn(move || {
        let (len, rest) = buf.split_first_chunk::<4>()?;
        let (name, rest) = rest.split_at(u32::from_le_bytes(*len) as usize);
        buf = rest;
        Some(std::str::from_utf8(name).expect("written from a str"))
    })
}

impl Kept {
    /// What a filter of `ask` found (`fits`: the nodes that fit, in order, with their scores),
    /// from `stamp`.
    pub fn new(ask: &PodAsk, stamp: Stamp, fits: &[(&str, f64)]) -> Self {
        let mut names = Vec::with_capacity(fits.iter().map(|(n, _)| n.len() + 4).sum());
        for (n, _) in fits {
            names.extend_from_slice(&(n.len() as u32).to_le_bytes());
            names.extend_from_slice(n.as_bytes());
        }
        Self {
            demand: ask.demand.clone(),
            uid: ask.uid.clone(),
            stamp,
            names,
            scores: fits.iter().map(|&(_, s)| s).collect(),
            reply: OnceLock::new(),
        }
    }

    /// The prioritize reply (JSON), written on first use: a second caller waits for the first.
    pub fn reply(&self) -> Bytes {
        self.reply
            .get_or_init(|| {
                let fits: Vec<(&str, f64)> = names(&self.names).zip(self.scores.iter().copied()).collect();
                Bytes::from(host_scores_json(&scale_scores(&fits)))
            })
            .clone()
    }

    /// Whether `candidates` are the nodes that fit, in the same order.
    fn same_nodes(&self, candidates: &[&str]) -> bool {
        candidates.len() == self.scores.len() && names(&self.names).zip(candidates).all(|(a, b)| a == *b)
    }
}

/// The last filters' scores.
#[derive(Debug, Default)]
pub struct Handoff {
    kept: Mutex<VecDeque<Arc<Kept>>>,
}

impl Handoff {
    /// Keeps a filter's scores (over the oldest kept).
    pub fn keep(&self, kept: Arc<Kept>) {
        let mut k = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        k.push_front(kept);
        k.truncate(KEEP);
    }

    /// The prioritize reply a filter of `ask` kept for exactly `candidates`, where the
    /// cluster's stamp is still `now`.
    pub fn reply(&self, ask: &PodAsk, candidates: &[&str], now: Stamp) -> Option<Bytes> {
        let found = self
            .kept
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|k| k.stamp == now && k.uid == ask.uid && k.demand == ask.demand && k.same_nodes(candidates))
            .cloned()?;
        Some(found.reply())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_read_back_as_written() {
        let ask_names = ["n1", "", "nødé-2", "n1"];
        let mut buf = Vec::new();
        for n in ask_names {
            buf.extend_from_slice(&(n.len() as u32).to_le_bytes());
            buf.extend_from_slice(n.as_bytes());
        }
        assert_eq!(names(&buf).collect::<Vec<_>>(), ask_names);
        assert_eq!(names(&[]).count(), 0);
    }
}
