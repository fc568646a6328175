//! The `tessera` scheduler looks at every node for a GPU pod, on the real Kubernetes.
//!
//! kube-scheduler stops looking once it has found a share of the nodes that its own checks
//! pass (`percentageOfNodesToScore`; by default a tenth of 5,000 nodes, and at least 100), and
//! asks the extender about those alone. Its checks add up a node's GPU resources; whether one
//! card has room is the extender's. On a cluster where most nodes have room in total but on
//! no one card, the few nodes that fit a pod can lie beyond the ones looked at: the extender
//! refuses every node it is asked about, and the pod waits, unscheduled, until a later attempt
//! happens to start elsewhere. The manifests set the `tessera` profile to look at every node.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use k8s_openapi::api::core::v1::{Node, NodeCondition};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use tessera_tests::cluster::{Cluster, tessera};
use tessera_tests::gpu_cluster::gpu_node;

/// Nodes of two T4s (30 GiB of GPU memory in all, 15 on a card) before the one that fits.
const CROWD: usize = 150;
/// The label every node of the test carries (the cluster's own node does not).
const LABEL: &str = "tessera-test/crowd";

/// A node of the test: `fixture`'s GPUs published as the node agent publishes them, Ready,
/// its resources as the device plugin would advertise them.
fn crowd_node(name: &str, fixture: &str, core: u32, memory_gib: u32) -> Node {
    let mut n = gpu_node(name, fixture);
    n.metadata.labels = Some(BTreeMap::from([(LABEL.to_string(), "true".to_string())]));
    let status = n.status.as_mut().expect("a status");
    let alloc = status.allocatable.as_mut().expect("allocatable");
    alloc.insert("tessera.io/gpu-core".into(), Quantity(core.to_string()));
    alloc.insert("tessera.io/gpu-memory".into(), Quantity(memory_gib.to_string()));
    status.capacity = Some(alloc.clone());
    status.conditions = Some(vec![NodeCondition {
        type_: "Ready".into(),
        status: "True".into(),
        ..Default::default()
    }]);
    n
}

/// The extender's count of the nodes it knows (its `/metrics`).
fn extender_nodes(c: &Cluster) -> Option<u64> {
    let out = c
        .command("curl")
        .args(["-sfk", "https://127.0.0.1:8888/metrics"])
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("tessera_extender_nodes "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|v| v as u64)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tessera_scheduler_weighs_every_node_for_a_gpu_pod() -> anyhow::Result<()> {
    let mut c = Cluster::start().await?;
    tessera::install(&mut c, "t4x2", 200, false).await?;
    // The crowd first, then the one node with cards of 79 GiB, in the order kube-scheduler
    // then looks at them (the harness runs it with one filter worker, so the order holds).
    let mut nodes: Vec<Node> = (0..CROWD)
        .map(|i| crowd_node(&format!("crowd-{i:03}"), "t4x2", 200, 30))
        .collect();
    nodes.push(crowd_node("crowd-roomy", "h100x8", 800, 632));
    let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": nodes});
    c.apply(&list.to_string())?;
    // The extender knows them all (the cluster's own node besides).
    let deadline = Instant::now() + Duration::from_secs(60);
    while extender_nodes(&c) != Some(CROWD as u64 + 2) {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the extender knows {:?} nodes, not {}",
            extender_nodes(&c),
            CROWD + 2
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // Half a card and 20 GiB: every crowd node has that much in all, none on one card.
    c.apply(&format!(
        r#"apiVersion: v1
kind: Pod
metadata: {{name: wide, namespace: default}}
spec:
  schedulerName: tessera
  nodeSelector: {{{LABEL}: "true"}}
  # The test's nodes have no kubelet: the node controller marks them not ready, then
  # unreachable, as it goes.
  tolerations:
  - {{key: node.kubernetes.io/not-ready, operator: Exists}}
  - {{key: node.kubernetes.io/unreachable, operator: Exists}}
  containers:
  - name: main
    image: docker.io/tessera/busybox:test
    imagePullPolicy: Never
    resources: {{limits: {{tessera.io/gpu-core: "50", tessera.io/gpu-memory: "20"}}}}
"#
    ))?;
    c.wait_for(
        &["pod/wide"],
        "{.spec.nodeName}",
        "crowd-roomy",
        Duration::from_secs(120),
    )
    .await
    .with_context(|| c.kubectl_ok(&["describe", "pod", "wide"]).unwrap_or_default())?;
    // At the first attempt it had every node: no attempt that knew them all was refused. (One
    // made before kube-scheduler had heard of the last nodes says fewer, "0/151 nodes".) Events
    // are written after the fact: read them a few times.
    let every = format!("0/{} nodes are available", CROWD + 2);
    for _ in 0..12 {
        let refused = c.kubectl_ok(&[
            "get",
            "events",
            "--field-selector",
            "involvedObject.name=wide,reason=FailedScheduling",
            "-o",
            "jsonpath={.items[*].message}",
        ])?;
        assert!(
            !refused.contains(&every),
            "the pod was refused with every node known: {refused}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Ok(())
}
