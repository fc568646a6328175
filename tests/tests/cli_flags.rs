//! Every binary's command line, read from its own `--help` (each subcommand's too): one naming
//! scheme for durations (`--<what>-secs`, `--<what>-ms`) and outputs (`--out FILE` or `-`,
//! `--out-dir DIR`; `-o/--output FORMAT` only in the kubectl plugin, as kubectl has it);
//! `--help` and `--version` answer everywhere and `--version` names the binary. The binaries are
//! those `cargo metadata` lists, built by `cargo build --workspace --bins` first.

use std::path::PathBuf;
use std::process::Command;

/// Every binary target of the workspace.
fn binaries() -> Vec<String> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--no-deps", "--offline"])
        .current_dir(&root)
        .output()
        .expect("running cargo metadata");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut bins: Vec<String> = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap().iter())
        .filter(|t| t["kind"].as_array().unwrap().iter().any(|k| k == "bin"))
        .map(|t| t["name"].as_str().unwrap().to_string())
        .collect();
    bins.sort();
    bins
}

/// `(exit code, stdout)` of `bin args...`.
fn run(bin: &PathBuf, args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(bin).args(args).output().unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The long flags a help text names, and its subcommands.
fn read_help(text: &str) -> (Vec<String>, Vec<String>) {
    let mut flags = Vec::new();
    for word in text.split(|c: char| c.is_whitespace() || c == ',' || c == '`' || c == '(' || c == ')') {
        if let Some(rest) = word.strip_prefix("--") {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-')
                .collect();
            if !name.is_empty() {
                flags.push(format!("--{name}"));
            }
        }
    }
    let mut subcommands = Vec::new();
    let mut in_commands = false;
    for line in text.lines() {
        if line.starts_with("Commands:") {
            in_commands = true;
        } else if in_commands && line.starts_with("  ") && !line.starts_with("   ") {
            let name = line.split_whitespace().next().unwrap_or("");
            if name != "help" && !name.is_empty() {
                subcommands.push(name.to_string());
            }
        } else if !line.starts_with(' ') {
            in_commands = false;
        }
    }
    (flags, subcommands)
}

#[test]
fn every_binary_names_its_flags_one_way() {
    let bins = binaries();
    assert!(bins.len() >= 10, "{bins:?}");
    let mut problems = Vec::new();
    let mut seen = 0;
    for name in &bins {
        let path = tessera_tests::workspace_bin(name);
        let (code, version) = run(&path, &["--version"]);
        // kubectl shows a plugin as `kubectl tessera`, and so does its version line.
        let shown = name.replacen("kubectl-", "kubectl ", 1);
        if code != Some(0) || !version.starts_with(&format!("{shown} ")) {
            problems.push(format!("{name} --version: {code:?} {version:?}"));
        }
        let (code, top) = run(&path, &["--help"]);
        if code != Some(0) {
            problems.push(format!("{name} --help exits {code:?}"));
        }
        let (mut flags, subcommands) = read_help(&top);
        for sub in &subcommands {
            let (code, text) = run(&path, &[sub, "--help"]);
            if code != Some(0) {
                problems.push(format!("{name} {sub} --help exits {code:?}"));
            }
            if text.contains("--share-enforcement") && !text.contains("`hook`") {
                problems.push(format!("{name} {sub}: --share-enforcement's help does not name hook"));
            }
            flags.extend(read_help(&text).0);
        }
        flags.sort();
        flags.dedup();
        for f in &flags {
            seen += 1;
            let duration = [
                "secs", "seconds", "-ms", "interval", "timeout", "period", "delay", "duration", "backoff",
            ]
            .iter()
            .any(|w| f.contains(w))
                || f.ends_with("-s");
            if duration && !(f.ends_with("-secs") || f.ends_with("-ms")) {
                problems.push(format!("{name} {f}: a duration is named --<what>-secs or --<what>-ms"));
            }
            let output = f == "--output" || f.starts_with("--out-") && f != "--out-dir" || f == "--outdir";
            if output && !(name == "kubectl-tessera" && f == "--output") {
                problems.push(format!(
                    "{name} {f}: outputs are --out (a file or -) or --out-dir (a directory)"
                ));
            }
        }
    }
    assert!(seen > 100, "only {seen} flags read: is the help parsed?");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
