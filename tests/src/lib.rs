//! Helpers for Tessera's cross-crate and end-to-end tests: chiefly a harness that runs real
//! containerd (1.7 and 2.x) on private paths and drives it through CRI, as the kubelet does.

pub mod apiserver;
pub mod cluster;
pub mod containerd;
pub mod fake_node;
pub mod fetched;
pub mod gpu_cluster;
pub mod gpu_dry_run;
pub mod http;
pub mod kubelet;
pub mod mps;
pub mod nvidia;
pub mod try_it;
pub mod uds;

/// A Tessera binary from the target folder (`cargo build --workspace --bins`, which
/// scripts/test.sh runs first: cargo builds a package's binaries only for its own tests).
pub fn workspace_bin(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    // A test runs from target/debug/deps, a binary (tessera-try) from target/debug.
    let dir = exe.parent().unwrap();
    let dir = if dir.ends_with("deps") {
        dir.parent().unwrap()
    } else {
        dir
    };
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is not built: run `cargo build --workspace --bins` first",
        path.display()
    );
    path
}
