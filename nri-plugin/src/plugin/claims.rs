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

/// How long a container's creation waits for the API server's answer (under containerd's
/// 2 s `plugin_request_timeout`, with an MPS share's ceiling wait after it).
const LOOKUP_TIMEOUT: Duration = Duration::from_millis(400);

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

    /// Asks the API server about each claim `marks` name whose record does not list pod
    /// `pod_uid`; a claim reserved for it is remembered. Errors are logged: the creation is
    /// then refused by [`Reserved::holds`], naming the claim.
    pub(super) async fn look_up(&self, store: &ClaimStore, pod_uid: &str, marks: &[Mark]) {
        let Some(source) = &self.source else { return };
        for uid in claims_of(marks) {
            let Ok(Some(claim)) = store.get(&uid) else { continue };
            if self.holds(&claim, pod_uid) {
                continue;
            }
            let asked = tokio::time::timeout(LOOKUP_TIMEOUT, source.reserved_for(&claim.namespace, &claim.name)).await;
            match asked {
                Ok(Ok((found_uid, pods))) if found_uid == claim.uid => {
                    if pods.iter().any(|p| p == pod_uid) {
                        debug!(
                            claim = claim.key(),
                            pod_uid, "claim reserved for a pod prepared after it"
                        );
                        self.learned
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .entry(claim.uid.clone())
                            .or_default()
                            .insert(pod_uid.to_string());
                    }
                }
                Ok(Ok((found_uid, _))) => {
                    warn!(
                        claim = claim.key(),
                        found_uid, "the API server's claim is another object than the node prepared"
                    )
                }
                Ok(Err(e)) => warn!(claim = claim.key(), error = e, "cannot read the claim's reservations"),
                Err(_) => warn!(
                    claim = claim.key(),
                    "the API server did not say in time whom the claim is reserved for"
                ),
            }
        }
    }

    /// Forgets what was learned of claims no longer recorded on the node.
    pub(super) fn retain(&self, store: &ClaimStore) {
        self.learned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|uid, _| matches!(store.get(uid), Ok(Some(_))));
    }
}
