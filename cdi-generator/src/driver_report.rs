//! What `tessera-cdi-generator driver` prints: the root, the version and every driver file
//! with how it was found, for operators troubleshooting a node (and for tests).

use std::fmt::Write as _;

use tessera_core::driver::DriverFileKind;
use tessera_node::driver::{Driver, RootChoice, VersionSource};

fn choice(d: &Driver) -> String {
    let tried = d
        .tried
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ");
    match d.choice {
        RootChoice::Given => "given".into(),
        RootChoice::Detected => format!("detected; tried {tried}"),
        RootChoice::Fallback => format!("no root holds libcuda; tried {tried}"),
    }
}

fn kind(k: DriverFileKind) -> &'static str {
    match k {
        DriverFileKind::Library => "library",
        DriverFileKind::Binary => "binary",
        DriverFileKind::Firmware => "firmware",
        DriverFileKind::Config => "config",
        DriverFileKind::Socket => "socket",
    }
}

/// The human-readable report, aligned, ending with the verdict.
pub fn text(d: &Driver) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "driver root:    {} ({})", d.root.display(), choice(d));
    let version = match (&d.version, d.version_source) {
        (Some(v), Some(VersionSource::Nvml)) => format!("{v} (from NVML)"),
        (Some(v), _) => format!("{v} (from the libcuda file name; NVML not loaded)"),
        (None, _) => "unknown (no NVML, no versioned libcuda)".into(),
    };
    let _ = writeln!(s, "driver version: {version}");
    let _ = writeln!(s, "files:          {}", d.files.len());
    let rows: Vec<[String; 4]> = d
        .files
        .iter()
        .map(|f| {
            let loader = f
                .loader_name()
                .filter(|n| *n != f.name())
                .map(|n| format!("as {n}"))
                .unwrap_or_default();
            [
                kind(f.kind).to_string(),
                d.host_path(f).display().to_string(),
                f.found_by.to_string(),
                loader,
            ]
        })
        .collect();
    let w1 = rows.iter().map(|r| r[1].len()).max().unwrap_or(0);
    let w2 = rows.iter().map(|r| r[2].len()).max().unwrap_or(0);
    for r in &rows {
        let line = format!("  {:<9} {:<w1$}  {:<w2$}  {}", r[0], r[1], r[2], r[3]);
        let _ = writeln!(s, "{}", line.trim_end());
    }
    if !d.missing.is_empty() {
        let _ = writeln!(s, "not found:      {}", d.missing.join(", "));
    }
    for k in &d.skipped {
        let _ = writeln!(s, "skipped:        {} ({})", k.path.display(), k.reason);
    }
    match d.check() {
        Ok(()) => {
            let _ = writeln!(s, "ready:          yes");
        }
        Err(e) => {
            let _ = writeln!(s, "ready:          NO: {e}");
        }
    }
    s
}

/// The same as JSON.
pub fn json(d: &Driver) -> serde_json::Value {
    serde_json::json!({
        "root": d.root,
        "choice": format!("{:?}", d.choice).to_lowercase(),
        "tried": d.tried,
        "version": d.version,
        "version_source": d.version_source,
        "files": d.files.iter().map(|f| serde_json::json!({
            "kind": f.kind,
            "host_path": d.host_path(f),
            "found_by": f.found_by,
            "loader_name": f.loader_name(),
        })).collect::<Vec<_>>(),
        "missing": d.missing,
        "skipped": d.skipped.iter().map(|k| serde_json::json!({"path": k.path, "reason": k.reason})).collect::<Vec<_>>(),
        "ready": d.check().is_ok(),
        "error": d.check().err().map(|e| e.to_string()),
    })
}
