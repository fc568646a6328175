//! The DRAPlugin service: prepares the claims the kubelet names (reading their allocation from
//! the API server) and unprepares them. Each prepared claim is recorded on the node before the
//! kubelet hears of it, so a plugin restart neither loses a prepared claim nor prepares one twice.

use std::path::PathBuf;
use std::sync::Arc;

use k8s_openapi::api::resource::v1::ResourceClaim;
use tessera_core::dra::{self, Carve, CarveLedger, ClaimStore, PreparedClaim};
use tessera_core::handoff::AllocatedDevice;
use tessera_core::inventory::{InventorySource, MadeInstance, MigPartitioner, NodeInventory};
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
            .chain(carving.into_iter().flat_map(|(_, c)| c).map(|c| c.carve))
            .collect()
    }

    /// Destroys the instances left by prepares that did not finish (a crash between creating
    /// them and recording the claim, or a failed prepare whose undo failed): those the ledger
    /// names that no recorded claim holds. The cards are read from `source` under the lock,
    /// after every prepare that could have made one.
    pub async fn clean_unfinished_carving(&self, source: &(dyn InventorySource + Send + Sync)) {
        if self.partitioner.is_none() {
            return;
        }
        let (carving, unreadable) = self.ledger.list();
        for bad in unreadable {
            warn!(error = bad, "a MIG carving record cannot be read");
        }
        if carving.is_empty() {
            return;
        }
        let _one = self.busy.lock().await;
        let inv = match source.discover() {
            Ok(inv) => inv,
            Err(e) => {
                warn!(error = %e, "the node's GPUs are unreadable: leftover MIG instances are destroyed later");
                return;
            }
        };
        for (uid, _) in carving {
            match (self.store.get(&uid), self.ledger.get(&uid)) {
                (Ok(_), Ok(entries)) => self.destroy_carving(&inv, &uid, entries),
                (Err(e), _) | (_, Err(e)) => {
                    warn!(uid, error = %e, "a claim's record is unreadable: its MIG instances are kept")
                }
            }
        }
    }

    /// Destroys what the ledger's `entries` of claim `uid` made, but instances a recorded claim
    /// holds, and forgets each entry once its instance is gone or held. An instance made but
    /// not noted (a crash in between) is found in `inv` by its placement and profile, unless a
    /// recorded claim or another entry holds it or its card had it before. Call with `busy`
    /// held.
    fn destroy_carving(&self, inv: &NodeInventory, uid: &str, entries: Vec<dra::Carving>) {
        let Some(partitioner) = &self.partitioner else { return };
        let (records, _) = self.store.list();
        let (carving, _) = self.ledger.list();
        let held: std::collections::BTreeSet<String> = records
            .iter()
            .flat_map(|r| r.devices.iter())
            .filter_map(|d| match &d.allocated {
                AllocatedDevice::Mig { uuid, .. } => Some(uuid.clone()),
                AllocatedDevice::Gpu { .. } => None,
            })
            .chain(
                carving
                    .iter()
                    .filter(|(other, _)| other != uid)
                    .flat_map(|(_, c)| c.iter().filter_map(|c| c.made.as_ref().map(|m| m.uuid.clone()))),
            )
            .collect();
        let mut left = Vec::new();
        for entry in entries {
            let c = &entry.carve;
            let targets: Vec<(u32, String)> = match &entry.made {
                Some(m) if held.contains(&m.uuid) => vec![],
                Some(m) => vec![(m.gi, m.uuid.clone())],
                None => inv
                    .gpu_by_uuid(&c.parent_uuid)
                    .into_iter()
                    .flat_map(|g| g.mig_devices.iter())
                    .filter(|m| c.made(m) && !held.contains(&m.uuid) && !entry.before.contains(&m.uuid))
                    .map(|m| (m.gi, m.uuid.clone()))
                    .collect(),
            };
            let mut gone = true;
            for (gi, instance) in targets {
                match partitioner.destroy(&c.parent_uuid, gi, &instance, c.profile_id, c.placement) {
                    Ok(()) => info!(uid, instance, "MIG instance no claim holds destroyed"),
                    Err(e) => {
                        warn!(
                            uid,
                            instance,
                            error = e,
                            "cannot destroy a MIG instance no claim holds; tried again at the next poll"
                        );
                        gone = false;
                    }
                }
            }
            if !gone {
                left.push(entry);
            }
        }
        if let Err(e) = self.ledger.set(uid, &left) {
            warn!(uid, error = %e, "cannot update the MIG carving record");
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

    /// Waits until the node's CDI spec lists every MIG instance in `uuids`, at most until
    /// `since` (when the kubelet asked) and the wait the plugin was given; the error names
    /// those it does not.
    pub async fn wait_for_cdi(&self, uuids: &[String], since: tokio::time::Instant) -> Result<(), Vec<String>> {
        let deadline = since + self.cdi_wait;
        loop {
            let missing: Vec<String> = uuids.iter().filter(|u| !self.cdi_lists(u)).cloned().collect();
            if missing.is_empty() {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(missing);
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
    /// record, its marker written again if it went missing). Also returns the MIG instances
    /// made for it, which the container can have once the node's CDI spec lists them
    /// ([`Preparer::wait_for_cdi`], outside the lock).
    pub async fn prepare(&self, claim: &api::Claim) -> Result<(Vec<api::Device>, Vec<String>), String> {
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
            return Ok((devices_of(&done), carved_uuids(&done)));
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
            let card = inv.gpu_by_uuid(&plan.parent_uuid).ok_or("the card is gone")?;
            // An allocation older than the card's instances (an operator made one there since
            // the slice was read): refused before anything is written or made.
            if let Some(m) = card
                .mig_devices
                .iter()
                .find(|m| m.placement.is_none_or(|p| p.overlaps(&plan.placement)))
            {
                return Err(format!(
                    "memory slices {}..{} of card {} are taken by MIG instance {} (gi {}); the claim waits until it goes",
                    plan.placement.start,
                    plan.placement.start + plan.placement.size,
                    plan.parent_uuid,
                    m.uuid,
                    m.gi
                ));
            }
            let before = card.mig_devices.iter().map(|m| m.uuid.clone()).collect();
            self.ledger
                .add(&claim.uid, plan, before)
                .map_err(|e| format!("recording it before creating it: {e}"))?;
            let m = match p.create(&plan.parent_uuid, plan.profile_id, plan.placement) {
                Ok(m) => m,
                Err(e) => {
                    // Nothing was made: a create cleans up after itself (or says it could not;
                    // a GPU instance without its compute instance is no MIG device to find).
                    let _ = self.ledger.forget(&claim.uid, plan);
                    return Err(e);
                }
            };
            info!(claim = key, instance = m.uuid, gi = m.gi, profile = %plan.profile, "MIG instance created");
            made.push((plan.clone(), m.clone()));
            // Noted, so that an undo destroys exactly this instance (if this write fails, the
            // undo has it from memory, the poll by its placement).
            if let Err(e) = self.ledger.made(&claim.uid, plan, &m) {
                warn!(claim = key, instance = m.uuid, error = %e, "cannot note a made MIG instance");
            }
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
                if let Ok(mut entries) = self.ledger.get(&claim.uid)
                    && !entries.is_empty()
                {
                    // What this prepare made, also where the ledger could not be told.
                    for (carve, m) in &made {
                        if let Some(entry) = entries.iter_mut().rev().find(|c| c.carve == *carve && c.made.is_none()) {
                            entry.made = Some(m.clone());
                        }
                    }
                    self.destroy_carving(&inv, &claim.uid, entries);
                }
                return Err(e);
            }
        };
        // The record holds what this prepare made; an older attempt's leftovers go.
        if let Ok(entries) = self.ledger.get(&claim.uid)
            && !entries.is_empty()
        {
            self.destroy_carving(&inv, &claim.uid, entries);
        }
        info!(
            claim = key,
            uid = prepared.uid,
            devices = ?prepared.devices.iter().map(|d| d.device.as_str()).collect::<Vec<_>>(),
            "claim prepared"
        );
        Ok((devices_of(&prepared), carved_uuids(&prepared)))
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
        let record = self
            .store
            .get(uid)
            .map_err(|e| format!("claim {uid}: its record cannot be read, so its MIG instances are kept: {e}"))?;
        if let Some(record) = record {
            for d in &record.devices {
                let (Some(c), AllocatedDevice::Mig { gi, uuid, .. }) = (&d.carved, &d.allocated) else {
                    continue;
                };
                let p = self.partitioner.as_ref().ok_or_else(|| {
                    format!("claim {uid}: cannot destroy MIG instance {uuid}: this node creates none")
                })?;
                p.destroy(&c.parent_uuid, *gi, uuid, c.profile_id, c.placement)
                    .map_err(|e| format!("claim {uid}: destroying MIG instance {uuid}: {e}"))?;
                info!(uid, instance = uuid, "MIG instance destroyed");
            }
        }
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

/// The MIG instances made for `claim`.
fn carved_uuids(claim: &PreparedClaim) -> Vec<String> {
    claim
        .devices
        .iter()
        .filter(|d| d.carved.is_some())
        .filter_map(|d| match &d.allocated {
            AllocatedDevice::Mig { uuid, .. } => Some(uuid.clone()),
            AllocatedDevice::Gpu { .. } => None,
        })
        .collect()
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
        let asked = tokio::time::Instant::now();
        let mut claims = std::collections::HashMap::new();
        let mut waiting: Vec<(String, Vec<String>)> = Vec::new();
        for c in request.into_inner().claims {
            let key = format!("{}/{}", c.namespace, c.name);
            let answer = match self.0.prepare(&c).await {
                Ok((devices, instances)) => {
                    if !instances.is_empty() {
                        waiting.push((c.uid.clone(), instances));
                    }
                    api::NodePrepareResourceResponse {
                        devices,
                        error: String::new(),
                    }
                }
                Err(error) => {
                    warn!(claim = key, uid = c.uid, error, "cannot prepare");
                    api::NodePrepareResourceResponse { devices: vec![], error }
                }
            };
            claims.insert(c.uid, answer);
        }
        // The instances made for the request's claims, waited for once, outside the lock: a
        // container gets one once the CDI generator lists it.
        let all: Vec<String> = waiting.iter().flat_map(|(_, u)| u.iter().cloned()).collect();
        if let Err(missing) = self.0.wait_for_cdi(&all, asked).await {
            for (uid, instances) in waiting {
                let late: Vec<&String> = instances.iter().filter(|u| missing.contains(u)).collect();
                if late.is_empty() {
                    continue;
                }
                let answer = claims.get_mut(&uid).expect("answered above");
                answer.devices.clear();
                answer.error = format!(
                    "claim {uid}: MIG instance(s) {late:?} made, but the node's CDI spec does not list them yet \
                     (tessera-cdi-generator lists them at its next reading of the cards); asked again, the prepare waits again"
                );
                warn!(uid, error = answer.error, "cannot prepare yet");
            }
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
