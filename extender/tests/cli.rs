//! The extender's command line refuses nonsense, naming the flag and the value.

use std::process::Command;

/// `serve` takes no zero where one is meaningless.
#[test]
fn serve_refuses_nonsense_naming_the_flag() {
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_tessera-extender"))
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
    for flag in ["--memory-unit-mib", "--lease-duration-secs"] {
        let (code, stderr, _) = run(&["serve", flag, "0"]);
        assert_eq!(code, Some(2), "{flag}: {stderr}");
        assert!(stderr.contains(flag) && stderr.contains("'0'"), "{flag}: {stderr}");
    }
}
