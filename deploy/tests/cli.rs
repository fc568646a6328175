//! `tessera-manifests` renders nothing Kubernetes would refuse or that would point nowhere,
//! naming the flag and the value; good flags render.

use std::process::Command;

#[test]
fn manifests_refuse_nonsense_naming_the_flag() {
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_tessera-manifests"))
            .args(args)
            .env("RUST_BACKTRACE", "0")
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
            out.stdout.len(),
        )
    };
    for (args, want) in [
        (
            &["--namespace", "Bad_NS!"][..],
            "--namespace=\"Bad_NS!\": not a namespace name",
        ),
        (&["--image", ""][..], "--image=\"\": not an image reference"),
        (
            &["--driver-root", "run/nvidia/driver"][..],
            "--driver-root=\"run/nvidia/driver\": must be an absolute host path",
        ),
        (
            &["--nri-socket", "nri.sock"][..],
            "--nri-socket=\"nri.sock\": must be an absolute host path",
        ),
        (
            &["--nri-socket", "/var/run/nri/"][..],
            "must name the socket, not its directory",
        ),
        (
            &["--exclusive-process", "--share-enforcement", "hook"][..],
            "--exclusive-process: only with --share-enforcement mps (was hook)",
        ),
        (
            &["--cdi-dir", "etc/cdi"][..],
            "--cdi-dir=\"etc/cdi\": must be an absolute host path",
        ),
        (
            &["--percentage-of-nodes-to-score", "101"][..],
            "--percentage-of-nodes-to-score must be 0 to 100, got 101",
        ),
    ] {
        let (code, stderr, printed) = run(args);
        assert_eq!((code, printed), (Some(1), 0), "{args:?}: {stderr}");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
    }
    let (code, _, printed) = run(&["--namespace", "gpu-system"]);
    assert_eq!(code, Some(0));
    assert!(printed > 0);
}

#[test]
fn a_chart_replaces_a_chart_and_nothing_else() {
    let tmp = std::env::temp_dir().join(format!("tessera-chart-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(tmp.join("notes")).unwrap();
    std::fs::write(tmp.join("notes/todo.txt"), "mine").unwrap();
    let manifests = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_tessera-manifests"))
            .args(args)
            .env("RUST_BACKTRACE", "0")
            .output()
            .unwrap()
    };
    // A directory of someone else's is left as it was.
    let out = manifests(&["--helm-chart", tmp.join("notes").to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a chart (no Chart.yaml)"));
    assert_eq!(std::fs::read_to_string(tmp.join("notes/todo.txt")).unwrap(), "mine");
    // A new chart, its values from the flags; then replaced by another, stale files gone.
    let chart = tmp.join("tessera");
    let out = manifests(&[
        "--image",
        "registry.example.com/t:1",
        "--helm-chart",
        chart.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        std::fs::read_to_string(chart.join("values.yaml"))
            .unwrap()
            .contains("image: registry.example.com/t:1\n")
    );
    std::fs::write(chart.join("templates/stale.yaml"), "kind: Stale").unwrap();
    assert!(manifests(&["--helm-chart", chart.to_str().unwrap()]).status.success());
    assert!(!chart.join("templates/stale.yaml").exists());
    assert!(
        std::fs::read_dir(&tmp)
            .unwrap()
            .all(|e| !e.unwrap().file_name().to_string_lossy().starts_with('.'))
    );
    // The namespace is the release's: naming one is an error, not ignored.
    let out = manifests(&["--namespace", "x", "--helm-chart", chart.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    std::fs::remove_dir_all(&tmp).unwrap();
}

/// The manifests into a full disk: an error naming standard output, not a panic; into a reader
/// that stops early (`| head -1`): a quiet end, as Unix tools do.
#[test]
fn printing_into_a_full_disk_is_an_error_and_into_a_closed_pipe_a_quiet_end() {
    tessera_node::stdout::testing::assert_stdout_failures_handled(|| {
        Command::new(env!("CARGO_BIN_EXE_tessera-manifests"))
    });
}
