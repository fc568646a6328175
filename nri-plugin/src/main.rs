use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::{Parser, Subcommand};
use tessera_core::handoff::SigningKeys;
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
    #[arg(long, default_value = "/var/run/nri/nri.sock")]
    socket: PathBuf,
    /// Plugin name.
    #[arg(long, default_value = "tessera")]
    name: String,
    /// Plugin index (two digits; lower runs first).
    #[arg(long, default_value = "10")]
    idx: String,
    /// This node's name (allocations for other nodes are refused).
    #[arg(long, env = "NODE_NAME")]
    node_name: Option<String>,
    /// Directory of the hand-off keys (a mounted Secret: one file per key, `active`).
    #[arg(long, default_value = "/etc/tessera/keys")]
    keys_dir: PathBuf,
    /// CDI spec directories, lowest priority first.
    #[arg(long = "cdi-dir", default_values = ["/etc/cdi", "/var/run/cdi"])]
    cdi_dirs: Vec<PathBuf>,
    /// The node runs an MPS control daemon: add MPS limits to shares.
    #[arg(long)]
    mps: bool,
}

#[derive(Subcommand)]
enum Command {
    /// Connect to the runtime's NRI socket and serve (the default).
    Run(RunArgs),
}

fn node_name(arg: Option<String>) -> anyhow::Result<String> {
    if let Some(n) = arg {
        return Ok(n);
    }
    // The kubelet's node name defaults to the host name.
    let host = nix::unistd::gethostname().context("no --node-name and no host name")?;
    Ok(host.to_string_lossy().into_owned())
}

fn plugin(args: &RunArgs) -> anyhow::Result<Arc<TesseraPlugin>> {
    let keys = SigningKeys::from_dir(&args.keys_dir)
        .with_context(|| format!("loading hand-off keys from {}", args.keys_dir.display()))?;
    Ok(Arc::new(TesseraPlugin::new(PluginConfig {
        node: node_name(args.node_name.clone())?,
        keys,
        cdi_dirs: args.cdi_dirs.clone(),
        mps: args.mps,
    })))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    let cli = Cli::parse();
    // Launched by the runtime: the socket is an inherited fd, name and index come from the
    // environment (which has nothing else, not even PATH).
    if let Ok(fd) = std::env::var("NRI_PLUGIN_SOCKET") {
        let fd: i32 = fd
            .parse()
            .with_context(|| format!("NRI_PLUGIN_SOCKET={fd:?} is not a file descriptor"))?;
        let mut args = RunArgs::parse_from(["tessera-nri-plugin"]);
        if let Some(Command::Run(a)) = cli.command {
            args = a;
        }
        let id = Identity {
            name: std::env::var("NRI_PLUGIN_NAME").unwrap_or(args.name.clone()),
            idx: std::env::var("NRI_PLUGIN_IDX").unwrap_or(args.idx.clone()),
        };
        return session::run_launched(fd, id, plugin(&args)?).await;
    }
    let args = match cli.command {
        Some(Command::Run(a)) => a,
        None => RunArgs::parse_from(["tessera-nri-plugin"]),
    };
    let id = Identity {
        name: args.name.clone(),
        idx: args.idx.clone(),
    };
    let plugin = plugin(&args)?;
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
