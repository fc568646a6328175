// Production functions stay under clippy.toml's length (tests may run long; CONTRIBUTING.md).
#![cfg_attr(not(test), deny(clippy::too_many_lines))]

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::{Parser, Subcommand};
use tessera_core::enforcement::{DEFAULT_HOOK_ROOT, DEFAULT_MPS_ROOT, HookLayout, MpsLayout, ShareEnforcement};
use tessera_core::flags::{host_path, listen_address};
use tessera_core::handoff::VerifyingKeys;
use tessera_nri_plugin::plugin::{PluginConfig, TesseraPlugin};
use tessera_nri_plugin::session::{self, Identity};

/// Tessera's NRI plugin.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Parser, Clone)]
struct RunArgs {
    /// NRI socket of the runtime (external plugin mode).
    #[arg(long, default_value = "/var/run/nri/nri.sock", value_parser = host_path)]
    socket: PathBuf,
    /// Plugin name.
    #[arg(long, default_value = "tessera", value_parser = plugin_name)]
    name: String,
    /// Plugin index (two digits; lower runs first).
    #[arg(long, default_value = "10", value_parser = plugin_index)]
    idx: String,
    /// This node's name (allocations for other nodes are refused).
    #[arg(long, env = "NODE_NAME")]
    node_name: Option<String>,
    /// Directory of the hand-off keys (a mounted Secret: one file per key, `active`).
    #[arg(long, default_value = "/etc/tessera/keys")]
    keys_dir: PathBuf,
    /// CDI spec directories, lowest priority first.
    #[arg(long = "cdi-dir", default_values = ["/etc/cdi", "/var/run/cdi"], value_parser = host_path)]
    cdi_dirs: Vec<PathBuf>,
    /// How this node holds shares to their limits: `mps` (Tessera's MPS daemons; a share
    /// whose daemon is down is refused), `hook` (Tessera's CUDA hook in the share's processes,
    /// with this plugin writing each container's limits) or `none` (shares run unenforced,
    /// annotated so).
    #[arg(long, env = "TESSERA_SHARE_ENFORCEMENT", default_value = "mps")]
    share_enforcement: ShareEnforcement,
    /// Where the MPS supervisor keeps each card's daemon directories and state.
    #[arg(long, env = "TESSERA_MPS_ROOT", default_value = DEFAULT_MPS_ROOT, value_parser = host_path)]
    mps_root: PathBuf,
    /// Where the CUDA hook is installed and each hook-mode container's limits are written.
    #[arg(long, env = "TESSERA_HOOK_ROOT", default_value = DEFAULT_HOOK_ROOT, value_parser = host_path)]
    hook_root: PathBuf,
    /// Where Tessera's DRA plugin records the claims it prepared (DRA installs).
    #[arg(long, env = "TESSERA_DRA_STATE_DIR", default_value = tessera_core::dra::DEFAULT_STATE_DIR, value_parser = host_path)]
    dra_state_dir: PathBuf,
    /// Where the grant of each container given GPUs is recorded (a tmpfs, root only): a
    /// restarted plugin rebuilds its books from it, and the DRA plugin reads which cards live
    /// containers use.
    #[arg(long, env = "TESSERA_GRANTS_DIR", default_value = tessera_core::granted::DEFAULT_GRANTS_DIR, value_parser = host_path)]
    grants_dir: PathBuf,
    /// Serve the node's GPU metrics (Prometheus, `/metrics`) on this address (`IP:PORT`).
    #[arg(long, value_parser = listen_address)]
    metrics_listen: Option<std::net::SocketAddr>,
    /// Where the host's /proc is (GPU processes are mapped to containers through it).
    #[arg(long, default_value = "/proc", value_parser = host_path)]
    proc_root: PathBuf,
    /// Where this process sees the host's / (NVML is loaded from the driver found under it).
    #[arg(long, default_value = "/", value_parser = host_path)]
    host_root: PathBuf,
    /// Read GPU telemetry from this file instead of NVML (tests, GPU-less machines).
    #[arg(long)]
    telemetry_fixture: Option<PathBuf>,
    /// Hold each share's GPU memory on its container's cgroup through the driver (NVIDIA
    /// r615+, cgroup v2): `auto` where the driver and kernel have it, `on` (do not run
    /// without it), `off`.
    #[arg(long, env = "TESSERA_CGROUP_MEMORY_LIMITS", default_value = "auto")]
    cgroup_memory_limits: CgroupMemoryLimits,
    /// Where the host's cgroup v2 hierarchy is, as this process sees it.
    #[arg(long, default_value = "/sys/fs/cgroup", value_parser = host_path)]
    cgroup_root: PathBuf,
    /// The libnvidia-ml to set those limits through (default: the driver's, found under the
    /// host root).
    #[arg(long, value_parser = host_path)]
    nvml_library: Option<PathBuf>,
}

/// Whether shares' memory is held on their containers' cgroups.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum CgroupMemoryLimits {
    /// Where the driver and kernel have per-cgroup limits.
    Auto,
    /// Always; the plugin does not run where they are missing.
    On,
    /// Never.
    Off,
}

#[derive(Parser, Clone)]
struct CheckArgs {
    /// NRI socket of the runtime.
    #[arg(long, default_value = "/var/run/nri/nri.sock", value_parser = host_path)]
    socket: PathBuf,
    /// containerd's configuration (checked when present).
    #[arg(long, default_value = "/etc/containerd/config.toml")]
    containerd_config: PathBuf,
    /// CRI-O's configuration; its `.conf.d` drop-ins are read too (checked when present).
    #[arg(long, default_value = "/etc/crio/crio.conf")]
    crio_config: PathBuf,
    /// CDI spec directories.
    #[arg(long = "cdi-dir", default_values = ["/etc/cdi", "/var/run/cdi"], value_parser = host_path)]
    cdi_dirs: Vec<PathBuf>,
    /// Directory of the hand-off keys.
    #[arg(long, default_value = "/etc/tessera/keys")]
    keys_dir: PathBuf,
    /// Where this process sees the host's / (the node DaemonSet mounts it at /host).
    #[arg(long, default_value = "/", value_parser = host_path)]
    host_root: PathBuf,
    /// The NVIDIA driver root as a host path (default: detected as the CDI generator does).
    #[arg(long, value_parser = host_path)]
    driver_root: Option<PathBuf>,
    /// Host directory holding `dev/`.
    #[arg(long, default_value = "/", value_parser = host_path)]
    dev_root: PathBuf,
    /// How this node holds shares to their limits, as `run` is told: `mps`, `hook` or `none`.
    #[arg(long, env = "TESSERA_SHARE_ENFORCEMENT", default_value = "mps")]
    share_enforcement: ShareEnforcement,
    /// Where the MPS supervisor keeps each card's daemon state.
    #[arg(long, env = "TESSERA_MPS_ROOT", default_value = DEFAULT_MPS_ROOT, value_parser = host_path)]
    mps_root: PathBuf,
    /// Where the CUDA hook is installed (hook mode).
    #[arg(long, env = "TESSERA_HOOK_ROOT", default_value = DEFAULT_HOOK_ROOT, value_parser = host_path)]
    hook_root: PathBuf,
    /// Where the host's cgroup v2 hierarchy is, as this process sees it.
    #[arg(long, default_value = "/sys/fs/cgroup", value_parser = host_path)]
    cgroup_root: PathBuf,
    /// The libnvidia-ml to ask about per-cgroup memory limits (default: the driver's, found
    /// under the host root).
    #[arg(long, value_parser = host_path)]
    nvml_library: Option<PathBuf>,
}

#[derive(Subcommand, Clone)]
enum Command {
    /// Connect to the runtime's NRI socket and serve (the default).
    Run(RunArgs),
    /// Check this node: NRI socket, runtime NRI/CDI settings, Tessera's CDI spec, driver, keys.
    /// Exits 1 when something must be fixed.
    Check(CheckArgs),
}

/// An NRI plugin name: what the runtime shows (non-empty, no `/` or whitespace).
fn plugin_name(s: &str) -> Result<String, String> {
    if s.is_empty() || s.contains('/') || s.contains(char::is_whitespace) {
        return Err("a plugin name is a word without '/' or spaces".into());
    }
    Ok(s.to_string())
}

/// An NRI plugin index: exactly two digits, as the runtime orders plugins.
fn plugin_index(s: &str) -> Result<String, String> {
    if s.len() == 2 && s.bytes().all(|b| b.is_ascii_digit()) {
        Ok(s.to_string())
    } else {
        Err("the index is two digits, 00 to 99".into())
    }
}

fn check(args: CheckArgs) -> anyhow::Result<()> {
    use tessera_nri_plugin::check::{CheckOptions, Level, run};
    let findings = run(&CheckOptions {
        socket: args.socket,
        containerd_config: args.containerd_config,
        crio_config: args.crio_config,
        cdi_dirs: args.cdi_dirs,
        keys_dir: args.keys_dir,
        host_root: args.host_root,
        driver_root: args.driver_root,
        dev_root: args.dev_root,
        enforcement: args.share_enforcement,
        mps: MpsLayout::new(args.mps_root),
        hook: HookLayout::new(args.hook_root),
        cgroup_root: args.cgroup_root,
        nvml_library: args.nvml_library,
    });
    let mut report: String = findings.iter().map(|f| format!("{f}\n")).collect();
    let failed = findings.iter().filter(|f| f.level == Level::Fail).count();
    if failed > 0 {
        report += &format!("{failed} problem(s) to fix before Tessera can inject GPUs on this node\n");
    } else {
        report += "this node is ready for Tessera\n";
    }
    tessera_node::stdout::print(&report)?;
    if failed > 0 {
        std::process::exit(1);
    }
    Ok(())
}

fn node_name(arg: Option<String>) -> anyhow::Result<String> {
    if let Some(n) = arg {
        return Ok(n);
    }
    // The kubelet's node name defaults to the host name.
    let host = nix::unistd::gethostname().context("no --node-name and no host name")?;
    Ok(host.to_string_lossy().into_owned())
}

async fn plugin(args: &RunArgs) -> anyhow::Result<Arc<TesseraPlugin>> {
    let keys = VerifyingKeys::from_dir(&args.keys_dir)
        .with_context(|| format!("loading hand-off keys from {}", args.keys_dir.display()))?;
    let private: Vec<String> = VerifyingKeys::kinds_in(&args.keys_dir)
        .unwrap_or_default()
        .into_iter()
        .filter(|(_, k)| *k == tessera_core::handoff::KeyKind::Ed25519Private)
        .map(|(id, _)| id)
        .collect();
    if !private.is_empty() {
        tracing::error!(
            keys = ?private,
            dir = %args.keys_dir.display(),
            "the extender's private key is on this node: whoever holds it can sign allocations; mount only the public keys (tessera-nri-plugin check fails until then)"
        );
    }
    let mut plugin = TesseraPlugin::new(PluginConfig {
        node: node_name(args.node_name.clone())?,
        keys,
        cdi_dirs: args.cdi_dirs.clone(),
        enforcement: args.share_enforcement,
        mps: MpsLayout::new(&args.mps_root),
        hook: HookLayout::new(&args.hook_root),
        claims: tessera_core::dra::ClaimStore::new(&args.dra_state_dir),
    })
    .reloading_keys_from(args.keys_dir.clone())
    .recording_grants_in(tessera_core::granted::GrantStore::new(&args.grants_dir))
    .reading_users_under(args.proc_root.clone());
    if let Some(limits) = per_cgroup_limits(args)? {
        plugin = plugin.holding_memory_per_cgroup(Arc::new(limits), args.cgroup_root.clone());
    }
    // A DRA claim shared by pods scheduled after it was prepared: their reservations are read
    // on the API server (kube's TLS needs one crypto provider for the process).
    let _ = rustls::crypto::ring::default_provider().install_default();
    match kube::Client::try_default().await {
        Ok(client) => {
            plugin = plugin.looking_up_reservations(Arc::new(tessera_nri_plugin::plugin::ApiReservations(client)));
        }
        Err(e) => tracing::warn!(
            error = %e,
            "no Kubernetes API server (in-cluster or KUBECONFIG): a DRA claim is granted only to the pods it was reserved for when prepared"
        ),
    }
    Ok(Arc::new(plugin))
}

/// The driver's per-cgroup memory limits, as `--cgroup-memory-limits` asks and the node has.
fn per_cgroup_limits(args: &RunArgs) -> anyhow::Result<Option<tessera_node::memory_limits::NvmlMemoryLimits>> {
    use tessera_node::memory_limits::probe;
    if args.cgroup_memory_limits == CgroupMemoryLimits::Off {
        tracing::info!("shares' memory is not held per cgroup (--cgroup-memory-limits off)");
        return Ok(None);
    }
    let library = args.nvml_library.clone().or_else(|| {
        tessera_node::inventory::NvmlSource {
            host_root: args.host_root.clone(),
            ..Default::default()
        }
        .library_path()
        .ok()
    });
    let (support, limits) = probe(library.as_deref(), &args.cgroup_root);
    match limits {
        Some(limits) => {
            tracing::info!(%support, "each share's GPU memory is held on its container's cgroup");
            Ok(Some(limits))
        }
        None if args.cgroup_memory_limits == CgroupMemoryLimits::On => {
            anyhow::bail!("--cgroup-memory-limits on, but this node's GPU memory limits are {support}")
        }
        None => {
            tracing::info!(%support, "shares' GPU memory is held by MPS and the CUDA hook");
            Ok(None)
        }
    }
}

/// The metrics' sources: the telemetry fixture, else NVML (without it, allocations only).
fn node_metrics(args: &RunArgs) -> tessera_nri_plugin::metrics::NodeMetrics {
    use tessera_node::telemetry::{FixtureTelemetry, NvmlTelemetry, TelemetrySource};
    let telemetry: Option<Box<dyn TelemetrySource>> = match &args.telemetry_fixture {
        Some(path) => Some(Box::new(FixtureTelemetry { path: path.clone() })),
        None => {
            let source = tessera_node::inventory::NvmlSource {
                host_root: args.host_root.clone(),
                ..Default::default()
            };
            match source.open() {
                Ok(nvml) => Some(Box::new(NvmlTelemetry::new(nvml))),
                Err(e) => {
                    tracing::warn!(error = %e, "no GPU telemetry: metrics report allocations only");
                    None
                }
            }
        }
    };
    tessera_nri_plugin::metrics::NodeMetrics {
        telemetry,
        proc_root: args.proc_root.clone(),
        enforcement: args.share_enforcement,
        mps: MpsLayout::new(&args.mps_root),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    let cli = Cli::parse();
    if let Some(Command::Check(args)) = cli.command {
        tessera_node::stdout::quiet_on_closed_stdout();
        return check(args);
    }
    // Launched by the runtime: the socket is an inherited fd, name and index come from the
    // environment (which has nothing else, not even PATH).
    if let Ok(fd) = std::env::var("NRI_PLUGIN_SOCKET") {
        let fd: i32 = fd
            .parse()
            .with_context(|| format!("NRI_PLUGIN_SOCKET={fd:?} is not a file descriptor"))?;
        let mut args = RunArgs::parse_from(["tessera-nri-plugin"]);
        if let Some(Command::Run(a)) = cli.command.clone() {
            args = a;
        }
        let id = Identity {
            name: std::env::var("NRI_PLUGIN_NAME").unwrap_or(args.name.clone()),
            idx: std::env::var("NRI_PLUGIN_IDX").unwrap_or(args.idx.clone()),
        };
        return session::run_launched(fd, id, plugin(&args).await?).await;
    }
    let args = match cli.command {
        Some(Command::Run(a)) => a,
        _ => RunArgs::parse_from(["tessera-nri-plugin"]),
    };
    let id = Identity {
        name: args.name.clone(),
        idx: args.idx.clone(),
    };
    let plugin = plugin(&args).await?;
    if let Some(listen) = args.metrics_listen {
        let metrics = std::sync::Arc::new(node_metrics(&args));
        let plugin = plugin.clone();
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .with_context(|| format!("listening for metrics on {listen}"))?;
        tokio::spawn(async move {
            if let Err(e) = tessera_nri_plugin::metrics::serve(listener, metrics, plugin).await {
                tracing::error!(error = %e, "the metrics endpoint stopped");
            }
        });
    }
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    session::run_external(args.socket.clone(), id, plugin, async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    })
    .await;
    Ok(())
}
