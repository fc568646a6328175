//! Dynamic MIG: on a node labelled [`crate::names::LABEL_DYNAMIC_MIG`], a card in MIG mode is published as
//! every GPU instance it could create (each profile at each of its placements), all drawing on
//! the card's shared counters (partitionable devices, `DRAPartitionableDevices`): one counter
//! per memory slice, the compute slices and the media engines. The scheduler then never
//! allocates two instances that overlap, or more than the card has. Preparing a claim for such
//! a device creates the instance ([`Carve`]); unpreparing it destroys it.
//!
//! Instances Tessera did not create (an operator's) are offered as they are, and the
//! placements they cover are not offered at all.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1 as resource;
use serde::{Deserialize, Serialize};

use crate::inventory::{Gpu, MadeInstance, MigDevice, MigPlacement, MigProfileInfo};
use crate::mig::MigProfile;

/// A MIG instance Tessera creates for a claim: what to create, and afterwards what to destroy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Carve {
    /// The card (`GPU-<uuid>`).
    pub parent_uuid: String,
    /// Its NVML index.
    pub parent_index: u32,
    /// NVML's GPU instance profile id.
    pub profile_id: u32,
    /// The profile.
    pub profile: MigProfile,
    /// Where on the card.
    pub placement: MigPlacement,
}

impl Carve {
    /// True when `m`, an instance of this card, is the one this carve makes.
    pub fn made(&self, m: &MigDevice) -> bool {
        m.placement == Some(self.placement) && m.profile == self.profile
    }
}

/// Whether `gpu` can have instances created on it: in MIG mode, its profiles known.
pub fn carvable(gpu: &Gpu) -> bool {
    gpu.mig_enabled && !gpu.mig_profiles.is_empty()
}

/// The name of card `gpu`'s counter set.
pub fn counter_set_name(gpu: &Gpu) -> String {
    format!("gpu-{}-counters", gpu.index)
}

/// The device name of profile `info` at `placement` on `gpu` (`gpu-0-mig-1g-5gb-me-at-3`).
pub fn placement_device_name(gpu: &Gpu, info: &MigProfileInfo, placement: MigPlacement) -> String {
    let profile = info.profile.to_string().replace(['.', '+'], "-");
    format!("gpu-{}-mig-{profile}-at-{}", gpu.index, placement.start)
}

fn counter(n: u64) -> resource::Counter {
    resource::Counter {
        value: k8s_openapi::apimachinery::pkg::api::resource::Quantity(n.to_string()),
    }
}

/// What an instance of `info` at `placement` takes from its card's counters (nothing of
/// which it takes none).
fn consumption(info: &MigProfileInfo, placement: MigPlacement) -> BTreeMap<String, resource::Counter> {
    let mut out: BTreeMap<String, resource::Counter> = placement
        .slices()
        .map(|s| (format!("memory-slice-{s}"), counter(1)))
        .collect();
    for (name, n) in engines(info) {
        if n > 0 {
            out.insert(name.into(), counter(u64::from(n)));
        }
    }
    out
}

fn engines(info: &MigProfileInfo) -> [(&'static str, u32); 5] {
    [
        ("compute-slices", info.slices),
        ("decoders", info.decoders),
        ("encoders", info.encoders),
        ("jpeg-decoders", info.jpeg_decoders),
        ("ofas", info.ofas),
    ]
}

/// Card `gpu`'s counter set: each memory slice once, and of each engine what its largest
/// profile has (the whole card's) less what the instances Tessera did not create (not in
/// `ours`) take; their memory slices are covered by withholding the placements over them.
pub fn counter_set(gpu: &Gpu, ours: &[Carve]) -> resource::CounterSet {
    let mut memory = std::collections::BTreeSet::new();
    let mut totals: BTreeMap<&'static str, u32> = BTreeMap::new();
    for info in &gpu.mig_profiles {
        memory.extend(info.placements.iter().flat_map(MigPlacement::slices));
        for (name, n) in engines(info) {
            let have = totals.entry(name).or_default();
            *have = (*have).max(n);
        }
    }
    for m in foreign(gpu, ours) {
        if let Some(info) = profile_of(gpu, m) {
            for (name, n) in engines(info) {
                if let Some(have) = totals.get_mut(name) {
                    *have = have.saturating_sub(n);
                }
            }
        }
    }
    let mut counters: BTreeMap<String, resource::Counter> = memory
        .into_iter()
        .map(|s| (format!("memory-slice-{s}"), counter(1)))
        .collect();
    // A counter the card has none of is left out (no device consumes it).
    for info in &gpu.mig_profiles {
        for (name, n) in engines(info) {
            if n > 0 {
                counters.insert(name.into(), counter(u64::from(totals[name])));
            }
        }
    }
    resource::CounterSet {
        name: counter_set_name(gpu),
        counters,
    }
}

/// The profile of instance `m` among its card's.
fn profile_of<'a>(gpu: &'a Gpu, m: &MigDevice) -> Option<&'a MigProfileInfo> {
    gpu.mig_profiles.iter().find(|p| p.profile == m.profile)
}

/// The instances on `gpu` that Tessera did not create (`ours` are what it created).
pub fn foreign<'a>(gpu: &'a Gpu, ours: &'a [Carve]) -> impl Iterator<Item = &'a MigDevice> + 'a {
    gpu.mig_devices
        .iter()
        .filter(move |m| !ours.iter().any(|c| c.parent_uuid == gpu.uuid && c.made(m)))
}

/// The placement devices of `gpu` (each profile at each placement no foreign instance
/// covers), each consuming its share of the card's counters; `attributes` are the card's
/// common attributes. An instance whose placement or profile is unknown covers the whole card.
pub fn placement_devices(
    gpu: &Gpu,
    ours: &[Carve],
    attributes: &BTreeMap<String, resource::DeviceAttribute>,
) -> Vec<resource::Device> {
    let taken: Vec<Option<MigPlacement>> = foreign(gpu, ours)
        .map(|m| m.placement.filter(|_| profile_of(gpu, m).is_some()))
        .collect();
    let mut out = Vec::new();
    for info in &gpu.mig_profiles {
        for &placement in &info.placements {
            if taken.iter().any(|t| t.is_none_or(|t| t.overlaps(&placement))) {
                continue;
            }
            let mut attributes = attributes.clone();
            attributes.insert("type".into(), super::publish::string("mig"));
            attributes.insert("parentUUID".into(), super::publish::string(&gpu.uuid));
            attributes.insert("profile".into(), super::publish::string(&info.profile.to_string()));
            attributes.insert("placementStart".into(), super::publish::int(i64::from(placement.start)));
            attributes.insert("shareable".into(), super::publish::boolean(false));
            attributes.insert("dynamic".into(), super::publish::boolean(true));
            out.push(resource::Device {
                name: placement_device_name(gpu, info, placement),
                attributes: Some(attributes),
                capacity: Some(BTreeMap::from([(
                    super::CAPACITY_MEMORY.to_string(),
                    resource::DeviceCapacity {
                        value: super::publish::q(format!("{}Mi", info.memory_mib)),
                        request_policy: None,
                    },
                )])),
                consumes_counters: Some(vec![resource::DeviceCounterConsumption {
                    counter_set: counter_set_name(gpu),
                    counters: consumption(info, placement),
                }]),
                ..Default::default()
            });
        }
    }
    out
}

/// The instance device `device` of `gpu` names, as a [`Carve`]; `None` when it names none.
pub fn carve_of(gpu: &Gpu, device: &str) -> Option<Carve> {
    gpu.mig_profiles.iter().find_map(|info| {
        info.placements
            .iter()
            .find(|p| placement_device_name(gpu, info, **p) == device)
            .map(|p| Carve {
                parent_uuid: gpu.uuid.clone(),
                parent_index: gpu.index,
                profile_id: info.id,
                profile: info.profile.clone(),
                placement: *p,
            })
    })
}

/// One instance in the [`CarveLedger`]: what is being made, and once it is, which instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Carving {
    /// What is being made.
    pub carve: Carve,
    /// The MIG instances its card had before (none of them is this one).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub before: Vec<String>,
    /// The instance, once made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub made: Option<MadeInstance>,
}

/// The MIG instances being created for claims not yet recorded: one file per claim uid,
/// written before NVML is asked for an instance, told the instance once it is made, and
/// removed once the claim's record (which lists what it carved) is written, or the instances
/// are destroyed. What a file names and no record does is left over from a crash or a failed
/// prepare, and is destroyed.
#[derive(Debug, Clone)]
pub struct CarveLedger {
    dir: std::path::PathBuf,
}

impl CarveLedger {
    /// The ledger under `state_dir/carving`.
    pub fn new(state_dir: &std::path::Path) -> Self {
        Self {
            dir: state_dir.join("carving"),
        }
    }

    fn path(&self, uid: &str) -> std::io::Result<std::path::PathBuf> {
        if !super::is_uid(uid) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("claim uid {uid:?} is invalid"),
            ));
        }
        Ok(self.dir.join(format!("{uid}.json")))
    }

    /// What is being carved for claim `uid`.
    pub fn get(&self, uid: &str) -> std::io::Result<Vec<Carving>> {
        let path = self.path(uid)?;
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{}: {e}", path.display()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(vec![]),
            Err(e) => Err(e),
        }
    }

    /// Sets claim `uid`'s carving to `all` (none: forgets it).
    pub fn set(&self, uid: &str, all: &[Carving]) -> std::io::Result<()> {
        if all.is_empty() {
            return self.remove(uid);
        }
        let text = serde_json::to_vec_pretty(all).map_err(std::io::Error::other)?;
        super::write_atomic(&self.dir, &self.path(uid)?, &text, 0o700, 0o600)
    }

    /// Adds `carve` to what is being carved for claim `uid`, before it is made; `before` are
    /// the instances its card has now.
    pub fn add(&self, uid: &str, carve: &Carve, before: Vec<String>) -> std::io::Result<()> {
        let mut all = self.get(uid)?;
        all.push(Carving {
            carve: carve.clone(),
            before,
            made: None,
        });
        self.set(uid, &all)
    }

    /// Notes that `carve`, of claim `uid`, is instance `made` (its latest entry not made yet).
    pub fn made(&self, uid: &str, carve: &Carve, made: &MadeInstance) -> std::io::Result<()> {
        let mut all = self.get(uid)?;
        if let Some(c) = all.iter_mut().rev().find(|c| c.carve == *carve && c.made.is_none()) {
            c.made = Some(made.clone());
        }
        self.set(uid, &all)
    }

    /// Forgets `carve` of claim `uid`, which was not made (its latest entry not made yet).
    pub fn forget(&self, uid: &str, carve: &Carve) -> std::io::Result<()> {
        let mut all = self.get(uid)?;
        if let Some(i) = all.iter().rposition(|c| c.carve == *carve && c.made.is_none()) {
            all.remove(i);
        }
        self.set(uid, &all)
    }

    /// Forgets claim `uid`'s carving (no error when there is none).
    pub fn remove(&self, uid: &str) -> std::io::Result<()> {
        match std::fs::remove_file(self.path(uid)?) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// Every claim with carving under way, and its carvings (unreadable files are named in the
    /// error list).
    pub fn list(&self) -> (Vec<(String, Vec<Carving>)>, Vec<String>) {
        let (mut out, mut bad) = (Vec::new(), Vec::new());
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return (out, bad);
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(uid) = name.strip_suffix(".json").filter(|u| super::is_uid(u)) else {
                continue;
            };
            match self.get(uid) {
                Ok(c) => out.push((uid.to_string(), c)),
                Err(err) => bad.push(err.to_string()),
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        (out, bad)
    }
}
