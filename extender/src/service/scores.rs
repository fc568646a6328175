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
use tessera_core::ledger::NameList;
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
    /// The nodes that fit, in the candidates' order.
    names: NameList,
    scores: Vec<f64>,
    reply: OnceLock<Bytes>,
}

impl Kept {
    /// What a filter of `ask` found (`fits`: the nodes that fit, in order, with their scores),
    /// from `stamp`.
    pub fn new(ask: &PodAsk, stamp: Stamp, fits: &[(&str, f64)]) -> Self {
        Self {
            demand: ask.demand.clone(),
            uid: ask.uid.clone(),
            stamp,
            names: NameList::new(fits.iter().map(|&(n, _)| n)),
            scores: fits.iter().map(|&(_, s)| s).collect(),
            reply: OnceLock::new(),
        }
    }

    /// The prioritize reply (JSON), written on first use: a second caller waits for the first.
    pub fn reply(&self) -> Bytes {
        self.reply
            .get_or_init(|| {
                let fits: Vec<(&str, f64)> = self.names.iter().zip(self.scores.iter().copied()).collect();
                Bytes::from(host_scores_json(&scale_scores(&fits)))
            })
            .clone()
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
            .find(|k| k.stamp == now && k.uid == ask.uid && k.demand == ask.demand && k.names.is(candidates))
            .cloned()?;
        Some(found.reply())
    }
}
