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

/// The definition, class by class: a usable class's fragments are the free compute of the
/// cards with less room than it needs; an unusable class's, all the node's free compute; the
/// classes weighed by popularity (in units of 2^-32 of a weight).
fn by_definition(w: &TargetWorkload, cluster: &ClusterState, model: u16, cpu_free: u64, frees: &[u32]) -> f64 {
    let mut sorted = frees.to_vec();
    sorted.sort_unstable_by(|a, b| b.cmp(a));
    let idle: u64 = frees.iter().map(|&f| u64::from(f)).sum();
    let mut total = 0i64;
    for c in &w.classes {
        let allowed = cluster.allowed_models(c.models.as_deref());
        let cards = c.cards as usize;
        let usable = c.gpu_milli > 0
            && allowed[usize::from(model)]
            && cpu_free >= c.cpu_milli
            && (1..=sorted.len()).contains(&cards)
            && sorted[cards - 1] >= c.gpu_milli;
        let frag = if usable {
            frees.iter().filter(|&&f| f < c.gpu_milli).map(|&f| u64::from(f)).sum()
        } else {
            idle
        };
        total += units(c.weight) * frag as i64;
    }
    milli(total)
}

proptest::proptest! {
    /// Fragments by level in one pass give the definition's value to the bit, memoised or not.
    #[test]
    fn fragmentation_is_the_definition_to_the_bit(
        classes in proptest::collection::vec((0u64..8, 0u32..=10, 0u32..4, proptest::bool::ANY, 0.01f64..1.0), 1..48),
        frees in proptest::collection::vec(0u32..=100, 0..10),
        cpu_free in 0u64..8,
        on_t4 in proptest::bool::ANY,
    ) {
        let mut cluster = ClusterState::new();
        let (t4, a100) = (cluster.model_id("Tesla T4"), cluster.model_id("NVIDIA A100-SXM4-40GB"));
        let w = TargetWorkload {
            classes: classes
                .iter()
                .map(|&(cpu, tenths, cards, t4_only, weight)| WorkloadClass {
                    cpu_milli: cpu * 1000,
                    gpu_milli: tenths * 100,
                    cards,
                    models: t4_only.then(|| vec!["T4".to_string()]),
                    weight,
                })
                .collect(),
        };
        let frees: Vec<u32> = frees.iter().map(|f| f * 10).collect();
        let model = if on_t4 { t4 } else { a100 };
        let mut f = Fragmentation::new(&w, &cluster);
        let want = by_definition(&w, &cluster, model, cpu_free * 1000, &frees);
        for _ in 0..2 {
            proptest::prop_assert_eq!(f.eval(model, cpu_free * 1000, &frees).to_bits(), want.to_bits());
        }
        // One card changed, from the node's terms: the same bits as the changed node by the
        // definition, for every card and amount taken.
        let mut base = ChangeBase::default();
        f.change_base(&mut base, model, cpu_free * 1000, &frees);
        proptest::prop_assert_eq!(f.after_one_change(&base, 0, 0).to_bits(), want.to_bits());
        for (i, &from) in frees.iter().enumerate() {
            for to in [0, from / 2, from.saturating_sub(10), from] {
                let mut changed = frees.clone();
                changed[i] = to;
                let want = by_definition(&w, &cluster, model, cpu_free * 1000, &changed);
                proptest::prop_assert_eq!(f.after_one_change(&base, from, to).to_bits(), want.to_bits());
            }
        }
        // One table for the node, read for each card in turn (as a share's card choice reads
        // it), and the node as it is from it: each the definition's bits.
        let mut table = ChangeTable::default();
        f.change_table(&mut table, base.terms(), &base.runs);
        proptest::prop_assert_eq!(Fragmentation::change_now(&table).to_bits(), want.to_bits());
        let core = frees.iter().copied().min().unwrap_or(0) / 2;
        for (i, &from) in frees.iter().enumerate() {
            let mut changed = frees.clone();
            changed[i] = from - core;
            let want = by_definition(&w, &cluster, model, cpu_free * 1000, &changed);
            proptest::prop_assert_eq!(f.change_after(&table, from, from - core).to_bits(), want.to_bits());
        }
    }
}
