//! Mutating admission of pods, as the API server does it: each MutatingWebhookConfiguration in
//! the store whose rules take pod CREATE is called over HTTPS (`clientConfig.url`, trusting only
//! its `caBundle`) with an `admission.k8s.io/v1` AdmissionReview; a JSONPatch in the reply is
//! applied, a denial is the request's error, and an unreachable webhook fails the request unless
//! its `failurePolicy` is `Ignore`. Namespace selectors are read for the
//! `kubernetes.io/metadata.name` label only; `matchConditions` (CEL) are not evaluated, so the
//! webhook sees every pod.

use std::time::Duration;

use axum::http::StatusCode;
use base64::Engine as _;
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject as _;
use serde_json::{Value, json};

use super::{ApiError, Inner, Kind, status};

fn names(v: &Value) -> Vec<&str> {
    v.as_array().into_iter().flatten().filter_map(Value::as_str).collect()
}

/// Whether `hook` takes a pod CREATE in namespace `ns`.
fn takes_pod_create(hook: &Value, ns: &str) -> bool {
    let rule_takes = |r: &Value| {
        let has = |field: &str, want: &str| names(&r[field]).iter().any(|x| *x == want || *x == "*");
        has("operations", "CREATE") && has("apiGroups", "") && has("resources", "pods")
    };
    let ns_ok = hook["namespaceSelector"]["matchExpressions"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["key"] == "kubernetes.io/metadata.name")
        .all(|e| {
            let listed = names(&e["values"]).contains(&ns);
            match e["operator"].as_str() {
                Some("In") => listed,
                Some("NotIn") => !listed,
                _ => true,
            }
        });
    ns_ok && hook["rules"].as_array().into_iter().flatten().any(rule_takes)
}

/// What a webhook said.
enum Verdict {
    Allowed(Option<json_patch::Patch>),
    Denied(u16, String),
}

async fn call(hook: &Value, ns: &str, pod: &Value) -> anyhow::Result<Verdict> {
    let url = hook["clientConfig"]["url"]
        .as_str()
        .ok_or_else(|| anyhow::anyhow!("the fake calls webhooks by clientConfig.url only"))?;
    let bundle = base64::engine::general_purpose::STANDARD
        .decode(hook["clientConfig"]["caBundle"].as_str().unwrap_or_default())?;
    let roots = CertificateDer::pem_slice_iter(&bundle)
        .map(|c| c.map(|c| c.to_vec()))
        .collect::<Result<Vec<_>, _>>()?;
    anyhow::ensure!(!roots.is_empty(), "clientConfig.caBundle holds no certificate");
    let parsed: axum::http::Uri = url.parse()?;
    let base = format!(
        "{}://{}",
        parsed.scheme_str().unwrap_or("https"),
        parsed.authority().map_or("", |a| a.as_str())
    );
    let mut cfg = kube::Config::new(base.parse()?);
    cfg.root_cert = Some(roots);
    let client = kube::Client::try_from(cfg)?;
    let review = json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": format!("review-{}", pod["metadata"]["name"].as_str().unwrap_or_default()),
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "name": pod["metadata"]["name"],
            "namespace": ns,
            "operation": "CREATE",
            "userInfo": {"username": "fake-apiserver-test"},
            "object": pod,
            "oldObject": null,
            "dryRun": false,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        }
    });
    let req = axum::http::Request::post(parsed.path_and_query().map_or("/", |p| p.as_str()))
        .header("content-type", "application/json")
        .body(serde_json::to_vec(&review)?)?;
    let timeout = Duration::from_secs(hook["timeoutSeconds"].as_u64().unwrap_or(10));
    let reply: Value = tokio::time::timeout(timeout, client.request(req)).await??;
    let resp = &reply["response"];
    anyhow::ensure!(
        resp["uid"] == review["request"]["uid"],
        "the reply's response.uid {} is not the request's",
        resp["uid"]
    );
    if resp["allowed"] != true {
        let code = resp["status"]["code"]
            .as_u64()
            .and_then(|c| u16::try_from(c).ok())
            .unwrap_or(400);
        let msg = resp["status"]["message"].as_str().unwrap_or_default().to_string();
        return Ok(Verdict::Denied(code, msg));
    }
    let patch = match resp["patch"].as_str() {
        None => None,
        Some(p) => {
            anyhow::ensure!(
                resp["patchType"] == "JSONPatch",
                "patchType {} is not JSONPatch",
                resp["patchType"]
            );
            Some(serde_json::from_slice(
                &base64::engine::general_purpose::STANDARD.decode(p)?,
            )?)
        }
    };
    Ok(Verdict::Allowed(patch))
}

/// Runs the pod through every mutating webhook that takes it; the pod to store, or why not.
pub(super) async fn admit_pod(inner: &Inner, ns: &str, mut pod: Value) -> Result<Value, ApiError> {
    let hooks: Vec<Value> = {
        let s = inner.store.lock().unwrap();
        s.objects
            .iter()
            .filter(|((k, _, _), _)| *k == Kind::MutatingWebhookConfiguration)
            .flat_map(|(_, v)| v["webhooks"].as_array().cloned().unwrap_or_default())
            .collect()
    };
    for hook in hooks.iter().filter(|h| takes_pod_create(h, ns)) {
        let name = hook["name"].as_str().unwrap_or_default();
        match call(hook, ns, &pod).await {
            Ok(Verdict::Allowed(None)) => {}
            Ok(Verdict::Allowed(Some(patch))) => json_patch::patch(&mut pod, &patch).map_err(|e| {
                status(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "InternalError",
                    format!("Internal error occurred: webhook {name:?} returned a patch that does not apply: {e}"),
                )
            })?,
            Ok(Verdict::Denied(code, msg)) => {
                return Err(status(
                    StatusCode::from_u16(code).unwrap_or(StatusCode::BAD_REQUEST),
                    "BadRequest",
                    format!("admission webhook {name:?} denied the request: {msg}"),
                ));
            }
            Err(_) if hook["failurePolicy"] == "Ignore" => {}
            Err(e) => {
                return Err(status(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "InternalError",
                    format!("Internal error occurred: failed calling webhook {name:?}: {e:#}"),
                ));
            }
        }
    }
    Ok(pod)
}
