use super::*;
use crate::inventory::{FixtureSource, InventorySource};
use crate::placement::CardDemand;
use crate::request::{PodRequest, RequestOptions};

fn capacity(fixture: &str) -> NodeCapacity {
    let inv = FixtureSource {
        fixture: fixture.into(),
        driver_root: None,
    }
    .discover()
    .unwrap();
    NodeCapacity {
        cpu_milli: 64_000,
        memory_bytes: 512 << 30,
        gpus: inv.gpus,
        schedulable: true,
        share_enforcement: Default::default(),
        topology: inv.topology.map(std::sync::Arc::new),
        cross_tenant: false,
    }
}

fn ledger() -> Ledger {
    let mut l = Ledger::new(EngineConfig::default(), &TargetWorkload::default());
    assert!(l.set_node("h", capacity("h100x8")).is_empty());
    assert!(l.set_node("a", capacity("a100-mig")).is_empty());
    l
}

fn share(core_milli: u32, mem: u64) -> PodDemand {
    PodDemand::single(
        1000,
        1 << 30,
        Some(CardDemand::Share {
            core_milli,
            memory_mib: Some(mem),
        }),
    )
}

fn from_json(v: serde_json::Value) -> PodDemand {
    let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(v).unwrap();
    PodDemand::from_request(&PodRequest::from_pod(&pod, &RequestOptions::default()).unwrap())
}

fn used(l: &Ledger, node: &str) -> Vec<(u32, u64)> {
    let i = l.node_index(node).unwrap();
    l.cluster().nodes[i]
        .cards
        .iter()
        .map(|c| (c.core_used, c.memory_used))
        .collect()
}

fn mig_used(l: &Ledger, node: &str) -> usize {
    let i = l.node_index(node).unwrap();
    l.cluster().nodes[i]
        .cards
        .iter()
        .flat_map(|c| c.mig.iter().flatten())
        .filter(|s| s.used)
        .count()
}

#[test]
fn reserve_books_what_the_allocation_says_and_unbook_frees_it() {
    let mut l = ledger();
    let before = used(&l, "h");
    let a = l.reserve("u1", "h", &share(300, 8192), Some(50)).unwrap().unwrap();
    assert_eq!(
        (a.node.as_str(), a.pod_uid.as_str(), a.core_limit),
        ("h", "u1", Some(50))
    );
    let AllocatedDevice::Gpu {
        core_percent,
        memory_mib,
        exclusive,
        ref uuid,
        ..
    } = a.containers[0].devices[0]
    else {
        panic!("a GPU share")
    };
    assert_eq!((core_percent, memory_mib, exclusive), (30, 8192, false));
    let after = used(&l, "h");
    let i = l.cluster().nodes[l.node_index("h").unwrap()]
        .cards
        .iter()
        .position(|c| &c.uuid == uuid)
        .unwrap();
    assert_eq!(after[i], (300, 8192));
    assert_eq!(l.booking("u1").unwrap().hold, Hold::Reserved);
    // A retried bind gets the same allocation and books nothing more.
    assert_eq!(l.reserve("u1", "h", &share(300, 8192), Some(50)).unwrap().unwrap(), a);
    assert_eq!(used(&l, "h"), after);
    l.unbook("u1").unwrap();
    assert_eq!(used(&l, "h"), before);
    assert!(l.unbook("u1").is_none(), "unbooking twice is harmless");
}

#[test]
fn a_bound_pod_keeps_its_cards_when_a_stale_bind_names_another_node() {
    let mut l = ledger();
    let demand = share(300, 8192);
    l.reserve("u1", "h", &demand, None).unwrap();
    // A reservation on another node (a failed bind retried elsewhere) moves the pod.
    assert!(l.reserve("u1", "a", &PodDemand::default(), None).is_ok());
    assert_eq!(l.booking("u1").unwrap().node, "a");
    l.reserve("u1", "h", &demand, None).unwrap();
    let held = used(&l, "h");
    // Once bound, it does not move.
    l.confirm("u1");
    let err = l.reserve("u1", "a", &PodDemand::default(), None).unwrap_err();
    assert_eq!(err.to_string(), "pod is already bound to node \"h\"");
    assert_eq!((l.booking("u1").unwrap().node.as_str(), used(&l, "h")), ("h", held));
}

#[test]
fn an_allocation_read_back_costs_what_the_plan_cost() {
    // Init container and two app containers: the plan's per-card maximum over phases must be
    // what the allocation maps back to.
    let demand = from_json(serde_json::json!({
        "metadata": {"name": "p"},
        "spec": {
            "initContainers": [{"name": "init", "resources": {"limits": {"tessera.io/gpu-core": "60", "tessera.io/gpu-memory": "10"}}}],
            "containers": [
                {"name": "a", "resources": {"limits": {"tessera.io/gpu-core": "40", "tessera.io/gpu-memory": "8"}}},
                {"name": "b", "resources": {"limits": {"tessera.io/gpu-core": "200"}}}
            ]
        }
    }));
    let mut l = ledger();
    let i = l.node_index("h").unwrap();
    let placement = l.engine().plan_on(i, &demand).unwrap();
    let node = l.engine().cluster.nodes[i].clone();
    let a = allocation_of(&node, &demand, &placement.plan, "u");
    assert_eq!(usage_of(&node, &demand, &a).unwrap(), placement.plan.usage);
    // The codec round trip changes nothing.
    let decoded = Allocation::decode(&a.encode()).unwrap();
    assert_eq!(usage_of(&node, &demand, &decoded).unwrap(), placement.plan.usage);
}

#[test]
fn mig_slices_are_booked_and_freed() {
    let demand = from_json(serde_json::json!({
        "metadata": {"name": "p"},
        "spec": {"containers": [{"name": "m", "resources": {"limits": {"tessera.io/mig-1g.5gb": "2"}}}]}
    }));
    let mut l = ledger();
    let a = l.reserve("m", "a", &demand, None).unwrap().unwrap();
    assert_eq!(a.containers[0].devices.len(), 2);
    assert!(matches!(a.containers[0].devices[0], AllocatedDevice::Mig { .. }));
    assert_eq!(mig_used(&l, "a"), 2);
    l.unbook("m");
    assert_eq!(mig_used(&l, "a"), 0);
}

#[test]
fn bookings_survive_a_republished_node_and_wait_for_an_unknown_one() {
    let mut l = ledger();
    let a = l.reserve("u", "h", &share(500, 1000), None).unwrap().unwrap();
    let after = used(&l, "h");
    // The node is published again with a card turning unhealthy: the booking still counts.
    let mut cap = capacity("h100x8");
    cap.gpus[7].health = crate::inventory::Health::Unhealthy {
        reason: "xid 79".into(),
    };
    assert!(l.set_node("h", cap).is_empty());
    assert_eq!(used(&l, "h"), after);

    // A pod seen bound to a node the ledger does not know yet counts once the node appears.
    let mut b = a.clone();
    b.node = "late".into();
    l.book(
        "v",
        Booking {
            node: "late".into(),
            demand: share(500, 1000),
            allocation: Some(b),
            hold: Hold::Bound,
        },
    )
    .unwrap();
    l.set_node("late", capacity("h100x8"));
    assert_eq!(used(&l, "late"), after);
    // Deleted nodes keep their bookings for when they return.
    l.remove_node("late");
    assert!(l.node_index("late").is_none());
    l.set_node("late", capacity("h100x8"));
    assert_eq!(used(&l, "late"), after);
}

#[test]
fn an_allocation_naming_an_unknown_device_is_refused_and_changes_nothing() {
    let mut l = ledger();
    let mut a = l.reserve("u", "h", &share(500, 1000), None).unwrap().unwrap();
    let before = used(&l, "h");
    if let AllocatedDevice::Gpu { uuid, .. } = &mut a.containers[0].devices[0] {
        *uuid = "GPU-nope".into();
    }
    let err = l
        .book(
            "u",
            Booking {
                node: "h".into(),
                demand: share(500, 1000),
                allocation: Some(a),
                hold: Hold::Bound,
            },
        )
        .unwrap_err();
    assert!(err.to_string().contains("GPU-nope"), "{err}");
    assert_eq!(used(&l, "h"), before);
    assert_eq!(l.booking("u").unwrap().hold, Hold::Reserved, "the old booking stays");
}

#[test]
fn reserve_refuses_when_the_node_is_full_and_fits_without_checks_victims() {
    let mut l = ledger();
    for k in 0..8 {
        l.reserve(&format!("w{k}"), "h", &share(1000, 1000), None).unwrap();
    }
    let err = l.reserve("x", "h", &share(500, 1000), None).unwrap_err();
    assert!(matches!(err, LedgerError::DoesNotFit { .. }), "{err}");
    assert!(l.booking("x").is_none());
    assert!(l.fits_without("h", &share(500, 1000), &[]).is_err());
    let full = used(&l, "h");
    l.fits_without("h", &share(500, 1000), &["w3"]).unwrap();
    assert_eq!(used(&l, "h"), full, "the probe changes nothing");
    assert!(matches!(
        l.reserve("x", "nowhere", &share(500, 1000), None),
        Err(LedgerError::UnknownNode(_))
    ));
}

fn pod_json(containers: &[(&str, u32, u32)]) -> serde_json::Value {
    serde_json::json!({"metadata": {"name": "p"}, "spec": {"containers": containers.iter().map(|(n, core, mem)| serde_json::json!({
        "name": n, "resources": {"limits": {"tessera.io/gpu-core": core.to_string(), "tessera.io/gpu-memory": mem.to_string()}}
    })).collect::<Vec<_>>()}})
}

#[test]
fn a_held_container_keeps_its_devices_and_the_rest_is_planned_beside_it() {
    let mut l = ledger();
    // A claim's retained GPU: 30% + 8 GiB, booked under its own key.
    let held_demand = from_json(pod_json(&[("a", 30, 8)]));
    let retained = l.reserve("egpu-1", "h", &held_demand, None).unwrap().unwrap();
    l.confirm("egpu-1");
    let before = used(&l, "h");
    let card = retained.containers[0].devices[0].clone();

    // The pod using it: container a holds that device, b needs 20% + 4 GiB more.
    let full = from_json(pod_json(&[("a", 30, 8), ("b", 20, 4)]));
    let planned = from_json(pod_json(&[("b", 20, 4)]));
    // On another node the handed-over booking is not there: refused, nothing changes.
    let err = l
        .reserve_holding("pod", "a", &full, &planned, None, &retained.containers, &["egpu-1"])
        .unwrap_err();
    assert!(err.to_string().contains("held on node \"h\""), "{err}");
    assert!(l.booking("egpu-1").is_some() && l.booking("pod").is_none());

    let a = l
        .reserve_holding("pod", "h", &full, &planned, None, &retained.containers, &["egpu-1"])
        .unwrap()
        .unwrap();
    assert_eq!(
        a.containers.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(),
        ["a", "b"]
    );
    assert_eq!(a.containers[0].devices, [card]);
    assert!(l.booking("egpu-1").is_none());
    // What the node holds: the retained share (now the pod's) plus b's.
    let total = |u: &[(u32, u64)]| u.iter().fold((0, 0), |(c, m), (uc, um)| (c + uc, m + um));
    assert_eq!(total(&used(&l, "h")), (total(&before).0 + 200, total(&before).1 + 4096));
    // Freeing the pod frees both; the claim's booking is the caller's to put back.
    l.unbook("pod");
    assert_eq!(total(&used(&l, "h")), (0, 0));
}

/// A card's shares belong to one tenant: a second tenant's share goes to another card, and
/// once every card holds another tenant's shares it is refused, saying why and naming no
/// tenant. A node labelled for cross-tenant sharing packs them together. Whole cards and MIG
/// slices are not shares.
#[test]
fn a_cards_shares_belong_to_one_tenant_unless_the_node_opts_in() {
    use crate::placement::Tenant;
    let tenant = |name: &str, core: u32| PodDemand {
        tenant: Tenant::named(name),
        ..share(core, 1024)
    };
    // t4x2: two cards.
    let mut l = Ledger::new(EngineConfig::default(), &TargetWorkload::default());
    assert!(l.set_node("t", capacity("t4x2")).is_empty());
    let card_of = |a: &Allocation| a.containers[0].devices[0].card_uuid().to_string();
    let a1 = l.reserve("a1", "t", &tenant("team-a", 200), None).unwrap().unwrap();
    let b1 = l.reserve("b1", "t", &tenant("team-b", 200), None).unwrap().unwrap();
    assert_ne!(card_of(&a1), card_of(&b1), "two tenants on one card");
    // Each tenant's next share joins its own card.
    let a2 = l.reserve("a2", "t", &tenant("team-a", 200), None).unwrap().unwrap();
    assert_eq!(card_of(&a2), card_of(&a1));
    // A third tenant: every card with room holds another tenant's shares.
    let err = l
        .reserve("c1", "t", &tenant("team-c", 200), None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("another tenant") && err.contains("tessera.io/cross-tenant-sharing=true"),
        "{err}"
    );
    assert!(!err.contains("team-a") && !err.contains("team-b"), "{err}");
    // Once team-b's share goes, its card is free for anyone.
    l.unbook("b1");
    let c1 = l.reserve("c1", "t", &tenant("team-c", 200), None).unwrap().unwrap();
    assert_eq!(card_of(&c1), card_of(&b1));

    // Opted in: shares of different tenants share a card.
    let mut cap = capacity("t4x2");
    cap.cross_tenant = true;
    let mut l = Ledger::new(EngineConfig::default(), &TargetWorkload::default());
    assert!(l.set_node("t", cap).is_empty());
    for (i, t) in ["team-a", "team-b", "team-c"].into_iter().enumerate() {
        l.reserve(&format!("p{i}"), "t", &tenant(t, 200), None)
            .unwrap()
            .unwrap();
    }
    let busy = used(&l, "t").iter().filter(|(c, _)| *c > 0).count();
    assert!(busy < 3, "three tenants' shares packed onto {busy} card(s) of 2");
}

/// Namespaces the operator labels into one group are one tenant: their shares share a card; a
/// group is not the namespace of the same name, and an empty label is no group.
#[test]
fn namespaces_labelled_into_one_group_are_one_tenant() {
    use crate::placement::Tenant;
    let of = Tenant::of_namespace;
    assert_eq!(of("ml-train", Some("ml")), of("ml-serve", Some("ml")));
    assert_ne!(of("ml-train", Some("ml")), of("ml-train", None));
    assert_ne!(of("ml", None), of("other", Some("ml")), "group ml is not namespace ml");
    assert_eq!(of("a", Some(" ")), of("a", None));
    let demand = |ns: &str, label: Option<&str>| PodDemand {
        tenant: of(ns, label),
        ..share(200, 1024)
    };
    let mut l = Ledger::new(EngineConfig::default(), &TargetWorkload::default());
    assert!(l.set_node("t", capacity("t4x2")).is_empty());
    let card_of = |a: &Allocation| a.containers[0].devices[0].card_uuid().to_string();
    // Spread policy would put them apart; one tenant's shares pack onto a card already theirs.
    let a = l
        .reserve("a", "t", &demand("ml-train", Some("ml")), None)
        .unwrap()
        .unwrap();
    let b = l.reserve("b", "t", &demand("other", None), None).unwrap().unwrap();
    let c = l
        .reserve("c", "t", &demand("ml-serve", Some("ml")), None)
        .unwrap()
        .unwrap();
    assert_ne!(card_of(&a), card_of(&b));
    assert_eq!(card_of(&c), card_of(&a), "the group's second namespace joins its card");
    let err = l
        .reserve("d", "t", &demand("ml-serve", None), None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("another tenant"),
        "unlabelled, it is a tenant of its own: {err}"
    );
}
