//! The DRAPlugin service: prepares the claims the kubelet names (reading their allocation from
//! the API server) and unprepares them. Each prepared claim is recorded on the node before the
//! kubelet hears of it, so a plugin restart neither loses a prepared claim nor prepares one twice.

use std::path::PathBuf;
use std::sync::Arc;

use k8s_openapi::api::resource::v1::ResourceClaim;
use tessera_core::dra::{self, ClaimStore, PreparedClaim};
use tessera_core::inventory::NodeInventory;
use tessera_proto::dra as api;
use tessera_proto::dra::dra_plugin_server::DraPlugin;
use tokio::sync::{Mutex, watch};
use tonic::{Request, Response, Status};
use tracing::{info, warn};

/// Where claims are read from: the API server, or a test's fake.
#[tonic::async_trait]
pub trait ClaimSource: Send + Sync + 'static {
    /// The claim `namespace/name` as the API server has it now.
    async fn get(&self, namespace: &str, name: &str) -> Result<ResourceClaim, String>;

    /// The tenant namespace `namespace` belongs to: its `tessera.io/tenant` label, else itself.
    async fn tenant(&self, namespace: &str) -> Result<String, String> {
        Ok(namespace.to_string())
    }

    /// Whether node `node` lets one card's shares go to different tenants
    /// (`tessera.io/cross-tenant-sharing=true`).
    async fn cross_tenant(&self, _node: &str) -> Result<bool, String> {
        Ok(false)
    }
}

/// Claims read from the API server.
pub struct ApiClaims(pub kube::Client);

#[tonic::async_trait]
impl ClaimSource for ApiClaims {
    async fn get(&self, namespace: &str, name: &str) -> Result<ResourceClaim, String> {
        kube::Api::<ResourceClaim>::namespaced(self.0.clone(), namespace)
            .get(name)
            .await
            .map_err(|e| format!("reading claim {namespace}/{name}: {e}"))
    }

    async fn tenant(&self, namespace: &str) -> Result<String, String> {
        let ns = kube::Api::<k8s_openapi::api::core::v1::Namespace>::all(self.0.clone())
            .get(namespace)
            .await
            .map_err(|e| format!("reading namespace {namespace}: {e}"))?;
        Ok(ns
            .metadata
            .labels
            .and_then(|l| l.get(tessera_core::names::LABEL_TENANT).cloned())
            .unwrap_or_else(|| namespace.to_string()))
    }

    async fn cross_tenant(&self, node: &str) -> Result<bool, String> {
        let n = kube::Api::<k8s_openapi::api::core::v1::Node>::all(self.0.clone())
            .get(node)
            .await
            .map_err(|e| format!("reading node {node}: {e}"))?;
        Ok(n.metadata
            .labels
            .and_then(|l| l.get(tessera_core::names::LABEL_CROSS_TENANT_SHARING).cloned())
            .is_some_and(|v| v == "true"))
    }
}

/// Prepares and unprepares claims on one node.
pub struct Preparer {
    node: String,
    inventory: watch::Receiver<Option<Arc<NodeInventory>>>,
    store: ClaimStore,
    cdi_dir: PathBuf,
    claims: Arc<dyn ClaimSource>,
    /// One prepare or unprepare at a time: records and markers change together.
    busy: Mutex<()>,
}

impl Preparer {
    /// A preparer for node `node`, its cards from `inventory`, records in `store`, markers in
    /// `cdi_dir`.
    pub fn new(
        node: &str,
        inventory: watch::Receiver<Option<Arc<NodeInventory>>>,
        store: ClaimStore,
        cdi_dir: PathBuf,
        claims: Arc<dyn ClaimSource>,
    ) -> Self {
        Self {
            node: node.into(),
            inventory,
            store,
            cdi_dir,
            claims,
            busy: Mutex::new(()),
        }
    }

    fn write_marker(&self, uid: &str, token: &str) -> Result<(), String> {
        let spec = dra::marker_spec(uid, token);
        let text = serde_json::to_vec_pretty(&spec).map_err(|e| e.to_string())?;
        let path = self.cdi_dir.join(dra::marker_file(uid));
        dra::write_atomic(&self.cdi_dir, &path, &text, 0o755, 0o644)
            .map_err(|e| format!("writing {}: {e}", path.display()))
    }

    /// Prepares claim `claim` (idempotent: a claim already recorded is answered from its
    /// record, its marker written again if it went missing).
    pub async fn prepare(&self, claim: &api::Claim) -> Result<Vec<api::Device>, String> {
        let key = format!("{}/{}", claim.namespace, claim.name);
        if !dra::is_uid(&claim.uid) {
            return Err(format!("claim {key}: uid {:?} is not a uid", claim.uid));
        }
        let _one = self.busy.lock().await;
        if let Some(done) = self
            .store
            .get(&claim.uid)
            .map_err(|e| format!("claim {key}: its record cannot be read: {e}"))?
        {
            self.write_marker(&done.uid, &done.token)?;
            return Ok(devices_of(&done));
        }
        let inv = self
            .inventory
            .borrow()
            .clone()
            .ok_or_else(|| format!("claim {key}: the node's GPUs are not read yet"))?;
        let found = self.claims.get(&claim.namespace, &claim.name).await?;
        let mut prepared = dra::prepare(&inv, &self.node, &claim.uid, &found).map_err(|e| e.to_string())?;
        self.check_tenancy(&prepared).await?;
        prepared.token = dra::new_token();
        // The marker first, then the record: a crash between leaves a marker that names no
        // record (it grants nothing) and the kubelet's retry prepares the claim again.
        self.write_marker(&prepared.uid, &prepared.token)?;
        self.store
            .put(&prepared)
            .map_err(|e| format!("claim {key}: recording it under {}: {e}", self.store.dir().display()))?;
        info!(
            claim = key,
            uid = prepared.uid,
            devices = ?prepared.devices.iter().map(|d| d.device.as_str()).collect::<Vec<_>>(),
            "claim prepared"
        );
        Ok(devices_of(&prepared))
    }

    /// Refuses `claim` when a card it would share serves another tenant's shares here
    /// ([`dra::check_tenancy`]).
    async fn check_tenancy(&self, claim: &PreparedClaim) -> Result<(), String> {
        let shares = claim.devices.iter().any(|d| {
            matches!(
                d.allocated,
                tessera_core::handoff::AllocatedDevice::Gpu { exclusive: false, .. }
            )
        });
        if !shares || self.claims.cross_tenant(&self.node).await? {
            return Ok(());
        }
        let mut tenants: std::collections::HashMap<String, String> = std::collections::HashMap::new();
        let mut tenant_of = async |namespace: &str| -> Result<String, String> {
            if let Some(t) = tenants.get(namespace) {
                return Ok(t.clone());
            }
            let t = self.claims.tenant(namespace).await?;
            tenants.insert(namespace.to_string(), t.clone());
            Ok(t)
        };
        let tenant = tenant_of(&claim.namespace).await?;
        // A record that cannot be read may be another tenant's share: refuse rather than guess.
        let (records, unreadable) = self.store.list();
        if !unreadable.is_empty() {
            return Err(format!(
                "claim {}: the node's claim records cannot all be read, so the card's tenants are unknown: {}",
                claim.key(),
                unreadable.join("; ")
            ));
        }
        let mut others = Vec::new();
        for other in records {
            let t = tenant_of(&other.namespace).await?;
            others.push((other, t));
        }
        dra::check_tenancy(claim, &tenant, &others, false)
    }

    /// Unprepares claim `uid`: its record and marker go (idempotent).
    pub async fn unprepare(&self, uid: &str) -> Result<(), String> {
        if !dra::is_uid(uid) {
            return Err(format!("claim uid {uid:?} is not a uid"));
        }
        let _one = self.busy.lock().await;
        let marker = self.cdi_dir.join(dra::marker_file(uid));
        match std::fs::remove_file(&marker) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(format!("removing {}: {e}", marker.display()));
            }
            _ => {}
        }
        self.store
            .remove(uid)
            .map_err(|e| format!("removing claim {uid}'s record: {e}"))?;
        info!(uid, "claim unprepared");
        Ok(())
    }

    /// Removes markers that name no record (left by a crash in the middle of a prepare).
    pub fn clean_orphan_markers(&self) {
        let Ok(entries) = std::fs::read_dir(&self.cdi_dir) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(uid) = name
                .strip_prefix("tessera.io-claim-")
                .and_then(|n| n.strip_suffix(".json"))
            else {
                continue;
            };
            if matches!(self.store.get(uid), Ok(None)) {
                match std::fs::remove_file(e.path()) {
                    Ok(()) => info!(uid, "marker of an unfinished prepare removed"),
                    Err(err) => warn!(uid, error = %err, "cannot remove an orphan marker"),
                }
            }
        }
    }
}

/// The kubelet's view of a prepared claim: each device with the claim's marker.
fn devices_of(claim: &PreparedClaim) -> Vec<api::Device> {
    claim
        .devices
        .iter()
        .map(|d| api::Device {
            request_names: d.requests.clone(),
            pool_name: d.pool.clone(),
            device_name: d.device.clone(),
            cdi_device_ids: vec![dra::marker_device(&claim.uid)],
            share_id: d.share_id.clone(),
        })
        .collect()
}

/// The gRPC face of a [`Preparer`].
pub struct DraService(pub Arc<Preparer>);

#[tonic::async_trait]
impl DraPlugin for DraService {
    async fn node_prepare_resources(
        &self,
        request: Request<api::NodePrepareResourcesRequest>,
    ) -> Result<Response<api::NodePrepareResourcesResponse>, Status> {
        let mut claims = std::collections::HashMap::new();
        for c in request.into_inner().claims {
            let answer = match self.0.prepare(&c).await {
                Ok(devices) => api::NodePrepareResourceResponse {
                    devices,
                    error: String::new(),
                },
                Err(error) => {
                    warn!(
                        claim = format!("{}/{}", c.namespace, c.name),
                        uid = c.uid,
                        error,
                        "cannot prepare"
                    );
                    api::NodePrepareResourceResponse { devices: vec![], error }
                }
            };
            claims.insert(c.uid, answer);
        }
        Ok(Response::new(api::NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<api::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<api::NodeUnprepareResourcesResponse>, Status> {
        let mut claims = std::collections::HashMap::new();
        for c in request.into_inner().claims {
            let error = self.0.unprepare(&c.uid).await.err().unwrap_or_default();
            claims.insert(c.uid, api::NodeUnprepareResourceResponse { error });
        }
        Ok(Response::new(api::NodeUnprepareResourcesResponse { claims }))
    }
}
