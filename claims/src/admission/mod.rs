//! The mutating admission webhook for pods that name ElasticGPU claims: each such container
//! gets its claim's GPU as `tessera.io/*` resources (limits and requests), so kubelet's
//! accounting, the device plugin and the node's cross-check see an ordinary Tessera pod.
//!
//! A pod is refused, with the annotation, claim and reason in the message, when a claim does not
//! exist, names a class that does not exist, asks for nothing Tessera can give, or is used by
//! another pod that has not finished; or when a container names a claim and also asks for
//! `tessera.io/*` resources itself. Pods that name no claim pass unchanged.
//!
//! Served over HTTPS on its own listener by every replica ([`router`]); [`certs`] keeps its
//! certificate and the webhook configuration's `caBundle`.

pub mod certs;

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::routing::post;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use kube::runtime::reflector::{ObjectRef, Store};
use tessera_api::claim::ElasticGpuClaim;
use tessera_api::class::ElasticGpuClass;
use tessera_api::pod::{claim_refs, names_claims};
use tessera_core::names::is_tessera_resource;
use tessera_core::request::RequestOptions;
use tracing::{info, warn};

use crate::{ClaimStores, SchedulerView};

use tessera_api::pod::MUTATE_PODS_PATH;

/// What the webhook reads.
pub struct Webhook {
    /// API client (claims and classes not yet in the stores).
    pub client: kube::Client,
    /// Claims and classes.
    pub stores: ClaimStores,
    /// Tessera's pods (pending users of a claim).
    pub pods: Store<Pod>,
    /// Bound users of claims, and the cluster's request options.
    pub cluster: Arc<dyn SchedulerView>,
    /// The memory unit of `tessera.io/gpu-memory`.
    pub opts: RequestOptions,
}

fn finished(p: &Pod) -> bool {
    matches!(
        p.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

impl Webhook {
    async fn claim(&self, ns: &str, name: &str) -> Result<Option<ElasticGpuClaim>, String> {
        if let Some(c) = self.stores.claims.get(&ObjectRef::new(name).within(ns)) {
            return Ok(Some((*c).clone()));
        }
        // Created a moment ago: not in the store yet.
        Api::<ElasticGpuClaim>::namespaced(self.client.clone(), ns)
            .get_opt(name)
            .await
            .map_err(|e| format!("reading ElasticGPUClaim {ns}/{name}: {e}"))
    }

    async fn class_exists(&self, name: &str) -> Result<bool, String> {
        if self.stores.classes.get(&ObjectRef::new(name)).is_some() {
            return Ok(true);
        }
        Api::<ElasticGpuClass>::all(self.client.clone())
            .get_opt(name)
            .await
            .map(|c| c.is_some())
            .map_err(|e| format!("reading ElasticGPUClass {name}: {e}"))
    }

    /// Another live pod naming claim `name` in `ns`, other than `this` (`namespace/name`).
    fn other_user(&self, ns: &str, name: &str, this: &str) -> Option<String> {
        if let Some((pod, _)) = self.cluster.claim_user(&format!("{ns}/{name}"))
            && pod != this
        {
            return Some(pod);
        }
        self.pods.state().into_iter().find_map(|p| {
            let key = format!("{ns}/{}", p.metadata.name.as_deref().unwrap_or_default());
            let uses = p.metadata.namespace.as_deref() == Some(ns)
                && key != this
                && !finished(&p)
                && claim_refs(&p).is_ok_and(|u| u.iter().any(|u| u.claim == name));
            uses.then_some(key)
        })
    }

    /// The pod with its claims' resources filled in, or why it is refused. `None`: unchanged.
    pub async fn mutate(&self, pod: &Pod, ns: &str) -> Result<Option<Pod>, String> {
        if !names_claims(pod) {
            return Ok(None);
        }
        let uses = claim_refs(pod).map_err(|e| e.to_string())?;
        let this = format!("{ns}/{}", pod.metadata.name.as_deref().unwrap_or_default());
        let mut out = pod.clone();
        for u in &uses {
            let claim = self.claim(ns, &u.claim).await?.ok_or_else(|| {
                format!(
                    "annotation {}: ElasticGPUClaim {ns}/{} does not exist",
                    u.annotation, u.claim
                )
            })?;
            let class = claim.class_name().map_err(|e| e.to_string())?;
            if !self.class_exists(class).await? {
                return Err(format!(
                    "ElasticGPUClaim {ns}/{} names ElasticGPUClass {class:?}, which does not exist",
                    u.claim
                ));
            }
            if let Some(user) = self.other_user(ns, &u.claim, &this) {
                return Err(format!("ElasticGPUClaim {ns}/{} is in use by pod {user}", u.claim));
            }
            let resources = claim.container_resources(&self.opts).map_err(|e| e.to_string())?;
            let spec = out.spec.as_mut().ok_or("the pod has no spec")?;
            let c = spec
                .init_containers
                .iter_mut()
                .flatten()
                .chain(spec.containers.iter_mut())
                .find(|c| c.name == u.container)
                .ok_or_else(|| format!("the pod has no container {:?}", u.container))?;
            let r = c.resources.get_or_insert_with(Default::default);
            if let Some(own) = r
                .limits
                .iter()
                .chain(r.requests.iter())
                .flat_map(|m| m.keys())
                .find(|k| is_tessera_resource(k))
            {
                return Err(format!(
                    "container {:?} names ElasticGPUClaim {ns}/{} ({}) and also asks for {own}; use one or the other",
                    u.container, u.claim, u.annotation
                ));
            }
            r.limits.get_or_insert_with(Default::default).extend(resources.clone());
            r.requests.get_or_insert_with(Default::default).extend(resources);
        }
        Ok(Some(out))
    }

    /// Answers one review.
    pub async fn review(&self, req: &AdmissionRequest<Pod>) -> AdmissionResponse {
        let resp = AdmissionResponse::from(req);
        let Some(pod) = req.object.as_ref().filter(|_| req.operation == Operation::Create) else {
            return resp;
        };
        let ns = req
            .namespace
            .as_deref()
            .or(pod.metadata.namespace.as_deref())
            .unwrap_or("default");
        match self.mutate(pod, ns).await {
            Ok(None) => resp,
            Ok(Some(mutated)) => {
                let (before, after) = match (serde_json::to_value(pod), serde_json::to_value(&mutated)) {
                    (Ok(b), Ok(a)) => (b, a),
                    _ => return resp.deny("the pod cannot be written back as JSON"),
                };
                info!(
                    pod = req.name,
                    namespace = ns,
                    "filled in the GPU resources of the pod's ElasticGPU claims"
                );
                match resp.clone().with_patch(json_patch::diff(&before, &after)) {
                    Ok(r) => r,
                    Err(e) => resp.deny(format!("cannot encode the patch: {e}")),
                }
            }
            Err(reason) => {
                warn!(
                    pod = req.name,
                    namespace = ns,
                    reason,
                    "refused a pod's ElasticGPU claims"
                );
                resp.deny(reason)
            }
        }
    }
}

async fn mutate_pods(State(w): State<Arc<Webhook>>, body: axum::body::Bytes) -> axum::Json<serde_json::Value> {
    let review: Result<AdmissionReview<Pod>, _> = serde_json::from_slice(&body);
    let resp = match review.map_err(|e| e.to_string()).and_then(|r| {
        let req: Result<AdmissionRequest<Pod>, _> = r.try_into();
        req.map_err(|e| e.to_string())
    }) {
        Ok(req) => w.review(&req).await,
        Err(e) => AdmissionResponse::invalid(format!("malformed AdmissionReview: {e}")),
    };
    axum::Json(review_json(resp.into_review()))
}

/// The review as the API server reads it: kube-rs writes the patch as an array of numbers
/// (kube-rs/kube#1781), the API documents a base64 string, so it is written as one.
fn review_json(review: AdmissionReview<DynamicObject>) -> serde_json::Value {
    use base64::Engine as _;
    let mut v = serde_json::to_value(&review).unwrap_or_default();
    if let Some(bytes) = v["response"]["patch"].as_array().map(|a| {
        a.iter()
            .filter_map(|b| b.as_u64().and_then(|b| u8::try_from(b).ok()))
            .collect::<Vec<u8>>()
    }) {
        v["response"]["patch"] = base64::engine::general_purpose::STANDARD.encode(bytes).into();
    }
    v
}

/// The webhook's router.
pub fn router(webhook: Arc<Webhook>) -> Router {
    Router::new()
        .route(MUTATE_PODS_PATH, post(mutate_pods))
        .route("/healthz", axum::routing::get(|| async { "ok" }))
        .with_state(webhook)
}
