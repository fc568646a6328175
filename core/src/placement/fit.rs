//! Card tier: which cards of one node a pod's containers get, and why a node cannot take a pod.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::mig::MigProfile;
use crate::topology::LinkRequirement;

use super::demand::{CardDemand, PodDemand};
use super::state::{CARD_MILLI, NodeState, ShareOwner, ShareRefusal};
use crate::names::LABEL_CROSS_TENANT_SHARING;

/// One card (or MIG device) given to a container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CardAssign {
    /// Card position on the node.
    pub card: usize,
    /// Compute, milli (1000 for whole cards, 0 for MIG).
    pub core_milli: u32,
    /// Memory, MiB.
    pub memory_mib: u64,
    /// Whole, exclusive card.
    pub exclusive: bool,
    /// MIG slot on the card, for MIG devices.
    pub mig_slot: Option<usize>,
}

/// The cards one container gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerPlacement {
    /// Index into [`PodDemand::containers`].
    pub container: usize,
    /// Its cards, in the order it sees them.
    pub cards: Vec<CardAssign>,
}

/// What a pod takes of one card: the maximum over its phases (see `request`'s module docs).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CardUsage {
    /// Compute, milli.
    pub core_milli: u32,
    /// Memory, MiB.
    pub memory_mib: u64,
    /// MIG slots taken.
    pub mig_slots: Vec<usize>,
    /// Who the pod's share on this card belongs to; `None` when the pod has no share here.
    pub share_user: Option<ShareOwner>,
}

/// A pod's usage of a node's cards, by card position.
pub type PodUsage = BTreeMap<usize, CardUsage>;

/// A complete plan for a pod on one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodePlan {
    /// Per container.
    pub containers: Vec<ContainerPlacement>,
    /// Per card, what is committed.
    pub usage: PodUsage,
}

/// Picks the card for one share among the cards that fit (positions on the node); the
/// engine's card-tier policy.
pub trait ShareChooser {
    /// `candidates` is non-empty; `free` gives each card's (compute, memory) free now.
    fn choose(
        &mut self,
        node: &NodeState,
        free: &[(u32, u64)],
        candidates: &[usize],
        core: u32,
        memory: &[u64],
    ) -> usize;
}

/// The memory a share of `core` milli takes on a card of `card_mib`: what it names, else the
/// same proportion of the card's memory.
pub(super) fn share_memory(memory_mib: Option<u64>, card_mib: u64, core: u32) -> u64 {
    match memory_mib {
        Some(m) => m,
        None => card_mib * u64::from(core) / u64::from(CARD_MILLI),
    }
}

/// `46%`, `0.5%`: compute in milli as a percentage of one card.
pub(super) fn pct(milli: u32) -> String {
    if milli.is_multiple_of(10) {
        format!("{}%", milli / 10)
    } else {
        format!("{:.1}%", f64::from(milli) / 10.0)
    }
}

/// `8 GiB`, `7.5 GiB`.
pub(super) fn gib(mib: u64) -> String {
    if mib.is_multiple_of(1024) {
        format!("{} GiB", mib / 1024)
    } else {
        format!("{:.1} GiB", mib as f64 / 1024.0)
    }
}

/// Checks CPU and memory; the error is a human-readable reason.
pub fn check_node_resources(node: &NodeState, pod: &PodDemand) -> Result<(), String> {
    if !node.schedulable {
        return Err("node is not schedulable".into());
    }
    if node.cpu_free() < pod.cpu_milli {
        return Err(format!(
            "insufficient cpu: {}m free, needs {}m",
            node.cpu_free(),
            pod.cpu_milli
        ));
    }
    if node.memory_free() < pod.memory_bytes {
        return Err(format!(
            "insufficient memory: {} free, needs {}",
            gib(node.memory_free() >> 20),
            gib(pod.memory_bytes.div_ceil(1 << 20))
        ));
    }
    Ok(())
}

/// Plans every phase of `pod` on `node`. Each phase is placed against the node as it is
/// without the pod (phases never run together); init phases prefer the cards the app phase
/// already took, so that the per-card maximum does not grow.
pub fn plan_node(
    node: &NodeState,
    pod: &PodDemand,
    allowed: &[bool],
    chooser: &mut dyn ShareChooser,
) -> Result<NodePlan, String> {
    check_node_resources(node, pod)?;
    pod.enforcement_ok(node.enforcement)?;
    let mut usage = PodUsage::new();
    let mut containers = Vec::new();
    // The app phase is listed last; plan it first.
    for phase in pod.phases.iter().rev() {
        let mut free: Vec<(u32, u64)> = node.cards.iter().map(|c| (c.core_free(), c.memory_free())).collect();
        let mut slot_taken: Vec<Vec<bool>> = node
            .cards
            .iter()
            .map(|c| {
                c.mig
                    .as_ref()
                    .map_or_else(Vec::new, |s| s.iter().map(|m| m.used).collect())
            })
            .collect();
        let mut busy = vec![false; node.cards.len()];
        let mut phase_usage = PodUsage::new();
        for &ci in phase {
            let owner = ShareOwner {
                uid: pod.containers[ci].run_as_user,
                tenant: pod.tenant,
            };
            let cards = place_container(
                node,
                &pod.containers[ci].cards,
                owner,
                allowed,
                &mut free,
                &mut slot_taken,
                &mut busy,
                &usage,
                chooser,
                pod.gpu_link,
            )
            .map_err(|reason| {
                if pod.containers.len() > 1 {
                    format!("container {:?}: {reason}", pod.containers[ci].name)
                } else {
                    reason
                }
            })?;
            for a in &cards {
                let u = phase_usage.entry(a.card).or_default();
                u.core_milli += a.core_milli;
                u.memory_mib += a.memory_mib;
                u.mig_slots.extend(a.mig_slot);
                if !a.exclusive {
                    u.share_user = u.share_user.or(Some(owner));
                }
            }
            containers.push(ContainerPlacement { container: ci, cards });
        }
        for (card, u) in phase_usage {
            let merged = usage.entry(card).or_default();
            merged.core_milli = merged.core_milli.max(u.core_milli);
            merged.memory_mib = merged.memory_mib.max(u.memory_mib);
            merged.share_user = merged.share_user.or(u.share_user);
            for s in u.mig_slots {
                if !merged.mig_slots.contains(&s) {
                    merged.mig_slots.push(s);
                }
            }
        }
    }
    containers.sort_by_key(|c| c.container);
    Ok(NodePlan { containers, usage })
}

#[allow(clippy::too_many_arguments)]
fn place_container(
    node: &NodeState,
    demand: &CardDemand,
    owner: ShareOwner,
    allowed: &[bool],
    free: &mut [(u32, u64)],
    slot_taken: &mut [Vec<bool>],
    busy: &mut [bool],
    prior: &PodUsage,
    chooser: &mut dyn ShareChooser,
    require: Option<LinkRequirement>,
) -> Result<Vec<CardAssign>, String> {
    let model_ok = |i: usize| allowed.get(usize::from(node.cards[i].model)).copied().unwrap_or(false);
    let usable: Vec<usize> = (0..node.cards.len())
        .filter(|&i| !busy[i] && node.cards[i].healthy && model_ok(i))
        .collect();
    if usable.is_empty() {
        return Err(if node.cards.is_empty() {
            "node has no GPU".into()
        } else if !(0..node.cards.len()).any(model_ok) {
            "no card of an allowed model".into()
        } else {
            "no healthy card available".into()
        });
    }
    match demand {
        CardDemand::Share { core_milli, memory_mib } => {
            let compute: Vec<usize> = usable
                .iter()
                .copied()
                .filter(|&i| node.cards[i].mig.is_none())
                .collect();
            let need_mem: Vec<u64> = compute
                .iter()
                .map(|&i| share_memory(*memory_mib, node.cards[i].memory_mib, *core_milli))
                .collect();
            let roomy: Vec<usize> = compute
                .iter()
                .zip(&need_mem)
                .filter(|(i, m)| free[**i].0 >= *core_milli && free[**i].1 >= **m)
                .map(|(i, _)| *i)
                .collect();
            let fits: Vec<usize> = roomy
                .iter()
                .copied()
                .filter(|&i| node.cards[i].admits(node.enforcement, node.cross_tenant, owner).is_ok())
                .collect();
            if fits.is_empty() && !roomy.is_empty() {
                return Err(share_refused(node, roomy[0], owner));
            }
            if fits.is_empty() {
                let best = compute.iter().max_by_key(|&&i| (free[i].0, free[i].1));
                return Err(match best {
                    None => "every usable card is in MIG mode".into(),
                    Some(&b) => format!(
                        "best card has {} core, {} free; needs {}, {}",
                        pct(free[b].0),
                        gib(free[b].1),
                        pct(*core_milli),
                        memory_mib.map_or_else(|| "memory in proportion".to_string(), gib)
                    ),
                });
            }
            // Init phases: a card the pod already holds enough of costs nothing extra.
            let reuse: Vec<usize> = fits
                .iter()
                .copied()
                .filter(|i| prior.get(i).is_some_and(|u| u.core_milli >= *core_milli))
                .collect();
            let pool = if reuse.is_empty() { &fits } else { &reuse };
            let mems: Vec<u64> = pool
                .iter()
                .map(|&i| need_mem[compute.iter().position(|&c| c == i).expect("from compute")])
                .collect();
            let pick = if pool.len() == 1 {
                pool[0]
            } else {
                chooser.choose(node, free, pool, *core_milli, &mems)
            };
            let mem = share_memory(*memory_mib, node.cards[pick].memory_mib, *core_milli);
            // Not busy: another container of the pod may share the card too (its free
            // compute and memory are what limit it).
            free[pick].0 -= core_milli;
            free[pick].1 -= mem;
            Ok(vec![CardAssign {
                card: pick,
                core_milli: *core_milli,
                memory_mib: mem,
                exclusive: false,
                mig_slot: None,
            }])
        }
        CardDemand::Whole { cards, min_memory_mib } => {
            let idle: Vec<usize> = usable
                .iter()
                .copied()
                .filter(|&i| {
                    let c = &node.cards[i];
                    c.mig.is_none()
                        && free[i] == (CARD_MILLI, c.memory_mib)
                        && min_memory_mib.is_none_or(|m| c.memory_mib >= m)
                })
                .collect();
            // The best-connected set (see `topology::choose_set`): NVLink over one PCIe
            // switch over one NUMA node over cross-socket, then the set that leaves connected
            // groups whole.
            let chosen = node.choose_cards(&idle, *cards as usize, require)?.cards;
            Ok(chosen
                .into_iter()
                .map(|i| {
                    let mem = node.cards[i].memory_mib;
                    free[i] = (0, 0);
                    busy[i] = true;
                    CardAssign {
                        card: i,
                        core_milli: CARD_MILLI,
                        memory_mib: mem,
                        exclusive: true,
                        mig_slot: None,
                    }
                })
                .collect())
        }
        CardDemand::Mig(wants) => place_mig(node, wants, &usable, slot_taken),
    }
}

/// Why `card`, which has room for a share, does not take it from `owner`: the node keeps a
/// card's shares to one tenant, or MPS to one user.
pub(super) fn share_refused(node: &NodeState, card: usize, owner: ShareOwner) -> String {
    match node.cards[card].admits(node.enforcement, node.cross_tenant, owner) {
        Err(refusal) => share_refusal_text(refusal, owner.uid),
        Ok(()) => unreachable!("a card that admits the share is in fits"),
    }
}

/// Why every card with room refuses a share run as `uid`, the first one's `refusal`.
pub(super) fn share_refusal_text(refusal: ShareRefusal, uid: Option<u32>) -> String {
    let who = |u: Option<u32>| u.map_or_else(|| "an unnamed user".to_string(), |u| format!("uid {u}"));
    match refusal {
        ShareRefusal::OtherTenant => format!(
            "every card with room holds shares of another tenant; this node gives a card's shares \
             to one tenant (label it {LABEL_CROSS_TENANT_SHARING}=true to share cards between tenants)"
        ),
        ShareRefusal::OtherUser(other) => format!(
            "every card with room serves MPS clients of another user ({}); this container runs as {} \
             (MPS serves one user per card: set runAsUser alike, or use another node)",
            who(other),
            who(uid)
        ),
    }
}

/// MIG devices of the profiles `wants` names on `node`'s `usable` cards, each from the card
/// with the fewest free devices of its profile, marked in `slot_taken`.
fn place_mig(
    node: &NodeState,
    wants: &[(MigProfile, u32)],
    usable: &[usize],
    slot_taken: &mut [Vec<bool>],
) -> Result<Vec<CardAssign>, String> {
    let mut out = Vec::new();
    for (profile, count) in wants {
        for _ in 0..*count {
            // Fill the card with the fewest free devices of this profile first.
            let mut best: Option<(usize, usize, usize)> = None; // (free count, card, slot)
            for &i in usable {
                let Some(slots) = &node.cards[i].mig else { continue };
                let open: Vec<usize> = (0..slots.len())
                    .filter(|&s| !slot_taken[i][s] && slots[s].profile == *profile)
                    .collect();
                if let Some(&s) = open.first()
                    && best.is_none_or(|b| open.len() < b.0)
                {
                    best = Some((open.len(), i, s));
                }
            }
            let Some((_, card, slot)) = best else {
                let total: usize = usable
                    .iter()
                    .filter_map(|&i| node.cards[i].mig.as_ref())
                    .map(|s| s.iter().filter(|m| m.profile == *profile).count())
                    .sum();
                let mut msg = format!("no free MIG {profile}");
                let _ = write!(msg, " ({total} on the node, all taken)");
                if total == 0 {
                    msg = format!("no MIG {profile} device on the node");
                }
                return Err(msg);
            };
            slot_taken[card][slot] = true;
            out.push(CardAssign {
                card,
                core_milli: 0,
                memory_mib: 0,
                exclusive: true,
                mig_slot: Some(slot),
            });
        }
    }
    Ok(out)
}

/// Commits a plan's usage on a node.
pub fn commit(node: &mut NodeState, pod: &PodDemand, usage: &PodUsage) {
    node.cpu_used += pod.cpu_milli;
    node.memory_used += pod.memory_bytes;
    for (&i, u) in usage {
        let c = &mut node.cards[i];
        c.core_used += u.core_milli;
        c.memory_used += u.memory_mib;
        if let Some(owner) = u.share_user {
            let su = c.share_user.get_or_insert(super::state::ShareUser {
                uid: owner.uid,
                tenant: owner.tenant,
                pods: 0,
            });
            su.pods += 1;
        }
        if let Some(slots) = &mut c.mig {
            for &s in &u.mig_slots {
                slots[s].used = true;
            }
        }
    }
}

/// Releases what [`commit`] committed.
pub fn release(node: &mut NodeState, pod: &PodDemand, usage: &PodUsage) {
    node.cpu_used = node.cpu_used.saturating_sub(pod.cpu_milli);
    node.memory_used = node.memory_used.saturating_sub(pod.memory_bytes);
    for (&i, u) in usage {
        let c = &mut node.cards[i];
        c.core_used = c.core_used.saturating_sub(u.core_milli);
        c.memory_used = c.memory_used.saturating_sub(u.memory_mib);
        if u.share_user.is_some()
            && let Some(su) = &mut c.share_user
        {
            su.pods = su.pods.saturating_sub(1);
            if su.pods == 0 {
                c.share_user = None;
            }
        }
        if let Some(slots) = &mut c.mig {
            for &s in &u.mig_slots {
                slots[s].used = false;
            }
        }
    }
}
