//! The extender's resident memory against a cluster of 1,000 GPU nodes: with the nodes alone,
//! then with 20,000 ordinary pods (no GPU, about 2 KB each as the API serves them), then with
//! 2,000 GPU pods on top, in one run. The extender runs in a child process (this program
//! re-executed) so that the fake API server's memory is not counted.
//!
//! `cargo bench -p tessera-tests --bench extender_memory`
//!
//! `CHILD_WRAPPER="valgrind --tool=massif"` (any command line) runs the child under that
//! program: the extender exits cleanly on SIGTERM, so a heap profiler's report is complete.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tessera_core::handoff::{AllocatedDevice, Allocation, ContainerAllocation};
use tessera_core::inventory::{FixtureSource, InventorySource};
use tessera_core::names::{ANNOTATION_ALLOCATION, ANNOTATION_ALLOCATION_SIGNATURE};
use tessera_core::request::{ContainerRole, RequestOptions};
use tessera_extender::service::cluster::Cluster;
use tessera_extender::service::{self, ServiceConfig};
use tessera_tests::apiserver::FakeApiServer;
use tessera_tests::gpu_cluster::{gpu_node, keys};

const NODES: usize = 1000;
const ORDINARY: usize = 20_000;
const GPU_PODS: usize = 2_000;

/// An ordinary workload pod as an API server returns it: labels, the last-applied annotation,
/// env, probes, volumes, status.
fn ordinary_pod(i: usize, node: &str) -> k8s_openapi::api::core::v1::Pod {
    let applied = format!(
        "{{\"apiVersion\":\"apps/v1\",\"kind\":\"Deployment\",\"metadata\":{{\"name\":\"web-{}\",\"namespace\":\"apps\"}},\"spec\":{{\"replicas\":3,\"template\":{{\"spec\":{{\"containers\":[{{\"name\":\"app\",\"image\":\"registry.example.com/team/app:1.2.3\"}}]}}}}}}}}",
        i % 500
    );
    serde_json::from_value(json!({
        "metadata": {
            "name": format!("web-{i}"), "namespace": "apps", "uid": format!("00000000-0000-4000-8000-{i:012}"),
            "labels": {"app": "web", "team": "payments", "pod-template-hash": "7d9f8c6b5", "version": "1.2.3", "tier": "frontend"},
            "annotations": {"kubectl.kubernetes.io/last-applied-configuration": applied, "prometheus.io/scrape": "true", "prometheus.io/port": "9090"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-7d9f8c6b5", "uid": "11111111-2222-3333-4444-555555555555", "controller": true}]
        },
        "spec": {
            "nodeName": node,
            "containers": [{
                "name": "app", "image": "registry.example.com/team/app:1.2.3",
                "env": (0..10).map(|k| json!({"name": format!("SETTING_{k}"), "value": format!("value-{k}-for-the-application")})).collect::<Vec<_>>(),
                "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"cpu": "1", "memory": "512Mi"}},
                "ports": [{"containerPort": 8080, "name": "http"}, {"containerPort": 9090, "name": "metrics"}],
                "volumeMounts": [{"name": "config", "mountPath": "/etc/app"}, {"name": "secrets", "mountPath": "/var/run/secrets/app"}, {"name": "kube-api-access-abcde", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}],
                "livenessProbe": {"httpGet": {"path": "/healthz", "port": 8080}, "periodSeconds": 10},
                "readinessProbe": {"httpGet": {"path": "/ready", "port": 8080}, "periodSeconds": 5}
            }],
            "volumes": [{"name": "config", "configMap": {"name": "web-config"}}, {"name": "secrets", "secret": {"secretName": "web-secrets"}},
                        {"name": "kube-api-access-abcde", "projected": {"sources": [{"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}}]}}],
            "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}]
        },
        "status": {
            "phase": "Running", "podIP": "10.0.3.17", "hostIP": "192.168.1.10", "qosClass": "Burstable",
            "conditions": [{"type": "Ready", "status": "True"}, {"type": "ContainersReady", "status": "True"}, {"type": "PodScheduled", "status": "True"}],
            "containerStatuses": [{"name": "app", "ready": true, "restartCount": 0, "image": "registry.example.com/team/app:1.2.3", "imageID": "sha256:0123456789abcdef", "started": true}]
        }
    }))
    .expect("a pod")
}

/// A bound share pod with its signed allocation.
fn gpu_pod(i: usize, node: &str, gpu: &tessera_core::inventory::Gpu) -> k8s_openapi::api::core::v1::Pod {
    let uid = format!("00000000-0000-4000-9000-{i:012}");
    let mut a = Allocation::new(node, &uid);
    a.containers.push(ContainerAllocation {
        name: "main".into(),
        role: ContainerRole::App,
        devices: vec![AllocatedDevice::share(gpu, 10, 4096)],
    });
    let s = keys().sign(&a);
    serde_json::from_value(json!({
        "metadata": {"name": format!("train-{i}"), "namespace": "ml", "uid": uid,
                     "annotations": {ANNOTATION_ALLOCATION: s.allocation, ANNOTATION_ALLOCATION_SIGNATURE: s.signature}},
        "spec": {"nodeName": node, "schedulerName": "tessera", "containers": [{"name": "main", "image": "nvcr.io/nvidia/pytorch:24.05",
                 "resources": {"limits": {"tessera.io/gpu-core": "10", "tessera.io/gpu-memory": "4", "cpu": "2", "memory": "8Gi"}}}]},
        "status": {"phase": "Running"}
    }))
    .expect("a pod")
}

fn rss_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Runs the extender in a child against `api` and returns its resident and peak KiB once it
/// has read the cluster.
async fn measure(api: &FakeApiServer) -> anyhow::Result<(u64, u64)> {
    let dir = tempfile::tempdir()?;
    let ready = dir.path().join("ready");
    let mut cmd = match std::env::var("CHILD_WRAPPER") {
        Ok(w) => {
            let mut parts = w.split_whitespace();
            let mut c = std::process::Command::new(parts.next().unwrap());
            c.args(parts).arg(std::env::current_exe()?);
            c
        }
        Err(_) => std::process::Command::new(std::env::current_exe()?),
    };
    let mut child = cmd.arg("--child").arg(api.url()).arg(&ready).spawn()?;
    let deadline = Instant::now() + Duration::from_secs(300);
    while !ready.exists() {
        anyhow::ensure!(Instant::now() < deadline, "the extender did not sync");
        anyhow::ensure!(child.try_wait()?.is_none(), "the extender exited");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let r = rss_kib(child.id());
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )?;
    child.wait()?;
    Ok(r)
}

/// The child: an extender against the API at `url`; `ready` appears once it has synced.
fn child(url: &str, ready: &Path) -> anyhow::Result<()> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(async {
            service::install_crypto_provider();
            let client = kube::Client::try_from(kube::Config::new(url.parse()?))?;
            let cluster = Arc::new(Cluster::new(Default::default(), keys(), RequestOptions::default()));
            let _running = service::start(
                client,
                cluster.clone(),
                ServiceConfig {
                    listen: "127.0.0.1:0".parse()?,
                    prefix: "/tessera".into(),
                    body_limit: 8 << 20,
                    lease: None,
                    tls: None,
                    claims: true,
                    webhook: None,
                    limits: Default::default(),
                },
            )
            .await?;
            while !cluster.synced() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            std::fs::write(ready, b"")?;
            // SIGTERM: exit as it is (a heap profiler wrapping the child then reports it).
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?
                .recv()
                .await;
            std::process::exit(0)
        })
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--child") {
        return child(&args[i + 1], Path::new(&args[i + 2]));
    }
    if args.iter().any(|a| a == "--list") {
        return Ok(());
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(parent())
}

async fn parent() -> anyhow::Result<()> {
    let api = FakeApiServer::start().await?;
    let names: Vec<String> = (0..NODES).map(|i| format!("gpu-{i:04}")).collect();
    for n in &names {
        api.create_node(&gpu_node(n, "h100x8"))?;
    }
    let size = serde_json::to_vec(&ordinary_pod(0, &names[0]))?.len();
    let (base, base_peak) = measure(&api).await?;
    for i in 0..ORDINARY {
        api.create_pod(&ordinary_pod(i, &names[i % NODES]))?;
    }
    let (ordinary, ordinary_peak) = measure(&api).await?;
    let inv = FixtureSource::new("h100x8").discover()?;
    for i in 0..GPU_PODS {
        api.create_pod(&gpu_pod(i, &names[i % NODES], &inv.gpus[(i / NODES) % 8]))?;
    }
    let (gpu, gpu_peak) = measure(&api).await?;
    let mib = |k: u64| k as f64 / 1024.0;
    println!("extender resident memory once synced, {NODES} H100x8 nodes (peak while reading in brackets):");
    println!(
        "  nodes only                          {:7.1} MiB  ({:.1})",
        mib(base),
        mib(base_peak)
    );
    println!(
        "  + {ORDINARY} ordinary pods ({size} B each)   {:7.1} MiB  ({:.1})   {:+.0} B per ordinary pod; ratio to nodes only {:.2}",
        mib(ordinary),
        mib(ordinary_peak),
        (ordinary as f64 - base as f64) * 1024.0 / ORDINARY as f64,
        ordinary as f64 / base as f64
    );
    println!(
        "  + {GPU_PODS} GPU pods                      {:7.1} MiB  ({:.1})   {:+.0} B per GPU pod",
        mib(gpu),
        mib(gpu_peak),
        (gpu as f64 - ordinary as f64) * 1024.0 / GPU_PODS as f64
    );
    Ok(())
}
