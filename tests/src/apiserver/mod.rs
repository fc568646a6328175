//! An in-process fake Kubernetes API server that speaks real Kubernetes JSON: list and watch
//! (with resourceVersion replay), get, create, replace (optimistic concurrency on
//! `resourceVersion`), merge patch (with the UID precondition), delete, `pods/binding`, for
//! Nodes, Pods, core/v1 Events (list, watch, create), Secrets, coordination.k8s.io Leases,
//! MutatingWebhookConfigurations and Tessera's custom resources (with their status
//! subresource). Pods created over HTTP go through the stored mutating webhooks first
//! (its `admission` module). Objects are stored as JSON and typed at the test-facing edge with
//! k8s-openapi, so kube-rs clients run against it unchanged.
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! let api = tessera_tests::apiserver::FakeApiServer::start().await?;
//! let client = api.client()?;
//! # Ok(()) }
//! ```

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use futures_util::StreamExt as _;
use k8s_openapi::api::core::v1::{Node, Pod};
use serde_json::{Value, json};
use tokio::sync::broadcast;

/// A kind the fake serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// core/v1 Node (cluster-scoped).
    Node,
    /// core/v1 Pod.
    Pod,
    /// core/v1 Namespace (cluster-scoped).
    Namespace,
    /// coordination.k8s.io/v1 Lease.
    Lease,
    /// core/v1 Event.
    Event,
    /// core/v1 Secret.
    Secret,
    /// admissionregistration.k8s.io/v1 MutatingWebhookConfiguration (cluster-scoped).
    MutatingWebhookConfiguration,
    /// tessera.io/v1alpha1 ElasticGPU (cluster-scoped, status subresource).
    ElasticGpu,
    /// tessera.io/v1alpha1 ElasticGPUClaim (status subresource).
    ElasticGpuClaim,
    /// tessera.io/v1alpha1 ElasticGPUClass (cluster-scoped).
    ElasticGpuClass,
    /// resource.k8s.io/v1 ResourceSlice (cluster-scoped).
    ResourceSlice,
    /// resource.k8s.io/v1 ResourceClaim.
    ResourceClaim,
}

/// Every kind served under `/apis/` or generically: (kind, group/version, plural).
const GENERIC: &[(Kind, &str, &str)] = &[
    (Kind::Lease, "coordination.k8s.io/v1", "leases"),
    (Kind::Secret, "v1", "secrets"),
    (
        Kind::MutatingWebhookConfiguration,
        "admissionregistration.k8s.io/v1",
        "mutatingwebhookconfigurations",
    ),
    (Kind::ElasticGpu, "tessera.io/v1alpha1", "elasticgpus"),
    (Kind::ElasticGpuClaim, "tessera.io/v1alpha1", "elasticgpuclaims"),
    (Kind::ElasticGpuClass, "tessera.io/v1alpha1", "elasticgpuclasses"),
    (Kind::ResourceSlice, "resource.k8s.io/v1", "resourceslices"),
    (Kind::ResourceClaim, "resource.k8s.io/v1", "resourceclaims"),
];

impl Kind {
    fn api_version(self) -> &'static str {
        match self {
            Kind::Node | Kind::Pod | Kind::Namespace | Kind::Event => "v1",
            k => GENERIC.iter().find(|g| g.0 == k).map(|g| g.1).expect("listed"),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Node => "Node",
            Kind::Pod => "Pod",
            Kind::Namespace => "Namespace",
            Kind::Lease => "Lease",
            Kind::Event => "Event",
            Kind::Secret => "Secret",
            Kind::MutatingWebhookConfiguration => "MutatingWebhookConfiguration",
            Kind::ElasticGpu => "ElasticGPU",
            Kind::ElasticGpuClaim => "ElasticGPUClaim",
            Kind::ElasticGpuClass => "ElasticGPUClass",
            Kind::ResourceSlice => "ResourceSlice",
            Kind::ResourceClaim => "ResourceClaim",
        }
    }

    /// Cluster-scoped kinds live under the empty namespace.
    fn namespaced(self) -> bool {
        !matches!(
            self,
            Kind::Node
                | Kind::Namespace
                | Kind::MutatingWebhookConfiguration
                | Kind::ElasticGpu
                | Kind::ElasticGpuClass
                | Kind::ResourceSlice
        )
    }

    /// Kinds whose status is written only through `/status` (and spec only without it).
    fn has_status(self) -> bool {
        matches!(self, Kind::ElasticGpu | Kind::ElasticGpuClaim)
    }
}

mod admission;
mod generic;

type Key = (Kind, String, String);

#[derive(Clone, Debug)]
struct WatchEvent {
    kind: Kind,
    rv: u64,
    kind_of_event: &'static str,
    object: Value,
}

#[derive(Default)]
struct Store {
    objects: BTreeMap<Key, Value>,
    log: Vec<WatchEvent>,
    rv: u64,
}

/// Counters and fault injection, visible to tests.
#[derive(Default)]
pub struct Faults {
    /// Fail this many upcoming binding requests with a 500.
    pub fail_bindings: AtomicU64,
    /// Delay every binding by this many milliseconds.
    pub binding_delay_ms: AtomicU64,
    /// Bindings that succeeded.
    pub bindings: AtomicU64,
    /// Store ResourceSlices without their devices' taints, as an API server with device taints
    /// off does.
    pub drop_device_taints: std::sync::atomic::AtomicBool,
    /// Delay every list of namespaces by this many milliseconds (a slow list: what is listed
    /// is read once the delay is over).
    pub namespace_list_delay_ms: AtomicU64,
}

struct Inner {
    store: Mutex<Store>,
    events: broadcast::Sender<WatchEvent>,
    uid: AtomicU64,
    faults: Faults,
}

/// The running fake API server.
pub struct FakeApiServer {
    addr: SocketAddr,
    inner: Arc<Inner>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A Kubernetes `Status` failure.
struct ApiError {
    code: StatusCode,
    reason: &'static str,
    message: String,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code.as_u16(),
        });
        (
            self.code,
            [(header::CONTENT_TYPE, "application/json")],
            body.to_string(),
        )
            .into_response()
    }
}

fn status(code: StatusCode, reason: &'static str, message: impl Into<String>) -> ApiError {
    ApiError {
        code,
        reason,
        message: message.into(),
    }
}

fn ok_json(code: StatusCode, v: &Value) -> Response {
    (code, [(header::CONTENT_TYPE, "application/json")], v.to_string()).into_response()
}

/// RFC 7386 JSON merge patch.
fn merge_patch(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(p) => {
            if !target.is_object() {
                *target = Value::Object(Default::default());
            }
            let t = target.as_object_mut().expect("object");
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        other => *target = other.clone(),
    }
}

fn meta_str<'a>(v: &'a Value, field: &str) -> Option<&'a str> {
    v.get("metadata").and_then(|m| m.get(field)).and_then(Value::as_str)
}

impl Inner {
    fn commit(&self, s: &mut Store, kind: Kind, ns: &str, name: &str, mut obj: Value, event: &'static str) -> Value {
        s.rv += 1;
        if kind == Kind::ResourceSlice && self.faults.drop_device_taints.load(Ordering::Relaxed) {
            for d in obj["spec"]["devices"].as_array_mut().into_iter().flatten() {
                d.as_object_mut().map(|d| d.remove("taints"));
            }
        }
        obj["apiVersion"] = json!(kind.api_version());
        obj["kind"] = json!(kind.name());
        obj["metadata"]["resourceVersion"] = json!(s.rv.to_string());
        let key = (kind, ns.to_string(), name.to_string());
        if event == "DELETED" {
            s.objects.remove(&key);
        } else {
            s.objects.insert(key, obj.clone());
        }
        let ev = WatchEvent {
            kind,
            rv: s.rv,
            kind_of_event: event,
            object: obj.clone(),
        };
        s.log.push(ev.clone());
        let _ = self.events.send(ev);
        obj
    }

    fn create(&self, kind: Kind, ns: &str, mut obj: Value) -> Result<Value, ApiError> {
        let name = meta_str(&obj, "name")
            .ok_or_else(|| {
                status(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "Invalid",
                    "metadata.name: Required value",
                )
            })?
            .to_string();
        let mut s = self.store.lock().unwrap();
        if s.objects.contains_key(&(kind, ns.to_string(), name.clone())) {
            return Err(status(
                StatusCode::CONFLICT,
                "AlreadyExists",
                format!("{} {name:?} already exists", kind.name()),
            ));
        }
        if !obj["metadata"].get("uid").is_some_and(Value::is_string) {
            obj["metadata"]["uid"] = json!(format!("uid-{:08}", self.uid.fetch_add(1, Ordering::Relaxed)));
        }
        if kind.namespaced() {
            obj["metadata"]["namespace"] = json!(ns);
        }
        obj["metadata"]["creationTimestamp"] = json!("2026-01-01T00:00:00Z");
        Ok(self.commit(&mut s, kind, ns, &name, obj, "ADDED"))
    }

    fn update(
        &self,
        kind: Kind,
        ns: &str,
        name: &str,
        f: impl FnOnce(&mut Value) -> Result<(), ApiError>,
    ) -> Result<Value, ApiError> {
        let mut s = self.store.lock().unwrap();
        let key = (kind, ns.to_string(), name.to_string());
        let Some(mut obj) = s.objects.get(&key).cloned() else {
            return Err(status(
                StatusCode::NOT_FOUND,
                "NotFound",
                format!("{} {name:?} not found", kind.name().to_lowercase()),
            ));
        };
        let uid = meta_str(&obj, "uid").map(str::to_string);
        f(&mut obj)?;
        if meta_str(&obj, "uid").map(str::to_string) != uid {
            return Err(status(
                StatusCode::CONFLICT,
                "Conflict",
                format!(
                    "Precondition failed: UID in precondition: {:?}, UID in object meta: {uid:?}",
                    meta_str(&obj, "uid")
                ),
            ));
        }
        Ok(self.commit(&mut s, kind, ns, name, obj, "MODIFIED"))
    }

    fn delete(&self, kind: Kind, ns: &str, name: &str) -> Result<Value, ApiError> {
        let mut s = self.store.lock().unwrap();
        let Some(obj) = s.objects.get(&(kind, ns.to_string(), name.to_string())).cloned() else {
            return Err(status(StatusCode::NOT_FOUND, "NotFound", format!("{name:?} not found")));
        };
        Ok(self.commit(&mut s, kind, ns, name, obj, "DELETED"))
    }

    fn get(&self, kind: Kind, ns: &str, name: &str) -> Option<Value> {
        self.store
            .lock()
            .unwrap()
            .objects
            .get(&(kind, ns.to_string(), name.to_string()))
            .cloned()
    }
}

/// Query parameters of list and watch.
#[derive(serde::Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct ListQuery {
    watch: Option<String>,
    resource_version: Option<String>,
    /// Page size (lists page as a real API server's do when asked).
    limit: Option<usize>,
    /// Where the previous page ended (an offset into the name-ordered list).
    #[serde(rename = "continue")]
    continue_: Option<String>,
}

async fn list_or_watch(inner: Arc<Inner>, kind: Kind, ns: Option<String>, q: ListQuery) -> Response {
    let in_ns = move |ev_ns: &str| ns.as_deref().is_none_or(|n| n == ev_ns);
    let watching = q.watch.as_deref().is_some_and(|w| w == "true" || w == "1");
    if !watching {
        let delay = inner.faults.namespace_list_delay_ms.load(Ordering::Relaxed);
        if kind == Kind::Namespace && delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        let s = inner.store.lock().unwrap();
        let mut keys: Vec<&(Kind, String, String)> =
            s.objects.keys().filter(|(k, ns, _)| *k == kind && in_ns(ns)).collect();
        keys.sort_by(|a, b| (&a.1, &a.2).cmp(&(&b.1, &b.2)));
        let from: usize = q.continue_.as_deref().and_then(|c| c.parse().ok()).unwrap_or(0);
        let to = q
            .limit
            .filter(|l| *l > 0)
            .map_or(keys.len(), |l| (from + l).min(keys.len()));
        let items: Vec<Value> = keys[from.min(to)..to].iter().map(|k| s.objects[*k].clone()).collect();
        let mut meta = json!({"resourceVersion": s.rv.to_string()});
        if to < keys.len() {
            meta["continue"] = json!(to.to_string());
        }
        return ok_json(
            StatusCode::OK,
            &json!({
                "apiVersion": kind.api_version(),
                "kind": format!("{}List", kind.name()),
                "metadata": meta,
                "items": items,
            }),
        );
    }
    let since: u64 = q.resource_version.as_deref().and_then(|v| v.parse().ok()).unwrap_or(0);
    // Replay and subscribe under the lock, so no event falls in between.
    let (backlog, rx) = {
        let s = inner.store.lock().unwrap();
        let backlog: Vec<WatchEvent> = s
            .log
            .iter()
            .filter(|e| e.kind == kind && e.rv > since)
            .cloned()
            .collect();
        (backlog, inner.events.subscribe())
    };
    let in_ns = Arc::new(in_ns);
    let live = tokio_stream::wrappers::BroadcastStream::new(rx)
        .take_while(|r| std::future::ready(r.is_ok()))
        .filter_map(|r| std::future::ready(r.ok()));
    let stream = futures_util::stream::iter(backlog)
        .chain(live)
        .filter(move |e| {
            let ns = meta_str(&e.object, "namespace").unwrap_or_default().to_string();
            std::future::ready(e.kind == kind && e.rv > since && in_ns(&ns))
        })
        .map(|e| {
            let line = json!({"type": e.kind_of_event, "object": e.object}).to_string() + "\n";
            Ok::<_, Infallible>(Bytes::from(line))
        });
    ([(header::CONTENT_TYPE, "application/json")], Body::from_stream(stream)).into_response()
}

fn parse_body(body: &Bytes) -> Result<Value, ApiError> {
    serde_json::from_slice(body).map_err(|e| status(StatusCode::BAD_REQUEST, "BadRequest", e.to_string()))
}

fn patch_fn(headers: &HeaderMap, body: &Bytes) -> Result<impl FnOnce(&mut Value) -> Result<(), ApiError>, ApiError> {
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    if !(ct.starts_with("application/merge-patch+json") || ct.starts_with("application/strategic-merge-patch+json")) {
        return Err(status(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "UnsupportedMediaType",
            format!("the fake supports merge patches only, not {ct:?}"),
        ));
    }
    let patch = parse_body(body)?;
    Ok(move |obj: &mut Value| {
        merge_patch(obj, &patch);
        Ok(())
    })
}

fn replace_fn(body: &Bytes) -> Result<impl FnOnce(&mut Value) -> Result<(), ApiError>, ApiError> {
    let new = parse_body(body)?;
    Ok(move |obj: &mut Value| {
        if let Some(rv) = meta_str(&new, "resourceVersion")
            && Some(rv) != meta_str(obj, "resourceVersion")
        {
            return Err(status(
                StatusCode::CONFLICT,
                "Conflict",
                "Operation cannot be fulfilled: the object has been modified; please apply your changes to the latest version and try again",
            ));
        }
        let uid = obj["metadata"]["uid"].clone();
        let created = obj["metadata"]["creationTimestamp"].clone();
        *obj = new;
        obj["metadata"]["uid"] = uid;
        obj["metadata"]["creationTimestamp"] = created;
        Ok(())
    })
}

fn respond(r: Result<Value, ApiError>, code: StatusCode) -> Response {
    match r {
        Ok(v) => ok_json(code, &v),
        Err(e) => e.into_response(),
    }
}

async fn bind_pod(inner: Arc<Inner>, ns: String, name: String, body: Bytes) -> Response {
    let binding = match parse_body(&body) {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let delay = inner.faults.binding_delay_ms.load(Ordering::Relaxed);
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    if inner
        .faults
        .fail_bindings
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
    {
        return status(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalError",
            "injected binding failure",
        )
        .into_response();
    }
    let Some(target) = binding["target"]["name"].as_str().map(str::to_string) else {
        return status(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid",
            "target.name: Required value",
        )
        .into_response();
    };
    let want_uid = meta_str(&binding, "uid").map(str::to_string);
    let r = inner.update(Kind::Pod, &ns, &name, |pod| {
        if let Some(u) = &want_uid
            && meta_str(pod, "uid") != Some(u.as_str())
        {
            return Err(status(
                StatusCode::CONFLICT,
                "Conflict",
                "Precondition failed: UID mismatch",
            ));
        }
        if let Some(n) = pod["spec"]["nodeName"].as_str().filter(|n| !n.is_empty()) {
            return Err(status(
                StatusCode::CONFLICT,
                "Conflict",
                format!("pod {name} is already assigned to node {n:?}"),
            ));
        }
        pod["spec"]["nodeName"] = json!(target);
        Ok(())
    });
    match r {
        Ok(_) => {
            inner.faults.bindings.fetch_add(1, Ordering::Relaxed);
            ok_json(
                StatusCode::CREATED,
                &json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}),
            )
        }
        Err(e) => e.into_response(),
    }
}

type S = State<Arc<Inner>>;

/// List, watch and create of a cluster-scoped core kind.
fn cluster_collection(kind: Kind) -> axum::routing::MethodRouter<Arc<Inner>> {
    get(move |State(i): S, Query(q): Query<ListQuery>| list_or_watch(i, kind, None, q)).post(
        move |State(i): S, b: Bytes| async move {
            respond(parse_body(&b).and_then(|v| i.create(kind, "", v)), StatusCode::CREATED)
        },
    )
}

/// Get, replace, patch and delete of one object of a cluster-scoped core kind.
fn cluster_item(kind: Kind) -> axum::routing::MethodRouter<Arc<Inner>> {
    get(move |State(i): S, Path(n): Path<String>| async move {
        respond(
            i.get(kind, "", &n).ok_or_else(|| {
                status(
                    StatusCode::NOT_FOUND,
                    "NotFound",
                    format!("{} {n:?} not found", kind.name().to_lowercase()),
                )
            }),
            StatusCode::OK,
        )
    })
    .put(move |State(i): S, Path(n): Path<String>, b: Bytes| async move {
        respond(replace_fn(&b).and_then(|f| i.update(kind, "", &n, f)), StatusCode::OK)
    })
    .patch(
        move |State(i): S, Path(n): Path<String>, h: HeaderMap, b: Bytes| async move {
            respond(patch_fn(&h, &b).and_then(|f| i.update(kind, "", &n, f)), StatusCode::OK)
        },
    )
    .delete(move |State(i): S, Path(n): Path<String>| async move { respond(i.delete(kind, "", &n), StatusCode::OK) })
}

fn router(inner: Arc<Inner>) -> Router {
    Router::new()
        .route("/api/v1/nodes", cluster_collection(Kind::Node))
        .route("/api/v1/nodes/{name}", cluster_item(Kind::Node))
        .route("/api/v1/namespaces", cluster_collection(Kind::Namespace))
        // `{ns}`: the path parameter's name is shared with the namespaced routes below.
        .route("/api/v1/namespaces/{ns}", cluster_item(Kind::Namespace))
        .route(
            "/api/v1/pods",
            get(|State(i): S, Query(q): Query<ListQuery>| list_or_watch(i, Kind::Pod, None, q)),
        )
        .route(
            "/api/v1/namespaces/{ns}/pods",
            get(|State(i): S, Path(ns): Path<String>, Query(q): Query<ListQuery>| {
                list_or_watch(i, Kind::Pod, Some(ns), q)
            })
            .post(|State(i): S, Path(ns): Path<String>, b: Bytes| async move {
                let admitted = match parse_body(&b) {
                    Ok(v) => admission::admit_pod(&i, &ns, v).await,
                    Err(e) => Err(e),
                };
                respond(admitted.and_then(|v| i.create(Kind::Pod, &ns, v)), StatusCode::CREATED)
            }),
        )
        .route(
            "/api/v1/namespaces/{ns}/pods/{name}",
            get(|State(i): S, Path((ns, n)): Path<(String, String)>| async move {
                respond(
                    i.get(Kind::Pod, &ns, &n)
                        .ok_or_else(|| status(StatusCode::NOT_FOUND, "NotFound", format!("pods {n:?} not found"))),
                    StatusCode::OK,
                )
            })
            .patch(
                |State(i): S, Path((ns, n)): Path<(String, String)>, h: HeaderMap, b: Bytes| async move {
                    respond(
                        patch_fn(&h, &b).and_then(|f| i.update(Kind::Pod, &ns, &n, f)),
                        StatusCode::OK,
                    )
                },
            )
            .put(
                |State(i): S, Path((ns, n)): Path<(String, String)>, b: Bytes| async move {
                    respond(
                        replace_fn(&b).and_then(|f| i.update(Kind::Pod, &ns, &n, f)),
                        StatusCode::OK,
                    )
                },
            )
            .delete(|State(i): S, Path((ns, n)): Path<(String, String)>| async move {
                respond(i.delete(Kind::Pod, &ns, &n), StatusCode::OK)
            }),
        )
        .route(
            "/api/v1/namespaces/{ns}/pods/{name}/binding",
            axum::routing::post(|State(i): S, Path((ns, n)): Path<(String, String)>, b: Bytes| bind_pod(i, ns, n, b)),
        )
        .route(
            "/api/v1/events",
            get(|State(i): S, Query(q): Query<ListQuery>| list_or_watch(i, Kind::Event, None, q)),
        )
        .route(
            "/api/v1/namespaces/{ns}/events",
            get(|State(i): S, Path(ns): Path<String>, Query(q): Query<ListQuery>| {
                list_or_watch(i, Kind::Event, Some(ns), q)
            })
            .post(|State(i): S, Path(ns): Path<String>, b: Bytes| async move {
                respond(
                    parse_body(&b).and_then(|v| i.create(Kind::Event, &ns, v)),
                    StatusCode::CREATED,
                )
            }),
        )
        .route("/apis/{*rest}", any(generic::serve))
        .route("/api/v1/namespaces/{ns}/secrets", any(generic::serve_secrets))
        .route("/api/v1/namespaces/{ns}/secrets/{name}", any(generic::serve_secrets))
        .fallback(|uri: axum::http::Uri| async move {
            status(
                StatusCode::NOT_FOUND,
                "NotFound",
                format!("the fake API server does not serve {uri}"),
            )
        })
        .with_state(inner)
}

impl FakeApiServer {
    /// Starts on a free localhost port.
    pub async fn start() -> anyhow::Result<Self> {
        let inner = Arc::new(Inner {
            store: Mutex::new(Store::default()),
            events: broadcast::channel(1 << 16).0,
            uid: AtomicU64::new(1),
            faults: Faults::default(),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let app = router(inner.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self { addr, inner, task })
    }

    /// The base URL.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A kube client for this server.
    pub fn client(&self) -> anyhow::Result<kube::Client> {
        tessera_extender::service::install_crypto_provider();
        let cfg = kube::Config::new(self.url().parse()?);
        Ok(kube::Client::try_from(cfg)?)
    }

    /// Fault injection and counters.
    pub fn faults(&self) -> &Faults {
        &self.inner.faults
    }

    /// Creates a node.
    pub fn create_node(&self, node: &Node) -> anyhow::Result<Node> {
        let v = self
            .inner
            .create(Kind::Node, "", serde_json::to_value(node)?)
            .map_err(|_| anyhow::anyhow!("node exists"))?;
        Ok(serde_json::from_value(v)?)
    }

    /// Creates a pod (a UID is assigned when it has none).
    pub fn create_pod(&self, pod: &Pod) -> anyhow::Result<Pod> {
        let ns = pod.metadata.namespace.clone().unwrap_or_else(|| "default".into());
        let v = self
            .inner
            .create(Kind::Pod, &ns, serde_json::to_value(pod)?)
            .map_err(|_| anyhow::anyhow!("pod exists"))?;
        Ok(serde_json::from_value(v)?)
    }

    /// A pod, if it exists.
    pub fn pod(&self, ns: &str, name: &str) -> Option<Pod> {
        self.inner
            .get(Kind::Pod, ns, name)
            .map(|v| serde_json::from_value(v).expect("stored pods are pods"))
    }

    /// Every pod.
    pub fn pods(&self) -> Vec<Pod> {
        let s = self.inner.store.lock().unwrap();
        s.objects
            .iter()
            .filter(|((k, _, _), _)| *k == Kind::Pod)
            .map(|(_, v)| serde_json::from_value(v.clone()).expect("stored pods are pods"))
            .collect()
    }

    /// Deletes a pod (it disappears at once, as after its grace period).
    pub fn delete_pod(&self, ns: &str, name: &str) -> bool {
        self.inner.delete(Kind::Pod, ns, name).is_ok()
    }

    /// Sets a pod's `status.phase`.
    pub fn set_pod_phase(&self, ns: &str, name: &str, phase: &str) -> bool {
        self.inner
            .update(Kind::Pod, ns, name, |p| {
                p["status"]["phase"] = json!(phase);
                Ok(())
            })
            .is_ok()
    }

    /// Applies a merge patch to a pod (as `kubectl annotate --overwrite` would).
    pub fn patch_pod(&self, ns: &str, name: &str, patch: &Value) -> bool {
        self.inner
            .update(Kind::Pod, ns, name, |p| {
                merge_patch(p, patch);
                Ok(())
            })
            .is_ok()
    }

    /// Applies a merge patch to a node.
    pub fn patch_node(&self, name: &str, patch: &Value) -> bool {
        self.inner
            .update(Kind::Node, "", name, |n| {
                merge_patch(n, patch);
                Ok(())
            })
            .is_ok()
    }

    /// Every core/v1 Event, in name order.
    pub fn events(&self) -> Vec<k8s_openapi::api::core::v1::Event> {
        let s = self.inner.store.lock().unwrap();
        s.objects
            .iter()
            .filter(|((k, _, _), _)| *k == Kind::Event)
            .filter_map(|(_, v)| serde_json::from_value(v.clone()).ok())
            .collect()
    }

    /// Creates any object the fake serves (its kind and namespace from its own
    /// `kind`/`metadata.namespace`), status and all, as a controller's earlier writes would
    /// have left it.
    pub fn create_object(&self, obj: &Value) -> anyhow::Result<Value> {
        let kind = GENERIC
            .iter()
            .map(|g| g.0)
            .chain([Kind::Node, Kind::Pod, Kind::Namespace, Kind::Event])
            .find(|k| obj["kind"] == k.name())
            .ok_or_else(|| anyhow::anyhow!("the fake does not serve kind {}", obj["kind"]))?;
        let ns = if kind.namespaced() {
            meta_str(obj, "namespace").unwrap_or("default").to_string()
        } else {
            String::new()
        };
        self.inner
            .create(kind, &ns, obj.clone())
            .map_err(|e| anyhow::anyhow!("{}", e.message))
    }

    /// Every object of `kind` (as its `kind` field spells it), in namespace/name order.
    pub fn objects(&self, kind: &str) -> Vec<Value> {
        let s = self.inner.store.lock().unwrap();
        s.objects
            .iter()
            .filter(|((k, _, _), _)| k.name() == kind)
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// One object of `kind` by namespace ("" when cluster-scoped) and name.
    pub fn object(&self, kind: &str, ns: &str, name: &str) -> Option<Value> {
        let s = self.inner.store.lock().unwrap();
        s.objects
            .iter()
            .find(|((k, n, m), _)| k.name() == kind && n == ns && m == name)
            .map(|(_, v)| v.clone())
    }

    /// Deletes one object of `kind`; false when there was none.
    pub fn delete_object(&self, kind: &str, ns: &str, name: &str) -> bool {
        let Some(k) = GENERIC.iter().map(|g| g.0).find(|k| k.name() == kind) else {
            return false;
        };
        self.inner.delete(k, ns, name).is_ok()
    }

    /// The raw JSON of a Lease.
    pub fn lease(&self, ns: &str, name: &str) -> Option<Value> {
        self.inner.get(Kind::Lease, ns, name)
    }
}
