//! The scheduler's verbs: what a pod asks, filter, reserve, preempt, read from the ledger.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use tessera_api::pod::{ClaimUse, claim_refs, names_claims};
use tessera_core::handoff::{Allocation, ContainerAllocation};
use tessera_core::ledger::{Booking, Hold};
use tessera_core::placement::{PodDemand, check_node_resources};
use tessera_core::request::{GpuDemand, PodRequest};
use tracing::debug;

use super::{AskError, Cluster, FilterOutcome, PodAsk, ReserveError};
use crate::service::wire::{HostScore, MAX_PRIORITY, MetaPod, MetaVictims};
use tessera_claims::holds::booking_key;

/// How a pod that names claims is placed now.
struct ClaimPlan {
    /// The node its held GPUs are on, with their containers' devices and the bookings they
    /// come from.
    held: Option<(String, Vec<ContainerAllocation>, Vec<String>)>,
    /// The demand left to plan (without the held containers' cards).
    planned: PodDemand,
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

impl Cluster {
    /// Parses what a pod asks for.
    pub fn ask(&self, pod: &Pod) -> Result<PodAsk, AskError> {
        let request = PodRequest::from_pod(pod, &self.opts)?;
        let ns = pod.metadata.namespace.as_deref().unwrap_or_default();
        // Most pods name no claim: no parsing for them.
        let claims = if names_claims(pod) {
            claim_refs(pod)?
                .into_iter()
                .map(|ClaimUse { container, claim, .. }| (container, format!("{ns}/{claim}")))
                .collect()
        } else {
            Vec::new()
        };
        let mut demand = PodDemand::from_request(&request);
        demand.tenant = self.tenants.of(ns);
        Ok(PodAsk {
            demand,
            core_limit: request.core_limit,
            claims,
            pod: format!("{ns}/{}", pod.metadata.name.as_deref().unwrap_or_default()),
            uid: pod.metadata.uid.clone(),
            request,
        })
    }

    /// How `ask` (pod `uid`) is placed given its claims: `Err` when a claim is used by another
    /// pod or its claims' GPUs are held on different nodes.
    fn claim_plan(&self, uid: Option<&str>, ask: &PodAsk) -> Result<ClaimPlan, String> {
        let holds = self.claims();
        let mut held: Option<(String, Vec<ContainerAllocation>, Vec<String>)> = None;
        let mut request = ask.request.clone();
        for (container, key) in &ask.claims {
            if let Some(u) = holds.user(key).filter(|u| Some(u.uid.as_str()) != uid) {
                return Err(format!("ElasticGPUClaim {key} is in use by pod {}", u.pod));
            }
            let Some(g) = holds.gpu(key).filter(|g| g.retain) else {
                continue;
            };
            let (node, containers, keys) = held.get_or_insert_with(|| (g.node.clone(), Vec::new(), Vec::new()));
            if *node != g.node {
                return Err(format!(
                    "the pod's claims hold GPUs on different nodes ({node:?} and {:?}, ElasticGPU {})",
                    g.node, g.egpu
                ));
            }
            let Some(c) = request.containers.iter_mut().find(|c| &c.name == container) else {
                continue;
            };
            if !g.serves(&c.gpu) {
                return Err(format!(
                    "ElasticGPUClaim {key} asks for another GPU than its retained ElasticGPU {} holds; delete that ElasticGPU to place the claim afresh",
                    g.egpu
                ));
            }
            containers.push(ContainerAllocation {
                name: container.clone(),
                role: c.role,
                devices: g.devices.clone(),
            });
            keys.push(booking_key(&g.egpu));
            c.gpu = GpuDemand::None;
        }
        let mut planned = PodDemand::from_request(&request);
        planned.tenant = ask.demand.tenant;
        Ok(ClaimPlan { planned, held })
    }

    /// Filters and scores `candidates` for `ask`.
    pub fn filter<'a>(&self, ask: &PodAsk, candidates: &[&'a str]) -> FilterOutcome<'a> {
        let mut out = FilterOutcome::default();
        let (not_ready, not_ready_changes) = {
            let nr = self.not_ready();
            (nr.reasons.clone(), nr.changes)
        };
        let mut l = self.ledger();
        out.stamp = (ask.claims.is_empty() && l.engine().remembers(&ask.demand)).then(|| super::Stamp {
            ledger: l.changes(),
            not_ready: not_ready_changes,
        });
        // A pod whose claims hold GPUs goes where they are, planning only the rest.
        let mut planned = None;
        let mut only = None;
        if !ask.claims.is_empty() {
            match self.claim_plan(ask.uid.as_deref(), ask) {
                Err(reason) => {
                    let reason: Arc<str> = reason.into();
                    out.unresolvable = candidates.iter().map(|&n| (n, reason.clone())).collect();
                    return out;
                }
                Ok(plan) => {
                    only = plan.held.map(|(node, _, keys)| (node, keys.join(", ")));
                    planned = Some(plan.planned);
                }
            }
        }
        let demand = planned.as_ref().unwrap_or(&ask.demand);
        let mut positions = Vec::with_capacity(candidates.len());
        let mut names = Vec::with_capacity(candidates.len());
        let resolved = l.resolve_names(candidates);
        for (&name, &index) in candidates.iter().zip(resolved.iter()) {
            if let Some((node, held)) = &only
                && node != name
            {
                out.unresolvable.push((
                    name,
                    format!("the pod's claims hold their GPUs on node {node:?} ({held})").into(),
                ));
                continue;
            }
            if ask.demand.wants_cards()
                && let Some(reason) = not_ready.get(name)
            {
                out.unresolvable.push((name, reason.as_str().into()));
                continue;
            }
            match index {
                Some(i) => {
                    positions.push(i);
                    names.push(name);
                }
                None => out
                    .unresolvable
                    .push((name, Arc::from("node is not known to the Tessera extender"))),
            }
        }
        let allowed = l.cluster().allowed_models(demand.gpu_models.as_deref());
        let verdicts = if demand.wants_cards() {
            let verdicts = l.engine().evaluate_nodes(demand, &positions);
            out.unsettled = l.engine().unsettled();
            verdicts
        } else {
            // Every card it needs is held: only its CPU and memory are left to fit.
            positions
                .iter()
                .map(|&i| {
                    (
                        i,
                        check_node_resources(&l.cluster().nodes[i], demand)
                            .map(|()| 0.0)
                            .map_err(Arc::from),
                    )
                })
                .collect()
        };
        out.fits.reserve(verdicts.len());
        for ((i, verdict), name) in verdicts.into_iter().zip(names) {
            match verdict {
                Ok(score) => out.fits.push((name, score)),
                // Preemption can only help where the pod could ever fit.
                Err(reason) if l.engine().could_take(i, demand, &allowed) => out.failed.push((name, reason)),
                Err(reason) => out.unresolvable.push((name, reason)),
            }
        }
        out
    }

    /// Reserves cards for a pod on `node`; `None` when the pod needs no GPU.
    pub fn reserve(&self, uid: &str, node: &str, ask: &PodAsk) -> Result<Option<Allocation>, ReserveError> {
        let mut l = self.ledger();
        let a = if ask.claims.is_empty() {
            l.reserve(uid, node, &ask.demand, ask.core_limit)?
        } else {
            let plan = self.claim_plan(Some(uid), ask).map_err(ReserveError::Claims)?;
            let (held, keys) = match plan.held {
                Some((n, held, keys)) if n == node => (held, keys),
                Some((n, _, keys)) => {
                    return Err(ReserveError::Claims(format!(
                        "the pod's claims hold their GPUs on node {n:?} ({}), not {node:?}",
                        keys.join(", ")
                    )));
                }
                None => (Vec::new(), Vec::new()),
            };
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            let a = l.reserve_holding(uid, node, &ask.demand, &plan.planned, ask.core_limit, &held, &keys)?;
            // Being bound, the pod uses its claims: their retained GPUs are its now.
            let change = self
                .claims()
                .use_claims(uid, &ask.pod, ask.claims.iter().map(|(_, k)| k.clone()).collect());
            Self::apply(&mut l, change);
            a
        };
        if a.is_some() {
            self.learn(&mut l, &ask.demand);
        }
        Ok(a)
    }

    /// Drops our reservation for `uid` if it is still one (a failed bind). A booking the
    /// API has since confirmed stays.
    pub fn release(&self, uid: &str) {
        let mut l = self.ledger();
        if l.booking(uid).is_some_and(|b| b.hold == Hold::Reserved) {
            l.unbook(uid);
            let change = self.claims().release_pod(uid);
            Self::apply(&mut l, change);
        }
    }

    /// The API server bound `uid` (our Binding succeeded): its hold is no longer ours to drop,
    /// whether or not the watch has shown it yet.
    pub fn confirm(&self, uid: &str) {
        self.ledger().confirm(uid);
    }

    /// The hold on `uid`, if any.
    pub fn booking(&self, uid: &str) -> Option<Booking> {
        self.ledger().booking(uid).cloned()
    }

    /// Keeps, per candidate node, only the victims whose eviction is needed for the pod to fit
    /// (a victim is spared when the pod still fits without evicting it). Nodes where the pod
    /// does not fit even with every victim gone are dropped.
    pub fn preempt(&self, ask: &PodAsk, candidates: BTreeMap<String, MetaVictims>) -> BTreeMap<String, MetaVictims> {
        let mut l = self.ledger();
        let mut out = BTreeMap::new();
        for (node, victims) in candidates {
            let mut evict: Vec<String> = victims.pods.iter().map(|p| p.uid.clone()).collect();
            if let Err(reason) = l.fits_without(&node, &ask.demand, &refs(&evict)) {
                debug!(node, reason, "evicting every victim would not make room");
                continue;
            }
            // Try to spare each victim in the scheduler's order (most important first, as its
            // own reprieve does), keeping at least one.
            let mut k = 0;
            while k < evict.len() && evict.len() > 1 {
                let mut trial = evict.clone();
                trial.remove(k);
                if l.fits_without(&node, &ask.demand, &refs(&trial)).is_ok() {
                    evict = trial;
                } else {
                    k += 1;
                }
            }
            out.insert(
                node,
                MetaVictims {
                    num_pdb_violations: (victims.num_pdb_violations).min(evict.len() as i64),
                    pods: evict.into_iter().map(|uid| MetaPod { uid }).collect(),
                },
            );
        }
        out
    }
}

/// The prioritize reply's entries: engine scores scaled to the extender's 0..=10 (the best
/// node 10, the worst 0, the rest in proportion), less the nodes scored 0.
///
/// kube-scheduler adds `score x weight x 10` for each host listed and nothing for a host that
/// is not, so a host left out is a host scored 0; and when every node ties the reply is empty,
/// the same for the scheduler as any score given to all (it adds one number to every node).
/// Either way the scheduler ranks the nodes as it would with every score listed, and it
/// decodes fewer entries: at 5,000 nodes a full reply is 142 KB, one entry per node.
pub fn scale_scores<'a>(fits: &[(&'a str, f64)]) -> Vec<HostScore<'a>> {
    let (lo, hi) = fits
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), (_, s)| {
            (lo.min(*s), hi.max(*s))
        });
    if hi - lo <= f64::EPSILON * hi.abs().max(1.0) {
        return Vec::new();
    }
    fits.iter()
        .filter_map(|&(host, s)| {
            let score = (((s - lo) / (hi - lo) * MAX_PRIORITY as f64).round() as i64).clamp(0, MAX_PRIORITY);
            (score > 0).then_some(HostScore { host, score })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scaled(v: &[f64]) -> Vec<(usize, i64)> {
        let names: Vec<String> = (0..v.len()).map(|i| i.to_string()).collect();
        let fits: Vec<(&str, f64)> = names.iter().map(String::as_str).zip(v.iter().copied()).collect();
        scale_scores(&fits)
            .into_iter()
            .map(|h| (h.host.parse().unwrap(), h.score))
            .collect()
    }

    #[test]
    fn scores_span_zero_to_ten_and_zeros_and_ties_are_left_out() {
        assert_eq!(scaled(&[-3.0, 1.0, 5.0]), [(1, 5), (2, 10)]);
        assert_eq!(scaled(&[2.5, 2.5]), []);
        assert_eq!(scaled(&[7.0]), []);
        assert_eq!(scaled(&[1e12, 1e12 + 1.0, 1e12 + 2.0]), [(1, 5), (2, 10)]);
        // 0.04 of the span rounds to 0: left out like the lowest.
        assert_eq!(scaled(&[0.0, 0.4, 10.0]), [(2, 10)]);
        assert!(scaled(&[]).is_empty());
    }

    /// The ranking kube-scheduler makes of the nodes (its plugins' totals, plus
    /// `score x weight x 10` for each host the extender listed, nothing for one it did not;
    /// the host picked is the highest, ties broken at random), given the extender's reply.
    fn ranking(others: &[i64], reply: &[HostScore<'_>], weight: i64) -> Vec<Vec<usize>> {
        let listed: std::collections::HashMap<&str, i64> = reply.iter().map(|h| (h.host, h.score)).collect();
        let totals: Vec<i64> = (0..others.len())
            .map(|i| others[i] + listed.get(i.to_string().as_str()).map_or(0, |s| s * weight * 10))
            .collect();
        let mut levels: BTreeMap<std::cmp::Reverse<i64>, Vec<usize>> = BTreeMap::new();
        for (i, t) in totals.into_iter().enumerate() {
            levels.entry(std::cmp::Reverse(t)).or_default().push(i);
        }
        levels.into_values().collect()
    }

    /// Every node scored, ties all 10: what the reply said before zeros were left out.
    fn every_node_scored<'a>(fits: &[(&'a str, f64)]) -> Vec<HostScore<'a>> {
        let (lo, hi) = fits
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), (_, s)| {
                (lo.min(*s), hi.max(*s))
            });
        let tie = hi - lo <= f64::EPSILON * hi.abs().max(1.0);
        fits.iter()
            .map(|&(host, s)| HostScore {
                host,
                score: if tie {
                    MAX_PRIORITY
                } else {
                    ((s - lo) / (hi - lo) * MAX_PRIORITY as f64).round() as i64
                },
            })
            .collect()
    }

    #[test]
    fn the_scheduler_ranks_nodes_as_it_would_with_every_node_scored() {
        let mut rng = tessera_core::placement::Rng::new(11);
        let mut left_out = 0;
        for round in 0..2_000 {
            let n = 1 + rng.below(12) as usize;
            let names: Vec<String> = (0..n).map(|i| i.to_string()).collect();
            // Few distinct engine scores, so that ties and zeros are common.
            let levels: Vec<f64> = (0..1 + rng.below(4))
                .map(|_| rng.below(1_000) as f64 / 97.0 - 5.0)
                .collect();
            let fits: Vec<(&str, f64)> = names
                .iter()
                .map(|h| (h.as_str(), levels[rng.below(levels.len() as u64) as usize]))
                .collect();
            let others: Vec<i64> = (0..n).map(|_| rng.below(300) as i64).collect();
            let weight = 1 + rng.below(5) as i64;
            let reply = scale_scores(&fits);
            let full = every_node_scored(&fits);
            left_out += full.len() - reply.len();
            assert_eq!(
                ranking(&others, &reply, weight),
                ranking(&others, &full, weight),
                "round {round}: {fits:?}, others {others:?}, weight {weight}: {reply:?}"
            );
        }
        assert!(left_out > 2_000, "the rounds left out only {left_out} hosts");
    }
}
