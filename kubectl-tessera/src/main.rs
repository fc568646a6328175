//! `kubectl-tessera`: put it on the PATH and run `kubectl tessera inspect` or
//! `kubectl tessera pod NAME`.

// Production functions stay under clippy.toml's length (tests may run long; CONTRIBUTING.md).
#![cfg_attr(not(test), deny(clippy::too_many_lines))]

use std::io::Write as _;

use clap::{Parser, Subcommand};
use tessera_core::request::RequestOptions;
use tessera_kubectl::Output;

/// Tessera's GPUs in the cluster: per node and card, and per pod.
#[derive(Parser)]
#[command(name = "kubectl tessera", version, about)]
struct Cli {
    /// The kubeconfig file (default: $KUBECONFIG, then ~/.kube/config, then the pod's service
    /// account), as kubectl reads it.
    #[arg(long, global = true, value_name = "FILE")]
    kubeconfig: Option<std::path::PathBuf>,
    /// The kubeconfig context (default: its current context).
    #[arg(long, global = true, value_name = "NAME")]
    context: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Each Tessera node's GPUs: compute and memory allocated of total, MIG devices used, and
    /// the pods on each card.
    Inspect {
        /// Only this node.
        node: Option<String>,
        /// `table`, `wide` (with UUID, NUMA node, health and share enforcement) or `json`.
        #[arg(short, long, value_enum, default_value = "table")]
        output: Output,
    },
    /// What a pod asked for, what it was given and on which card, and its events.
    Pod {
        /// The pod's name.
        name: String,
        /// Its namespace (default: the context's, else `default`).
        #[arg(short, long)]
        namespace: Option<String>,
        /// MiB in one tessera.io/gpu-memory unit (the cluster's setting).
        #[arg(long, default_value_t = RequestOptions::default().memory_unit_mib, value_parser = tessera_core::flags::memory_unit_mib)]
        memory_unit_mib: u64,
    },
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

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let cli = Cli::parse();
    quiet_on_closed_stdout();
    // kube's rustls needs a process-wide crypto provider for https API servers.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let config = match config(cli.kubeconfig.as_deref(), cli.context.as_deref()).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    let server = config.cluster_url.to_string();
    let default_namespace = config.default_namespace.clone();
    let client = match kube::Client::try_from(config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {server}: {e}");
            std::process::exit(1);
        }
    };
    let result = match cli.command {
        Command::Inspect { node, output } => tessera_kubectl::inspect(&client, node.as_deref(), output).await,
        Command::Pod {
            name,
            namespace,
            memory_unit_mib,
        } => {
            let namespace = namespace.unwrap_or(default_namespace);
            tessera_kubectl::pod(&client, &namespace, &name, &RequestOptions { memory_unit_mib }).await
        }
    };
    match result {
        // A write that fails (`> /dev/full`) is an error, not a panic.
        Ok(text) => {
            let mut out = std::io::stdout().lock();
            if let Err(e) = out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
                eprintln!("error: writing to standard output: {e}");
                std::process::exit(1);
            }
        }
        // An API request that failed names the server it went to.
        Err(e @ tessera_kubectl::CliError::Api { .. }) => {
            eprintln!("error: {server}: {e}");
            std::process::exit(1);
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}

/// The cluster as kubectl finds it, with `--kubeconfig` and `--context` as kubectl takes them.
async fn config(kubeconfig: Option<&std::path::Path>, context: Option<&str>) -> Result<kube::Config, String> {
    let options = kube::config::KubeConfigOptions {
        context: context.map(String::from),
        ..Default::default()
    };
    match kubeconfig {
        Some(path) => {
            let file = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| format!("--kubeconfig {}: {e}", path.display()))?;
            kube::Config::from_custom_kubeconfig(file, &options)
                .await
                .map_err(|e| format!("--kubeconfig {}: {e}", path.display()))
        }
        None if context.is_some() => kube::Config::from_kubeconfig(&options)
            .await
            .map_err(|e| format!("--context {}: {e}", context.unwrap_or_default())),
        None => kube::Config::infer()
            .await
            .map_err(|e| format!("no cluster to talk to (no kubeconfig, not in a pod): {e}")),
    }
}
