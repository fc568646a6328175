//! `tessera-try`: Tessera on a real single-node Kubernetes with fixture GPUs, the user guide's
//! examples run on it, and everything removed after (`scripts/try.sh` fetches what it needs and
//! builds Tessera first).

use clap::Parser;

/// Tries Tessera without GPUs: a real Kubernetes 1.36 (API server, scheduler, kubelet,
/// containerd) in a network namespace of its own, Tessera installed from deploy/, the examples
/// of deploy/examples run on fixture cards; prints what each container got. Needs root; run
/// through scripts/try.sh.
#[derive(Parser)]
#[command(name = "tessera-try", version, about)]
struct Cli {}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    Cli::parse();
    anyhow::ensure!(
        nix::unistd::geteuid().is_root(),
        "tessera-try runs a kubelet and containerd: run it as root (scripts/try.sh)"
    );
    let seen = tessera_tests::try_it::run(&mut |line| println!("{line}")).await?;
    tessera_tests::try_it::check(&seen).map_err(anyhow::Error::msg)?;
    println!("{} containers, each with exactly what it asked for", seen.len());
    Ok(())
}
