//! The GPU harness (`tests/gpu/run.sh`) in its dry run, as CI runs it: every case of the real
//! GPU run, on a fixture node with NVIDIA's real driver files, a stand-in MPS control daemon and
//! a probe that reports what the container got, through containerd 1.7 and 2.x. Keeps the
//! harness working between GPU runs (a lent GPU is spent on the real table, not on its bugs).

use std::path::Path;
use std::process::Command;

#[test]
fn the_gpu_harness_dry_run_passes_every_case() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let exe = std::env::current_exe().unwrap();
    let built = exe.parent().and_then(Path::parent).unwrap();
    let out = tempfile::tempdir().unwrap();
    let run = Command::new("bash")
        .arg(repo.join("tests/gpu/run.sh"))
        .args(["--dry-run", "--only", "cri", "--bin-dir"])
        .arg(built)
        .env("OUT", out.path())
        .output()
        .unwrap();
    let table = std::fs::read_to_string(out.path().join("gpu-table.txt")).unwrap_or_default();
    assert!(
        run.status.success(),
        "{table}\n{}",
        String::from_utf8_lossy(&run.stderr)
            .lines()
            .rev()
            .take(30)
            .collect::<Vec<_>>()
            .join("\n")
    );
    let rows: Vec<&str> = table.lines().filter(|l| l.contains(" | ")).collect();
    assert!(rows.iter().filter(|r| r.contains("| PASS |")).count() >= 40, "{table}");
    // Only what needs a newer driver than the fixture's (550) is skipped, naming its version.
    let skipped: Vec<&&str> = rows.iter().filter(|r| r.contains("| SKIP |")).collect();
    assert!(
        skipped
            .iter()
            .all(|r| r.contains("driver r615+") && r.contains("driver 550.")),
        "{table}"
    );
    assert!(
        rows.iter().all(|r| r.contains("| PASS |") || r.contains("| SKIP |")),
        "{table}"
    );
}
