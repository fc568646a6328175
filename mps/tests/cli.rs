//! The supervisor's command line: `status` into a full disk is an error naming standard
//! output, into a reader that stops early a quiet end; a relative MPS root (handed to share
//! containers as a host path) and intervals of 0 (a busy loop) are refused, naming the flag.

use std::process::{Command, Stdio};

use tessera_node::stdout::testing;

const BIN: &str = env!("CARGO_BIN_EXE_tessera-mps-supervisor");

fn command(args: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(args).env_remove("TESSERA_MPS_ROOT");
    cmd
}

#[test]
fn status_into_a_full_disk_is_an_error_and_into_a_closed_pipe_a_quiet_end() {
    let dir = tempfile::tempdir().unwrap();
    let args = ["status", "--mps-root", dir.path().to_str().unwrap()];
    testing::assert_stdout_failures_handled(|| command(&args));
}

#[test]
fn relative_roots_and_zero_intervals_are_refused_naming_the_flag() {
    for (args, want) in [
        (
            &["status", "--mps-root", "mps"][..],
            "invalid value 'mps' for '--mps-root <MPS_ROOT>': a host path must be absolute",
        ),
        (
            &["run", "--mps-root", "mps"][..],
            "invalid value 'mps' for '--mps-root <MPS_ROOT>': a host path must be absolute",
        ),
        (
            &["run", "--host-root", "host"][..],
            "'--host-root <HOST_ROOT>': a host path must be absolute",
        ),
        (
            &["run", "--check-secs", "0"][..],
            "invalid value '0' for '--check-secs <CHECK_SECS>': an interval must be at least 1",
        ),
        (
            &["run", "--inventory-secs", "0"][..],
            "invalid value '0' for '--inventory-secs <INVENTORY_SECS>': an interval must be at least 1",
        ),
        (
            &["run", "--backoff-ms", "0"][..],
            "invalid value '0' for '--backoff-ms <BACKOFF_MS>': an interval must be at least 1",
        ),
    ] {
        let out = testing::run(command(args), Stdio::null());
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}
