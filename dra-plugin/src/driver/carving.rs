//! Dynamic MIG's carving, seen from the plugin: the instances claims hold, the clean-up of
//! what unfinished prepares left, the wait for the CDI generator to list a new instance, and
//! an instance made again when the card lost it (a reboot, a GPU reset).

use tessera_core::dra::{self, Carve, PreparedClaim};
use tessera_core::handoff::AllocatedDevice;
use tessera_core::inventory::{Gpu, InventorySource, MadeInstance, NodeInventory};
use tessera_node::dirwatch::DirWatch;
use tracing::{info, warn};

use super::{CarveError, ClaimError, Preparer};

/// How often a prepare that waits for the CDI generator reads the CDI directory, beside each
/// change the kernel tells of.
const CDI_RECHECK: std::time::Duration = std::time::Duration::from_millis(100);

/// Says, once per process, that the CDI directory is not watched (each wait makes its watch).
fn unwatched(e: &std::io::Error) {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
        warn!(error = %e, "the CDI directory is not watched: a wait for a MIG instance's CDI entry reads it every 0.1 s");
    }
}

impl Preparer {
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
    pub(super) fn destroy_carving(&self, inv: &NodeInventory, uid: &str, entries: Vec<dra::Carving>) {
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
                            error = %e,
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

    /// The recorded claim whose MIG instance `uuid` is, if one is.
    pub(super) fn holder_of(&self, uuid: &str) -> Option<String> {
        let (records, _) = self.store.list();
        records
            .into_iter()
            .find(|r| {
                r.devices.iter().any(|d| {
                    d.carved.is_some() && matches!(&d.allocated, AllocatedDevice::Mig { uuid: u, .. } if u == uuid)
                })
            })
            .map(|r| r.uid)
    }

    /// How long the kubelet's call waits for a claim whose MIG instance is in the way to be
    /// unprepared: half the CDI wait, so that an instance made after it still has time to be
    /// listed within the kubelet's 45 s.
    pub fn held_wait(&self) -> std::time::Duration {
        self.cdi_wait / 2
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
    ///
    /// The CDI directory is read again as soon as a file in it changes (the kernel tells), and
    /// every 0.1 s in any case.
    pub async fn wait_for_cdi(&self, uuids: &[String], since: tokio::time::Instant) -> Result<(), Vec<String>> {
        let deadline = since + self.cdi_wait;
        let (mut watch, mut tried) = (None, false);
        loop {
            let missing: Vec<String> = uuids.iter().filter(|u| !self.cdi_lists(u)).cloned().collect();
            if missing.is_empty() {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(missing);
            }
            if !tried {
                tried = true;
                // Watched from now on, then read again: a spec written in between is seen.
                match DirWatch::new(std::slice::from_ref(&self.cdi_dir)) {
                    Ok(w) => {
                        watch = Some(w);
                        continue;
                    }
                    Err(e) => unwatched(&e),
                }
            }
            let changed = async {
                match watch.as_mut() {
                    Some(w) => w.changed().await.err(),
                    None => std::future::pending().await,
                }
            };
            let lost = tokio::select! {
                () = tokio::time::sleep(CDI_RECHECK) => None,
                e = changed => e,
            };
            if let Some(e) = lost {
                unwatched(&e);
                watch = None;
            }
        }
    }

    /// Creates the MIG instance `plan` of claim `uid` on its card (as `inv` has it), named in
    /// the ledger first and noted there once made.
    pub(super) fn carve(&self, inv: &NodeInventory, uid: &str, plan: &Carve) -> Result<MadeInstance, CarveError> {
        let p = self.partitioner.as_ref().ok_or(CarveError::NoPartitioner)?;
        let in_the_way = |card: &Gpu| {
            card.mig_devices
                .iter()
                .find(|m| m.placement.is_none_or(|p| p.overlaps(&plan.placement)))
                .cloned()
        };
        let mut card = inv.gpu_by_uuid(&plan.parent_uuid).ok_or(CarveError::CardGone)?;
        // The inventory is the last poll's: an instance in the way may have gone since (an
        // unprepare destroyed it), and one this plugin made since (another claim's prepare a
        // moment ago) is not in it. The card is read again (through NVML on a node) in either
        // case, and only then.
        let fresh;
        if (in_the_way(card).is_some() || self.made_since(card))
            && let Some(now) = self.read_card(&plan.parent_uuid)?
        {
            fresh = now;
            card = &fresh;
        }
        // An allocation older than the card's instances (an operator made one there since the
        // slice was read, or a claim not yet unprepared holds one): refused before anything is
        // written or made. An operator's instance made since the last poll is not known here:
        // the card refuses that create, and makes nothing.
        if let Some(m) = in_the_way(card) {
            return Err(CarveError::SlicesTaken {
                start: plan.placement.start,
                end: plan.placement.start + plan.placement.size,
                card: plan.parent_uuid.clone(),
                instance: m.uuid.clone(),
                gi: m.gi,
            });
        }
        let before = card.mig_devices.iter().map(|m| m.uuid.clone()).collect();
        self.ledger.add(uid, plan, before).map_err(CarveError::Ledger)?;
        let m = match p.create(&plan.parent_uuid, plan.profile_id, plan.placement) {
            Ok(m) => m,
            Err(e) => {
                // Nothing was made: a create cleans up after itself (or says it could not; a
                // GPU instance without its compute instance is no MIG device to find).
                let _ = self.ledger.forget(uid, plan);
                return Err(CarveError::Create(e));
            }
        };
        info!(uid, instance = m.uuid, gi = m.gi, profile = %plan.profile, "MIG instance created");
        // Noted, so that an undo destroys exactly this instance (if this write fails, the undo
        // has it from memory, the poll by its placement).
        if let Err(e) = self.ledger.made(uid, plan, &m) {
            warn!(uid, instance = m.uuid, error = %e, "cannot note a made MIG instance");
        }
        Ok(m)
    }

    /// Whether `card`, as last read, lacks an instance this plugin made or is making there
    /// (the claims' records and the ledger name them): it was read before.
    fn made_since(&self, card: &Gpu) -> bool {
        self.carved()
            .iter()
            .any(|c| c.parent_uuid == card.uuid && !card.mig_devices.iter().any(|m| c.made(m)))
    }

    /// Card `uuid` as the node's cards are now; `None` where they cannot be read (no source
    /// given, or the reading failed: the last poll's stands), and an error where the card is
    /// no longer there.
    fn read_card(&self, uuid: &str) -> Result<Option<Gpu>, CarveError> {
        let Some(source) = self.source.as_ref() else {
            return Ok(None);
        };
        match source.discover() {
            Ok(inv) => inv
                .gpus
                .into_iter()
                .find(|g| g.uuid == uuid)
                .map(Some)
                .ok_or(CarveError::CardGone),
            Err(e) => {
                warn!(card = uuid, error = %e, "cannot read the cards before making a MIG instance: the last reading stands");
                Ok(None)
            }
        }
    }

    /// Destroys what a prepare of claim `uid` that failed made (`made`, also where the ledger
    /// could not be told).
    pub(super) fn undo_carving(&self, inv: &NodeInventory, uid: &str, made: &[(Carve, MadeInstance)]) {
        if let Ok(mut entries) = self.ledger.get(uid)
            && !entries.is_empty()
        {
            for (carve, m) in made {
                if let Some(entry) = entries.iter_mut().rev().find(|c| c.carve == *carve && c.made.is_none()) {
                    entry.made = Some(m.clone());
                }
            }
            self.destroy_carving(inv, uid, entries);
        }
    }

    /// `record` with every MIG instance it holds on its card: one the card lost (a reboot or a
    /// GPU reset destroys MIG instances, not the node's records) is made again at its
    /// placement, ledger first, and the record rewritten with the new instance. Without this a
    /// retried prepare answered from the record, and the container waited for a CDI entry that
    /// never came.
    pub(super) fn instances_still_there(&self, mut record: PreparedClaim) -> Result<PreparedClaim, ClaimError> {
        if record.devices.iter().all(|d| d.carved.is_none()) {
            return Ok(record);
        }
        let inv = self.cards_now(&record.key())?;
        let mut remade: Vec<(Carve, MadeInstance)> = Vec::new();
        let (key, uid) = (record.key(), record.uid.clone());
        for d in &mut record.devices {
            let (Some(plan), AllocatedDevice::Mig { uuid, gi, ci, .. }) = (&d.carved, &mut d.allocated) else {
                continue;
            };
            let there = inv
                .gpu_by_uuid(&plan.parent_uuid)
                .is_some_and(|g| g.mig_devices.iter().any(|m| m.uuid == *uuid));
            if there {
                continue;
            }
            warn!(claim = uid, instance = %uuid, "the claim's MIG instance is gone from its card: making it again");
            let m = match self.carve(&inv, &uid, plan) {
                Ok(m) => m,
                Err(e) => {
                    self.undo_carving(&inv, &uid, &remade);
                    return Err(ClaimError::Remake {
                        key,
                        uuid: uuid.clone(),
                        card: plan.parent_uuid.clone(),
                        source: Box::new(e),
                    });
                }
            };
            (*uuid, *gi, *ci) = (m.uuid.clone(), m.gi, m.ci);
            remade.push((plan.clone(), m));
        }
        if remade.is_empty() {
            return Ok(record);
        }
        if let Err(source) = self.store.put(&record) {
            self.undo_carving(&inv, &record.uid, &remade);
            return Err(ClaimError::RecordRemade {
                key: record.key(),
                source,
            });
        }
        if let Ok(entries) = self.ledger.get(&record.uid) {
            self.destroy_carving(&inv, &record.uid, entries);
        }
        Ok(record)
    }
}
