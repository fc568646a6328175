//! `tessera-gpu-e2e`: Tessera's node stack on a real GPU, case by case, on containerd 1.7 and
//! 2.x, printed as a table (runtime, case, expected, verdict, observed). Run by
//! `tests/gpu/run.sh`, which builds the CUDA probe image; see that script.
//!
//! The spec comes from `tessera-cdi-generator generate` with no flags (NVML, the driver found
//! where the node keeps it, shares enforced by MPS), the MPS daemons from
//! `tessera-mps-supervisor`, the NRI plugin is the release binary connected to each containerd,
//! and containers are created through CRI as the kubelet creates them. Share limits are judged
//! against the whole card measured in the same run. With `--dry-run` (no GPU) the same cases run
//! against a fixture node, a fake MPS daemon and a shell probe: the plumbing, not CUDA.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use tessera_core::enforcement::MpsLayout;
use tessera_core::handoff::{AllocatedDevice, Allocation, ContainerAllocation, SigningKeys};
use tessera_core::inventory::{InventorySource, NodeInventory};
use tessera_core::names::{ANNOTATION_ALLOCATION, ANNOTATION_ALLOCATION_SIGNATURE};
use tessera_core::request::ContainerRole;
use tessera_node::inventory::NvmlSource;
use tessera_proto::cri;
use tessera_tests::containerd::{ContainerSpec, Containerd, Pod, Version};
use tessera_tests::fake_node::{FakeNodePaths, fake_node};

#[path = "report.rs"]
mod report;

use report::{Baseline, Row, Verdict, judge_share, num, parse, pass, summary, table};

const NODE: &str = "gpu-node";
const PROBE_IMAGE: &str = "docker.io/tessera/probe:gpu";

/// Tessera's node stack on a real GPU (or, with --dry-run, on a fixture node), case by case on
/// containerd 1.7 and 2.x, printed as a table. Run by tests/gpu/run.sh.
#[derive(clap::Parser)]
#[command(name = "tessera-gpu-e2e", version)]
struct Args {
    /// Directory holding the release binaries (tessera-nri-plugin, tessera-cdi-generator,
    /// tessera-mps-supervisor, libtessera-cuda-hook.so).
    #[arg(long)]
    bin_dir: PathBuf,
    /// The CUDA probe's OCI image (a tarball).
    #[arg(long)]
    probe_image: PathBuf,
    /// No GPU: a fake MPS control program (this file) stands in for the driver's.
    #[arg(long = "dry-run", value_name = "FAKE_MPS_CONTROL")]
    fake_mps_control: Option<PathBuf>,
    /// Also write the table to this file (rewritten after each runtime, so that a run cut
    /// short keeps what it finished).
    #[arg(long)]
    out: Option<PathBuf>,
    /// The containerd versions to run on, in turn (repeatable; default both).
    #[arg(long = "runtime", value_enum)]
    runtimes: Vec<Version>,
}

impl Args {
    fn dry_run(&self) -> bool {
        self.fake_mps_control.is_some()
    }
}

fn args() -> anyhow::Result<Args> {
    let a = <Args as clap::Parser>::parse();
    for b in ["tessera-nri-plugin", "tessera-cdi-generator", "tessera-mps-supervisor"] {
        anyhow::ensure!(a.bin_dir.join(b).exists(), "--bin-dir must hold {b}");
    }
    anyhow::ensure!(
        a.probe_image.exists(),
        "--probe-image {} does not exist",
        a.probe_image.display()
    );
    Ok(a)
}

struct Stack {
    c: Containerd,
    keys: SigningKeys,
    plugin: Child,
    plugin_log: PathBuf,
    pods: usize,
}

impl Stack {
    async fn pod(&mut self, name: &str, devices: Vec<AllocatedDevice>, forge: bool) -> anyhow::Result<Pod> {
        self.pods += 1;
        let uid = format!("uid-{name}-{}", self.pods);
        let mut a = Allocation::new(NODE, &uid);
        a.containers.push(ContainerAllocation {
            name: "main".into(),
            role: ContainerRole::App,
            devices,
        });
        let s = self.keys.sign(&a);
        let allocation = if forge {
            s.allocation.replace("\"core_percent\":30", "\"core_percent\":100")
        } else {
            s.allocation
        };
        self.c
            .run_pod_with_uid(
                name,
                &uid,
                &[
                    (ANNOTATION_ALLOCATION, &allocation),
                    (ANNOTATION_ALLOCATION_SIGNATURE, &s.signature),
                ],
            )
            .await
    }

    fn spec(&self, cmd: &[&str], amounts: &[(&str, &str)]) -> ContainerSpec {
        let mut spec = ContainerSpec::new("main", cmd).image(PROBE_IMAGE);
        for (k, v) in amounts {
            spec = spec.annotation(&format!("tessera.io/allocated.{k}"), v);
        }
        spec
    }

    /// Creates a container; the error text when the runtime refuses it. A share refused because
    /// its card's MPS daemon did not take its limits within the plugin's wait is created again,
    /// twice at most, as the kubelet does (the supervisor's fake daemon answers through Python
    /// processes, slow on a loaded machine); each retry is said on stderr.
    async fn create(&mut self, pod: &Pod, spec: ContainerSpec) -> Result<String, String> {
        let mut tries = 0;
        loop {
            match self.c.create_container(pod, spec.clone()).await {
                Ok(id) => return Ok(id),
                Err(e) => {
                    let e = format!("{e:#}");
                    tries += 1;
                    if tries > 2 || !e.contains("did not take the share's limits") {
                        return Err(e);
                    }
                    eprintln!("tessera-gpu-e2e: created again, as the kubelet would: {e}");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    }

    async fn start(&mut self, id: &str) -> anyhow::Result<()> {
        self.c
            .cri()?
            .start_container(cri::StartContainerRequest {
                container_id: id.into(),
            })
            .await?;
        Ok(())
    }

    async fn wait(&mut self, id: &str, secs: u64) -> anyhow::Result<(i32, String)> {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let st = self.c.status(id).await?;
            if st.state == cri::ContainerState::ContainerExited as i32 {
                let log = std::fs::read_to_string(&st.log_path).unwrap_or_default();
                // CRI log lines: "<time> <stream> <tag> <text>".
                let text = log
                    .lines()
                    .map(|l| l.splitn(4, ' ').nth(3).unwrap_or(""))
                    .collect::<Vec<_>>()
                    .join("\n");
                return Ok((st.exit_code, text));
            }
            anyhow::ensure!(Instant::now() < deadline, "container {id} did not exit within {secs} s");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn run(&mut self, pod: &Pod, spec: ContainerSpec) -> Result<(i32, String), String> {
        let id = self.create(pod, spec).await?;
        self.start(&id).await.map_err(|e| format!("{e:#}"))?;
        self.wait(&id, 120).await.map_err(|e| format!("{e:#}"))
    }
}

const SHARE: [(&str, &str); 3] = [("gpu-core", "30"), ("gpu-memory", "8"), ("gpu-memory-mib", "8192")];

fn write_keys(dir: &Path) -> anyhow::Result<SigningKeys> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("active"), "k1")?;
    std::fs::write(dir.join("k1"), [7u8; 32])?;
    Ok(SigningKeys::from_dir(dir)?)
}

/// Spawns `cmd` with its output appended to `log` (a restarted program adds to its log).
fn spawn_logged(cmd: &mut Command, log: &Path) -> anyhow::Result<Child> {
    let f = std::fs::File::options().create(true).append(true).open(log)?;
    Ok(cmd.stdin(Stdio::null()).stdout(f.try_clone()?).stderr(f).spawn()?)
}

/// Where the plugin serves the node's GPU metrics during the run.
const METRICS_ADDR: &str = "127.0.0.1:9403";

/// One scrape of the plugin's metrics (the body), or the error.
async fn scrape() -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(METRICS_ADDR).await?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: node\r\nConnection: close\r\n\r\n")
        .await?;
    let mut reply = String::new();
    s.read_to_string(&mut reply).await?;
    Ok(reply
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or(reply))
}

/// Scrapes until `stop`, keeping the scrape with the most per-container use series, then the
/// most allocation series (dry there are no use series: the last scrape, after the container
/// ended, would have neither).
fn scrape_while_running(stop: tokio::sync::oneshot::Receiver<()>) -> tokio::task::JoinHandle<String> {
    tokio::spawn(async move {
        let mut stop = stop;
        let mut best = String::new();
        let count = |t: &str| {
            let series = |prefix: &str| t.lines().filter(|l| l.starts_with(prefix)).count();
            (
                series("tessera_container_gpu_memory_used_bytes{"),
                series("tessera_container_gpu_allocated_core_ratio{"),
            )
        };
        loop {
            if let Ok(text) = scrape().await
                && count(&text) >= count(&best)
            {
                best = text;
            }
            tokio::select! {
                _ = &mut stop => return best,
                _ = tokio::time::sleep(Duration::from_millis(250)) => {}
            }
        }
    })
}

/// Scrapes until `stop`: the highest value of the series starting with `prefix` whose labels
/// contain `label`.
fn scrape_peak(
    stop: tokio::sync::oneshot::Receiver<()>,
    prefix: &'static str,
    label: &'static str,
) -> tokio::task::JoinHandle<Option<f64>> {
    tokio::spawn(async move {
        let mut stop = stop;
        let mut peak: Option<f64> = None;
        loop {
            if let Ok(text) = scrape().await {
                let v = text
                    .lines()
                    .filter(|l| l.starts_with(prefix) && l.contains(label))
                    .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                    .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))));
                peak = match (peak, v) {
                    (Some(p), Some(v)) => Some(p.max(v)),
                    (p, v) => p.or(v),
                };
            }
            tokio::select! {
                _ = &mut stop => return peak,
                _ = tokio::time::sleep(Duration::from_millis(250)) => {}
            }
        }
    })
}

/// Starts the release NRI plugin against `c` (in `mode`) and waits for it to synchronise.
fn start_plugin(
    a: &Args,
    c: &Containerd,
    keys: &Path,
    (mode, mps, hook): (&str, &MpsLayout, &Path),
    log: &Path,
) -> anyhow::Result<Child> {
    let synced_before = std::fs::read_to_string(log)
        .unwrap_or_default()
        .matches("synchronized")
        .count();
    let child = spawn_logged(
        Command::new(a.bin_dir.join("tessera-nri-plugin"))
            .arg("run")
            .args(["--share-enforcement", mode, "--hook-root"])
            .arg(hook)
            .arg("--socket")
            .arg(c.nri_socket())
            .arg("--keys-dir")
            .arg(keys)
            .arg("--cdi-dir")
            .arg(c.cdi_dir())
            .arg("--node-name")
            .arg(NODE)
            .arg("--mps-root")
            .arg(&mps.root)
            .args(["--metrics-listen", METRICS_ADDR]),
        log,
    )
    .context("starting tessera-nri-plugin")?;
    let deadline = Instant::now() + Duration::from_secs(20);
    // The log is appended to: this plugin's sync is one more than the log had before it.
    let syncs = || {
        std::fs::read_to_string(log)
            .unwrap_or_default()
            .matches("synchronized")
            .count()
    };
    while syncs() <= synced_before {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the NRI plugin did not synchronise:\n{}",
            std::fs::read_to_string(log)?
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(child)
}

/// Starts the MPS supervisor: the driver's daemon on a GPU, the fake one dry.
fn start_supervisor(a: &Args, mps: &MpsLayout, log: &Path) -> anyhow::Result<Child> {
    let mut cmd = Command::new(a.bin_dir.join("tessera-mps-supervisor"));
    cmd.arg("run").arg("--mps-root").arg(&mps.root);
    if let Some(fake) = &a.fake_mps_control {
        // Health checks a minute apart: the fake daemon's clients are Python processes, and
        // eight cards checked every second kept two cores busy enough that a share's ceiling
        // missed the NRI plugin's wait (seen: 3.9 s from ceiling to held); every 5 s still
        // did on a loaded 2-core machine (CI's clean run: three share rows refused on
        // containerd 2). No dry case waits for a health check.
        cmd.args(["--fixture", "h100x8", "--check-secs", "60", "--control-binary"])
            .arg(fake);
    }
    spawn_logged(&mut cmd, log).context("starting tessera-mps-supervisor")
}

fn stop(mut child: Child) {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    let deadline = Instant::now() + Duration::from_secs(15);
    while Instant::now() < deadline {
        if child.try_wait().ok().flatten().is_some() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// The spec: on a GPU, `tessera-cdi-generator generate` with no flags but the output and where
/// the CUDA hook is (MPS nodes preload it) (its case row); dry, from the fixture on a fake node.
fn generate_spec(
    a: &Args,
    c: &Containerd,
    work: &Path,
    (mps, hook_root): (&MpsLayout, &Path),
    rows: &mut Vec<Row>,
    runtime: &str,
) -> anyhow::Result<NodeInventory> {
    let hook = |cmd: &mut Command| {
        cmd.arg("--hook-root")
            .arg(hook_root)
            .arg("--hook-library")
            .arg(a.bin_dir.join("libtessera-cuda-hook.so"));
    };
    let generator = a.bin_dir.join("tessera-cdi-generator");
    let (out, inv) = if a.dry_run() {
        let inv = fake_node("h100x8", work)?;
        let paths = FakeNodePaths::under(work);
        let mut cmd = Command::new(&generator);
        cmd.arg("generate");
        hook(&mut cmd);
        let out = cmd
            .args(["--fixture", "h100x8", "--driver-root"])
            .arg(&paths.driver_root)
            .arg("--dev-root")
            .arg(&paths.dev_root)
            .arg("--mps-root")
            .arg(&mps.root)
            // Dry, nothing is written outside the run's directory.
            .arg("--driver-bundle-dir")
            .arg(work.join("driver-bundle"))
            .arg("--out-dir")
            .arg(c.cdi_dir())
            .output()?;
        (out, inv)
    } else {
        let mut cmd = Command::new(&generator);
        cmd.arg("generate");
        hook(&mut cmd);
        let out = cmd.arg("--out-dir").arg(c.cdi_dir()).output()?;
        (
            out,
            NvmlSource::default()
                .discover()
                .context("reading the GPU through NVML")?,
        )
    };
    let spec = std::fs::read_to_string(c.cdi_dir().join("tessera.io-gpu.json")).unwrap_or_default();
    let libcuda = mounts_libcuda(&spec);
    let mps_edits = spec.contains("CUDA_MPS_PIPE_DIRECTORY=");
    let driver = Command::new(&generator).arg("driver").output()?;
    let root = String::from_utf8_lossy(&driver.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("driver root:").map(|r| r.trim().to_string()))
        .unwrap_or_else(|| "-".into());
    rows.push(Row {
        runtime: runtime.into(),
        case: "spec generated with no flags",
        expected: "exit 0; libcuda.so.1 mounted; shares through MPS; root detected".into(),
        observed: format!(
            "exit {}; libcuda {}; MPS edits {}; {} driver file(s); root {root}",
            out.status.code().unwrap_or(-1),
            if libcuda { "mounted" } else { "MISSING" },
            if mps_edits { "present" } else { "MISSING" },
            inv.driver_files.len()
        ),
        verdict: if out.status.success() && libcuda && mps_edits {
            Verdict::Pass
        } else {
            Verdict::Fail
        },
    });
    Ok(inv)
}

/// `tessera-cdi-generator topology --json`: on a GPU from NVML (the matrix, CPU and NUMA
/// affinity this node would publish); dry, the NVLink-bridged-pairs fixture.
fn topology_view(a: &Args, runtime: &str) -> anyhow::Result<Row> {
    let mut cmd = Command::new(a.bin_dir.join("tessera-cdi-generator"));
    cmd.args(["topology", "--json"]);
    if a.dry_run() {
        cmd.args(["--fixture", "a100-nvlink-pairs"]);
    }
    let out = cmd.output()?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    let gpus = v["gpus"].as_array().map_or(0, Vec::len);
    let rows: Vec<&str> = v["topology"]["matrix"]
        .as_array()
        .map(|m| m.iter().filter_map(|r| r.as_str()).collect())
        .unwrap_or_default();
    let diagonal = rows
        .iter()
        .enumerate()
        .all(|(i, r)| r.split_whitespace().nth(i) == Some("X"));
    let affinity: Vec<String> = v["gpus"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|g| format!("cpus {} numa {}", g["cpu_affinity"], g["numa_node"]))
        .collect();
    let ok = out.status.success() && gpus > 0 && rows.len() == gpus && diagonal;
    Ok(Row {
        runtime: runtime.into(),
        case: "topology view",
        expected: "exit 0; one matrix row per GPU, X on the diagonal".into(),
        observed: format!(
            "exit {}; {gpus} GPU(s); matrix {:?}; {}",
            out.status.code().unwrap_or(-1),
            rows,
            affinity.join(", ")
        ),
        verdict: pass(ok),
    })
}

async fn cases(a: &Args, version: Version) -> anyhow::Result<Vec<Row>> {
    let c = Containerd::start(version).await?;
    let runtime = format!("containerd {}", c.package_version());
    c.import_image(&a.probe_image)?;
    let work = tempfile::tempdir()?;
    let mps = if a.dry_run() {
        MpsLayout::new(work.path().join("mps"))
    } else {
        MpsLayout::default()
    };
    let mut rows = Vec::new();
    let hook_root = work.path().join("hook");
    let inv = generate_spec(a, &c, work.path(), (&mps, &hook_root), &mut rows, &runtime)?;
    rows.push(topology_view(a, &runtime)?);
    let gpu = inv.gpus.first().context("no GPU in the inventory")?.clone();
    let dry = a.dry_run();
    let row = |case, expected: String, observed: String, verdict| Row {
        runtime: runtime.clone(),
        case,
        expected,
        observed,
        verdict,
    };

    // The card's MPS daemon.
    let sup_log = work.path().join("supervisor.log");
    let supervisor = start_supervisor(a, &mps, &sup_log)?;
    let t0 = Instant::now();
    let ready = loop {
        match mps.ready(&gpu.uuid, SystemTime::now()) {
            Ok(()) => break Ok(t0.elapsed()),
            Err(e) if t0.elapsed() > Duration::from_secs(60) => break Err(e),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    rows.push(row(
        "MPS daemon of the card",
        "ready (Default compute mode kept)".into(),
        match &ready {
            Ok(d) => format!("ready after {:.1}s", d.as_secs_f64()),
            Err(e) => format!("{e}; log: {}", std::fs::read_to_string(&sup_log).unwrap_or_default()),
        },
        pass(ready.is_ok()),
    ));

    let keys_dir = work.path().join("keys");
    let keys = write_keys(&keys_dir)?;
    let plugin_log = work.path().join("plugin.log");
    let plugin = start_plugin(a, &c, &keys_dir, ("mps", &mps, &hook_root), &plugin_log)?;
    let mut s = Stack {
        c,
        keys,
        plugin,
        plugin_log,
        pods: 0,
    };

    // Whole card: the baseline for every ratio below.
    let pod = s.pod("whole", vec![AllocatedDevice::whole(&gpu)], false).await?;
    let spec = s.spec(&["/probe", "--bench-ms", "3000"], &[("gpu-core", "100")]);
    let mut base = Baseline::default();
    let (stop_scraping, scraping) = tokio::sync::oneshot::channel();
    let scraper = scrape_while_running(scraping);
    let ran = s.run(&pod, spec).await;
    let _ = stop_scraping.send(());
    let metrics = scraper.await.unwrap_or_default();
    let (verdict, observed) = match ran {
        Ok((code, out)) => {
            let kv = parse(&out);
            base = Baseline {
                sms: num(&kv, "sms"),
                rate: num(&kv, "kernels_per_s"),
            };
            let ok = code == 0 && kv.get("devices").map(String::as_str) == Some("1") && !kv.contains_key("mps_threads");
            let mut o = summary(&kv);
            // The card is otherwise idle: what is in use once the context exists is the context's.
            if let (Some(t), Some(f)) = (num(&kv, "mem_total_mib"), num(&kv, "mem_free_mib")) {
                let _ = write!(o, " in use with a context {:.0} MiB", t - f);
            }
            if let (Some(t), Some(f)) = (num(&kv, "mem_total_mib"), num(&kv, "mem_free_end_mib")) {
                let _ = write!(o, ", after the kernels {:.0} MiB", t - f);
            }
            (pass(ok), o)
        }
        Err(e) => (Verdict::Fail, e),
    };
    rows.push(row(
        "whole card (the baseline)",
        format!("1 device ({}), all SMs, {} MiB, no MPS", gpu.model, gpu.memory_mib),
        observed,
        verdict,
    ));
    // The node's metrics while that container ran: on a GPU, its process's memory attributed
    // to it through its cgroup; dry, allocations only (no NVML).
    let series = |prefix: &str| -> Vec<&str> { metrics.lines().filter(|l| l.starts_with(prefix)).collect() };
    let used = series("tessera_container_gpu_memory_used_bytes{");
    let allocated = series("tessera_container_gpu_allocated_core_ratio{");
    let up = series("tessera_telemetry_up").join(" ");
    let ok = if dry {
        !allocated.is_empty()
    } else {
        up.ends_with(" 1")
            && used
                .iter()
                .any(|l| l.contains("container=\"main\"") && !l.ends_with(" 0.0"))
    };
    rows.push(row(
        "node metrics while it ran",
        if dry {
            "the container's allocation (no NVML dry)".into()
        } else {
            "telemetry up; the container's GPU memory attributed to it".into()
        },
        format!("{up}; used {used:?}; allocated {allocated:?}"),
        pass(ok),
    ));

    // A 30% + 8 GiB share, alone.
    let share = AllocatedDevice::share(&gpu, 30, 8192);
    let pod = s.pod("share", vec![share.clone()], false).await?;
    let spec = s.spec(&["/probe", "--alloc-gib", "20", "--bench-ms", "3000", "--fill"], &SHARE);
    let (verdict, observed) = match s.run(&pod, spec).await {
        Ok((_, out)) => {
            let (ok, o) = judge_share(dry, &parse(&out), base, Some(&gpu.uuid), 30.0, 8192.0);
            (pass(ok), o)
        }
        Err(e) => (Verdict::Fail, e),
    };
    rows.push(row(
        "30% + 8 GiB share",
        "~30% of the SMs, <= 8 GiB allocatable, 20 GiB cudaMalloc fails".into(),
        observed,
        verdict,
    ));

    // The same share, its process unsetting every MPS variable: the card's daemon holds it to
    // the ceiling (the largest share placed, this one), and NVIDIA's default pipe directory is
    // where the container has the daemon's socket.
    let pod = s.pod("share-unset", vec![share.clone()], false).await?;
    let spec = s.spec(
        &[
            "sh",
            "-c",
            "unset CUDA_MPS_ACTIVE_THREAD_PERCENTAGE CUDA_MPS_PINNED_DEVICE_MEM_LIMIT CUDA_MPS_PIPE_DIRECTORY; \
             exec /probe --alloc-gib 20 --bench-ms 3000 --fill",
        ],
        &SHARE,
    );
    let (verdict, observed) = match s.run(&pod, spec).await {
        Ok((_, out)) => {
            let kv = parse(&out);
            let (ok, o) = if dry {
                // Dry: the variables are gone and the container still has the card's shm.
                (
                    !kv.contains_key("mps_threads") && kv.get("mps_shm").map(String::as_str) == Some(gpu.uuid.as_str()),
                    summary(&kv),
                )
            } else {
                judge_share(dry, &kv, base, Some(&gpu.uuid), 30.0, 8192.0)
            };
            (pass(ok), o)
        }
        Err(e) => (Verdict::Fail, e),
    };
    rows.push(row(
        "30% + 8 GiB share, MPS variables unset",
        "still ~30% of the SMs, <= 8 GiB allocatable (the daemon's ceiling)".into(),
        observed,
        verdict,
    ));

    // Two shares at the same time on the card.
    let mut ids = Vec::new();
    for n in ["share-a", "share-b"] {
        let pod = s.pod(n, vec![share.clone()], false).await?;
        let spec = s.spec(&["/probe", "--alloc-gib", "20", "--bench-ms", "5000", "--fill"], &SHARE);
        ids.push(s.create(&pod, spec).await);
    }
    for id in ids.iter().flatten() {
        s.start(id).await?;
    }
    let mut judged = Vec::new();
    for id in ids.iter().flatten() {
        judged.push(match s.wait(id, 120).await {
            Ok((_, out)) => judge_share(dry, &parse(&out), base, Some(&gpu.uuid), 30.0, 8192.0),
            Err(e) => (false, format!("{e:#}")),
        });
    }
    for e in ids.iter().filter_map(|r| r.as_ref().err()) {
        judged.push((false, e.clone()));
    }
    rows.push(row(
        "two 30% + 8 GiB shares at once",
        "each ~30% of the SMs and <= 8 GiB allocatable, side by side".into(),
        judged.iter().map(|(_, o)| o.as_str()).collect::<Vec<_>>().join(" | "),
        pass(judged.len() == 2 && judged.iter().all(|(ok, _)| *ok)),
    ));

    // Three CUDA processes of one share at once (gunicorn workers, torchrun on one share):
    // MPS limits each alone, so the hook, preloaded on MPS nodes too, holds their memory
    // together, and has them take turns on the card, so MPS's per-process SM cap holds for
    // the three together.
    let (observed, verdict) = three_processes(&mut s, dry, "mps", share.clone(), base).await?;
    rows.push(row(
        "three processes of one 30% + 8 GiB share",
        "<= 8 GiB held together (the hook's one budget per container); <= 0.40x the card together (turns)".into(),
        observed,
        verdict,
    ));
    let (observed, verdict) = per_cgroup_memory(&mut s, dry, share.clone(), &inv.driver_version).await?;
    rows.push(row(
        "per-cgroup memory limit (driver r615+)",
        "the share's 8 GiB set on its container's cgroup by the NRI plugin, read back through NVML".into(),
        observed,
        verdict,
    ));

    // A whole card on the same node (the card, now the shares are gone): not through MPS.
    let pod = s.pod("whole-after", vec![AllocatedDevice::whole(&gpu)], false).await?;
    let spec = s.spec(&["/probe"], &[("gpu-core", "100")]);
    let (verdict, observed) = match s.run(&pod, spec).await {
        Ok((code, out)) => {
            let kv = parse(&out);
            let all_sms = dry || (num(&kv, "sms").is_some() && num(&kv, "sms") == base.sms);
            (
                pass(code == 0 && all_sms && !kv.contains_key("mps_threads")),
                summary(&kv),
            )
        }
        Err(e) => (Verdict::Fail, e),
    };
    rows.push(row(
        "whole card beside the MPS daemon",
        "the whole card, not through MPS".into(),
        observed,
        verdict,
    ));

    // MPS serves one user per card: another user's share on a card a root share holds is
    // refused at start (the NRI plugin reads its process's user), rather than left waiting and
    // holding the card's other shares up.
    {
        let root_pod = s.pod("root-share", vec![share.clone()], false).await?;
        let spec = s.spec(&["/probe", "--bench-ms", "8000"], &SHARE);
        let root_id = s.create(&root_pod, spec).await;
        let user_pod = s.pod("user-share", vec![share.clone()], false).await?;
        let spec = s.spec(&["/probe"], &SHARE).user(1000);
        let user_id = s.create(&user_pod, spec).await;
        let (verdict, observed) = match (root_id, user_id) {
            (Ok(r), Ok(u)) => {
                s.start(&r).await?;
                let started = s.start(&u).await;
                let _ = s.wait(&r, 120).await;
                match started {
                    Err(e) => {
                        let e = format!("{e:#}");
                        (
                            pass(e.contains("runs as uid 1000")),
                            e.rsplit("desc = ").next().unwrap_or(&e).chars().take(120).collect(),
                        )
                    }
                    Ok(()) => (Verdict::Fail, "started beside the root share".to_string()),
                }
            }
            (r, u) => (Verdict::Fail, format!("{:?} {:?}", r.err(), u.err())),
        };
        // A container created and never started holds its card: gone with its pod, whatever
        // the verdict, so that the next cases find the card free.
        for pod in [&root_pod, &user_pod] {
            let _ = s.c.remove_pod(pod).await;
        }
        rows.push(row(
            "uid 1000 share beside a root share",
            "refused at start, naming the root share (one user per MPS daemon)".into(),
            observed,
            verdict,
        ));
    }

    // No allocation, but the env other stacks read.
    let pod = s.c.run_pod("plain", &[]).await?;
    let spec = ContainerSpec::new(
        "main",
        &[
            "sh",
            "-c",
            "ls /dev/nvidia* 2>/dev/null | wc -l; /probe; env | grep VISIBLE",
        ],
    )
    .image(PROBE_IMAGE)
    .env("NVIDIA_VISIBLE_DEVICES", "all")
    .env("CUDA_VISIBLE_DEVICES", "0");
    let (verdict, observed) = match s.run(&pod, spec).await {
        Ok((_, out)) => {
            let kv = parse(&out);
            let nodes = out.lines().next().unwrap_or("?").trim().to_string();
            (
                pass(
                    nodes == "0"
                        && kv.get("devices").map(String::as_str) == Some("0")
                        && kv.get("CUDA_VISIBLE_DEVICES").map(String::as_str) == Some(""),
                ),
                format!("{nodes} /dev/nvidia* node(s); {}", summary(&kv)),
            )
        }
        Err(e) => (Verdict::Fail, e),
    };
    rows.push(row(
        "no GPU, NVIDIA_VISIBLE_DEVICES=all",
        "no device node, CUDA sees 0 devices".into(),
        observed,
        verdict,
    ));

    // A forged hand-off: refused at creation.
    let pod = s.pod("forged", vec![share.clone()], true).await?;
    let spec = s.spec(&["/probe"], &[("gpu-core", "100")]);
    let (verdict, observed) = match s.create(&pod, spec).await {
        Ok(id) => (Verdict::Fail, format!("created {id}")),
        Err(e) => (pass(e.contains("forged")), e.chars().take(140).collect()),
    };
    rows.push(row(
        "forged hand-off",
        "refused, saying forged".into(),
        observed,
        verdict,
    ));

    // nvidia-smi inside a GPU container.
    let pod = s.pod("smi", vec![AllocatedDevice::whole(&gpu)], false).await?;
    let cmd: &[&str] = if dry {
        &[
            "sh",
            "-c",
            "command -v nvidia-smi >/dev/null && echo 'GPU 0: (dry run: nvidia-smi mounted)'",
        ]
    } else {
        &["nvidia-smi", "-L"]
    };
    let spec = s.spec(cmd, &[("gpu-core", "100")]);
    let (verdict, observed) = match s.run(&pod, spec).await {
        Ok((code, out)) => (
            pass(code == 0 && out.contains("GPU 0")),
            out.lines().next().unwrap_or("").to_string(),
        ),
        Err(e) => (Verdict::Fail, e),
    };
    rows.push(row(
        "nvidia-smi in a GPU container",
        "lists GPU 0".into(),
        observed,
        verdict,
    ));

    // The daemons stop: a share is refused at creation (fail closed).
    stop(supervisor);
    let pod = s.pod("late-share", vec![share.clone()], false).await?;
    let spec = s.spec(&["/probe"], &SHARE);
    let (verdict, observed) = match s.create(&pod, spec).await {
        Ok(id) => (Verdict::Fail, format!("created {id}")),
        Err(e) => (
            pass(e.contains("cannot be enforced")),
            e.rsplit("desc = ").next().unwrap_or(&e).chars().take(160).collect(),
        ),
    };
    rows.push(row(
        "share with its MPS daemon down",
        "refused at creation, saying why".into(),
        observed,
        verdict,
    ));

    stop(s.plugin);

    // Hook mode on the same node: the spec's shares preload Tessera's CUDA hook instead.
    let mut cmd = Command::new(a.bin_dir.join("tessera-cdi-generator"));
    cmd.arg("generate")
        .args(["--share-enforcement", "hook", "--hook-root"])
        .arg(&hook_root);
    cmd.arg("--hook-library").arg(a.bin_dir.join("libtessera-cuda-hook.so"));
    if dry {
        let paths = FakeNodePaths::under(work.path());
        cmd.args(["--fixture", "h100x8", "--driver-root"])
            .arg(&paths.driver_root)
            .arg("--dev-root")
            .arg(&paths.dev_root)
            .arg("--driver-bundle-dir")
            .arg(work.path().join("driver-bundle"));
    }
    let out = cmd.arg("--out-dir").arg(s.c.cdi_dir()).output()?;
    anyhow::ensure!(
        out.status.success(),
        "hook-mode spec: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    s.plugin = start_plugin(a, &s.c, &keys_dir, ("hook", &mps, &hook_root), &s.plugin_log)?;
    let pod = s.pod("hook-share", vec![share.clone()], false).await?;
    let spec = s
        .spec(&["/probe", "--alloc-gib", "20", "--bench-ms", "5000"], &SHARE)
        .env("TESSERA_HOOK_DEBUG", "1");
    let (verdict, observed) = match s.run(&pod, spec).await {
        Ok((_, out)) => {
            let kv = parse(&out);
            let mut o = summary(&kv);
            // The hook's own lines: the throttle's steps (asked for above), anything it said.
            let said: Vec<&str> = out.lines().filter(|l| l.starts_with("tessera-cuda-hook:")).collect();
            let steps = said.iter().filter(|l| l.contains("throttle pids=")).count();
            let _ = write!(o, " hook: {steps} control steps");
            for l in said
                .iter()
                .filter(|l| !l.contains("throttle pids="))
                .chain(said.iter().rev().take(3))
            {
                let _ = write!(o, "; {}", l.trim_start_matches("tessera-cuda-hook: "));
            }
            let ratio = num(&kv, "kernels_per_s").zip(base.rate).map(|(r, w)| r / w);
            if let Some(r) = ratio {
                let _ = write!(o, " throughput {r:.2}x whole");
            }
            let ok = if dry {
                kv.get("hook_preload")
                    .is_some_and(|p| p.ends_with("libtessera-cuda-hook.so"))
                    && kv.get("hook_memory").map(String::as_str) == Some("8192")
            } else {
                num(&kv, "mem_total_mib") == Some(8192.0)
                    && kv.get("alloc").is_some_and(|a| a != "ok")
                    && ratio.is_some_and(|r| r > 0.15 && r < 0.45)
            };
            (pass(ok), o)
        }
        Err(e) => (Verdict::Fail, e),
    };
    rows.push(row(
        "hook mode: 30% + 8 GiB share",
        "sees 8 GiB, 20 GiB cudaMalloc fails, ~0.3x whole-card throughput".into(),
        observed,
        verdict,
    ));
    let (observed, verdict) = three_processes(&mut s, dry, "hook", share.clone(), base).await?;
    rows.push(row(
        "hook mode: three processes of one 30% + 8 GiB share",
        "<= 8 GiB held together, ~0.3x whole-card throughput together".into(),
        observed,
        verdict,
    ));

    // Filled to its limit, what the share's process really holds on the card (NVML, through
    // the node's metrics): the hook charges its context too, so that stays within the share.
    let pod = s.pod("hook-fill", vec![share.clone()], false).await?;
    let spec = s.spec(&["/probe", "--fill", "--hold-ms", "3000"], &SHARE);
    let series = "tessera_container_gpu_memory_used_bytes{";
    let (stop_scraping, scraping) = tokio::sync::oneshot::channel();
    let scraper = scrape_peak(scraping, series, "pod=\"hook-fill\"");
    let ran = s.run(&pod, spec).await;
    let _ = stop_scraping.send(());
    let held_mib = scraper.await.ok().flatten().map(|b| b / 1048576.0);
    let (verdict, observed) = match ran {
        Ok((_, out)) => {
            let kv = parse(&out);
            let filled = num(&kv, "filled_mib");
            let ok = dry
                || (filled.is_some_and(|f| (6144.0..=8192.0).contains(&f))
                    && held_mib.is_some_and(|h| h <= 8192.0 + 64.0));
            let o = match held_mib {
                Some(h) => format!("{} held on the card (NVML) {h:.0} MiB", summary(&kv)),
                None => format!("{} held on the card: no series", summary(&kv)),
            };
            (pass(ok), o)
        }
        Err(e) => (Verdict::Fail, e),
    };
    rows.push(row(
        "hook mode: share filled to its limit",
        "6-8 GiB admitted in 256 MiB blocks; the card holds <= 8 GiB for it, context included".into(),
        observed,
        verdict,
    ));

    // A stream-ordered pool keeps what is freed (release threshold at the most): the kept
    // memory is still the share's, so a cudaMalloc of as much again beside it must not fit.
    let pod = s.pod("hook-pool", vec![share.clone()], false).await?;
    let spec = s.spec(&["/probe", "--pool-gib", "5"], &SHARE);
    let (verdict, observed) = match s.run(&pod, spec).await {
        Ok((_, out)) => {
            let kv = parse(&out);
            let ok = dry
                || (kv.get("pool_alloc").map(String::as_str) == Some("ok")
                    && kv.get("pool_then_alloc").is_some_and(|a| a != "ok"));
            (pass(ok), summary(&kv))
        }
        Err(e) => (Verdict::Fail, e),
    };
    rows.push(row(
        "hook mode: a pool keeps 5 GiB freed",
        "5 GiB more beside it refused (8 GiB share)".into(),
        observed,
        verdict,
    ));

    // VMM memory released while mapped stays until unmapped (ggml-cuda's pattern).
    let pod = s.pod("hook-vmm", vec![share.clone()], false).await?;
    let spec = s.spec(&["/probe", "--vmm-gib", "5"], &SHARE);
    let (verdict, observed) = match s.run(&pod, spec).await {
        Ok((_, out)) => {
            let kv = parse(&out);
            let ok = dry
                || (kv.get("vmm_map").map(String::as_str) == Some("ok")
                    && kv.get("vmm_then_alloc").is_some_and(|a| a != "ok"));
            (pass(ok), summary(&kv))
        }
        Err(e) => (Verdict::Fail, e),
    };
    rows.push(row(
        "hook mode: 5 GiB VMM released while mapped",
        "5 GiB more beside it refused (8 GiB share)".into(),
        observed,
        verdict,
    ));
    stop(s.plugin);

    if rows.iter().any(|r| r.verdict == Verdict::Fail) {
        eprintln!(
            "plugin log:\n{}",
            std::fs::read_to_string(&s.plugin_log).unwrap_or_default()
        );
        eprintln!(
            "supervisor log:\n{}",
            std::fs::read_to_string(&sup_log).unwrap_or_default()
        );
        eprintln!("containerd log:\n{}", s.c.log_tail(30));
    }
    Ok(rows)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() -> anyhow::Result<()> {
    let a = args()?;
    let versions = if a.runtimes.is_empty() {
        Version::ALL.to_vec()
    } else {
        a.runtimes.clone()
    };
    let mut rows = Vec::new();
    for v in versions {
        match cases(&a, v).await {
            Ok(r) => rows.extend(r),
            Err(e) => rows.push(Row {
                runtime: format!("{v:?}"),
                case: "setup",
                expected: "the stack comes up".into(),
                observed: format!("{e:#}"),
                verdict: Verdict::Fail,
            }),
        }
        if let Some(out) = &a.out {
            std::fs::write(out, table(&rows))?;
        }
    }
    print!("{}", table(&rows));
    if rows.iter().any(|r| r.verdict == Verdict::Fail) {
        std::process::exit(1);
    }
    Ok(())
}

/// Whether a CDI spec (JSON) gives containers `libcuda.so.1` in `/usr/local/nvidia/lib64`: a
/// mount of the file itself, or of a driver bundle (mounted at `/usr/local/nvidia`) that holds it.
fn mounts_libcuda(spec: &str) -> bool {
    let Ok(v) = serde_json::from_str::<serde_json::Value>(spec) else {
        return false;
    };
    let edits = std::iter::once(&v["containerEdits"]).chain(
        v["devices"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|d| &d["containerEdits"]),
    );
    edits
        .flat_map(|e| e["mounts"].as_array().into_iter().flatten())
        .any(|m| match (m["containerPath"].as_str(), m["hostPath"].as_str()) {
            (Some("/usr/local/nvidia/lib64/libcuda.so.1"), _) => true,
            (Some("/usr/local/nvidia"), Some(host)) => Path::new(host).join("lib64/libcuda.so.1").exists(),
            _ => false,
        })
}

/// The driver's per-cgroup memory limit on a share's container (r615+): set by the NRI plugin at
/// the container's start, read back here through NVML on the container's cgroup while the probe
/// fills the share. SKIP, naming the driver's version, where the driver has no such limits.
async fn per_cgroup_memory(
    s: &mut Stack,
    dry: bool,
    share: AllocatedDevice,
    driver: &str,
) -> anyhow::Result<(String, Verdict)> {
    use tessera_node::memory_limits::{CgroupMemoryLimits, NvmlMemoryLimits, cgroup_of_process, cgroup2_root};
    let limits = if dry {
        None
    } else {
        NvmlMemoryLimits::open(NvmlSource::default().library_path().ok().as_deref()).ok()
    };
    let Some(limits) = limits else {
        return Ok((
            format!("driver {driver}: no per-cgroup memory limits (they came with r615)"),
            Verdict::Skip,
        ));
    };
    let root = cgroup2_root().context("no cgroup v2 hierarchy is mounted")?;
    let uuid = share.uuid().to_string();
    let pod = s.pod("per-cgroup", vec![share], false).await?;
    let spec = s.spec(&["/probe", "--fill", "--hold-ms", "5000"], &SHARE);
    let id = match s.create(&pod, spec).await {
        Ok(id) => id,
        Err(e) => return Ok((e, Verdict::Fail)),
    };
    s.start(&id).await?;
    let pid = s.c.task_pid(&id).await?;
    let got = cgroup_of_process(Path::new("/proc"), pid, &root)
        .map_err(|e| e.to_string())
        .and_then(|cgroup| limits.get(&uuid, &cgroup).map_err(|e| e.to_string()));
    let (code, out) = s.wait(&id, 60).await?;
    let kv = parse(&out);
    let want = 8192u64 << 20;
    let set = matches!(&got, Ok(Some(l)) if l.hard == want);
    let filled = num(&kv, "filled_mib").is_some_and(|m| m <= 8192.0);
    let said = match got {
        Ok(Some(l)) => format!("hard {} MiB, soft {} MiB on the cgroup", l.hard >> 20, l.soft >> 20),
        Ok(None) => "no limit on the container's cgroup".into(),
        Err(e) => e,
    };
    Ok((
        format!("driver {driver}: {said}; {}", summary(&kv)),
        pass(set && filled && code == 0),
    ))
}

/// Three processes of one 30% + 8 GiB share, filling and benchmarking at once (in `mode`): on
/// a GPU their memory together is at most the share; dry, each is preloaded with the hook and
/// its 8 GiB. Their throughput together, against the whole card's `base`, is shown.
async fn three_processes(
    s: &mut Stack,
    dry: bool,
    mode: &str,
    share: AllocatedDevice,
    base: Baseline,
) -> anyhow::Result<(String, Verdict)> {
    let pod = s.pod(&format!("three-{mode}"), vec![share], false).await?;
    let one = "/probe --fill --hold-ms 3000 --bench-ms 4000";
    let cmd = format!("{one} > /tmp/p1 & {one} > /tmp/p2 & {one} > /tmp/p3 & wait; cat /tmp/p1 /tmp/p2 /tmp/p3");
    let spec = s.spec(&["sh", "-c", &cmd], &SHARE);
    let (verdict, observed) = match s.run(&pod, spec).await {
        Ok((_, out)) => {
            let sum = |key: &str| -> f64 {
                out.lines()
                    .filter_map(|l| l.strip_prefix(&format!("{key}=")))
                    .filter_map(|v| v.trim().parse::<f64>().ok())
                    .sum()
            };
            let hooked = out.lines().filter(|l| l.starts_with("hook_memory=8192")).count();
            // MPS shares' processes take turns; hook shares' launch in the container's window
            // of the card's time.
            let compute = if mode == "mps" { "turns" } else { "windows" };
            let held_so = out
                .lines()
                .filter(|l| l.strip_prefix("hook_compute=") == Some(compute))
                .count();
            if dry {
                (
                    pass(hooked == 3 && held_so == 3),
                    format!("{hooked} of 3 processes preloaded with an 8 GiB hook, {held_so} with compute={compute}"),
                )
            } else {
                let held = sum("filled_mib");
                let x = base.rate.map(|b| sum("kernels_per_s") / b);
                // The share is 0.30x; its processes' own windows overlap only roughly.
                (
                    pass(held > 0.0 && held <= 8192.0 && x.is_some_and(|x| x > 0.0 && x <= 0.40)),
                    format!(
                        "{held} MiB held together; {} the whole card's throughput together",
                        x.map_or("-".into(), |x| format!("{x:.2}x"))
                    ),
                )
            }
        }
        Err(e) => (Verdict::Fail, e),
    };
    Ok((observed, verdict))
}
