//! `kubectl tessera` against the fake API server: a cluster of the three fixtures with pods
//! placed by the extender (filter, bind), checked against golden output. Regenerate the golden
//! files with `UPDATE_GOLDEN=1 cargo test -p tessera-tests --test kubectl`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use k8s_openapi::api::core::v1::{Event, ObjectReference};
use kube::Api;
use kube::api::{ObjectMeta, PostParams};
use serde_json::json;
use tessera_core::request::RequestOptions;
use tessera_kubectl::{CliError, Output};
use tessera_tests::apiserver::FakeApiServer;
use tessera_tests::gpu_cluster::{
    PREFIX, ReplicaOptions, gpu_node, plain_node, pod, scheduler_json, share_pod, start_replica,
};

fn golden(name: &str, text: &str) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("golden").join(name);
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, text).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(
        text,
        want,
        "{name} differs from {} (UPDATE_GOLDEN=1 to accept)",
        path.display()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_and_pod_show_what_the_extender_placed() -> anyhow::Result<()> {
    let api = FakeApiServer::start().await?;
    let client = api.client()?;
    // No Tessera node yet: a clear error.
    api.create_node(&plain_node("cpu-only"))?;
    let e = tessera_kubectl::inspect(&client, None, Output::Table)
        .await
        .unwrap_err();
    assert!(matches!(e, CliError::NoTesseraNodes), "{e}");
    assert!(e.to_string().contains("no Tessera nodes"), "{e}");

    for (name, fixture) in [("h1", "h100x8"), ("a1", "a100-mig"), ("t1", "t4x2")] {
        api.create_node(&gpu_node(name, fixture))?;
    }
    let mut r = start_replica(&api, ReplicaOptions::default()).await?;
    let placed: [(k8s_openapi::api::core::v1::Pod, &str); 6] = [
        (share_pod("infer-a", 30, 8), "h1"),
        (share_pod("infer-b", 50, 16), "h1"),
        (pod("train", &[("main", &[("tessera.io/gpu-core", "200")])]), "h1"),
        (pod("mig", &[("main", &[("tessera.io/mig-1g.5gb", "2")])]), "a1"),
        (
            pod(
                "two",
                &[
                    ("a", &[("tessera.io/gpu-core", "20"), ("tessera.io/gpu-memory", "2")]),
                    ("b", &[("tessera.io/gpu-core", "100")]),
                ],
            ),
            "t1",
        ),
        (share_pod("small", 10, 1), "a1"),
    ];
    for (p, node) in &placed {
        let p = api.create_pod(p)?;
        let (_, reply) = r
            .http
            .post_json(
                &format!("{PREFIX}/filter"),
                &json!({"Pod": scheduler_json(&p), "Nodes": null, "NodeNames": [node]}),
            )
            .await?;
        assert_eq!(reply["NodeNames"], json!([node]), "{reply}");
        let (_, reply) = r
            .http
            .post_json(
                &format!("{PREFIX}/bind"),
                &json!({"PodName": p.metadata.name, "PodNamespace": "default", "PodUID": p.metadata.uid, "Node": node}),
            )
            .await?;
        assert_eq!(reply["Error"], "", "{reply}");
    }
    // A pod that fits nowhere, with the scheduler's event as kube-scheduler writes it.
    let pending = api.create_pod(&pod("huge", &[("main", &[("tessera.io/gpu-core", "800")])]))?;
    Api::<Event>::namespaced(client.clone(), "default")
        .create(
            &PostParams::default(),
            &Event {
                metadata: ObjectMeta {
                    name: Some("huge.1".into()),
                    ..Default::default()
                },
                involved_object: ObjectReference {
                    kind: Some("Pod".into()),
                    name: Some("huge".into()),
                    namespace: Some("default".into()),
                    uid: pending.metadata.uid.clone(),
                    ..Default::default()
                },
                reason: Some("FailedScheduling".into()),
                type_: Some("Warning".into()),
                message: Some(
                    "0/4 nodes are available: 1 node(s) needs 8 idle whole GPU(s), 6 idle, 3 node(s) had no GPU."
                        .into(),
                ),
                ..Default::default()
            },
        )
        .await?;

    golden(
        "kubectl-inspect.txt",
        &tessera_kubectl::inspect(&client, None, Output::Table).await?,
    );
    golden(
        "kubectl-inspect-wide-t1.txt",
        &tessera_kubectl::inspect(&client, Some("t1"), Output::Wide).await?,
    );
    let json: serde_json::Value = serde_json::from_str(&tessera_kubectl::inspect(&client, None, Output::Json).await?)?;
    let h1 = &json["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["name"] == "h1")
        .unwrap()["cards"];
    let allocated: u64 = h1
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["core_allocated"].as_u64().unwrap())
        .sum();
    assert_eq!(allocated, 30 + 50 + 200, "{h1}");
    let e = tessera_kubectl::inspect(&client, Some("cpu-only"), Output::Table)
        .await
        .unwrap_err();
    assert!(matches!(e, CliError::NodeNotFound(_)), "{e}");

    // The bound pods' events come from the extender asynchronously: wait for them.
    tessera_tests::gpu_cluster::eventually(5, "the extender's events", || {
        api.events()
            .iter()
            .filter(|e| e.reason.as_deref() == Some("TesseraBound"))
            .count()
            == placed.len()
    })
    .await?;
    let opts = RequestOptions::default();
    let report = tessera_kubectl::pod(&client, "default", "two", &opts).await?;
    // Event names carry the time; the report shows reasons and messages only.
    golden("kubectl-pod-two.txt", &report);
    golden(
        "kubectl-pod-huge.txt",
        &tessera_kubectl::pod(&client, "default", "huge", &opts).await?,
    );
    let e = tessera_kubectl::pod(&client, "default", "ghost", &opts)
        .await
        .unwrap_err();
    assert_eq!(e.to_string(), "pod default/ghost not found");

    // A tampered allocation naming a card the node does not have is reported, not counted.
    let mut annotations: BTreeMap<String, String> = api
        .pod("default", "small")
        .unwrap()
        .metadata
        .annotations
        .unwrap_or_default();
    let a = annotations.get_mut("tessera.io/allocation").unwrap();
    let first_gpu = a.find("GPU-").unwrap();
    a.replace_range(first_gpu..first_gpu + 12, "GPU-deadbeef");
    let patch = json!({"metadata": {"annotations": {"tessera.io/allocation": a.clone()}}});
    Api::<k8s_openapi::api::core::v1::Pod>::namespaced(client.clone(), "default")
        .patch(
            "small",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await?;
    let text = tessera_kubectl::inspect(&client, Some("a1"), Output::Table).await?;
    assert!(
        text.contains("! pod default/small: container main has GPU GPU-deadbeef")
            && text.contains("which node a1 does not have"),
        "{text}"
    );
    Ok(())
}
