//! The extender over HTTP on a 5,000-node x 8-GPU cluster that is half full (fake API server,
//! same process): filter + prioritize round trip for one GPU pod with `NodeNames` of all 5,000
//! nodes, against the same round trip for a pod without GPUs (HTTP and JSON cost only), and
//! binds per second with 4 concurrent clients. Run: `cargo bench -p tessera-tests --bench extender_http`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::json;
use tessera_core::handoff::{AllocatedDevice, Allocation, ContainerAllocation};
use tessera_core::inventory::{FixtureSource, InventorySource};
use tessera_core::names::{ANNOTATION_ALLOCATION, ANNOTATION_ALLOCATION_SIGNATURE};
use tessera_core::placement::Rng;
use tessera_core::request::ContainerRole;
use tessera_extender::service::wire::{ExtenderFilterResult, HostPriority};
use tessera_tests::apiserver::FakeApiServer;
use tessera_tests::gpu_cluster::{
    PREFIX, ReplicaOptions, gpu_node, keys, pod, scheduler_json, share_pod, start_replica,
};
use tessera_tests::http::JsonClient;

const NODES: usize = 5000;
const ROUND_TRIPS: usize = 200;
const BINDS: usize = 2000;

fn quantile(v: &mut [Duration], q: f64) -> Duration {
    v.sort();
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// Seconds the extender itself spent in filter + prioritize so far (from its own metrics).
async fn server_seconds(http: &mut JsonClient) -> anyhow::Result<f64> {
    let (_, body) = http.request("/metrics", None).await?;
    let text = String::from_utf8(body)?;
    let mut total = 0.0;
    for verb in ["filter", "prioritize"] {
        let key = format!("tessera_extender_request_duration_seconds_sum{{verb=\"{verb}\"}} ");
        if let Some(line) = text.lines().find(|l| l.starts_with(&key)) {
            total += line[key.len()..].trim().parse::<f64>()?;
        }
    }
    Ok(total)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// One pod per node holding about half of its compute: idle, full and partly used cards.
fn fill(api: &FakeApiServer, rng: &mut Rng) -> anyhow::Result<()> {
    let inv = FixtureSource {
        fixture: "h100x8".into(),
        driver_root: None,
    }
    .discover()?;
    let keys = keys();
    for n in 0..NODES {
        let node = format!("n{n:04}");
        let uid = format!("uid-fill-{n}");
        let devices: Vec<AllocatedDevice> = inv
            .gpus
            .iter()
            .filter_map(|g| {
                let core = match rng.below(4) {
                    0 => return None,
                    1 => 100,
                    _ => 10 * (1 + rng.below(9) as u32),
                };
                Some(AllocatedDevice::share(g, core, g.memory_mib * u64::from(core) / 100))
            })
            .collect();
        if devices.is_empty() {
            continue;
        }
        let mut a = Allocation::new(&node, &uid);
        a.containers.push(ContainerAllocation {
            name: "main".into(),
            role: ContainerRole::App,
            devices: devices.clone(),
        });
        let s = keys.sign(&a);
        // The spec's shape (what the workload learner sees) follows the first device.
        let first = match &devices[0] {
            AllocatedDevice::Gpu { core_percent, .. } => *core_percent,
            AllocatedDevice::Mig { .. } => unreachable!(),
        };
        let mut p = share_pod(&format!("fill-{n}"), first, 1);
        p.metadata.uid = Some(uid);
        p.metadata.annotations = Some(BTreeMap::from([
            (ANNOTATION_ALLOCATION.to_string(), s.allocation),
            (ANNOTATION_ALLOCATION_SIGNATURE.to_string(), s.signature),
        ]));
        p.spec.as_mut().unwrap().node_name = Some(node);
        api.create_pod(&p)?;
    }
    Ok(())
}

/// The request body as kube-scheduler builds it.
#[derive(serde::Serialize)]
#[serde(rename_all = "PascalCase")]
struct Args<'a> {
    pod: &'a serde_json::Value,
    nodes: Option<()>,
    node_names: &'a [String],
}

/// Filter, then prioritize the nodes that passed, as the scheduler does; replies are parsed
/// into the wire types (a typed client, like the scheduler's).
async fn round_trips(
    http: &mut JsonClient,
    pods: &[serde_json::Value],
    names: &[String],
) -> anyhow::Result<Vec<Duration>> {
    let mut out = Vec::with_capacity(ROUND_TRIPS);
    for i in 0..ROUND_TRIPS + 10 {
        let pod = &pods[i % pods.len()];
        let t = Instant::now();
        let body = serde_json::to_vec(&Args {
            pod,
            nodes: None,
            node_names: names,
        })?;
        let (s1, f) = http.request(&format!("{PREFIX}/filter"), Some(body)).await?;
        let f: ExtenderFilterResult = serde_json::from_slice(&f)?;
        let fit = f.node_names.unwrap_or_default();
        let body = serde_json::to_vec(&Args {
            pod,
            nodes: None,
            node_names: &fit,
        })?;
        let (s2, p) = http.request(&format!("{PREFIX}/prioritize"), Some(body)).await?;
        let scores: Vec<HostPriority> = serde_json::from_slice(&p)?;
        anyhow::ensure!(s1 == 200 && s2 == 200, "filter {s1}, prioritize {s2}");
        std::hint::black_box(scores);
        if i >= 10 {
            out.push(t.elapsed());
        }
    }
    Ok(out)
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> anyhow::Result<()> {
    let api = FakeApiServer::start().await?;
    for n in 0..NODES {
        api.create_node(&gpu_node(&format!("n{n:04}"), "h100x8"))?;
    }
    fill(&api, &mut Rng::new(7))?;
    let t = Instant::now();
    let mut r = start_replica(&api, ReplicaOptions::default()).await?;
    println!(
        "extender synced {NODES} nodes and their pods in {:.0} ms",
        ms(t.elapsed())
    );
    let names: Vec<String> = (0..NODES).map(|n| format!("n{n:04}")).collect();

    let gpu = api.create_pod(&share_pod("bench", 30, 8))?;
    let cpu = api.create_pod(&pod("web", &[("main", &[("cpu", "1")])]))?;
    let s0 = server_seconds(&mut r.http).await?;
    let mut base = round_trips(&mut r.http, &[scheduler_json(&cpu)], &names).await?;
    let s1 = server_seconds(&mut r.http).await?;
    let mut gpu_rt = round_trips(&mut r.http, &[scheduler_json(&gpu)], &names).await?;
    let s2 = server_seconds(&mut r.http).await?;
    let runs = (ROUND_TRIPS + 10) as f64;
    let (server_base, server_gpu) = ((s1 - s0) / runs * 1e3, (s2 - s1) / runs * 1e3);
    // Every request a pod shape not seen before (memoised node verdicts do not apply).
    let shapes: Vec<serde_json::Value> = (0..ROUND_TRIPS + 10)
        .map(|i| {
            scheduler_json(&share_pod(
                &format!("shape-{i}"),
                5 + (i % 90) as u32,
                1 + (i / 90) as u32,
            ))
        })
        .collect();
    let mut cold = round_trips(&mut r.http, &shapes, &names).await?;
    let (b50, b99) = (quantile(&mut base, 0.5), quantile(&mut base, 0.99));
    let (g50, g99) = (quantile(&mut gpu_rt, 0.5), quantile(&mut gpu_rt, 0.99));
    println!("filter+prioritize round trip, NodeNames={NODES}, {ROUND_TRIPS} runs:");
    println!(
        "  inside the extender (its metrics, mean): {server_base:.2} ms without GPUs, {server_gpu:.2} ms GPU share"
    );
    println!(
        "  pod without GPUs (HTTP+JSON baseline): median {:.2} ms, p99 {:.2} ms",
        ms(b50),
        ms(b99)
    );
    let (c50, c99) = (quantile(&mut cold, 0.5), quantile(&mut cold, 0.99));
    println!(
        "  a new pod shape every request:         median {:.2} ms, p99 {:.2} ms  (ratio to baseline {:.2} / {:.2})",
        ms(c50),
        ms(c99),
        c50.as_secs_f64() / b50.as_secs_f64(),
        c99.as_secs_f64() / b99.as_secs_f64()
    );
    println!(
        "  GPU share pod (30% + 8 GiB):           median {:.2} ms, p99 {:.2} ms  (ratio to baseline {:.2} / {:.2})",
        ms(g50),
        ms(g99),
        g50.as_secs_f64() / b50.as_secs_f64(),
        g99.as_secs_f64() / b99.as_secs_f64()
    );

    // The same decision without HTTP: the engine's share of the round trip.
    let cluster = r.running.service.cluster.clone();
    let ask = cluster.ask(&gpu)?;
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let mut engine = Vec::new();
    for _ in 0..ROUND_TRIPS {
        let t = Instant::now();
        let out = cluster.filter(&ask, &refs);
        engine.push(t.elapsed());
        anyhow::ensure!(out.fits.len() + out.failed.len() + out.unresolvable.len() == NODES);
    }
    let mut engine_cold = Vec::new();
    for (i, shape) in shapes.iter().enumerate() {
        let p: k8s_openapi::api::core::v1::Pod = serde_json::from_value(shape.clone())?;
        let mut ask = cluster.ask(&p)?;
        // A shape no earlier request had.
        ask.demand.cpu_milli += 1 + i as u64;
        let t = Instant::now();
        std::hint::black_box(cluster.filter(&ask, &refs));
        engine_cold.push(t.elapsed());
    }
    println!(
        "  engine only, one filter of {NODES} nodes, new shape: median {:.2} ms, p99 {:.2} ms",
        ms(quantile(&mut engine_cold, 0.5)),
        ms(quantile(&mut engine_cold, 0.99))
    );
    println!(
        "  engine only, one filter of {NODES} nodes: median {:.2} ms, p99 {:.2} ms",
        ms(quantile(&mut engine, 0.5)),
        ms(quantile(&mut engine, 0.99))
    );

    // Binds: 4 clients, each its own connection, round-robin over the nodes.
    let pods: Vec<_> = (0..BINDS)
        .map(|i| api.create_pod(&share_pod(&format!("b{i}"), 20, 4)))
        .collect::<anyhow::Result<_>>()?;
    let addr = r.running.addr;
    let t = Instant::now();
    let tasks: Vec<_> = (0..4)
        .map(|c| {
            let mine: Vec<_> = pods.iter().skip(c).step_by(4).cloned().collect();
            tokio::spawn(async move {
                let mut http = JsonClient::new(addr);
                let mut lat = Vec::new();
                let mut failed = 0;
                for (i, p) in mine.iter().enumerate() {
                    let node = format!("n{:04}", (i * 4 + c) % NODES);
                    let args = json!({"PodName": p.metadata.name, "PodNamespace": "default",
                                      "PodUID": p.metadata.uid, "Node": node});
                    let t = Instant::now();
                    let (_, reply) = http.post_json(&format!("{PREFIX}/bind"), &args).await?;
                    lat.push(t.elapsed());
                    if reply["Error"] != "" {
                        failed += 1;
                    }
                }
                anyhow::Ok((lat, failed))
            })
        })
        .collect();
    let mut lat = Vec::new();
    let mut failed = 0;
    for task in tasks {
        let (l, f) = task.await??;
        lat.extend(l);
        failed += f;
    }
    let wall = t.elapsed();
    println!(
        "binds, 4 concurrent clients: {BINDS} in {:.0} ms = {:.0} binds/s; median {:.2} ms, p99 {:.2} ms; {failed} did not fit",
        ms(wall),
        BINDS as f64 / wall.as_secs_f64(),
        ms(quantile(&mut lat, 0.5)),
        ms(quantile(&mut lat, 0.99))
    );
    Ok(())
}
