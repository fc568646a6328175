//! The command line as a user and a pipeline meet it: a printed spec into a full disk is an
//! error naming standard output, into a reader that stops early (`| head -1`) a quiet end, and
//! flags that would write nonsense into the spec (a relative host path) or spin (an interval of
//! 0) are refused, naming the flag and the value.

use std::process::{Command, Output, Stdio};

use tessera_node::stdout::testing;

const BIN: &str = env!("CARGO_BIN_EXE_tessera-cdi-generator");
const GENERATE: &[&str] = &["generate", "--fixture", "h100x8", "--no-driver-bundle"];

fn run(args: &[&str], stdout: Stdio) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.args(args);
    testing::run(cmd, stdout)
}

#[test]
fn printing_into_a_full_disk_is_an_error_and_into_a_closed_pipe_a_quiet_end() {
    for args in [
        GENERATE,
        &["topology", "--fixture", "h100x8"],
        &["topology", "--fixture", "h100x8", "--json"],
    ] {
        testing::assert_stdout_failures_handled(|| {
            let mut cmd = Command::new(BIN);
            cmd.args(args);
            cmd
        });
    }
}

#[test]
fn host_paths_must_be_absolute_and_intervals_positive() {
    for (args, want) in [
        (
            [GENERATE, &["--mps-root", "mps"]].concat(),
            "invalid value 'mps' for '--mps-root <MPS_ROOT>': a host path must be absolute",
        ),
        (
            [GENERATE, &["--hook-root", "hook"]].concat(),
            "invalid value 'hook' for '--hook-root <HOOK_ROOT>': a host path must be absolute",
        ),
        (
            [GENERATE, &["--driver-bundle-dir", "bundles"]].concat(),
            "'--driver-bundle-dir <DRIVER_BUNDLE_DIR>': a host path must be absolute",
        ),
        (
            [GENERATE, &["--dev-root", "dev"]].concat(),
            "'--dev-root <DEV_ROOT>': a host path must be absolute",
        ),
        (
            [GENERATE, &["--driver-root", "run/nvidia/driver"]].concat(),
            "'--driver-root <DRIVER_ROOT>': a host path must be absolute",
        ),
        (
            vec!["run", "--fixture", "h100x8", "--cdi-dir", "cdi"],
            "'--cdi-dir <CDI_DIR>': a host path must be absolute",
        ),
        (
            vec!["run", "--fixture", "h100x8", "--interval-secs", "0"],
            "invalid value '0' for '--interval-secs <INTERVAL_SECS>': an interval must be at least 1",
        ),
    ] {
        let out = run(&args, Stdio::null());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
    }
    // The environment's value is checked as the flag's.
    let out = Command::new(BIN)
        .args(GENERATE)
        .env("TESSERA_MPS_ROOT", "run/mps")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("'run/mps'") && stderr.contains("must be absolute"),
        "{stderr}"
    );
}
