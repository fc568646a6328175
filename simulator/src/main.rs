//! `tessera-simulator`: compares placement policies on a cluster trace.
//!
//! It replays the trace (the embedded default when none is given) through the placement
//! engine, once per policy and seed, and prints how much of the GPU
//! capacity each policy allocated as the workload arrived, then a summary of who wins and what
//! the figures mean; writes the chart (SVG) and, on request, CSV and JSON. A trace is checked
//! before the run (see [`tessera_simulator::check`]).

// Production functions stay under clippy.toml's length (tests may run long; CONTRIBUTING.md).
#![cfg_attr(not(test), deny(clippy::too_many_lines))]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, anyhow, bail};
use clap::{Args, Parser};
use indicatif::{ProgressBar, ProgressStyle};
use tessera_core::placement::PodDemand;
use tessera_simulator::{self as simulate, Scenario, chart, check, embedded, report, summary, trace};

/// Replay a cluster trace through Tessera's placement engine (the embedded default when no
/// trace is given) and compare policies.
#[derive(Parser)]
#[command(name = "tessera-simulator", version, about)]
struct Cli {
    #[command(flatten)]
    args: SimulateArgs,
}

#[derive(Args)]
struct SimulateArgs {
    /// Directory of the Alibaba openb CSVs (cluster-trace-gpu-v2023).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Pod list variant in --trace: default, cpu050, gpushare40, gpuspec10, multigpu20.
    #[arg(long, default_value = "default", value_parser = ["default", "cpu050", "gpushare40", "gpuspec10", "multigpu20"])]
    variant: String,
    /// Node list CSV (overrides --trace's).
    #[arg(long)]
    nodes: Option<PathBuf>,
    /// Pod list CSV (overrides --trace's).
    #[arg(long)]
    pods: Option<PathBuf>,
    /// Policies to compare, comma-separated; `node/card` (e.g. `fgd/mosaic`) sets the two tiers
    /// apart.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "random,spread,binpack,bestfit,fgd,mosaic"
    )]
    policies: Vec<simulate::Policies>,
    /// Seeds: a range `42..51` (inclusive) or a list `42,43`.
    #[arg(long, default_value = "42..51", allow_hyphen_values = true)]
    seeds: String,
    /// Worker threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Directory for the chart (SVG) and, on request, CSV and JSON.
    #[arg(long, default_value = "target/simulate")]
    out_dir: PathBuf,
    /// Also write the per-point means as CSV.
    #[arg(long)]
    csv: bool,
    /// Also write every run's samples as JSON.
    #[arg(long)]
    json: bool,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

/// The most seeds one run takes (each seed is a full replay per policy).
const MAX_SEEDS: u64 = 1000;

fn parse_seeds(s: &str) -> anyhow::Result<Vec<u64>> {
    let bad = || format!("--seeds={s:?}: expected a range like 42..51 or a list like 42,43");
    let seeds: Vec<u64> = if let Some((a, b)) = s.split_once("..") {
        let (a, b): (u64, u64) = (a.trim().parse().with_context(bad)?, b.trim().parse().with_context(bad)?);
        if a > b {
            bail!(bad());
        }
        if b - a >= MAX_SEEDS {
            bail!(
                "--seeds={s:?}: {} seeds; at most {MAX_SEEDS} in one run",
                u128::from(b - a) + 1
            );
        }
        (a..=b).collect()
    } else {
        s.split(',')
            .map(|x| x.trim().parse::<u64>().with_context(bad))
            .collect::<anyhow::Result<_>>()?
    };
    if seeds.len() as u64 > MAX_SEEDS {
        bail!("--seeds={s:?}: {} seeds; at most {MAX_SEEDS} in one run", seeds.len());
    }
    if let Some(d) = seeds
        .iter()
        .enumerate()
        .find_map(|(i, x)| seeds[..i].contains(x).then_some(x))
    {
        bail!("--seeds={s:?}: seed {d} given twice");
    }
    Ok(seeds)
}

/// Seeds as the user wrote them: a range when they follow each other.
fn show_seeds(seeds: &[u64]) -> String {
    match (seeds.first(), seeds.last()) {
        (Some(a), Some(b)) if seeds.len() > 2 && b - a + 1 == seeds.len() as u64 => format!("{a}..{b}"),
        _ => seeds.iter().map(u64::to_string).collect::<Vec<_>>().join(","),
    }
}

fn peak_rss_mib() -> f64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes only into the struct it is given.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) };
    if rc != 0 {
        return f64::NAN;
    }
    // SAFETY: initialised by the successful call above (and zeroed before it).
    let usage = unsafe { usage.assume_init() };
    usage.ru_maxrss as f64 / 1024.0
}

/// A write to standard output that failed (a full disk, a closed pipe).
#[derive(Debug, thiserror::Error)]
#[error("cannot write to standard output")]
struct StdoutError(#[source] std::io::Error);

/// Writes `text` to `out`.
fn say(out: &mut dyn Write, text: std::fmt::Arguments<'_>) -> Result<(), StdoutError> {
    out.write_fmt(text).map_err(StdoutError)
}

/// A line on standard error (progress, errors); a failed write there is dropped.
fn note(text: std::fmt::Arguments<'_>) {
    let _ = writeln!(std::io::stderr(), "{text}");
}

/// The flags that need no input read.
fn validate(args: &SimulateArgs) -> anyhow::Result<Vec<u64>> {
    let seeds = parse_seeds(&args.seeds)?;
    if args.threads == Some(0) {
        bail!("--threads=0: at least 1");
    }
    if let Some(p) = args
        .policies
        .iter()
        .enumerate()
        .find_map(|(i, p)| args.policies[..i].contains(p).then_some(p))
    {
        bail!("--policies: {p} given twice");
    }
    Ok(seeds)
}

/// Makes the output directory and writes a file in it, so that a directory that cannot take
/// the chart is refused before the run, not after it.
fn probe_out_dir(dir: &Path) -> anyhow::Result<()> {
    let bad = |what: &str| {
        format!(
            "--out-dir={}: cannot {what} (the chart is written there)",
            dir.display()
        )
    };
    std::fs::create_dir_all(dir).with_context(|| bad("create it"))?;
    let probe = dir.join(format!(".tessera-simulator-probe-{}", std::process::id()));
    std::fs::write(&probe, b"probe").with_context(|| bad("write in it"))?;
    std::fs::remove_file(&probe).with_context(|| bad("remove a file from it"))?;
    Ok(())
}

/// The inputs: the trace's files, or the embedded default.
struct Inputs {
    /// A label for reports (the pod list's stem).
    name: String,
    /// Where the nodes and the tasks come from, for messages.
    nodes_from: String,
    tasks_from: String,
    nodes: Vec<trace::TraceNode>,
    tasks: Vec<trace::TraceTask>,
    /// The embedded default (no files).
    embedded: bool,
}

const EMBEDDED: &str = "the embedded default";

fn load(args: &SimulateArgs) -> anyhow::Result<Inputs> {
    let nodes_path = args
        .nodes
        .clone()
        .or_else(|| args.trace.as_ref().map(|d| d.join("openb_node_list_gpu_node.csv")));
    let pods_path = args.pods.clone().or_else(|| {
        args.trace
            .as_ref()
            .map(|d| d.join(format!("openb_pod_list_{}.csv", args.variant)))
    });
    let inputs = match (&nodes_path, &pods_path) {
        (None, None) => Inputs {
            name: "embedded default".to_string(),
            nodes_from: EMBEDDED.into(),
            tasks_from: EMBEDDED.into(),
            nodes: embedded::nodes(),
            tasks: embedded::tasks(),
            embedded: true,
        },
        (Some(n), Some(p)) => Inputs {
            name: p
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default(),
            nodes_from: n.display().to_string(),
            tasks_from: p.display().to_string(),
            nodes: trace::read_nodes(n)?,
            tasks: trace::read_tasks(p)?,
            embedded: false,
        },
        _ => bail!("give both --nodes and --pods, or --trace"),
    };
    if inputs.nodes.iter().all(|n| n.gpus == 0) {
        bail!(
            "{}: no node with a GPU ({} node(s)): nothing to place GPU tasks on",
            inputs.nodes_from,
            inputs.nodes.len()
        );
    }
    if inputs.tasks.is_empty() {
        bail!("{}: no task to replay", inputs.tasks_from);
    }
    Ok(inputs)
}

/// The scenario of `inputs`, checked: refused when it cannot be run in bounded work or none of
/// it fits.
fn scenario(inputs: &Inputs) -> anyhow::Result<(Scenario, check::Plan)> {
    let demands: Vec<PodDemand> = inputs.tasks.iter().map(trace::TraceTask::demand).collect();
    let scenario = Scenario::new(inputs.name.clone(), trace::cluster_of(&inputs.nodes), demands);
    let name = |i: usize| inputs.tasks[i].name.clone();
    let plan = check::check(&scenario, &name).map_err(|e| {
        if inputs.embedded {
            anyhow!("{EMBEDDED}: {e}")
        } else {
            anyhow!("{} on the nodes of {}: {e}", inputs.tasks_from, inputs.nodes_from)
        }
    })?;
    Ok((scenario, plan))
}

fn simulate(args: SimulateArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    let seeds = validate(&args)?;
    let inputs = load(&args)?;
    let (scenario, plan) = scenario(&inputs)?;
    probe_out_dir(&args.out_dir)?;
    let capacity = scenario.cluster.gpu_capacity_milli();
    let requested: u64 = scenario.tasks.iter().map(PodDemand::gpu_milli).sum();
    say(
        out,
        format_args!(
            "{}: {} nodes, {} GPUs, {} tasks ({:.1}% of GPU capacity); {} workload classes; seeds {}; policies {}\n",
            inputs.name,
            inputs.nodes.len(),
            capacity / 1000,
            inputs.tasks.len(),
            100.0 * requested as f64 / capacity.max(1) as f64,
            scenario.workload.classes.len(),
            show_seeds(&seeds),
            args.policies
                .iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
                .join(",")
        ),
    )?;
    if let Some(w) = plan.warning() {
        say(out, format_args!("{w}\n"))?;
    }
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let runs = (args.policies.len() * seeds.len()) as u64;
    let (results, wall) = replay(&scenario, &args, &seeds, threads, plan.tasks_per_run * runs);
    let series = report::summarize(&results);
    say(out, format_args!("{}", report::text(&series)))?;
    say(
        out,
        format_args!(
            "\n{} runs ({} policies x {} seeds) on {threads} thread(s): wall {:.1} s, peak RSS {:.0} MiB\n",
            results.len(),
            args.policies.len(),
            seeds.len(),
            wall.as_secs_f64(),
            peak_rss_mib()
        ),
    )?;
    write_files(&args, &inputs.name, &series, &results, out)?;
    let workload = if inputs.embedded {
        embedded::DESCRIPTION.to_string()
    } else {
        format!("the trace {} on the nodes of {}.", inputs.tasks_from, inputs.nodes_from)
    };
    let never_fit = plan.never_fit_sentence();
    let ctx = summary::Context {
        capacity_gpus: capacity as f64 / 1000.0,
        workload: &workload,
        never_fit: never_fit.as_deref(),
    };
    say(out, format_args!("{}", summary::text(&series, &results, &ctx)))?;
    out.flush().map_err(StdoutError)?;
    Ok(())
}

/// Runs every policy with every seed, with a progress bar on a terminal and a line at each
/// tenth of the runs off one; `total` is the expected number of tasks submitted.
fn replay(
    scenario: &Scenario,
    args: &SimulateArgs,
    seeds: &[u64],
    threads: usize,
    total: u64,
) -> (Vec<simulate::RunResult>, std::time::Duration) {
    let bar = if args.quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(total)
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {percent}% {elapsed}/{duration} {msg}").expect("valid template"),
    );
    let start = Instant::now();
    // Off a terminal the bar is not drawn: a line at each tenth of the runs instead, so that a
    // long run logged to a file still says where it is.
    let lines = !args.quiet && !std::io::IsTerminal::is_terminal(&std::io::stderr());
    let done = std::sync::atomic::AtomicU64::new(0);
    let tick = || {
        bar.inc(1);
        let d = done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        // `total` is an estimate: nothing is said past it.
        if lines && d < total && d * 10 / total > (d - 1) * 10 / total {
            let elapsed = start.elapsed().as_secs_f64();
            note(format_args!(
                "simulate: {}% ({d} of about {total} tasks placed), {elapsed:.0} s elapsed, about {:.0} s left",
                d * 100 / total,
                elapsed * (total - d) as f64 / d as f64
            ));
        }
    };
    let results = simulate::run_all(scenario, &args.policies, seeds, threads, &tick);
    if lines {
        note(format_args!(
            "simulate: done, {} runs in {:.1} s",
            results.len(),
            start.elapsed().as_secs_f64()
        ));
    }
    bar.finish_and_clear();
    (results, start.elapsed())
}

/// Writes the chart and, on request, the CSV and JSON, and says where.
fn write_files(
    args: &SimulateArgs,
    name: &str,
    series: &[report::PolicySeries],
    results: &[simulate::RunResult],
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.out_dir).with_context(|| format!("creating {}", args.out_dir.display()))?;
    let stem = name.replace(' ', "-");
    let chart_path = args.out_dir.join(format!("{stem}.svg"));
    std::fs::write(
        &chart_path,
        chart::svg(&format!("GPU allocation ratio, {name}"), series),
    )
    .with_context(|| format!("writing {}", chart_path.display()))?;
    say(out, format_args!("chart: {}\n", chart_path.display()))?;
    if args.csv {
        let p = args.out_dir.join(format!("{stem}.csv"));
        std::fs::write(&p, report::csv(series)).with_context(|| format!("writing {}", p.display()))?;
        say(out, format_args!("csv: {}\n", p.display()))?;
    }
    if args.json {
        let p = args.out_dir.join(format!("{stem}.json"));
        std::fs::write(&p, serde_json::to_string(results)?).with_context(|| format!("writing {}", p.display()))?;
        say(out, format_args!("json: {}\n", p.display()))?;
    }
    Ok(())
}

/// A command whose output goes to a reader that may stop early (`| head`) ends quietly when it
/// does, as Unix tools do (Rust ignores SIGPIPE, so a print would panic). Only for commands
/// that print: a server keeps SIGPIPE ignored, its socket writes get errors instead.
fn quiet_on_closed_stdout() {
    // SAFETY: restoring the default disposition of one signal, before any thread that could
    // race on it prints.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

fn main() -> ExitCode {
    quiet_on_closed_stdout();
    let args = Cli::parse().args;
    let Err(e) = simulate(args, &mut std::io::stdout()) else {
        return ExitCode::SUCCESS;
    };
    // A reader that stopped early (with SIGPIPE blocked, so that the write says so instead of
    // the signal ending the process) is no error: end quietly, as `head` expects.
    if e.downcast_ref::<StdoutError>()
        .is_some_and(|s| s.0.kind() == std::io::ErrorKind::BrokenPipe)
    {
        return ExitCode::SUCCESS;
    }
    note(format_args!("Error: {e:?}"));
    ExitCode::FAILURE
}
