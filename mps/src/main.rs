// Production functions stay under clippy.toml's length (tests may run long; CONTRIBUTING.md).
#![cfg_attr(not(test), deny(clippy::too_many_lines))]

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use tessera_core::enforcement::{DEFAULT_MPS_ROOT, MpsLayout};
use tessera_core::flags::{host_path, interval};
use tessera_core::inventory::{FixtureSource, InventorySource};
use tessera_mps::control::MpsBinaries;
use tessera_mps::supervisor::{Backoff, DEFAULT_SHM_MIB, Supervisor, SupervisorConfig};
use tessera_node::inventory::NvmlSource;
use tracing::{info, warn};

/// Tessera's MPS supervisor: one NVIDIA MPS control daemon per card that can host shares.
#[derive(Parser)]
#[command(name = "tessera-mps-supervisor", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run and supervise the daemons until SIGTERM.
    Run(RunArgs),
    /// Print each card's daemon state; exit 1 unless every daemon is ready (readiness probe).
    Status {
        /// Where the daemons' directories and state are.
        #[arg(long, env = "TESSERA_MPS_ROOT", default_value = DEFAULT_MPS_ROOT, value_parser = host_path)]
        mps_root: PathBuf,
    },
    /// (Internal) run a daemon with its card's shm directory as /dev/shm.
    #[command(hide = true)]
    ExecDaemon {
        #[arg(long)]
        shm: PathBuf,
        /// The supervisor's pid: the daemon is killed when it dies.
        #[arg(long)]
        parent: Option<i32>,
        #[arg(last = true, required = true)]
        argv: Vec<OsString>,
    },
}

#[derive(Parser)]
struct RunArgs {
    /// Where the daemons' directories and state are (a host path, shared with the NRI plugin
    /// and the share containers).
    #[arg(long, env = "TESSERA_MPS_ROOT", default_value = DEFAULT_MPS_ROOT, value_parser = host_path)]
    mps_root: PathBuf,
    /// Where this process sees the host's / (the node DaemonSet mounts it at /host).
    #[arg(long, default_value = "/", value_parser = host_path)]
    host_root: PathBuf,
    /// Host directory of the NVIDIA driver (default: detected).
    #[arg(long, value_parser = host_path)]
    driver_root: Option<PathBuf>,
    /// Fixture file (or built-in name) instead of NVML, for tests.
    #[arg(long)]
    fixture: Option<PathBuf>,
    /// nvidia-cuda-mps-control to run instead of the driver's (tests use a fake).
    #[arg(long)]
    control_binary: Option<PathBuf>,
    /// Seconds between health checks of each daemon.
    #[arg(long, default_value_t = 5, value_parser = interval)]
    check_secs: u64,
    /// First restart delay, milliseconds (doubles up to a minute).
    #[arg(long, default_value_t = 1000, value_parser = interval)]
    backoff_ms: u64,
    /// Seconds between re-reads of the node's GPUs.
    #[arg(long, default_value_t = 30, value_parser = interval)]
    inventory_secs: u64,
    /// Size of each card's shm tmpfs in MiB (the card's share containers see it as /dev/shm
    /// and share it with the card's MPS server).
    #[arg(long, default_value_t = DEFAULT_SHM_MIB, value_parser = clap::value_parser!(u64).range(16..=1 << 20))]
    shm_mib: u64,
    /// Put each card MPS serves in exclusive-process compute mode while its daemon runs (set
    /// back to default when the card stops hosting shares): a CUDA process that goes around
    /// MPS is refused the card. Needs root on the host; costs every context on the card
    /// outside MPS (docs/operations.md).
    #[arg(long)]
    exclusive_process: bool,
    /// nvidia-smi to set compute modes with instead of the driver's (tests use a fake).
    #[arg(long)]
    nvidia_smi: Option<PathBuf>,
}

/// Cards that can host shares: healthy and not in MIG mode.
fn share_cards(source: &dyn InventorySource) -> anyhow::Result<Vec<String>> {
    let inv = source.discover().context("reading the node's GPUs")?;
    Ok(inv
        .gpus
        .iter()
        .filter(|g| !g.mig_enabled && g.health.is_healthy())
        .map(|g| g.uuid.clone())
        .collect())
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    let nvml = NvmlSource {
        host_root: args.host_root.clone(),
        driver_root: args.driver_root.clone(),
        ..Default::default()
    };
    let source: Box<dyn InventorySource + Send + Sync> = match &args.fixture {
        Some(f) => Box::new(FixtureSource::readable(f).map_err(|e| anyhow::anyhow!("--fixture {}: {e}", f.display()))?),
        None => Box::new(nvml.clone()),
    };
    let binaries = match &args.control_binary {
        Some(control) => MpsBinaries {
            control: control.clone(),
            path_dirs: control.parent().map(PathBuf::from).into_iter().collect(),
            library_dirs: Vec::new(),
        },
        None => MpsBinaries::from_driver(&nvml.driver(), &args.host_root)?,
    };
    info!(control = %binaries.control.display(), root = %args.mps_root.display(), "supervising MPS daemons");
    let mut config = SupervisorConfig::new(
        MpsLayout::new(&args.mps_root),
        binaries,
        std::env::current_exe().context("locating this program")?,
    );
    // nvidia-smi: to set cards exclusive when asked, and always to set back a card an earlier
    // supervisor left exclusive (its marker) once this one is not asked to.
    let nvidia_smi = match &args.nvidia_smi {
        Some(p) => Ok(p.clone()),
        None => {
            let driver = nvml.driver();
            driver
                .files
                .iter()
                .find(|f| f.kind == tessera_core::driver::DriverFileKind::Binary && f.name() == "nvidia-smi")
                .map(|f| {
                    let h = driver.host_path(f);
                    args.host_root.join(h.strip_prefix("/").unwrap_or(&h))
                })
                .ok_or_else(|| format!("no nvidia-smi under driver root {}", driver.root.display()))
        }
    };
    match nvidia_smi {
        Ok(nvidia_smi) => {
            if args.exclusive_process {
                info!(nvidia_smi = %nvidia_smi.display(), "cards MPS serves are put in exclusive-process mode");
            }
            config.compute_modes = Some(tessera_mps::compute_mode::ComputeModes {
                nvidia_smi,
                library_dirs: config.binaries.library_dirs.clone(),
                timeout: Duration::from_secs(30),
            });
            config.exclusive_process = args.exclusive_process;
        }
        Err(e) if args.exclusive_process => anyhow::bail!("--exclusive-process: {e} (--nvidia-smi names one)"),
        Err(_) => {}
    }
    config.check_every = Duration::from_secs(args.check_secs);
    config.shm_mib = args.shm_mib;
    config.backoff = Backoff {
        base: Duration::from_millis(args.backoff_ms),
        ..Backoff::default()
    };
    let mut supervisor = Supervisor::new(config);
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut ticker = tokio::time::interval(Duration::from_secs(args.inventory_secs));
    loop {
        tokio::select! {
            _ = ticker.tick() => match share_cards(source.as_ref()) {
                Ok(cards) => {
                    if cards != supervisor.cards() {
                        info!(?cards, "cards hosting shares");
                    }
                    supervisor.reconcile(&cards).await;
                }
                Err(e) => warn!(error = format!("{e:#}"), "cannot read the GPUs; keeping the daemons as they are"),
            },
            _ = term.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
        }
    }
    info!("stopping the MPS daemons");
    supervisor.shutdown().await;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        // Before any thread exists: a mount namespace can only be entered single-threaded.
        Command::ExecDaemon { shm, parent, argv } => Err(tessera_mps::namespace::exec_with_shm(&shm, parent, &argv)),
        Command::Status { mps_root } => {
            tessera_node::stdout::quiet_on_closed_stdout();
            let (text, ready) = tessera_mps::status::report(&MpsLayout::new(mps_root), std::time::SystemTime::now());
            tessera_node::stdout::print(&text)?;
            if !ready {
                std::process::exit(1);
            }
            Ok(())
        }
        Command::Run(args) => {
            tracing_subscriber::fmt()
                .with_writer(std::io::stderr)
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
                )
                .init();
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?
                .block_on(run(args))
        }
    }
}
