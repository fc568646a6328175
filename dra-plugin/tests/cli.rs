//! The DRA plugin's command line refuses nonsense before it starts, naming the flag and the
//! value: a memory unit or poll interval of 0, a relative host path.

use std::process::Command;

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
            &["--state-dir", "claims"][..],
            "invalid value 'claims' for '--state-dir <STATE_DIR>': a host path must be absolute",
        ),
        (
            &["--cdi-dir", "cdi"][..],
            "'--cdi-dir <CDI_DIR>': a host path must be absolute",
        ),
        (
            &["--registry-dir", "registry"][..],
            "'--registry-dir <REGISTRY_DIR>': a host path must be absolute",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_tessera-dra-plugin"))
            .args(["--node-name", "n1"])
            .args(args)
            .env("RUST_BACKTRACE", "0")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}
