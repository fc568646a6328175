//! One share on a node whose cards have owners (MPS nodes, and nodes that keep a card's shares
//! to one tenant), without building a plan: the general path's verdict and score, computed
//! without allocating.
//!
//! The general path ([`super::fit::plan_node`], then the node score of the plan) clones the
//! node, builds a usage map and several card lists per node; for a pod shape new to every node
//! that is most of a filter's cost. This path takes the same steps in the same order on the
//! node as it is (same card rules, same refusals, same choice among cards, the same exact
//! fragmentation sums, then the same floating-point arithmetic), so its verdicts are exactly
//! the general path's (`tests::owned_shares_*`).

use std::sync::Arc;

use super::evaluate::Evaluator;
use super::fit::check_node_resources;
use super::refusal::CardRefusal;
use super::{
    CARD_MILLI, CardDemand, Fragmentation, NodeAfter, PodDemand, PolicyKind, ShareOwner, ShareUser, fgd_score, fit,
};
use super::{mosaic_card_score, node_score};

/// The card the general path's chooser takes among `pool` (positions with room that admit the
/// share), and the node's fragmentation after and now (with the classes that could run once the
/// pod's CPU is taken) when the policy computed them.
struct Pick {
    card: usize,
    frag_after: Option<f64>,
    frag_now: Option<f64>,
}

/// The share of a one-container, one-phase share pod (compute, memory) and its owner: the form
/// this path takes; `None` for any other pod.
pub(super) fn owned_form(pod: &PodDemand) -> Option<((u32, Option<u64>), ShareOwner)> {
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
    Some(((core_milli, memory_mib), owner))
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
    ) -> Option<Result<f64, Arc<str>>> {
        let (share, owner) = owned_form(pod)?;
        Some(self.owned_share_on(n, pod, allowed, share, owner, (node_policy, gpu_policy)))
    }

    fn owned_share_on(
        &mut self,
        n: usize,
        pod: &PodDemand,
        allowed: &[bool],
        (core, memory_mib): (u32, Option<u64>),
        owner: ShareOwner,
        (node_policy, gpu_policy): (PolicyKind, PolicyKind),
    ) -> Result<f64, Arc<str>> {
        let cluster = self.cluster;
        let node = &cluster.nodes[n];
        check_node_resources(node, pod)?;
        pod.enforcement_ok(node.enforcement)?;
        let share = (core, memory_mib);
        // The node's free compute and capacity over the cards that offer it.
        let pool = match self.kept_pool(n, allowed, share, owner) {
            Some(pool) => pool,
            None => self.scan_pool(n, allowed, share, owner),
        };
        let (gpu_free, offering) = pool.map_err(|r| self.s.refusals.text(r))?;
        let cpu_after = node.cpu_free() - pod.cpu_milli;
        let pick = self.pick_share_card(n, core, gpu_policy, cpu_after);
        // The node as it is: where the pod's CPU leaves the same classes able to run, what the
        // card's choice worked out (the same sum, to the bit).
        let before = if matches!(node_policy, PolicyKind::Fgd | PolicyKind::Mosaic) {
            let frag = &self.s.frag;
            match pick.frag_now {
                Some(now) if frag.cpu_rank(node.cpu_free()) == frag.cpu_rank(cpu_after) => now,
                _ => self.node_fragmentation(n),
            }
        } else {
            0.0
        };
        let after = NodeAfter {
            cpu_free: cpu_after,
            cpu_total: node.cpu_milli,
            gpu_free: gpu_free - u64::from(core),
            gpu_capacity: offering as u64 * u64::from(CARD_MILLI),
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

    /// Fills the scratch pool (the cards that take the share, with their free compute and
    /// memory) from node `n`'s kept briefs, and gives the node's free compute and cards
    /// offering it, or why no card takes the share; `None` when nothing is kept, or when no
    /// card offering compute is of an allowed model ([`Evaluator::scan_pool`] then says why,
    /// from the cards in full).
    fn kept_pool(
        &mut self,
        n: usize,
        allowed: &[bool],
        (core, memory_mib): (u32, Option<u64>),
        owner: ShareOwner,
    ) -> Option<Result<(u64, usize), CardRefusal>> {
        let kept = self.terms.get(n)?;
        let node = &self.cluster.nodes[n];
        let s = &mut *self.s;
        // Every card is written to the next slot and the slot kept only when the card takes the
        // share: whether one does follows the data, and a branch on it is mispredicted often.
        s.pool.clear();
        s.pool.resize(kept.cards.len(), 0);
        s.pool_free.clear();
        s.pool_free.resize(kept.cards.len(), (0, 0));
        let mut len = 0;
        for b in kept.cards {
            let free = (u32::from(b.core_free), u64::from(b.memory_free));
            let need = fit::share_memory(memory_mib, u64::from(b.memory_mib), core);
            let takes = allowed.get(usize::from(b.model)).copied().unwrap_or(false)
                & (free.0 >= core)
                & (free.1 >= need)
                & ShareUser::admits(b.share_user.as_ref(), node.enforcement, node.cross_tenant, owner).is_ok();
            s.pool[len] = usize::from(b.index);
            s.pool_free[len] = free;
            len += usize::from(takes);
        }
        s.pool.truncate(len);
        s.pool_free.truncate(len);
        if len > 0 {
            return Some(Ok((kept.terms.idle, kept.offering)));
        }
        // The briefs are the cards [`Evaluator::scan_pool`] weighs (healthy, not in MIG mode),
        // in the same order: where one is of an allowed model, they give its reason.
        let mut usable = kept
            .cards
            .iter()
            .filter(|b| allowed.get(usize::from(b.model)).copied().unwrap_or(false))
            .peekable();
        usable.peek()?;
        let mut best: Option<(u32, u64)> = None;
        for b in usable {
            let free = (u32::from(b.core_free), u64::from(b.memory_free));
            let need = fit::share_memory(memory_mib, u64::from(b.memory_mib), core);
            if free.0 >= core && free.1 >= need {
                let Err(refusal) = ShareUser::admits(b.share_user.as_ref(), node.enforcement, node.cross_tenant, owner)
                else {
                    unreachable!("a card that admits the share is in the pool");
                };
                return Some(Err(CardRefusal::owner(refusal, owner.uid)));
            }
            best = best.max(Some(free));
        }
        let best = best.expect("a usable card");
        Some(Err(CardRefusal::TooSmall { best, core, memory_mib }))
    }

    /// [`Evaluator::kept_pool`] from the node's cards in full.
    fn scan_pool(
        &mut self,
        n: usize,
        allowed: &[bool],
        (core, memory_mib): (u32, Option<u64>),
        owner: ShareOwner,
    ) -> Result<(u64, usize), CardRefusal> {
        let node = &self.cluster.nodes[n];
        let s = &mut *self.s;
        s.pool.clear();
        s.pool_free.clear();
        let (mut any_allowed, mut any_usable) = (false, false);
        let mut first_roomy: Option<usize> = None;
        let mut best_free: Option<(u32, u64)> = None;
        let (mut gpu_free, mut offering) = (0u64, 0usize);
        for (i, c) in node.cards.iter().enumerate() {
            if c.offers_compute() {
                gpu_free += u64::from(c.core_free());
                offering += 1;
            }
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
            let need = fit::share_memory(memory_mib, c.memory_mib, core);
            if free.0 < core || free.1 < need {
                continue;
            }
            first_roomy.get_or_insert(i);
            if c.admits(node.enforcement, node.cross_tenant, owner).is_ok() {
                s.pool.push(i);
                s.pool_free.push(free);
            }
        }
        if !s.pool.is_empty() {
            return Ok((gpu_free, offering));
        }
        Err(if !any_usable {
            if node.cards.is_empty() {
                CardRefusal::NoGpu
            } else if !any_allowed {
                CardRefusal::NoAllowedModel
            } else {
                CardRefusal::NoHealthyCard
            }
        } else if let Some(first) = first_roomy {
            match node.cards[first].admits(node.enforcement, node.cross_tenant, owner) {
                Err(refusal) => CardRefusal::owner(refusal, owner.uid),
                Ok(()) => unreachable!("a card that admits the share is in the pool"),
            }
        } else if let Some(best) = best_free {
            CardRefusal::TooSmall { best, core, memory_mib }
        } else {
            CardRefusal::AllMig
        })
    }

    /// The card the general path's [`super::PolicyChooser`] takes among the cards in the
    /// scratch pool (the first when there is one).
    fn pick_share_card(&mut self, n: usize, core: u32, policy: PolicyKind, cpu_after: u64) -> Pick {
        let cluster = self.cluster;
        let node = &cluster.nodes[n];
        let s = &mut *self.s;
        let pool = &s.pool;
        let only = |card| Pick {
            card,
            frag_after: None,
            frag_now: None,
        };
        // One card: no choice to make, but the fragmentation policies weigh it below from the
        // node's terms (kept ones are read where the card states are not).
        if pool.len() == 1 && !matches!(policy, PolicyKind::Fgd | PolicyKind::Mosaic) {
            return only(pool[0]);
        }
        let with_free = || pool.iter().zip(&s.pool_free);
        match policy {
            PolicyKind::Random => only(pool[s.rng.below(pool.len() as u64) as usize]),
            PolicyKind::Spread => only(
                *with_free()
                    .max_by_key(|&(&i, &free)| (free, usize::MAX - i))
                    .expect("non-empty")
                    .0,
            ),
            PolicyKind::Binpack | PolicyKind::Bestfit => {
                only(*with_free().min_by_key(|&(&i, &free)| (free, i)).expect("non-empty").0)
            }
            PolicyKind::Fgd | PolicyKind::Mosaic => {
                // Each card tried changes one card: the node's table of one-card changes gives
                // what a full evaluation of the changed node gives, to the bit. The node's terms
                // are kept while it does not change; which classes could run depends on the
                // pod's CPU.
                let kept = self.terms.get(n);
                let (model, cards) = match kept {
                    Some(k) => (k.model, k.offering),
                    None => (
                        node.model().unwrap_or(0),
                        node.cards.iter().filter(|c| c.offers_compute()).count(),
                    ),
                };
                let key = (model, cards, s.frag.cpu_rank(cpu_after));
                if s.runs_key != Some(key) {
                    s.frag.runs(&mut s.runs, model, cpu_after, cards);
                    s.runs_key = Some(key);
                }
                let terms = match kept {
                    Some(k) => k.terms,
                    None => {
                        s.frees.clear();
                        s.frees
                            .extend(node.cards.iter().filter(|c| c.offers_compute()).map(|c| c.core_free()));
                        s.frag.change_base(&mut s.base, model, cpu_after, &s.frees);
                        s.base.terms()
                    }
                };
                s.frag.change_table(&mut s.table, terms, &s.runs);
                let before = Fragmentation::change_now(&s.table);
                // The first of the best cards is kept, as the general path's chooser keeps it.
                let mut best = (f64::NEG_INFINITY, pool[0], f64::NAN);
                for (&c, &(cf, _)) in pool.iter().zip(&s.pool_free) {
                    let fa = s.frag.change_after(&s.table, cf, cf - core);
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
                    frag_now: Some(before),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
