//! The DRAPlugin service: prepares the claims the kubelet names (reading their allocation from
//! the API server) and unprepares them. Each prepared claim is recorded on the node before the
//! kubelet hears of it, so a plugin restart neither loses a prepared claim nor prepares one twice.

use std::path::PathBuf;
use std::sync::Arc;

use k8s_openapi::api::resource::v1::ResourceClaim;
use tessera_core::dra::{self, Carve, CarveLedger, ClaimStore, PreparedClaim};
use tessera_core::handoff::AllocatedDevice;
use tessera_core::inventory::{MadeInstance, MigPartitioner, NodeInventory};
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
    /// Creates and destroys MIG instances (dynamic MIG); `None`: this node creates none.
    partitioner: Option<Arc<dyn MigPartitioner>>,
    /// The instances being created for claims not recorded yet.
    ledger: CarveLedger,
    /// How long a prepare waits for the node's CDI spec to list a MIG instance it created.
    cdi_wait: std::time::Duration,
    /// One prepare or unprepare at a time: records and markers change together.
    busy: Mutex<()>,
}

/// How long a prepare waits, by default, for the CDI generator to list a created instance
/// (under the kubelet's 45 s for a DRA call).
pub const CDI_WAIT: std::time::Duration = std::time::Duration::from_secs(35);

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
        let ledger = CarveLedger::new(store.dir().parent().unwrap_or(store.dir()));
        Self {
            node: node.into(),
            inventory,
            store,
            cdi_dir,
            claims,
            partitioner: None,
            ledger,
            cdi_wait: CDI_WAIT,
            busy: Mutex::new(()),
        }
    }

    /// Creates MIG instances for claims that were allocated one (dynamic MIG) through
    /// `partitioner`, waiting at most `cdi_wait` for the node's CDI spec to list each.
    pub fn creating_instances(mut self, partitioner: Arc<dyn MigPartitioner>, cdi_wait: std::time::Duration) -> Self {
        self.partitioner = Some(partitioner);
        self.cdi_wait = cdi_wait;
        self
    }

    /// The MIG instances Tessera created and claims hold (or are being created for one).
    pub fn carved(&self) -> Vec<Carve> {
        let (records, _) = self.store.list();
        let (carving, _) = self.ledger.list();
        records
            .iter()
            .flat_map(|r| r.devices.iter().filter_map(|d| d.carved.clone()))
            .chain(carving.into_iter().flat_map(|(_, c)| c))
            .collect()
    }

    /// Destroys the instances left by a prepare that did not finish (a crash between creating
    /// them and recording the claim): those the ledger names for a claim with no record.
    pub async fn clean_unfinished_carving(&self, inv: &NodeInventory) {
        let Some(partitioner) = self.partitioner.clone() else {
            return;
        };
        let _one = self.busy.lock().await;
        let (carving, unreadable) = self.ledger.list();
        for bad in unreadable {
            warn!(error = bad, "a MIG carving record cannot be read");
        }
        for (uid, carves) in carving {
            if !matches!(self.store.get(&uid), Ok(None)) {
                // Recorded (the claim holds them) or unreadable: not ours to destroy.
                let _ = self.ledger.remove(&uid);
                continue;
            }
            let mut done = true;
            for c in &carves {
                let Some(gpu) = inv.gpu_by_uuid(&c.parent_uuid) else {
                    continue;
                };
                for m in gpu.mig_devices.iter().filter(|m| c.made(m)) {
                    match partitioner.destroy(&c.parent_uuid, m.gi) {
                        Ok(()) => info!(
                            uid,
                            instance = m.uuid,
                            "MIG instance of an unfinished prepare destroyed"
                        ),
                        Err(e) => {
                            warn!(
                                uid,
                                instance = m.uuid,
                                error = e,
                                "cannot destroy a MIG instance of an unfinished prepare"
                            );
                            done = false;
                        }
                    }
                }
            }
            if done {
                let _ = self.ledger.remove(&uid);
            }
        }
    }

    /// Destroys instances `made` for claim `uid`, whose prepare failed, and forgets them.
    fn undo_carving(&self, uid: &str, made: &[(Carve, MadeInstance)]) {
        let Some(partitioner) = &self.partitioner else { return };
        let mut done = true;
        for (c, m) in made {
            if let Err(e) = partitioner.destroy(&c.parent_uuid, m.gi) {
                warn!(
                    uid,
                    instance = m.uuid,
                    error = e,
                    "cannot destroy the MIG instance of a failed prepare"
                );
                done = false;
            }
        }
        if done {
            let _ = self.ledger.remove(uid);
        }
    }

    /// Whether the node's CDI spec (the CDI generator's) lists device `uuid`.
    fn cdi_lists(&self, uuid: &str) -> bool {
        let Ok(entries) = std::fs::read_dir(&self.cdi_dir) else {
            return false;
        };
        entries.flatten().any(|e| {
            std::fs::read(e.path())
                .ok()
                .and_then(|b| serde_json::from_slice::<tessera_core::cdi::CdiSpec>(&b).ok())
                .is_some_and(|spec| spec.kind == tessera_core::names::CDI_KIND && spec.device(uuid).is_some())
        })
    }

    /// Waits until the node's CDI spec lists the instances claim `claim` was given.
    async fn wait_for_cdi(&self, claim: &PreparedClaim) -> Result<(), String> {
        let uuids: Vec<&str> = claim
            .devices
            .iter()
            .filter(|d| d.carved.is_some())
            .filter_map(|d| match &d.allocated {
                AllocatedDevice::Mig { uuid, .. } => Some(uuid.as_str()),
                AllocatedDevice::Gpu { .. } => None,
            })
            .collect();
        let deadline = tokio::time::Instant::now() + self.cdi_wait;
        loop {
            let missing: Vec<&str> = uuids.iter().copied().filter(|u| !self.cdi_lists(u)).collect();
            if missing.is_empty() {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(format!(
                    "claim {}: MIG instance(s) {missing:?} created, but the node's CDI spec in {} does not list them yet \
                     (tessera-cdi-generator lists them at its next reading of the cards); asked again, the prepare waits again",
                    claim.key(),
                    self.cdi_dir.display()
                ));
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
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
            self.wait_for_cdi(&done).await?;
            return Ok(devices_of(&done));
        }
        let inv = self
            .inventory
            .borrow()
            .clone()
            .ok_or_else(|| format!("claim {key}: the node's GPUs are not read yet"))?;
        let found = self.claims.get(&claim.namespace, &claim.name).await?;
        // A MIG instance the claim was allocated is created here, named in the ledger first:
        // a crash before the record leaves a ledger entry, and the instance is destroyed.
        let mut made: Vec<(Carve, MadeInstance)> = Vec::new();
        let partitioner = self.partitioner.clone();
        let planned = dra::prepare_with(&inv, &self.node, &claim.uid, &found, &mut |plan| {
            let p = partitioner
                .as_ref()
                .ok_or("this node's DRA plugin creates no MIG instances (it has neither NVML nor a fixture file)")?;
            self.ledger
                .add(&claim.uid, plan)
                .map_err(|e| format!("recording it before creating it: {e}"))?;
            let m = p.create(&plan.parent_uuid, plan.profile_id, plan.placement)?;
            info!(claim = key, instance = m.uuid, gi = m.gi, profile = %plan.profile, "MIG instance created");
            made.push((plan.clone(), m.clone()));
            Ok(m)
        });
        let recorded = async {
            let mut prepared = planned.map_err(|e| e.to_string())?;
            self.check_tenancy(&prepared).await?;
            prepared.token = dra::new_token();
            // The marker first, then the record: a crash between leaves a marker that names no
            // record (it grants nothing) and the kubelet's retry prepares the claim again.
            self.write_marker(&prepared.uid, &prepared.token)?;
            self.store
                .put(&prepared)
                .map_err(|e| format!("claim {key}: recording it under {}: {e}", self.store.dir().display()))?;
            Ok::<_, String>(prepared)
        }
        .await;
        let prepared = match recorded {
            Ok(p) => p,
            Err(e) => {
                self.undo_carving(&claim.uid, &made);
                return Err(e);
            }
        };
        if !made.is_empty() {
            let _ = self.ledger.remove(&claim.uid);
        }
        info!(
            claim = key,
            uid = prepared.uid,
            devices = ?prepared.devices.iter().map(|d| d.device.as_str()).collect::<Vec<_>>(),
            "claim prepared"
        );
        self.wait_for_cdi(&prepared).await?;
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
        // The instances created for it go first: while one cannot be destroyed the record
        // stays, and the kubelet asks again.
        if let Ok(Some(record)) = self.store.get(uid) {
            for d in &record.devices {
                let (Some(c), AllocatedDevice::Mig { gi, uuid, .. }) = (&d.carved, &d.allocated) else {
                    continue;
                };
                let p = self.partitioner.as_ref().ok_or_else(|| {
                    format!("claim {uid}: cannot destroy MIG instance {uuid}: this node creates none")
                })?;
                p.destroy(&c.parent_uuid, *gi)
                    .map_err(|e| format!("claim {uid}: destroying MIG instance {uuid}: {e}"))?;
                info!(uid, instance = uuid, "MIG instance destroyed");
            }
        }
        let _ = self.ledger.remove(uid);
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
