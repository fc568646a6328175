//! `tessera-manifests`: prints the install manifests for a cluster's settings (namespace,
//! image, replicas, driver root, share enforcement, the runtime's paths) or only the
//! KubeSchedulerConfiguration; refuses values Kubernetes would refuse, naming the flag.

// Production functions stay under clippy.toml's length (tests may run long; CONTRIBUTING.md).
#![cfg_attr(not(test), deny(clippy::too_many_lines))]

use anyhow::Context;
use clap::Parser;
use tessera_deploy::image::{IMAGE_SHAPE, is_image_reference};
use tessera_deploy::{ManifestOptions, render, scheduler_config};

/// Print Tessera's install manifests (typed objects rendered to YAML): every component, the
/// CRDs, RBAC and the second scheduler's configuration.
#[derive(Parser)]
#[command(name = "tessera-manifests", version, about)]
struct ManifestArgs {
    /// Namespace for every namespaced object.
    #[arg(long, default_value = "tessera-system")]
    namespace: String,
    /// The Tessera image.
    #[arg(long)]
    image: Option<String>,
    /// The kube-scheduler image for the `tessera` scheduler (match your cluster's version).
    #[arg(long)]
    scheduler_image: Option<String>,
    /// Extender replicas.
    #[arg(long, default_value_t = 2)]
    replicas: i32,
    /// Host directory of the NVIDIA driver files (default: each node detects it).
    #[arg(long)]
    driver_root: Option<String>,
    /// How GPU nodes hold shares to their limits: `mps` (adds the MPS supervisor), `hook`
    /// (Tessera's CUDA hook preloaded into share containers) or `none`.
    #[arg(long, default_value = "mps")]
    share_enforcement: tessera_core::enforcement::ShareEnforcement,
    /// The container runtime's NRI socket on the GPU nodes.
    #[arg(long, default_value = "/var/run/nri/nri.sock")]
    nri_socket: String,
    /// Where the container runtime reads CDI specs on the GPU nodes.
    #[arg(long, default_value = "/var/run/cdi")]
    cdi_dir: String,
    /// Also install Tessera as a DRA driver (Kubernetes 1.34+): DeviceClasses, the node
    /// agents' DRA rights and the DRA kubelet plugin.
    #[arg(long)]
    dra: bool,
    /// With `--share-enforcement mps`: put the cards MPS serves in exclusive-process compute
    /// mode, so a process that goes around MPS is refused the card (costs: docs/operations.md).
    #[arg(long)]
    exclusive_process: bool,
    /// The share of the cluster's nodes the `tessera` scheduler looks at for each pod, 0 to
    /// 100: 100 (every node) lets the extender weigh every node that could take the pod; 0 is
    /// kube-scheduler's adaptive default, which stops once its own checks have passed a share
    /// of the nodes (a tenth of 5,000, at least 100), and leaves a pod unscheduled while the
    /// only cards that fit it lie beyond them.
    #[arg(long, default_value_t = 100)]
    percentage_of_nodes_to_score: u32,
    /// Print only the KubeSchedulerConfiguration.
    #[arg(long)]
    scheduler_config: bool,
    /// Write here instead of stdout.
    #[arg(long, default_value = "-")]
    out: String,
    /// Write a Helm chart of these manifests into this directory instead (the flags above
    /// become its values' defaults; the namespace is the release's). Replaces a chart there.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["namespace", "scheduler_config", "out"])]
    helm_chart: Option<std::path::PathBuf>,
}

fn manifests(args: ManifestArgs) -> anyhow::Result<()> {
    let d = ManifestOptions::default();
    anyhow::ensure!(
        args.replicas >= 1,
        "--replicas must be at least 1, got {}",
        args.replicas
    );
    anyhow::ensure!(
        args.percentage_of_nodes_to_score <= 100,
        "--percentage-of-nodes-to-score must be 0 to 100, got {}",
        args.percentage_of_nodes_to_score
    );
    // A DNS-1123 label, as Kubernetes wants namespace names.
    let ns = &args.namespace;
    anyhow::ensure!(
        !ns.is_empty()
            && ns.len() <= 63
            && ns
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !ns.starts_with('-')
            && !ns.ends_with('-'),
        "--namespace={ns:?}: not a namespace name (lowercase letters, digits and '-', at most 63, starting and ending with a letter or digit)"
    );
    // The chart's values schema holds its values to the same rule.
    for (flag, image) in [("--image", &args.image), ("--scheduler-image", &args.scheduler_image)] {
        if let Some(i) = image {
            anyhow::ensure!(
                is_image_reference(i),
                "{flag}={i:?}: not an image reference ({IMAGE_SHAPE})"
            );
        }
    }
    for (flag, path) in [
        ("--driver-root", args.driver_root.as_deref()),
        ("--nri-socket", Some(args.nri_socket.as_str())),
        ("--cdi-dir", Some(args.cdi_dir.as_str())),
    ] {
        if let Some(p) = path {
            anyhow::ensure!(
                p.starts_with('/') && !p.contains(char::is_whitespace),
                "{flag}={p:?}: must be an absolute host path"
            );
        }
    }
    anyhow::ensure!(
        !args.nri_socket.ends_with('/'),
        "--nri-socket={:?}: must name the socket, not its directory",
        args.nri_socket
    );
    anyhow::ensure!(
        !args.exclusive_process || args.share_enforcement == tessera_core::enforcement::ShareEnforcement::Mps,
        "--exclusive-process: only with --share-enforcement mps (was {})",
        args.share_enforcement
    );
    let opts = ManifestOptions {
        namespace: args.namespace,
        image: args.image.unwrap_or(d.image),
        scheduler_image: args.scheduler_image.unwrap_or(d.scheduler_image),
        replicas: args.replicas,
        driver_root: args.driver_root,
        share_enforcement: args.share_enforcement,
        nri_socket: args.nri_socket,
        cdi_dir: args.cdi_dir,
        dra: args.dra,
        exclusive_process: args.exclusive_process,
        percentage_of_nodes_to_score: args.percentage_of_nodes_to_score,
        ..d
    };
    if let Some(dir) = &args.helm_chart {
        return write_chart(dir, &tessera_deploy::chart::files(&opts));
    }
    let text = if args.scheduler_config {
        scheduler_config(&opts)
    } else {
        render(&opts)
    };
    if args.out == "-" {
        print(&text)?;
    } else {
        std::fs::write(&args.out, text).with_context(|| format!("writing {}", args.out))?;
    }
    Ok(())
}

/// Writes the chart's files into `dir` as a whole: into a new directory beside it, which then
/// takes the place of a chart already there. A directory that is not a chart is left alone.
fn write_chart(dir: &std::path::Path, files: &[(String, String)]) -> anyhow::Result<()> {
    let name = dir
        .file_name()
        .with_context(|| format!("--helm-chart {}: names no directory", dir.display()))?;
    if dir.exists() && !dir.join("Chart.yaml").is_file() && std::fs::read_dir(dir)?.next().is_some() {
        anyhow::bail!(
            "--helm-chart {}: a directory that is not a chart (no Chart.yaml); not replacing it",
            dir.display()
        );
    }
    let staging = dir.with_file_name(format!(".{}.tmp-{}", name.to_string_lossy(), std::process::id()));
    let written = (|| -> anyhow::Result<()> {
        for (path, text) in files {
            let path = staging.join(path);
            std::fs::create_dir_all(path.parent().expect("chart files are in the chart"))?;
            std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        }
        if dir.exists() {
            std::fs::remove_dir_all(dir).with_context(|| format!("removing the old chart {}", dir.display()))?;
        }
        std::fs::rename(&staging, dir).with_context(|| format!("moving the chart to {}", dir.display()))
    })();
    if written.is_err() {
        let _ = std::fs::remove_dir_all(&staging);
    }
    written.with_context(|| format!("--helm-chart {}", dir.display()))
}

/// A command whose output goes to a reader that may stop early (`| head`) ends quietly when it
/// does, as Unix tools do (Rust ignores SIGPIPE, so a print would panic). The node agents'
/// `tessera_node::stdout` does the same; this workstation tool does not take in the node
/// agents' crate (NVML, nix) for it.
fn quiet_on_closed_stdout() {
    // SAFETY: restoring the default disposition of one signal, before any thread that could
    // race on it prints.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Writes `text` to standard output: a write that fails (`> /dev/full`) is an error, not a panic.
fn print(text: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|e| anyhow::anyhow!("writing to standard output: {e}"))
}

fn main() -> anyhow::Result<()> {
    quiet_on_closed_stdout();
    manifests(ManifestArgs::parse())
}
