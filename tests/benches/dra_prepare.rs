//! The DRA plugin's NodePrepareResources and NodeUnprepareResources as the kubelet calls them
//! (one claim per call, over the plugin's Unix socket), with claims, namespaces and the node
//! read from the fake API server: per-claim latency for whole cards and for shares by
//! consumable capacity on the 8-GPU fixture, against a no-op plugin on the same transport, and
//! how a prepare grows with the claims already prepared on the node; and a claim of a MIG
//! instance made for it (dynamic MIG), on a fixture A100 node whose instances the real CDI
//! generator lists, until the kubelet is told.
//! Run: `cargo bench -p tessera-tests --bench dra_prepare`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use serde_json::json;
use tessera_cdi_generator::daemon::DaemonConfig;
use tessera_cdi_generator::spec::SpecOptions;
use tessera_core::dra::DRIVER;
use tessera_core::inventory::{FixtureMigInstances, FixtureSource};
use tessera_dra_plugin::driver::ApiClaims;
use tessera_dra_plugin::service::{self, Config};
use tessera_proto::dra as api;
use tessera_proto::dra::dra_plugin_client::DraPluginClient;
use tessera_proto::dra::dra_plugin_server::{DraPlugin, DraPluginServer};
use tessera_tests::apiserver::FakeApiServer;
use tessera_tests::gpu_cluster::plain_node;
use tonic::transport::{Channel, Endpoint, Uri};

const NODE: &str = "node-a";
const NAMESPACE: &str = "team-a";
/// Rounds of the no-op baseline and of each whole-card measurement.
const ROUNDS: usize = 200;
/// Shares prepared together for the growth figure: 8 cards x 10 shares of 10% + 8 GiB.
const SHARES: usize = 80;
/// Claims of a 1g.5gb instance made for each: the fixture's 2 A100s x 7 placements.
const CARVES: usize = 14;
/// Rounds of the carve measurement (each prepares and unprepares every one of [`CARVES`]).
const CARVE_ROUNDS: usize = 3;

fn quantile(v: &mut [Duration], q: f64) -> Duration {
    v.sort();
    v[((v.len() - 1) as f64 * q).round() as usize]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// A plugin that answers every claim at once with no devices: the gRPC and socket cost alone.
struct NoOp;

#[tonic::async_trait]
impl DraPlugin for NoOp {
    async fn node_prepare_resources(
        &self,
        request: tonic::Request<api::NodePrepareResourcesRequest>,
    ) -> Result<tonic::Response<api::NodePrepareResourcesResponse>, tonic::Status> {
        let claims = request
            .into_inner()
            .claims
            .into_iter()
            .map(|c| (c.uid, api::NodePrepareResourceResponse::default()))
            .collect();
        Ok(tonic::Response::new(api::NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        request: tonic::Request<api::NodeUnprepareResourcesRequest>,
    ) -> Result<tonic::Response<api::NodeUnprepareResourcesResponse>, tonic::Status> {
        let claims = request
            .into_inner()
            .claims
            .into_iter()
            .map(|c| (c.uid, api::NodeUnprepareResourceResponse::default()))
            .collect();
        Ok(tonic::Response::new(api::NodeUnprepareResourcesResponse { claims }))
    }
}

async fn channel(socket: PathBuf) -> anyhow::Result<Channel> {
    for _ in 0..250 {
        if socket.exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(Endpoint::try_from("http://[::]:50051")?
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let socket = socket.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(socket).await?)) }
        }))
        .await?)
}

/// An allocated claim of `device`, a share when `consumed` names capacity, as the scheduler
/// leaves it.
fn claim(name: &str, device: &str, consumed: Option<(&str, &str)>) -> serde_json::Value {
    let mut result = json!({"driver": DRIVER, "pool": NODE, "device": device, "request": "gpu"});
    if let Some((cores, memory)) = consumed {
        result["shareID"] = json!(format!("share-{name}"));
        result["consumedCapacity"] = json!({"cores": cores, "memory": memory});
    }
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": format!("uid-{name}")},
        "spec": {},
        "status": {"allocation": {"devices": {"results": [result]}}}
    })
}

fn claim_ref(name: &str) -> api::Claim {
    api::Claim {
        namespace: NAMESPACE.into(),
        uid: format!("uid-{name}"),
        name: name.into(),
    }
}

/// Prepares (or unprepares) one claim as the kubelet does, failing on the claim's error.
async fn call(client: &mut DraPluginClient<Channel>, name: &str, prepare: bool) -> anyhow::Result<Duration> {
    let claims = vec![claim_ref(name)];
    let t = Instant::now();
    let error = if prepare {
        let mut r = client
            .node_prepare_resources(api::NodePrepareResourcesRequest { claims })
            .await?
            .into_inner();
        r.claims.remove(&format!("uid-{name}")).map(|c| c.error)
    } else {
        let mut r = client
            .node_unprepare_resources(api::NodeUnprepareResourcesRequest { claims })
            .await?
            .into_inner();
        r.claims.remove(&format!("uid-{name}")).map(|c| c.error)
    };
    let elapsed = t.elapsed();
    match error.as_deref() {
        Some("") => Ok(elapsed),
        Some(e) => anyhow::bail!("claim {name}: {e}"),
        None => anyhow::bail!("claim {name}: no answer"),
    }
}

/// Prepares claim `name` once the plugin can (the node's cards are read at its first poll),
/// then unprepares it.
async fn first_prepare(client: &mut DraPluginClient<Channel>, name: &str) -> anyhow::Result<()> {
    let started = Instant::now();
    while call(client, name, true).await.is_err() {
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(30),
            "the plugin never prepared {name}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    call(client, name, false).await?;
    Ok(())
}

fn line(what: &str, v: &mut [Duration], base: Duration) {
    let (p50, p99) = (quantile(v, 0.5), quantile(v, 0.99));
    println!(
        "  {what:<44} median {:.2} ms, p99 {:.2} ms  (median {:.1}x the no-op plugin)",
        ms(p50),
        ms(p99),
        p50.as_secs_f64() / base.as_secs_f64()
    );
}

/// A claim of a 1g.5gb MIG instance at placement `i % 7` of the fixture A100 `i / 7`.
fn carve_claim(i: usize) -> serde_json::Value {
    claim(
        &format!("carve-{i}"),
        &format!("gpu-{}-mig-1g-5gb-at-{}", i / 7, i % 7),
        None,
    )
}

/// Prepares and unprepares [`CARVES`] claims of a MIG instance each, [`CARVE_ROUNDS`] times, on
/// a fixture A100 node (in `dir`) whose instances the DRA plugin makes and the CDI generator
/// lists as it does on a node (woken by the claim markers in the CDI directory): how long the
/// kubelet waits for each, instance made and listed.
async fn carves(dir: &Path, api: &FakeApiServer) -> anyhow::Result<(Vec<Duration>, Vec<Duration>)> {
    std::fs::create_dir_all(dir.join("cdi"))?;
    let fixture = dir.join("node.yaml");
    std::fs::write(
        &fixture,
        tessera_core::inventory::Fixture::builtin_text("a100-dynamic-mig").unwrap_or_default(),
    )?;
    let generator = tokio::spawn(tessera_cdi_generator::daemon::run(
        Box::new(FixtureSource::new(&fixture)),
        // A node's generator watches the CDI directory alone (no file stands for its cards).
        vec![dir.join("cdi")],
        DaemonConfig {
            cdi_dir: dir.join("cdi"),
            spec: SpecOptions::default(),
            interval: Duration::from_secs(30),
            node_name: None,
            bundle: None,
            check_host_paths: None,
            share_memory: None,
        },
    ));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let plugin = tokio::spawn(service::run(
        Config {
            partitioner: Some(Arc::new(FixtureMigInstances::new(&fixture))),
            cdi_wait: tessera_dra_plugin::driver::CDI_WAIT,
            ..config(dir)
        },
        Arc::new(FixtureSource::new(&fixture)),
        Arc::new(ApiClaims(api.client()?)),
        None,
        async move {
            let _ = stopped.await;
        },
    ));
    let mut client = DraPluginClient::new(channel(dir.join("plugins").join(DRIVER).join("dra.sock")).await?);
    first_prepare(&mut client, "carve-0").await?;
    let (mut made, mut gone) = (Vec::new(), Vec::new());
    for _ in 0..CARVE_ROUNDS {
        for i in 0..CARVES {
            made.push(call(&mut client, &format!("carve-{i}"), true).await?);
        }
        for i in 0..CARVES {
            gone.push(call(&mut client, &format!("carve-{i}"), false).await?);
        }
    }
    let _ = stop.send(());
    plugin.await??;
    generator.abort();
    Ok((made, gone))
}

fn config(dir: &Path) -> Config {
    Config {
        node: NODE.into(),
        registry_dir: dir.join("plugins_registry"),
        plugin_dir: dir.join("plugins").join(DRIVER),
        cdi_dir: dir.join("cdi"),
        state_dir: dir.join("state"),
        memory_unit_mib: 1024,
        poll: Duration::from_millis(100),
        partitioner: None,
        cdi_wait: Duration::from_secs(5),
        grants_dir: dir.join("grants"),
    }
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let api = FakeApiServer::start().await?;
    api.create_node(&plain_node(NODE))?;
    api.create_object(&json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}))?;
    for i in 0..8 {
        api.create_object(&claim(&format!("whole-{i}"), &format!("gpu-{i}"), None))?;
    }
    for i in 0..SHARES {
        api.create_object(&claim(
            &format!("share-{i}"),
            &format!("gpu-{}", i % 8),
            Some(("10", "8Gi")),
        ))?;
    }
    for i in 0..CARVES {
        api.create_object(&carve_claim(i))?;
    }

    // The no-op plugin on a socket of its own.
    let noop_socket = dir.path().join("noop.sock");
    let listener = tokio::net::UnixListener::bind(&noop_socket)?;
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(DraPluginServer::new(NoOp))
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
    );
    let mut noop = DraPluginClient::new(channel(noop_socket).await?);
    let mut base = Vec::new();
    for i in 0..ROUNDS + 10 {
        let t = call(&mut noop, &format!("noop-{i}"), true).await?;
        if i >= 10 {
            base.push(t);
        }
    }
    let base_p50 = quantile(&mut base, 0.5);

    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let plugin = tokio::spawn(service::run(
        config(dir.path()),
        Arc::new(FixtureSource::new("h100x8")),
        Arc::new(ApiClaims(api.client()?)),
        None,
        async move {
            let _ = stopped.await;
        },
    ));
    let mut client = DraPluginClient::new(channel(dir.path().join("plugins").join(DRIVER).join("dra.sock")).await?);
    first_prepare(&mut client, "whole-0").await?;

    let (mut whole, mut whole_un) = (Vec::new(), Vec::new());
    for round in 0..ROUNDS / 8 {
        for i in 0..8 {
            let t = call(&mut client, &format!("whole-{i}"), true).await?;
            if round > 0 {
                whole.push(t);
            }
        }
        for i in 0..8 {
            whole_un.push(call(&mut client, &format!("whole-{i}"), false).await?);
        }
    }
    let (mut first, mut second, mut last, mut share_un) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut all = Vec::new();
    for round in 0..4 {
        for i in 0..SHARES {
            let t = call(&mut client, &format!("share-{i}"), true).await?;
            if round > 0 {
                all.push(t);
                if i < 8 {
                    first.push(t);
                } else if i < 16 {
                    second.push(t);
                } else if i >= SHARES - 8 {
                    last.push(t);
                }
            }
        }
        for i in 0..SHARES {
            share_un.push(call(&mut client, &format!("share-{i}"), false).await?);
        }
    }
    println!("DRA plugin, one claim per call as the kubelet sends them, claims from the fake API server:");
    println!(
        "  no-op plugin (gRPC over the socket only):    median {:.2} ms, p99 {:.2} ms",
        ms(base_p50),
        ms(quantile(&mut base, 0.99))
    );
    line("prepare, whole card", &mut whole, base_p50);
    line("unprepare, whole card", &mut whole_un, base_p50);
    line(
        &format!("prepare, share (10% + 8 GiB, {SHARES} on 8 cards)"),
        &mut all,
        base_p50,
    );
    line("  the first 8 (node empty)", &mut first, base_p50);
    line("  the next 8 (8 prepared)", &mut second, base_p50);
    line(&format!("  the last 8 ({} prepared)", SHARES - 8), &mut last, base_p50);
    line("unprepare, share", &mut share_un, base_p50);
    let _ = stop.send(());
    plugin.await??;
    let (mut made, mut gone) = carves(&dir.path().join("carve"), &api).await?;
    line(
        &format!("prepare, 1g.5gb made for it ({CARVES} on 2 A100s)"),
        &mut made,
        base_p50,
    );
    line("unprepare, the instance destroyed", &mut gone, base_p50);
    Ok(())
}
