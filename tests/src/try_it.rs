//! Tessera tried without GPUs: the real single-node Kubernetes of the tests, Tessera installed
//! from its manifests with the binaries built here, and the user guide's examples run on it.
//!
//! A node of fixture cards (an H100x8, then an A100 with MIG instances) stands in for the GPUs,
//! with NVIDIA's real 535 driver files as its driver; the examples under `deploy/examples` run
//! as written but for their image, which is the tests' busybox (no registry here) printing
//! what the container was given. `tessera-try` (`scripts/try.sh`) prints each; the cluster
//! test `the_try_it_command_runs_every_example` runs it in CI.

use std::path::Path;
use std::time::Duration;

use anyhow::Context as _;
use serde::Deserialize as _;
use serde_yaml::Value;

use crate::cluster::{Cluster, tessera};

/// What one container of an example was given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    /// The example's file, under `deploy/examples`.
    pub example: String,
    /// `pod/container`.
    pub container: String,
    /// `CUDA_VISIBLE_DEVICES` as the container saw it.
    pub visible: String,
    /// GPU device nodes in its `/dev`.
    pub device_nodes: u32,
    /// Its share's limits (`30% + 8192 MiB`), when it has a share.
    pub share: Option<String>,
}

/// The examples, in the order they run: the extender's (phase 1, an H100x8 node), DRA's (the
/// node then labelled for DRA), MIG (an A100 in MIG mode).
const EXTENDER: [&str; 3] = ["whole-gpu.yaml", "share-30-8gib.yaml", "two-containers.yaml"];
const DRA: [&str; 2] = ["dra/whole-gpu.yaml", "dra/share-30-4gib.yaml"];
const MIG: [&str; 1] = ["mig-slice.yaml"];

/// What each container runs instead of its image's program.
const PROBE: &str = "echo VISIBLE=$CUDA_VISIBLE_DEVICES; echo DEVICES=$(ls /dev | grep -c '^nvidia[0-9]'); \
                     echo CORE=$TESSERA_GPU_CORE_LIMIT; echo MIB=$TESSERA_GPU_MEMORY_LIMIT_MIB; sleep 3600";

/// A pod's name and its containers' names.
type PodNames = (String, Vec<String>);

/// Example `file` as written, but each container runs the tests' busybox, printing what it was
/// given; returns the YAML and its pods.
fn example(file: &str) -> anyhow::Result<(String, Vec<PodNames>)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/examples")
        .join(file);
    let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    let mut out = Vec::new();
    let mut pods = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let mut v = Value::deserialize(doc).with_context(|| path.display().to_string())?;
        if v["kind"] == "Pod" {
            let name = v["metadata"]["name"].as_str().unwrap_or_default().to_string();
            let mut names = Vec::new();
            for c in v["spec"]["containers"].as_sequence_mut().into_iter().flatten() {
                names.push(c["name"].as_str().unwrap_or_default().to_string());
                c["image"] = "docker.io/tessera/busybox:test".into();
                c["imagePullPolicy"] = "Never".into();
                c["command"] = serde_yaml::to_value(["sh", "-c", PROBE])?;
            }
            pods.push((name, names));
        }
        out.push(serde_yaml::to_string(&v)?);
    }
    Ok((out.join("---\n"), pods))
}

/// Runs `file`'s pods and reads what each container was given.
async fn run_example(c: &Cluster, file: &str, say: &mut dyn FnMut(&str)) -> anyhow::Result<Vec<Seen>> {
    let (yaml, pods) = example(file)?;
    c.apply(&yaml)?;
    let mut seen = Vec::new();
    for (pod, containers) in pods {
        c.wait_for(
            &[&format!("pod/{pod}")],
            "{.status.phase}",
            "Running",
            Duration::from_secs(120),
        )
        .await
        .with_context(|| c.kubectl_ok(&["describe", "pod", &pod]).unwrap_or_default())?;
        for container in containers {
            let mut logs = String::new();
            for _ in 0..300 {
                logs = c.kubectl_ok(&["logs", &pod, "-c", &container]).unwrap_or_default();
                if logs.contains("MIB=") {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let get = |k: &str| {
                logs.lines()
                    .find_map(|l| l.strip_prefix(&format!("{k}=")))
                    .unwrap_or_default()
                    .trim()
                    .to_string()
            };
            let (core, mib) = (get("CORE"), get("MIB"));
            let s = Seen {
                example: file.to_string(),
                container: format!("{pod}/{container}"),
                visible: get("VISIBLE"),
                device_nodes: get("DEVICES").parse().unwrap_or(0),
                share: (!core.is_empty()).then(|| format!("{core}% + {mib} MiB")),
            };
            say(&format!(
                "  {:<28} {:<22} {} device node(s), CUDA_VISIBLE_DEVICES={}{}",
                s.example,
                s.container,
                s.device_nodes,
                s.visible,
                s.share.as_deref().map(|x| format!(", share {x}")).unwrap_or_default()
            ));
            seen.push(s);
        }
    }
    Ok(seen)
}

/// What `kubectl tessera inspect` shows of the cluster.
fn inspect(c: &Cluster) -> anyhow::Result<String> {
    let out = c
        .command(tessera::bin("kubectl-tessera"))
        .args(["inspect", "--kubeconfig"])
        .arg(c.kubeconfig())
        .output()?;
    anyhow::ensure!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Brings the cluster up, installs Tessera, runs every example and reports as it goes through
/// `say`; everything it made is gone when it returns.
pub async fn run(say: &mut dyn FnMut(&str)) -> anyhow::Result<Vec<Seen>> {
    let mut seen = Vec::new();
    say("== a real Kubernetes with an H100x8 fixture node (no GPU needed)");
    let mut c = Cluster::start().await?;
    say(&format!(
        "Kubernetes {} up in {:.0}s",
        c.version(),
        c.started_in().as_secs_f64()
    ));
    tessera::install(&mut c, "h100x8", 800, true).await?;
    say("Tessera installed from deploy/ (extender, scheduler, node agents, DRA driver)");
    say("== through the scheduler extender (tessera.io/* resources)");
    for file in EXTENDER {
        seen.extend(run_example(&c, file, say).await?);
    }
    say("== kubectl tessera inspect");
    say(&inspect(&c)?);
    // A node serves one path at a time: drained of the extender's pods, then given to DRA.
    for file in EXTENDER {
        for (pod, _) in example(file)?.1 {
            c.kubectl_ok(&["delete", "pod", &pod, "--wait=true"])?;
        }
    }
    c.kubectl_ok(&[
        "label",
        "node",
        crate::cluster::NODE,
        &format!("{}=true", tessera_core::names::LABEL_DRA),
    ])?;
    say("== through DRA (the node labelled tessera.io/dra=true)");
    for file in DRA {
        seen.extend(run_example(&c, file, say).await?);
    }
    drop(c);
    say("== a MIG slice (an A100 node in MIG mode)");
    let mut c = Cluster::start().await?;
    tessera::install(&mut c, "a100-mig", 100, false).await?;
    for file in MIG {
        seen.extend(run_example(&c, file, say).await?);
    }
    say("== kubectl tessera inspect");
    say(&inspect(&c)?);
    drop(c);
    say("done: the clusters and everything they made are gone");
    Ok(seen)
}

/// What each example's containers must have been given: one device node, the card (or MIG
/// device) named in `CUDA_VISIBLE_DEVICES`, and the share's limits as the example asks.
const WANTED: [(&str, &str, Option<&str>); 7] = [
    ("train-whole/train", "GPU-", None),
    ("infer-share/infer", "GPU-", Some("30% + 8192 MiB")),
    ("pipeline/encoder", "GPU-", Some("50% + 10240 MiB")),
    ("pipeline/decoder", "GPU-", Some("50% + 10240 MiB")),
    ("dra-whole/train", "GPU-", None),
    ("dra-share/infer", "GPU-", Some("30% + 4096 MiB")),
    ("notebook-mig/notebook", "MIG-", None),
];

/// Whether every example's containers got what they asked for; the error names the first that
/// did not.
pub fn check(seen: &[Seen]) -> Result<(), String> {
    for (container, visible, share) in WANTED {
        let s = seen
            .iter()
            .find(|s| s.container == container)
            .ok_or_else(|| format!("{container} did not run"))?;
        if s.device_nodes != 1 || !s.visible.starts_with(visible) || s.share.as_deref() != share {
            return Err(format!(
                "{container} got {s:?}, not one {visible}... device with share {share:?}"
            ));
        }
    }
    Ok(())
}
