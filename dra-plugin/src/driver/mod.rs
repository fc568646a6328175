//! The DRAPlugin service: prepares the claims the kubelet names and unprepares them.
//!
//! A claim's allocation is read from the API server; each prepared claim is recorded on the
//! node before the kubelet hears of it, so a plugin restart neither loses a prepared claim nor
//! prepares one twice. A claim is prepared only onto cards no one else uses in a way that
//! excludes it: the node's other claims, and its live containers (the NRI plugin's grant
//! records), which the scheduler does not see. The parts: where claims are read ([`source`]),
//! dynamic MIG's instances (`carving`), the gRPC face ([`grpc`]).

use std::path::PathBuf;
use std::sync::Arc;

use tessera_core::dra::{self, Carve, CarveLedger, ClaimStore, PreparedClaim};
use tessera_core::granted::{CardUse, GrantStore};
use tessera_core::handoff::AllocatedDevice;
use tessera_core::inventory::{InventorySource, MadeInstance, MigPartitioner, NodeInventory};
use tessera_proto::dra as api;
use tokio::sync::{Mutex, watch};
use tracing::{error, info, warn};

mod carving;
mod error;
pub mod grpc;
pub mod source;

pub use error::{CarveError, ClaimError, SourceError};
pub use grpc::DraService;
pub use source::{ApiClaims, ClaimSource};

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
    /// Reads the node's cards now (a recorded MIG instance is looked for on the card).
    source: Option<Arc<dyn InventorySource + Send + Sync>>,
    /// The NRI plugin's records of what live containers were granted.
    grants: Option<GrantStore>,
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
            source: None,
            grants: None,
            busy: Mutex::new(()),
        }
    }

    /// Reads the node's cards through `source` when the last reading is not enough (a
    /// recorded MIG instance that may be gone).
    pub fn discovering_with(mut self, source: Arc<dyn InventorySource + Send + Sync>) -> Self {
        self.source = Some(source);
        self
    }

    /// Reads which cards live containers use from the NRI plugin's grant records in `grants`.
    pub fn reading_grants_from(mut self, grants: GrantStore) -> Self {
        self.grants = Some(grants);
        self
    }

    /// The node's cards (for claim `key`): read now when a source was given, else the last
    /// poll's reading.
    fn cards_now(&self, key: &str) -> Result<Arc<NodeInventory>, ClaimError> {
        if let Some(source) = &self.source {
            return source
                .discover()
                .map(Arc::new)
                .map_err(|source| ClaimError::CardsUnreadable {
                    key: key.to_string(),
                    source,
                });
        }
        self.inventory
            .borrow()
            .clone()
            .ok_or_else(|| ClaimError::NoCards { key: key.to_string() })
    }

    /// Creates MIG instances for claims that were allocated one (dynamic MIG) through
    /// `partitioner`, waiting at most `cdi_wait` for the node's CDI spec to list each.
    pub fn creating_instances(mut self, partitioner: Arc<dyn MigPartitioner>, cdi_wait: std::time::Duration) -> Self {
        self.partitioner = Some(partitioner);
        self.cdi_wait = cdi_wait;
        self
    }

    fn write_marker(&self, claim: &PreparedClaim) -> Result<(), ClaimError> {
        let spec = dra::marker_spec(claim);
        let text = serde_json::to_vec_pretty(&spec).map_err(ClaimError::MarkerEncode)?;
        let path = self.cdi_dir.join(dra::marker_file(&claim.uid));
        dra::write_atomic(&self.cdi_dir, &path, &text, 0o755, 0o644)
            .map_err(|source| ClaimError::Marker { path, source })
    }

    /// Prepares claim `claim` (idempotent: a claim already recorded is answered from its
    /// record, its marker written again if it went missing, a MIG instance the card lost made
    /// again). Also returns the MIG instances made for it, which the container can have once
    /// the node's CDI spec lists them ([`Preparer::wait_for_cdi`], outside the lock).
    pub async fn prepare(&self, claim: &api::Claim) -> Result<(Vec<api::Device>, Vec<String>), ClaimError> {
        let key = format!("{}/{}", claim.namespace, claim.name);
        if !dra::is_uid(&claim.uid) {
            return Err(ClaimError::BadUid {
                key,
                uid: claim.uid.clone(),
            });
        }
        let _one = self.busy.lock().await;
        if let Some(done) = self
            .store
            .get(&claim.uid)
            .map_err(|source| ClaimError::RecordUnreadable {
                key: key.clone(),
                source,
            })?
        {
            let done = self.instances_still_there(done)?;
            self.write_marker(&done)?;
            return Ok((devices_of(&done), carved_uuids(&done)));
        }
        let inv = self
            .inventory
            .borrow()
            .clone()
            .ok_or_else(|| ClaimError::NoCards { key: key.clone() })?;
        let found = self.claims.get(&claim.namespace, &claim.name).await?;
        // A MIG instance the claim was allocated is created here, named in the ledger first:
        // a crash before the record leaves a ledger entry, and the instance is destroyed.
        let mut made: Vec<(Carve, MadeInstance)> = Vec::new();
        let mut held_by = None;
        let planned = dra::prepare_with(&inv, &self.node, &claim.uid, &found, &mut |plan| {
            let m = self.carve(&inv, &claim.uid, plan).map_err(|e| {
                if let CarveError::SlicesTaken { instance, .. } = &e {
                    held_by = self.holder_of(instance);
                }
                e.to_string()
            })?;
            made.push((plan.clone(), m.clone()));
            Ok(m)
        })
        .map_err(|e| match held_by.take() {
            Some(holder) => ClaimError::HeldByClaim {
                holder,
                message: e.to_string(),
            },
            None => ClaimError::Plan(e),
        });
        let recorded = async {
            let mut prepared = planned?;
            self.check_card_use(&prepared).await?;
            prepared.markers = dra::new_markers(&prepared);
            // The marker first, then the record: a crash between leaves a marker that names no
            // record (it grants nothing) and the kubelet's retry prepares the claim again.
            self.write_marker(&prepared)?;
            self.store.put(&prepared).map_err(|source| ClaimError::Record {
                key: key.clone(),
                dir: self.store.dir().to_path_buf(),
                source,
            })?;
            Ok::<_, ClaimError>(prepared)
        }
        .await;
        let prepared = match recorded {
            Ok(p) => p,
            Err(e) => {
                self.undo_carving(&inv, &claim.uid, &made);
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

    /// Refuses `claim` when a device it would get is in use in a way that excludes it
    /// ([`tessera_core::granted::check_card_use`]): by another recorded claim, or by a live
    /// container (whose claim may be gone); a share also when its card serves another tenant's
    /// shares and the node has not opted in. A record that cannot be read is left out (its
    /// claim grants nothing until it is readable; its live containers still count).
    async fn check_card_use(&self, claim: &PreparedClaim) -> Result<(), ClaimError> {
        let mine: Vec<&str> = claim.devices.iter().map(|d| d.allocated.uuid()).collect();
        let (records, unreadable) = self.store.list();
        for bad in unreadable {
            warn!(
                error = bad,
                "a claim record cannot be read: left out of the card checks"
            );
        }
        let (grants, bad_grants) = self.grants.as_ref().map(GrantStore::list).unwrap_or_default();
        for bad in bad_grants {
            warn!(error = bad, "a container's grant record cannot be read");
        }
        // Who else uses the claim's devices, with the namespace whose tenant it is.
        let mut others: Vec<(CardUse, String)> = Vec::new();
        for r in records.iter().filter(|r| r.uid != claim.uid) {
            others.extend(
                CardUse::of_claim(r, &r.namespace)
                    .into_iter()
                    .map(|u| (u, r.namespace.clone())),
            );
        }
        for g in grants.values() {
            others.extend(
                CardUse::of_container(g, &g.namespace)
                    .into_iter()
                    .map(|u| (u, g.namespace.clone())),
            );
        }
        others.retain(|(u, _)| mine.contains(&u.uuid.as_str()) && u.claim.as_deref() != Some(claim.uid.as_str()));
        if others.is_empty() {
            return Ok(());
        }
        let shares = claim
            .devices
            .iter()
            .any(|d| matches!(d.allocated, AllocatedDevice::Gpu { exclusive: false, .. }));
        let cross_tenant = shares && self.claims.cross_tenant(&self.node).await?;
        let mut tenants: std::collections::HashMap<String, String> = std::collections::HashMap::new();
        for ns in std::iter::once(&claim.namespace).chain(others.iter().map(|(_, ns)| ns)) {
            if !tenants.contains_key(ns) {
                tenants.insert(ns.clone(), self.claims.tenant(ns).await?);
            }
        }
        let uses: Vec<CardUse> = others
            .into_iter()
            .map(|(u, ns)| CardUse {
                tenant: tenants[&ns].clone(),
                ..u
            })
            .collect();
        tessera_core::granted::check_card_use(claim, &tenants[&claim.namespace], &uses, cross_tenant)
            .map_err(ClaimError::CardInUse)
    }

    /// Unprepares claim `uid`: its record and marker go (idempotent).
    pub async fn unprepare(&self, uid: &str) -> Result<(), ClaimError> {
        if !dra::is_uid(uid) {
            return Err(ClaimError::BadUnprepareUid(uid.to_string()));
        }
        let _one = self.busy.lock().await;
        // The instances created for it go first: while one cannot be destroyed the record
        // stays, and the kubelet asks again.
        let record = self.store.get(uid).map_err(|source| ClaimError::KeepInstances {
            uid: uid.to_string(),
            source,
        })?;
        if let Some(record) = record {
            for d in &record.devices {
                let (Some(c), AllocatedDevice::Mig { gi, uuid, .. }) = (&d.carved, &d.allocated) else {
                    continue;
                };
                let p = self.partitioner.as_ref().ok_or_else(|| ClaimError::NoPartitioner {
                    uid: uid.to_string(),
                    uuid: uuid.clone(),
                })?;
                p.destroy(&c.parent_uuid, *gi, uuid, c.profile_id, c.placement)
                    .map_err(|source| ClaimError::Destroy {
                        uid: uid.to_string(),
                        uuid: uuid.clone(),
                        source,
                    })?;
                info!(uid, instance = uuid, "MIG instance destroyed");
            }
        }
        let marker = self.cdi_dir.join(dra::marker_file(uid));
        match std::fs::remove_file(&marker) {
            Err(source) if source.kind() != std::io::ErrorKind::NotFound => {
                return Err(ClaimError::RemoveMarker { path: marker, source });
            }
            _ => {}
        }
        self.store.remove(uid).map_err(|source| ClaimError::RemoveRecord {
            uid: uid.to_string(),
            source,
        })?;
        info!(uid, "claim unprepared");
        Ok(())
    }

    /// Sets aside the claim records that cannot be read (named in the log, kept beside the
    /// records for people): one bad file no longer stands in every other claim's way, and a
    /// claim whose record is set aside grants nothing more (its live containers still count in
    /// the card checks, through their grant records).
    pub fn set_aside_unreadable_records(&self) {
        for uid in self.store.unreadable() {
            match self.store.set_aside(&uid) {
                Ok(to) => error!(
                    uid,
                    to = %to.display(),
                    "a claim record cannot be read: set aside (its claim is no longer prepared on this node; its pod's containers are refused until it is prepared again)"
                ),
                Err(e) => warn!(uid, error = %e, "a claim record cannot be read, nor set aside"),
            }
        }
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

/// The kubelet's view of a prepared claim: each device with the markers of the requests it
/// serves (the kubelet hands a container those of the requests it names).
fn devices_of(claim: &PreparedClaim) -> Vec<api::Device> {
    claim
        .devices
        .iter()
        .map(|d| api::Device {
            request_names: d.requests.clone(),
            pool_name: d.pool.clone(),
            device_name: d.device.clone(),
            cdi_device_ids: dra::marker_devices(claim, &d.requests),
            share_id: d.share_id.clone(),
        })
        .collect()
}
