// Production functions stay under clippy.toml's length (tests may run long; CONTRIBUTING.md).
#![cfg_attr(not(test), deny(clippy::too_many_lines))]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use tessera_core::dra::{PLUGIN_DIR, REGISTRY_DIR};
use tessera_core::flags::{host_path, interval, memory_unit_mib};
use tessera_core::inventory::{FixtureMigInstances, FixtureSource, InventorySource, MigPartitioner};
use tessera_core::request::DEFAULT_MEMORY_UNIT_MIB;
use tessera_dra_plugin::driver::ApiClaims;
use tessera_dra_plugin::service::{self, Config};
use tessera_dra_plugin::slices::SlicePublisher;
use tessera_node::inventory::{NvmlMig, NvmlSource};

/// Tessera's kubelet DRA plugin (driver gpu.tessera.io, Kubernetes 1.34+).
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    /// This node's name.
    #[arg(long, env = "NODE_NAME")]
    node_name: String,
    /// The kubelet's plugin registry directory.
    #[arg(long, default_value = REGISTRY_DIR, value_parser = host_path)]
    registry_dir: PathBuf,
    /// The directory of this plugin's DRA socket (as the kubelet sees it).
    #[arg(long, default_value = PLUGIN_DIR, value_parser = host_path)]
    plugin_dir: PathBuf,
    /// CDI spec directory the container runtime reads (claim markers are written there).
    #[arg(long, default_value = "/var/run/cdi", value_parser = host_path)]
    cdi_dir: PathBuf,
    /// Where prepared claims are recorded (read by Tessera's NRI plugin).
    #[arg(long, default_value = tessera_core::dra::DEFAULT_STATE_DIR, value_parser = host_path)]
    state_dir: PathBuf,
    /// MiB per step of a share's memory (a cluster-wide setting, as the device plugin's).
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
    /// Where the NRI plugin records what each live container was granted (read to keep a card
    /// held while a container uses it).
    #[arg(long, env = "TESSERA_GRANTS_DIR", default_value = tessera_core::granted::DEFAULT_GRANTS_DIR, value_parser = host_path)]
    grants_dir: PathBuf,
    /// How often the node's GPUs are read, seconds.
    #[arg(long, default_value_t = 30, value_parser = interval)]
    poll_secs: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    let cli = Cli::parse();
    // kube's TLS: one crypto provider for the process (the workspace's rustls has two).
    let _ = rustls::crypto::ring::default_provider().install_default();
    if cli.node_name.is_empty() {
        anyhow::bail!("--node-name (NODE_NAME) is empty: the pool is named after the node");
    }
    // Dynamic MIG creates instances through NVML, or in a fixture file (a built-in fixture
    // cannot change).
    let (source, partitioner): (Arc<dyn InventorySource + Send + Sync>, Option<Arc<dyn MigPartitioner>>) =
        match &cli.fixture {
            Some(f) => (
                Arc::new(FixtureSource::readable(f).map_err(|e| anyhow::anyhow!("--fixture {}: {e}", f.display()))?),
                f.is_file()
                    .then(|| Arc::new(FixtureMigInstances::new(f)) as Arc<dyn MigPartitioner>),
            ),
            None => {
                let nvml = NvmlSource {
                    host_root: cli.host_root.clone(),
                    driver_root: cli.driver_root.clone(),
                    ..Default::default()
                };
                let partitioner = match nvml
                    .open()
                    .map_err(|e| e.to_string())
                    .and_then(|n| NvmlMig::new(n).map_err(|e| e.to_string()))
                {
                    Ok(n) => Some(Arc::new(n) as Arc<dyn MigPartitioner>),
                    Err(e) => {
                        tracing::warn!(error = %e, "no NVML: MIG instances are not created per claim");
                        None
                    }
                };
                (Arc::new(nvml), partitioner)
            }
        };
    let client = kube::Client::try_default()
        .await
        .map_err(|e| anyhow::anyhow!("no Kubernetes API server (in-cluster or KUBECONFIG): {e}"))?;
    let slices = SlicePublisher::new(client.clone(), &cli.node_name);
    let config = Config {
        node: cli.node_name,
        registry_dir: cli.registry_dir,
        plugin_dir: cli.plugin_dir,
        cdi_dir: cli.cdi_dir,
        state_dir: cli.state_dir,
        memory_unit_mib: cli.memory_unit_mib,
        poll: Duration::from_secs(cli.poll_secs),
        partitioner,
        cdi_wait: tessera_dra_plugin::driver::CDI_WAIT,
        grants_dir: cli.grants_dir,
    };
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    service::run(config, source, Arc::new(ApiClaims(client)), Some(slices), async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    })
    .await
}
