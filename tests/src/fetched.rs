//! What a fetch script (`tests/runtimes/fetch.sh`, `tests/nvidia/fetch.sh`) reports: one line
//! per item, `NAME VERSION PATH`. A script runs once per process; a cache carried to another
//! machine (no network there) is read from its ready file, named by an environment variable.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

/// Items by name: (version, path).
pub type Items = HashMap<String, (String, PathBuf)>;

/// Runs `script` (relative to the tests crate), or reads `ready` under `$cache_var`'s folder
/// when that is set and holds one, and checks that every name in `want` is reported.
pub fn fetch(script: &str, cache_var: &str, ready: &str, want: &[&str]) -> anyhow::Result<Items> {
    if let Some(cache) = std::env::var_os(cache_var).map(PathBuf::from)
        && let Ok(text) = std::fs::read_to_string(cache.join(ready))
    {
        return parse(
            &text.replace('@', &cache.display().to_string()),
            &cache.join(ready),
            want,
        );
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join(script);
    let out = Command::new("bash")
        .arg(&script)
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    if !out.status.success() {
        bail!("{} failed:\n{}", script.display(), String::from_utf8_lossy(&out.stderr));
    }
    parse(&String::from_utf8_lossy(&out.stdout), &script, want)
}

fn parse(text: &str, source: &Path, want: &[&str]) -> anyhow::Result<Items> {
    let mut items = HashMap::new();
    for line in text.lines() {
        let mut parts = line.splitn(3, ' ');
        if let (Some(name), Some(version), Some(path)) = (parts.next(), parts.next(), parts.next()) {
            items.insert(name.to_string(), (version.to_string(), PathBuf::from(path)));
        }
    }
    for key in want {
        if !items.contains_key(*key) {
            bail!("{} did not report {key}", source.display());
        }
    }
    Ok(items)
}
