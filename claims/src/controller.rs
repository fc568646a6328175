//! The claims controller: makes each claim's ElasticGPU and status say what its pod was given.
//!
//! Reconciling a claim (`namespace/name`), from the stores alone:
//! - a bound pod uses it (its signed allocation gives the container's devices): the ElasticGPU
//!   `egpu-<claim uid>` records node, devices and amounts, `Bound` to the claim with the pod;
//!   the claim is `Bound` to it;
//! - no pod uses it: `Retain` keeps the ElasticGPU `Bound` (its devices stay booked, and the next
//!   pod using the claim is placed on them); `Delete` deletes it and the claim is `Pending`;
//! - the claim is gone (or was created again under its name): its old ElasticGPU is `Released`
//!   (Retain, no longer booked) or deleted (Delete).
//!
//! Only the leader writes. Every change to a claim, an ElasticGPU or a pod naming claims
//! triggers its claim; a new leader, and every [`RESYNC`], reconciles them all.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Client};
use serde_json::json;
use tessera_api::class::ReclaimPolicy;
use tessera_api::egpu::{ClaimRef, ElasticGpu, ElasticGpuPhase, ElasticGpuSpec, GpuDevice};
use tessera_core::names::{ANNOTATION_ALLOCATION, ANNOTATION_ALLOCATION_SIGNATURE, is_tessera_resource};
use tokio::sync::{mpsc, watch};
use tracing::{info, warn};

use crate::{ClaimStores, SchedulerView};

/// How often every claim is reconciled even without a change.
pub const RESYNC: Duration = Duration::from_secs(300);
/// How long before a failed reconcile is tried again.
const RETRY: Duration = Duration::from_secs(2);

/// What the controller reads and writes.
pub struct Reconciler {
    /// API client.
    pub client: Client,
    /// The cluster view (hand-off keys).
    pub cluster: Arc<dyn SchedulerView>,
    /// Tessera's pods.
    pub pods: Store<Pod>,
    /// Claims, classes, ElasticGPUs.
    pub stores: ClaimStores,
}

/// A pod using a claim, as far as it got.
struct Use {
    pod: String,
    /// Node and the container's devices, once bound with a verified allocation.
    bound: Option<(String, Vec<GpuDevice>)>,
    /// The container's `tessera.io/*` limits.
    capacity: std::collections::BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
}

fn is_finished(p: &Pod) -> bool {
    matches!(
        p.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

impl Reconciler {
    /// The live pod using claim `name` in `ns`, if any.
    fn user(&self, ns: &str, name: &str) -> Option<Use> {
        let mut found: Option<Use> = None;
        for p in self.pods.state() {
            if p.metadata.namespace.as_deref() != Some(ns) || is_finished(&p) {
                continue;
            }
            let Ok(uses) = tessera_api::pod::claim_refs(&p) else {
                continue;
            };
            let Some(u) = uses.into_iter().find(|u| u.claim == name) else {
                continue;
            };
            let container = p
                .spec
                .iter()
                .flat_map(|s| s.init_containers.iter().flatten().chain(&s.containers))
                .find(|c| c.name == u.container);
            let capacity = container
                .and_then(|c| c.resources.as_ref())
                .and_then(|r| r.limits.clone())
                .unwrap_or_default()
                .into_iter()
                .filter(|(k, _)| is_tessera_resource(k))
                .collect();
            let bound = self.bound_devices(&p, &u.container);
            let this = Use {
                pod: format!("{ns}/{}", p.metadata.name.as_deref().unwrap_or_default()),
                bound,
                capacity,
            };
            // A bound pod is the one that holds the claim.
            if found.as_ref().is_none_or(|f| f.bound.is_none() && this.bound.is_some()) {
                found = Some(this);
            }
        }
        found
    }

    /// The node and the container's devices, from the pod's verified allocation.
    fn bound_devices(&self, p: &Pod, container: &str) -> Option<(String, Vec<GpuDevice>)> {
        let node = p.spec.as_ref()?.node_name.clone()?;
        let a = p.metadata.annotations.as_ref()?;
        let allocation = self
            .cluster
            .keys()
            .verify(
                a.get(ANNOTATION_ALLOCATION).map(String::as_str),
                a.get(ANNOTATION_ALLOCATION_SIGNATURE).map(String::as_str),
                &node,
                p.metadata.uid.as_deref()?,
            )
            .ok()?;
        let devices = allocation
            .containers
            .iter()
            .find(|c| c.name == container)?
            .devices
            .iter()
            .map(GpuDevice::from)
            .collect();
        Some((node, devices))
    }

    fn claim_gone(&self, e: &ElasticGpu, why: &str) -> Vec<Action> {
        let name = e.metadata.name.clone().unwrap_or_default();
        match e.spec.reclaim_policy {
            ReclaimPolicy::Delete => vec![Action::DeleteGpu(name)],
            ReclaimPolicy::Retain if e.phase() != ElasticGpuPhase::Released => vec![Action::GpuStatus(
                name,
                json!({"phase": "Released", "pod": null, "message": why}),
            )],
            ReclaimPolicy::Retain => Vec::new(),
        }
    }

    /// What claim `key` needs done.
    fn plan(&self, key: &str) -> Vec<Action> {
        let Some((ns, name)) = key.split_once('/') else {
            return Vec::new();
        };
        let claim = self.stores.claims.get(&ObjectRef::new(name).within(ns));
        let gpus: Vec<Arc<ElasticGpu>> = self
            .stores
            .elastic_gpus
            .state()
            .into_iter()
            .filter(|e| e.spec.claim_ref.namespace == ns && e.spec.claim_ref.name == name)
            .collect();
        let mut actions = Vec::new();
        let Some(claim) = claim else {
            for e in &gpus {
                actions.extend(self.claim_gone(e, "its ElasticGPUClaim was deleted"));
            }
            return actions;
        };
        let claim_uid = claim.metadata.uid.clone().unwrap_or_default();
        let own = ElasticGpu::name_for(&claim_uid);
        for e in gpus.iter().filter(|e| e.spec.claim_ref.uid != claim_uid) {
            actions.extend(self.claim_gone(e, "its ElasticGPUClaim was deleted and created again"));
        }
        let current = gpus.iter().find(|e| e.spec.claim_ref.uid == claim_uid);
        let user = self.user(ns, name);
        let status = claim.status.clone().unwrap_or_default();
        let claim_status = |phase: &str, egpu: Option<&str>, pod: Option<&str>| {
            let same = serde_json::to_value(status.phase)
                .ok()
                .as_ref()
                .and_then(|v| v.as_str())
                == Some(phase)
                && status.elastic_gpu_name.as_deref() == egpu
                && status.pod.as_deref() == pod;
            (!same).then(|| {
                Action::ClaimStatus(
                    ns.to_string(),
                    name.to_string(),
                    json!({"phase": phase, "elasticGPUName": egpu, "pod": pod}),
                )
            })
        };
        match (user, current) {
            (
                Some(Use {
                    pod,
                    bound: Some((node, devices)),
                    capacity,
                }),
                current,
            ) => {
                match current {
                    // Not what the pod holds (a Delete GPU not yet deleted when the next pod
                    // was placed): it goes, and the next pass records the pod's.
                    Some(e) if e.spec.node_name != node || e.spec.devices != devices => {
                        actions.push(Action::DeleteGpu(own));
                        return actions;
                    }
                    Some(_) => {}
                    None => {
                        let reclaim_policy = claim
                            .class_name()
                            .ok()
                            .and_then(|c| self.stores.classes.get(&ObjectRef::new(c)))
                            .map(|c| c.spec.reclaim_policy)
                            .unwrap_or_default();
                        actions.push(Action::CreateGpu(Box::new(ElasticGpu::new(
                            &own,
                            ElasticGpuSpec {
                                capacity,
                                node_name: node,
                                claim_ref: ClaimRef {
                                    namespace: ns.to_string(),
                                    name: name.to_string(),
                                    uid: claim_uid.clone(),
                                },
                                reclaim_policy,
                                devices,
                            },
                        ))));
                    }
                }
                let s = current.and_then(|e| e.status.clone()).unwrap_or_default();
                if current.is_none() || s.phase != ElasticGpuPhase::Bound || s.pod.as_deref() != Some(pod.as_str()) {
                    actions.push(Action::GpuStatus(
                        own.clone(),
                        json!({"phase": "Bound", "pod": pod, "message": null}),
                    ));
                }
                actions.extend(claim_status("Bound", Some(&own), Some(&pod)));
            }
            // Not bound yet: nothing changes until it is.
            (Some(Use { bound: None, .. }), _) => {}
            (None, Some(e)) if e.spec.reclaim_policy == ReclaimPolicy::Retain => {
                let s = e.status.clone().unwrap_or_default();
                if s.phase != ElasticGpuPhase::Bound || s.pod.is_some() {
                    actions.push(Action::GpuStatus(
                        own.clone(),
                        json!({"phase": "Bound", "pod": null, "message": "retained for its claim"}),
                    ));
                }
                actions.extend(claim_status("Bound", Some(&own), None));
            }
            (None, Some(_)) => {
                actions.push(Action::DeleteGpu(own));
                actions.extend(claim_status("Pending", None, None));
            }
            (None, None) => actions.extend(claim_status("Pending", None, None)),
        }
        actions
    }

    /// Brings claim `key` and its ElasticGPUs to what they should be.
    pub async fn reconcile(&self, key: &str) -> Result<(), kube::Error> {
        let gpus: Api<ElasticGpu> = Api::all(self.client.clone());
        for action in self.plan(key) {
            match action {
                Action::CreateGpu(e) => {
                    let name = e.metadata.name.clone().unwrap_or_default();
                    match gpus.create(&PostParams::default(), &e).await {
                        Ok(_) => info!(
                            claim = key,
                            elastic_gpu = name,
                            node = e.spec.node_name,
                            "ElasticGPU created"
                        ),
                        Err(kube::Error::Api(s)) if s.code == 409 => {}
                        Err(err) => return Err(err),
                    }
                }
                Action::GpuStatus(name, status) => {
                    gpus.patch_status(&name, &PatchParams::default(), &Patch::Merge(json!({"status": status})))
                        .await?;
                }
                Action::DeleteGpu(name) => match gpus.delete(&name, &DeleteParams::default()).await {
                    Ok(_) => info!(claim = key, elastic_gpu = name, "ElasticGPU deleted"),
                    Err(kube::Error::Api(s)) if s.code == 404 => {}
                    Err(err) => return Err(err),
                },
                Action::ClaimStatus(ns, name, status) => {
                    let claims: Api<tessera_api::claim::ElasticGpuClaim> = Api::namespaced(self.client.clone(), &ns);
                    match claims
                        .patch_status(&name, &PatchParams::default(), &Patch::Merge(json!({"status": status})))
                        .await
                    {
                        Ok(_) => {}
                        Err(kube::Error::Api(s)) if s.code == 404 => {}
                        Err(err) => return Err(err),
                    }
                }
            }
        }
        Ok(())
    }

    fn every_key(&self) -> BTreeSet<String> {
        let claims = self.stores.claims.state().into_iter().map(|c| c.key());
        let gpus = self
            .stores
            .elastic_gpus
            .state()
            .into_iter()
            .map(|e| format!("{}/{}", e.spec.claim_ref.namespace, e.spec.claim_ref.name));
        claims.chain(gpus).collect()
    }

    /// Reconciles triggered claims while this replica leads (all of them when it starts
    /// leading, and every [`RESYNC`]) until the task is dropped.
    pub async fn run(
        self,
        mut triggers: mpsc::UnboundedReceiver<String>,
        retry: mpsc::UnboundedSender<String>,
        mut leading: watch::Receiver<bool>,
    ) {
        // Nothing is decided before the cluster and the claims have been read.
        let _ = self.stores.claims.wait_until_ready().await;
        let _ = self.stores.classes.wait_until_ready().await;
        while !self.cluster.synced() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let mut pending: BTreeSet<String> = BTreeSet::new();
        let mut resync = true;
        // Without election (a single replica) leadership never changes.
        let mut elected = true;
        loop {
            if resync && *leading.borrow() {
                pending.extend(self.every_key());
                resync = false;
            }
            if pending.is_empty() {
                tokio::select! {
                    k = triggers.recv() => match k {
                        Some(k) => { pending.insert(k); }
                        None => return,
                    },
                    r = leading.changed(), if elected => match r {
                        Ok(()) => resync = true,
                        Err(_) => elected = false,
                    },
                    _ = tokio::time::sleep(RESYNC) => resync = true,
                }
            }
            while let Ok(k) = triggers.try_recv() {
                pending.insert(k);
            }
            if !*leading.borrow() {
                // A follower writes nothing; it catches up when it leads.
                pending.clear();
                continue;
            }
            while let Some(k) = pending.pop_first() {
                if let Err(e) = self.reconcile(&k).await {
                    warn!(claim = k, error = %e, "reconciling the claim failed; trying again");
                    let retry = retry.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(RETRY).await;
                        let _ = retry.send(k);
                    });
                }
            }
        }
    }
}

/// One write.
enum Action {
    CreateGpu(Box<ElasticGpu>),
    GpuStatus(String, serde_json::Value),
    DeleteGpu(String),
    ClaimStatus(String, String, serde_json::Value),
}
