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
            &["--cdi-dir", "etc/cdi"][..],
            "--cdi-dir=\"etc/cdi\": must be an absolute host path",
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
