// Production functions stay under clippy.toml's length (tests may run long; CONTRIBUTING.md).
#![cfg_attr(not(test), deny(clippy::too_many_lines))]

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use tessera_core::flags::{host_path, interval, memory_unit_mib};
use tessera_core::inventory::FixtureSource;
use tessera_core::request::DEFAULT_MEMORY_UNIT_MIB;
use tessera_device_plugin::manager::{self, Config, DEFAULT_PLUGIN_DIR, Source};
use tessera_node::inventory::NvmlSource;

/// Tessera's kubelet device plugin.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    /// Kubelet device plugin directory.
    #[arg(long, default_value = DEFAULT_PLUGIN_DIR, value_parser = host_path)]
    plugin_dir: PathBuf,
    /// MiB per unit of tessera.io/gpu-memory (a cluster-wide setting).
    #[arg(long, default_value_t = DEFAULT_MEMORY_UNIT_MIB, value_parser = memory_unit_mib)]
    memory_unit_mib: u64,
    /// Fixture file (or built-in name) instead of NVML.
    #[arg(long)]
    fixture: Option<PathBuf>,
    /// Where this process sees the host's / (the node DaemonSet mounts it at /host).
    #[arg(long, default_value = "/", value_parser = host_path)]
    host_root: PathBuf,
    /// Host directory of the NVIDIA driver (default: detected).
    #[arg(long, value_parser = host_path)]
    driver_root: Option<PathBuf>,
    /// Inventory poll interval, seconds.
    #[arg(long, default_value_t = 30, value_parser = interval)]
    poll_secs: u64,
    /// Seconds without a critical event after which a GPU is healthy again.
    #[arg(long, default_value_t = 300)]
    recovery_secs: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    let cli = Cli::parse();
    let source = match cli.fixture {
        // NVML may come later (a driver still loading), so it is waited for; a fixture is not.
        Some(f) => {
            Source::Fixture(FixtureSource::readable(&f).map_err(|e| anyhow::anyhow!("--fixture {}: {e}", f.display()))?)
        }
        None => Source::Nvml(Box::new(NvmlSource {
            host_root: cli.host_root,
            driver_root: cli.driver_root,
            ..Default::default()
        })),
    };
    // The kubelet's directory must take our sockets.
    let probe = cli
        .plugin_dir
        .join(format!(".tessera-write-test-{}", std::process::id()));
    std::fs::write(&probe, b"")
        .and_then(|()| std::fs::remove_file(&probe))
        .map_err(|e| {
            anyhow::anyhow!(
                "--plugin-dir {}: cannot create sockets there: {e}",
                cli.plugin_dir.display()
            )
        })?;
    let config = Config {
        plugin_dir: cli.plugin_dir,
        memory_unit_mib: cli.memory_unit_mib,
        poll: Duration::from_secs(cli.poll_secs),
        recovery: Duration::from_secs(cli.recovery_secs),
    };
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    manager::run(config, source, async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    })
    .await
}
