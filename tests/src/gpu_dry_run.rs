//! The GPU harness (`tests/gpu/run.sh`) in its dry run, one part at a time, as the suite's
//! tests run it: on the binaries of this build and the runtimes the fetch scripts fetched.

use std::path::Path;
use std::process::Command;

/// What a dry run of one part left: whether it passed, its table, the end of its stderr.
pub struct DryRun {
    pub passed: bool,
    pub table: String,
    pub stderr_tail: String,
}

/// Runs `tests/gpu/run.sh --dry-run --only <part>` and reads the table it writes to `table`
/// under its `$OUT`.
pub fn run(part: &str, table: &str) -> DryRun {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let exe = std::env::current_exe().expect("the test's own path");
    // A test runs from target/debug/deps; the binaries are in target/debug.
    let built = exe.parent().and_then(Path::parent).expect("a target folder");
    let out = tempfile::tempdir().expect("a temporary folder");
    let run = Command::new("bash")
        .arg(repo.join("tests/gpu/run.sh"))
        .args(["--dry-run", "--only", part, "--bin-dir"])
        .arg(built)
        .env("OUT", out.path())
        .output()
        .expect("bash runs");
    let stderr = String::from_utf8_lossy(&run.stderr);
    let mut tail: Vec<&str> = stderr.lines().rev().take(40).collect();
    tail.reverse();
    DryRun {
        passed: run.status.success(),
        table: std::fs::read_to_string(out.path().join(table)).unwrap_or_default(),
        stderr_tail: tail.join("\n"),
    }
}
