use k8s_openapi::api::resource::v1 as resource;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use std::collections::BTreeMap;
use std::path::Path;

use super::*;
use crate::handoff::AllocatedDevice;
use crate::inventory::{FixtureSource, Health, InventorySource, MadeInstance, MigDevice, NodeInventory};

fn inv(fixture: &str) -> NodeInventory {
    FixtureSource::new(fixture).discover().unwrap()
}

pub(super) fn result(device: &str, consumed: &[(&str, &str)]) -> resource::DeviceRequestAllocationResult {
    resource::DeviceRequestAllocationResult {
        driver: DRIVER.into(),
        pool: "node-a".into(),
        device: device.into(),
        request: "gpu".into(),
        share_id: (!consumed.is_empty()).then(|| "7f1c".to_string()),
        consumed_capacity: (!consumed.is_empty()).then(|| {
            consumed
                .iter()
                .map(|(k, v)| (k.to_string(), Quantity(v.to_string())))
                .collect()
        }),
        ..Default::default()
    }
}

pub(super) fn claim(results: Vec<resource::DeviceRequestAllocationResult>, pods: &[&str]) -> resource::ResourceClaim {
    resource::ResourceClaim {
        metadata: ObjectMeta {
            name: Some("c".into()),
            namespace: Some("team-a".into()),
            uid: Some("u-1".into()),
            ..Default::default()
        },
        spec: Default::default(),
        status: Some(resource::ResourceClaimStatus {
            allocation: Some(resource::AllocationResult {
                devices: Some(resource::DeviceAllocationResult {
                    results: Some(results),
                    config: None,
                }),
                ..Default::default()
            }),
            reserved_for: Some(
                pods.iter()
                    .map(|p| resource::ResourceClaimConsumerReference {
                        resource: "pods".into(),
                        name: format!("pod-{p}"),
                        uid: p.to_string(),
                        api_group: None,
                    })
                    .collect(),
            ),
            devices: None,
        }),
    }
}

#[test]
fn a_node_publishes_each_healthy_card_with_consumable_capacity_and_carved_mig_devices() {
    let mut t4 = inv("t4x2");
    let devices = slice_devices(&t4, 1024);
    assert_eq!(
        devices.iter().map(|d| d.name.as_str()).collect::<Vec<_>>(),
        ["gpu-0", "gpu-1"]
    );
    let d = &devices[0];
    assert_eq!(d.allow_multiple_allocations, Some(true));
    let cap = d.capacity.as_ref().unwrap();
    let mem = &cap[CAPACITY_MEMORY];
    let mib = t4.gpus[0].memory_mib;
    assert_eq!(mem.value.0, format!("{mib}Mi"));
    let range = mem.request_policy.as_ref().unwrap().valid_range.as_ref().unwrap();
    // Whole GiB only, the most a share may take is the card's whole GiB.
    assert_eq!(range.step.as_ref().unwrap().0, "1024Mi");
    assert_eq!(range.max.as_ref().unwrap().0, format!("{}Mi", mib / 1024 * 1024));
    assert_eq!(
        cap[CAPACITY_CORES]
            .request_policy
            .as_ref()
            .unwrap()
            .default
            .as_ref()
            .unwrap()
            .0,
        "100"
    );
    let attrs = d.attributes.as_ref().unwrap();
    assert_eq!(attrs["uuid"].string.as_deref(), Some(t4.gpus[0].uuid.as_str()));
    // An unhealthy card is offered tainted (NoSchedule), and not at all where taints are not
    // served.
    t4.gpus[1].health = Health::Unhealthy {
        reason: "XID 79".into(),
    };
    let devices = slice_devices(&t4, 1024);
    assert_eq!(devices.len(), 2);
    assert_eq!(devices[0].taints, None);
    let taint = &devices[1].taints.as_ref().unwrap()[0];
    assert_eq!(
        (taint.key.as_str(), taint.effect.as_str()),
        (UNHEALTHY_TAINT, "NoSchedule")
    );
    assert_eq!(untainted(&devices).len(), 1);

    let mig = inv("a100-mig");
    let devices = slice_devices(&mig, 1024);
    for gpu in &mig.gpus {
        let named: Vec<&str> = devices
            .iter()
            .filter(|d| {
                d.attributes
                    .as_ref()
                    .unwrap()
                    .get("parentUUID")
                    .and_then(|a| a.string.as_deref())
                    == Some(gpu.uuid.as_str())
            })
            .map(|d| d.name.as_str())
            .collect();
        if gpu.mig_enabled {
            assert_eq!(named.len(), gpu.mig_devices.len(), "{named:?}");
            assert!(
                !devices.iter().any(|d| d.name == device_name(gpu, None)),
                "a MIG-mode card is not offered whole"
            );
        }
    }
    assert!(devices.iter().all(|d| d.name.len() <= 63));
}

#[test]
fn a_claim_with_no_consumed_capacity_gets_the_whole_card_and_a_share_its_capacity() {
    let t4 = inv("t4x2");
    let whole = prepare(&t4, "node-a", "u-1", &claim(vec![result("gpu-1", &[])], &["p1"])).unwrap();
    assert_eq!(whole.devices.len(), 1);
    assert_eq!(whole.devices[0].allocated, AllocatedDevice::whole(&t4.gpus[1]));
    assert_eq!(whole.pods, ["p1"]);
    let all = prepare(
        &t4,
        "node-a",
        "u-1",
        &claim(vec![result("gpu-1", &[("cores", "100"), ("memory", "15Gi")])], &[]),
    )
    .unwrap();
    assert!(matches!(
        all.devices[0].allocated,
        AllocatedDevice::Gpu { exclusive: true, .. }
    ));
    let share = prepare(
        &t4,
        "node-a",
        "u-1",
        &claim(
            vec![result("gpu-0", &[("cores", "30"), ("memory", "4Gi")])],
            &["p1", "p2"],
        ),
    )
    .unwrap();
    assert_eq!(
        share.devices[0].allocated,
        AllocatedDevice::Gpu {
            uuid: t4.gpus[0].uuid.clone(),
            index: 0,
            minor: t4.gpus[0].minor,
            core_percent: 30,
            memory_mib: 4096,
            exclusive: false,
        }
    );
    assert_eq!(share.devices[0].share_id.as_deref(), Some("7f1c"));
    // Results of other drivers are not Tessera's to prepare.
    let mut other = result("nic-0", &[]);
    other.driver = "net.example.com".into();
    let mixed = prepare(&t4, "node-a", "u-1", &claim(vec![other, result("gpu-0", &[])], &[])).unwrap();
    assert_eq!(mixed.devices.len(), 1);
}

#[test]
fn claims_the_node_cannot_honour_are_refused_with_what_is_wrong() {
    let t4 = inv("t4x2");
    let err = |c: &resource::ResourceClaim, uid: &str| prepare(&t4, "node-a", uid, c).unwrap_err().to_string();
    assert!(
        err(&claim(vec![result("gpu-9", &[])], &[]), "u-1")
            .contains("device \"gpu-9\" of pool \"node-a\" is not a device of node node-a")
    );
    let mut elsewhere = result("gpu-0", &[]);
    elsewhere.pool = "node-b".into();
    assert!(err(&claim(vec![elsewhere], &[]), "u-1").contains("pool \"node-b\""));
    assert!(
        err(&claim(vec![result("gpu-0", &[])], &[]), "u-2")
            .contains("the kubelet asked for uid u-2, the API server has uid u-1")
    );
    let mut unallocated = claim(vec![], &[]);
    unallocated.status = None;
    assert_eq!(err(&unallocated, "u-1"), "claim team-a/c: not allocated");
    assert!(
        err(
            &claim(vec![result("gpu-0", &[("cores", "2.5"), ("memory", "4Gi")])], &[]),
            "u-1"
        )
        .contains("consumedCapacity cores=\"2.5\" is invalid: not a whole number")
    );
    assert!(
        err(
            &claim(vec![result("gpu-0", &[("cores", "0"), ("memory", "4Gi")])], &[]),
            "u-1"
        )
        .contains("at least 1%")
    );
    // A card that went unhealthy after allocation is not handed out.
    let mut sick = t4.clone();
    sick.gpus[0].health = Health::Unhealthy {
        reason: "XID 48".into(),
    };
    assert!(prepare(&sick, "node-a", "u-1", &claim(vec![result("gpu-0", &[])], &[])).is_err());
}

/// A claim prepared as the DRA plugin prepares it: its record, with a token per request.
fn recorded(store: &ClaimStore, mut c: PreparedClaim) -> PreparedClaim {
    c.markers = new_markers(&c);
    store.put(&c).unwrap();
    c
}

/// The environment the kubelet gives a container handed `requests` of `c` (every request's
/// marker when `None`, as for a container naming the whole claim).
fn handed(c: &PreparedClaim, requests: Option<&[&str]>) -> Vec<String> {
    let spec = marker_spec(c);
    spec.devices
        .iter()
        .filter(|d| requests.is_none_or(|rs| rs.iter().any(|r| d.name == format!("{}_{r}", c.uid))))
        .flat_map(|d| d.container_edits.env.clone())
        .chain(["PATH=/bin".to_string()])
        .collect()
}

const ANYONE: &dyn Fn(&PreparedClaim) -> bool = &|_| true;

#[test]
fn a_container_gets_a_claims_devices_only_through_its_marker_in_its_namespace() {
    let dir = tempfile::tempdir().unwrap();
    let store = ClaimStore::new(dir.path());
    let t4 = inv("t4x2");
    let c = prepare(
        &t4,
        "node-a",
        "u-1",
        &claim(vec![result("gpu-0", &[("cores", "30"), ("memory", "4Gi")])], &["p1"]),
    )
    .unwrap();
    let c = recorded(&store, c);
    // What the kubelet hands the container: the marker's variable with the request's token.
    let marks = marked_claims(&handed(&c, None));
    assert_eq!(
        marks,
        [Mark {
            claim: "u-1".into(),
            request: Some("gpu".into()),
            token: c.markers["gpu"].clone()
        }]
    );
    let got = devices_for(&store, "team-a", &marks, ANYONE).unwrap();
    assert_eq!(got.devices, vec![c.devices[0].allocated.clone()]);
    assert_eq!(got.claims.keys().collect::<Vec<_>>(), ["u-1"]);
    // Another namespace's pod naming the claim (its env is its own to write) gets nothing.
    assert_eq!(
        devices_for(&store, "team-b", &marks, ANYONE).unwrap_err().to_string(),
        "claim team-a/c (u-1) is not a claim of namespace team-b"
    );
    // Nor does a pod of the namespace that writes the marker itself, without the token.
    let forged = [Mark {
        token: "u-1".into(),
        ..marks[0].clone()
    }];
    assert!(
        devices_for(&store, "team-a", &forged, ANYONE)
            .unwrap_err()
            .to_string()
            .contains("does not carry the claim's token")
    );
    // A claim-wide marker (as older plugins wrote them) does not stand for a claim recorded
    // with per-request markers, whatever its value.
    let claim_wide = [Mark {
        request: None,
        ..marks[0].clone()
    }];
    assert!(devices_for(&store, "team-a", &claim_wide, ANYONE).is_err());
    let other = [Mark {
        claim: "u-9".into(),
        ..marks[0].clone()
    }];
    assert_eq!(
        devices_for(&store, "team-a", &other, ANYONE).unwrap_err().to_string(),
        "claim u-9 is not prepared on this node"
    );
    // A record that cannot be read is said to be unreadable, not missing.
    std::fs::write(store.dir().join("u-7.json"), "{").unwrap();
    let unreadable = [Mark {
        claim: "u-7".into(),
        ..marks[0].clone()
    }];
    assert!(
        devices_for(&store, "team-a", &unreadable, ANYONE)
            .unwrap_err()
            .to_string()
            .contains("cannot be read")
    );
    // A marker name that is no uid, or no request, names nothing.
    assert!(marked_claims(&["TESSERA_DRA_CLAIM_.._etc=x".to_string()]).is_empty());
    assert!(marked_claims(&["TESSERA_DRA_CLAIM_u_1_R_GPU=x".to_string()]).is_empty());
    assert!(store.get("../../etc/passwd").unwrap().is_none());
}

/// A pod that copies another pod's marker (its token included) into its own environment gets
/// nothing: the claim must be reserved for the pod that uses it. Fails when `devices_for`
/// does not ask.
#[test]
fn a_claim_gives_its_devices_only_to_pods_it_is_reserved_for() {
    let dir = tempfile::tempdir().unwrap();
    let store = ClaimStore::new(dir.path());
    let c = prepare(
        &inv("t4x2"),
        "node-a",
        "u-1",
        &claim(vec![result("gpu-0", &[])], &["p1"]),
    )
    .unwrap();
    let c = recorded(&store, c);
    let marks = marked_claims(&handed(&c, None));
    let reserved_for = |pod: &'static str| move |claim: &PreparedClaim| claim.pods.iter().any(|p| p == pod);
    assert!(devices_for(&store, "team-a", &marks, &reserved_for("p1")).is_ok());
    assert_eq!(
        devices_for(&store, "team-a", &marks, &reserved_for("p2"))
            .unwrap_err()
            .to_string(),
        "claim team-a/c (u-1) is not reserved for this pod (status.reservedFor); a pod gets a claim only when it names it"
    );
}

/// A container handed one request of a claim gets that request's devices, not the claim's
/// others: each request has its own marker and token. Fails with one marker per claim.
#[test]
fn a_container_gets_only_the_requests_it_was_handed() {
    let dir = tempfile::tempdir().unwrap();
    let store = ClaimStore::new(dir.path());
    let mut second = result("gpu-1", &[]);
    second.request = "eval".into();
    let c = prepare(
        &inv("t4x2"),
        "node-a",
        "u-1",
        &claim(vec![result("gpu-0", &[]), second], &["p1"]),
    )
    .unwrap();
    let c = recorded(&store, c);
    assert_eq!(c.markers.keys().collect::<Vec<_>>(), ["eval", "gpu"]);
    let one = devices_for(&store, "team-a", &marked_claims(&handed(&c, Some(&["gpu"]))), ANYONE).unwrap();
    assert_eq!(one.devices, [c.devices[0].allocated.clone()]);
    let both = devices_for(&store, "team-a", &marked_claims(&handed(&c, None)), ANYONE).unwrap();
    assert_eq!(both.devices.len(), 2);
    // The first request's token does not open the second.
    let mut stolen = marked_claims(&handed(&c, Some(&["gpu"])));
    stolen[0].request = Some("eval".into());
    assert!(devices_for(&store, "team-a", &stolen, ANYONE).is_err());
    // Each device's CDI names are its requests' markers.
    assert_eq!(
        marker_devices(&c, &c.devices[1].requests),
        ["tessera.io/claim=u-1_eval"]
    );
}

/// Admin access (to a device in use, without its users' limits) is refused at preparation,
/// naming the device; before, it was granted as an exclusive whole card.
#[test]
fn admin_access_is_refused() {
    let mut r = result("gpu-0", &[]);
    r.admin_access = Some(true);
    let err = prepare(&inv("t4x2"), "node-a", "u-1", &claim(vec![r], &["p1"])).unwrap_err();
    assert!(
        matches!(err, DraError::AdminAccess { ref device, .. } if device == "gpu-0"),
        "{err}"
    );
}

#[test]
fn a_share_comes_alone_to_a_container() {
    let dir = tempfile::tempdir().unwrap();
    let store = ClaimStore::new(dir.path());
    let t4 = inv("t4x2");
    let mut marks = Vec::new();
    for (uid, device, consumed) in [
        ("u-1", "gpu-0", vec![("cores", "30"), ("memory", "4Gi")]),
        ("u-2", "gpu-0", vec![("cores", "30"), ("memory", "4Gi")]),
        ("u-3", "gpu-1", vec![]),
    ] {
        let mut c = prepare(&t4, "node-a", "u-1", &claim(vec![result(device, &consumed)], &[])).unwrap();
        c.uid = uid.into();
        let c = recorded(&store, c);
        marks.push(marked_claims(&handed(&c, None)).remove(0));
    }
    // Two equal shares of one card, or a share beside a whole card: one container's limits
    // could hold only one of them.
    for pair in [[0, 1], [0, 2]] {
        let two: Vec<_> = pair.iter().map(|&i| marks[i].clone()).collect();
        let err = devices_for(&store, "team-a", &two, ANYONE).unwrap_err().to_string();
        assert!(err.contains("a container may hold one share, alone"), "{err}");
    }
    assert_eq!(
        devices_for(&store, "team-a", &marks[2..], ANYONE)
            .unwrap()
            .devices
            .len(),
        1
    );
}

#[test]
fn records_are_written_whole_for_root_only_and_removed_idempotently() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir().unwrap();
    let store = ClaimStore::new(dir.path());
    let t4 = inv("t4x2");
    let c = prepare(&t4, "node-a", "u-1", &claim(vec![result("gpu-0", &[])], &["p1"])).unwrap();
    store.put(&c).unwrap();
    store.put(&c).unwrap();
    assert_eq!(store.get("u-1").unwrap(), Some(c.clone()));
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(store.dir()), 0o700);
    assert_eq!(mode(&store.dir().join("u-1.json")), 0o600);
    assert_eq!(store.list(), (vec![c.clone()], vec![]));
    std::fs::write(store.dir().join("u-2.json"), "{").unwrap();
    let (claims, bad) = store.list();
    assert_eq!((claims.len(), bad.len()), (1, 1), "{bad:?}");
    // An unreadable record is set aside, out of the records' way, and kept for people.
    assert_eq!(store.unreadable(), ["u-2"]);
    let aside = store.set_aside("u-2").unwrap();
    assert_eq!(std::fs::read_to_string(aside).unwrap(), "{");
    assert_eq!(store.list(), (vec![c], vec![]));
    assert!(store.unreadable().is_empty());
    store.remove("u-1").unwrap();
    store.remove("u-1").unwrap();
    assert_eq!(store.get("u-1").unwrap(), None);
    assert!(
        std::fs::read_dir(store.dir())
            .unwrap()
            .flatten()
            .all(|e| !e.file_name().to_string_lossy().contains(".tmp-"))
    );
}

#[test]
fn a_claims_markers_are_a_valid_cdi_spec_each_setting_only_its_variable() {
    let uid = "0b6c7a2e-1d2f-4c59-9a41-3f1e2d3c4b5a";
    let c = PreparedClaim {
        uid: uid.into(),
        namespace: "team-a".into(),
        name: "c".into(),
        pods: vec![],
        token: String::new(),
        markers: [
            ("gpu".to_string(), "9f2c".to_string()),
            ("big-gpus/h100".to_string(), "77aa".to_string()),
        ]
        .into(),
        devices: vec![],
    };
    let spec = marker_spec(&c);
    spec.validate().unwrap();
    assert_eq!(
        marker_device(uid, "big-gpus/h100"),
        format!("tessera.io/claim={uid}_big-gpus.h100")
    );
    let envs: Vec<_> = spec.devices.iter().map(|d| d.container_edits.env.clone()).collect();
    assert_eq!(
        envs,
        [
            vec![format!(
                "TESSERA_DRA_CLAIM_0b6c7a2e_1d2f_4c59_9a41_3f1e2d3c4b5a_R_big_gpus_S_h100=77aa"
            )],
            vec![format!(
                "TESSERA_DRA_CLAIM_0b6c7a2e_1d2f_4c59_9a41_3f1e2d3c4b5a_R_gpu=9f2c"
            )],
        ]
    );
    let marks = marked_claims(&envs.concat());
    assert_eq!(
        marks.iter().map(|m| m.request.clone().unwrap()).collect::<Vec<_>>(),
        ["big-gpus/h100", "gpu"]
    );
    // A claim an older plugin recorded keeps its one claim-wide marker.
    let old = PreparedClaim {
        markers: Default::default(),
        token: "5e5e".into(),
        ..c
    };
    let spec = marker_spec(&old);
    spec.validate().unwrap();
    assert_eq!(
        spec.devices[0].container_edits.env,
        ["TESSERA_DRA_CLAIM_0b6c7a2e_1d2f_4c59_9a41_3f1e2d3c4b5a=5e5e"]
    );
    assert_eq!(
        marker_devices(&old, &["gpu".into()]),
        [format!("tessera.io/claim={uid}")]
    );
    assert_eq!(marked_claims(&spec.devices[0].container_edits.env)[0].request, None);
    assert_ne!(new_token(), new_token());
}

fn device<'a>(p: &'a Published, name: &str) -> &'a resource::Device {
    p.devices
        .iter()
        .find(|d| d.name == name)
        .unwrap_or_else(|| panic!("no device {name}"))
}

fn consumed(d: &resource::Device) -> BTreeMap<String, String> {
    let c = d.consumes_counters.as_ref().expect("consumes counters");
    assert_eq!(c.len(), 1);
    c[0].counters
        .iter()
        .map(|(k, v)| (k.clone(), v.value.0.clone()))
        .collect()
}

#[test]
fn dynamic_mig_publishes_every_placement_over_the_cards_counters() {
    let inv = inv("a100-dynamic-mig");
    // Without the node's label the cards in MIG mode offer the instances they have: none.
    assert!(publish(&inv, 1024, false, &[]).devices.is_empty());
    let p = publish(&inv, 1024, true, &[]);
    // Per A100-40GB: 7 + 7 (+me) + 4 + 3 + 2 + 1 + 1 placements.
    assert_eq!(p.devices.len(), 2 * 25);
    assert_eq!(p.counter_sets.len(), 2);
    let set = &p.counter_sets[0];
    assert_eq!(set.name, "gpu-0-counters");
    let totals: BTreeMap<&str, &str> = set
        .counters
        .iter()
        .map(|(k, v)| (k.as_str(), v.value.0.as_str()))
        .collect();
    assert_eq!(totals["compute-slices"], "7");
    assert_eq!(totals["decoders"], "5");
    assert_eq!(totals["jpeg-decoders"], "1");
    assert_eq!(
        (1..=8)
            .filter(|s| totals.contains_key(format!("memory-slice-{}", s - 1).as_str()))
            .count(),
        8
    );
    assert!(!totals.contains_key("encoders"), "an A100 has no encoder: no counter");
    let small = device(&p, "gpu-0-mig-3g-20gb-at-4");
    assert_eq!(
        consumed(small),
        BTreeMap::from(
            [
                ("compute-slices", "3"),
                ("decoders", "2"),
                ("memory-slice-4", "1"),
                ("memory-slice-5", "1"),
                ("memory-slice-6", "1"),
                ("memory-slice-7", "1"),
            ]
            .map(|(k, v)| (k.to_string(), v.to_string()))
        )
    );
    let me = device(&p, "gpu-1-mig-1g-5gb-me-at-3");
    assert_eq!(consumed(me)["jpeg-decoders"], "1");
    assert_eq!(me.consumes_counters.as_ref().unwrap()[0].counter_set, "gpu-1-counters");
    let attrs = me.attributes.as_ref().unwrap();
    assert_eq!(attrs["profile"].string.as_deref(), Some("1g.5gb+me"));
    assert_eq!(attrs["type"].string.as_deref(), Some("mig"));
    assert_eq!(attrs["placementStart"].int, Some(3));
    // Every counter a device consumes is one of its card's, and no more than the card has.
    for d in &p.devices {
        let set = &p.counter_sets[if d.name.starts_with("gpu-0") { 0 } else { 1 }];
        for (k, v) in consumed(d) {
            let have: u32 = set.counters[&k].value.0.parse().unwrap();
            assert!(v.parse::<u32>().unwrap() <= have, "{}: {k}={v} of {have}", d.name);
        }
        assert!(
            d.name.len() <= 63
                && d.name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        );
    }
}

#[test]
fn slices_hold_devices_or_counters_within_the_apis_limits() {
    let inv = inv("a100-dynamic-mig");
    let mut p = publish(&inv, 1024, true, &[]);
    // Nine cards' counter sets: two counter slices (8 sets at most in one).
    for i in 2..9 {
        let mut set = p.counter_sets[0].clone();
        set.name = format!("gpu-{i}-counters");
        p.counter_sets.push(set);
    }
    let s = slices("node-a", 4, &p);
    let names: Vec<&str> = s.iter().map(|s| s.metadata.name.as_deref().unwrap()).collect();
    assert_eq!(
        names,
        [
            "node-a-gpu.tessera.io-counters-0",
            "node-a-gpu.tessera.io-counters-1",
            "node-a-gpu.tessera.io",
        ]
    );
    for slice in &s {
        assert_eq!(slice.spec.pool.resource_slice_count, 3);
        assert_eq!(slice.spec.pool.generation, 4);
        assert_eq!(slice.spec.node_name.as_deref(), Some("node-a"));
        assert!(slice.spec.devices.is_some() != slice.spec.shared_counters.is_some());
        assert!(slice.spec.devices.as_ref().is_none_or(|d| d.len() <= DEVICES_PER_SLICE));
        assert!(
            slice
                .spec
                .shared_counters
                .as_ref()
                .is_none_or(|c| c.len() <= COUNTER_SETS_PER_SLICE)
        );
    }
    // 130 devices: three device slices.
    let many = Published {
        devices: (0..130)
            .map(|i| resource::Device {
                name: format!("d-{i}"),
                ..Default::default()
            })
            .collect(),
        counter_sets: vec![],
    };
    let s = slices("n", 1, &many);
    assert_eq!(s.len(), 3);
    assert_eq!(s[2].metadata.name.as_deref(), Some("n-gpu.tessera.io-2"));
    assert_eq!(s[2].spec.devices.as_ref().unwrap().len(), 2);
    // No device at all: one empty slice, so the pool says the node has nothing.
    assert_eq!(slices("n", 1, &Published::default()).len(), 1);
}

#[test]
fn an_instance_tessera_did_not_make_is_offered_as_it_is_and_its_placements_are_not() {
    let mut inv = inv("a100-dynamic-mig");
    let gpu = inv.gpus[0].clone();
    let foreign = MigDevice {
        index: 0,
        uuid: "MIG-11111111-2222-3333-4444-555555555555".into(),
        gi: 3,
        ci: 0,
        profile: "2g.10gb".parse().unwrap(),
        memory_mib: 9856,
        gi_access: gpu.device.clone(),
        ci_access: gpu.device.clone(),
        placement: Some(crate::inventory::MigPlacement { start: 2, size: 2 }),
    };
    inv.gpus[0].mig_devices.push(foreign.clone());
    let p = publish(&inv, 1024, true, &[]);
    let names: Vec<&str> = p
        .devices
        .iter()
        .map(|d| d.name.as_str())
        .filter(|n| n.starts_with("gpu-0-"))
        .collect();
    assert!(names.contains(&"gpu-0-mig-3-0"), "{names:?}");
    for gone in [
        "gpu-0-mig-2g-10gb-at-2",
        "gpu-0-mig-1g-5gb-at-3",
        "gpu-0-mig-3g-20gb-at-0",
        "gpu-0-mig-7g-40gb-at-0",
    ] {
        assert!(
            !names.contains(&gone),
            "{gone} overlaps the operator's instance: {names:?}"
        );
    }
    for kept in [
        "gpu-0-mig-2g-10gb-at-0",
        "gpu-0-mig-1g-5gb-at-1",
        "gpu-0-mig-3g-20gb-at-4",
    ] {
        assert!(names.contains(&kept), "{kept}: {names:?}");
    }
    // The same instance made by Tessera for a claim: not offered (the claim holds it), and
    // its placements stay offered (the scheduler counts the claim's counters).
    let ours = carve_of(&gpu, "gpu-0-mig-2g-10gb-at-2").unwrap();
    assert_eq!(ours.profile_id, 14);
    let p = publish(&inv, 1024, true, std::slice::from_ref(&ours));
    assert!(p.devices.iter().all(|d| d.name != "gpu-0-mig-3-0"));
    assert!(p.devices.iter().any(|d| d.name == "gpu-0-mig-2g-10gb-at-2"));
    // Nor is it offered once the label goes: the claim still holds it.
    let p = publish(&inv, 1024, false, std::slice::from_ref(&ours));
    assert!(p.devices.iter().all(|d| d.name != "gpu-0-mig-3-0"));
    let p = publish(&inv, 1024, false, &[]);
    assert!(p.devices.iter().any(|d| d.name == "gpu-0-mig-3-0"));
    // An instance of unknown placement, or of a profile the card does not list, covers the card.
    let mut odd = inv.clone();
    odd.gpus[0].mig_devices[0].profile = "1c.2g.10gb".parse().unwrap();
    inv.gpus[0].mig_devices[0].placement = None;
    for inv in [inv, odd] {
        let p = publish(&inv, 1024, true, &[]);
        assert_eq!(
            p.devices.iter().filter(|d| d.name.starts_with("gpu-0-")).count(),
            1,
            "only the instance itself"
        );
    }
}

#[test]
fn preparing_a_placement_creates_its_instance() {
    let inv = inv("a100-dynamic-mig");
    let c = claim(vec![result("gpu-1-mig-3g-20gb-at-4", &[])], &["p1"]);
    let mut asked = Vec::new();
    let got = prepare_with(&inv, "node-a", "u-1", &c, &mut |plan| {
        asked.push(plan.clone());
        Ok(MadeInstance {
            gi: 2,
            ci: 0,
            uuid: "MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee".into(),
        })
    })
    .unwrap();
    assert_eq!(asked.len(), 1);
    assert_eq!(
        (
            asked[0].parent_uuid.as_str(),
            asked[0].profile_id,
            asked[0].placement.start,
            asked[0].placement.size
        ),
        ("GPU-7be0c9d2-3f41-4a85-b6d0-2c9e81f4a7b3", 9, 4, 4)
    );
    assert_eq!(got.devices[0].carved.as_ref(), Some(&asked[0]));
    assert!(matches!(
        &got.devices[0].allocated,
        AllocatedDevice::Mig { uuid, gi: 2, parent_index: 1, profile, .. }
            if uuid == "MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee" && profile.to_string() == "3g.20gb"
    ));
    // A node that cannot create instances refuses, naming the device; so does a failed create.
    let err = prepare(&inv, "node-a", "u-1", &c).unwrap_err().to_string();
    assert!(
        err.contains("gpu-1-mig-3g-20gb-at-4") && err.contains("creates no MIG instances"),
        "{err}"
    );
    let err = prepare_with(&inv, "node-a", "u-1", &c, &mut |_| Err("insufficient resources".into()))
        .unwrap_err()
        .to_string();
    assert!(err.contains("insufficient resources"), "{err}");
    // An unhealthy card's placements are not prepared.
    let mut sick = inv.clone();
    sick.gpus[1].health = Health::Unhealthy {
        reason: "XID 79".into(),
    };
    let err = prepare_with(&sick, "node-a", "u-1", &c, &mut |_| {
        panic!("no instance on a sick card")
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("not a device of node"), "{err}");
}

#[test]
fn the_carving_ledger_names_what_is_being_made() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = CarveLedger::new(dir.path());
    let gpu = &inv("a100-dynamic-mig").gpus[0];
    let a = carve_of(gpu, "gpu-0-mig-1g-5gb-at-0").unwrap();
    let b = carve_of(gpu, "gpu-0-mig-1g-5gb-at-1").unwrap();
    ledger.add("u-1", &a, vec![]).unwrap();
    ledger.add("u-1", &b, vec!["MIG-y".into()]).unwrap();
    let made = MadeInstance {
        gi: 1,
        ci: 0,
        uuid: "MIG-x".into(),
    };
    ledger.made("u-1", &b, &made).unwrap();
    // A second attempt at `b` is an entry of its own; the one not made is forgotten.
    ledger.add("u-1", &b, vec![]).unwrap();
    ledger.forget("u-1", &b).unwrap();
    let got = ledger.get("u-1").unwrap();
    assert_eq!(got.iter().map(|c| &c.carve).collect::<Vec<_>>(), [&a, &b]);
    assert_eq!((got[0].made.as_ref(), got[1].made.as_ref()), (None, Some(&made)));
    assert_eq!(got[1].before, ["MIG-y"]);
    assert!(ledger.add("../x", &a, vec![]).is_err());
    assert_eq!(ledger.list().0.len(), 1);
    ledger.remove("u-1").unwrap();
    ledger.remove("u-1").unwrap();
    assert!(ledger.list().0.is_empty());
}

/// Two requests of one claim that are shares of one card are refused at prepare: the node
/// holds a claim's share of a card as one container's limits, and could give neither its own.
#[test]
fn two_shares_of_one_card_in_one_claim_are_refused() {
    let a = result("gpu-0", &[("cores", "30"), ("memory", "4Gi")]);
    let mut b = result("gpu-0", &[("cores", "20"), ("memory", "2Gi")]);
    b.request = "second".into();
    b.share_id = Some("8a2d".into());
    let err = prepare(&inv("t4x2"), "node-a", "u-1", &claim(vec![a, b], &["p1"])).unwrap_err();
    assert!(matches!(err, DraError::TwoSharesOfOneCard { .. }), "{err}");
}
