//! The node's GPU metrics (Prometheus text at `/metrics` on `--metrics-listen`): per card what
//! it is, what it uses and what Tessera allocated on it; per container (namespace, pod,
//! container) what it was allocated and what its processes use, found by mapping each GPU
//! process through its cgroup to a container this plugin gave GPUs to. Label sets are small
//! and bounded: cards by index and UUID, containers by the three names and their card.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;
use tessera_core::enforcement::{MpsLayout, ShareEnforcement};
use tessera_core::handoff::AllocatedDevice;
use tessera_node::telemetry::{GpuSample, TelemetrySource, container_of_pid};

use crate::plugin::{TesseraPlugin, Tracked};

type F64Gauge = Gauge<f64, AtomicU64>;

/// Labels of one card.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Card {
    gpu: String,
    uuid: String,
}

/// Labels of the card's description.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CardInfo {
    gpu: String,
    uuid: String,
    model: String,
}

/// Labels of one container on one card.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OnCard {
    namespace: String,
    pod: String,
    container: String,
    gpu: String,
    uuid: String,
}

const MIB: f64 = 1_048_576.0;

/// What the metrics are made of.
pub struct NodeMetrics {
    /// The cards now (`None`: no telemetry on this node; allocations are still reported).
    pub telemetry: Option<Box<dyn TelemetrySource>>,
    /// Where the host's `/proc` is (processes are mapped to containers through it).
    pub proc_root: PathBuf,
    /// The node's share enforcement (MPS daemon state is reported in `mps` mode).
    pub enforcement: ShareEnforcement,
    /// Where the MPS daemons' state is.
    pub mps: MpsLayout,
}

/// What a container holds of one card: (compute ratio, memory MiB).
fn allocated(d: &AllocatedDevice) -> (f64, u64) {
    match d {
        AllocatedDevice::Gpu {
            core_percent,
            memory_mib,
            ..
        } => (f64::from(*core_percent) / 100.0, *memory_mib),
        AllocatedDevice::Mig { .. } => (0.0, 0),
    }
}

/// The series one scrape fills, registered in the order they are exposed.
struct Series {
    up: Gauge<i64>,
    info: Family<CardInfo, Gauge>,
    mem_total: Family<Card, F64Gauge>,
    mem_used: Family<Card, F64Gauge>,
    sm: Family<Card, F64Gauge>,
    alloc_core: Family<Card, F64Gauge>,
    alloc_mem: Family<Card, F64Gauge>,
    unattributed: Family<Card, F64Gauge>,
    healthy: Family<Card, F64Gauge>,
    xids: Family<Card, Counter>,
    mps_ready: Family<Card, F64Gauge>,
    c_alloc_core: Family<OnCard, F64Gauge>,
    c_alloc_mem: Family<OnCard, F64Gauge>,
    c_mem: Family<OnCard, F64Gauge>,
    c_sm: Family<OnCard, F64Gauge>,
}

impl Series {
    /// Registers every series in `reg`.
    fn register(reg: &mut Registry) -> Self {
        let family = |reg: &mut Registry, name: &str, help: &str| {
            let f = Family::<Card, F64Gauge>::default();
            reg.register(name, help, f.clone());
            f
        };
        let up = Gauge::<i64>::default();
        reg.register("telemetry_up", "1 when the GPUs could be read this scrape", up.clone());
        let info = Family::<CardInfo, Gauge>::default();
        reg.register("gpu_info", "The card's model (value 1)", info.clone());
        let mem_total = family(reg, "gpu_memory_total_bytes", "Card memory");
        let mem_used = family(reg, "gpu_memory_used_bytes", "Card memory in use");
        let sm = family(reg, "gpu_sm_utilization_ratio", "Card SM utilization, 0..1");
        let alloc_core = family(
            reg,
            "gpu_allocated_core_ratio",
            "Compute Tessera allocated on the card, in cards (1 = whole)",
        );
        let alloc_mem = family(
            reg,
            "gpu_allocated_memory_bytes",
            "Memory Tessera allocated on the card",
        );
        let unattributed = family(
            reg,
            "gpu_unattributed_memory_bytes",
            "Card memory held by processes of no Tessera container",
        );
        let healthy = family(reg, "gpu_healthy", "1 while the card answers NVML");
        let xids = Family::<Card, Counter>::default();
        reg.register(
            "gpu_xid_errors",
            "Critical XID errors seen since the plugin started",
            xids.clone(),
        );
        let mps_ready = family(
            reg,
            "gpu_mps_daemon_ready",
            "1 while the card's MPS control daemon is ready (mps enforcement only)",
        );
        let c_family = |reg: &mut Registry, name: &str, help: &str| {
            let f = Family::<OnCard, F64Gauge>::default();
            reg.register(name, help, f.clone());
            f
        };
        let c_alloc_core = c_family(
            reg,
            "container_gpu_allocated_core_ratio",
            "Compute allocated to the container on the card",
        );
        let c_alloc_mem = c_family(
            reg,
            "container_gpu_allocated_memory_bytes",
            "Memory allocated to the container on the card",
        );
        let c_mem = c_family(
            reg,
            "container_gpu_memory_used_bytes",
            "Card memory the container's processes hold",
        );
        let c_sm = c_family(
            reg,
            "container_gpu_sm_utilization_ratio",
            "The container's share of the card's SMs, 0..1",
        );
        Self {
            up,
            info,
            mem_total,
            mem_used,
            sm,
            alloc_core,
            alloc_mem,
            unattributed,
            healthy,
            xids,
            mps_ready,
            c_alloc_core,
            c_alloc_mem,
            c_mem,
            c_sm,
        }
    }
}

impl NodeMetrics {
    /// The exposition text for the containers `plugin` tracks now.
    pub fn scrape(&self, plugin: &TesseraPlugin) -> String {
        self.render(&plugin.tracked())
    }

    /// The exposition text for `containers` (container id -> what it was given).
    pub fn render(&self, containers: &HashMap<String, Tracked>) -> String {
        let mut reg = Registry::with_prefix("tessera");
        let series = Series::register(&mut reg);

        let samples: Option<Vec<GpuSample>> = self.telemetry.as_ref().and_then(|t| match t.sample() {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the GPUs for metrics");
                None
            }
        });
        series.up.set(i64::from(samples.is_some()));
        let samples = samples.unwrap_or_default();
        // Card indices from the telemetry, else (no telemetry) from the allocations.
        let mut index_of: HashMap<&str, u32> = containers
            .values()
            .flat_map(|t| &t.devices)
            .map(|d| match d {
                AllocatedDevice::Gpu { uuid, index, .. } => (uuid.as_str(), *index),
                AllocatedDevice::Mig {
                    parent_uuid,
                    parent_index,
                    ..
                } => (parent_uuid.as_str(), *parent_index),
            })
            .collect();
        index_of.extend(samples.iter().map(|s| (s.uuid.as_str(), s.index)));
        let card = |uuid: &str| Card {
            gpu: index_of.get(uuid).map_or_else(String::new, u32::to_string),
            uuid: uuid.to_string(),
        };
        let on_card = |t: &Tracked, uuid: &str| OnCard {
            namespace: t.namespace.clone(),
            pod: t.pod.clone(),
            container: t.container.clone(),
            gpu: index_of.get(uuid).map_or_else(String::new, u32::to_string),
            uuid: uuid.to_string(),
        };
        // Allocations, per card and per container (sorted for a stable order of series).
        let sorted: BTreeMap<&String, &Tracked> = containers.iter().filter(|(_, t)| !t.stopped).collect();
        let mut per_card: BTreeMap<String, (f64, u64)> = BTreeMap::new();
        for t in sorted.values() {
            for d in &t.devices {
                let (core, mem) = allocated(d);
                let e = per_card.entry(d.card_uuid().to_string()).or_default();
                e.0 += core;
                e.1 += mem;
                if matches!(d, AllocatedDevice::Gpu { .. }) {
                    series.c_alloc_core.get_or_create(&on_card(t, d.card_uuid())).set(core);
                    series
                        .c_alloc_mem
                        .get_or_create(&on_card(t, d.card_uuid()))
                        .set(mem as f64 * MIB);
                }
            }
        }
        for s in &samples {
            let k = card(&s.uuid);
            series
                .info
                .get_or_create(&CardInfo {
                    gpu: k.gpu.clone(),
                    uuid: s.uuid.clone(),
                    model: s.model.clone(),
                })
                .set(1);
            series.mem_total.get_or_create(&k).set(s.memory_total_mib as f64 * MIB);
            series.mem_used.get_or_create(&k).set(s.memory_used_mib as f64 * MIB);
            series.sm.get_or_create(&k).set(f64::from(s.sm_percent) / 100.0);
            series.healthy.get_or_create(&k).set(if s.healthy { 1.0 } else { 0.0 });
            series.xids.get_or_create(&k).inc_by(s.xid_errors);
            if self.enforcement == ShareEnforcement::Mps {
                let ready = self.mps.ready(&s.uuid, std::time::SystemTime::now()).is_ok();
                series.mps_ready.get_or_create(&k).set(if ready { 1.0 } else { 0.0 });
            }
            let mut lost = 0u64;
            for p in &s.processes {
                let owner = container_of_pid(&self.proc_root, p.pid, sorted.keys().map(|id| id.as_str()));
                match owner.and_then(|id| sorted.get(&id.to_string()).copied()) {
                    Some(t) => {
                        let l = on_card(t, &s.uuid);
                        let m = series.c_mem.get_or_create(&l);
                        m.set(m.get() + p.memory_mib as f64 * MIB);
                        let u = series.c_sm.get_or_create(&l);
                        u.set(u.get() + f64::from(p.sm_percent) / 100.0);
                    }
                    None => lost += p.memory_mib,
                }
            }
            series.unattributed.get_or_create(&k).set(lost as f64 * MIB);
            per_card.entry(s.uuid.clone()).or_default();
        }
        for (uuid, (core, mem)) in &per_card {
            series.alloc_core.get_or_create(&card(uuid)).set(*core);
            series.alloc_mem.get_or_create(&card(uuid)).set(*mem as f64 * MIB);
        }
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &reg).expect("encoding to a String");
        out
    }
}

/// Serves `/metrics` on `listener` until the process ends.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<NodeMetrics>,
    plugin: Arc<TesseraPlugin>,
) -> anyhow::Result<()> {
    use axum::routing::get;
    let app = axum::Router::new().route(
        "/metrics",
        get(move || {
            let (metrics, plugin) = (metrics.clone(), plugin.clone());
            async move {
                let text = tokio::task::spawn_blocking(move || metrics.scrape(&plugin))
                    .await
                    .unwrap_or_default();
                (
                    [(
                        axum::http::header::CONTENT_TYPE,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    )],
                    text,
                )
            }
        }),
    );
    tracing::info!(listen = %listener.local_addr()?, "serving node GPU metrics at /metrics");
    axum::serve(listener, app).await?;
    Ok(())
}
