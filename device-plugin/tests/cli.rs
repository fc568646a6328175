//! The binary's refusals: a fixture that cannot be read, a plugin directory it cannot write
//! (it used to serve nothing, or keep running, saying only "keeping the last one").

use std::process::Command;

fn run(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tessera-device-plugin"))
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn refuses_what_it_cannot_serve_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let (code, err) = run(&["--fixture", "h100x9", "--plugin-dir", dir.path().to_str().unwrap()]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("--fixture h100x9: cannot read fixture h100x9") && err.contains("t4x2"),
        "{err}"
    );
    let (code, err) = run(&["--fixture", "t4x2", "--plugin-dir", "/nonexistent/plugins"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("--plugin-dir /nonexistent/plugins: cannot create sockets there"),
        "{err}"
    );
}

/// A memory unit or a poll interval of 0, a relative host path: refused before anything runs,
/// naming the flag and the value.
#[test]
fn refuses_nonsense_values_naming_the_flag() {
    for (args, want) in [
        (
            &["--memory-unit-mib", "0"][..],
            "invalid value '0' for '--memory-unit-mib <MEMORY_UNIT_MIB>': the memory unit must be at least 1 MiB",
        ),
        (
            &["--poll-secs", "0"][..],
            "invalid value '0' for '--poll-secs <POLL_SECS>': an interval must be at least 1",
        ),
        (
            &["--plugin-dir", "plugins"][..],
            "invalid value 'plugins' for '--plugin-dir <PLUGIN_DIR>': a host path must be absolute",
        ),
        (
            &["--driver-root", "nvidia"][..],
            "'--driver-root <DRIVER_ROOT>': a host path must be absolute",
        ),
    ] {
        let (code, err) = run(args);
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}
