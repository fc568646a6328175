//! Which claims hold GPUs and who uses them, as bookings for the ledger.
//!
//! A Bound [`ElasticGpu`] whose class retains it keeps its devices booked for its claim while no
//! pod uses the claim (the ledger key `egpu/<name>`); while a pod uses the claim, the pod's own
//! booking covers them. Feeding this from the ElasticGPU and pod watches in any order converges
//! to the same bookings, so a restarted extender books every retained GPU exactly once.

use std::collections::HashMap;
use std::sync::Arc;

use tessera_api::class::ReclaimPolicy;
use tessera_api::egpu::{ElasticGpu, ElasticGpuPhase};
use tessera_core::handoff::{AllocatedDevice, Allocation, ContainerAllocation};
use tessera_core::ledger::{Booking, Hold};
use tessera_core::placement::{CARD_MILLI, CardDemand, ContainerDemand, PodDemand, Tenant};
use tessera_core::request::{ContainerRole, GpuDemand};
use tracing::warn;

/// A claim, as `namespace/name`.
pub type ClaimKey = String;

/// A claim's Bound ElasticGPU.
#[derive(Debug, Clone, PartialEq)]
pub struct HeldGpu {
    /// The ElasticGPU's name.
    pub egpu: String,
    /// Its node.
    pub node: String,
    /// Its devices.
    pub devices: Vec<AllocatedDevice>,
    /// Its class retains it when its pod goes.
    pub retain: bool,
}

impl HeldGpu {
    /// Whether its devices are what a container asking `demand` would be given (a claim edited
    /// since its GPU was retained is not).
    pub fn serves(&self, demand: &GpuDemand) -> bool {
        match demand {
            GpuDemand::None => false,
            GpuDemand::Share(share) => matches!(
                self.devices.as_slice(),
                [AllocatedDevice::Gpu { exclusive: false, core_percent, memory_mib, .. }]
                    if *core_percent == share.core_percent && share.memory_mib.is_none_or(|m| m == *memory_mib)
            ),
            GpuDemand::Whole { cards, min_memory_mib } => {
                self.devices.len() == *cards as usize
                    && self.devices.iter().all(|d| {
                        matches!(d, AllocatedDevice::Gpu { exclusive: true, memory_mib, .. }
                            if min_memory_mib.is_none_or(|m| *memory_mib >= m))
                    })
            }
            GpuDemand::Mig(wanted) => {
                let mut have: Vec<String> = self
                    .devices
                    .iter()
                    .filter_map(|d| match d {
                        AllocatedDevice::Mig { profile, .. } => Some(profile.to_string()),
                        AllocatedDevice::Gpu { .. } => None,
                    })
                    .collect();
                let mut want: Vec<String> = wanted
                    .iter()
                    .flat_map(|m| std::iter::repeat_n(m.profile.to_string(), m.count as usize))
                    .collect();
                have.sort();
                want.sort();
                have.len() == self.devices.len() && have == want
            }
        }
    }
}

/// Who uses a claim now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimUser {
    /// The pod's UID.
    pub uid: String,
    /// `namespace/name`.
    pub pod: String,
}

/// What the ledger must do after a change.
#[derive(Debug, Default)]
pub struct LedgerChange {
    /// Keys to unbook.
    pub unbook: Vec<String>,
    /// Bookings to make.
    pub book: Vec<(String, Booking)>,
}

/// Which tenant each namespace's pods belong to (the scheduler's namespace watch knows).
pub trait TenantOf: Send + Sync + std::fmt::Debug {
    /// The tenant of `namespace`'s pods.
    fn tenant_of(&self, namespace: &str) -> Tenant;
}

/// Every namespace a tenant of its own (no namespace grouped with another).
#[derive(Debug, Default)]
pub struct OwnNamespace;

impl TenantOf for OwnNamespace {
    fn tenant_of(&self, namespace: &str) -> Tenant {
        Tenant::of_namespace(namespace, None)
    }
}

/// The claims' GPUs and users.
#[derive(Debug)]
pub struct ClaimHolds {
    /// Each namespace's tenant (a retained share keeps its card to its claim's tenant).
    tenants: Arc<dyn TenantOf>,
    gpus: HashMap<ClaimKey, HeldGpu>,
    users: HashMap<ClaimKey, ClaimUser>,
    by_pod: HashMap<String, Vec<ClaimKey>>,
}

/// The ledger key of an ElasticGPU's booking (not a pod UID, so never one).
pub fn booking_key(egpu: &str) -> String {
    format!("egpu/{egpu}")
}

/// True for the ledger keys of ElasticGPU bookings.
pub fn is_booking_key(key: &str) -> bool {
    key.starts_with("egpu/")
}

/// The one-container booking of a held GPU.
fn held_booking(key: &ClaimKey, g: &HeldGpu, tenant: Tenant) -> Booking {
    let container = format!("claim:{key}");
    let cards = match g.devices.first() {
        Some(AllocatedDevice::Mig { .. }) => CardDemand::Mig(
            g.devices
                .iter()
                .filter_map(|d| match d {
                    AllocatedDevice::Mig { profile, .. } => Some((profile.clone(), 1)),
                    AllocatedDevice::Gpu { .. } => None,
                })
                .collect(),
        ),
        Some(AllocatedDevice::Gpu {
            exclusive: false,
            core_percent,
            memory_mib,
            ..
        }) => CardDemand::Share {
            core_milli: core_percent * CARD_MILLI / 100,
            memory_mib: Some(*memory_mib),
        },
        _ => CardDemand::Whole {
            cards: g.devices.len() as u32,
            min_memory_mib: None,
        },
    };
    let mut allocation = Allocation::new(g.node.clone(), booking_key(&g.egpu));
    allocation.containers.push(ContainerAllocation {
        name: container.clone(),
        role: ContainerRole::App,
        devices: g.devices.clone(),
    });
    Booking {
        node: g.node.clone(),
        demand: PodDemand {
            containers: vec![ContainerDemand {
                name: container,
                role: ContainerRole::App,
                cards,
                run_as_user: None,
            }],
            phases: vec![vec![0]],
            tenant,
            ..Default::default()
        },
        allocation: Some(allocation),
        hold: Hold::Bound,
    }
}

impl Default for ClaimHolds {
    /// No claims yet; every namespace a tenant of its own.
    fn default() -> Self {
        Self::with_tenants(Arc::new(OwnNamespace))
    }
}

impl ClaimHolds {
    /// No claims yet; tenants as `tenants` says.
    pub fn with_tenants(tenants: Arc<dyn TenantOf>) -> Self {
        Self {
            tenants,
            gpus: HashMap::new(),
            users: HashMap::new(),
            by_pod: HashMap::new(),
        }
    }

    /// The booking a claim's GPU needs now: retained and unused.
    fn wanted(&self, key: &ClaimKey) -> Option<(String, Booking)> {
        let g = self.gpus.get(key)?;
        // The claim's namespace: a retained share keeps its card to that namespace's tenant.
        let tenant = self.tenants.tenant_of(key.split_once('/').map_or("", |(ns, _)| ns));
        (g.retain && !self.users.contains_key(key)).then(|| (booking_key(&g.egpu), held_booking(key, g, tenant)))
    }

    /// Runs `f`, then says how the bookings of `keys` changed.
    fn changing(&mut self, keys: &[ClaimKey], f: impl FnOnce(&mut Self)) -> LedgerChange {
        let before: Vec<_> = keys.iter().map(|k| self.wanted(k)).collect();
        f(self);
        let mut change = LedgerChange::default();
        for (k, was) in keys.iter().zip(before) {
            let now = self.wanted(k);
            if was.as_ref().map(|w| (&w.0, &w.1)) == now.as_ref().map(|n| (&n.0, &n.1)) {
                continue;
            }
            change.unbook.extend(was.map(|w| w.0));
            change.book.extend(now);
        }
        change
    }

    /// An ElasticGPU was added or changed.
    pub fn gpu_applied(&mut self, e: &ElasticGpu) -> LedgerChange {
        let Some(name) = e.metadata.name.clone() else {
            return LedgerChange::default();
        };
        let key = format!("{}/{}", e.spec.claim_ref.namespace, e.spec.claim_ref.name);
        let held = match (e.phase(), e.allocated_devices()) {
            (ElasticGpuPhase::Bound, Ok(devices)) if !devices.is_empty() => Some(HeldGpu {
                egpu: name.clone(),
                node: e.spec.node_name.clone(),
                devices,
                retain: e.spec.reclaim_policy == ReclaimPolicy::Retain,
            }),
            (ElasticGpuPhase::Bound, Err(err)) => {
                warn!(elastic_gpu = name, error = %err, "not booking an ElasticGPU whose devices do not read");
                None
            }
            _ => None,
        };
        // Another of the claim's ElasticGPUs may be named; only this one's entry changes.
        let mut keys = vec![key.clone()];
        keys.extend(self.key_of(&name).filter(|k| *k != key));
        self.changing(&keys, |s| {
            s.gpus.retain(|_, g| g.egpu != name);
            if let Some(h) = held {
                s.gpus.insert(key, h);
            }
        })
    }

    fn key_of(&self, egpu: &str) -> Option<ClaimKey> {
        self.gpus.iter().find(|(_, g)| g.egpu == egpu).map(|(k, _)| k.clone())
    }

    /// An ElasticGPU was deleted.
    pub fn gpu_deleted(&mut self, egpu: &str) -> LedgerChange {
        let keys: Vec<ClaimKey> = self.key_of(egpu).into_iter().collect();
        self.changing(&keys, |s| s.gpus.retain(|_, g| g.egpu != egpu))
    }

    /// A full list was read: ElasticGPUs not in `names` are gone.
    pub fn gpus_listed(&mut self, names: &std::collections::HashSet<String>) -> LedgerChange {
        let keys: Vec<ClaimKey> = self
            .gpus
            .iter()
            .filter(|(_, g)| !names.contains(&g.egpu))
            .map(|(k, _)| k.clone())
            .collect();
        self.changing(&keys, |s| s.gpus.retain(|_, g| names.contains(&g.egpu)))
    }

    /// Pod `uid` (`pod` = `namespace/name`) uses `claims` (bound, or being bound by us).
    pub fn use_claims(&mut self, uid: &str, pod: &str, claims: Vec<ClaimKey>) -> LedgerChange {
        let mut keys = claims.clone();
        keys.extend(self.by_pod.get(uid).into_iter().flatten().cloned());
        self.changing(&keys, |s| {
            s.drop_user(uid);
            for k in &claims {
                s.users.insert(
                    k.clone(),
                    ClaimUser {
                        uid: uid.to_string(),
                        pod: pod.to_string(),
                    },
                );
            }
            if !claims.is_empty() {
                s.by_pod.insert(uid.to_string(), claims);
            }
        })
    }

    fn drop_user(&mut self, uid: &str) {
        for k in self.by_pod.remove(uid).into_iter().flatten() {
            if self.users.get(&k).is_some_and(|u| u.uid == uid) {
                self.users.remove(&k);
            }
        }
    }

    /// Pod `uid` no longer uses its claims (it finished, was deleted, or its bind failed).
    pub fn release_pod(&mut self, uid: &str) -> LedgerChange {
        let keys = self.by_pod.get(uid).cloned().unwrap_or_default();
        self.changing(&keys, |s| s.drop_user(uid))
    }

    /// A full pod list was read: users not in `uids` are gone.
    pub fn pods_listed(&mut self, uids: &std::collections::HashSet<String>) -> LedgerChange {
        let gone: Vec<String> = self.by_pod.keys().filter(|u| !uids.contains(*u)).cloned().collect();
        let mut change = LedgerChange::default();
        for uid in gone {
            let c = self.release_pod(&uid);
            change.unbook.extend(c.unbook);
            change.book.extend(c.book);
        }
        change
    }

    /// The claim's Bound GPU, if any.
    pub fn gpu(&self, key: &str) -> Option<&HeldGpu> {
        self.gpus.get(key)
    }

    /// Who uses the claim now, if anyone.
    pub fn user(&self, key: &str) -> Option<&ClaimUser> {
        self.users.get(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_api::egpu::{ClaimRef, ElasticGpuSpec, ElasticGpuStatus, GpuDevice};

    fn egpu(name: &str, claim: &str, retain: bool, phase: ElasticGpuPhase) -> ElasticGpu {
        let mut e = ElasticGpu::new(
            name,
            ElasticGpuSpec {
                node_name: "n1".into(),
                claim_ref: ClaimRef {
                    namespace: "ml".into(),
                    name: claim.into(),
                    uid: "u".into(),
                },
                reclaim_policy: if retain {
                    ReclaimPolicy::Retain
                } else {
                    ReclaimPolicy::Delete
                },
                devices: vec![GpuDevice {
                    uuid: "GPU-a".into(),
                    minor: Some(0),
                    core_percent: 10,
                    memory_mib: 4096,
                    ..Default::default()
                }],
                ..Default::default()
            },
        );
        e.status = Some(ElasticGpuStatus {
            phase,
            ..Default::default()
        });
        e
    }

    /// Replays `change` onto a set of booked keys.
    fn replay(booked: &mut Vec<String>, change: LedgerChange) {
        booked.retain(|k| !change.unbook.contains(k));
        booked.extend(change.book.into_iter().map(|(k, _)| k));
        booked.sort();
    }

    #[test]
    fn a_retained_gpu_is_booked_only_while_no_pod_uses_its_claim_in_any_order() {
        let e = egpu("egpu-u", "c", true, ElasticGpuPhase::Bound);
        // GPU first, then its pod.
        let (mut a, mut booked_a) = (ClaimHolds::default(), Vec::new());
        replay(&mut booked_a, a.gpu_applied(&e));
        assert_eq!(booked_a, ["egpu/egpu-u"]);
        replay(&mut booked_a, a.use_claims("p1", "ml/p", vec!["ml/c".into()]));
        assert!(booked_a.is_empty());
        // Pod first, then its GPU (a restarted extender reads them in either order).
        let (mut b, mut booked_b) = (ClaimHolds::default(), Vec::new());
        replay(&mut booked_b, b.use_claims("p1", "ml/p", vec!["ml/c".into()]));
        replay(&mut booked_b, b.gpu_applied(&e));
        assert_eq!(booked_a, booked_b);
        // The pod goes: the GPU is booked again, for its claim.
        replay(&mut booked_b, b.release_pod("p1"));
        assert_eq!(booked_b, ["egpu/egpu-u"]);
        assert!(b.user("ml/c").is_none());
        // Released (its claim deleted): no longer booked; deleted: nothing left.
        replay(
            &mut booked_b,
            b.gpu_applied(&egpu("egpu-u", "c", true, ElasticGpuPhase::Released)),
        );
        assert!(booked_b.is_empty() && b.gpu("ml/c").is_none());
    }

    #[test]
    fn a_retained_gpu_serves_only_the_demand_it_was_given_for() {
        use tessera_core::request::GpuShare;
        let mut h = ClaimHolds::default();
        h.gpu_applied(&egpu("egpu-u", "c", true, ElasticGpuPhase::Bound));
        let g = h.gpu("ml/c").unwrap();
        let share = |core, mem| {
            GpuDemand::Share(GpuShare {
                core_percent: core,
                memory_mib: mem,
            })
        };
        assert!(g.serves(&share(10, Some(4096))) && g.serves(&share(10, None)));
        assert!(!g.serves(&share(20, Some(4096))) && !g.serves(&share(10, Some(8192))));
        assert!(!g.serves(&GpuDemand::Whole {
            cards: 1,
            min_memory_mib: None
        }));
    }

    #[test]
    fn a_deleted_class_gpu_is_never_booked_and_a_relist_drops_what_is_gone() {
        let mut h = ClaimHolds::default();
        let mut booked = Vec::new();
        replay(
            &mut booked,
            h.gpu_applied(&egpu("egpu-d", "d", false, ElasticGpuPhase::Bound)),
        );
        assert!(booked.is_empty() && h.gpu("ml/d").is_some());
        replay(
            &mut booked,
            h.gpu_applied(&egpu("egpu-r", "r", true, ElasticGpuPhase::Bound)),
        );
        assert_eq!(booked, ["egpu/egpu-r"]);
        replay(&mut booked, h.gpus_listed(&["egpu-d".to_string()].into()));
        assert!(booked.is_empty() && h.gpu("ml/r").is_none());
        // A user that a pod list no longer has is gone.
        replay(&mut booked, h.use_claims("p", "ml/p", vec!["ml/d".into()]));
        assert!(h.user("ml/d").is_some());
        replay(&mut booked, h.pods_listed(&Default::default()));
        assert!(h.user("ml/d").is_none());
    }
}
