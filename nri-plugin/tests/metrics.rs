//! The node's GPU metrics: parsed with a Prometheus parser, for a node with a share, a second
//! share, a whole card and a MIG device in use, GPU processes mapped to their containers
//! through their cgroups (a process of no Tessera container is counted apart), and served over
//! HTTP from a running plugin.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use tessera_core::enforcement::{HookLayout, MpsLayout, ShareEnforcement};
use tessera_core::handoff::{AllocatedDevice, VerifyingKeys};
use tessera_node::telemetry::FixtureTelemetry;
use tessera_nri_plugin::metrics::{NodeMetrics, serve};
use tessera_nri_plugin::plugin::{PluginConfig, TesseraPlugin, Tracked};

const TELEMETRY: &str = "gpus:
  - { index: 0, uuid: GPU-aaaa, model: NVIDIA A100-SXM4-40GB, memory_total_mib: 40960, memory_used_mib: 9300, sm_percent: 55,
      processes: [ { pid: 100, memory_mib: 6000, sm_percent: 25 }, { pid: 101, memory_mib: 3000, sm_percent: 30 } ] }
  - { index: 1, uuid: GPU-bbbb, model: NVIDIA A100-SXM4-40GB, memory_total_mib: 40960, memory_used_mib: 20500, sm_percent: 90,
      healthy: false, xid_errors: 2,
      processes: [ { pid: 102, memory_mib: 20000, sm_percent: 88 }, { pid: 200, memory_mib: 500, sm_percent: 2 } ] }
  - { index: 2, uuid: GPU-cccc, model: NVIDIA A100-SXM4-40GB, memory_total_mib: 40960, memory_used_mib: 4000, sm_percent: 10,
      processes: [ { pid: 103, memory_mib: 4000, sm_percent: 10 } ] }
";

fn gpu(uuid: &str, index: u32, core_percent: u32, memory_mib: u64, exclusive: bool) -> AllocatedDevice {
    AllocatedDevice::Gpu {
        uuid: uuid.into(),
        index,
        minor: index,
        core_percent,
        memory_mib,
        exclusive,
    }
}

fn tracked(pod: &str, devices: Vec<AllocatedDevice>) -> Tracked {
    Tracked {
        uuids: String::new(),
        namespace: "team-a".into(),
        pod: pod.into(),
        container: "main".into(),
        devices,
        ..Default::default()
    }
}

fn cgroup(proc_root: &Path, pid: u32, container_id: &str) {
    let dir = proc_root.join(pid.to_string());
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("cgroup"),
        format!("0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-{container_id}.scope\n"),
    )
    .unwrap();
}

fn value(samples: &[prometheus_parse::Sample], metric: &str, labels: &[(&str, &str)]) -> Option<f64> {
    samples
        .iter()
        .find(|s| s.metric == metric && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .map(|s| match s.value {
            // (OpenMetrics counters' `_total` samples parse as untyped.)
            prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v)
            | prometheus_parse::Value::Counter(v) => v,
            ref other => panic!("{metric}: {other:?}"),
        })
}

#[test]
fn metrics_parse_and_attribute_use_to_containers() {
    let dir = tempfile::tempdir().unwrap();
    let proc_root = dir.path().join("proc");
    let telemetry = dir.path().join("telemetry.yaml");
    std::fs::write(&telemetry, TELEMETRY).unwrap();
    for (pid, id) in [(100, "c-share-a"), (101, "c-share-b"), (102, "c-whole"), (103, "c-mig")] {
        cgroup(&proc_root, pid, id);
    }
    std::fs::create_dir_all(proc_root.join("200")).unwrap();
    std::fs::write(proc_root.join("200/cgroup"), "0::/system.slice/dcgm.service\n").unwrap();
    let containers: HashMap<String, Tracked> = [
        (
            "c-share-a",
            tracked("infer-a", vec![gpu("GPU-aaaa", 0, 30, 8192, false)]),
        ),
        (
            "c-share-b",
            tracked("infer-b", vec![gpu("GPU-aaaa", 0, 50, 4096, false)]),
        ),
        ("c-whole", tracked("train", vec![gpu("GPU-bbbb", 1, 100, 40960, true)])),
        // An init container that finished: stopped, not removed, holds nothing.
        (
            "c-init",
            Tracked {
                stopped: true,
                ..tracked("infer-a", vec![gpu("GPU-aaaa", 0, 20, 2048, false)])
            },
        ),
        (
            "c-mig",
            tracked(
                "mig",
                vec![AllocatedDevice::Mig {
                    uuid: "MIG-1".into(),
                    profile: "1g.5gb".parse().unwrap(),
                    parent_uuid: "GPU-cccc".into(),
                    parent_index: 2,
                    gi: 7,
                    ci: 0,
                }],
            ),
        ),
    ]
    .into_iter()
    .map(|(id, t)| (id.to_string(), t))
    .collect();
    let m = NodeMetrics {
        telemetry: Some(Box::new(FixtureTelemetry { path: telemetry })),
        proc_root,
        enforcement: ShareEnforcement::None,
        mps: MpsLayout::default(),
    };
    let text = m.render(&containers);
    let lines = text.lines().map(|l| Ok(l.to_string()));
    let parsed = prometheus_parse::Scrape::parse(lines).expect("Prometheus text");
    let s = &parsed.samples;
    let mib = 1_048_576.0;
    let g0 = [("gpu", "0"), ("uuid", "GPU-aaaa")];
    assert_eq!(value(s, "tessera_telemetry_up", &[]), Some(1.0));
    assert_eq!(
        value(
            s,
            "tessera_gpu_info",
            &[("gpu", "1"), ("model", "NVIDIA A100-SXM4-40GB")]
        ),
        Some(1.0)
    );
    assert_eq!(value(s, "tessera_gpu_memory_total_bytes", &g0), Some(40960.0 * mib));
    assert_eq!(value(s, "tessera_gpu_memory_used_bytes", &g0), Some(9300.0 * mib));
    assert_eq!(value(s, "tessera_gpu_sm_utilization_ratio", &g0), Some(0.55));
    assert_eq!(value(s, "tessera_gpu_healthy", &g0), Some(1.0));
    assert_eq!(value(s, "tessera_gpu_healthy", &[("gpu", "1")]), Some(0.0));
    assert_eq!(value(s, "tessera_gpu_xid_errors_total", &[("gpu", "1")]), Some(2.0));
    assert_eq!(value(s, "tessera_gpu_allocated_core_ratio", &g0), Some(0.8));
    assert_eq!(value(s, "tessera_gpu_allocated_memory_bytes", &g0), Some(12288.0 * mib));
    assert_eq!(value(s, "tessera_gpu_allocated_core_ratio", &[("gpu", "1")]), Some(1.0));
    assert_eq!(
        value(s, "tessera_gpu_unattributed_memory_bytes", &[("gpu", "1")]),
        Some(500.0 * mib)
    );
    assert_eq!(value(s, "tessera_gpu_unattributed_memory_bytes", &g0), Some(0.0));
    let a = [
        ("namespace", "team-a"),
        ("pod", "infer-a"),
        ("container", "main"),
        ("gpu", "0"),
    ];
    assert_eq!(value(s, "tessera_container_gpu_allocated_core_ratio", &a), Some(0.3));
    assert_eq!(
        value(s, "tessera_container_gpu_allocated_memory_bytes", &a),
        Some(8192.0 * mib)
    );
    assert_eq!(
        value(s, "tessera_container_gpu_memory_used_bytes", &a),
        Some(6000.0 * mib)
    );
    assert_eq!(value(s, "tessera_container_gpu_sm_utilization_ratio", &a), Some(0.25));
    let whole = [("pod", "train"), ("gpu", "1")];
    assert_eq!(
        value(s, "tessera_container_gpu_memory_used_bytes", &whole),
        Some(20000.0 * mib)
    );
    assert_eq!(
        value(s, "tessera_container_gpu_sm_utilization_ratio", &whole),
        Some(0.88)
    );
    // The MIG container's process is on its parent card, attributed to it.
    let mig = [("pod", "mig"), ("gpu", "2"), ("uuid", "GPU-cccc")];
    assert_eq!(
        value(s, "tessera_container_gpu_memory_used_bytes", &mig),
        Some(4000.0 * mib)
    );
    // No MPS series outside mps mode; bounded label sets.
    assert!(!text.contains("mps_daemon_ready{"), "{text}");
    for sample in s {
        assert!(sample.labels.iter().count() <= 5, "{sample:?}");
    }

    // Telemetry unreadable: allocations still reported, telemetry_up 0.
    let broken = NodeMetrics {
        telemetry: Some(Box::new(FixtureTelemetry {
            path: dir.path().join("missing.yaml"),
        })),
        proc_root: dir.path().join("proc"),
        enforcement: ShareEnforcement::None,
        mps: MpsLayout::default(),
    };
    let text = broken.render(&containers);
    let parsed = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).unwrap();
    assert_eq!(value(&parsed.samples, "tessera_telemetry_up", &[]), Some(0.0));
    assert_eq!(
        value(
            &parsed.samples,
            "tessera_gpu_allocated_core_ratio",
            &[("gpu", "0"), ("uuid", "GPU-aaaa")]
        ),
        Some(0.8),
        "the card's index from the allocation when there is no telemetry"
    );
}

#[tokio::test]
async fn a_running_plugin_serves_them_over_http() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let keys = dir.path().join("keys");
    std::fs::create_dir_all(&keys)?;
    std::fs::write(keys.join("active"), "k1")?;
    std::fs::write(keys.join("k1"), [1u8; 32])?;
    let telemetry = dir.path().join("telemetry.yaml");
    std::fs::write(&telemetry, TELEMETRY)?;
    let plugin = Arc::new(TesseraPlugin::new(PluginConfig {
        node: "n".into(),
        keys: VerifyingKeys::from_dir(&keys)?,
        cdi_dirs: vec![],
        enforcement: ShareEnforcement::Mps,
        mps: MpsLayout::new(dir.path().join("mps")),
        hook: HookLayout::default(),
        claims: Default::default(),
    }));
    let metrics = Arc::new(NodeMetrics {
        telemetry: Some(Box::new(FixtureTelemetry { path: telemetry })),
        proc_root: dir.path().join("proc"),
        enforcement: ShareEnforcement::Mps,
        mps: MpsLayout::new(dir.path().join("mps")),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(serve(listener, metrics, plugin));
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: n\r\nConnection: close\r\n\r\n")
        .await?;
    let mut reply = String::new();
    s.read_to_string(&mut reply).await?;
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    assert!(reply.contains("content-type: application/openmetrics-text"), "{reply}");
    // MPS mode: each card's daemon state (no supervisor here: not ready).
    assert!(
        reply.contains("tessera_gpu_mps_daemon_ready{gpu=\"0\",uuid=\"GPU-aaaa\"} 0"),
        "{reply}"
    );
    Ok(())
}

/// The Grafana dashboard (deploy/grafana/tessera-gpus.json) is valid JSON and every metric its
/// queries use is a family the node serves.
#[test]
fn the_dashboard_uses_only_served_metrics() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/grafana/tessera-gpus.json");
    let dash: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let telemetry = dir.path().join("t.yaml");
    std::fs::write(&telemetry, TELEMETRY).unwrap();
    // One process in a Tessera container, so the per-container use families are present.
    cgroup(dir.path(), 100, "c");
    let served = NodeMetrics {
        telemetry: Some(Box::new(FixtureTelemetry { path: telemetry })),
        proc_root: dir.path().to_path_buf(),
        enforcement: ShareEnforcement::Mps,
        mps: MpsLayout::new(dir.path()),
    }
    .render(&HashMap::from([(
        "c".to_string(),
        tracked("p", vec![gpu("GPU-aaaa", 0, 30, 1024, false)]),
    )]));
    let mut used = 0;
    for panel in dash["panels"].as_array().unwrap() {
        for t in panel["targets"].as_array().unwrap() {
            let expr = t["expr"].as_str().unwrap();
            for name in expr
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|w| w.starts_with("tessera_"))
            {
                used += 1;
                assert!(
                    served.lines().any(|l| l.starts_with(&format!("# TYPE {name} "))),
                    "panel {:?} uses {name}, which the node does not serve",
                    panel["title"]
                );
            }
        }
    }
    assert!(used >= 10, "{used}");
}
