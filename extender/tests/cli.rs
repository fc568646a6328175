//! The command line as a pipeline uses it: `tessera-extender simulate | head -1` ends quietly
//! when the reader stops (SIGPIPE, as Unix tools do), not with a panic and exit code 101.

use std::io::{BufRead as _, BufReader};
use std::os::unix::process::ExitStatusExt as _;
use std::process::{Command, Stdio};

#[test]
fn simulate_into_a_reader_that_stops_early_ends_quietly() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tessera-extender"))
        .args(["simulate", "--seeds", "42..42"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    // The reader is gone (dropped above); the simulator goes on to its next line.
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(first.starts_with("embedded default:"), "{first}");
    assert_eq!(out.status.signal(), Some(libc::SIGPIPE), "{:?}: {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
}
