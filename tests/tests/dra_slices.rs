//! The DRA plugin's ResourceSlice against an API server: published only while the node is
//! labelled for DRA, an unhealthy card tainted, and, where the server drops device taints (the
//! fake's fault injection; the real 1.36 server serves them, `tests/tests/cluster.rs`), the
//! unhealthy card left out rather than offered as if healthy; with dynamic MIG, a pool of
//! device slices and counter slices that follows the node's label.

use std::sync::atomic::Ordering;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use tessera_core::dra::{Published, UNHEALTHY_TAINT, publish, slice_name};
use tessera_core::inventory::{FixtureSource, Health, InventorySource};
use tessera_core::names::{LABEL_DRA, LABEL_DYNAMIC_MIG};
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
    let published = publish(&inv, 1024, false, &[]);
    let devices = || {
        let p = published.clone();
        move |_dynamic: bool| p
    };

    // Not labelled for DRA: nothing published.
    api.create_node(&node("n1", false))?;
    let mut publisher = SlicePublisher::new(api.client()?, "n1");
    assert_eq!(publisher.sync(devices()).await?, Synced::Withdrawn);
    assert_eq!(stored(&api, "n1"), None);

    // Labelled: the unhealthy card is there, tainted.
    api.patch_node("n1", &serde_json::json!({"metadata": {"labels": {LABEL_DRA: "true"}}}));
    assert_eq!(publisher.sync(devices()).await?, Synced::Published(1));
    let want = vec![
        ("gpu-0".to_string(), vec![]),
        ("gpu-1".to_string(), vec![UNHEALTHY_TAINT.to_string()]),
    ];
    assert_eq!(stored(&api, "n1"), Some(want));
    assert_eq!(publisher.sync(devices()).await?, Synced::Unchanged);

    // A server that drops taints: the card is left out, not offered untainted.
    api.faults().drop_device_taints.store(true, Ordering::Relaxed);
    api.create_node(&node("n2", true))?;
    let mut publisher2 = SlicePublisher::new(api.client()?, "n2");
    assert!(matches!(publisher2.sync(devices()).await?, Synced::Published(_)));
    assert_eq!(stored(&api, "n2"), Some(vec![("gpu-0".to_string(), vec![])]));
    assert_eq!(publisher2.sync(devices()).await?, Synced::Unchanged);

    // The label goes: the slice is withdrawn.
    api.patch_node("n1", &serde_json::json!({"metadata": {"labels": {LABEL_DRA: null}}}));
    assert_eq!(publisher.sync(devices()).await?, Synced::Withdrawn);
    assert_eq!(stored(&api, "n1"), None);
    Ok(())
}

/// The generation and slice count of slice `name`, and its device names and counter sets.
fn layout(api: &FakeApiServer, name: &str) -> Option<(i64, i64, usize, usize)> {
    let s = api.object("ResourceSlice", "", name)?;
    let pool = &s["spec"]["pool"];
    Some((
        pool["generation"].as_i64()?,
        pool["resourceSliceCount"].as_i64()?,
        s["spec"]["devices"].as_array().map_or(0, Vec::len),
        s["spec"]["sharedCounters"].as_array().map_or(0, Vec::len),
    ))
}

#[tokio::test]
async fn dynamic_mig_publishes_a_pool_of_device_and_counter_slices() -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let api = FakeApiServer::start().await?;
    let inv = FixtureSource::new("a100-dynamic-mig").discover()?;
    api.create_node(&node("n1", true))?;
    let mut publisher = SlicePublisher::new(api.client()?, "n1");
    let seen = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let asked = |seen: std::sync::Arc<std::sync::atomic::AtomicBool>| {
        let inv = inv.clone();
        move |dynamic: bool| -> Published {
            seen.store(dynamic, Ordering::Relaxed);
            publish(&inv, 1024, dynamic, &[])
        }
    };
    // Without the dynamic-MIG label: the cards' (no) instances, one empty slice.
    assert_eq!(publisher.sync(asked(seen.clone())).await?, Synced::Published(1));
    assert!(!seen.load(Ordering::Relaxed));
    assert_eq!(layout(&api, &slice_name("n1")), Some((1, 1, 0, 0)));
    // With it: 50 placement devices in one slice, the two cards' counter sets in another, one
    // pool of two slices at one generation.
    api.patch_node(
        "n1",
        &serde_json::json!({"metadata": {"labels": {LABEL_DYNAMIC_MIG: "true"}}}),
    );
    assert_eq!(publisher.sync(asked(seen.clone())).await?, Synced::Published(2));
    assert!(seen.load(Ordering::Relaxed));
    assert_eq!(layout(&api, &slice_name("n1")), Some((2, 2, 50, 0)));
    let counters = format!("{}-counters-0", slice_name("n1"));
    assert_eq!(layout(&api, &counters), Some((2, 2, 0, 2)));
    // A fresh plugin (a restart) finds the pool and moves it on; the label going takes the
    // counter slice away.
    let mut again = SlicePublisher::new(api.client()?, "n1");
    api.patch_node(
        "n1",
        &serde_json::json!({"metadata": {"labels": {LABEL_DYNAMIC_MIG: null}}}),
    );
    assert_eq!(again.sync(asked(seen.clone())).await?, Synced::Published(3));
    assert_eq!(layout(&api, &slice_name("n1")), Some((3, 1, 0, 0)));
    assert_eq!(
        layout(&api, &counters),
        None,
        "the counter slice of the older layout is gone"
    );
    Ok(())
}
