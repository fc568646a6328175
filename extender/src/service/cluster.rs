//! The extender's view of the cluster: the core [`Ledger`] fed from Node and Pod objects, and
//! the placement questions the scheduler asks of it. Kubernetes objects are translated here;
//! every decision is the engine's.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::{Node, Pod};
use tessera_api::pod::{ClaimUse, PodClaimError, claim_refs, names_claims};
use tessera_core::handoff::ContainerAllocation;
use tessera_core::handoff::{Allocation, KeyDirStamp, SigningKeys};
use tessera_core::inventory::{Health, PublishedInventory};
use tessera_core::ledger::{Booking, Hold, Ledger, LedgerError, NodeCapacity};
use tessera_core::names::{
    ANNOTATION_ALLOCATION, ANNOTATION_ALLOCATION_SIGNATURE, ANNOTATION_INVENTORY, LABEL_CROSS_TENANT_SHARING,
    LABEL_DRA, offers_dra,
};
use tessera_core::placement::check_node_resources;
use tessera_core::placement::{EngineConfig, PodDemand, WorkloadLearner};
use tessera_core::quantity::Amount;
use tessera_core::request::{GpuDemand, PodRequest, RequestError, RequestOptions};
use tracing::{debug, info, warn};

use super::tenants::Tenants;
use super::wire::{HostScore, MAX_PRIORITY, MetaVictims};
use tessera_claims::holds::{ClaimHolds, LedgerChange, booking_key, is_booking_key};

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

/// How a pod that names claims is placed now.
struct ClaimPlan {
    /// The node its held GPUs are on, with their containers' devices and the bookings they
    /// come from.
    held: Option<(String, Vec<ContainerAllocation>, Vec<String>)>,
    /// The demand left to plan (without the held containers' cards).
    planned: PodDemand,
}

/// The filter verdict for one pod, naming nodes as the candidates did.
#[derive(Debug, Default)]
pub struct FilterOutcome<'a> {
    /// Nodes that fit, with the engine's score.
    pub fits: Vec<(&'a str, f64)>,
    /// Nodes that do not fit now, with why.
    pub failed: Vec<(&'a str, Arc<str>)>,
    /// Nodes that cannot take the pod whatever is evicted, with why.
    pub unresolvable: Vec<(&'a str, Arc<str>)>,
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
    learning: Mutex<Learning>,
    keys: std::sync::RwLock<Arc<SigningKeys>>,
    /// Where the keys are read again from when it changes (see [`Cluster::reloading_keys_from`]).
    keys_dir: Option<(std::path::PathBuf, Mutex<KeyDirStamp>)>,
    opts: RequestOptions,
    /// Nodes that offer pods none of their GPUs (a driver not ready, GPUs given to DRA), with
    /// why.
    not_ready: Mutex<BTreeMap<String, String>>,
    nodes_synced: AtomicBool,
    pods_synced: AtomicBool,
    /// Claims' GPUs and users (lock order: ledger, then claims).
    claims: Mutex<ClaimHolds>,
    elastic_gpus_synced: AtomicBool,
    /// Each namespace's tenant.
    tenants: Arc<Tenants>,
}

/// Reads a node: its capacity, and why its GPUs cannot be given to pods (the node publishes
/// its driver as not ready, or gives its GPUs to DRA claims), when they cannot.
fn node_capacity(node: &Node) -> (NodeCapacity, Option<String>) {
    let name = node.metadata.name.as_deref().unwrap_or_default();
    let alloc = node.status.as_ref().and_then(|s| s.allocatable.as_ref());
    let amount = |key: &str| {
        alloc.and_then(|a| a.get(key)).and_then(|q| match Amount::parse(&q.0) {
            Ok(a) => Some(a),
            Err(e) => {
                warn!(node = name, resource = key, value = q.0, error = %e, "unparsable allocatable");
                None
            }
        })
    };
    let (gpus, not_ready, share_enforcement, topology) = match node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANNOTATION_INVENTORY))
    {
        None => (Vec::new(), None, Default::default(), None),
        Some(v) => match PublishedInventory::decode(v) {
            Ok(inv) => {
                // A matrix that does not match the GPUs would misplace; place without it.
                let topology = inv.topology.filter(|t| {
                    let fits = t.len() == inv.gpus.len();
                    if !fits {
                        warn!(
                            node = name,
                            rows = t.len(),
                            gpus = inv.gpus.len(),
                            "ignoring a GPU topology that does not match the GPUs"
                        );
                    }
                    fits
                });
                (
                    inv.gpus,
                    inv.not_ready,
                    inv.share_enforcement,
                    topology.map(std::sync::Arc::new),
                )
            }
            Err(e) => {
                warn!(node = name, error = %e, "ignoring the node's {ANNOTATION_INVENTORY} annotation");
                (Vec::new(), None, Default::default(), None)
            }
        },
    };
    let not_ready = not_ready.map(|reason| format!("the node's GPU driver is not ready: {reason}"));
    // A node that serves DRA claims: its cards are the DRA scheduler's to give.
    let not_ready = not_ready.or_else(|| {
        offers_dra(node.metadata.labels.as_ref())
            .then(|| format!("the node's GPUs go to DRA claims ({LABEL_DRA}=true): ask with a ResourceClaim"))
    });
    // A node whose driver cannot serve containers, or whose GPUs go to DRA, keeps its GPUs in
    // the books (bound pods stay counted) but offers none.
    let gpus = match &not_ready {
        None => gpus,
        Some(reason) => gpus
            .into_iter()
            .map(|mut g| {
                g.health = Health::Unhealthy { reason: reason.clone() };
                g
            })
            .collect(),
    };
    let cap = NodeCapacity {
        cpu_milli: amount("cpu").map_or(0, Amount::milli_ceil),
        memory_bytes: amount("memory").map_or(0, Amount::ceil),
        gpus,
        schedulable: !node.spec.as_ref().and_then(|s| s.unschedulable).unwrap_or(false),
        share_enforcement,
        topology,
        cross_tenant: node
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(LABEL_CROSS_TENANT_SHARING))
            .is_some_and(|v| v == "true"),
    };
    (cap, not_ready)
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn is_terminated(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

impl Cluster {
    /// An empty view; not ready until both the node and the pod lists have been read.
    pub fn new(config: EngineConfig, keys: SigningKeys, opts: RequestOptions) -> Self {
        let tenants = Arc::new(Tenants::default());
        Self {
            ledger: Mutex::new(Ledger::new(config, &Default::default())),
            learning: Mutex::new(Learning {
                learner: WorkloadLearner::new(2000.0),
                seen: 0,
                stale: false,
            }),
            keys: std::sync::RwLock::new(Arc::new(keys)),
            keys_dir: None,
            opts,
            not_ready: Mutex::new(BTreeMap::new()),
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

    /// An ElasticGPU was added or changed.
    pub fn elastic_gpu_applied(&self, e: &tessera_api::egpu::ElasticGpu) {
        let mut l = self.ledger();
        let change = self.claims().gpu_applied(e);
        Self::apply(&mut l, change);
    }

    /// An ElasticGPU was deleted.
    pub fn elastic_gpu_deleted(&self, name: &str) {
        let mut l = self.ledger();
        let change = self.claims().gpu_deleted(name);
        Self::apply(&mut l, change);
    }

    /// A full ElasticGPU list was read.
    pub fn elastic_gpus_listed(&self, names: &HashSet<String>) {
        let mut l = self.ledger();
        let change = self.claims().gpus_listed(names);
        Self::apply(&mut l, change);
        self.elastic_gpus_synced.store(true, Ordering::Release);
    }

    /// Who uses the claim `namespace/name` now (`namespace/name` of the pod, and its UID).
    pub fn claim_user(&self, key: &str) -> Option<(String, String)> {
        self.claims().user(key).map(|u| (u.pod.clone(), u.uid.clone()))
    }

    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|p| p.into_inner())
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

    /// A node was added or changed.
    pub fn node_applied(&self, node: &Node) {
        let Some(name) = node.metadata.name.as_deref() else {
            return;
        };
        let (cap, not_ready) = node_capacity(node);
        {
            let mut nr = self.not_ready.lock().unwrap_or_else(|p| p.into_inner());
            match not_ready {
                Some(reason) => {
                    if nr.get(name) != Some(&reason) {
                        warn!(node = name, reason, "no GPU pods go to the node");
                    }
                    nr.insert(name.to_string(), reason);
                }
                None => {
                    nr.remove(name);
                }
            }
        }
        for (uid, e) in self.ledger().set_node(name, cap) {
            warn!(node = name, pod_uid = uid, error = %e, "a booked allocation no longer matches the node");
        }
    }

    /// A node was deleted.
    pub fn node_deleted(&self, name: &str) {
        self.ledger().remove_node(name);
        self.not_ready.lock().unwrap_or_else(|p| p.into_inner()).remove(name);
    }

    /// A full node list was read: nodes not in it are gone.
    pub fn nodes_listed(&self, names: &HashSet<String>) {
        let mut l = self.ledger();
        let known: Vec<String> = l.cluster().nodes.iter().map(|n| n.name.clone()).collect();
        for n in known.iter().filter(|n| !names.contains(*n)) {
            l.remove_node(n);
        }
        self.not_ready
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|n, _| names.contains(n));
        self.nodes_synced.store(true, Ordering::Release);
    }

    /// Parses what a pod asks for.
    pub fn ask(&self, pod: &Pod) -> Result<PodAsk, AskError> {
        let request = PodRequest::from_pod(pod, &self.opts)?;
        let ns = pod.metadata.namespace.as_deref().unwrap_or_default();
        // Most pods name no claim: no parsing for them.
        let claims = if names_claims(pod) {
            claim_refs(pod)?
                .into_iter()
                .map(|ClaimUse { container, claim, .. }| (container, format!("{ns}/{claim}")))
                .collect()
        } else {
            Vec::new()
        };
        let mut demand = PodDemand::from_request(&request);
        demand.tenant = self.tenants.of(ns);
        Ok(PodAsk {
            demand,
            core_limit: request.core_limit,
            claims,
            pod: format!("{ns}/{}", pod.metadata.name.as_deref().unwrap_or_default()),
            uid: pod.metadata.uid.clone(),
            request,
        })
    }

    /// How `ask` (pod `uid`) is placed given its claims: `Err` when a claim is used by another
    /// pod or its claims' GPUs are held on different nodes.
    fn claim_plan(&self, uid: Option<&str>, ask: &PodAsk) -> Result<ClaimPlan, String> {
        let holds = self.claims();
        let mut held: Option<(String, Vec<ContainerAllocation>, Vec<String>)> = None;
        let mut request = ask.request.clone();
        for (container, key) in &ask.claims {
            if let Some(u) = holds.user(key).filter(|u| Some(u.uid.as_str()) != uid) {
                return Err(format!("ElasticGPUClaim {key} is in use by pod {}", u.pod));
            }
            let Some(g) = holds.gpu(key).filter(|g| g.retain) else {
                continue;
            };
            let (node, containers, keys) = held.get_or_insert_with(|| (g.node.clone(), Vec::new(), Vec::new()));
            if *node != g.node {
                return Err(format!(
                    "the pod's claims hold GPUs on different nodes ({node:?} and {:?}, ElasticGPU {})",
                    g.node, g.egpu
                ));
            }
            let Some(c) = request.containers.iter_mut().find(|c| &c.name == container) else {
                continue;
            };
            if !g.serves(&c.gpu) {
                return Err(format!(
                    "ElasticGPUClaim {key} asks for another GPU than its retained ElasticGPU {} holds; delete that ElasticGPU to place the claim afresh",
                    g.egpu
                ));
            }
            containers.push(ContainerAllocation {
                name: container.clone(),
                role: c.role,
                devices: g.devices.clone(),
            });
            keys.push(booking_key(&g.egpu));
            c.gpu = GpuDemand::None;
        }
        let mut planned = PodDemand::from_request(&request);
        planned.tenant = ask.demand.tenant;
        Ok(ClaimPlan { planned, held })
    }

    /// A pod was added or changed: bound pods are booked with their verified allocation,
    /// finished pods free what they held.
    pub fn pod_applied(&self, pod: &Pod) {
        let Some(uid) = pod.metadata.uid.as_deref() else {
            return;
        };
        if is_terminated(pod) {
            let mut l = self.ledger();
            l.unbook(uid);
            let change = self.claims().release_pod(uid);
            Self::apply(&mut l, change);
            return;
        }
        let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) else {
            // Not bound: a reservation of ours (bind in flight) stays as it is.
            return;
        };
        let name = pod.metadata.name.as_deref().unwrap_or_default();
        let annotations = pod.metadata.annotations.as_ref();
        let allocation = annotations
            .and_then(|a| a.get(ANNOTATION_ALLOCATION))
            .and_then(|value| {
                let sig = annotations.and_then(|a| a.get(ANNOTATION_ALLOCATION_SIGNATURE));
                match self.keys().verify(Some(value), sig.map(String::as_str), node, uid) {
                    Ok(a) => Some(a),
                    Err(e) => {
                        warn!(pod = name, node, error = %e, "not counting an allocation that does not verify");
                        None
                    }
                }
            });
        let (demand, claims, pod_key) = match self.ask(pod) {
            Ok(a) => (a.demand, a.claims, a.pod),
            Err(e) => {
                debug!(pod = name, error = %e, "bound pod with an invalid request: counting nothing");
                (PodDemand::default(), Vec::new(), String::new())
            }
        };
        let mut l = self.ledger();
        // The first verified allocation of a pod holds until the pod ends: its node injected
        // those devices at sandbox creation, whatever the annotation says now (a tenant may
        // rewrite its own pod's annotations; pods/update allows it).
        let allocation = allocation.or_else(|| {
            let kept = l.booking(uid).filter(|b| b.node == node)?.allocation.clone()?;
            warn!(
                pod = name,
                node, "the pod's allocation annotation no longer verifies: keeping the allocation it was bound with"
            );
            Some(kept)
        });
        if !claims.is_empty() {
            let change = self
                .claims()
                .use_claims(uid, &pod_key, claims.into_iter().map(|(_, k)| k).collect());
            Self::apply(&mut l, change);
        }
        if allocation.is_none() && !demand.wants_cards() {
            // Most pods: only their CPU and memory count, kept in a few bytes.
            l.book_plain(uid, node, demand.cpu_milli, demand.memory_bytes);
            return;
        }
        if let Some(b) = l.booking(uid)
            && b.node == node
            && b.allocation == allocation
            && b.demand == demand
        {
            l.confirm(uid);
            return;
        }
        // Running GPU pods are the workload fragmentation is measured against.
        let learn = allocation.is_some() && l.booking(uid).is_none();
        let booking = Booking {
            node: node.to_string(),
            demand,
            allocation,
            hold: Hold::Bound,
        };
        if learn {
            self.learn(&mut l, &booking.demand);
        }
        if let Err(e) = l.book(uid, booking.clone()) {
            warn!(pod = name, node, error = %e, "counting the pod without its GPUs");
            let _ = l.book(
                uid,
                Booking {
                    allocation: None,
                    ..booking
                },
            );
        }
    }

    /// A pod was deleted.
    pub fn pod_deleted(&self, uid: &str) {
        let mut l = self.ledger();
        l.unbook(uid);
        let change = self.claims().release_pod(uid);
        Self::apply(&mut l, change);
    }

    /// A full pod list was read: bound bookings of pods not in it are gone (our own
    /// reservations in flight stay).
    pub fn pods_listed(&self, uids: &HashSet<String>) {
        let mut l = self.ledger();
        for uid in l.booked_uids() {
            // Retained ElasticGPUs are booked under their own keys, not pods'.
            if is_booking_key(&uid) {
                continue;
            }
            if !uids.contains(&uid) && l.booking(&uid).is_some_and(|b| b.hold == Hold::Bound) {
                l.unbook(&uid);
            }
        }
        l.retain_plain(uids);
        let change = self.claims().pods_listed(uids);
        Self::apply(&mut l, change);
        self.pods_synced.store(true, Ordering::Release);
        // The running pods seen during the list are the first target workload.
        let mut learning = self.learning.lock().unwrap_or_else(|p| p.into_inner());
        if learning.stale || learning.seen > 0 {
            learning.stale = false;
            l.set_workload(&learning.learner.target(0.95, 10));
        }
    }

    /// Filters and scores `candidates` for `ask`.
    pub fn filter<'a>(&self, ask: &PodAsk, candidates: &[&'a str]) -> FilterOutcome<'a> {
        let mut out = FilterOutcome::default();
        let not_ready = self.not_ready.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let mut l = self.ledger();
        // A pod whose claims hold GPUs goes where they are, planning only the rest.
        let mut planned = None;
        let mut only = None;
        if !ask.claims.is_empty() {
            match self.claim_plan(ask.uid.as_deref(), ask) {
                Err(reason) => {
                    let reason: Arc<str> = reason.into();
                    out.unresolvable = candidates.iter().map(|&n| (n, reason.clone())).collect();
                    return out;
                }
                Ok(plan) => {
                    only = plan.held.map(|(node, _, keys)| (node, keys.join(", ")));
                    planned = Some(plan.planned);
                }
            }
        }
        let demand = planned.as_ref().unwrap_or(&ask.demand);
        let mut positions = Vec::with_capacity(candidates.len());
        let mut names = Vec::with_capacity(candidates.len());
        let resolved = l.resolve_names(candidates);
        for (&name, &index) in candidates.iter().zip(resolved.iter()) {
            if let Some((node, held)) = &only
                && node != name
            {
                out.unresolvable.push((
                    name,
                    format!("the pod's claims hold their GPUs on node {node:?} ({held})").into(),
                ));
                continue;
            }
            if ask.demand.wants_cards()
                && let Some(reason) = not_ready.get(name)
            {
                out.unresolvable.push((name, reason.as_str().into()));
                continue;
            }
            match index {
                Some(i) => {
                    positions.push(i);
                    names.push(name);
                }
                None => out
                    .unresolvable
                    .push((name, Arc::from("node is not known to the Tessera extender"))),
            }
        }
        let allowed = l.cluster().allowed_models(demand.gpu_models.as_deref());
        let verdicts = if demand.wants_cards() {
            l.engine().evaluate_nodes(demand, &positions)
        } else {
            // Every card it needs is held: only its CPU and memory are left to fit.
            positions
                .iter()
                .map(|&i| {
                    (
                        i,
                        check_node_resources(&l.cluster().nodes[i], demand)
                            .map(|()| 0.0)
                            .map_err(Arc::from),
                    )
                })
                .collect()
        };
        for ((i, verdict), name) in verdicts.into_iter().zip(names) {
            match verdict {
                Ok(score) => out.fits.push((name, score)),
                // Preemption can only help where the pod could ever fit.
                Err(reason) if l.cluster().nodes[i].could_take(demand, &allowed) => out.failed.push((name, reason)),
                Err(reason) => out.unresolvable.push((name, reason)),
            }
        }
        out
    }

    /// Reserves cards for a pod on `node`; `None` when the pod needs no GPU.
    pub fn reserve(&self, uid: &str, node: &str, ask: &PodAsk) -> Result<Option<Allocation>, ReserveError> {
        let mut l = self.ledger();
        let a = if ask.claims.is_empty() {
            l.reserve(uid, node, &ask.demand, ask.core_limit)?
        } else {
            let plan = self.claim_plan(Some(uid), ask).map_err(ReserveError::Claims)?;
            let (held, keys) = match plan.held {
                Some((n, held, keys)) if n == node => (held, keys),
                Some((n, _, keys)) => {
                    return Err(ReserveError::Claims(format!(
                        "the pod's claims hold their GPUs on node {n:?} ({}), not {node:?}",
                        keys.join(", ")
                    )));
                }
                None => (Vec::new(), Vec::new()),
            };
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            let a = l.reserve_holding(uid, node, &ask.demand, &plan.planned, ask.core_limit, &held, &keys)?;
            // Being bound, the pod uses its claims: their retained GPUs are its now.
            let change = self
                .claims()
                .use_claims(uid, &ask.pod, ask.claims.iter().map(|(_, k)| k.clone()).collect());
            Self::apply(&mut l, change);
            a
        };
        if a.is_some() {
            self.learn(&mut l, &ask.demand);
        }
        Ok(a)
    }

    /// Drops our reservation for `uid` if it is still one (a failed bind). A booking the
    /// API has since confirmed stays.
    pub fn release(&self, uid: &str) {
        let mut l = self.ledger();
        if l.booking(uid).is_some_and(|b| b.hold == Hold::Reserved) {
            l.unbook(uid);
            let change = self.claims().release_pod(uid);
            Self::apply(&mut l, change);
        }
    }

    /// The API server bound `uid` (our Binding succeeded): its hold is no longer ours to drop,
    /// whether or not the watch has shown it yet.
    pub fn confirm(&self, uid: &str) {
        self.ledger().confirm(uid);
    }

    /// The hold on `uid`, if any.
    pub fn booking(&self, uid: &str) -> Option<Booking> {
        self.ledger().booking(uid).cloned()
    }

    /// Keeps, per candidate node, only the victims whose eviction is needed for the pod to fit
    /// (a victim is spared when the pod still fits without evicting it). Nodes where the pod
    /// does not fit even with every victim gone are dropped.
    pub fn preempt(&self, ask: &PodAsk, candidates: BTreeMap<String, MetaVictims>) -> BTreeMap<String, MetaVictims> {
        let mut l = self.ledger();
        let mut out = BTreeMap::new();
        for (node, victims) in candidates {
            let mut evict: Vec<String> = victims.pods.iter().map(|p| p.uid.clone()).collect();
            if let Err(reason) = l.fits_without(&node, &ask.demand, &refs(&evict)) {
                debug!(node, reason, "evicting every victim would not make room");
                continue;
            }
            // Try to spare each victim in the scheduler's order (most important first, as its
            // own reprieve does), keeping at least one.
            let mut k = 0;
            while k < evict.len() && evict.len() > 1 {
                let mut trial = evict.clone();
                trial.remove(k);
                if l.fits_without(&node, &ask.demand, &refs(&trial)).is_ok() {
                    evict = trial;
                } else {
                    k += 1;
                }
            }
            out.insert(
                node,
                MetaVictims {
                    num_pdb_violations: (victims.num_pdb_violations).min(evict.len() as i64),
                    pods: evict.into_iter().map(|uid| super::wire::MetaPod { uid }).collect(),
                },
            );
        }
        out
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

/// Scales engine scores to the extender's 0..=10: the best node gets 10, the worst 0, the
/// rest in proportion (all 10 when they tie).
pub fn scale_scores<'a>(fits: &[(&'a str, f64)]) -> Vec<HostScore<'a>> {
    let (lo, hi) = fits
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), (_, s)| {
            (lo.min(*s), hi.max(*s))
        });
    let tie = hi - lo <= f64::EPSILON * hi.abs().max(1.0);
    fits.iter()
        .map(|&(host, s)| {
            let score = if tie {
                MAX_PRIORITY
            } else {
                ((s - lo) / (hi - lo) * MAX_PRIORITY as f64).round() as i64
            };
            HostScore {
                host,
                score: score.clamp(0, MAX_PRIORITY),
            }
        })
        .collect()
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
    use super::*;

    fn scaled(v: &[f64]) -> Vec<i64> {
        scale_scores(&v.iter().map(|s| ("n", *s)).collect::<Vec<_>>())
            .into_iter()
            .map(|h| h.score)
            .collect()
    }

    #[test]
    fn scores_span_zero_to_ten_and_ties_get_ten() {
        assert_eq!(scaled(&[-3.0, 1.0, 5.0]), [0, 5, 10]);
        assert_eq!(scaled(&[2.5, 2.5]), [10, 10]);
        assert_eq!(scaled(&[1e12, 1e12 + 1.0, 1e12 + 2.0]), [0, 5, 10]);
        assert!(scaled(&[]).is_empty());
    }
}
