//! One share on a node whose cards have owners (MPS nodes, and nodes that keep a card's shares
//! to one tenant), without building a plan: the general path's verdict and score, computed
//! without allocating.
//!
//! The general path ([`super::fit::plan_node`], then the node score of the plan) clones the
//! node, builds a usage map and several card lists per node; for a pod shape new to every node
//! that is most of a filter's cost. This path takes the same steps in the same order on the
//! node as it is (same card rules, same refusals, same choice among cards, same floating-point
//! arithmetic), so its verdicts are exactly the general path's (`tests::owned_shares_*`).

use super::evaluate::Evaluator;
use super::fit::{check_node_resources, pct};
use super::{CARD_MILLI, CardDemand, NodeAfter, PodDemand, PolicyKind, ShareOwner, fgd_score, fit};
use super::{mosaic_card_score, node_score};

/// The card the general path's chooser takes among `pool` (positions with room that admit the
/// share), and its fragmentation after when the policy computed it.
struct Pick {
    card: usize,
    frag_after: Option<f64>,
}

impl Evaluator<'_> {
    /// The general path's verdict for a one-container, one-phase share pod on node `n`: its
    /// score, or why it does not fit. `None` when the pod is not of that form.
    pub(super) fn owned_share(
        &mut self,
        n: usize,
        pod: &PodDemand,
        allowed: &[bool],
        (node_policy, gpu_policy): (PolicyKind, PolicyKind),
    ) -> Option<Result<f64, String>> {
        let [container] = pod.containers.as_slice() else {
            return None;
        };
        let CardDemand::Share { core_milli, memory_mib } = container.cards else {
            return None;
        };
        if pod.phases.len() != 1 || pod.phases[0] != [0] {
            return None;
        }
        let owner = ShareOwner {
            uid: container.run_as_user,
            tenant: pod.tenant,
        };
        Some(self.owned_share_on(
            n,
            pod,
            allowed,
            (core_milli, memory_mib),
            owner,
            (node_policy, gpu_policy),
        ))
    }

    fn owned_share_on(
        &mut self,
        n: usize,
        pod: &PodDemand,
        allowed: &[bool],
        (core, memory_mib): (u32, Option<u64>),
        owner: ShareOwner,
        (node_policy, gpu_policy): (PolicyKind, PolicyKind),
    ) -> Result<f64, String> {
        let cluster = self.cluster;
        let node = &cluster.nodes[n];
        check_node_resources(node, pod)?;
        pod.enforcement_ok(node.enforcement)?;
        // One pass over the cards: those that take the share into the pool; what the refusal
        // would say when none does.
        let pool = &mut self.s.pool;
        pool.clear();
        let (mut any_allowed, mut any_usable) = (false, false);
        let mut first_roomy: Option<usize> = None;
        let mut best_free: Option<(u32, u64)> = None;
        for (i, c) in node.cards.iter().enumerate() {
            let allowed = allowed.get(usize::from(c.model)).copied().unwrap_or(false);
            any_allowed |= allowed;
            if !(allowed && c.healthy) {
                continue;
            }
            any_usable = true;
            if c.mig.is_some() {
                continue;
            }
            let free = (c.core_free(), c.memory_free());
            best_free = best_free.max(Some(free));
            let need = memory_mib.unwrap_or(c.memory_mib * u64::from(core) / u64::from(CARD_MILLI));
            if free.0 < core || free.1 < need {
                continue;
            }
            first_roomy.get_or_insert(i);
            if c.admits(node.enforcement, node.cross_tenant, owner).is_ok() {
                pool.push(i);
            }
        }
        if pool.is_empty() {
            return Err(if !any_usable {
                if node.cards.is_empty() {
                    "node has no GPU".into()
                } else if !any_allowed {
                    "no card of an allowed model".into()
                } else {
                    "no healthy card available".into()
                }
            } else if let Some(first) = first_roomy {
                fit::share_refused(node, first, owner)
            } else if let Some((cf, mf)) = best_free {
                format!(
                    "best card has {} core, {} free; needs {}, {}",
                    pct(cf),
                    fit::gib(mf),
                    pct(core),
                    memory_mib.map_or_else(|| "memory in proportion".to_string(), fit::gib)
                )
            } else {
                "every usable card is in MIG mode".into()
            });
        }
        let cpu_after = node.cpu_free() - pod.cpu_milli;
        let pick = self.pick_share_card(n, core, gpu_policy, cpu_after);
        let before = if matches!(node_policy, PolicyKind::Fgd | PolicyKind::Mosaic) {
            self.node_fragmentation(n)
        } else {
            0.0
        };
        let after = NodeAfter {
            cpu_free: cpu_after,
            cpu_total: node.cpu_milli,
            gpu_free: node.gpu_free_milli() - u64::from(core),
            gpu_capacity: node.gpu_capacity_milli(),
        };
        let (frag, frees, rng) = (&mut self.s.frag, &mut self.s.frees, &mut self.s.rng);
        let frag_after = || {
            pick.frag_after.unwrap_or_else(|| {
                frees.clear();
                frees.extend(
                    node.cards
                        .iter()
                        .enumerate()
                        .filter(|(_, c)| c.offers_compute())
                        .map(|(i, c)| {
                            if i == pick.card {
                                c.core_free() - core
                            } else {
                                c.core_free()
                            }
                        }),
                );
                frag.eval(node.model().unwrap_or(0), cpu_after, frees)
            })
        };
        Ok(node_score(node_policy, rng, before, frag_after, &after, pod))
    }

    /// The card the general path's [`super::PolicyChooser`] takes among the cards in the
    /// scratch pool (the first when there is one).
    fn pick_share_card(&mut self, n: usize, core: u32, policy: PolicyKind, cpu_after: u64) -> Pick {
        let cluster = self.cluster;
        let node = &cluster.nodes[n];
        let s = &mut *self.s;
        let pool = &s.pool;
        let only = |card| Pick { card, frag_after: None };
        if pool.len() == 1 {
            return only(pool[0]);
        }
        let free = |i: usize| (node.cards[i].core_free(), node.cards[i].memory_free());
        match policy {
            PolicyKind::Random => only(pool[s.rng.below(pool.len() as u64) as usize]),
            PolicyKind::Spread => only(
                *pool
                    .iter()
                    .max_by_key(|&&i| (free(i), usize::MAX - i))
                    .expect("non-empty"),
            ),
            PolicyKind::Binpack | PolicyKind::Bestfit => {
                only(*pool.iter().min_by_key(|&&i| (free(i), i)).expect("non-empty"))
            }
            PolicyKind::Fgd | PolicyKind::Mosaic => {
                s.frees.clear();
                s.frees
                    .extend(node.cards.iter().filter(|c| c.offers_compute()).map(|c| c.core_free()));
                // Each card tried changes one card: `after_one_change` gives what a full
                // evaluation of the changed node gives, to the bit.
                s.frag
                    .change_base(&mut s.base, node.model().unwrap_or(0), cpu_after, &s.frees);
                let before = s.frag.after_one_change(&s.base, 0, 0);
                let mut best = (f64::NEG_INFINITY, pool[0], f64::NAN);
                // Cards with the same free compute score the same, and the first of equals is
                // kept: each free compute is evaluated once.
                let mut seen = [u32::MAX; 16];
                for (k, &c) in pool.iter().enumerate() {
                    let cf = node.cards[c].core_free();
                    if seen.contains(&cf) {
                        continue;
                    }
                    seen[k.min(seen.len() - 1)] = cf;
                    let fa = s.frag.after_one_change(&s.base, cf, cf - core);
                    let score = if policy == PolicyKind::Fgd {
                        fgd_score(before, fa)
                    } else {
                        mosaic_card_score(&s.frag, before, fa, cf, core)
                    };
                    if score > best.0 {
                        best = (score, c, fa);
                    }
                }
                Pick {
                    card: best.1,
                    frag_after: Some(best.2).filter(|f| !f.is_nan()),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
