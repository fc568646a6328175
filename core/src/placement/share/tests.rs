//! The owned-share path gives exactly the general path's verdicts, on random clusters, pods
//! and policies.

use std::collections::BTreeMap;

use super::super::evaluate::{Evaluator, FragMemo, Scratch};
use super::super::terms::NodeTerms;
use super::super::*;
use crate::enforcement::{EnforcementRequirement, ShareEnforcement};
use crate::inventory::{FixtureSource, InventorySource};

const POLICIES: [PolicyKind; 6] = [
    PolicyKind::Mosaic,
    PolicyKind::Fgd,
    PolicyKind::Binpack,
    PolicyKind::Bestfit,
    PolicyKind::Spread,
    PolicyKind::Random,
];

fn pick<T: Clone>(rng: &mut Rng, from: &[T]) -> T {
    from[rng.below(from.len() as u64) as usize].clone()
}

fn tenants() -> [Tenant; 3] {
    [Tenant::UNNAMED, Tenant::named("a"), Tenant::named("b")]
}

/// A node of a random fixture with random bookings: cards idle, full, shared by random tenants
/// and users, unhealthy; CPU and memory partly taken.
fn random_node(cluster: &mut ClusterState, rng: &mut Rng, name: String) -> NodeState {
    let fixture = pick(rng, &["h100x8", "t4x2", "a100-mig", "l40s-pcie-switches"]);
    let inv = FixtureSource::new(fixture).discover().expect("built-in fixture");
    let mut cards = cluster.cards_from_inventory(&inv.gpus);
    for c in &mut cards {
        c.healthy = rng.below(10) != 0;
        if c.mig.is_some() {
            continue;
        }
        match rng.below(4) {
            0 => {}
            1 => (c.core_used, c.memory_used) = (CARD_MILLI, c.memory_mib),
            _ => {
                c.core_used = 10 * (1 + rng.below(99) as u32);
                c.memory_used = c.memory_mib * (rng.below(101)) / 100;
                c.share_user = Some(ShareUser {
                    uid: pick(rng, &[None, Some(0), Some(1000)]),
                    tenant: pick(rng, &tenants()),
                    pods: 1,
                });
            }
        }
    }
    let enforcement = pick(
        rng,
        &[
            ShareEnforcement::Unknown,
            ShareEnforcement::None,
            ShareEnforcement::Mps,
            ShareEnforcement::Hook,
        ],
    );
    NodeState {
        name,
        cpu_milli: 64_000,
        cpu_used: rng.below(64_001),
        memory_bytes: 256 << 30,
        memory_used: rng.below(257) << 30,
        cards,
        schedulable: rng.below(12) != 0,
        enforcement,
        cross_tenant: rng.below(4) == 0,
        topology: inv.topology.map(std::sync::Arc::new),
    }
}

/// A random workload: up to 60 classes (past the size where fragmentation is memoised).
fn random_workload(rng: &mut Rng) -> TargetWorkload {
    let n = 1 + rng.below(60) as usize;
    let classes = (0..n)
        .map(|_| {
            let cards = pick(rng, &[0u32, 1, 1, 1, 2, 4]);
            WorkloadClass {
                cpu_milli: 1000 * rng.below(40),
                gpu_milli: match cards {
                    0 => 0,
                    1 => pick(rng, &[100, 250, 300, 500, 700, 1000]),
                    _ => 1000,
                },
                cards,
                models: pick(rng, &[None, Some(vec!["H100".to_string()])]),
                weight: 1.0 / n as f64,
            }
        })
        .collect();
    TargetWorkload { classes }
}

/// A one-container share pod with a random owner, size, model constraint and requirement.
fn random_share(rng: &mut Rng) -> (PodDemand, (PolicyKind, PolicyKind)) {
    let gib = 1 + rng.below(80);
    let memory_mib = pick(rng, &[None, Some(1024 * gib)]);
    let mut pod = PodDemand::single(
        1000 * rng.below(30),
        rng.below(64) << 30,
        Some(CardDemand::Share {
            core_milli: 10 * (1 + rng.below(100) as u32),
            memory_mib,
        }),
    );
    pod.containers[0].run_as_user = pick(rng, &[None, Some(0), Some(1000)]);
    pod.tenant = pick(rng, &tenants());
    pod.gpu_models = pick(
        rng,
        &[None, Some(vec!["T4".into()]), Some(vec!["H100".into(), "L40S".into()])],
    );
    pod.share_enforcement = pick(rng, &[None, Some(EnforcementRequirement::Any)]);
    (pod, (pick(rng, &POLICIES), pick(rng, &POLICIES)))
}

/// The verdict with the score's exact bits, so that equal means identical.
fn exact(v: Result<f64, impl ToString>) -> Result<u64, String> {
    v.map(f64::to_bits).map_err(|r| r.to_string())
}

#[test]
fn owned_shares_get_the_general_paths_verdicts_exactly() {
    let mut outcomes: BTreeMap<String, usize> = BTreeMap::new();
    for seed in 0..60 {
        let mut rng = Rng::new(seed);
        let mut cluster = ClusterState::new();
        for i in 0..24 {
            let node = random_node(&mut cluster, &mut rng, format!("node-{i}"));
            cluster.add_node(node);
        }
        let frag = Fragmentation::new(&random_workload(&mut rng), &cluster);
        let config = EngineConfig::default();
        // One scratch (random source, memos) per path, drawn from alike. The owned-share path
        // runs twice: with every node's fragmentation terms kept, and with none.
        let mut kept = NodeTerms::default();
        kept.reset(frag.levels(), &cluster);
        kept.refresh(&frag, &cluster, 0..cluster.nodes.len(), &mut Vec::new());
        let none = NodeTerms::default();
        let mut fast = [Scratch::new(frag.clone(), seed), Scratch::new(frag.clone(), seed)];
        let mut general = Scratch::new(frag, seed);
        let (mut fast_frag, mut general_frag) = ([vec![None; 24], vec![None; 24]], vec![None; 24]);
        for _ in 0..40 {
            let (pod, policies) = random_share(&mut rng);
            let allowed = cluster.allowed_models(pod.gpu_models.as_deref());
            for n in 0..cluster.nodes.len() {
                let mut got = [&kept, &none]
                    .into_iter()
                    .zip(&mut fast)
                    .zip(&mut fast_frag)
                    .map(|((terms, s), nf)| {
                        let mut ev = Evaluator {
                            cluster: &cluster,
                            config,
                            s,
                            node_frag: FragMemo::Own(nf),
                            terms,
                        };
                        ev.owned_share(n, &pod, &allowed, policies)
                            .expect("a one-container share")
                    });
                let (got, uncached) = (got.next().expect("kept"), got.next().expect("none"));
                assert_eq!(
                    exact(got.clone()),
                    exact(uncached),
                    "seed {seed}, node {n}: terms kept or not"
                );
                let mut ev = Evaluator {
                    cluster: &cluster,
                    config,
                    s: &mut general,
                    node_frag: FragMemo::Own(&mut general_frag),
                    terms: &none,
                };
                let want = ev.general(n, &pod, &allowed, policies);
                let key = match &want {
                    Ok(_) => "fits".to_string(),
                    Err(r) => r.split([':', ';', '(']).next().unwrap_or(r).to_string(),
                };
                *outcomes.entry(key).or_default() += 1;
                assert_eq!(
                    exact(got),
                    exact(want),
                    "seed {seed}, node {n}: {:?}, policies {policies:?}\n{pod:?}",
                    cluster.nodes[n]
                );
            }
        }
    }
    // Every outcome the paths can reach was reached, fits most of all.
    for reason in [
        "fits",
        "insufficient cpu",
        "insufficient memory",
        "node is not schedulable",
        "no card of an allowed model",
        "best card has 0% core, 0 GiB free",
        "every card with room holds shares of another tenant",
        "every card with room serves MPS clients of another user ",
        "the pod requires enforced shares",
        "every usable card is in MIG mode",
    ] {
        let seen: usize = outcomes
            .iter()
            .filter(|(k, _)| k.starts_with(reason))
            .map(|(_, n)| n)
            .sum();
        assert!(seen > 0, "{reason:?} never happened: {outcomes:#?}");
    }
}

/// A verdict list with the scores' exact bits.
fn exact_all(v: Vec<(usize, Verdict)>) -> Vec<(usize, Result<u64, String>)> {
    v.into_iter()
        .map(|(n, v)| (n, v.map(f64::to_bits).map_err(|e| e.to_string())))
        .collect()
}

/// An engine of the default policies on 16 random nodes and a random workload, with the
/// workload and every node's position.
fn random_engine(rng: &mut Rng) -> (Engine, TargetWorkload, Vec<usize>) {
    let mut cluster = ClusterState::new();
    for i in 0..16 {
        let node = random_node(&mut cluster, rng, format!("node-{i}"));
        cluster.add_node(node);
    }
    let workload = random_workload(rng);
    let engine = Engine::new(cluster, &workload, EngineConfig::default());
    (engine, workload, (0..16).collect())
}

#[test]
fn kept_node_terms_follow_every_change_of_a_node() {
    // One engine keeps what each node's share evaluations read while pods are placed and
    // released, cards fail and the workload changes; an engine built afresh on the same
    // cluster before each pod keeps nothing from before. Their verdicts are the same bits,
    // and whether a node could ever take the pod reads the same from what is kept.
    let mut from_kept = 0;
    for seed in 0..12 {
        let mut rng = Rng::new(1000 + seed);
        let (mut kept, mut workload, all) = random_engine(&mut rng);
        let config = kept.config();
        let mut placed = Vec::new();
        for step in 0..80 {
            let (mut pod, (node_policy, gpu_policy)) = random_share(&mut rng);
            if node_policy == PolicyKind::Random || gpu_policy == PolicyKind::Random {
                (pod.node_policy, pod.gpu_policy) = (None, None);
            } else {
                (pod.node_policy, pod.gpu_policy) = (Some(node_policy), Some(gpu_policy));
            }
            let got = kept.evaluate_nodes(&pod, &all);
            let mut fresh = Engine::new(kept.cluster.clone(), &workload, config);
            let want = fresh.evaluate_nodes(&pod, &all);
            assert_eq!(exact_all(got), exact_all(want), "seed {seed}, step {step}: {pod:?}");
            let allowed = kept.cluster.allowed_models(pod.gpu_models.as_deref());
            for &n in &all {
                let node = &kept.cluster.nodes[n];
                from_kept += usize::from(kept.terms.healthy_models(n).is_some());
                assert_eq!(
                    kept.could_take(n, &pod, &allowed),
                    node.could_take(&pod, &allowed),
                    "seed {seed}, step {step}, node {n}: {node:?}\n{pod:?}"
                );
            }
            match rng.below(8) {
                0 if !placed.is_empty() => {
                    let (pod, placement) = placed.swap_remove(rng.below(placed.len() as u64) as usize);
                    kept.release(&pod, &placement);
                }
                1 => {
                    let n = rng.below(all.len() as u64) as usize;
                    if let Some(c) = kept.cluster.nodes[n].cards.first_mut() {
                        c.healthy = !c.healthy;
                    }
                    kept.node_changed(n);
                }
                2 => {
                    workload = random_workload(&mut rng);
                    kept.set_workload(&workload);
                }
                _ => {
                    if let Ok(placement) = kept.schedule(&pod) {
                        kept.commit(&pod, &placement);
                        placed.push((pod, placement));
                    }
                }
            }
        }
    }
    assert!(from_kept > 5000, "nodes answered from what is kept: {from_kept}");
}

#[test]
fn a_gpu_ask_remembered_for_other_cpu_and_memory_gives_fresh_verdicts() {
    // Pods of one GPU ask and other CPU and memory (some more than nodes have free, some
    // crossing the workload's class CPU thresholds) reuse what each node's cards said; an
    // engine built afresh before each pod remembers nothing. Their verdicts are the same bits.
    for seed in 0..12 {
        let mut rng = Rng::new(2000 + seed);
        let (mut kept, workload, all) = random_engine(&mut rng);
        let config = kept.config();
        let mut asks = Vec::new();
        for step in 0..30 {
            let (mut ask, (node_policy, gpu_policy)) = random_share(&mut rng);
            if node_policy != PolicyKind::Random && gpu_policy != PolicyKind::Random {
                (ask.node_policy, ask.gpu_policy) = (Some(node_policy), Some(gpu_policy));
            }
            if rng.below(3) == 0 {
                ask.containers[0].cards = CardDemand::Whole {
                    cards: 1 + rng.below(2) as u32,
                    min_memory_mib: None,
                };
            }
            // Each node remembers several asks: the two before come back in between.
            asks.push(ask.clone());
            for k in 0..8 {
                let mut pod = asks[asks.len().saturating_sub(1 + k % 3)].clone();
                pod.cpu_milli = 1000 * rng.below(48);
                pod.memory_bytes = rng.below(128) << 30;
                let got = kept.evaluate_nodes(&pod, &all);
                let want = Engine::new(kept.cluster.clone(), &workload, config).evaluate_nodes(&pod, &all);
                assert_eq!(exact_all(got), exact_all(want), "seed {seed}, step {step}: {pod:?}");
            }
            if let Ok(placement) = kept.schedule(&ask) {
                kept.commit(&ask, &placement);
            }
        }
    }
}
