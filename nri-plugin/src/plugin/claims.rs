//! Whether a DRA claim is reserved for the pod whose container carries its marker.
//!
//! A marker's token is in the container's environment, where any process of the container can
//! read it and a tenant can copy it into another pod's spec. So a container gets a claim's
//! devices only while the claim is reserved for its pod (`status.reservedFor`). The pods the
//! claim was reserved for when the node prepared it are in the node's record, and stay reserved
//! as long as they exist (pod UIDs are never reused), so they need no lookup; a pod the record
//! does not list (a claim shared by pods scheduled later, or a copied marker) is looked up on
//! the API server, and what it said yes to is remembered.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tessera_core::dra::{ClaimStore, Mark, PreparedClaim, claims_of};
use tracing::{debug, warn};

/// Where a claim's reservations are read: the API server, or a test's fake.
#[async_trait]
pub trait Reservations: Send + Sync + 'static {
    /// Claim `namespace/name`'s uid and the uids of the pods it is reserved for now.
    async fn reserved_for(&self, namespace: &str, name: &str) -> Result<(String, Vec<String>), String>;
}

/// Reservations read from the API server.
pub struct ApiReservations(pub kube::Client);

#[async_trait]
impl Reservations for ApiReservations {
    async fn reserved_for(&self, namespace: &str, name: &str) -> Result<(String, Vec<String>), String> {
        use k8s_openapi::api::resource::v1::ResourceClaim;
        let claim = kube::Api::<ResourceClaim>::namespaced(self.0.clone(), namespace)
            .get(name)
            .await
            .map_err(|e| format!("reading claim {namespace}/{name}: {e}"))?;
        let pods = claim
            .status
            .and_then(|s| s.reserved_for)
            .unwrap_or_default()
            .into_iter()
            .filter(|r| r.resource == "pods" && r.api_group.as_deref().unwrap_or("").is_empty())
            .map(|r| r.uid)
            .collect();
        Ok((claim.metadata.uid.unwrap_or_default(), pods))
    }
}

/// How long a container's creation waits for the API server's answers, all claims together
/// (under containerd's 2 s `plugin_request_timeout`, with an MPS share's ceiling wait after it).
const LOOKUP_TIMEOUT: Duration = Duration::from_millis(300);
/// Claims looked up for one container at most (a pod names a few; a tenant naming more gets
/// the rest refused rather than slowing every creation).
const MAX_LOOKUPS: usize = 8;

/// The pods known to be reserved for each claim beyond its record's, and where to ask.
#[derive(Default)]
pub(super) struct Reserved {
    source: Option<Arc<dyn Reservations>>,
    /// Claim uid -> pod uids the API server said it is reserved for.
    learned: Mutex<HashMap<String, HashSet<String>>>,
}

impl Reserved {
    pub(super) fn with(source: Arc<dyn Reservations>) -> Self {
        Self {
            source: Some(source),
            learned: Mutex::default(),
        }
    }

    /// Whether `claim` is reserved for pod `pod_uid`: listed in its record, or learned since.
    pub(super) fn holds(&self, claim: &PreparedClaim, pod_uid: &str) -> bool {
        !pod_uid.is_empty()
            && (claim.pods.iter().any(|p| p == pod_uid)
                || self
                    .learned
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get(&claim.uid)
                    .is_some_and(|pods| pods.contains(pod_uid)))
    }

    /// Asks the API server, all at once and within [`LOOKUP_TIMEOUT`] together, about the
    /// claims `marks` name whose record does not list pod `pod_uid`, of the pod's `namespace`
    /// and named with the token the node gave (anything else is refused without asking, so a
    /// forged marker costs no lookup), at most [`MAX_LOOKUPS`] of them; a claim reserved for
    /// the pod is remembered. Errors are logged: the creation is then refused by
    /// [`Reserved::holds`], naming the claim.
    pub(super) async fn look_up(&self, store: &ClaimStore, (pod_uid, namespace): (&str, &str), marks: &[Mark]) {
        let Some(source) = &self.source else { return };
        let wanted: Vec<PreparedClaim> = claims_of(marks)
            .into_iter()
            .filter_map(|uid| store.get(&uid).ok().flatten())
            .filter(|claim| claim.namespace == namespace && !self.holds(claim, pod_uid))
            .filter(|claim| {
                marks
                    .iter()
                    .filter(|m| m.claim == claim.uid)
                    .all(|m| tessera_core::dra::marker_token_matches(claim, m))
            })
            .take(MAX_LOOKUPS)
            .collect();
        if wanted.is_empty() {
            return;
        }
        let asks = wanted
            .iter()
            .map(|claim| async move { (claim, source.reserved_for(&claim.namespace, &claim.name).await) });
        let Ok(answers) = tokio::time::timeout(LOOKUP_TIMEOUT, futures_util::future::join_all(asks)).await else {
            warn!(
                claims = ?wanted.iter().map(PreparedClaim::key).collect::<Vec<_>>(),
                "the API server did not say in time whom the claims are reserved for"
            );
            return;
        };
        for (claim, answer) in answers {
            match answer {
                Ok((found_uid, pods)) if found_uid == claim.uid => {
                    if pods.iter().any(|p| p == pod_uid) {
                        debug!(
                            claim = claim.key(),
                            pod_uid, "claim reserved for a pod prepared after it"
                        );
                        self.learn(&claim.uid, pod_uid);
                    }
                }
                Ok((found_uid, _)) => warn!(
                    claim = claim.key(),
                    found_uid, "the API server's claim is another object than the node prepared"
                ),
                Err(e) => warn!(claim = claim.key(), error = e, "cannot read the claim's reservations"),
            }
        }
    }

    /// Notes that claim `uid` is reserved for pod `pod_uid`.
    pub(super) fn learn(&self, uid: &str, pod_uid: &str) {
        self.learned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(uid.to_string())
            .or_default()
            .insert(pod_uid.to_string());
    }

    /// Keeps what was learned of claims still recorded on the node, for pods still there
    /// (`live_pods`).
    pub(super) fn retain(&self, store: &ClaimStore, live_pods: &HashSet<String>) {
        let mut learned = self.learned.lock().unwrap_or_else(|p| p.into_inner());
        learned.retain(|uid, pods| {
            pods.retain(|p| live_pods.contains(p));
            !pods.is_empty() && matches!(store.get(uid), Ok(Some(_)))
        });
    }
}
