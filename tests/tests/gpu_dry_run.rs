//! The GPU harness (`tests/gpu/run.sh`) in its dry run, as CI runs it: every case of the real
//! GPU run, on a fixture node with NVIDIA's real driver files, a stand-in MPS control daemon and
//! a probe that reports what the container got, through containerd 1.7 and 2.x. Keeps the
//! harness working between GPU runs (a lent GPU is spent on the real table, not on its bugs).

use tessera_tests::gpu_dry_run;

#[test]
fn the_gpu_harness_dry_run_passes_every_case() {
    let run = gpu_dry_run::run("cri", "gpu-table.txt");
    let table = &run.table;
    assert!(run.passed, "{table}\n{}", run.stderr_tail);
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
