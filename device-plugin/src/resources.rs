//! The resource manager: which devices each resource advertises, what Allocate answers, and
//! preferred allocations. Pure functions of the inventory and health, table-tested.

use std::collections::{BTreeMap, BTreeSet};

use tessera_core::inventory::NodeInventory;
use tessera_core::names::{RESOURCE_GPU_CORE, RESOURCE_GPU_MEMORY};

use crate::health::HealthState;

/// Annotation prefix of Allocate's answers (`tessera.io/allocated.gpu-core`).
pub const ALLOCATED_PREFIX: &str = "tessera.io/allocated.";
/// `tessera.io/gpu-core` devices per card (one per percent).
pub const CORE_UNITS_PER_CARD: usize = 100;
/// Kubelet's health strings.
pub const HEALTHY: &str = "Healthy";
/// Kubelet's health strings.
pub const UNHEALTHY: &str = "Unhealthy";

/// One advertised device.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Unit {
    /// Device ID (at most 63 characters).
    pub id: String,
    /// Healthy.
    pub healthy: bool,
    /// NUMA node.
    pub numa: Option<u32>,
}

/// What the node advertises: resource name -> devices.
pub type Advertised = BTreeMap<String, Vec<Unit>>;

/// Computes every resource's devices.
pub fn advertise(inv: &NodeInventory, health: &HealthState, memory_unit_mib: u64) -> Advertised {
    let mut out: Advertised = BTreeMap::new();
    for gpu in &inv.gpus {
        let healthy = gpu.health.is_healthy() && health.is_healthy(&gpu.uuid);
        if gpu.mig_enabled {
            for m in &gpu.mig_devices {
                out.entry(m.profile.resource_name()).or_default().push(Unit {
                    id: m.uuid.clone(),
                    healthy: healthy && health.is_healthy(&m.uuid),
                    numa: gpu.numa_node,
                });
            }
            continue;
        }
        let core = out.entry(RESOURCE_GPU_CORE.to_string()).or_default();
        for n in 0..CORE_UNITS_PER_CARD {
            core.push(Unit {
                id: format!("{}-c{n:02}", gpu.uuid),
                healthy,
                numa: gpu.numa_node,
            });
        }
        let memory = out.entry(RESOURCE_GPU_MEMORY.to_string()).or_default();
        for n in 0..gpu.memory_mib / memory_unit_mib.max(1) {
            memory.push(Unit {
                id: format!("{}-m{n}", gpu.uuid),
                healthy,
                numa: gpu.numa_node,
            });
        }
    }
    out
}

/// The resource suffix used in annotation keys (`gpu-core`, `mig-1g.10gb`).
pub fn suffix(resource: &str) -> &str {
    resource.strip_prefix("tessera.io/").unwrap_or(resource)
}

/// Why an Allocate request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocateError {
    /// A container request with no device.
    #[error("container request {index} for {resource} lists no device")]
    Empty { resource: String, index: usize },
    /// A device ID this plugin does not advertise.
    #[error("container request {index} for {resource}: unknown device {id:?}")]
    Unknown { resource: String, index: usize, id: String },
    /// The same device twice.
    #[error("container request {index} for {resource}: device {id:?} listed twice")]
    Duplicate { resource: String, index: usize, id: String },
}

/// Allocate's annotations for one container request: the amount (units) and, for MIG, the
/// device IDs; for memory also the amount in MiB. The NRI plugin cross-checks them with the
/// hand-off.
pub fn allocate_annotations(
    resource: &str,
    index: usize,
    ids: &[String],
    known: &BTreeSet<String>,
    memory_unit_mib: u64,
) -> Result<BTreeMap<String, String>, AllocateError> {
    if ids.is_empty() {
        return Err(AllocateError::Empty {
            resource: resource.into(),
            index,
        });
    }
    let mut seen = BTreeSet::new();
    for id in ids {
        if !known.contains(id) {
            return Err(AllocateError::Unknown {
                resource: resource.into(),
                index,
                id: id.clone(),
            });
        }
        if !seen.insert(id) {
            return Err(AllocateError::Duplicate {
                resource: resource.into(),
                index,
                id: id.clone(),
            });
        }
    }
    let key = format!("{ALLOCATED_PREFIX}{}", suffix(resource));
    let mut out = BTreeMap::from([(key.clone(), ids.len().to_string())]);
    if resource == RESOURCE_GPU_MEMORY {
        out.insert(format!("{key}-mib"), (ids.len() as u64 * memory_unit_mib).to_string());
    } else if resource != RESOURCE_GPU_CORE {
        out.insert(format!("{key}.ids"), ids.join(","));
    }
    Ok(out)
}

/// The card a core or memory unit belongs to (`GPU-...-c07` -> `GPU-...`).
fn card_of(id: &str) -> &str {
    id.rsplit_once('-').map_or(id, |(card, _)| card)
}

/// Preferred allocation for core/memory units. A request of whole cards' worth of core units
/// (200 = two cards) gets whole idle cards, the set the extender's card tier chooses for the
/// same idle cards (`NodeState::choose_cards`: best connected, then leaving connected groups
/// whole). Otherwise the must-include units, then units of the card that has them or, failing
/// that, the card with the fewest available units that can supply all that is missing (one
/// card per share), then any.
pub fn preferred(
    cards: Option<&NodeInventory>,
    available: &[String],
    must_include: &[String],
    size: usize,
) -> Vec<String> {
    if let Some(inv) = cards
        && must_include.is_empty()
        && let Some(whole) = whole_cards(inv, available, size)
    {
        return whole;
    }
    let mut chosen: Vec<String> = must_include.iter().take(size).cloned().collect();
    let mut by_card: BTreeMap<&str, Vec<&String>> = BTreeMap::new();
    for id in available.iter().filter(|id| !chosen.contains(id)) {
        by_card.entry(card_of(id)).or_default().push(id);
    }
    let missing = size.saturating_sub(chosen.len());
    let preferred_card = chosen
        .first()
        .map(|c| card_of(c).to_string())
        .filter(|c| by_card.get(c.as_str()).is_some_and(|v| v.len() >= missing))
        .or_else(|| {
            by_card
                .iter()
                .filter(|(_, v)| v.len() >= missing)
                .min_by_key(|(_, v)| v.len())
                .map(|(c, _)| c.to_string())
        });
    if let Some(card) = preferred_card
        && let Some(units) = by_card.get_mut(card.as_str())
    {
        chosen.extend(units.drain(..missing.min(units.len())).cloned());
    }
    for units in by_card.values() {
        for id in units {
            if chosen.len() >= size {
                break;
            }
            chosen.push((*id).clone());
        }
    }
    chosen.truncate(size);
    chosen
}

/// `size` core units as whole idle cards (every unit available), when `size` is a whole number
/// of cards and enough cards are idle.
fn whole_cards(inv: &NodeInventory, available: &[String], size: usize) -> Option<Vec<String>> {
    if size < CORE_UNITS_PER_CARD || !size.is_multiple_of(CORE_UNITS_PER_CARD) {
        return None;
    }
    let mut by_card: BTreeMap<&str, Vec<&String>> = BTreeMap::new();
    for id in available {
        by_card.entry(card_of(id)).or_default().push(id);
    }
    let idle: Vec<usize> = (0..inv.gpus.len())
        .filter(|&i| {
            by_card
                .get(inv.gpus[i].uuid.as_str())
                .is_some_and(|u| u.len() == CORE_UNITS_PER_CARD)
        })
        .collect();
    let set =
        tessera_core::topology::choose_set(|a, b| inv.link(a, b), &idle, size / CORE_UNITS_PER_CARD, None).ok()?;
    Some(
        set.cards
            .iter()
            .flat_map(|&i| by_card[inv.gpus[i].uuid.as_str()].iter().map(|id| (*id).clone()))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use tessera_core::inventory::{FixtureSource, InventorySource};

    use super::*;

    fn counts(fixture: &str) -> BTreeMap<String, usize> {
        let inv = FixtureSource::new(fixture).discover().unwrap();
        advertise(&inv, &HealthState::default(), 1024)
            .into_iter()
            .map(|(k, v)| (k, v.len()))
            .collect()
    }

    #[test]
    fn counts_per_fixture() {
        let c = counts("h100x8");
        assert_eq!(
            c,
            BTreeMap::from([
                ("tessera.io/gpu-core".into(), 800),
                ("tessera.io/gpu-memory".into(), 8 * 79)
            ])
        );
        let c = counts("t4x2");
        assert_eq!(
            c,
            BTreeMap::from([
                ("tessera.io/gpu-core".into(), 200),
                ("tessera.io/gpu-memory".into(), 30)
            ])
        );
        let c = counts("a100-mig");
        assert_eq!(
            c,
            BTreeMap::from([
                ("tessera.io/gpu-core".into(), 100),
                ("tessera.io/gpu-memory".into(), 40),
                ("tessera.io/mig-1g.5gb".into(), 9),
                ("tessera.io/mig-2g.10gb".into(), 1),
                ("tessera.io/mig-3g.20gb".into(), 2),
                ("tessera.io/mig-4g.20gb".into(), 1),
            ])
        );
    }

    #[test]
    fn ids_fit_kubelet_limits_and_carry_numa() {
        let inv = FixtureSource::new("h100x8").discover().unwrap();
        let a = advertise(&inv, &HealthState::default(), 256);
        for units in a.values() {
            assert!(units.iter().all(|u| u.id.len() <= 63), "{:?}", units[0]);
        }
        assert_eq!(a["tessera.io/gpu-memory"].len(), 8 * 318);
        assert_eq!(a["tessera.io/gpu-core"][0].numa, Some(0));
        assert_eq!(a["tessera.io/gpu-core"][799].numa, Some(1));
    }

    #[test]
    fn allocate_annotations_and_errors() {
        let known: BTreeSet<String> = ["GPU-a-c00", "GPU-a-c01", "GPU-a-m0"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let ids = vec!["GPU-a-c00".to_string(), "GPU-a-c01".to_string()];
        let a = allocate_annotations("tessera.io/gpu-core", 0, &ids, &known, 1024).unwrap();
        assert_eq!(
            a,
            BTreeMap::from([("tessera.io/allocated.gpu-core".into(), "2".into())])
        );
        let a = allocate_annotations("tessera.io/gpu-memory", 0, &["GPU-a-m0".into()], &known, 1024).unwrap();
        assert_eq!(a["tessera.io/allocated.gpu-memory-mib"], "1024");
        let known_mig: BTreeSet<String> = ["MIG-1".to_string(), "MIG-2".to_string()].into();
        let a = allocate_annotations(
            "tessera.io/mig-1g.5gb",
            0,
            &["MIG-1".into(), "MIG-2".into()],
            &known_mig,
            1024,
        )
        .unwrap();
        assert_eq!(a["tessera.io/allocated.mig-1g.5gb.ids"], "MIG-1,MIG-2");
        assert!(matches!(
            allocate_annotations("r", 3, &[], &known, 1),
            Err(AllocateError::Empty { index: 3, .. })
        ));
        let e = allocate_annotations("r", 1, &["nope".into()], &known, 1).unwrap_err();
        assert_eq!(e.to_string(), "container request 1 for r: unknown device \"nope\"");
        assert!(matches!(
            allocate_annotations("r", 0, &["GPU-a-c00".into(), "GPU-a-c00".into()], &known, 1),
            Err(AllocateError::Duplicate { .. })
        ));
    }

    #[test]
    fn preferred_units_come_from_one_card() {
        let ids = |card: &str, n: usize| (0..n).map(|i| format!("{card}-c{i:02}")).collect::<Vec<_>>();
        let mut available = ids("GPU-a", 50);
        available.extend(ids("GPU-b", 20));
        available.extend(ids("GPU-c", 90));
        let p = preferred(None, &available, &[], 30);
        assert_eq!(p.len(), 30);
        assert!(
            p.iter().all(|id| id.starts_with("GPU-a-")),
            "fewest units that still fit: {p:?}"
        );
        let p = preferred(None, &available, &["GPU-c-c05".into()], 10);
        assert!(p.iter().all(|id| id.starts_with("GPU-c-")), "{p:?}");
        let p = preferred(None, &available, &[], 150);
        assert_eq!(p.len(), 150);
    }

    /// Whole cards' worth of core units: whole idle cards, the set the extender's card tier
    /// (`NodeState::choose_cards`) picks for the same idle cards, on each topology fixture.
    #[test]
    fn whole_card_requests_get_the_extenders_set() {
        use std::sync::Arc;
        use tessera_core::placement::{ClusterState, NodeState};
        for fixture in ["a100-nvlink-pairs", "l40s-pcie-switches", "h100-nvswitch", "h100x8"] {
            let inv = FixtureSource::new(fixture).discover().unwrap();
            let mut cluster = ClusterState::new();
            let node = NodeState {
                name: fixture.into(),
                cpu_milli: 1,
                cpu_used: 0,
                memory_bytes: 1,
                memory_used: 0,
                cards: cluster.cards_from_inventory(&inv.gpus),
                schedulable: true,
                enforcement: Default::default(),
                cross_tenant: false,
                topology: inv.topology.clone().map(Arc::new),
            };
            let units = advertise(&inv, &HealthState::default(), 1024);
            let n = inv.gpus.len();
            for (taken, want) in [(vec![], 2), (vec![0], 2), (vec![0, 2], 2), (vec![1], 3), (vec![], 4)] {
                if want + taken.len() > n {
                    continue;
                }
                // A share on each taken card: some of its units are gone.
                let available: Vec<String> = units["tessera.io/gpu-core"]
                    .iter()
                    .filter(|u| {
                        let card = inv.gpus.iter().position(|g| u.id.starts_with(&g.uuid)).unwrap();
                        !(taken.contains(&card) && u.id.ends_with("-c00"))
                    })
                    .map(|u| u.id.clone())
                    .collect();
                let p = preferred(Some(&inv), &available, &[], want * CORE_UNITS_PER_CARD);
                let mut cards: Vec<usize> = p
                    .iter()
                    .map(|id| inv.gpus.iter().position(|g| card_of(id) == g.uuid).unwrap())
                    .collect();
                cards.dedup();
                let idle: Vec<usize> = (0..n).filter(|i| !taken.contains(i)).collect();
                let extender = node.choose_cards(&idle, want, None).unwrap().cards;
                assert_eq!(cards, extender, "{fixture}, cards {taken:?} in use, {want} wanted");
                assert_eq!(p.len(), want * CORE_UNITS_PER_CARD);
            }
        }
        // Not a whole number of cards, or no inventory yet: units as before.
        let inv = FixtureSource::new("a100-nvlink-pairs").discover().unwrap();
        let ids: Vec<String> = (0..100).map(|i| format!("{}-c{i:02}", inv.gpus[5].uuid)).collect();
        assert_eq!(preferred(Some(&inv), &ids, &[], 30).len(), 30);
        assert_eq!(preferred(None, &ids, &[], 100), ids);
    }
}
