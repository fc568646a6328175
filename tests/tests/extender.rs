//! The scheduler extender over HTTP against the fake API server: kube-scheduler's JSON, safe
//! bind under concurrency, races with deletion, restart recovery and leader failover.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use serde_json::{Value, json};
use tessera_core::handoff::{AllocatedDevice, Allocation};
use tessera_core::names::{ANNOTATION_ALLOCATION, ANNOTATION_ALLOCATION_SIGNATURE};
use tessera_tests::apiserver::FakeApiServer;
use tessera_tests::gpu_cluster::{
    PREFIX, Replica, ReplicaOptions, eventually, gpu_node, keys, plain_node, pod, scheduler_json, share_pod,
    start_replica,
};
use tessera_tests::http::JsonClient;

fn path(verb: &str) -> String {
    format!("{PREFIX}/{verb}")
}

fn args(pod: &k8s_openapi::api::core::v1::Pod, nodes: &[&str]) -> Value {
    json!({"Pod": scheduler_json(pod), "Nodes": null, "NodeNames": nodes})
}

fn bind_args(p: &k8s_openapi::api::core::v1::Pod, node: &str) -> Value {
    json!({
        "PodName": p.metadata.name,
        "PodNamespace": p.metadata.namespace,
        "PodUID": p.metadata.uid,
        "Node": node,
    })
}

/// The verified allocation of a bound pod.
fn allocation_of(api: &FakeApiServer, name: &str) -> Option<Allocation> {
    allocation_in(api, "default", name)
}

fn allocation_in(api: &FakeApiServer, namespace: &str, name: &str) -> Option<Allocation> {
    let p = api.pod(namespace, name)?;
    let node = p.spec.as_ref()?.node_name.clone()?;
    let a = p.metadata.annotations.as_ref()?;
    keys()
        .verify(
            a.get(ANNOTATION_ALLOCATION).map(String::as_str),
            a.get(ANNOTATION_ALLOCATION_SIGNATURE).map(String::as_str),
            &node,
            p.metadata.uid.as_deref()?,
        )
        .ok()
}

/// Per (node, card UUID): (compute %, memory MiB) summed over every bound pod's verified
/// allocation. (Nodes built from the same fixture share UUIDs.)
fn card_totals(api: &FakeApiServer) -> HashMap<(String, String), (u32, u64)> {
    let mut t: HashMap<(String, String), (u32, u64)> = HashMap::new();
    for p in api.pods() {
        let Some(a) = allocation_of(api, p.metadata.name.as_deref().unwrap()) else {
            continue;
        };
        for c in &a.containers {
            for d in &c.devices {
                if let AllocatedDevice::Gpu {
                    uuid,
                    core_percent,
                    memory_mib,
                    ..
                } = d
                {
                    let e = t.entry((a.node.clone(), uuid.clone())).or_default();
                    e.0 += core_percent;
                    e.1 += memory_mib;
                }
            }
        }
    }
    t
}

fn assert_no_overcommit(api: &FakeApiServer, card_mib: u64) {
    for (uuid, (core, mem)) in card_totals(api) {
        assert!(
            core <= 100 && mem <= card_mib,
            "card {uuid:?} over-committed: {core}% {mem} MiB"
        );
    }
}

async fn bind(http: &mut JsonClient, p: &k8s_openapi::api::core::v1::Pod, node: &str) -> anyhow::Result<String> {
    let (status, reply) = http.post_json(&path("bind"), &bind_args(p, node)).await?;
    let err = reply["Error"].as_str().unwrap_or_default().to_string();
    anyhow::ensure!(
        status == 200 || !err.is_empty(),
        "bind replied {status} without an error: {reply}"
    );
    Ok(err)
}

async fn cluster(nodes: &[(&str, &str)]) -> anyhow::Result<(FakeApiServer, Replica)> {
    let api = FakeApiServer::start().await?;
    for (name, fixture) in nodes {
        api.create_node(&gpu_node(name, fixture))?;
    }
    let r = start_replica(&api, ReplicaOptions::default()).await?;
    Ok((api, r))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filter_prioritize_and_bind_speak_kube_schedulers_json() -> anyhow::Result<()> {
    let (api, mut r) = cluster(&[("h1", "h100x8"), ("h2", "h100x8"), ("t1", "t4x2")]).await?;
    api.create_node(&plain_node("cpu-only"))?;
    let p = api.create_pod(&share_pod("share", 30, 8))?;

    // Exactly the bytes kube-scheduler sends (PascalCase, pod without TypeMeta).
    let (status, reply) = r
        .http
        .post_json(&path("filter"), &args(&p, &["h1", "h2", "t1", "cpu-only", "ghost"]))
        .await?;
    assert_eq!(status, 200);
    let mut fit: Vec<&str> = reply["NodeNames"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    fit.sort();
    assert_eq!(fit, ["h1", "h2", "t1"], "{reply}");
    let unresolvable = reply["FailedAndUnresolvableNodes"].as_object().unwrap();
    assert!(unresolvable["ghost"].as_str().unwrap().contains("not known"), "{reply}");
    assert!(
        unresolvable.contains_key("cpu-only"),
        "a node without GPUs can never fit: {reply}"
    );
    assert_eq!(reply["Error"], "");
    for key in [
        "Nodes",
        "NodeNames",
        "FailedNodes",
        "FailedAndUnresolvableNodes",
        "Error",
    ] {
        assert!(reply.get(key).is_some(), "reply lacks {key}: {reply}");
    }

    // A model constraint keeps only the T4 node.
    let mut t4_only = share_pod("t4", 50, 4);
    t4_only.metadata.annotations = Some(BTreeMap::from([("tessera.io/gpu-model".into(), "T4".into())]));
    let t4_only = api.create_pod(&t4_only)?;
    let (_, reply) = r
        .http
        .post_json(&path("filter"), &args(&t4_only, &["h1", "t1"]))
        .await?;
    assert_eq!(reply["NodeNames"], json!(["t1"]), "{reply}");
    assert!(reply["FailedAndUnresolvableNodes"]["h1"].is_string(), "{reply}");

    // Prioritize: empty nodes tie, so no preference: an empty list, which kube-scheduler
    // reads as 0 for every host (`prioritize_after_filter_sees_what_changed_in_between`
    // has nodes that differ).
    let (status, scores) = r
        .http
        .post_json(&path("prioritize"), &args(&p, &["h1", "h2", "t1"]))
        .await?;
    assert_eq!((status, scores), (200, json!([])));

    // Bind: the signed allocation is on the pod and the pod is bound.
    assert_eq!(bind(&mut r.http, &p, "h2").await?, "");
    let a = allocation_of(&api, "share").expect("a verified allocation");
    assert_eq!(a.node, "h2");
    assert!(matches!(
        a.containers[0].devices[..],
        [AllocatedDevice::Gpu {
            core_percent: 30,
            memory_mib: 8192,
            exclusive: false,
            ..
        }]
    ));
    // A retried bind succeeds and changes nothing.
    let before = api.pod("default", "share").unwrap().metadata.annotations;
    assert_eq!(bind(&mut r.http, &p, "h2").await?, "");
    assert_eq!(api.pod("default", "share").unwrap().metadata.annotations, before);
    assert_eq!(api.faults().bindings.load(std::sync::atomic::Ordering::Relaxed), 1);
    // Bound elsewhere: refused with a reason.
    assert!(bind(&mut r.http, &p, "h1").await?.contains("already bound"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_form_non_gpu_pods_and_bad_requests() -> anyhow::Result<()> {
    let (api, mut r) = cluster(&[("h1", "h100x8"), ("t1", "t4x2")]).await?;
    let whole = api.create_pod(&pod("big", &[("main", &[("tessera.io/gpu-core", "400")])]))?;
    // Not node-cache capable: `Nodes` in, `Nodes` out.
    let nodes = json!({"metadata": {}, "items": [serde_json::to_value(gpu_node("h1", "h100x8"))?, serde_json::to_value(gpu_node("t1", "t4x2"))?]});
    let (_, reply) = r
        .http
        .post_json(
            &path("filter"),
            &json!({"Pod": scheduler_json(&whole), "Nodes": nodes, "NodeNames": null}),
        )
        .await?;
    let items = reply["Nodes"]["items"].as_array().unwrap();
    assert_eq!(items.len(), 1, "{reply}");
    assert_eq!(items[0]["metadata"]["name"], "h1");
    assert!(reply["NodeNames"].is_null());
    assert!(
        reply["FailedNodes"]["t1"].is_string(),
        "two cards cannot take four: {reply}"
    );

    // A pod without Tessera resources passes through untouched; no scores.
    let web = api.create_pod(&pod("web", &[("main", &[("cpu", "1")])]))?;
    let (_, reply) = r
        .http
        .post_json(&path("filter"), &args(&web, &["h1", "t1", "x"]))
        .await?;
    assert_eq!(reply["NodeNames"], json!(["h1", "t1", "x"]));
    let (_, scores) = r
        .http
        .post_json(&path("prioritize"), &args(&web, &["h1", "t1"]))
        .await?;
    assert_eq!(scores, json!([]));
    assert_eq!(bind(&mut r.http, &web, "t1").await?, "");
    assert_eq!(
        api.pod("default", "web").unwrap().spec.unwrap().node_name.as_deref(),
        Some("t1")
    );

    // An invalid Tessera request is unresolvable everywhere, with the field and value.
    let bad = api.create_pod(&pod("bad", &[("main", &[("tessera.io/gpu-core", "150")])]))?;
    let (_, reply) = r.http.post_json(&path("filter"), &args(&bad, &["h1"])).await?;
    let why = reply["FailedAndUnresolvableNodes"]["h1"].as_str().unwrap();
    assert!(why.contains("gpu-core") && why.contains("150"), "{why}");

    // Malformed bodies: 400 with a JSON error, never a crash.
    for body in [&b"{not json"[..], b"[]", br#"{"Pod": 3}"#, br#"{"PodName": 1}"#] {
        for verb in ["filter", "prioritize", "bind", "preempt"] {
            let (status, bytes) = r.http.request(&path(verb), Some(body.to_vec())).await?;
            assert_eq!(status, 400, "{verb} {}", String::from_utf8_lossy(body));
            let v: Value = serde_json::from_slice(&bytes)?;
            assert!(v["Error"].as_str().unwrap().contains("malformed"), "{v}");
        }
    }
    // Too large: 413, still JSON.
    let (status, bytes) =
        tessera_tests::http::post_oversized(r.running.addr, &path("filter"), vec![b' '; 9 << 20]).await?;
    assert_eq!(status, 413);
    assert!(serde_json::from_slice::<Value>(&bytes)?["Error"].is_string());
    assert_eq!(r.http.get_status("/healthz").await?, 200);
    assert_eq!(r.http.get_status("/readyz").await?, 200);
    let (_, m) = r.http.request("/metrics", None).await?;
    let m = String::from_utf8(m)?;
    assert!(
        m.contains("tessera_extender_requests_total{verb=\"filter\",outcome=\"bad_request\"} 5"),
        "{m}"
    );
    assert!(m.contains("tessera_extender_leader 1"), "{m}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hundred_and_twenty_concurrent_binds_never_overcommit() -> anyhow::Result<()> {
    // Two nodes of two T4s: room for 20 pods of 10% per node.
    let (api, r) = cluster(&[("a", "t4x2"), ("b", "t4x2")]).await?;
    let addr = r.running.addr;
    let pods: Vec<_> = (0..120)
        .map(|i| api.create_pod(&share_pod(&format!("p{i}"), 10, 1)))
        .collect::<anyhow::Result<_>>()?;
    let tasks: Vec<_> = pods
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let p = p.clone();
            let node = if i % 2 == 0 { "a" } else { "b" };
            tokio::spawn(async move {
                let mut http = JsonClient::new(addr);
                bind(&mut http, &p, node).await
            })
        })
        .collect();
    let mut ok = 0;
    for t in tasks {
        let err = t.await??;
        if err.is_empty() {
            ok += 1;
        } else {
            assert!(err.contains("does not fit"), "{err}");
        }
    }
    assert_eq!(ok, 40, "exactly the capacity is bound");
    let bound = api
        .pods()
        .iter()
        .filter(|p| p.spec.as_ref().unwrap().node_name.is_some())
        .count();
    assert_eq!(bound, 40);
    let totals = card_totals(&api);
    assert_eq!(totals.len(), 4);
    assert!(totals.values().all(|&(core, _)| core == 100), "{totals:?}");
    assert_no_overcommit(&api, 15360);
    // Pending pods carry no allocation.
    assert!(
        api.pods()
            .iter()
            .filter(|p| p.spec.as_ref().unwrap().node_name.is_none())
            .all(|p| p
                .metadata
                .annotations
                .as_ref()
                .is_none_or(|a| !a.contains_key(ANNOTATION_ALLOCATION)))
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_release_and_deletions_free() -> anyhow::Result<()> {
    let (api, mut r) = cluster(&[("t", "t4x2")]).await?;
    let whole = |n: &str| pod(n, &[("main", &[("tessera.io/gpu-core", "200")])]);
    let p = api.create_pod(&whole("w1"))?;
    let uid = p.metadata.uid.clone().unwrap();

    // The Binding fails: the reservation is released and the pod stays unbound.
    api.faults().fail_bindings.store(1, std::sync::atomic::Ordering::SeqCst);
    let err = bind(&mut r.http, &p, "t").await?;
    assert!(err.contains("injected binding failure"), "{err}");
    assert!(
        r.running.service.cluster.booking(&uid).is_none(),
        "reservation released"
    );
    // The retry succeeds with both cards.
    assert_eq!(bind(&mut r.http, &p, "t").await?, "");
    assert_eq!(allocation_of(&api, "w1").unwrap().containers[0].devices.len(), 2);

    // The node is full; a second pod does not fit.
    let q = api.create_pod(&share_pod("q", 10, 1))?;
    let (_, reply) = r.http.post_json(&path("filter"), &args(&q, &["t"])).await?;
    assert_eq!(reply["NodeNames"], json!([]), "{reply}");
    assert!(reply["FailedNodes"]["t"].is_string());

    // Deleting the pod frees both cards (seen through the watch).
    api.delete_pod("default", "w1");
    let cluster = r.running.service.cluster.clone();
    eventually(10, "the deletion to free the cards", || cluster.booking(&uid).is_none()).await?;
    let (_, reply) = r.http.post_json(&path("filter"), &args(&q, &["t"])).await?;
    assert_eq!(reply["NodeNames"], json!(["t"]));

    // A finished pod frees its share too.
    let w2 = api.create_pod(&whole("w2"))?;
    assert_eq!(bind(&mut r.http, &w2, "t").await?, "");
    let uid2 = w2.metadata.uid.clone().unwrap();
    api.set_pod_phase("default", "w2", "Succeeded");
    eventually(10, "the finished pod to free the cards", || {
        cluster.booking(&uid2).is_none()
    })
    .await?;

    // A bind racing the pod's deletion leaves nothing behind.
    let w3 = api.create_pod(&whole("w3"))?;
    api.faults()
        .binding_delay_ms
        .store(300, std::sync::atomic::Ordering::SeqCst);
    let addr = r.running.addr;
    let w3c = w3.clone();
    let racing = tokio::spawn(async move { bind(&mut JsonClient::new(addr), &w3c, "t").await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    api.delete_pod("default", "w3");
    let err = racing.await??;
    assert!(!err.is_empty(), "the bind of a deleted pod fails");
    api.faults()
        .binding_delay_ms
        .store(0, std::sync::atomic::Ordering::SeqCst);
    let uid3 = w3.metadata.uid.clone().unwrap();
    eventually(10, "no leak", || cluster.booking(&uid3).is_none()).await?;
    let w4 = api.create_pod(&whole("w4"))?;
    assert_eq!(bind(&mut r.http, &w4, "t").await?, "", "both cards are free again");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_extender_rebuilds_every_allocation_before_it_is_ready() -> anyhow::Result<()> {
    let (api, mut r) = cluster(&[("a", "t4x2"), ("b", "h100x8")]).await?;
    for i in 0..6 {
        let p = api.create_pod(&share_pod(&format!("s{i}"), 60, 2))?;
        assert_eq!(bind(&mut r.http, &p, if i < 2 { "a" } else { "b" }).await?, "");
    }
    let before = card_totals(&api);
    r.running.shutdown().await;

    // A fresh replica: it must know the T4s each hold 60%, so a 50% pod no longer fits there.
    let mut r2 = start_replica(&api, ReplicaOptions::default()).await?;
    assert_eq!(r2.http.get_status("/readyz").await?, 200);
    let p = api.create_pod(&share_pod("late", 50, 1))?;
    let (_, reply) = r2.http.post_json(&path("filter"), &args(&p, &["a", "b"])).await?;
    assert_eq!(reply["NodeNames"], json!(["b"]), "{reply}");
    assert_eq!(bind(&mut r2.http, &p, "b").await?, "");
    // Nothing was re-allocated on the way.
    let after = card_totals(&api);
    for (card, used) in before {
        assert!(after[&card].0 >= used.0);
    }
    assert_no_overcommit(&api, 81559);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leader_failover_loses_and_duplicates_nothing() -> anyhow::Result<()> {
    let api = FakeApiServer::start().await?;
    api.create_node(&gpu_node("a", "t4x2"))?;
    api.create_node(&gpu_node("b", "t4x2"))?;
    // The replicas' own pods, which they label with their role (the Service selects the leader).
    for id in ["one", "two"] {
        let mut p = pod(id, &[]);
        p.metadata.namespace = Some("tessera-system".into());
        api.create_pod(&p)?;
    }
    let role = |id: &str| {
        api.pod("tessera-system", id)
            .and_then(|p| p.metadata.labels)
            .and_then(|l| l.get("tessera.io/extender-role").cloned())
            .unwrap_or_default()
    };
    let opts = |id: &str| ReplicaOptions {
        identity: Some(id.into()),
        label_pod: true,
        ..Default::default()
    };
    let mut replicas = vec![
        start_replica(&api, opts("one")).await?,
        start_replica(&api, opts("two")).await?,
    ];
    let services: Vec<_> = replicas.iter().map(|r| r.running.service.clone()).collect();
    eventually(10, "a leader", || services.iter().any(|s| s.is_leader())).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        services.iter().filter(|s| s.is_leader()).count(),
        1,
        "exactly one leader"
    );
    let leader = services.iter().position(|s| s.is_leader()).unwrap();
    assert_eq!(replicas[leader].http.get_status("/readyz").await?, 200);
    assert_eq!(
        replicas[1 - leader].http.get_status("/readyz").await?,
        503,
        "followers are not ready"
    );
    // ... as leaders; as pods they are (so Deployment rollouts complete).
    assert_eq!(replicas[1 - leader].http.get_status("/syncedz").await?, 200);
    let names = ["one", "two"];
    eventually(5, "the role labels", || {
        role(names[leader]) == "leader" && role(names[1 - leader]) == "follower"
    })
    .await?;
    // A follower refuses to bind.
    let stray = api.create_pod(&share_pod("stray", 10, 1))?;
    assert!(
        bind(&mut replicas[1 - leader].http, &stray, "a")
            .await?
            .contains("not the leader")
    );

    // A stream of binds, each sent to a ready replica (as the Service routes); the leader is
    // killed a third of the way through.
    let pods: Vec<_> = (0..30)
        .map(|i| api.create_pod(&share_pod(&format!("p{i}"), 10, 1)))
        .collect::<anyhow::Result<_>>()?;
    let mut failover = None;
    for (i, p) in pods.iter().enumerate() {
        if i == 10 {
            // No lease release: the process just stops.
            replicas.remove(leader).running.kill();
            failover = Some(tokio::time::Instant::now());
        }
        let node = if i % 2 == 0 { "a" } else { "b" };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        'routed: loop {
            for r in replicas.iter_mut() {
                if r.http.get_status("/readyz").await? == 200 {
                    let err = bind(&mut r.http, p, node).await?;
                    if err.is_empty() {
                        break 'routed;
                    }
                    assert!(err.contains("not the leader"), "{err}");
                }
            }
            anyhow::ensure!(tokio::time::Instant::now() < deadline, "no leader took over");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if i == 10 {
            eprintln!("failover took {:?}", failover.unwrap().elapsed());
        }
    }
    assert!(replicas[0].running.service.is_leader(), "the follower took over");
    eventually(5, "the new leader's label", || role(names[1 - leader]) == "leader").await?;
    assert_eq!(
        api.faults().bindings.load(std::sync::atomic::Ordering::Relaxed),
        30,
        "every pod bound exactly once"
    );
    assert_eq!(card_totals(&api).values().map(|v| v.0).sum::<u32>(), 300);
    assert_no_overcommit(&api, 15360);
    let lease = api.lease("tessera-system", "tessera-extender").unwrap();
    assert!(lease["spec"]["leaseTransitions"].as_i64().unwrap() >= 1, "{lease}");
    Ok(())
}

/// A pod already bound to `node` with a signed allocation of `core`% on card `card`.
fn bound_share(name: &str, node: &str, card: usize, core: u32) -> k8s_openapi::api::core::v1::Pod {
    use tessera_core::inventory::{FixtureSource, InventorySource};
    let inv = FixtureSource {
        fixture: "t4x2".into(),
        driver_root: None,
    }
    .discover()
    .unwrap();
    let g = &inv.gpus[card];
    let uid = format!("uid-{name}");
    let mut a = Allocation::new(node, &uid);
    a.containers.push(tessera_core::handoff::ContainerAllocation {
        name: "main".into(),
        role: tessera_core::request::ContainerRole::App,
        devices: vec![AllocatedDevice::share(g, core, 1024)],
    });
    let s = keys().sign(&a);
    let mut p = share_pod(name, core, 1);
    p.metadata.uid = Some(uid);
    p.metadata.annotations = Some(BTreeMap::from([
        (ANNOTATION_ALLOCATION.to_string(), s.allocation),
        (ANNOTATION_ALLOCATION_SIGNATURE.to_string(), s.signature),
    ]));
    p.spec.as_mut().unwrap().node_name = Some(node.into());
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preempt_keeps_only_victims_that_free_a_card() -> anyhow::Result<()> {
    let (api, mut r) = cluster(&[("t", "t4x2")]).await?;
    // Card 0: v1 + v2 (50% each); card 1: v3 (50%).
    let victims =
        [("v1", 0), ("v2", 0), ("v3", 1)].map(|(n, card)| api.create_pod(&bound_share(n, "t", card, 50)).unwrap());
    let cluster = r.running.service.cluster.clone();
    eventually(10, "the bound pods to be booked", || {
        victims
            .iter()
            .all(|v| cluster.booking(v.metadata.uid.as_deref().unwrap()).is_some())
    })
    .await?;
    let whole = api.create_pod(&pod("whole", &[("main", &[("tessera.io/gpu-core", "100")])]))?;
    let meta = |names: &[&str]| -> Value {
        let pods: Vec<Value> = names.iter().map(|n| json!({"UID": format!("uid-{n}")})).collect();
        json!({"Pod": scheduler_json(&whole), "NodeNameToVictims": null,
               "NodeNameToMetaVictims": {"t": {"Pods": pods, "NumPDBViolations": 1}}})
    };
    let kept = |reply: &Value| -> Vec<String> {
        reply["NodeNameToMetaVictims"]["t"]["Pods"]
            .as_array()
            .map(|a| a.iter().map(|p| p["UID"].as_str().unwrap().to_string()).collect())
            .unwrap_or_default()
    };
    // Evicting v1 alone frees no whole card (v2 stays on card 0): the node is dropped.
    let (status, reply) = r.http.post_json(&path("preempt"), &meta(&["v1"])).await?;
    assert_eq!(status, 200);
    assert_eq!(reply["NodeNameToMetaVictims"], json!({}), "{reply}");
    // Offered v1 and v3, evicting v3 empties card 1: v1 is spared.
    let (_, reply) = r.http.post_json(&path("preempt"), &meta(&["v1", "v3"])).await?;
    assert_eq!(kept(&reply), ["uid-v3"], "{reply}");
    assert_eq!(reply["NodeNameToMetaVictims"]["t"]["NumPDBViolations"], 1, "{reply}");
    // Offered v1 and v2, both must go.
    let (_, reply) = r.http.post_json(&path("preempt"), &meta(&["v1", "v2"])).await?;
    assert_eq!(kept(&reply), ["uid-v1", "uid-v2"], "{reply}");
    // The same with victims as objects (not node-cache capable).
    let objs: Vec<Value> = victims.iter().map(scheduler_json).collect();
    let (_, reply) = r
        .http
        .post_json(
            &path("preempt"),
            &json!({"Pod": scheduler_json(&whole), "NodeNameToMetaVictims": null,
                    "NodeNameToVictims": {"t": {"Pods": objs, "NumPDBViolations": 0}}}),
        )
        .await?;
    assert_eq!(kept(&reply).len(), 1, "one victim is enough: {reply}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_https_with_the_given_certificate() -> anyhow::Result<()> {
    use std::sync::Arc;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let api = FakeApiServer::start().await?;
    let dir = tempfile::tempdir()?;
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string()])?;
    let (cert_path, key_path) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    std::fs::write(&cert_path, cert.cert.pem())?;
    std::fs::write(&key_path, cert.signing_key.serialize_pem())?;
    let running = start_verbs(
        &api,
        Some(tessera_extender::service::VerbTls::Files {
            cert: cert_path,
            key: key_path,
            client_ca: None,
        }),
        Default::default(),
    )
    .await?;
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.cert.der().clone())?;
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(running.addr).await?;
    let mut tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect("localhost".try_into()?, tcp)
        .await?;
    tls.write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await?;
    let mut reply = String::new();
    tls.read_to_string(&mut reply).await?;
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    assert!(reply.ends_with("ok"), "{reply}");
    // Plain HTTP to the TLS port gets nowhere.
    assert!(JsonClient::new(running.addr).get_status("/healthz").await.is_err());
    Ok(())
}

/// Every example in `deploy/examples/` (the user guide's) is accepted and placed as described.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_user_guide_examples_are_placed_as_documented() -> anyhow::Result<()> {
    let (api, mut r) = cluster(&[("h100", "h100x8"), ("a100", "a100-mig")]).await?;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir)? {
        let file_path = entry?.path();
        // claims/: custom resources with their pods (tests/tests/claims.rs).
        if file_path.is_dir() {
            continue;
        }
        let doc: Value = serde_yaml::from_str(&std::fs::read_to_string(&file_path)?)?;
        // A Deployment's pod template stands for its pods.
        let mut pod_json = if doc["kind"] == "Deployment" {
            let mut t = doc["spec"]["template"].clone();
            t["metadata"]["name"] = doc["metadata"]["name"].clone();
            t
        } else {
            doc.clone()
        };
        pod_json["metadata"]["namespace"] = json!("default");
        let file = file_path.file_name().unwrap().to_string_lossy().into_owned();
        let p = api.create_pod(&serde_json::from_value(pod_json)?)?;
        let (_, reply) = r.http.post_json(&path("filter"), &args(&p, &["h100", "a100"])).await?;
        let fit: Vec<String> = serde_json::from_value(reply["NodeNames"].clone())?;
        anyhow::ensure!(!fit.is_empty(), "{file}: no node fits: {reply}");
        let err = bind(&mut r.http, &p, &fit[0]).await?;
        anyhow::ensure!(err.is_empty(), "{file}: {err}");
        let a = allocation_of(&api, p.metadata.name.as_deref().unwrap()).expect("allocation");
        let devices = |c: usize| &a.containers[c].devices;
        let gpu = |c: usize| match &devices(c)[0] {
            AllocatedDevice::Gpu {
                core_percent,
                memory_mib,
                exclusive,
                ..
            } => (*core_percent, *memory_mib, *exclusive),
            AllocatedDevice::Mig { .. } => panic!("{file}: a GPU, not MIG"),
        };
        match file.as_str() {
            "whole-gpu.yaml" => assert_eq!(gpu(0), (100, 81559, true), "{file}"),
            "share-30-8gib.yaml" => assert_eq!(gpu(0), (30, 8192, false), "{file}"),
            "mig-slice.yaml" => {
                assert_eq!(a.node, "a100");
                assert!(
                    matches!(&devices(0)[0], AllocatedDevice::Mig { profile, .. } if profile.to_string() == "1g.5gb")
                );
            }
            "two-containers.yaml" => {
                assert_eq!(a.containers.len(), 2);
                assert_eq!((gpu(0).0, gpu(1).0), (50, 50));
            }
            "model-constraint.yaml" => {
                assert_eq!(a.node, "h100", "{file}");
                assert_eq!(devices(0).len(), 2);
            }
            "nano-gpu-deployment.yaml" => assert_eq!(gpu(0), (20, 1024, false), "{file}"),
            "gpushare-memory-only.yaml" => assert_eq!(gpu(0), (0, 3072, false), "{file}"),
            "gpu-manager-core-limit.yaml" => {
                assert_eq!(gpu(0), (50, 4096, false), "{file}");
                assert_eq!(a.core_limit, Some(50));
            }
            other => panic!("{other}: add it to this test"),
        }
        seen += 1;
    }
    assert_eq!(seen, 8);
    Ok(())
}

/// kube-scheduler gives up on a slow bind (its HTTP timeout) and closes the connection: the bind
/// still runs to its end, so a failure still releases the reservation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bind_abandoned_by_the_scheduler_still_cleans_up() -> anyhow::Result<()> {
    let (api, r) = cluster(&[("t", "t4x2")]).await?;
    let p = api.create_pod(&pod("slow", &[("main", &[("tessera.io/gpu-core", "200")])]))?;
    let uid = p.metadata.uid.clone().unwrap();
    api.faults()
        .binding_delay_ms
        .store(400, std::sync::atomic::Ordering::SeqCst);
    api.faults().fail_bindings.store(1, std::sync::atomic::Ordering::SeqCst);
    let addr = r.running.addr;
    let pc = p.clone();
    let client = tokio::spawn(async move { bind(&mut JsonClient::new(addr), &pc, "t").await });
    let cluster = r.running.service.cluster.clone();
    eventually(5, "the reservation", || cluster.booking(&uid).is_some()).await?;
    client.abort();
    eventually(5, "the abandoned bind to release its reservation", || {
        cluster.booking(&uid).is_none()
    })
    .await?;
    assert!(api.pod("default", "slow").unwrap().spec.unwrap().node_name.is_none());
    Ok(())
}

/// Request bodies recorded in kube-scheduler's exact shape (an informer's pod: no TypeMeta,
/// managedFields, status), sent byte for byte; replies have exactly Go's keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recorded_kube_scheduler_requests() -> anyhow::Result<()> {
    let (api, mut r) = cluster(&[("gpu-a", "h100x8"), ("gpu-b", "t4x2")]).await?;
    api.create_node(&plain_node("cpu-1"))?;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/extender");
    let filter = std::fs::read(dir.join("filter-request.json"))?;
    let recorded: Value = serde_json::from_slice(&filter)?;
    assert!(recorded["Pod"].get("apiVersion").is_none() && recorded["Pod"].get("kind").is_none());
    api.create_pod(&serde_json::from_value(recorded["Pod"].clone())?)?;

    let (status, body) = r.http.request(&path("filter"), Some(filter.clone())).await?;
    assert_eq!(status, 200);
    let reply: Value = serde_json::from_slice(&body)?;
    let mut keys: Vec<&str> = reply.as_object().unwrap().keys().map(String::as_str).collect();
    keys.sort();
    assert_eq!(
        keys,
        [
            "Error",
            "FailedAndUnresolvableNodes",
            "FailedNodes",
            "NodeNames",
            "Nodes"
        ]
    );
    assert_eq!(reply["NodeNames"], json!(["gpu-a", "gpu-b"]), "{reply}");
    assert!(reply["FailedAndUnresolvableNodes"]["cpu-1"].is_string());

    // Nodes loaded differently, so that their scores differ and the reply names one (the
    // pod's 30% fills gpu-b's card at 70%).
    let most = api.create_pod(&share_pod("most", 70, 4))?;
    assert_eq!(bind(&mut r.http, &most, "gpu-b").await?, "");
    let (status, body) = r.http.request(&path("prioritize"), Some(filter)).await?;
    assert_eq!(status, 200);
    let scores: Value = serde_json::from_slice(&body)?;
    assert!(!scores.as_array().unwrap().is_empty(), "{scores}");
    for s in scores.as_array().unwrap() {
        let mut keys: Vec<&str> = s.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort();
        assert_eq!(keys, ["Host", "Score"], "{s}");
    }

    let (status, body) = r
        .http
        .request(&path("bind"), Some(std::fs::read(dir.join("bind-request.json"))?))
        .await?;
    assert_eq!((status, String::from_utf8(body)?), (200, r#"{"Error":""}"#.to_string()));
    let a = allocation_of(&api, "infer-7d9f8c6b5-x2x9q").expect("bound with an allocation");
    assert_eq!(a.node, "gpu-b");
    Ok(())
}

/// A node whose driver cannot serve containers (the CDI generator found no libcuda) publishes
/// itself not ready: GPU pods are kept off it with the reason, plain pods are not, and it
/// comes back when the driver is fixed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_a_broken_driver_gets_no_gpu_pods() -> anyhow::Result<()> {
    use tessera_core::inventory::{FixtureSource, InventorySource, PublishedInventory};
    use tessera_core::names::ANNOTATION_INVENTORY;
    let (api, mut r) = cluster(&[("h1", "h100x8"), ("h2", "h100x8")]).await?;
    let share = api.create_pod(&share_pod("share", 30, 8))?;
    let plain = api.create_pod(&pod("plain", &[("c", &[("cpu", "1")])]))?;
    let mut inv = FixtureSource::new("h100x8").discover()?;
    inv.driver_files.retain(|f| f.stem().as_deref() != Some("libcuda"));
    let broken = PublishedInventory::of(&inv);
    assert!(broken.not_ready.is_some());
    assert!(api.patch_node(
        "h1",
        &json!({"metadata": {"annotations": {ANNOTATION_INVENTORY: broken.encode()}}})
    ));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let reply = loop {
        let (_, reply) = r.http.post_json(&path("filter"), &args(&share, &["h1", "h2"])).await?;
        if reply["NodeNames"] == json!(["h2"]) {
            break reply;
        }
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "h1 still offered: {reply}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let why = reply["FailedAndUnresolvableNodes"]["h1"].as_str().unwrap_or_default();
    assert!(
        why.contains("GPU driver is not ready") && why.contains("no libcuda"),
        "{reply}"
    );
    let (_, reply) = r.http.post_json(&path("filter"), &args(&plain, &["h1", "h2"])).await?;
    assert_eq!(reply["NodeNames"], json!(["h1", "h2"]), "{reply}");

    // The driver is fixed: h1 takes GPU pods again.
    let fixed = PublishedInventory::of(&FixtureSource::new("h100x8").discover()?);
    assert!(api.patch_node(
        "h1",
        &json!({"metadata": {"annotations": {ANNOTATION_INVENTORY: fixed.encode()}}})
    ));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (_, reply) = r.http.post_json(&path("filter"), &args(&share, &["h1", "h2"])).await?;
        if reply["NodeNames"] == json!(["h1", "h2"]) {
            break;
        }
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "h1 not back: {reply}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// Nodes publish how they enforce shares: a pod can require enforcement, and MPS nodes keep
/// one user per shared card (MPS serves one user at a time), through real binds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enforcement_is_published_required_and_mps_keeps_one_user_per_card() -> anyhow::Result<()> {
    use tessera_core::enforcement::ShareEnforcement;
    use tessera_tests::gpu_cluster::gpu_node_enforced;
    let api = FakeApiServer::start().await?;
    api.create_node(&gpu_node_enforced("t-mps", "t4x2", ShareEnforcement::Mps))?;
    api.create_node(&gpu_node_enforced("t-none", "t4x2", ShareEnforcement::None))?;
    let mut r = start_replica(&api, ReplicaOptions::default()).await?;

    // Required enforcement: only the MPS node; the other says why.
    let mut strict = share_pod("strict", 20, 2);
    strict
        .metadata
        .annotations
        .get_or_insert_default()
        .insert("tessera.io/share-enforcement".into(), "required".into());
    let strict = api.create_pod(&strict)?;
    let (_, reply) = r
        .http
        .post_json(&path("filter"), &args(&strict, &["t-mps", "t-none"]))
        .await?;
    assert_eq!(reply["NodeNames"], json!(["t-mps"]), "{reply}");
    assert_eq!(
        reply["FailedAndUnresolvableNodes"]["t-none"],
        "the pod requires enforced shares; this node's share enforcement is none",
        "{reply}"
    );

    // Users on the MPS node: root and uid 1000 get different cards, a third user none.
    let as_user = |name: &str, uid: i64| {
        let mut p = share_pod(name, 20, 2);
        p.spec.as_mut().unwrap().security_context = Some(k8s_openapi::api::core::v1::PodSecurityContext {
            run_as_user: Some(uid),
            ..Default::default()
        });
        p
    };
    let mut cards = Vec::new();
    for (name, uid) in [("root", 0), ("u1000", 1000), ("u1000-b", 1000)] {
        let p = api.create_pod(&as_user(name, uid))?;
        let (_, reply) = r.http.post_json(&path("filter"), &args(&p, &["t-mps"])).await?;
        assert_eq!(reply["NodeNames"], json!(["t-mps"]), "{name}: {reply}");
        assert_eq!(bind(&mut r.http, &p, "t-mps").await?, "", "{name}");
        let a = allocation_of(&api, name).expect("bound");
        cards.push(a.containers[0].devices[0].card_uuid().to_string());
    }
    assert_ne!(cards[0], cards[1], "root and uid 1000 share a card: {cards:?}");
    assert_eq!(cards[1], cards[2], "uid 1000's second pod joins its card");
    let p = api.create_pod(&as_user("u7", 7))?;
    let (_, reply) = r
        .http
        .post_json(&path("filter"), &args(&p, &["t-mps", "t-none"]))
        .await?;
    assert_eq!(reply["NodeNames"], json!(["t-none"]), "{reply}");
    let why = reply["FailedNodes"]["t-mps"].as_str().unwrap_or_default();
    assert!(
        why.contains("serves MPS clients of another user") && why.contains("uid 7"),
        "{reply}"
    );
    Ok(())
}

/// Tenancy: shares of pods in different namespaces never land on one card, unless the node is
/// labelled for cross-tenant sharing; a pod with no card of its own tenant left is refused on
/// that node with the reason (naming no other tenant), and placed on the opted-in node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cards_shares_belong_to_one_namespace_unless_the_node_opts_in() -> anyhow::Result<()> {
    use tessera_core::names::LABEL_CROSS_TENANT_SHARING;
    let api = FakeApiServer::start().await?;
    api.create_node(&gpu_node("t-iso", "t4x2"))?;
    let mut open = gpu_node("t-open", "t4x2");
    open.metadata
        .labels
        .get_or_insert_default()
        .insert(LABEL_CROSS_TENANT_SHARING.into(), "true".into());
    api.create_node(&open)?;
    let mut r = start_replica(&api, ReplicaOptions::default()).await?;
    let in_ns = |ns: &str, name: &str| {
        let mut p = share_pod(name, 20, 2);
        p.metadata.namespace = Some(ns.into());
        p
    };
    let mut card = HashMap::new();
    for (ns, name, node) in [
        ("team-a", "a1", "t-iso"),
        ("team-b", "b1", "t-iso"),
        ("team-a", "a2", "t-iso"),
        ("team-a", "oa", "t-open"),
        ("team-b", "ob", "t-open"),
    ] {
        let p = api.create_pod(&in_ns(ns, name))?;
        let (_, reply) = r.http.post_json(&path("filter"), &args(&p, &[node])).await?;
        assert_eq!(reply["NodeNames"], json!([node]), "{name}: {reply}");
        assert_eq!(bind(&mut r.http, &p, node).await?, "", "{name}");
        let a = allocation_in(&api, ns, name).expect("bound");
        card.insert(name, a.containers[0].devices[0].card_uuid().to_string());
    }
    assert_ne!(card["a1"], card["b1"], "two namespaces on one card");
    assert_eq!(card["a1"], card["a2"], "a namespace's second share joins its card");
    assert_eq!(card["oa"], card["ob"], "the opted-in node packs tenants together");
    // A third namespace: both cards of t-iso hold another tenant's shares.
    let p = api.create_pod(&in_ns("team-c", "c1"))?;
    let (_, reply) = r
        .http
        .post_json(&path("filter"), &args(&p, &["t-iso", "t-open"]))
        .await?;
    assert_eq!(reply["NodeNames"], json!(["t-open"]), "{reply}");
    let why = reply["FailedNodes"]["t-iso"].as_str().unwrap_or_default();
    assert!(
        why.contains("another tenant") && why.contains(LABEL_CROSS_TENANT_SHARING) && !why.contains("team-"),
        "{reply}"
    );
    Ok(())
}

/// An operator groups namespaces into one tenant with the `tessera.io/tenant` label: their
/// shares share a card, through filter and bind, as one namespace's do; an unlabelled namespace
/// stays a tenant of its own. The label is read from a watch on namespaces: one labelled before
/// the extender starts, one after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespaces_labelled_into_one_tenant_share_a_card() -> anyhow::Result<()> {
    use tessera_tests::gpu_cluster::tenant_namespace as namespace;
    let api = FakeApiServer::start().await?;
    api.create_node(&gpu_node("t-iso", "t4x2"))?;
    api.create_object(&namespace("ml-train", Some("ml")))?;
    api.create_object(&namespace("other", None))?;
    let mut r = start_replica(&api, ReplicaOptions::default()).await?;
    let in_ns = |ns: &str, name: &str| {
        let mut p = share_pod(name, 20, 2);
        p.metadata.namespace = Some(ns.into());
        p
    };
    let mut card = HashMap::new();
    for (ns, name) in [("ml-train", "t1"), ("other", "o1")] {
        let p = api.create_pod(&in_ns(ns, name))?;
        let (_, reply) = r.http.post_json(&path("filter"), &args(&p, &["t-iso"])).await?;
        assert_eq!(reply["NodeNames"], json!(["t-iso"]), "{name}: {reply}");
        assert_eq!(bind(&mut r.http, &p, "t-iso").await?, "", "{name}");
        let a = allocation_in(&api, ns, name).expect("bound");
        card.insert(name, a.containers[0].devices[0].card_uuid().to_string());
    }
    assert_ne!(card["t1"], card["o1"]);
    // Both cards now hold a tenant's shares: a namespace of its own fits on neither.
    let lone = api.create_pod(&in_ns("ml-serve", "s0"))?;
    let (_, reply) = r.http.post_json(&path("filter"), &args(&lone, &["t-iso"])).await?;
    assert_eq!(
        reply["NodeNames"],
        json!([]),
        "unlabelled, ml-serve is its own tenant: {reply}"
    );
    // Labelled into the group while the extender runs: its shares join the group's card.
    api.create_object(&namespace("ml-serve", Some("ml")))?;
    let p = api.create_pod(&in_ns("ml-serve", "s1"))?;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (_, reply) = r.http.post_json(&path("filter"), &args(&p, &["t-iso"])).await?;
        if reply["NodeNames"] == json!(["t-iso"]) {
            break;
        }
        anyhow::ensure!(std::time::Instant::now() < deadline, "the label never took: {reply}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(bind(&mut r.http, &p, "t-iso").await?, "");
    let a = allocation_in(&api, "ml-serve", "s1").expect("bound");
    assert_eq!(a.containers[0].devices[0].card_uuid(), card["t1"], "the group's card");
    Ok(())
}

/// Multi-GPU pods through filter and bind on a node with NVLink bridges in pairs over two NUMA
/// nodes (the published topology): two 2-GPU pods each get a bridged pair, a 4-GPU pod stays
/// on one NUMA node, and `tessera.io/gpu-link: nvlink` rules out nodes without a bridged pair
/// left, saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_gpu_pods_get_connected_cards_from_the_published_topology() -> anyhow::Result<()> {
    use tessera_core::inventory::{FixtureSource, InventorySource};
    let (api, mut r) = cluster(&[("pairs", "a100-nvlink-pairs"), ("h", "h100x8")]).await?;
    let inv = FixtureSource::new("a100-nvlink-pairs").discover()?;
    let index_of = |uuid: &str| {
        inv.gpus
            .iter()
            .position(|g| g.uuid == uuid)
            .expect("a card of the fixture")
    };
    let whole = |name: &str, cards: u32| {
        pod(
            name,
            &[("main", &[("tessera.io/gpu-core", &(cards * 100).to_string())])],
        )
    };
    let nvlink = |name: &str| {
        let mut p = whole(name, 2);
        p.metadata
            .annotations
            .get_or_insert_default()
            .insert("tessera.io/gpu-link".into(), "nvlink".into());
        p
    };
    let mut given = BTreeMap::new();
    for (name, cards) in [("two-a", 2), ("two-b", 2)] {
        let p = api.create_pod(&whole(name, cards))?;
        let (_, reply) = r.http.post_json(&path("filter"), &args(&p, &["pairs"])).await?;
        assert_eq!(reply["NodeNames"], json!(["pairs"]), "{name}: {reply}");
        assert_eq!(bind(&mut r.http, &p, "pairs").await?, "", "{name}");
        let a = allocation_of(&api, name).expect("bound");
        let mut cards: Vec<usize> = a.containers[0]
            .devices
            .iter()
            .map(|d| index_of(d.card_uuid()))
            .collect();
        cards.sort();
        given.insert(name, cards);
    }
    assert_eq!(given["two-a"], [0, 1], "a bridged pair");
    assert_eq!(given["two-b"], [2, 3], "the NUMA node's other bridged pair");

    // Requiring NVLink: h100x8 publishes NUMA nodes only; "pairs" still has two bridged pairs.
    let nv = api.create_pod(&nvlink("nv"))?;
    let (_, reply) = r.http.post_json(&path("filter"), &args(&nv, &["pairs", "h"])).await?;
    assert_eq!(reply["NodeNames"], json!(["pairs"]), "{reply}");
    let why = reply["FailedNodes"]["h"].as_str().unwrap_or_default();
    assert!(
        why.contains("tessera.io/gpu-link=nvlink") && why.contains("worst link is NODE"),
        "{reply}"
    );

    let four = api.create_pod(&whole("four", 4))?;
    assert_eq!(bind(&mut r.http, &four, "pairs").await?, "");
    let a = allocation_of(&api, "four").expect("bound");
    let numa: std::collections::BTreeSet<Option<u32>> = a.containers[0]
        .devices
        .iter()
        .map(|d| inv.gpus[index_of(d.card_uuid())].numa_node)
        .collect();
    assert_eq!(numa.len(), 1, "a 4-GPU pod on one NUMA node: {a:?}");

    // No bridged pair left anywhere: the NVLink pod fits nowhere, and says why.
    let (_, reply) = r.http.post_json(&path("filter"), &args(&nv, &["pairs", "h"])).await?;
    assert_eq!(reply["NodeNames"], json!([]), "{reply}");
    assert_eq!(
        reply["FailedNodes"]["pairs"], "needs 2 idle whole GPU(s), 0 idle",
        "{reply}"
    );
    Ok(())
}

/// Binds leave Events on the pod that `kubectl describe pod` shows: which GPUs on a bind, why
/// on a failed one, and a scheduler retrying the same failure does not repeat it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binds_are_told_in_pod_events() -> anyhow::Result<()> {
    let (api, mut r) = cluster(&[("t1", "t4x2")]).await?;
    let ok = api.create_pod(&share_pod("ok", 30, 4))?;
    assert_eq!(bind(&mut r.http, &ok, "t1").await?, "");
    let a = allocation_of(&api, "ok").expect("bound");
    let uuid = a.containers[0].devices[0].card_uuid().to_string();
    eventually(5, "the bound event", || {
        api.events().iter().any(|e| {
            e.involved_object.name.as_deref() == Some("ok")
                && e.reason.as_deref() == Some("TesseraBound")
                && e.type_.as_deref() == Some("Normal")
                && e.message.as_deref().is_some_and(|m| {
                    m.starts_with("bound to t1: main: GPU ") && m.contains(&uuid) && m.contains("30% + 4096 MiB")
                })
        })
    })
    .await?;

    // Two whole cards on a node that has one idle: refused, told once however often retried.
    let big = api.create_pod(&pod("big", &[("main", &[("tessera.io/gpu-core", "200")])]))?;
    for _ in 0..3 {
        let err = bind(&mut r.http, &big, "t1").await?;
        assert!(err.contains("needs 2 idle whole GPU(s), 1 idle"), "{err}");
    }
    eventually(5, "the failure event", || {
        api.events()
            .iter()
            .any(|e| e.reason.as_deref() == Some("TesseraBindFailed"))
    })
    .await?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let failures: Vec<_> = api
        .events()
        .into_iter()
        .filter(|e| e.involved_object.name.as_deref() == Some("big"))
        .collect();
    assert_eq!(failures.len(), 1, "{failures:?}");
    let e = &failures[0];
    assert_eq!(e.type_.as_deref(), Some("Warning"));
    assert_eq!(e.involved_object.uid, big.metadata.uid);
    assert!(
        e.message
            .as_deref()
            .is_some_and(|m| m.starts_with("binding to t1 failed: ")),
        "{e:?}"
    );
    Ok(())
}

/// The bind verb is no back door onto nodes: a pod of another scheduler is not bound through
/// it (the default scheduler never asked), nor a Tessera pod onto a node whose taints it does
/// not tolerate (a control-plane node); tolerating them, it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bind_refuses_other_schedulers_pods_and_untolerated_taints() -> anyhow::Result<()> {
    use k8s_openapi::api::core::v1::{Taint, Toleration};
    let api = FakeApiServer::start().await?;
    api.create_node(&gpu_node("t1", "t4x2"))?;
    let mut cp = plain_node("cp");
    cp.spec.get_or_insert_default().taints = Some(vec![Taint {
        key: "node-role.kubernetes.io/control-plane".into(),
        effect: "NoSchedule".into(),
        ..Default::default()
    }]);
    api.create_node(&cp)?;
    let mut r = start_replica(&api, ReplicaOptions::default()).await?;
    let bound = |name: &str| api.pod("default", name).and_then(|p| p.spec?.node_name);

    let mut foreign = pod("foreign", &[("main", &[("cpu", "1")])]);
    foreign.spec.as_mut().unwrap().scheduler_name = None;
    let foreign = api.create_pod(&foreign)?;
    let err = bind(&mut r.http, &foreign, "t1").await?;
    assert!(
        err.contains("schedulerName is \"default-scheduler\", not \"tessera\""),
        "{err}"
    );
    let mut other = share_pod("other", 30, 4);
    other.spec.as_mut().unwrap().scheduler_name = Some("volcano".into());
    let other = api.create_pod(&other)?;
    assert!(bind(&mut r.http, &other, "t1").await?.contains("\"volcano\""));
    assert_eq!((bound("foreign"), bound("other")), (None, None));

    let web = api.create_pod(&pod("web", &[("main", &[("cpu", "1")])]))?;
    let err = bind(&mut r.http, &web, "cp").await?;
    assert!(
        err.contains("does not tolerate node \"cp\"'s taint node-role.kubernetes.io/control-plane=:NoSchedule"),
        "{err}"
    );
    assert_eq!(bound("web"), None);
    assert!(
        bind(&mut r.http, &web, "nowhere")
            .await?
            .contains("node \"nowhere\" not found")
    );

    let mut admin = pod("admin", &[("main", &[("cpu", "1")])]);
    admin.spec.as_mut().unwrap().tolerations = Some(vec![Toleration {
        key: Some("node-role.kubernetes.io/control-plane".into()),
        operator: Some("Exists".into()),
        effect: Some("NoSchedule".into()),
        ..Default::default()
    }]);
    let admin = api.create_pod(&admin)?;
    assert_eq!(bind(&mut r.http, &admin, "cp").await?, "");
    assert_eq!(bound("admin").as_deref(), Some("cp"));
    Ok(())
}

/// A tenant cannot free its pod's GPUs in the extender's books by rewriting the pod's
/// allocation annotations (pods/update allows it): the node keeps the devices it injected, so
/// the booking keeps them too until the pod ends, and no other pod is given the same card.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tampered_allocation_annotation_keeps_the_booking() -> anyhow::Result<()> {
    let (api, mut r) = cluster(&[("t1", "t4x2")]).await?;
    let whole = |name: &str| pod(name, &[("main", &[("tessera.io/gpu-core", "100")])]);
    let first = api.create_pod(&whole("first"))?;
    let second = api.create_pod(&whole("second"))?;
    assert_eq!(bind(&mut r.http, &first, "t1").await?, "");
    assert_eq!(bind(&mut r.http, &second, "t1").await?, "");
    // The tenant of `first` breaks its signature, then its allocation.
    for patch in [
        json!({"metadata": {"annotations": {"tessera.io/allocation-signature": "x"}}}),
        json!({"metadata": {"annotations": {"tessera.io/allocation": null, "tessera.io/allocation-signature": null}}}),
    ] {
        assert!(api.patch_pod("default", "first", &patch));
        // The extender has seen the change when the pod's annotations are gone from its view.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let third = api.create_pod(&whole(&format!("third-{}", patch.to_string().len())))?;
        let err = bind(&mut r.http, &third, "t1").await?;
        assert!(
            !err.is_empty(),
            "a third whole card was given on a two-card node: {patch}"
        );
        assert_eq!(
            api.pod("default", &third.metadata.name.clone().unwrap())
                .and_then(|p| p.spec?.node_name),
            None
        );
    }
    // The pod ends: its card is free again.
    api.delete_pod("default", "first");
    let fourth = api.create_pod(&whole("fourth"))?;
    let mut err = String::from("not tried");
    for _ in 0..50 {
        err = bind(&mut r.http, &fourth, "t1").await?;
        if err.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(err, "");
    Ok(())
}

/// The extender's service on loopback for `api` (no claims, no lease, the test keys), its
/// verbs behind `tls`, its listeners held to `limits`.
async fn start_verbs(
    api: &FakeApiServer,
    tls: Option<tessera_extender::service::VerbTls>,
    limits: tessera_extender::service::tls::ListenerLimits,
) -> anyhow::Result<tessera_extender::service::Running> {
    let cluster = std::sync::Arc::new(tessera_extender::service::cluster::Cluster::new(
        Default::default(),
        keys(),
        Default::default(),
    ));
    tessera_extender::service::start(
        api.client()?,
        cluster,
        tessera_extender::service::ServiceConfig {
            listen: "127.0.0.1:0".parse()?,
            prefix: PREFIX.into(),
            body_limit: 1 << 20,
            lease: None,
            tls,
            claims: false,
            webhook: None,
            limits,
        },
    )
    .await
}

/// One HTTP/1.1 request over TLS to `addr` (server name `localhost`, trusting `ca`), with a
/// client certificate when given: the status and body, or the handshake's error.
async fn over_tls(
    addr: std::net::SocketAddr,
    ca: &[u8],
    client: Option<(&[u8], &[u8])>,
    method_path: &str,
    body: &[u8],
) -> anyhow::Result<(u16, String)> {
    use std::sync::Arc;

    use rustls_pki_types::pem::PemObject as _;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from_pem_slice(ca)?)?;
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots);
    let config = match client {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => builder.with_client_auth_cert(
            vec![CertificateDer::from_pem_slice(cert)?],
            PrivateKeyDer::from_pem_slice(key)?,
        )?,
    };
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let mut tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect("localhost".try_into()?, tcp)
        .await?;
    tls.write_all(
        format!(
            "{method_path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        )
        .as_bytes(),
    )
    .await?;
    tls.write_all(body).await?;
    let mut reply = String::new();
    tls.read_to_string(&mut reply).await?;
    let status = reply.get(9..12).unwrap_or_default().parse()?;
    Ok((
        status,
        reply
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default(),
    ))
}

/// Only the scheduler drives the extender: with a client CA, the verbs answer only a client
/// whose certificate that CA signed. Without a certificate a caller is refused (403) and
/// nothing is bound; a certificate of another CA fails the handshake; probes and metrics
/// answer anyone; the scheduler's certificate binds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verbs_answer_only_the_schedulers_client_certificate() -> anyhow::Result<()> {
    use tessera_claims::admission::certs::generate_with_clients;
    let api = FakeApiServer::start().await?;
    api.create_node(&gpu_node("t1", "t4x2"))?;
    let dir = tempfile::tempdir()?;
    let (serving, clients) = generate_with_clients(vec!["localhost".into()], &["tessera-scheduler"])?;
    let (_, strangers) = generate_with_clients(vec!["localhost".into()], &["tessera-scheduler"])?;
    let (scheduler, stranger) = (&clients[0], &strangers[0]);
    for (name, bytes) in [
        ("tls.crt", &serving.cert),
        ("tls.key", &serving.key),
        ("ca.crt", &serving.ca),
    ] {
        std::fs::write(dir.path().join(name), bytes)?;
    }
    let running = start_verbs(
        &api,
        Some(tessera_extender::service::VerbTls::Files {
            cert: dir.path().join("tls.crt"),
            key: dir.path().join("tls.key"),
            client_ca: Some(dir.path().join("ca.crt")),
        }),
        Default::default(),
    )
    .await?;
    let addr = running.addr;
    let web = api.create_pod(&pod("web", &[("main", &[("cpu", "1")])]))?;
    let body = serde_json::to_vec(&bind_args(&web, "t1"))?;
    let bind_path = format!("POST {}", path("bind"));
    let mine = Some((scheduler.cert.as_slice(), scheduler.key.as_slice()));
    for _ in 0..50 {
        if over_tls(addr, &serving.ca, None, "GET /readyz", b"").await?.0 == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Anyone: the probes and the metrics.
    assert_eq!(over_tls(addr, &serving.ca, None, "GET /healthz", b"").await?.0, 200);
    assert_eq!(over_tls(addr, &serving.ca, None, "GET /metrics", b"").await?.0, 200);
    // No certificate: refused, nothing bound.
    let (status, reply) = over_tls(addr, &serving.ca, None, &bind_path, &body).await?;
    assert_eq!(status, 403, "{reply}");
    assert!(reply.contains("client certificate is required"), "{reply}");
    let (status, _) = over_tls(addr, &serving.ca, None, &format!("POST {}", path("filter")), b"{}").await?;
    assert_eq!(status, 403);
    // Another CA's client certificate: no handshake.
    let foreign = over_tls(
        addr,
        &serving.ca,
        Some((&stranger.cert, &stranger.key)),
        &bind_path,
        &body,
    )
    .await;
    assert!(foreign.is_err(), "a certificate of another CA was taken: {foreign:?}");
    assert_eq!(api.pod("default", "web").and_then(|p| p.spec?.node_name), None);
    // The scheduler's.
    let (status, reply) = over_tls(addr, &serving.ca, mine, &bind_path, &body).await?;
    assert_eq!((status, reply.as_str()), (200, r#"{"Error":""}"#), "{reply}");
    assert_eq!(
        api.pod("default", "web").and_then(|p| p.spec?.node_name).as_deref(),
        Some("t1")
    );
    Ok(())
}

/// The verbs' certificates the extender keeps itself: the scheduler's key is only in the
/// scheduler's Secret (the extender's holds its own key and the CA), and deleting the
/// extender's Secret rotates both while the extender runs: the next handshake serves the new
/// certificate, the scheduler's old one is refused and its new one answered. A Secret left
/// half-made (`pending`) by a replica that died, or of the older one-Secret layout, is made
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn self_kept_verb_certificates_are_split_and_rotate_without_a_restart() -> anyhow::Result<()> {
    use tessera_extender::service::verb_certs::{STATE_ANNOTATION, VerbCerts};
    const NS: &str = "tessera-system";
    let api = FakeApiServer::start().await?;
    let decode = |s: &serde_json::Value, k: &str| -> Vec<u8> {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD
            .decode(s["data"][k].as_str().unwrap_or_default())
            .unwrap_or_default()
    };
    let secret = |name: &str| api.object("Secret", NS, name);
    // An abandoned half-made Secret is there already: it is replaced, not served.
    api.create_object(&serde_json::json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "tessera-extender-tls", "namespace": NS,
                     "annotations": {STATE_ANNOTATION: "pending"}},
        "data": {"tls.crt": "eA==", "tls.key": "eA==", "ca.crt": "eA=="}
    }))?;
    let certs = VerbCerts {
        namespace: NS.into(),
        secret: "tessera-extender-tls".into(),
        scheduler_secret: "tessera-scheduler-tls".into(),
        service: "localhost".into(),
        pending_grace: Duration::from_secs(2),
    };
    let begun = std::time::Instant::now();
    let running = start_verbs(
        &api,
        Some(tessera_extender::service::VerbTls::SelfManaged(certs)),
        Default::default(),
    )
    .await?;
    let waited = begun.elapsed();
    assert!(
        waited >= Duration::from_secs(2),
        "a pending Secret was replaced at once ({waited:?}): its maker may still be writing"
    );
    let addr = running.addr;
    let (ext, sched) = (
        secret("tessera-extender-tls").unwrap(),
        secret("tessera-scheduler-tls").unwrap(),
    );
    assert_eq!(ext["metadata"]["annotations"][STATE_ANNOTATION], "written");
    // Each Secret holds one side's key: the extender's none of the scheduler's.
    let keys_of = |s: &serde_json::Value| s["data"].as_object().unwrap().keys().cloned().collect::<Vec<_>>();
    assert_eq!(keys_of(&ext), ["ca.crt", "tls.crt", "tls.key"]);
    assert_eq!(keys_of(&sched), ["ca.crt", "tls.crt", "tls.key"]);
    let (ca, client_cert, client_key) = (
        decode(&sched, "ca.crt"),
        decode(&sched, "tls.crt"),
        decode(&sched, "tls.key"),
    );
    assert_ne!(client_key, decode(&ext, "tls.key"));
    assert_eq!(ca, decode(&ext, "ca.crt"));
    let filter = format!("POST {}", path("filter"));
    let answered = |ca: Vec<u8>, cert: Vec<u8>, key: Vec<u8>| {
        let filter = filter.clone();
        async move {
            over_tls(addr, &ca, Some((&cert, &key)), &filter, b"{}")
                .await
                .map(|(status, _)| status)
        }
    };
    let status = answered(ca.clone(), client_cert.clone(), client_key.clone()).await?;
    assert_ne!(status, 403, "the scheduler's certificate was refused");

    // Rotation: the extender's Secret deleted while it runs.
    assert!(api.delete_object("Secret", NS, "tessera-extender-tls"));
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let new_sched = loop {
        let s = secret("tessera-scheduler-tls").unwrap();
        let written =
            secret("tessera-extender-tls").is_some_and(|e| e["metadata"]["annotations"][STATE_ANNOTATION] == "written");
        if written && decode(&s, "ca.crt") != ca {
            break s;
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "no new pair after the Secret went"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let new_ca = decode(&new_sched, "ca.crt");
    // The new pair is served from the next handshake on (the listener's acceptor follows).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let fresh = answered(
            new_ca.clone(),
            decode(&new_sched, "tls.crt"),
            decode(&new_sched, "tls.key"),
        )
        .await;
        if fresh.as_ref().is_ok_and(|s| *s != 403) {
            break;
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "the new pair is not served: {fresh:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The old client certificate: no handshake (its CA is no longer trusted), even when the
    // caller trusts whatever the server shows.
    let old = answered(new_ca.clone(), client_cert, client_key).await;
    assert!(old.is_err(), "the rotated-out client certificate was answered: {old:?}");

    // The older layout (one Secret with the scheduler's key in it) is made again as two.
    let legacy = secret("tessera-extender-tls").unwrap();
    assert!(api.delete_object("Secret", NS, "tessera-extender-tls"));
    let mut data = legacy["data"].clone();
    data["scheduler.key"] = data["tls.key"].clone();
    api.create_object(&serde_json::json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "tessera-extender-tls", "namespace": NS}, "data": data
    }))?;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let e = secret("tessera-extender-tls");
        if e.as_ref().is_some_and(|e| {
            e["metadata"]["annotations"][STATE_ANNOTATION] == "written" && e["data"].get("scheduler.key").is_none()
        }) {
            break;
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "the one-Secret layout was kept: {e:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(running);
    Ok(())
}

/// A client that connects and trickles (or never sends) its headers, or never finishes its TLS
/// handshake, is dropped after the listener's limit; at most `connections` are served at
/// once, so such clients can delay a request but not starve it or grow the extender's
/// memory without bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listeners_drop_slow_clients_and_bound_connections() -> anyhow::Result<()> {
    use std::time::Instant;
    use tessera_extender::service::tls::ListenerLimits;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let api = FakeApiServer::start().await?;
    let limits = ListenerLimits {
        handshake: Duration::from_millis(400),
        header_read: Duration::from_millis(400),
        connections: 2,
    };
    let start = |tls: Option<tessera_extender::service::VerbTls>| start_verbs(&api, tls, limits);
    // Closed by the server: the read ends (0 bytes or an error) before `within`.
    async fn closed_within(s: &mut tokio::net::TcpStream, within: Duration) -> bool {
        let mut buf = [0u8; 256];
        loop {
            match tokio::time::timeout(within, s.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return true,
                Ok(Ok(_)) => continue,
                Err(_) => return false,
            }
        }
    }
    // Plain HTTP: a client that connects and sends nothing.
    let plain = start(None).await?;
    let mut mute = tokio::net::TcpStream::connect(plain.addr).await?;
    let t = Instant::now();
    assert!(
        closed_within(&mut mute, Duration::from_secs(5)).await,
        "a client that sent no byte was kept"
    );
    assert!(t.elapsed() >= Duration::from_millis(300), "{:?}", t.elapsed());
    // Headers trickled, never finished.
    let mut slow = tokio::net::TcpStream::connect(plain.addr).await?;
    slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n").await?;
    let t = Instant::now();
    assert!(
        closed_within(&mut slow, Duration::from_secs(5)).await,
        "a trickling client was kept"
    );
    assert!(t.elapsed() >= Duration::from_millis(300), "{:?}", t.elapsed());
    // Both slots taken by silent clients: a good request waits for one to be dropped, then
    // is answered.
    let (mut a, mut b) = (
        tokio::net::TcpStream::connect(plain.addr).await?,
        tokio::net::TcpStream::connect(plain.addr).await?,
    );
    a.write_all(b"GET").await?;
    b.write_all(b"GET").await?;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let t = Instant::now();
    assert_eq!(JsonClient::new(plain.addr).get_status("/healthz").await?, 200);
    assert!(
        t.elapsed() >= Duration::from_millis(250),
        "answered beside two busy slots: {:?}",
        t.elapsed()
    );
    assert!(closed_within(&mut a, Duration::from_secs(5)).await && closed_within(&mut b, Duration::from_secs(5)).await);

    // TLS: a client that never starts its handshake.
    let dir = tempfile::tempdir()?;
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string()])?;
    std::fs::write(dir.path().join("tls.crt"), cert.cert.pem())?;
    std::fs::write(dir.path().join("tls.key"), cert.signing_key.serialize_pem())?;
    let tls = start(Some(tessera_extender::service::VerbTls::Files {
        cert: dir.path().join("tls.crt"),
        key: dir.path().join("tls.key"),
        client_ca: None,
    }))
    .await?;
    let mut silent = tokio::net::TcpStream::connect(tls.addr).await?;
    let t = Instant::now();
    assert!(
        closed_within(&mut silent, Duration::from_secs(5)).await,
        "a silent TLS client was kept"
    );
    assert!(t.elapsed() >= Duration::from_millis(300), "{:?}", t.elapsed());
    // TLS: handshakes completed, then silence, on every slot (any pod can reach the webhook's
    // port): each is dropped after the header timeout and a real request is answered.
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(
        rustls::ClientConfig::builder()
            .dangerous()
            .with_custom_certificate_verifier(std::sync::Arc::new(AnyServer))
            .with_no_client_auth(),
    ));
    let mut quiet = Vec::new();
    for _ in 0..2 {
        let tcp = tokio::net::TcpStream::connect(tls.addr).await?;
        quiet.push(connector.connect("localhost".try_into()?, tcp).await?);
    }
    let t = Instant::now();
    let tcp = tokio::net::TcpStream::connect(tls.addr).await?;
    let mut good = connector.connect("localhost".try_into()?, tcp).await?;
    good.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await?;
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(5), good.read_to_string(&mut answer))
        .await
        .map_err(|_| anyhow::anyhow!("a request behind two silent TLS clients was never answered"))??;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        t.elapsed() >= Duration::from_millis(250),
        "answered beside two busy slots: {:?}",
        t.elapsed()
    );
    for mut q in quiet {
        let mut buf = [0u8; 64];
        let ended = tokio::time::timeout(Duration::from_secs(5), q.read(&mut buf)).await;
        assert!(
            matches!(ended, Ok(Ok(0)) | Ok(Err(_))),
            "a silent TLS client was kept: {ended:?}"
        );
    }
    Ok(())
}

/// Trusts any server certificate (the listener test's self-signed one).
#[derive(Debug)]
struct AnyServer;

impl rustls::client::danger::ServerCertVerifier for AnyServer {
    fn verify_server_cert(
        &self,
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &[rustls::pki_types::CertificateDer<'_>],
        _: &rustls::pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _: &[u8],
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
    }

    fn verify_tls13_signature(
        &self,
        _: &[u8],
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        rustls::crypto::ring::default_provider()
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// Rotation without restarting the extender: it reads its keys again when their directory
/// changes, so a key made active signs from the next bind, and a key removed stops verifying.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_extender_signs_with_a_rotated_key_without_a_restart() -> anyhow::Result<()> {
    use std::sync::Arc;
    let api = FakeApiServer::start().await?;
    api.create_node(&gpu_node("t1", "t4x2"))?;
    let dir = tempfile::tempdir()?;
    let write = |files: &[(&str, &[u8])]| -> anyhow::Result<()> {
        for e in std::fs::read_dir(dir.path())? {
            std::fs::remove_file(e?.path())?;
        }
        for (name, bytes) in files {
            std::fs::write(dir.path().join(name), bytes)?;
        }
        Ok(())
    };
    write(&[("active", b"k1"), ("k1", &[1u8; 32])])?;
    let cluster = Arc::new(
        tessera_extender::service::cluster::Cluster::new(
            Default::default(),
            tessera_core::handoff::SigningKeys::from_dir(dir.path())?,
            Default::default(),
        )
        .reloading_keys_from(dir.path().to_path_buf()),
    );
    let running = tessera_extender::service::start(
        api.client()?,
        cluster.clone(),
        tessera_extender::service::ServiceConfig {
            listen: "127.0.0.1:0".parse()?,
            prefix: PREFIX.into(),
            body_limit: 1 << 20,
            lease: None,
            tls: None,
            claims: false,
            webhook: None,
            limits: Default::default(),
        },
    )
    .await?;
    let mut http = JsonClient::new(running.addr);
    let signature = |name: &str| {
        api.pod("default", name)
            .and_then(|p| p.metadata.annotations?.get("tessera.io/allocation-signature").cloned())
            .unwrap_or_default()
    };
    let first = api.create_pod(&share_pod("first", 30, 4))?;
    let mut err = String::from("not tried");
    for _ in 0..50 {
        err = bind(&mut http, &first, "t1").await?;
        if err.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(err, "");
    assert!(signature("first").starts_with("v1.k1."), "{}", signature("first"));
    // k2 made active in the Secret: the next bind signs with it.
    std::thread::sleep(Duration::from_millis(20));
    write(&[("active", b"k2"), ("k1", &[1u8; 32]), ("k2", &[2u8; 32])])?;
    let second = api.create_pod(&share_pod("second", 30, 4))?;
    assert_eq!(bind(&mut http, &second, "t1").await?, "");
    assert!(signature("second").starts_with("v1.k2."), "{}", signature("second"));
    // k1 removed: what it signed no longer verifies.
    std::thread::sleep(Duration::from_millis(20));
    write(&[("active", b"k2"), ("k2", &[2u8; 32])])?;
    let p = api.pod("default", "first").unwrap();
    let a = p.metadata.annotations.clone().unwrap_or_default();
    let verified = cluster.keys().verify(
        a.get("tessera.io/allocation").map(String::as_str),
        a.get("tessera.io/allocation-signature").map(String::as_str),
        "t1",
        p.metadata.uid.as_deref().unwrap_or_default(),
    );
    assert!(
        matches!(verified, Err(tessera_core::handoff::HandoffError::UnknownKey { ref key_id }) if key_id == "k1"),
        "{verified:?}"
    );
    Ok(())
}

/// Prioritize right after filter sends the scores the filter worked out (the same as worked
/// out afresh), but only while nothing they came from has changed: cards taken in between
/// are seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prioritize_after_filter_sees_what_changed_in_between() -> anyhow::Result<()> {
    let (api, mut r) = cluster(&[("h1", "h100x8"), ("h2", "h100x8"), ("h3", "h100x8")]).await?;
    let nodes = ["h1", "h2", "h3"];
    // Nodes loaded differently, so that their scores differ.
    let load = api.create_pod(&share_pod("load", 60, 8))?;
    assert_eq!(bind(&mut r.http, &load, "h3").await?, "");
    let half = api.create_pod(&share_pod("half", 50, 8))?;
    assert_eq!(bind(&mut r.http, &half, "h2").await?, "");
    let p = api.create_pod(&share_pod("p", 40, 8))?;
    let twin = api.create_pod(&share_pod("twin", 40, 8))?;
    let scores = |v: Value| -> Vec<(String, i64)> {
        v.as_array()
            .expect("an array")
            .iter()
            .map(|s| (s["Host"].as_str().unwrap().to_string(), s["Score"].as_i64().unwrap()))
            .collect()
    };

    let (_, f) = r.http.post_json(&path("filter"), &args(&p, &nodes)).await?;
    assert_eq!(f["NodeNames"], json!(nodes), "{f}");
    let (_, kept) = r.http.post_json(&path("prioritize"), &args(&p, &nodes)).await?;
    // The same shape asked about by a pod no filter kept anything for: worked out afresh.
    let (_, fresh) = r.http.post_json(&path("prioritize"), &args(&twin, &nodes)).await?;
    assert_eq!(scores(kept.clone()), scores(fresh), "{kept}");
    // Scores that differ: the lowest node is scored 0, left out; h2 is named.
    assert!((1..nodes.len()).contains(&scores(kept.clone()).len()), "{kept}");
    assert!(scores(kept.clone()).iter().any(|s| s.0 == "h2"), "{kept}");

    // The scheduler filters, then the rest of h2's compute is taken before it asks prioritize.
    let (_, f) = r.http.post_json(&path("filter"), &args(&p, &nodes)).await?;
    assert_eq!(f["NodeNames"], json!(nodes), "{f}");
    let seven = api.create_pod(&pod("seven", &[("main", &[("tessera.io/gpu-core", "700")])]))?;
    assert_eq!(bind(&mut r.http, &seven, "h2").await?, "");
    let rest = api.create_pod(&share_pod("rest", 50, 8))?;
    assert_eq!(bind(&mut r.http, &rest, "h2").await?, "");
    let (_, after) = r.http.post_json(&path("prioritize"), &args(&p, &nodes)).await?;
    let after = scores(after);
    assert!(after.iter().all(|s| s.0 != "h2"), "h2 has no compute left: {after:?}");
    assert!(!after.is_empty(), "h1 and h3 differ: {after:?}");
    let (_, fresh) = r.http.post_json(&path("prioritize"), &args(&twin, &nodes)).await?;
    assert_eq!(after, scores(fresh));
    Ok(())
}
