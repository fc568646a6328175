//! The binary's flags, checked as NRI wants them; `check`'s report into a full disk is an
//! error naming standard output, into a reader that stops early a quiet end.

use std::process::{Command, Output, Stdio};

use tessera_node::stdout::testing;

const BIN: &str = env!("CARGO_BIN_EXE_tessera-nri-plugin");

fn run(args: &[&str], stdout: Stdio) -> Output {
    testing::run(command(args), stdout)
}

fn command(args: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(args);
    cmd
}

/// The plugin's name and index as NRI wants them, refused otherwise, naming the flag.
#[test]
fn name_and_index_are_checked() {
    for (args, want) in [
        (&["run", "--idx", "999"][..], "invalid value '999' for '--idx <IDX>'"),
        (&["run", "--idx", "abc"][..], "invalid value 'abc' for '--idx <IDX>'"),
        (&["run", "--name", ""][..], "invalid value '' for '--name <NAME>'"),
    ] {
        let out = std::process::Command::new(BIN).args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

/// Host paths are absolute (the MPS root is handed to containers, the CDI directories are the
/// runtime's), and a listen address names a port that exists.
#[test]
fn host_paths_and_addresses_are_checked_naming_the_flag() {
    for (args, want) in [
        (
            &["run", "--mps-root", "mps"][..],
            "invalid value 'mps' for '--mps-root <MPS_ROOT>': a host path must be absolute",
        ),
        (
            &["run", "--hook-root", "hook"][..],
            "'--hook-root <HOOK_ROOT>': a host path must be absolute",
        ),
        (
            &["run", "--cdi-dir", "/etc/cdi", "--cdi-dir", "cdi"][..],
            "invalid value 'cdi' for '--cdi-dir <CDI_DIRS>': a host path must be absolute",
        ),
        (
            &["run", "--dra-state-dir", "dra"][..],
            "'--dra-state-dir <DRA_STATE_DIR>': a host path must be absolute",
        ),
        (
            &["run", "--grants-dir", "grants"][..],
            "'--grants-dir <GRANTS_DIR>': a host path must be absolute",
        ),
        (
            &["check", "--mps-root", "mps"][..],
            "invalid value 'mps' for '--mps-root <MPS_ROOT>': a host path must be absolute",
        ),
        (
            &["check", "--driver-root", "run/nvidia/driver"][..],
            "'--driver-root <DRIVER_ROOT>': a host path must be absolute",
        ),
        (
            &["run", "--metrics-listen", "0.0.0.0:99999"][..],
            "invalid value '0.0.0.0:99999' for '--metrics-listen <METRICS_LISTEN>': port 99999: a port is 1..=65535",
        ),
        (
            &["run", "--metrics-listen", "9403"][..],
            "'--metrics-listen <METRICS_LISTEN>': no port: expected IP:PORT",
        ),
    ] {
        let out = run(args, Stdio::null());
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

#[test]
fn check_into_a_full_disk_is_an_error_and_into_a_closed_pipe_a_quiet_end() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let socket = format!("{d}/nri.sock");
    let args = [
        "check",
        "--socket",
        &socket,
        "--host-root",
        d,
        "--dev-root",
        d,
        "--keys-dir",
        d,
        "--cdi-dir",
        d,
    ];
    testing::assert_stdout_failures_handled(|| command(&args));
}
