//! `tessera-gpu-cluster`: Tessera on a real Kubernetes on the GPU machine, case by case, as a
//! table. Run by `tests/gpu/run.sh` (its cluster part); see that script.
//!
//! The cluster is the tests' own (`tessera_tests::cluster`: v1.36.2's API server, scheduler,
//! controllers and kubelet, etcd, containerd 2.x with NRI and CDI, in a network namespace of its
//! own), Tessera installed from its manifests with the node agents reading the card through
//! NVML. Pods go through the real scheduler and Tessera's extender, the kubelet's device-plugin
//! `Allocate` and DRA `NodePrepareResources`, and run the CUDA probe: what each container got is
//! judged against the whole card measured on the same cluster. Twice: shares enforced by MPS,
//! then by the hook (a fresh cluster each, as a chart value would install it). With `--dry-run`
//! the node is an H100x8 fixture with NVIDIA's real 535 files, MPS a stand-in daemon and the
//! probe a shell script: the plumbing, not CUDA.

#[path = "report.rs"]
mod report;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use report::{Baseline, Row, Verdict, judge_hook, judge_share, num, parse, pass, summary, table};
use serde_json::{Value, json};
use tessera_core::enforcement::ShareEnforcement;
use tessera_core::inventory::{FixtureSource, InventorySource, NodeInventory, PublishedInventory};
use tessera_core::names::{ANNOTATION_INVENTORY, LABEL_DRA};
use tessera_tests::cluster::tessera::{self, Gpus, Setup};
use tessera_tests::cluster::{Cluster, NODE};

const PROBE_IMAGE: &str = "docker.io/tessera/probe:gpu";
/// The fixture node of a dry run.
const FIXTURE: &str = "h100x8";

/// Tessera on a real Kubernetes on a GPU (or, with --dry-run, on a fixture node), printed as a
/// table.
#[derive(clap::Parser)]
#[command(name = "tessera-gpu-cluster", version)]
struct Args {
    /// The CUDA probe's OCI image (a tarball).
    #[arg(long)]
    probe_image: PathBuf,
    /// Tessera's CUDA hook, as the node installs it (hook and MPS modes).
    #[arg(long)]
    hook_library: PathBuf,
    /// No GPU: a fake MPS control program (this file) stands in for the driver's.
    #[arg(long = "dry-run", value_name = "FAKE_MPS_CONTROL")]
    fake_mps_control: Option<PathBuf>,
    /// Rounds of pod starts (a plain pod and a share pod each, interleaved).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=50))]
    rounds: u32,
    /// Also write the table to this file.
    #[arg(long)]
    out: Option<PathBuf>,
}

impl Args {
    fn dry_run(&self) -> bool {
        self.fake_mps_control.is_some()
    }
}

/// One mode's cluster and what its rows need.
struct Phase<'a> {
    a: &'a Args,
    c: Cluster,
    label: String,
    mode: ShareEnforcement,
    base: Baseline,
    rows: Vec<Row>,
}

impl Phase<'_> {
    fn row(&mut self, case: &'static str, expected: impl Into<String>, observed: String, verdict: Verdict) {
        println!("{} | {case} | {observed}", self.label);
        self.rows.push(Row {
            runtime: self.label.clone(),
            case,
            expected: expected.into(),
            observed,
            verdict,
        });
    }

    /// Runs `pod` to its end and returns each container's output (or why it did not run).
    async fn run(&self, pod: &Value) -> Result<Vec<(String, String)>, String> {
        let name = pod["metadata"]["name"].as_str().unwrap_or_default().to_string();
        self.c.apply(&pod.to_string()).map_err(|e| format!("{e:#}"))?;
        let ended = ended(&self.c, &name, Duration::from_secs(180)).await;
        let mut out = Vec::new();
        for c in pod["spec"]["containers"].as_array().into_iter().flatten() {
            let cname = c["name"].as_str().unwrap_or_default();
            let logs = self.c.kubectl_ok(&["logs", &name, "-c", cname]).unwrap_or_default();
            out.push((cname.to_string(), logs));
        }
        let r = match ended {
            Ok(phase) if phase == "Succeeded" => Ok(out),
            Ok(phase) => Err(format!("pod {name} {phase}: {out:?}")),
            // What the pod went through (its events), before it goes.
            Err(e) => Err(format!(
                "{e:#}: {}",
                self.c
                    .kubectl_ok(&["describe", "pod", &name])
                    .unwrap_or_default()
                    .lines()
                    .rev()
                    .take(8)
                    .collect::<Vec<_>>()
                    .join(" / ")
            )),
        };
        let _ = self.c.kubectl(&["delete", "pod", &name, "--wait=true"]);
        r
    }

    /// A share's output judged in this phase's mode.
    fn judge(&self, kv: &BTreeMap<String, String>, percent: f64, mib: f64) -> (bool, String) {
        match self.mode {
            ShareEnforcement::Hook => judge_hook(self.a.dry_run(), kv, self.base, percent, mib),
            _ => judge_share(self.a.dry_run(), kv, self.base, None, percent, mib),
        }
    }
}

/// Waits for `pod` to end; returns its phase.
async fn ended(c: &Cluster, pod: &str, within: Duration) -> anyhow::Result<String> {
    let deadline = Instant::now() + within;
    loop {
        let phase = c
            .kubectl_ok(&["get", "pod", pod, "-o", "jsonpath={.status.phase}"])
            .unwrap_or_default();
        if phase == "Succeeded" || phase == "Failed" {
            return Ok(phase);
        }
        anyhow::ensure!(Instant::now() < deadline, "pod {pod} is {phase:?} after {within:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// A pod of the probe image; `scheduler` the tessera scheduler's pods (the extender's), none for
/// DRA's (the default scheduler); `claims` (name, ResourceClaim or template, is a template).
fn pod(name: &str, tessera_scheduler: bool, claims: &[(&str, &str, bool)], containers: Vec<Value>) -> Value {
    let mut p = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 2, "containers": containers},
    });
    if tessera_scheduler {
        p["spec"]["schedulerName"] = "tessera".into();
    }
    if !claims.is_empty() {
        p["spec"]["resourceClaims"] = claims
            .iter()
            .map(|(n, claim, template)| {
                let key = if *template {
                    "resourceClaimTemplateName"
                } else {
                    "resourceClaimName"
                };
                json!({"name": n, key: claim})
            })
            .collect();
    }
    p
}

/// A container running `cmd` (a shell line) with `tessera.io/*` limits or a claim.
fn container(name: &str, cmd: &str, limits: &[(&str, &str)], claim: Option<&str>) -> Value {
    let mut c = json!({
        "name": name,
        "image": PROBE_IMAGE,
        "imagePullPolicy": "Never",
        "command": ["sh", "-c", cmd],
    });
    if !limits.is_empty() {
        let l: serde_json::Map<String, Value> = limits
            .iter()
            .map(|(k, v)| (format!("tessera.io/{k}"), Value::from(*v)))
            .collect();
        c["resources"] = json!({ "limits": l });
    }
    if let Some(claim) = claim {
        c["resources"] = json!({"claims": [{"name": claim}]});
    }
    c
}

/// The cards this machine has: NVML's view (what `nvidia-smi` lists), or the fixture's dry.
fn local_gpus(a: &Args) -> anyhow::Result<NodeInventory> {
    if a.dry_run() {
        Ok(FixtureSource::new(FIXTURE).discover()?)
    } else {
        Ok(tessera_node::inventory::NvmlSource::default()
            .discover()
            .context("reading the GPUs through NVML")?)
    }
}

/// `nvidia-smi`'s cards as (uuid, name, MiB); the fixture's dry.
fn smi_cards(a: &Args, inv: &NodeInventory) -> anyhow::Result<Vec<(String, String, u64)>> {
    if a.dry_run() {
        return Ok(inv
            .gpus
            .iter()
            .map(|g| (g.uuid.clone(), g.model.clone(), g.memory_mib))
            .collect());
    }
    let out = Command::new("nvidia-smi")
        .args(["--query-gpu=uuid,name,memory.total", "--format=csv,noheader,nounits"])
        .output()
        .context("running nvidia-smi")?;
    anyhow::ensure!(
        out.status.success(),
        "nvidia-smi: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split(',').map(str::trim).collect();
            anyhow::ensure!(f.len() == 3, "nvidia-smi printed {l:?}");
            Ok((f[0].to_string(), f[1].to_string(), f[2].parse()?))
        })
        .collect()
}

/// The inventory the node published matches nvidia-smi: the same cards, names and memory.
fn inventory_row(p: &mut Phase<'_>, inv: &NodeInventory) -> anyhow::Result<()> {
    let want = smi_cards(p.a, inv)?;
    let node: Value = serde_json::from_str(&p.c.kubectl_ok(&["get", "node", NODE, "-o", "json"])?)?;
    let published = node["metadata"]["annotations"][ANNOTATION_INVENTORY]
        .as_str()
        .context("the node published no inventory")?;
    let published = PublishedInventory::decode(published)?;
    let got: Vec<(String, String, u64)> = published
        .gpus
        .iter()
        .map(|g| (g.uuid.clone(), g.model.clone(), g.memory_mib))
        .collect();
    let mode = published.gpus.iter().map(|g| g.compute_mode).collect::<Vec<_>>();
    let observed = format!(
        "{} card(s) {:?}; driver {}; shares by {}; compute modes {mode:?}",
        got.len(),
        got,
        published.driver_version,
        published.share_enforcement
    );
    let ok = got == want && published.share_enforcement == p.mode;
    p.row(
        "published inventory",
        format!("the cards nvidia-smi lists ({}), shares by {}", want.len(), p.mode),
        observed,
        pass(ok),
    );
    Ok(())
}

/// The whole card through the extender: the baseline of every share row after it.
async fn whole_card(p: &mut Phase<'_>, inv: &NodeInventory) {
    let cmd = "exec /probe --bench-ms 3000";
    let whole = pod(
        "whole",
        true,
        &[],
        vec![container("main", cmd, &[("gpu-core", "100")], None)],
    );
    let (verdict, observed) = match p.run(&whole).await {
        Ok(out) => {
            let kv = parse(&out[0].1);
            p.base = Baseline {
                sms: num(&kv, "sms"),
                rate: num(&kv, "kernels_per_s"),
            };
            let ok = kv.get("devices").map(String::as_str) == Some("1") && !kv.contains_key("mps_threads");
            (pass(ok), summary(&kv))
        }
        Err(e) => (Verdict::Fail, e),
    };
    let gpu = &inv.gpus[0];
    let expected = format!("1 device ({}), all SMs, {} MiB, no MPS", gpu.model, gpu.memory_mib);
    p.row("whole card (tessera.io/gpu-core: 100)", expected, observed, verdict);
}

/// Shares through the extender: one 30% + 8 GiB container, then a pod of two 50% + 10 GiB.
async fn shares(p: &mut Phase<'_>) {
    let cmd = "exec /probe --alloc-gib 20 --bench-ms 3000 --fill";
    let one = pod(
        "share",
        true,
        &[],
        vec![container("main", cmd, &[("gpu-core", "30"), ("gpu-memory", "8")], None)],
    );
    let (verdict, observed) = match p.run(&one).await {
        Ok(out) => {
            let (ok, o) = p.judge(&parse(&out[0].1), 30.0, 8192.0);
            (pass(ok), o)
        }
        Err(e) => (Verdict::Fail, e),
    };
    p.row(
        "30% + 8 GiB share pod",
        "~30% of the card, <= 8 GiB allocatable, 20 GiB cudaMalloc fails",
        observed,
        verdict,
    );
    let limits = [("gpu-core", "50"), ("gpu-memory", "10")];
    let two = pod(
        "two",
        true,
        &[],
        vec![
            container("encoder", cmd, &limits, None),
            container("decoder", cmd, &limits, None),
        ],
    );
    let (verdict, observed) = match p.run(&two).await {
        Ok(out) => {
            let judged: Vec<(bool, String)> = out.iter().map(|(_, o)| p.judge(&parse(o), 50.0, 10240.0)).collect();
            let observed = judged.iter().map(|(_, o)| o.as_str()).collect::<Vec<_>>().join(" | ");
            (pass(judged.iter().all(|(ok, _)| *ok)), observed)
        }
        Err(e) => (Verdict::Fail, e),
    };
    p.row(
        "two containers of 50% + 10 GiB",
        "each ~50% of the card and <= 10 GiB allocatable, side by side",
        observed,
        verdict,
    );
}

/// Seconds from `kubectl apply` to the pod Running (`kubectl wait` watches for it), then the
/// pod deleted.
fn start_secs(c: &Cluster, pod: &Value) -> anyhow::Result<f64> {
    let name = pod["metadata"]["name"].as_str().unwrap_or_default();
    let t = Instant::now();
    c.apply(&pod.to_string())?;
    c.kubectl_ok(&[
        "wait",
        "--for=jsonpath={.status.phase}=Running",
        &format!("pod/{name}"),
        "--timeout=120s",
    ])?;
    let secs = t.elapsed().as_secs_f64();
    if secs > 10.0 {
        // A slow start says why (what the scheduler and the kubelet did meanwhile).
        let events = c
            .kubectl_ok(&[
                "get",
                "events",
                "--field-selector",
                &format!("involvedObject.name={name}"),
            ])
            .unwrap_or_default();
        eprintln!("pod {name} took {secs:.1}s to run:\n{events}");
    }
    c.kubectl_ok(&["delete", "pod", name, "--wait=true"])?;
    Ok(secs)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Pod start, Pending to Running: a 30% + 8 GiB share pod against the same pod without GPUs,
/// both through the tessera scheduler, in interleaved rounds (which goes first alternates).
fn pod_start_row(p: &mut Phase<'_>) {
    // Both end at once on SIGTERM (a shell as PID 1 ignores it otherwise).
    let cmd = "trap 'exit 0' TERM; sleep 3600 & wait";
    let plain = |i: u32| {
        pod(
            &format!("plain-{i}"),
            true,
            &[],
            vec![container("main", cmd, &[], None)],
        )
    };
    let share = |i: u32| {
        let limits = [("gpu-core", "30"), ("gpu-memory", "8")];
        pod(
            &format!("timed-share-{i}"),
            true,
            &[],
            vec![container("main", cmd, &limits, None)],
        )
    };
    let (mut plains, mut shares, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    let mut failed = None;
    for i in 0..p.a.rounds {
        let (first, second) = if i % 2 == 0 {
            (plain(i), share(i))
        } else {
            (share(i), plain(i))
        };
        match (start_secs(&p.c, &first), start_secs(&p.c, &second)) {
            (Ok(x), Ok(y)) => {
                let (pl, sh) = if i % 2 == 0 { (x, y) } else { (y, x) };
                plains.push(pl);
                shares.push(sh);
                ratios.push(sh / pl);
            }
            (Err(e), _) | (_, Err(e)) => {
                failed = Some(format!("{e:#}"));
                break;
            }
        }
    }
    let spread = |v: &[f64]| {
        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = v.iter().copied().fold(0.0, f64::max);
        format!("{lo:.2}-{hi:.2}")
    };
    let observed = match failed {
        Some(e) => e,
        None => format!(
            "{} rounds: plain median {:.2}s ({}), share median {:.2}s ({}); share/plain median {:.2}x (rounds {})",
            ratios.len(),
            median(&mut plains.clone()),
            spread(&plains),
            median(&mut shares.clone()),
            spread(&shares),
            median(&mut ratios.clone()),
            spread(&ratios),
        ),
    };
    let ok = ratios.len() == p.a.rounds as usize;
    p.row(
        "pod start, share vs plain",
        "every pod Running; the ratio and its spread",
        observed,
        pass(ok),
    );
}

/// DRA on the same node, labelled for it: a whole card from a template and a 30% + 8 GiB share
/// by consumable capacity, prepared by the kubelet through the DRA plugin.
async fn dra(p: &mut Phase<'_>, inv: &NodeInventory) -> anyhow::Result<()> {
    let cards = inv.gpus.iter().filter(|g| !g.mig_enabled).count();
    p.c.kubectl_ok(&["label", "node", NODE, &format!("{LABEL_DRA}=true")])?;
    let slice = format!("resourceslice/{NODE}-{}", tessera_core::dra::DRIVER);
    let names: Vec<String> = (0..cards).map(|i| format!("gpu-{i}")).collect();
    p.c.wait_for(
        &[&slice],
        "{.spec.devices[*].name}",
        &names.join(" "),
        Duration::from_secs(90),
    )
    .await
    .with_context(|| p.c.log_tail("dra-plugin", 20))?;
    // The DRA plugin's own read of the cards (NVML on a GPU): each device names its card.
    let uuids = p.c.kubectl_ok(&[
        "get",
        &slice,
        "-o",
        "jsonpath={.spec.devices[*].attributes.uuid.string}",
    ])?;
    let want: Vec<&str> = inv
        .gpus
        .iter()
        .filter(|g| !g.mig_enabled)
        .map(|g| g.uuid.as_str())
        .collect();
    let ok = uuids.split_whitespace().collect::<Vec<_>>() == want;
    p.row(
        "DRA: the node's slice",
        format!("one device per card, named by its UUID ({})", want.len()),
        format!("devices {names:?}, uuids {uuids}"),
        pass(ok),
    );
    p.c.apply(
        r#"{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
  "metadata": {"name": "whole-gpu", "namespace": "default"},
  "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.tessera.io"}}]}}}}"#,
    )?;
    p.c.apply(
        r#"{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
  "metadata": {"name": "share-30-8gib", "namespace": "default"},
  "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.tessera.io",
    "capacity": {"requests": {"cores": "30", "memory": "8Gi"}}}}]}}}"#,
    )?;
    let whole = pod(
        "dra-whole",
        false,
        &[("gpu", "whole-gpu", true)],
        vec![container("main", "exec /probe --bench-ms 3000", &[], Some("gpu"))],
    );
    let (verdict, observed) = match p.run(&whole).await {
        Ok(out) => {
            let kv = parse(&out[0].1);
            let ok = kv.get("devices").map(String::as_str) == Some("1")
                && !kv.contains_key("mps_threads")
                && (p.a.dry_run() || num(&kv, "sms") == p.base.sms);
            (pass(ok), summary(&kv))
        }
        Err(e) => (Verdict::Fail, e),
    };
    p.row("DRA: whole-card claim", "1 device, all SMs, no MPS", observed, verdict);
    let cmd = "exec /probe --alloc-gib 20 --bench-ms 3000 --fill";
    let share = pod(
        "dra-share",
        false,
        &[("gpu", "share-30-8gib", false)],
        vec![container("main", cmd, &[], Some("gpu"))],
    );
    let (verdict, observed) = match p.run(&share).await {
        Ok(out) => {
            let (ok, o) = p.judge(&parse(&out[0].1), 30.0, 8192.0);
            (pass(ok), o)
        }
        Err(e) => (Verdict::Fail, e),
    };
    p.row(
        "DRA: 30% + 8 GiB share claim",
        "~30% of the card, <= 8 GiB allocatable, 20 GiB cudaMalloc fails",
        observed,
        verdict,
    );
    Ok(())
}

/// One mode's cluster: up, Tessera installed, every case; DRA in MPS mode only.
async fn phase(a: &Args, mode: ShareEnforcement, inv: &NodeInventory) -> anyhow::Result<Vec<Row>> {
    let mut c = Cluster::start().await?;
    let label = format!("k8s {} {mode}", c.version());
    println!("{label}: up in {:.0}s", c.started_in().as_secs_f64());
    c.import_image(&a.probe_image)?;
    let cards = inv.gpus.iter().filter(|g| !g.mig_enabled).count();
    let setup = Setup {
        gpus: if a.dry_run() {
            Gpus::Fixture(FIXTURE.into())
        } else {
            Gpus::Nvml
        },
        core: u32::try_from(cards)? * 100,
        dra: mode == ShareEnforcement::Mps,
        enforcement: mode,
        hook_library: Some(a.hook_library.clone()),
        mps_control: a.fake_mps_control.clone(),
    };
    let t = Instant::now();
    tessera::install_with(&mut c, &setup).await?;
    println!(
        "{label}: Tessera installed and the node's GPUs published in {:.0}s",
        t.elapsed().as_secs_f64()
    );
    let mut p = Phase {
        a,
        c,
        label,
        mode,
        base: Baseline::default(),
        rows: Vec::new(),
    };
    if mode == ShareEnforcement::Mps {
        inventory_row(&mut p, inv)?;
    }
    whole_card(&mut p, inv).await;
    shares(&mut p).await;
    pod_start_row(&mut p);
    if setup.dra
        && let Err(e) = dra(&mut p, inv).await
    {
        p.row(
            "DRA: set up",
            "the node's slice published",
            format!("{e:#}"),
            Verdict::Fail,
        );
    }
    if p.rows.iter().any(|r| r.verdict == Verdict::Fail) {
        for name in ["nri-plugin", "extender", "kubelet", "mps-supervisor", "dra-plugin"] {
            eprintln!("== {name} log:\n{}", p.c.log_tail(name, 15));
        }
    }
    Ok(p.rows)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() -> anyhow::Result<()> {
    let a = <Args as clap::Parser>::parse();
    for (flag, path) in [("--probe-image", &a.probe_image), ("--hook-library", &a.hook_library)] {
        anyhow::ensure!(path.exists(), "{flag} {} does not exist", path.display());
    }
    let inv = local_gpus(&a)?;
    anyhow::ensure!(!inv.gpus.is_empty(), "no GPU on this machine");
    let mut rows = Vec::new();
    for mode in [ShareEnforcement::Mps, ShareEnforcement::Hook] {
        match phase(&a, mode, &inv).await {
            Ok(r) => rows.extend(r),
            Err(e) => rows.push(Row {
                runtime: format!("k8s {mode}"),
                case: "setup",
                expected: "the cluster comes up with Tessera on it".into(),
                observed: format!("{e:#}"),
                verdict: Verdict::Fail,
            }),
        }
        // A run cut short keeps the modes it finished.
        if let Some(out) = &a.out {
            std::fs::write(out, table(&rows))?;
        }
    }
    let mut text = table(&rows);
    if a.dry_run() {
        let _ = writeln!(
            text,
            "# dry run: fixture {FIXTURE}, NVIDIA's 535 files as its driver, a stand-in MPS daemon"
        );
    } else {
        let _ = writeln!(text, "# driver {} (NVML)", inv.driver_version);
    }
    print!("{text}");
    if let Some(out) = &a.out {
        std::fs::write(out, &text)?;
    }
    if rows.iter().any(|r| r.verdict == Verdict::Fail) {
        std::process::exit(1);
    }
    Ok(())
}
