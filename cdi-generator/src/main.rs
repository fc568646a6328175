// Production functions stay under clippy.toml's length (tests may run long; CONTRIBUTING.md).
#![cfg_attr(not(test), deny(clippy::too_many_lines))]

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use tessera_cdi_generator::bundle::{self, DEFAULT_BUNDLE_ROOT};
use tessera_cdi_generator::daemon::{self, BundleConfig, DaemonConfig};
use tessera_cdi_generator::driver_report;
use tessera_cdi_generator::spec::{self, SpecOptions};
use tessera_cdi_generator::topology_report;
use tessera_cdi_generator::writer::{self, DEFAULT_CDI_DIR};
use tessera_core::enforcement::{DEFAULT_HOOK_ROOT, DEFAULT_MPS_ROOT, HookLayout, MpsLayout, ShareEnforcement};
use tessera_core::flags::{host_path, interval};
use tessera_core::inventory::{FixtureSource, InventorySource};
use tessera_node::inventory::{FixtureWithHostDriver, NvmlSource};
use tessera_node::stdout::{print, quiet_on_closed_stdout};

/// Tessera's CDI spec generator.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Args, Clone)]
struct SourceArgs {
    /// Fixture file (or built-in fixture name: h100x8, a100-mig, t4x2, h100-nvswitch,
    /// a100-nvlink-pairs, l40s-pcie-switches) instead of NVML.
    #[arg(long)]
    fixture: Option<PathBuf>,
    /// Host directory holding the driver files, detected by default (/run/nvidia/driver, /,
    /// /usr/local/nvidia, /home/kubernetes/bin/nvidia). With --fixture: the driver's real
    /// files are found there (without it, the fixture's own list is used).
    #[arg(long, value_parser = host_path)]
    driver_root: Option<PathBuf>,
    /// Where this process sees the host's / (the node DaemonSet mounts it at /host). Files
    /// are read under it; the spec names host paths.
    #[arg(long, default_value = "/", value_parser = host_path)]
    host_root: PathBuf,
    /// Host directory holding /dev (device nodes get a hostPath under it when not /).
    #[arg(long, default_value = "/", value_parser = host_path)]
    dev_root: PathBuf,
    /// libnvidia-ml.so.1 to load (default: the loader's search path).
    #[arg(long)]
    nvml_library: Option<PathBuf>,
}

impl SourceArgs {
    /// How the driver holds share memory, for the published inventory (NVML's, not a
    /// fixture's: `None` with `--fixture`). The host's cgroup hierarchy is under the host root.
    fn share_memory(&self) -> Option<tessera_core::inventory::ShareMemory> {
        if self.fixture.is_some() {
            return None;
        }
        let library = self.nvml_library.clone().or_else(|| {
            tessera_node::inventory::NvmlSource {
                host_root: self.host_root.clone(),
                driver_root: self.driver_root.clone(),
                ..Default::default()
            }
            .library_path()
            .ok()
        });
        let held =
            tessera_cdi_generator::publish::share_memory(library.as_deref(), &self.host_root.join("sys/fs/cgroup"));
        tracing::info!(
            per_cgroup = held.per_cgroup,
            detail = held.detail,
            "how the driver holds share memory"
        );
        Some(held)
    }
}

/// How the node holds shares; the same setting the NRI plugin and the MPS supervisor read.
#[derive(Args, Clone)]
struct EnforcementArgs {
    /// `mps`: share devices connect to each card's MPS daemon (run by tessera-mps-supervisor);
    /// `hook`: Tessera's CUDA hook is preloaded into share containers; `none`: shares run
    /// unenforced.
    #[arg(long, env = "TESSERA_SHARE_ENFORCEMENT", default_value = "mps")]
    share_enforcement: ShareEnforcement,
    /// Where the MPS daemons' directories are (a host path).
    #[arg(long, env = "TESSERA_MPS_ROOT", default_value = DEFAULT_MPS_ROOT, value_parser = host_path)]
    mps_root: PathBuf,
    /// Where hook mode's files are (a host path; the library is installed under it).
    #[arg(long, env = "TESSERA_HOOK_ROOT", default_value = DEFAULT_HOOK_ROOT, value_parser = host_path)]
    hook_root: PathBuf,
    /// Where driver bundles are made (a host path, writable here at the same path): the spec
    /// mounts the driver once from there.
    #[arg(long, default_value = DEFAULT_BUNDLE_ROOT, value_parser = host_path)]
    driver_bundle_dir: PathBuf,
    /// Mount each driver file on its own instead of one bundle.
    #[arg(long)]
    no_driver_bundle: bool,
    /// The CUDA hook library to install on the host in hook mode (the image's copy).
    #[arg(long, default_value = "/usr/local/lib/tessera/libtessera-cuda-hook.so")]
    hook_library: PathBuf,
}

impl EnforcementArgs {
    fn spec(&self, dev_root: &Path) -> SpecOptions {
        SpecOptions {
            dev_root: dev_root.to_path_buf(),
            enforcement: self.share_enforcement,
            mps: MpsLayout::new(&self.mps_root),
            hook: HookLayout::new(&self.hook_root),
            driver_bundle: None,
        }
    }

    /// Where to make the driver bundle, unless mounting file by file.
    fn bundle(&self, source: &SourceArgs) -> Option<BundleConfig> {
        (!self.no_driver_bundle).then(|| BundleConfig {
            root: self.driver_bundle_dir.clone(),
            host_root: source.host_root.clone(),
        })
    }

    /// In hook and MPS modes, installs the library on the host before any spec names it (on
    /// MPS nodes it holds a container's processes to its memory together).
    fn install_hook(&self) -> anyhow::Result<()> {
        if self.share_enforcement.preloads_hook() {
            let layout = HookLayout::new(&self.hook_root);
            let changed = layout.install(&self.hook_library).with_context(|| {
                format!(
                    "installing the CUDA hook {} under {}",
                    self.hook_library.display(),
                    self.hook_root.display()
                )
            })?;
            if changed {
                tracing::info!(library = %layout.library().display(), "CUDA hook installed");
            }
        }
        Ok(())
    }
}

impl SourceArgs {
    fn source(&self) -> Box<dyn InventorySource + Send + Sync> {
        match &self.fixture {
            Some(f) => {
                let fixture = FixtureSource {
                    fixture: f.clone(),
                    driver_root: self.driver_root.clone(),
                };
                match self.driver_root {
                    // A fixture's GPUs with the real driver files found under the given root.
                    Some(_) => Box::new(FixtureWithHostDriver {
                        fixture,
                        host_root: self.host_root.clone(),
                    }),
                    None => Box::new(fixture),
                }
            }
            None => Box::new(self.nvml()),
        }
    }

    fn nvml(&self) -> NvmlSource {
        NvmlSource {
            host_root: self.host_root.clone(),
            driver_root: self.driver_root.clone(),
            dev_root: self.dev_root.clone(),
            library: self.nvml_library.clone(),
            ..Default::default()
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Print (or write) the CDI spec once.
    Generate {
        #[command(flatten)]
        source: SourceArgs,
        #[command(flatten)]
        enforcement: EnforcementArgs,
        /// `-` for standard output, or a directory (made if missing) to write
        /// tessera.io-gpu.json into.
        #[arg(long, alias = "output", default_value = "-")]
        out_dir: String,
    },
    /// Show where the driver is and every file a GPU container would get, with how each was
    /// found (needs no GPU). Exits 1 when GPU containers could not run CUDA with them.
    Driver {
        #[command(flatten)]
        source: SourceArgs,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Show how the GPUs are connected (`nvidia-smi topo -m`'s matrix, with CPU and NUMA
    /// affinity): what the node publishes and the scheduler chooses multi-GPU sets by.
    Topology {
        #[command(flatten)]
        source: SourceArgs,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Run the daemon: keep the spec current and publish the inventory.
    Run {
        #[command(flatten)]
        source: SourceArgs,
        #[command(flatten)]
        enforcement: EnforcementArgs,
        /// CDI spec directory.
        #[arg(long, default_value = DEFAULT_CDI_DIR, value_parser = host_path)]
        cdi_dir: PathBuf,
        /// Poll interval in seconds.
        #[arg(long, default_value_t = 30, value_parser = interval)]
        interval_secs: u64,
        /// This node's name, to publish the inventory annotation on (in a cluster).
        #[arg(long, env = "NODE_NAME")]
        node_name: Option<String>,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    match Cli::parse().command {
        Command::Generate {
            source,
            enforcement,
            out_dir: output,
        } => {
            quiet_on_closed_stdout();
            let inventory = source.source().discover().context("reading the GPU inventory")?;
            // Printing a spec to read writes nothing on this machine: the driver bundle is
            // named where the daemon would make it, the hook is not installed.
            let printing = output == "-";
            if !printing {
                enforcement.install_hook()?;
            }
            let mut opts = enforcement.spec(&source.dev_root);
            if let Some(b) = enforcement.bundle(&source) {
                inventory.driver_check().map_err(anyhow::Error::msg)?;
                opts.driver_bundle = Some(if printing {
                    bundle::planned(&inventory, &b.host_root, &b.root)
                } else {
                    bundle::prepare(&inventory, &b.host_root, &b.root)?
                });
            }
            let (spec, text) = spec::render(&inventory, &opts)?;
            let missing = spec::missing_host_paths(&spec, &opts, &source.host_root);
            if output == "-" {
                // Printing a spec to read needs no driver here; say what a node would need.
                if !missing.is_empty() {
                    eprintln!(
                        "tessera-cdi-generator: warning: {} mounted host path(s) do not exist on this machine; \
                         a runtime would refuse containers with this spec: {}",
                        missing.len(),
                        missing.join(", ")
                    );
                }
                print(&text)?;
            } else {
                if !missing.is_empty() {
                    return Err(spec::SpecError::MissingHostPaths(missing).into());
                }
                let outcome = writer::write_spec(output.as_ref(), writer::SPEC_FILE, &text)?;
                eprintln!("{}/{}: {outcome:?}", output, writer::SPEC_FILE);
            }
            Ok(())
        }
        Command::Driver { source, json } => {
            quiet_on_closed_stdout();
            let driver = source.nvml().driver();
            if json {
                print(&format!(
                    "{}\n",
                    serde_json::to_string_pretty(&driver_report::json(&driver))?
                ))?;
            } else {
                print(&driver_report::text(&driver))?;
            }
            if driver.check().is_err() {
                std::process::exit(1);
            }
            Ok(())
        }
        Command::Topology { source, json } => {
            quiet_on_closed_stdout();
            let inventory = source.source().discover().context("reading the GPU inventory")?;
            if json {
                print(&format!(
                    "{}\n",
                    serde_json::to_string_pretty(&topology_report::json(&inventory))?
                ))?;
            } else {
                print(&topology_report::text(&inventory))?;
            }
            Ok(())
        }
        Command::Run {
            source,
            enforcement,
            cdi_dir,
            interval_secs,
            node_name,
        } => {
            enforcement.install_hook()?;
            // Read again at once when the fixture or the CDI directory changes (see daemon::run).
            let watch: Vec<PathBuf> = source.fixture.iter().cloned().chain([cdi_dir.clone()]).collect();
            let config = DaemonConfig {
                cdi_dir,
                spec: enforcement.spec(&source.dev_root),
                interval: Duration::from_secs(interval_secs),
                node_name,
                bundle: enforcement.bundle(&source),
                check_host_paths: Some(source.host_root.clone()),
                share_memory: source.share_memory(),
            };
            daemon::run(source.source(), watch, config).await
        }
    }
}
