use super::*;
use crate::placement::{CardDemand, CardState, ClusterState, NodeState, PodDemand};

fn card(model: u16, used: u32) -> CardState {
    CardState {
        uuid: String::new(),
        index: 0,
        minor: 0,
        model,
        memory_mib: 16_000,
        numa: None,
        healthy: true,
        core_used: used,
        memory_used: 0,
        mig: None,
        share_user: None,
    }
}

fn share(cpu: u64, milli: u32) -> PodDemand {
    PodDemand::single(
        cpu,
        0,
        Some(CardDemand::Share {
            core_milli: milli,
            memory_mib: None,
        }),
    )
}

fn whole(cpu: u64, n: u32) -> PodDemand {
    PodDemand::single(
        cpu,
        0,
        Some(CardDemand::Whole {
            cards: n,
            min_memory_mib: None,
        }),
    )
}

#[test]
fn typical_pods_keep_the_popular_classes_and_renormalise() {
    let mut pods = vec![share(1000, 500); 6];
    pods.extend(vec![whole(2000, 1); 3]);
    pods.push(whole(8000, 8));
    let w = TargetWorkload::typical(&pods, 0.95, 1);
    assert_eq!(w.classes.len(), 3);
    let w = TargetWorkload::typical(&pods, 0.85, 1);
    assert_eq!(w.classes.len(), 2, "the 8-GPU class is below the coverage line");
    assert!((w.classes[0].weight - 6.0 / 9.0).abs() < 1e-9);
    assert_eq!((w.classes[0].gpu_milli, w.classes[0].cards), (500, 1));
    assert_eq!((w.classes[1].gpu_milli, w.classes[1].cards), (1000, 1));
}

#[test]
fn fragmentation_matches_the_papers_definition() {
    // Node: 2 cards, one with 300 free, one idle; 4 CPUs free.
    let mut cluster = ClusterState::new();
    let m = cluster.model_id("T4");
    let node = NodeState {
        name: "n".into(),
        cpu_milli: 8000,
        cpu_used: 4000,
        memory_bytes: 0,
        memory_used: 0,
        cards: vec![card(m, 700), card(m, 0)],
        schedulable: true,
        enforcement: Default::default(),
        cross_tenant: false,
        topology: None,
    };
    cluster.add_node(node.clone());
    let w = TargetWorkload {
        classes: vec![
            // A 500 share fits the idle card: the 300 left on the other is a fragment for it.
            WorkloadClass {
                cpu_milli: 1000,
                gpu_milli: 500,
                cards: 1,
                models: None,
                weight: 0.5,
            },
            // Two whole cards do not fit: all 1300 idle is a fragment.
            WorkloadClass {
                cpu_milli: 1000,
                gpu_milli: 1000,
                cards: 2,
                models: None,
                weight: 0.25,
            },
            // A 200 share needing more CPU than is free: all idle is a fragment.
            WorkloadClass {
                cpu_milli: 6000,
                gpu_milli: 200,
                cards: 1,
                models: None,
                weight: 0.25,
            },
        ],
    };
    let mut f = Fragmentation::new(&w, &cluster);
    let expected = 0.5 * 300.0 + 0.25 * 1300.0 + 0.25 * 1300.0;
    assert!((f.of_node(&node) - expected).abs() < 1e-9);
    // Few classes: computed directly (cheaper than a lookup in a large memo).
    assert!((f.of_node(&node) - expected).abs() < 1e-9);
    assert_eq!(f.memo_len(), 0);
    // Many classes: memoised, the same answer again from one memo entry.
    let many = TargetWorkload {
        classes: (1..=40)
            .map(|i| WorkloadClass {
                cpu_milli: 0,
                gpu_milli: 25 * i,
                cards: 1,
                models: None,
                weight: 1.0 / 40.0,
            })
            .collect(),
    };
    let mut m = Fragmentation::new(&many, &cluster);
    let first = m.of_node(&node);
    assert_eq!(m.of_node(&node), first);
    assert_eq!(m.memo_len(), 1);
    // A class restricted to another model cannot use the node at all.
    let w = TargetWorkload {
        classes: vec![WorkloadClass {
            cpu_milli: 0,
            gpu_milli: 100,
            cards: 1,
            models: Some(vec!["A100".into()]),
            weight: 1.0,
        }],
    };
    let mut f = Fragmentation::new(&w, &cluster);
    assert!((f.of_node(&node) - 1300.0).abs() < 1e-9);
}

#[test]
fn fgd_score_is_the_published_sigmoid_scale() {
    assert_eq!(fgd_score(1000.0, 1000.0), 50.0);
    assert_eq!(fgd_score(1000.0, 1001.0), 49.0);
    assert_eq!(fgd_score(2000.0, 1000.0), 73.0);
    assert_eq!(fgd_score(0.0, 3000.0), 4.0);
}

#[test]
fn card_waste_follows_the_class_sizes() {
    let cluster = ClusterState::new();
    let w = TargetWorkload {
        classes: vec![WorkloadClass {
            cpu_milli: 0,
            gpu_milli: 400,
            cards: 1,
            models: None,
            weight: 1.0,
        }],
    };
    let f = Fragmentation::new(&w, &cluster);
    assert_eq!(f.card_waste(0), 0.0);
    assert_eq!(f.card_waste(399), 399.0);
    assert_eq!(f.card_waste(400), 0.0);
    assert_eq!(f.card_waste(1000), 200.0); // 400 + 400, 200 left
}

#[test]
fn learner_forgets_old_pods() {
    let mut l = WorkloadLearner::new(10.0);
    for _ in 0..100 {
        l.observe(&share(1000, 500));
    }
    for _ in 0..30 {
        l.observe(&whole(1000, 1));
    }
    let w = l.target(1.0, 1);
    assert_eq!(w.classes[0].gpu_milli, 1000, "recent whole-card pods dominate: {w:?}");
    assert!(w.classes[0].weight > 0.85);
}
