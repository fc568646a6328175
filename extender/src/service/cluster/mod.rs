//! The extender's view of the cluster: a core [`Ledger`] that watches write and verbs read.
//!
//! Node, Pod and ElasticGPU events feed the ledger and the claims' holds (`feed`); the
//! scheduler's questions (what a pod asks, filter, reserve, preempt) are answered from it
//! (`verbs`). Kubernetes objects are translated here; every decision is the engine's.

use std::collections::BTreeMap;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tessera_api::pod::PodClaimError;
use tessera_core::handoff::{KeyDirStamp, SigningKeys};
use tessera_core::ledger::{Ledger, LedgerError};
use tessera_core::placement::{EngineConfig, PodDemand, WorkloadLearner};
use tessera_core::request::{PodRequest, RequestError, RequestOptions};
use tracing::{info, warn};

use super::tenants::Tenants;
use tessera_claims::holds::{ClaimHolds, LedgerChange};

mod feed;
mod verbs;

pub use verbs::scale_scores;

/// How many observed pods between refreshes of the target workload.
const WORKLOAD_REFRESH: u64 = 64;

/// What a pod asks of the extender.
#[derive(Debug, Clone)]
pub struct PodAsk {
    /// The engine's view of the request.
    pub demand: PodDemand,
    /// `tessera.io/core-limit`.
    pub core_limit: Option<u32>,
    /// The request as parsed (to plan around containers whose claims hold GPUs).
    pub request: PodRequest,
    /// The claims its containers name, as `namespace/name` per container.
    pub claims: Vec<(String, String)>,
    /// `namespace/name`.
    pub pod: String,
    /// Its UID, when it has one.
    pub uid: Option<String>,
}

/// Why cards could not be reserved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReserveError {
    /// The ledger refused.
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    /// The pod's claims do not allow it here.
    #[error("{0}")]
    Claims(String),
}

/// A pod the extender cannot place as written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AskError {
    /// Its resources or Tessera annotations are invalid.
    #[error(transparent)]
    Request(#[from] RequestError),
    /// Its claim annotations are invalid.
    #[error(transparent)]
    Claims(#[from] PodClaimError),
}

/// What a filter's verdicts were worked out from: while it is the same, the same pod on the
/// same nodes gets the same verdicts (for a pod the engine remembers, without claims).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stamp {
    /// The engine's changes ([`Ledger::changes`]).
    ledger: u64,
    /// Changes to the nodes that offer GPU pods nothing.
    not_ready: u64,
}

/// The ledger, locked. As the lock is let go its count of changes is published for
/// [`Cluster::stamp`] (still under the lock, so the published counts only grow); a change
/// made under a lock not yet let go is not seen, as if the stamp had been read before it.
struct LedgerGuard<'a> {
    ledger: std::sync::MutexGuard<'a, Ledger>,
    changes: &'a AtomicU64,
}

impl Deref for LedgerGuard<'_> {
    type Target = Ledger;
    fn deref(&self) -> &Ledger {
        &self.ledger
    }
}

impl DerefMut for LedgerGuard<'_> {
    fn deref_mut(&mut self) -> &mut Ledger {
        &mut self.ledger
    }
}

impl Drop for LedgerGuard<'_> {
    fn drop(&mut self) {
        self.changes.store(self.ledger.changes(), Ordering::Release);
    }
}

/// Nodes that offer pods none of their GPUs, with why, and how often that changed.
#[derive(Debug, Default)]
struct NotReady {
    reasons: BTreeMap<String, String>,
    changes: u64,
}

impl NotReady {
    /// Records why `node` offers nothing (`None`: it offers its GPUs); true when that is new.
    fn set(&mut self, node: &str, reason: Option<String>) -> bool {
        let changed = match reason {
            Some(r) if self.reasons.get(node) == Some(&r) => false,
            Some(r) => {
                self.reasons.insert(node.to_string(), r);
                true
            }
            None => self.reasons.remove(node).is_some(),
        };
        self.changes += u64::from(changed);
        changed
    }

    /// Keeps the nodes `keep` says to.
    fn retain(&mut self, keep: impl Fn(&str) -> bool) {
        let before = self.reasons.len();
        self.reasons.retain(|n, _| keep(n));
        self.changes += u64::from(self.reasons.len() != before);
    }
}

/// The filter verdict for one pod, naming nodes as the candidates did.
#[derive(Debug, Default)]
pub struct FilterOutcome<'a> {
    /// What the verdicts were worked out from, where they stand while it does: the engine
    /// remembers the pod's verdicts and the pod names no claim (claims' holds change apart
    /// from the ledger).
    pub stamp: Option<Stamp>,
    /// Nodes that fit, with the engine's score.
    pub fits: Vec<(&'a str, f64)>,
    /// Nodes that do not fit now, with why.
    pub failed: Vec<(&'a str, Arc<str>)>,
    /// Nodes that cannot take the pod whatever is evicted, with why.
    pub unresolvable: Vec<(&'a str, Arc<str>)>,
    /// The engine has yet to remember what it found: [`Cluster::settle`] once the answer is
    /// out (else the next use of the engine does it first).
    pub unsettled: bool,
}

struct Learning {
    learner: WorkloadLearner,
    seen: u64,
    /// The engine's target is behind the learner.
    stale: bool,
}

/// The cluster as the extender knows it.
pub struct Cluster {
    ledger: Mutex<Ledger>,
    /// The ledger's count of changes as of the last time its lock was let go: what
    /// [`Cluster::stamp`] reads, without waiting for the lock.
    ledger_changes: AtomicU64,
    learning: Mutex<Learning>,
    keys: std::sync::RwLock<Arc<SigningKeys>>,
    /// Where the keys are read again from when it changes (see [`Cluster::reloading_keys_from`]).
    keys_dir: Option<(std::path::PathBuf, Mutex<KeyDirStamp>)>,
    opts: RequestOptions,
    /// Nodes that offer pods none of their GPUs (a driver not ready, GPUs given to DRA), with
    /// why.
    not_ready: Mutex<NotReady>,
    nodes_synced: AtomicBool,
    pods_synced: AtomicBool,
    /// Claims' GPUs and users (lock order: ledger, then claims).
    claims: Mutex<ClaimHolds>,
    elastic_gpus_synced: AtomicBool,
    /// Each namespace's tenant.
    tenants: Arc<Tenants>,
}

impl Cluster {
    /// An empty view; not ready until both the node and the pod lists have been read.
    pub fn new(config: EngineConfig, keys: SigningKeys, opts: RequestOptions) -> Self {
        let tenants = Arc::new(Tenants::default());
        Self {
            ledger: Mutex::new(Ledger::new(config, &Default::default())),
            ledger_changes: AtomicU64::new(0),
            learning: Mutex::new(Learning {
                learner: WorkloadLearner::new(2000.0),
                seen: 0,
                stale: false,
            }),
            keys: std::sync::RwLock::new(Arc::new(keys)),
            keys_dir: None,
            opts,
            not_ready: Mutex::new(NotReady::default()),
            nodes_synced: AtomicBool::new(false),
            pods_synced: AtomicBool::new(false),
            claims: Mutex::new(ClaimHolds::with_tenants(
                tenants.clone() as Arc<dyn tessera_claims::holds::TenantOf>
            )),
            elastic_gpus_synced: AtomicBool::new(true),
            tenants,
        }
    }

    /// Each namespace's tenant (fed by [`super::tenants::watch`]).
    pub fn tenants(&self) -> &Arc<Tenants> {
        &self.tenants
    }

    /// The cluster has ElasticGPUs: not synced until they have been read too.
    pub fn track_elastic_gpus(&self) {
        self.elastic_gpus_synced.store(false, Ordering::Release);
    }

    fn claims(&self) -> std::sync::MutexGuard<'_, ClaimHolds> {
        self.claims.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Applies what the claims' bookkeeping asks of the ledger.
    fn apply(l: &mut Ledger, change: LedgerChange) {
        for k in change.unbook {
            l.unbook(&k);
        }
        for (k, b) in change.book {
            if let Err(e) = l.book(&k, b) {
                warn!(booking = k, error = %e, "cannot book a retained ElasticGPU");
            }
        }
    }

    /// Who uses the claim `namespace/name` now (`namespace/name` of the pod, and its UID).
    pub fn claim_user(&self, key: &str) -> Option<(String, String)> {
        self.claims().user(key).map(|u| (u.pod.clone(), u.uid.clone()))
    }

    fn ledger(&self) -> LedgerGuard<'_> {
        LedgerGuard {
            ledger: self.ledger.lock().unwrap_or_else(|p| p.into_inner()),
            changes: &self.ledger_changes,
        }
    }

    fn not_ready(&self) -> std::sync::MutexGuard<'_, NotReady> {
        self.not_ready.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Lets the engine remember what the last filter found
    /// ([`tessera_core::placement::Engine::settle`]).
    pub fn settle(&self) {
        self.ledger().engine().settle();
    }

    /// What a filter now would work its verdicts out from. It does not wait for the ledger:
    /// a prioritize checks it while the filter before it settles the engine's memos.
    pub fn stamp(&self) -> Stamp {
        Stamp {
            ledger: self.ledger_changes.load(Ordering::Acquire),
            not_ready: self.not_ready().changes,
        }
    }

    /// Reads the signing keys again from `dir` (a mounted Secret) whenever it changes: a key
    /// made active signs from the next bind, a key removed stops verifying, without a restart.
    pub fn reloading_keys_from(mut self, dir: std::path::PathBuf) -> Self {
        let stamp = KeyDirStamp::of(&dir);
        self.keys_dir = Some((dir, Mutex::new(stamp)));
        self
    }

    /// The signing keys, read again first when their directory changed (a key set that does
    /// not load keeps the one loaded, with a warning).
    pub fn keys(&self) -> Arc<SigningKeys> {
        if let Some((dir, seen)) = &self.keys_dir {
            let now = KeyDirStamp::of(dir);
            let mut seen = seen.lock().unwrap_or_else(|p| p.into_inner());
            if *seen != now {
                match super::keys::signing_keys(dir) {
                    Ok(fresh) => {
                        info!(dir = %dir.display(), active = fresh.active_key_id(), "the hand-off keys changed: reloaded");
                        *self.keys.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(fresh);
                        *seen = now;
                    }
                    Err(e) => {
                        warn!(dir = %dir.display(), error = %e, "cannot reload the hand-off keys; keeping the loaded ones")
                    }
                }
            }
        }
        self.keys.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// How requests are read (the memory unit).
    pub fn request_options(&self) -> RequestOptions {
        self.opts
    }

    /// True once every node and every pod has been read (allocations rebuilt).
    pub fn synced(&self) -> bool {
        self.nodes_synced.load(Ordering::Acquire)
            && self.pods_synced.load(Ordering::Acquire)
            && self.elastic_gpus_synced.load(Ordering::Acquire)
            && self.tenants.synced()
    }

    /// Known nodes and bookings, for metrics.
    pub fn counts(&self) -> (usize, usize) {
        let l = self.ledger();
        (l.node_count(), l.booking_count())
    }

    /// Records a pod in the workload and refreshes the engine's target now and then (each
    /// refresh forgets the memoised node verdicts). Lock order: ledger, then learning.
    fn learn(&self, ledger: &mut Ledger, demand: &PodDemand) {
        let mut learning = self.learning.lock().unwrap_or_else(|p| p.into_inner());
        learning.learner.observe(demand);
        learning.seen += 1;
        if learning.seen == 1 || learning.seen.is_multiple_of(WORKLOAD_REFRESH) || !self.synced() {
            learning.stale = true;
        }
        if learning.stale && self.synced() {
            learning.stale = false;
            ledger.set_workload(&learning.learner.target(0.95, 10));
        }
    }
}

impl tessera_claims::SchedulerView for Cluster {
    fn synced(&self) -> bool {
        Cluster::synced(self)
    }

    fn keys(&self) -> Arc<SigningKeys> {
        Cluster::keys(self)
    }

    fn claim_user(&self, key: &str) -> Option<(String, String)> {
        Cluster::claim_user(self, key)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use k8s_openapi::api::core::v1::Node;

    use super::*;

    fn node(name: &str) -> Node {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name},
            "status": {"allocatable": {"cpu": "8", "memory": "32Gi", "pods": "110"}}
        }))
        .expect("a node")
    }

    #[test]
    fn a_stamp_is_read_while_the_ledger_is_held_and_moves_once_it_is_let_go() {
        let keys = SigningKeys::new("k1", [("k1".to_string(), vec![9u8; 32])]).expect("valid keys");
        let cluster = Arc::new(Cluster::new(EngineConfig::default(), keys, RequestOptions::default()));
        let before = cluster.stamp();
        let mut ledger = cluster.ledger();
        let (capacity, _) = feed::node_capacity(&node("n1"));
        ledger.set_node("n1", capacity);
        // Asked from another thread while the lock is held, it answers, as of before the change.
        let (tx, rx) = std::sync::mpsc::channel();
        let other = cluster.clone();
        std::thread::spawn(move || tx.send(other.stamp()));
        let during = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("the stamp waited for the ledger's lock");
        assert_eq!(during, before);
        drop(ledger);
        assert_ne!(cluster.stamp(), before, "a change to the ledger did not move the stamp");
    }
}
