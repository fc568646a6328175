//! `tessera-gpu-e2e`: Tessera's node stack on a real GPU, case by case, on containerd 1.7 and
//! 2.x, printed as a table (runtime, case, expected, observed, verdict). Run by
//! `tests/gpu/run.sh`, which builds the CUDA probe image; see that script.
//!
//! The spec comes from `tessera-cdi-generator generate` with no flags (NVML, the driver found
//! where the node keeps it), the NRI plugin is the release binary connected to each containerd,
//! and containers are created through CRI as the kubelet creates them. With `--dry-run` (no
//! GPU) the same cases run against a fixture node and a shell probe, which checks the plumbing,
//! not CUDA.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tessera_core::handoff::{AllocatedDevice, Allocation, ContainerAllocation, SigningKeys};
use tessera_core::inventory::{InventorySource, NodeInventory, NvmlSource};
use tessera_core::names::{ANNOTATION_ALLOCATION, ANNOTATION_ALLOCATION_SIGNATURE};
use tessera_core::request::ContainerRole;
use tessera_proto::cri;
use tessera_tests::containerd::{ContainerSpec, Containerd, Pod, Version};
use tessera_tests::fake_node::{FakeNodePaths, fake_node};

const NODE: &str = "gpu-node";
const PROBE_IMAGE: &str = "docker.io/tessera/probe:gpu";

struct Args {
    bin_dir: PathBuf,
    probe_image: PathBuf,
    dry_run: bool,
    out: Option<PathBuf>,
}

fn args() -> anyhow::Result<Args> {
    let mut a = Args {
        bin_dir: PathBuf::new(),
        probe_image: PathBuf::new(),
        dry_run: false,
        out: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        match k.as_str() {
            "--bin-dir" => a.bin_dir = it.next().context("--bin-dir DIR")?.into(),
            "--probe-image" => a.probe_image = it.next().context("--probe-image TAR")?.into(),
            "--out" => a.out = Some(it.next().context("--out FILE")?.into()),
            "--dry-run" => a.dry_run = true,
            other => {
                bail!("unknown argument {other:?}; usage: --bin-dir DIR --probe-image TAR [--dry-run] [--out FILE]")
            }
        }
    }
    anyhow::ensure!(
        a.bin_dir.join("tessera-nri-plugin").exists(),
        "--bin-dir must hold the release binaries"
    );
    anyhow::ensure!(
        a.probe_image.exists(),
        "--probe-image {} does not exist",
        a.probe_image.display()
    );
    Ok(a)
}

/// One row of the table.
struct Row {
    runtime: String,
    case: &'static str,
    expected: String,
    observed: String,
    pass: bool,
}

/// The probe's `key=value` lines.
fn parse(out: &str) -> BTreeMap<String, String> {
    out.lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect()
}

fn summary(kv: &BTreeMap<String, String>) -> String {
    let get = |k: &str| kv.get(k).map(String::as_str).unwrap_or("-");
    let mut s = format!("devices={}", get("devices"));
    for k in ["name", "sms", "mem_total_mib", "alloc", "kernels_per_s", "error"] {
        if let Some(v) = kv.get(k) {
            let _ = write!(s, " {k}={v}");
        }
    }
    s
}

struct Stack {
    c: Containerd,
    keys: SigningKeys,
    inv: NodeInventory,
    plugin: Child,
    plugin_log: PathBuf,
    pods: usize,
    dry_run: bool,
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

    fn spec(&self, name: &str, cmd: &[&str], amounts: &[(&str, &str)]) -> ContainerSpec {
        let mut spec = ContainerSpec::new(name, cmd).image(PROBE_IMAGE);
        for (k, v) in amounts {
            spec = spec.annotation(&format!("tessera.io/allocated.{k}"), v);
        }
        spec
    }

    /// Creates a container; the error text when the runtime refuses it.
    async fn create(&mut self, pod: &Pod, spec: ContainerSpec) -> Result<String, String> {
        self.c.create_container(pod, spec).await.map_err(|e| format!("{e:#}"))
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

    fn probe(&self, extra: &[&'static str]) -> Vec<&'static str> {
        let mut v = vec!["/probe"];
        v.extend_from_slice(extra);
        v
    }
}

fn write_keys(dir: &Path) -> anyhow::Result<SigningKeys> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("active"), "k1")?;
    std::fs::write(dir.join("k1"), [7u8; 32])?;
    Ok(SigningKeys::from_dir(dir)?)
}

/// Starts the release NRI plugin against `c` and waits for it to register.
fn start_plugin(bin_dir: &Path, c: &Containerd, keys: &Path, log: &Path) -> anyhow::Result<Child> {
    let f = std::fs::File::create(log)?;
    let child = Command::new(bin_dir.join("tessera-nri-plugin"))
        .arg("run")
        .arg("--socket")
        .arg(c.nri_socket())
        .arg("--keys-dir")
        .arg(keys)
        .arg("--cdi-dir")
        .arg(c.cdi_dir())
        .arg("--node-name")
        .arg(NODE)
        .stdin(Stdio::null())
        .stdout(f.try_clone()?)
        .stderr(f)
        .spawn()
        .context("starting tessera-nri-plugin")?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while !std::fs::read_to_string(log)
        .unwrap_or_default()
        .contains("synchronized")
    {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the NRI plugin did not synchronise:\n{}",
            std::fs::read_to_string(log)?
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(child)
}

/// The spec: on a GPU, `tessera-cdi-generator generate` with no flags (its case row); dry,
/// from the fixture on a fake node.
fn generate_spec(
    a: &Args,
    c: &Containerd,
    work: &Path,
    rows: &mut Vec<Row>,
    runtime: &str,
) -> anyhow::Result<NodeInventory> {
    let generator = a.bin_dir.join("tessera-cdi-generator");
    let (out, inv) = if a.dry_run {
        let inv = fake_node("h100x8", work)?;
        let paths = FakeNodePaths::under(work);
        let out = Command::new(&generator)
            .args(["generate", "--fixture", "h100x8", "--driver-root"])
            .arg(&paths.driver_root)
            .arg("--dev-root")
            .arg(&paths.dev_root)
            .arg("--output")
            .arg(c.cdi_dir())
            .output()?;
        (out, inv)
    } else {
        let out = Command::new(&generator)
            .arg("generate")
            .arg("--output")
            .arg(c.cdi_dir())
            .output()?;
        (
            out,
            NvmlSource::default()
                .discover()
                .context("reading the GPU through NVML")?,
        )
    };
    let spec = std::fs::read_to_string(c.cdi_dir().join("tessera.io-gpu.json")).unwrap_or_default();
    let libcuda = spec.contains("/usr/local/nvidia/lib64/libcuda.so.1");
    let driver = Command::new(&generator).arg("driver").output()?;
    let root = String::from_utf8_lossy(&driver.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("driver root:").map(|r| r.trim().to_string()))
        .unwrap_or_else(|| "-".into());
    rows.push(Row {
        runtime: runtime.into(),
        case: "spec generated with no flags",
        expected: "exit 0; libcuda.so.1 mounted; driver root detected".into(),
        observed: format!(
            "exit {}; libcuda {}; {} driver file(s); root {root}",
            out.status.code().unwrap_or(-1),
            if libcuda { "mounted" } else { "MISSING" },
            inv.driver_files.len()
        ),
        pass: out.status.success() && libcuda,
    });
    Ok(inv)
}

async fn cases(a: &Args, version: Version) -> anyhow::Result<Vec<Row>> {
    let c = Containerd::start(version).await?;
    let runtime = format!("containerd {}", c.package_version());
    c.import_image(&a.probe_image)?;
    let work = tempfile::tempdir()?;
    let mut rows = Vec::new();
    let inv = generate_spec(a, &c, work.path(), &mut rows, &runtime)?;
    let keys_dir = work.path().join("keys");
    let keys = write_keys(&keys_dir)?;
    let plugin_log = work.path().join("plugin.log");
    let plugin = start_plugin(&a.bin_dir, &c, &keys_dir, &plugin_log)?;
    let mut s = Stack {
        c,
        keys,
        inv,
        plugin,
        plugin_log,
        pods: 0,
        dry_run: a.dry_run,
    };
    let gpu = s.inv.gpus.first().context("no GPU in the inventory")?.clone();
    let row = |case, expected: String, observed: String, pass| Row {
        runtime: runtime.clone(),
        case,
        expected,
        observed,
        pass,
    };

    // Whole card: the baseline for every ratio below.
    let pod = s.pod("whole", vec![AllocatedDevice::whole(&gpu)], false).await?;
    let spec = s.spec("main", &s.probe(&["--bench-ms", "3000"]), &[("gpu-core", "100")]);
    let (whole, whole_rate) = match s.run(&pod, spec).await {
        Ok((code, out)) => {
            let kv = parse(&out);
            let ok = code == 0 && kv.get("devices").map(String::as_str) == Some("1");
            let rate = kv.get("kernels_per_s").and_then(|v| v.parse::<f64>().ok());
            ((ok, summary(&kv)), rate)
        }
        Err(e) => ((false, e), None),
    };
    rows.push(row(
        "whole card",
        format!("1 device ({}), all SMs, {} MiB", gpu.model, gpu.memory_mib),
        whole.1,
        whole.0,
    ));

    // A 30% + 8 GiB share.
    let share = AllocatedDevice::share(&gpu, 30, 8192);
    let amounts = [("gpu-core", "30"), ("gpu-memory", "8"), ("gpu-memory-mib", "8192")];
    let pod = s.pod("share", vec![share.clone()], false).await?;
    let spec = s.spec("main", &s.probe(&["--alloc-gib", "20", "--bench-ms", "3000"]), &amounts);
    let (pass, observed) = match s.run(&pod, spec).await {
        Ok((code, out)) => {
            let kv = parse(&out);
            let ratio = kv
                .get("kernels_per_s")
                .and_then(|v| v.parse::<f64>().ok())
                .zip(whole_rate)
                .map(|(r, w)| format!(" throughput {:.2}x whole", r / w))
                .unwrap_or_default();
            (
                code == 0 && kv.get("devices").map(String::as_str) == Some("1"),
                summary(&kv) + &ratio,
            )
        }
        Err(e) => (false, e),
    };
    rows.push(row(
        "30% + 8 GiB share",
        "1 device (limits: not enforced without MPS or the hook)".into(),
        observed,
        pass,
    ));

    // Two shares at the same time on the same card.
    let mut ids = Vec::new();
    for n in ["share-a", "share-b"] {
        let pod = s.pod(n, vec![share.clone()], false).await?;
        let spec = s.spec("main", &s.probe(&["--bench-ms", "3000"]), &amounts);
        ids.push(s.create(&pod, spec).await);
    }
    let mut outs = Vec::new();
    for id in ids.iter().flatten() {
        s.start(id).await?;
    }
    for id in ids.iter().flatten() {
        outs.push(s.wait(id, 120).await.map(|(c, o)| (c, parse(&o))));
    }
    let both = outs.len() == 2
        && outs
            .iter()
            .all(|r| matches!(r, Ok((0, kv)) if kv.get("devices").map(String::as_str) == Some("1")));
    rows.push(row(
        "two shares at once",
        "both run on the card at the same time".into(),
        outs.iter()
            .map(|r| match r {
                Ok((_, kv)) => summary(kv),
                Err(e) => format!("{e:#}"),
            })
            .chain(ids.iter().filter_map(|r| r.as_ref().err().cloned()))
            .collect::<Vec<_>>()
            .join(" | "),
        both,
    ));

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
    let (pass, observed) = match s.run(&pod, spec).await {
        Ok((_, out)) => {
            let kv = parse(&out);
            let nodes = out.lines().next().unwrap_or("?").trim().to_string();
            (
                nodes == "0"
                    && kv.get("devices").map(String::as_str) == Some("0")
                    && kv.get("CUDA_VISIBLE_DEVICES").map(String::as_str) == Some(""),
                format!("{nodes} /dev/nvidia* node(s); {}", summary(&kv)),
            )
        }
        Err(e) => (false, e),
    };
    rows.push(row(
        "no GPU, NVIDIA_VISIBLE_DEVICES=all",
        "no device node, CUDA sees 0 devices".into(),
        observed,
        pass,
    ));

    // A forged hand-off: refused at creation.
    let pod = s.pod("forged", vec![share.clone()], true).await?;
    let spec = s.spec("main", &["/probe"], &[("gpu-core", "100")]);
    let (pass, observed) = match s.create(&pod, spec).await {
        Ok(id) => (false, format!("created {id}")),
        Err(e) => (e.contains("forged"), e.chars().take(140).collect()),
    };
    rows.push(row("forged hand-off", "refused, saying forged".into(), observed, pass));

    // nvidia-smi inside a GPU container.
    let pod = s.pod("smi", vec![AllocatedDevice::whole(&gpu)], false).await?;
    let cmd: &[&str] = if s.dry_run {
        &[
            "sh",
            "-c",
            "test -f /usr/bin/nvidia-smi && echo 'GPU 0: (dry run: nvidia-smi mounted)'",
        ]
    } else {
        &["nvidia-smi", "-L"]
    };
    let spec = s.spec("main", cmd, &[("gpu-core", "100")]);
    let (pass, observed) = match s.run(&pod, spec).await {
        Ok((code, out)) => (
            code == 0 && out.contains("GPU 0"),
            out.lines().next().unwrap_or("").to_string(),
        ),
        Err(e) => (false, e),
    };
    rows.push(row(
        "nvidia-smi in a GPU container",
        "lists GPU 0".into(),
        observed,
        pass,
    ));

    let _ = s.plugin.kill();
    let _ = s.plugin.wait();
    if rows.iter().any(|r| !r.pass) {
        eprintln!(
            "plugin log:\n{}",
            std::fs::read_to_string(&s.plugin_log).unwrap_or_default()
        );
        eprintln!("containerd log:\n{}", s.c.log_tail(30));
    }
    Ok(rows)
}

fn table(rows: &[Row]) -> String {
    let w = |f: &dyn Fn(&Row) -> usize| rows.iter().map(f).max().unwrap_or(0);
    let (w0, w1, w2) = (w(&|r| r.runtime.len()), w(&|r| r.case.len()), w(&|r| r.expected.len()));
    let mut s = String::new();
    for r in rows {
        let _ = writeln!(
            s,
            "{:<w0$} | {:<w1$} | {:<w2$} | {} | {}",
            r.runtime,
            r.case,
            r.expected,
            if r.pass { "PASS" } else { "FAIL" },
            r.observed
        );
    }
    s
}

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() -> anyhow::Result<()> {
    let a = args()?;
    let mut rows = Vec::new();
    for v in Version::ALL {
        match cases(&a, v).await {
            Ok(r) => rows.extend(r),
            Err(e) => rows.push(Row {
                runtime: format!("{v:?}"),
                case: "setup",
                expected: "the stack comes up".into(),
                observed: format!("{e:#}"),
                pass: false,
            }),
        }
    }
    let text = table(&rows);
    print!("{text}");
    if let Some(out) = &a.out {
        std::fs::write(out, &text)?;
    }
    if rows.iter().any(|r| !r.pass) {
        std::process::exit(1);
    }
    Ok(())
}
