//! Building blocks for extender tests and benchmarks: GPU nodes as the cdi-generator publishes
//! them, GPU pods as users write them, and an extender running against the fake API server.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, Node, NodeSpec, NodeStatus, Pod, PodSpec, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::ObjectMeta;
use tessera_core::handoff::SigningKeys;
use tessera_core::inventory::{FixtureSource, InventorySource, PublishedInventory};
use tessera_core::names::ANNOTATION_INVENTORY;
use tessera_core::placement::EngineConfig;
use tessera_core::request::RequestOptions;
use tessera_extender::service::cluster::Cluster;
use tessera_extender::service::leader::LeaseConfig;
use tessera_extender::service::{self, Running, ServiceConfig};

use crate::apiserver::FakeApiServer;
use crate::http::JsonClient;

/// The URL prefix the tests serve the verbs under.
pub const PREFIX: &str = "/tessera";

/// The hand-off keys every test cluster uses.
pub fn keys() -> SigningKeys {
    SigningKeys::new("k1", [("k1".to_string(), vec![9u8; 32])]).expect("valid keys")
}

/// A node publishing the GPUs of a built-in fixture (`h100x8`, `a100-mig`, `t4x2`).
pub fn gpu_node(name: &str, fixture: &str) -> Node {
    let mut n = plain_node(name);
    if !fixture.is_empty() {
        let inv = FixtureSource {
            fixture: fixture.into(),
            driver_root: None,
        }
        .discover()
        .expect("built-in fixture");
        n.metadata.annotations = Some(BTreeMap::from([(
            ANNOTATION_INVENTORY.to_string(),
            PublishedInventory::of(&inv).encode(),
        )]));
    }
    n
}

/// A GPU node publishing how it enforces shares.
pub fn gpu_node_enforced(name: &str, fixture: &str, mode: tessera_core::enforcement::ShareEnforcement) -> Node {
    let inv = FixtureSource::new(fixture).discover().expect("built-in fixture");
    let mut n = plain_node(name);
    n.metadata.annotations = Some(BTreeMap::from([(
        ANNOTATION_INVENTORY.to_string(),
        PublishedInventory::of(&inv).enforced_by(mode).encode(),
    )]));
    n
}

/// A node without GPUs: 64 CPUs, 512 GiB.
pub fn plain_node(name: &str) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        spec: Some(NodeSpec::default()),
        status: Some(NodeStatus {
            allocatable: Some(BTreeMap::from([
                ("cpu".to_string(), Quantity("64".into())),
                ("memory".to_string(), Quantity("512Gi".into())),
                ("pods".to_string(), Quantity("110".into())),
            ])),
            ..Default::default()
        }),
    }
}

/// A pod with one container per entry of `containers`: `(name, [(resource, amount)])`.
pub fn pod(name: &str, containers: &[(&str, &[(&str, &str)])]) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("default".into()),
            ..Default::default()
        },
        spec: Some(PodSpec {
            scheduler_name: Some("tessera".into()),
            containers: containers
                .iter()
                .map(|(c, limits)| Container {
                    name: c.to_string(),
                    image: Some("busybox".into()),
                    resources: Some(ResourceRequirements {
                        limits: Some(
                            limits
                                .iter()
                                .map(|(k, v)| (k.to_string(), Quantity(v.to_string())))
                                .collect(),
                        ),
                        ..Default::default()
                    }),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }),
        status: None,
    }
}

/// A one-container pod asking for a share: `core` percent and `mem` GiB.
pub fn share_pod(name: &str, core: u32, mem: u32) -> Pod {
    pod(
        name,
        &[(
            "main",
            &[
                ("tessera.io/gpu-core", &core.to_string()),
                ("tessera.io/gpu-memory", &mem.to_string()),
            ],
        )],
    )
}

/// A namespace, labelled into tenant group `group` (`tessera.io/tenant`) where one is given.
pub fn tenant_namespace(name: &str, group: Option<&str>) -> serde_json::Value {
    let labels = group.map_or_else(
        || serde_json::json!({}),
        |g| serde_json::json!({ tessera_core::names::LABEL_TENANT: g }),
    );
    serde_json::json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}})
}

/// The pod as kube-scheduler embeds it: no apiVersion/kind.
pub fn scheduler_json(pod: &Pod) -> serde_json::Value {
    let mut v = serde_json::to_value(pod).expect("pods serialize");
    if let Some(o) = v.as_object_mut() {
        o.remove("apiVersion");
        o.remove("kind");
    }
    v
}

/// An extender replica on the fake API server.
pub struct Replica {
    /// The running service.
    pub running: Running,
    /// A client to it.
    pub http: JsonClient,
}

/// Options for [`start_replica`].
#[derive(Clone, Default)]
pub struct ReplicaOptions {
    /// Leader election identity; `None` runs without election.
    pub identity: Option<String>,
    /// Engine policies.
    pub engine: EngineConfig,
    /// Label the replica's pod (named as its identity, in `tessera-system`) with its role.
    pub label_pod: bool,
    /// Serve the claims' admission webhook (on a free localhost port).
    pub webhook: Option<tessera_extender::service::WebhookConfig>,
}

/// Starts an extender against `api` and waits until it has read the cluster.
pub async fn start_replica(api: &FakeApiServer, opts: ReplicaOptions) -> anyhow::Result<Replica> {
    let cluster = Arc::new(Cluster::new(opts.engine, keys(), RequestOptions::default()));
    let lease = opts.identity.map(|id| LeaseConfig {
        lease_duration: Duration::from_secs(2),
        renew_deadline: Duration::from_millis(1500),
        retry_period: Duration::from_millis(200),
        label_pod: opts.label_pod,
        ..LeaseConfig::new("tessera-system", "tessera-extender", &id)
    });
    let running = service::start(
        api.client()?,
        cluster.clone(),
        ServiceConfig {
            listen: "127.0.0.1:0".parse()?,
            prefix: PREFIX.into(),
            body_limit: 8 << 20,
            lease,
            tls: None,
            claims: true,
            webhook: opts.webhook.clone(),
            limits: Default::default(),
        },
    )
    .await?;
    let http = JsonClient::new(running.addr);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !cluster.synced() {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the extender did not sync within 20 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(Replica { running, http })
}

/// Waits until `f` holds (polling every 10 ms, up to `secs`).
pub async fn eventually(secs: u64, what: &str, mut f: impl FnMut() -> bool) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    while !f() {
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}
