//! `kubectl-tessera`: put it on the PATH and run `kubectl tessera inspect` or
//! `kubectl tessera pod NAME`.

use clap::{Parser, Subcommand};
use tessera_core::request::RequestOptions;
use tessera_kubectl::Output;

/// Tessera's GPUs in the cluster: per node and card, and per pod.
#[derive(Parser)]
#[command(name = "kubectl tessera", version, about)]
struct Cli {
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
        /// Its namespace.
        #[arg(short, long, default_value = "default")]
        namespace: String,
        /// MiB in one tessera.io/gpu-memory unit (the cluster's setting).
        #[arg(long, default_value_t = RequestOptions::default().memory_unit_mib)]
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
    let client = match kube::Client::try_default().await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: cannot reach the cluster (kubeconfig or in-cluster config): {e}");
            std::process::exit(1);
        }
    };
    let result = match cli.command {
        Command::Inspect { node, output } => tessera_kubectl::inspect(&client, node.as_deref(), output).await,
        Command::Pod {
            name,
            namespace,
            memory_unit_mib,
        } => tessera_kubectl::pod(&client, &namespace, &name, &RequestOptions { memory_unit_mib }).await,
    };
    match result {
        Ok(text) => print!("{text}"),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
