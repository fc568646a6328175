//! ElasticGPU claims end to end against the fake API server: the admission webhook (called by
//! the fake over HTTPS with the CA the extender wrote into the webhook configuration), placement
//! through filter and bind, the claims controller's ElasticGPUs and claim status, Retain and
//! Delete, and a restarted extender.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::PostParams;
use serde_json::{Value, json};
use tessera_api::egpu::GpuDevice;
use tessera_claims::admission::certs::SelfManaged;
use tessera_core::handoff::Allocation;
use tessera_core::names::{ANNOTATION_ALLOCATION, ANNOTATION_ALLOCATION_SIGNATURE};
use tessera_deploy::{ManifestOptions, objects};
use tessera_extender::service::{WebhookConfig, WebhookTls};
use tessera_tests::apiserver::FakeApiServer;
use tessera_tests::gpu_cluster::{
    PREFIX, Replica, ReplicaOptions, eventually, gpu_node, keys, scheduler_json, share_pod, start_replica,
};

const NS: &str = "default";

fn webhook() -> WebhookConfig {
    WebhookConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        tls: WebhookTls::SelfManaged(SelfManaged {
            namespace: "tessera-system".into(),
            secret: "tessera-webhook-tls".into(),
            // The fake calls https://localhost:<port>: the certificate is for that name.
            service: "localhost".into(),
            webhook_configuration: "tessera-extender".into(),
        }),
    }
}

/// Starts a replica with the webhook and installs the rendered webhook configuration, pointed
/// at it; waits until the extender has written its CA into it.
async fn start(api: &FakeApiServer) -> anyhow::Result<Replica> {
    let r = start_replica(
        api,
        ReplicaOptions {
            webhook: Some(webhook()),
            ..Default::default()
        },
    )
    .await?;
    let port = r.running.webhook_addr.expect("webhook served").port();
    let mut cfg = objects(&ManifestOptions::default())
        .into_iter()
        .find(|o| o["kind"] == "MutatingWebhookConfiguration")
        .expect("rendered");
    cfg["webhooks"][0]["clientConfig"] = json!({"url": format!("https://localhost:{port}/mutate-pods")});
    api.delete_object("MutatingWebhookConfiguration", "", "tessera-extender");
    api.create_object(&cfg)?;
    eventually(10, "the caBundle", || {
        api.object("MutatingWebhookConfiguration", "", "tessera-extender")
            .is_some_and(|c| {
                c["webhooks"][0]["clientConfig"]["caBundle"]
                    .as_str()
                    .is_some_and(|b| !b.is_empty())
            })
    })
    .await?;
    Ok(r)
}

fn example_docs() -> anyhow::Result<Vec<Value>> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples/claims/elastic-gpu.yaml");
    use serde::Deserialize as _;
    serde_yaml::Deserializer::from_str(&std::fs::read_to_string(path)?)
        .map(|d| Ok(serde_json::to_value(serde_yaml::Value::deserialize(d)?)?))
        .collect()
}

/// Creates a pod through the API (and so through admission), in its own namespace; the error
/// is the API's message.
async fn create_pod(api: &FakeApiServer, pod: &Value) -> Result<Pod, String> {
    let ns = pod["metadata"]["namespace"].as_str().unwrap_or(NS);
    let pods: Api<Pod> = Api::namespaced(api.client().map_err(|e| e.to_string())?, ns);
    let pod: Pod = serde_json::from_value(pod.clone()).map_err(|e| e.to_string())?;
    pods.create(&PostParams::default(), &pod).await.map_err(|e| match e {
        kube::Error::Api(s) => s.message,
        e => e.to_string(),
    })
}

fn claim_pod(name: &str, annotation: &str, claim: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "annotations": {annotation: claim}},
        "spec": {"schedulerName": "tessera", "containers": [{"name": "main", "image": "busybox"}]}
    })
}

fn claim(name: &str, class: &str, requests: Value) -> Value {
    json!({
        "apiVersion": "tessera.io/v1alpha1", "kind": "ElasticGPUClaim",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"egpuClassName": class, "resources": {"requests": requests}}
    })
}

fn class(name: &str, reclaim: &str) -> Value {
    json!({
        "apiVersion": "tessera.io/v1alpha1", "kind": "ElasticGPUClass",
        "metadata": {"name": name}, "provisioner": "tessera.io/gpu", "reclaimPolicy": reclaim
    })
}

/// Filters over `nodes` as kube-scheduler would and binds to the first that fits; the reply
/// when none does.
async fn schedule(api: &FakeApiServer, r: &mut Replica, name: &str, nodes: &[&str]) -> anyhow::Result<String> {
    schedule_in(api, r, NS, name, nodes).await
}

/// [`schedule`] for a pod of namespace `ns`.
async fn schedule_in(
    api: &FakeApiServer,
    r: &mut Replica,
    ns: &str,
    name: &str,
    nodes: &[&str],
) -> anyhow::Result<String> {
    let p = api.pod(ns, name).expect("pod exists");
    let (_, reply) = r
        .http
        .post_json(
            &format!("{PREFIX}/filter"),
            &json!({"Pod": scheduler_json(&p), "Nodes": null, "NodeNames": nodes}),
        )
        .await?;
    let fit: Vec<String> = serde_json::from_value(reply["NodeNames"].clone())?;
    let Some(node) = fit.first() else {
        anyhow::bail!("{name}: no node fits: {reply}");
    };
    let (_, b) = r
        .http
        .post_json(
            &format!("{PREFIX}/bind"),
            &json!({"PodName": name, "PodNamespace": ns, "PodUID": p.metadata.uid, "Node": node}),
        )
        .await?;
    anyhow::ensure!(b["Error"] == "", "{name}: bind: {b}");
    Ok(node.clone())
}

fn allocation(api: &FakeApiServer, name: &str) -> Allocation {
    allocation_in(api, NS, name)
}

fn allocation_in(api: &FakeApiServer, ns: &str, name: &str) -> Allocation {
    let p = api.pod(ns, name).expect("pod");
    let a = p.metadata.annotations.as_ref().expect("annotations");
    keys()
        .verify(
            a.get(ANNOTATION_ALLOCATION).map(String::as_str),
            a.get(ANNOTATION_ALLOCATION_SIGNATURE).map(String::as_str),
            p.spec.as_ref().unwrap().node_name.as_deref().unwrap(),
            p.metadata.uid.as_deref().unwrap(),
        )
        .expect("a verified allocation")
}

/// The card of the first device pod `ns/name` was given.
fn card_of(api: &FakeApiServer, ns: &str, name: &str) -> String {
    allocation_in(api, ns, name).containers[0].devices[0]
        .card_uuid()
        .to_string()
}

/// The filter's reply for `pod` on `node` alone.
async fn filter_on(r: &mut Replica, pod: &Pod, node: &str) -> anyhow::Result<Value> {
    let args = json!({"Pod": scheduler_json(pod), "Nodes": null, "NodeNames": [node]});
    Ok(r.http.post_json(&format!("{PREFIX}/filter"), &args).await?.1)
}

fn claim_obj(api: &FakeApiServer, name: &str) -> Value {
    api.object("ElasticGPUClaim", NS, name).expect("claim")
}

/// The ElasticGPU bound to claim `name`.
fn egpu_of(api: &FakeApiServer, name: &str) -> Option<Value> {
    api.objects("ElasticGPU")
        .into_iter()
        .find(|e| e["spec"]["claimRef"]["name"] == name)
}

fn limits(p: &Pod, container: &str) -> Vec<(String, String)> {
    let c = p
        .spec
        .as_ref()
        .unwrap()
        .containers
        .iter()
        .find(|c| c.name == container)
        .unwrap();
    let r = c.resources.as_ref().expect("resources");
    assert_eq!(
        r.limits, r.requests,
        "extended resources have equal limits and requests"
    );
    r.limits
        .iter()
        .flatten()
        .map(|(k, v)| (k.clone(), v.0.clone()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn elastic_gpus_example_binds_and_retain_brings_a_recreated_pod_back_to_its_card() -> anyhow::Result<()> {
    let api = FakeApiServer::start().await?;
    for n in ["h1", "h2"] {
        api.create_node(&gpu_node(n, "h100x8"))?;
    }
    let mut r = start(&api).await?;
    let docs = example_docs()?;
    for d in docs.iter().filter(|d| d["kind"] != "Pod") {
        api.create_object(d)?;
    }
    let pods: Vec<&Value> = docs.iter().filter(|d| d["kind"] == "Pod").collect();
    assert_eq!(pods.len(), 2);
    for p in &pods {
        let created = create_pod(&api, p).await.map_err(anyhow::Error::msg)?;
        // The webhook filled in the claim's GPU as Tessera's resources.
        assert_eq!(
            limits(&created, "test-cuda"),
            [
                ("tessera.io/gpu-core".to_string(), "10".to_string()),
                ("tessera.io/gpu-memory".to_string(), "4".to_string())
            ]
        );
    }
    for p in ["test-cuda-1", "test-cuda-2"] {
        schedule(&api, &mut r, p, &["h1", "h2"]).await?;
    }
    // Both claims Bound to an ElasticGPU that records what their pod was given.
    eventually(10, "two Bound ElasticGPUs and claims", || {
        ["gpushare-egpuc-1", "gpushare-egpuc-2"].iter().all(|c| {
            claim_obj(&api, c)["status"]["phase"] == "Bound"
                && egpu_of(&api, c).is_some_and(|e| e["status"]["phase"] == "Bound" && e["status"]["pod"].is_string())
        })
    })
    .await?;
    let e1 = egpu_of(&api, "gpushare-egpuc-1").unwrap();
    let e1_name = e1["metadata"]["name"].as_str().unwrap().to_string();
    let a1 = allocation(&api, "test-cuda-1");
    let recorded: Vec<GpuDevice> = serde_json::from_value(e1["spec"]["devices"].clone())?;
    let given: Vec<GpuDevice> = a1.containers[0].devices.iter().map(GpuDevice::from).collect();
    assert_eq!(recorded, given);
    assert_eq!((recorded[0].core_percent, recorded[0].memory_mib), (10, 4096));
    assert_eq!(e1["spec"]["nodeName"], a1.node.as_str());
    assert_eq!(e1["spec"]["reclaimPolicy"], "Retain");
    assert_eq!(e1["status"]["pod"], "default/test-cuda-1");
    assert_eq!(
        claim_obj(&api, "gpushare-egpuc-1")["status"]["elasticGPUName"],
        e1_name.as_str()
    );
    assert_eq!(
        e1["metadata"]["name"],
        format!(
            "egpu-{}",
            claim_obj(&api, "gpushare-egpuc-1")["metadata"]["uid"].as_str().unwrap()
        )
    );

    // Retain: the pod goes, its ElasticGPU stays Bound to the claim and its card stays booked.
    api.delete_pod(NS, "test-cuda-1");
    eventually(10, "the ElasticGPU kept for its claim", || {
        egpu_of(&api, "gpushare-egpuc-1")
            .is_some_and(|e| e["status"]["phase"] == "Bound" && e["status"]["pod"].is_null())
            && claim_obj(&api, "gpushare-egpuc-1")["status"]["pod"].is_null()
    })
    .await?;
    let held_key = format!("egpu/{e1_name}");
    let held = r
        .running
        .service
        .cluster
        .booking(&held_key)
        .expect("the retained GPU is booked");
    assert_eq!(held.allocation.unwrap().containers[0].devices, a1.containers[0].devices);

    // A restarted extender books it again from the ElasticGPU, and the used one only once.
    r.running.kill();
    let mut r = start(&api).await?;
    let held = r
        .running
        .service
        .cluster
        .booking(&held_key)
        .expect("booked again after a restart");
    assert_eq!(held.node, a1.node);
    let e2 = egpu_of(&api, "gpushare-egpuc-2").unwrap();
    let e2_key = format!("egpu/{}", e2["metadata"]["name"].as_str().unwrap());
    assert!(
        r.running.service.cluster.booking(&e2_key).is_none(),
        "its pod's booking covers it"
    );
    let pod2_uid = api.pod(NS, "test-cuda-2").unwrap().metadata.uid.unwrap();
    assert!(r.running.service.cluster.booking(&pod2_uid).is_some());

    // The pod again: only the retained GPU's node will do, and it gets the same card and share.
    create_pod(&api, pods[0]).await.map_err(anyhow::Error::msg)?;
    let other = if a1.node == "h1" { "h2" } else { "h1" };
    let p = api.pod(NS, "test-cuda-1").unwrap();
    let (_, reply) = r
        .http
        .post_json(
            &format!("{PREFIX}/filter"),
            &json!({"Pod": scheduler_json(&p), "Nodes": null, "NodeNames": [other, a1.node.as_str()]}),
        )
        .await?;
    assert_eq!(reply["NodeNames"], json!([a1.node.as_str()]), "{reply}");
    let why = reply["FailedAndUnresolvableNodes"][other].as_str().unwrap_or_default();
    assert!(why.contains(&format!("hold their GPUs on node {:?}", a1.node)), "{why}");
    assert_eq!(
        schedule(&api, &mut r, "test-cuda-1", &[other, &a1.node]).await?,
        a1.node
    );
    let again = allocation(&api, "test-cuda-1");
    assert_eq!(again.containers[0].devices, a1.containers[0].devices);
    assert!(
        r.running.service.cluster.booking(&held_key).is_none(),
        "handed over to the pod"
    );
    eventually(10, "the ElasticGPU used again", || {
        egpu_of(&api, "gpushare-egpuc-1").is_some_and(|e| e["status"]["pod"] == "default/test-cuda-1")
    })
    .await?;
    assert_eq!(api.objects("ElasticGPU").len(), 2, "reused, not created again");
    Ok(())
}

/// docs/threat-model.md: a retained ElasticGPU share keeps its card to its claim's tenant.
/// While no pod uses the claim, its card is booked for the claim's namespace's tenant (read
/// from the namespace watch, `tessera.io/tenant` groups included): another tenant's share never
/// lands beside it on a node that has not opted in, and a namespace of the claim's group does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retained_share_keeps_its_card_to_its_claims_tenant() -> anyhow::Result<()> {
    use tessera_tests::gpu_cluster::tenant_namespace;
    let api = FakeApiServer::start().await?;
    api.create_node(&gpu_node("t-held", "t4x2"))?;
    for (ns, group) in [
        ("ml-train", Some("ml")),
        ("ml-eval", Some("ml")),
        ("other", None),
        ("solo", None),
    ] {
        api.create_object(&tenant_namespace(ns, group))?;
    }
    let mut r = start(&api).await?;
    api.create_object(&class("keep", "Retain"))?;
    let mut c = claim(
        "held",
        "keep",
        json!({"tessera.io/gpu-core": "10", "tessera.io/gpu-memory": "2"}),
    );
    c["metadata"]["namespace"] = json!("ml-train");
    api.create_object(&c)?;
    let mut p = claim_pod("trainer", "claim.tessera.io/main", "held");
    p["metadata"]["namespace"] = json!("ml-train");
    create_pod(&api, &p).await.map_err(anyhow::Error::msg)?;
    schedule_in(&api, &mut r, "ml-train", "trainer", &["t-held"]).await?;
    let held_card = card_of(&api, "ml-train", "trainer");
    // The pod goes (its own booking with it); its claim keeps the share.
    let uid = api.pod("ml-train", "trainer").unwrap().metadata.uid.unwrap();
    api.delete_pod("ml-train", "trainer");
    eventually(10, "the ElasticGPU kept for its claim, the pod's booking gone", || {
        egpu_of(&api, "held").is_some_and(|e| e["status"]["phase"] == "Bound" && e["status"]["pod"].is_null())
            && r.running.service.cluster.booking(&uid).is_none()
    })
    .await?;
    let share = |ns: &str, name: &str| {
        let mut p = share_pod(name, 20, 2);
        p.metadata.namespace = Some(ns.into());
        p
    };
    // Another tenant's share takes the other card, not the held one's free 90%.
    api.create_pod(&share("other", "o1"))?;
    schedule_in(&api, &mut r, "other", "o1", &["t-held"]).await?;
    let other_card = card_of(&api, "other", "o1");
    assert_ne!(other_card, held_card, "another tenant's share beside the retained one");
    // Both cards now serve a tenant: a third tenant fits on neither, and is not told whose.
    let solo = api.create_pod(&share("solo", "s1"))?;
    let reply = filter_on(&mut r, &solo, "t-held").await?;
    assert_eq!(reply["NodeNames"], json!([]), "a third tenant on a held card: {reply}");
    let why = reply["FailedNodes"]["t-held"].as_str().unwrap_or_default();
    assert!(why.contains("another tenant"), "{reply}");
    let names = ["ml", "ml-train", "ml-eval", "other"];
    assert!(
        !why.split(|c: char| !c.is_alphanumeric() && c != '-')
            .any(|w| names.contains(&w)),
        "the refusal names a tenant: {why}"
    );
    // A namespace of the claim's group shares the held card.
    api.create_pod(&share("ml-eval", "e1"))?;
    schedule_in(&api, &mut r, "ml-eval", "e1", &["t-held"]).await?;
    let eval_card = card_of(&api, "ml-eval", "e1");
    assert_eq!(eval_card, held_card, "the claim's group shares its card");

    // A restarted extender books the retained share under the claim's group too, even where
    // the namespaces are listed well after the ElasticGPUs: it reads the ElasticGPUs only once
    // the namespaces are listed (booked before, the share would be the namespace's alone, and
    // the group's next share would fit nowhere).
    let e1_uid = api.pod("ml-eval", "e1").unwrap().metadata.uid.unwrap();
    api.delete_pod("ml-eval", "e1");
    eventually(10, "the group's share gone", || {
        r.running.service.cluster.booking(&e1_uid).is_none()
    })
    .await?;
    r.running.kill();
    api.faults()
        .namespace_list_delay_ms
        .store(1500, std::sync::atomic::Ordering::Relaxed);
    let mut r = start(&api).await?;
    let e2 = api.create_pod(&share("ml-eval", "e2"))?;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let reply = filter_on(&mut r, &e2, "t-held").await?;
        if reply["NodeNames"] == json!(["t-held"]) {
            break;
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "the group's share fits nowhere after a restart: {reply}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    schedule_in(&api, &mut r, "ml-eval", "e2", &["t-held"]).await?;
    let e2_card = card_of(&api, "ml-eval", "e2");
    assert_eq!(e2_card, held_card, "the claim's group shares its card after a restart");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_frees_the_gpu_when_its_pod_goes() -> anyhow::Result<()> {
    let api = FakeApiServer::start().await?;
    api.create_node(&gpu_node("h1", "h100x8"))?;
    let mut r = start(&api).await?;
    api.create_object(&class("scratch", "Delete"))?;
    api.create_object(&claim(
        "scratch",
        "scratch",
        json!({"tessera.io/gpu-core": "20", "tessera.io/gpu-memory": "2"}),
    ))?;
    create_pod(&api, &claim_pod("job", "claim.tessera.io/main", "scratch"))
        .await
        .map_err(anyhow::Error::msg)?;
    schedule(&api, &mut r, "job", &["h1"]).await?;
    eventually(10, "the ElasticGPU", || {
        egpu_of(&api, "scratch").is_some_and(|e| e["status"]["phase"] == "Bound")
    })
    .await?;
    let e = egpu_of(&api, "scratch").unwrap();
    assert_eq!(e["spec"]["reclaimPolicy"], "Delete");
    assert_eq!(
        e["spec"]["capacity"],
        json!({"tessera.io/gpu-core": "20", "tessera.io/gpu-memory": "2"})
    );
    let uid = api.pod(NS, "job").unwrap().metadata.uid.unwrap();
    api.delete_pod(NS, "job");
    eventually(10, "the ElasticGPU deleted and the claim Pending", || {
        egpu_of(&api, "scratch").is_none() && claim_obj(&api, "scratch")["status"]["phase"] == "Pending"
    })
    .await?;
    let cluster = &r.running.service.cluster;
    assert!(cluster.booking(&uid).is_none());
    assert!(
        cluster
            .booking(&format!("egpu/{}", e["metadata"]["name"].as_str().unwrap()))
            .is_none()
    );
    assert_eq!(cluster.counts().1, 0, "nothing is booked");
    // Placed afresh next time.
    create_pod(&api, &claim_pod("job2", "claim.tessera.io/main", "scratch"))
        .await
        .map_err(anyhow::Error::msg)?;
    schedule(&api, &mut r, "job2", &["h1"]).await?;
    eventually(10, "a new ElasticGPU", || {
        egpu_of(&api, "scratch").is_some_and(|e| e["status"]["pod"] == "default/job2")
    })
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_claims_are_refused_at_admission_with_the_reason() -> anyhow::Result<()> {
    let api = FakeApiServer::start().await?;
    api.create_node(&gpu_node("h1", "h100x8"))?;
    let mut r = start(&api).await?;
    api.create_object(&class("shared", "Retain"))?;
    api.create_object(&claim(
        "ok",
        "shared",
        json!({"elasticgpu.io/gpu-core": 30, "elasticgpu.io/gpu-memory": 8}),
    ))?;
    api.create_object(&claim("classless", "nope", json!({"tessera.io/gpu-core": "10"})))?;
    api.create_object(&claim("cpu", "shared", json!({"cpu": "2"})))?;

    let refused = |pod: Value| {
        let api = &api;
        async move { create_pod(api, &pod).await.err().unwrap_or_default() }
    };
    let e = refused(claim_pod("a", "egpuc.elasticgpu.io/main", "missing")).await;
    assert!(
        e.contains("denied the request") && e.contains("ElasticGPUClaim default/missing does not exist"),
        "{e}"
    );
    let e = refused(claim_pod("b", "egpuc.elasticgpu.io/main", "classless")).await;
    assert!(
        e.contains("names ElasticGPUClass \"nope\", which does not exist"),
        "{e}"
    );
    let e = refused(claim_pod("c", "egpuc.elasticgpu.io/main", "cpu")).await;
    assert!(
        e.contains("spec.resources.requests[\"cpu\"]=\"2\": not a GPU resource"),
        "{e}"
    );
    let e = refused(claim_pod("d", "egpuc.elasticgpu.io/sidecar", "ok")).await;
    assert!(
        e.contains("names container \"sidecar\", which the pod does not have"),
        "{e}"
    );
    let mut own = claim_pod("e", "egpuc.elasticgpu.io/main", "ok");
    own["spec"]["containers"][0]["resources"] = json!({"limits": {"tessera.io/gpu-core": "50"}});
    let e = refused(own).await;
    assert!(e.contains("also asks for tessera.io/gpu-core"), "{e}");
    assert!(api.pods().is_empty(), "nothing refused was stored");

    // A good one is admitted, and while it runs its claim is in use.
    let p = create_pod(&api, &claim_pod("first", "egpuc.elasticgpu.io/main", "ok"))
        .await
        .map_err(anyhow::Error::msg)?;
    assert_eq!(
        limits(&p, "main"),
        [
            ("tessera.io/gpu-core".to_string(), "30".to_string()),
            ("tessera.io/gpu-memory".to_string(), "8".to_string())
        ]
    );
    schedule(&api, &mut r, "first", &["h1"]).await?;
    eventually(5, "the pod seen", || {
        r.running.service.cluster.claim_user("default/ok").is_some()
    })
    .await?;
    let e = refused(claim_pod("second", "claim.tessera.io/main", "ok")).await;
    assert!(
        e.contains("ElasticGPUClaim default/ok is in use by pod default/first"),
        "{e}"
    );
    // A pod that names no claim passes unchanged.
    let plain = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "plain", "namespace": NS},
        "spec": {"containers": [{"name": "main", "image": "busybox"}]}});
    let p = create_pod(&api, &plain).await.map_err(anyhow::Error::msg)?;
    assert!(p.spec.unwrap().containers[0].resources.is_none());
    // Once it has finished, the claim is free again.
    api.set_pod_phase(NS, "first", "Succeeded");
    eventually(5, "the claim free", || {
        r.running.service.cluster.claim_user("default/ok").is_none()
    })
    .await?;
    tokio::time::sleep(Duration::from_millis(50)).await;
    create_pod(&api, &claim_pod("second", "claim.tessera.io/main", "ok"))
        .await
        .map_err(anyhow::Error::msg)?;
    Ok(())
}

/// Whether `addr` serves a certificate for `localhost` that `ca_pem` signed (a TLS handshake).
async fn serves_cert_of(addr: std::net::SocketAddr, ca_pem: &[u8]) -> bool {
    use rustls_pki_types::CertificateDer;
    use rustls_pki_types::pem::PemObject as _;
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca_pem).flatten() {
        if roots.add(c).is_err() {
            return false;
        }
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let Ok(builder) = rustls::ClientConfig::builder_with_provider(provider).with_safe_default_protocol_versions()
    else {
        return false;
    };
    let config = builder.with_root_certificates(roots).with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let Ok(tcp) = tokio::net::TcpStream::connect(addr).await else {
        return false;
    };
    let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
    connector.connect(name, tcp).await.is_ok()
}

/// The webhook's Secret is the source of truth for every replica: deleted, it is made again by
/// one replica, every replica then serves the new certificate without a restart, and the
/// configuration's `caBundle` settles on the new CA instead of replicas writing their own in
/// turn (before, each kept the CA it started with and they overwrote each other until restarted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_follow_the_webhook_secret_and_agree_on_the_ca() -> anyhow::Result<()> {
    use base64::Engine as _;
    let api = FakeApiServer::start().await?;
    let a = start(&api).await?;
    let b = start_replica(
        &api,
        ReplicaOptions {
            webhook: Some(webhook()),
            ..Default::default()
        },
    )
    .await?;
    let ca_of_secret = |api: &FakeApiServer| -> Option<Vec<u8>> {
        let s = api.object("Secret", "tessera-system", "tessera-webhook-tls")?;
        base64::engine::general_purpose::STANDARD
            .decode(s["data"]["ca.crt"].as_str()?)
            .ok()
    };
    let bundle = |api: &FakeApiServer| -> Option<Vec<u8>> {
        let c = api.object("MutatingWebhookConfiguration", "", "tessera-extender")?;
        base64::engine::general_purpose::STANDARD
            .decode(c["webhooks"][0]["clientConfig"]["caBundle"].as_str()?)
            .ok()
    };
    let old = ca_of_secret(&api).expect("the Secret");
    let (addr_a, addr_b) = (
        a.running.webhook_addr.expect("webhook"),
        b.running.webhook_addr.expect("webhook"),
    );
    assert!(serves_cert_of(addr_a, &old).await && serves_cert_of(addr_b, &old).await);

    assert!(api.delete_object("Secret", "tessera-system", "tessera-webhook-tls"));
    eventually(10, "a new Secret", || ca_of_secret(&api).is_some_and(|ca| ca != old)).await?;
    let new = ca_of_secret(&api).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !(serves_cert_of(addr_a, &new).await && serves_cert_of(addr_b, &new).await) {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the replicas still serve the old certificate"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eventually(10, "the caBundle on the new CA", || {
        bundle(&api).as_deref() == Some(new.as_slice())
    })
    .await?;
    // It stays there: no replica writes another CA.
    for _ in 0..30 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(bundle(&api).as_deref(), Some(new.as_slice()), "the caBundle moved");
        assert_eq!(
            ca_of_secret(&api).as_deref(),
            Some(new.as_slice()),
            "the Secret was made again"
        );
    }

    // An operator's own certificate put in the Secret (a rotation by hand, cert-manager): both
    // replicas serve it, and the caBundle follows.
    let mine = tessera_claims::admission::certs::generate(vec!["localhost".into()])?;
    let b64 = |v: &[u8]| base64::engine::general_purpose::STANDARD.encode(v);
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(api.client()?, "tessera-system");
    secrets
        .patch(
            "tessera-webhook-tls",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"data": {
                "tls.crt": b64(&mine.cert), "tls.key": b64(&mine.key), "ca.crt": b64(&mine.ca)
            }})),
        )
        .await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !(serves_cert_of(addr_a, &mine.ca).await && serves_cert_of(addr_b, &mine.ca).await) {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the replicas do not serve the operator's certificate"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eventually(10, "the caBundle on the operator's CA", || {
        bundle(&api).as_deref() == Some(mine.ca.as_slice())
    })
    .await?;
    Ok(())
}
