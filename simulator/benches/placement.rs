//! One placement decision on a 5,000-node x 8-GPU cluster that is half full, per policy.
//! `bestfit` (no fragmentation model) is the baseline the others are compared against.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use tessera_core::placement::{
    CardDemand, CardState, ClusterState, Engine, EngineConfig, NodeState, PodDemand, Rng, Tenant,
};
use tessera_core::policy::PolicyKind;
use tessera_simulator::{embedded, trace};

fn half_full_cluster() -> ClusterState {
    let mut rng = Rng::new(5000);
    let mut cluster = ClusterState::new();
    let model = cluster.model_id("A100");
    for n in 0..5000 {
        let mut cpu_used = 0;
        let cards = (0..8)
            .map(|i| {
                // Half the compute is used: a mix of idle, full and partly shared cards.
                let used = match rng.below(4) {
                    0 => 0,
                    1 => 1000,
                    _ => 100 * (1 + rng.below(9) as u32),
                };
                cpu_used += u64::from(used) * 10;
                CardState {
                    uuid: format!("n{n}-g{i}"),
                    index: i,
                    minor: i,
                    model,
                    memory_mib: 81_920,
                    numa: Some(i / 4),
                    healthy: true,
                    core_used: used,
                    memory_used: 81_920 * u64::from(used) / 1000,
                    mig: None,
                    share_user: None,
                }
            })
            .collect();
        cluster.add_node(NodeState {
            name: format!("node-{n:05}"),
            cpu_milli: 128_000,
            cpu_used,
            memory_bytes: 1 << 40,
            memory_used: 0,
            cards,
            schedulable: true,
            enforcement: Default::default(),
            cross_tenant: false,
            topology: None,
        });
    }
    cluster
}

fn bench(c: &mut Criterion) {
    let cluster = half_full_cluster();
    let used = cluster.gpu_used_milli() as f64 / cluster.gpu_capacity_milli() as f64;
    println!(
        "cluster: {} nodes, {:.0}% of GPU compute used",
        cluster.nodes.len(),
        used * 100.0
    );
    let tasks: Vec<PodDemand> = embedded::tasks().iter().map(trace::TraceTask::demand).collect();
    let workload = tessera_core::placement::TargetWorkload::typical(&tasks, 0.95, 10);
    let share = PodDemand::single(
        4000,
        8 << 30,
        Some(CardDemand::Share {
            core_milli: 300,
            memory_mib: Some(8192),
        }),
    );
    let two = PodDemand::single(
        16_000,
        64 << 30,
        Some(CardDemand::Whole {
            cards: 2,
            min_memory_mib: None,
        }),
    );
    let mut group = c.benchmark_group("schedule-5000x8-half-full");
    for policy in [PolicyKind::Bestfit, PolicyKind::Fgd, PolicyKind::Mosaic] {
        let mut engine = Engine::new(
            cluster.clone(),
            &workload,
            EngineConfig {
                node_policy: policy,
                gpu_policy: policy,
                seed: 1,
            },
        );
        group.bench_function(format!("{policy}/share-30%"), |b| {
            b.iter(|| black_box(engine.schedule(black_box(&share)).is_ok()))
        });
        group.bench_function(format!("{policy}/2-gpu"), |b| {
            b.iter(|| black_box(engine.schedule(black_box(&two)).is_ok()))
        });
        // The extender's filter for a pod shape no node has seen yet: every call asks for a
        // share of another size, so no node's remembered verdict applies.
        let all: Vec<usize> = (0..engine.cluster.nodes.len()).collect();
        let mut core = 100;
        group.bench_function(format!("{policy}/filter-new-shape"), |b| {
            b.iter(|| {
                core = if core >= 900 { 101 } else { core + 1 };
                let pod = PodDemand::single(
                    4000,
                    8 << 30,
                    Some(CardDemand::Share {
                        core_milli: core,
                        memory_mib: Some(4096),
                    }),
                );
                black_box(engine.evaluate_nodes(black_box(&pod), &all).len())
            })
        });
        // The same for a pod of a named tenant, as the extender's are: a card's shares belong
        // to one tenant, so the card tier checks each card's owner.
        group.bench_function(format!("{policy}/filter-new-shape-tenant"), |b| {
            b.iter(|| {
                core = if core >= 900 { 101 } else { core + 1 };
                let mut pod = PodDemand::single(
                    4000,
                    8 << 30,
                    Some(CardDemand::Share {
                        core_milli: core,
                        memory_mib: Some(4096),
                    }),
                );
                pod.tenant = Tenant::named("team-a");
                black_box(engine.evaluate_nodes(black_box(&pod), &all).len())
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
