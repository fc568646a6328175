//! The GPU harness's cluster part (`tests/gpu/run.sh --only cluster`, `tessera-gpu-cluster`) in
//! its dry run, as CI runs it: the real Kubernetes of the tests with Tessera installed from its
//! manifests, on an H100x8 fixture node with NVIDIA's real driver files and a stand-in MPS
//! daemon, every case of the GPU run (extender pods, DRA claims, pod start) in MPS and then hook
//! mode. Keeps the harness working between GPU runs.

use tessera_tests::gpu_dry_run;

/// Every case the harness runs, by mode: what a GPU run's table holds too.
const CASES: [(&str, &[&str]); 2] = [
    (
        "mps",
        &[
            "published inventory",
            "whole card (tessera.io/gpu-core: 100)",
            "30% + 8 GiB share pod",
            "two containers of 50% + 10 GiB",
            "pod start, share vs plain",
            "DRA: the node's slice",
            "DRA: whole-card claim",
            "DRA: 30% + 8 GiB share claim",
        ],
    ),
    (
        "hook",
        &[
            "whole card (tessera.io/gpu-core: 100)",
            "30% + 8 GiB share pod",
            "two containers of 50% + 10 GiB",
            "pod start, share vs plain",
        ],
    ),
];

#[test]
fn the_gpu_cluster_harness_dry_run_passes_every_case() {
    let run = gpu_dry_run::run("cluster", "gpu-cluster-table.txt");
    let table = &run.table;
    assert!(run.passed, "{table}\n{}", run.stderr_tail);
    let rows: Vec<&str> = table.lines().filter(|l| l.contains(" | ")).collect();
    for (mode, cases) in CASES {
        for case in cases {
            let row = rows
                .iter()
                .find(|r| {
                    let mut cols = r.split(" | ").map(str::trim);
                    cols.next().is_some_and(|m| m.ends_with(&format!(" {mode}"))) && cols.next() == Some(case)
                })
                .unwrap_or_else(|| panic!("no row {mode} | {case}:\n{table}"));
            assert!(row.contains("| PASS |"), "{row}\n{table}");
        }
    }
    assert_eq!(rows.len(), 12, "{table}");
    // The pod-start rows give the ratio of every round.
    assert!(
        rows.iter()
            .filter(|r| r.contains("pod start"))
            .all(|r| r.contains("3 rounds") && r.contains("share/plain median")),
        "{table}"
    );
}
