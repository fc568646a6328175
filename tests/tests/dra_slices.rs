//! The DRA plugin's ResourceSlice against an API server: published only while the node is
//! labelled for DRA, an unhealthy card tainted, and, where the server drops device taints (the
//! fake's fault injection; the real 1.36 server serves them, `tests/tests/cluster.rs`), the
//! unhealthy card left out rather than offered as if healthy.

use std::sync::atomic::Ordering;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use tessera_core::dra::{UNHEALTHY_TAINT, slice_devices, slice_name};
use tessera_core::inventory::{FixtureSource, Health, InventorySource};
use tessera_core::names::LABEL_DRA;
use tessera_dra_plugin::slices::{SlicePublisher, Synced};
use tessera_tests::apiserver::FakeApiServer;

fn node(name: &str, dra: bool) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: dra.then(|| [(LABEL_DRA.to_string(), "true".to_string())].into()),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// Device name -> its taint keys, as the server stored the slice.
fn stored(api: &FakeApiServer, node: &str) -> Option<Vec<(String, Vec<String>)>> {
    let slice = api.object("ResourceSlice", "", &slice_name(node))?;
    Some(
        slice["spec"]["devices"]
            .as_array()?
            .iter()
            .map(|d| {
                let taints = d["taints"].as_array().into_iter().flatten();
                (
                    d["name"].as_str().unwrap_or_default().to_string(),
                    taints
                        .map(|t| t["key"].as_str().unwrap_or_default().to_string())
                        .collect(),
                )
            })
            .collect(),
    )
}

#[tokio::test]
async fn an_unhealthy_card_is_tainted_or_left_out_and_the_slice_follows_the_label() -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let api = FakeApiServer::start().await?;
    let mut inv = FixtureSource::new("t4x2").discover()?;
    inv.gpus[1].health = Health::Unhealthy {
        reason: "XID 79".into(),
    };
    let devices = slice_devices(&inv, 1024);

    // Not labelled for DRA: nothing published.
    api.create_node(&node("n1", false))?;
    let mut publisher = SlicePublisher::new(api.client()?, "n1");
    assert_eq!(publisher.sync(devices.clone()).await?, Synced::Withdrawn);
    assert_eq!(stored(&api, "n1"), None);

    // Labelled: the unhealthy card is there, tainted.
    api.patch_node("n1", &serde_json::json!({"metadata": {"labels": {LABEL_DRA: "true"}}}));
    assert_eq!(publisher.sync(devices.clone()).await?, Synced::Published(1));
    let want = vec![
        ("gpu-0".to_string(), vec![]),
        ("gpu-1".to_string(), vec![UNHEALTHY_TAINT.to_string()]),
    ];
    assert_eq!(stored(&api, "n1"), Some(want));
    assert_eq!(publisher.sync(devices.clone()).await?, Synced::Unchanged);

    // A server that drops taints: the card is left out, not offered untainted.
    api.faults().drop_device_taints.store(true, Ordering::Relaxed);
    api.create_node(&node("n2", true))?;
    let mut publisher2 = SlicePublisher::new(api.client()?, "n2");
    assert!(matches!(publisher2.sync(devices.clone()).await?, Synced::Published(_)));
    assert_eq!(stored(&api, "n2"), Some(vec![("gpu-0".to_string(), vec![])]));
    assert_eq!(publisher2.sync(devices.clone()).await?, Synced::Unchanged);

    // The label goes: the slice is withdrawn.
    api.patch_node("n1", &serde_json::json!({"metadata": {"labels": {LABEL_DRA: null}}}));
    assert_eq!(publisher.sync(devices).await?, Synced::Withdrawn);
    assert_eq!(stored(&api, "n1"), None);
    Ok(())
}
