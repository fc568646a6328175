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

/// A listen address names a port that exists; the error says so, naming the flag and value.
#[test]
fn serve_names_a_port_out_of_range() {
    for flag in ["--listen", "--webhook-listen"] {
        let out = Command::new(env!("CARGO_BIN_EXE_tessera-extender"))
            .args(["serve", flag, "0.0.0.0:99999"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag}: {stderr}");
        assert!(
            stderr.contains(&format!("invalid value '0.0.0.0:99999' for '{flag} <"))
                && stderr.contains("port 99999: a port is 1..=65535"),
            "{flag}: {stderr}"
        );
    }
}

/// An empty `active` file in the key directory is named, with what it must hold.
#[test]
fn serve_names_an_empty_active_key_file() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("k1"), "0123456789abcdef0123456789abcdef").unwrap();
    std::fs::write(dir.path().join("active"), "\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tessera-extender"))
        .args(["serve", "--keys-dir", dir.path().to_str().unwrap()])
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let active = dir.path().join("active");
    assert!(
        stderr.contains(&format!(
            "{} is empty: it must hold the id of the key that signs (the key files are k1)",
            active.display()
        )),
        "{stderr}"
    );
}
