//! The binary's flags, checked as NRI wants them.

/// The plugin's name and index as NRI wants them, refused otherwise, naming the flag.
#[test]
fn name_and_index_are_checked() {
    for (args, want) in [
        (&["run", "--idx", "999"][..], "invalid value '999' for '--idx <IDX>'"),
        (&["run", "--idx", "abc"][..], "invalid value 'abc' for '--idx <IDX>'"),
        (&["run", "--name", ""][..], "invalid value '' for '--name <NAME>'"),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tessera-nri-plugin"))
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}
