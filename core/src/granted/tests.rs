use super::*;
use crate::dra::{PreparedClaim, PreparedDevice};

fn gpu(uuid: &str, exclusive: bool) -> AllocatedDevice {
    AllocatedDevice::Gpu {
        uuid: uuid.into(),
        index: 0,
        minor: 0,
        core_percent: if exclusive { 100 } else { 30 },
        memory_mib: 4096,
        exclusive,
    }
}

fn live(pod_uid: &str, pod: &str, devices: Vec<AllocatedDevice>, claim: Option<&str>) -> Granted {
    Granted {
        uuids: devices
            .iter()
            .map(|d| d.uuid().to_string())
            .collect::<Vec<_>>()
            .join(","),
        namespace: "team-a".into(),
        pod: pod.into(),
        pod_uid: pod_uid.into(),
        container: "main".into(),
        claims: claim
            .map(|c| BTreeMap::from([(c.to_string(), devices.iter().map(|d| d.uuid().to_string()).collect())]))
            .unwrap_or_default(),
        devices,
        ..Default::default()
    }
}

fn via(claim: &str, uuid: &str) -> BTreeMap<String, Vec<String>> {
    BTreeMap::from([(claim.to_string(), vec![uuid.to_string()])])
}

/// A card held whole by a live container of another pod is granted to nobody else, whole or
/// by a share; shares sit side by side; a pod's own containers, and containers given the card
/// through one DRA claim, share it.
#[test]
fn a_card_held_whole_is_granted_to_no_other_pod() {
    let held = live("uid-1", "trainer", vec![gpu("GPU-1", true)], None);
    let books = [("ctr-1", &held)];
    let err = double_grant(books, "uid-2", "c", &[gpu("GPU-1", true)], &BTreeMap::new()).unwrap();
    assert!(
        err.contains("GPU-1") && err.contains("team-a/trainer") && err.contains("refusing a second grant"),
        "{err}"
    );
    let err = double_grant(books, "uid-2", "c", &[gpu("GPU-1", false)], &BTreeMap::new()).unwrap();
    assert!(err.contains("as a whole card"), "{err}");
    assert_eq!(
        double_grant(books, "uid-1", "c", &[gpu("GPU-1", true)], &BTreeMap::new()),
        None
    );
    let shares = live("uid-3", "s1", vec![gpu("GPU-2", false)], None);
    assert_eq!(
        double_grant(
            [("ctr-3", &shares)],
            "uid-4",
            "c",
            &[gpu("GPU-2", false)],
            &BTreeMap::new()
        ),
        None
    );
    assert!(
        double_grant(
            [("ctr-3", &shares)],
            "uid-4",
            "c",
            &[gpu("GPU-2", true)],
            &BTreeMap::new()
        )
        .is_some()
    );
    let stopped = Granted {
        stopped: true,
        ..held.clone()
    };
    assert_eq!(
        double_grant(
            [("ctr-1", &stopped)],
            "uid-2",
            "c",
            &[gpu("GPU-1", true)],
            &BTreeMap::new()
        ),
        None
    );
}

/// Pods are told apart by UID: a StatefulSet pod recreated under its predecessor's name is
/// another pod, refused the card its predecessor's container still holds. Fails when the
/// exemption compares names.
#[test]
fn a_recreated_pod_of_the_same_name_is_another_pod() {
    let old = live("uid-old", "db-0", vec![gpu("GPU-1", true)], None);
    let err = double_grant(
        [("ctr-old", &old)],
        "uid-new",
        "main",
        &[gpu("GPU-1", true)],
        &BTreeMap::new(),
    );
    assert!(err.is_some_and(|e| e.contains("team-a/db-0")));
}

/// Containers share a device through one claim, and only that device: a container holding a
/// card whole through claim A and another card through claim B does not make claim A's
/// holders welcome on claim B's card. Fails when a shared claim exempts the holder whole.
#[test]
fn a_shared_claim_shares_only_its_own_devices() {
    let mut holder = live("uid-1", "a", vec![gpu("GPU-1", true)], Some("claim-a"));
    holder.devices.push(gpu("GPU-2", true));
    holder.claims.insert("claim-b".into(), vec!["GPU-2".into()]);
    let books = [("ctr-1", &holder)];
    assert_eq!(
        double_grant(books, "uid-2", "c", &[gpu("GPU-1", true)], &via("claim-a", "GPU-1")),
        None
    );
    // Claim A's second pod naming GPU-2 through claim A (a forged or stale record): refused.
    let mut claims = via("claim-a", "GPU-1");
    claims.get_mut("claim-a").unwrap().push("GPU-2".into());
    let err = double_grant(books, "uid-2", "c", &[gpu("GPU-1", true), gpu("GPU-2", true)], &claims).unwrap();
    assert!(err.contains("GPU-2"), "{err}");
}

fn prepared(uid: &str, ns: &str, devices: Vec<AllocatedDevice>) -> PreparedClaim {
    PreparedClaim {
        uid: uid.into(),
        namespace: ns.into(),
        name: uid.into(),
        pods: vec![],
        token: String::new(),
        markers: BTreeMap::new(),
        devices: devices
            .into_iter()
            .map(|allocated| PreparedDevice {
                requests: vec!["gpu".into()],
                pool: "node-a".into(),
                device: "gpu-0".into(),
                share_id: None,
                allocated,
                carved: None,
            })
            .collect(),
    }
}

#[test]
fn a_cards_shares_go_to_one_tenant_unless_the_node_opts_in() {
    let uses = CardUse::of_claim(&prepared("a", "team-a", vec![gpu("GPU-1", false)]), "team-a");
    let b = prepared("b", "team-b", vec![gpu("GPU-1", false)]);
    let err = check_card_use(&b, "team-b", &uses, false).unwrap_err();
    assert!(
        err.contains("GPU-1") && err.contains("\"team-a\"") && err.contains("claim team-a/a"),
        "{err}"
    );
    // Opted in; the same tenant; another card: no refusal.
    assert_eq!(check_card_use(&b, "team-b", &uses, true), Ok(()));
    assert_eq!(check_card_use(&b, "team-a", &uses, false), Ok(()));
    assert_eq!(
        check_card_use(
            &prepared("c", "team-b", vec![gpu("GPU-2", false)]),
            "team-b",
            &uses,
            false
        ),
        Ok(())
    );
    // The claim itself is no other user of its card (a prepare asked again).
    let again = CardUse::of_claim(&b, "team-b");
    assert_eq!(check_card_use(&b, "team-b", &again, false), Ok(()));
}

/// A card stays held while a live container uses it, also after its claim was unprepared and
/// deallocated: a whole-card claim, or another tenant's share, waits until the container is
/// gone. Before, only recorded claims counted, and the card was offered again at once.
#[test]
fn a_live_container_keeps_its_card_after_its_claim_is_gone() {
    let stays = live("uid-1", "trainer", vec![gpu("GPU-1", true)], Some("gone"));
    let uses = CardUse::of_container(&stays, "team-a");
    let whole = prepared("next", "team-b", vec![gpu("GPU-1", true)]);
    let err = check_card_use(&whole, "team-b", &uses, true).unwrap_err();
    assert!(err.contains("container main of pod team-a/trainer"), "{err}");
    let share = prepared("next", "team-b", vec![gpu("GPU-1", false)]);
    assert!(check_card_use(&share, "team-b", &uses, true).is_err());
    // A live share of another tenant keeps the card to its tenant; a stopped container holds
    // nothing.
    let s = live("uid-2", "s", vec![gpu("GPU-2", false)], None);
    let err = check_card_use(
        &prepared("x", "team-b", vec![gpu("GPU-2", false)]),
        "team-b",
        &CardUse::of_container(&s, "team-a"),
        false,
    )
    .unwrap_err();
    assert!(err.contains("\"team-a\""), "{err}");
    let done = Granted { stopped: true, ..stays };
    assert!(CardUse::of_container(&done, "team-a").is_empty());
}

#[test]
fn grants_are_kept_for_root_only_and_follow_the_live_containers() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir().unwrap();
    let store = GrantStore::new(dir.path().join("grants"));
    let g = live("uid-1", "p", vec![gpu("GPU-1", false)], Some("c"));
    store.put("abc123", &g).unwrap();
    store.put("def456", &g).unwrap();
    assert_eq!(store.get("abc123").unwrap(), Some(g.clone()));
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(
        (mode(store.dir()), mode(&store.dir().join("abc123.json"))),
        (0o700, 0o600)
    );
    store.retain(&["def456".to_string()].into());
    assert_eq!(store.list().0.keys().collect::<Vec<_>>(), ["def456"]);
    assert!(store.put("../x", &g).is_err());
    store.remove("def456").unwrap();
    store.remove("def456").unwrap();
    assert!(store.list().0.is_empty());
}

fn share(uuid: &str) -> AllocatedDevice {
    gpu(uuid, false)
}

/// A share claim's limits are one container's: a second live container naming it (of the same
/// pod, or of another pod the claim is reserved for) is refused, naming the first; once the
/// first has stopped, the share is granted again. A whole card's claim is still shared. Before,
/// each container got the whole share, and N containers N times its memory.
#[test]
fn a_share_claim_serves_one_live_container_at_a_time() {
    let first = live("uid-1", "a", vec![share("GPU-1")], Some("claim-s"));
    let books = [("ctr-1", &first)];
    for pod in ["uid-1", "uid-2"] {
        let err = double_grant(books, pod, "sidecar", &[share("GPU-1")], &via("claim-s", "GPU-1")).unwrap();
        assert!(
            err.contains("claim-s") && err.contains("one container at a time"),
            "{err}"
        );
    }
    // Another share claim on the same card: two claims, two containers, each its own share.
    assert_eq!(
        double_grant(books, "uid-2", "c", &[share("GPU-1")], &via("claim-t", "GPU-1")),
        None
    );
    let stopped = Granted { stopped: true, ..first };
    assert_eq!(
        double_grant(
            [("ctr-1", &stopped)],
            "uid-2",
            "c",
            &[share("GPU-1")],
            &via("claim-s", "GPU-1")
        ),
        None
    );
}
