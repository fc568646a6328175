//! Resolves Tessera's CDI device names (`tessera.io/gpu=...`) against the spec files on disk
//! into the edits to apply. Only Tessera's own kind is read (other vendors' files in the same
//! directories are skipped); later directories win, as in CDI. Specs are re-read only when a
//! file changes, and results are memoised per name set, so CreateContainer stays fast.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use tessera_core::cdi::{CdiEdits, CdiSpec, parse_qualified};
use tessera_core::names::CDI_KIND;

/// Why Tessera's CDI devices could not be resolved.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    /// A spec file could not be read.
    #[error("{path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A file that names Tessera's kind is not JSON or YAML.
    #[error("{path}: not a readable CDI spec: {reason}")]
    Unreadable { path: PathBuf, reason: String },
    /// Tessera's spec does not parse as a CDI spec.
    #[error("{path}: {reason}")]
    Parse { path: PathBuf, reason: String },
    /// Tessera's spec parses but is not valid.
    #[error("{path}: {source}")]
    Invalid {
        path: PathBuf,
        #[source]
        source: tessera_core::cdi::CdiError,
    },
    /// A device name is not a qualified CDI name.
    #[error("{0}")]
    Name(#[source] tessera_core::cdi::CdiError),
    /// No spec of Tessera's has these devices.
    #[error("unresolvable CDI devices {}", .0.join(", "))]
    Unresolvable(Vec<String>),
}

/// A device node to add.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceEdit {
    /// Path in the container.
    pub path: String,
    /// `c` or `b`.
    pub kind: String,
    /// Major.
    pub major: i64,
    /// Minor.
    pub minor: i64,
}

/// A mount to add.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEdit {
    /// Container path.
    pub destination: String,
    /// Host path.
    pub source: String,
    /// Type (`bind`).
    pub kind: String,
    /// Options.
    pub options: Vec<String>,
}

/// All edits of a set of CDI devices (spec-wide edits included).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Edits {
    /// Device nodes.
    pub devices: Vec<DeviceEdit>,
    /// Mounts.
    pub mounts: Vec<MountEdit>,
    /// `KEY=value`.
    pub env: Vec<String>,
}

impl Edits {
    /// Adds `e` (device nodes by path and mounts by destination are not repeated).
    fn add(&mut self, e: &CdiEdits) {
        self.env.extend(e.env.iter().cloned());
        for d in &e.device_nodes {
            if !self.devices.iter().any(|x| x.path == d.path) {
                self.devices.push(DeviceEdit {
                    path: d.path.clone(),
                    kind: d.kind.clone(),
                    major: d.major,
                    minor: d.minor,
                });
            }
        }
        for m in &e.mounts {
            if !self.mounts.iter().any(|x| x.destination == m.container_path) {
                self.mounts.push(MountEdit {
                    destination: m.container_path.clone(),
                    source: m.host_path.clone(),
                    kind: "bind".into(),
                    options: m.options.clone(),
                });
            }
        }
    }
}

/// The resolver.
pub struct CdiResolver {
    dirs: Vec<PathBuf>,
    stamp: Vec<(PathBuf, Option<SystemTime>)>,
    /// Tessera's specs, highest priority first.
    specs: Vec<CdiSpec>,
    memo: HashMap<Vec<String>, Edits>,
}

/// Reads one spec file, `None` when it is another vendor's.
fn read_spec(path: &Path) -> Result<Option<CdiSpec>, ResolveError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        // Gone between listing and reading (a claim's marker unprepared, the spec of a node
        // whose last MIG instance went): not a spec any more.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(ResolveError::Read {
                path: path.to_path_buf(),
                source,
            });
        }
    };
    let yaml = matches!(path.extension().and_then(|x| x.to_str()), Some("yaml" | "yml"));
    let parsed = if yaml {
        serde_yaml::from_str::<serde_yaml::Value>(&text)
            .map(|v| v.get("kind").and_then(|k| k.as_str()).map(str::to_string))
            .map_err(|e| e.to_string())
    } else {
        serde_json::from_str::<serde_json::Value>(&text)
            .map(|v| v.get("kind").and_then(|k| k.as_str()).map(str::to_string))
            .map_err(|e| e.to_string())
    };
    let kind = match parsed {
        Ok(kind) => kind,
        // A file that cannot be parsed is nobody's for sure; one that names Tessera's kind is
        // a broken spec of ours, said as such rather than left to look like a missing device.
        Err(e) if text.contains(CDI_KIND) => {
            return Err(ResolveError::Unreadable {
                path: path.to_path_buf(),
                reason: e,
            });
        }
        Err(_) => None,
    };
    if kind.as_deref() != Some(CDI_KIND) {
        return Ok(None);
    }
    let parse = |reason: String| ResolveError::Parse {
        path: path.to_path_buf(),
        reason,
    };
    let spec: CdiSpec = if yaml {
        serde_yaml::from_str(&text).map_err(|e| parse(e.to_string()))?
    } else {
        serde_json::from_str(&text).map_err(|e| parse(e.to_string()))?
    };
    spec.validate().map_err(|source| ResolveError::Invalid {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(Some(spec))
}

impl CdiResolver {
    /// A resolver over `dirs` (later directories win, as in CDI).
    pub fn new(dirs: Vec<PathBuf>) -> Self {
        Self {
            dirs,
            stamp: Vec::new(),
            specs: Vec::new(),
            memo: HashMap::new(),
        }
    }

    fn files(&self) -> Vec<(PathBuf, Option<SystemTime>)> {
        let mut out = Vec::new();
        for d in &self.dirs {
            let Ok(entries) = std::fs::read_dir(d) else { continue };
            let mut here: Vec<_> = entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| matches!(p.extension().and_then(|x| x.to_str()), Some("json" | "yaml" | "yml")))
                .map(|p| {
                    let t = std::fs::metadata(&p).and_then(|m| m.modified()).ok();
                    (p, t)
                })
                .collect();
            here.sort();
            out.extend(here);
        }
        out
    }

    fn refresh(&mut self) -> Result<(), ResolveError> {
        let stamp = self.files();
        if stamp == self.stamp {
            return Ok(());
        }
        let mut specs = Vec::new();
        for (path, _) in &stamp {
            if let Some(s) = read_spec(path)? {
                specs.push(s);
            }
        }
        specs.reverse();
        self.specs = specs;
        self.stamp = stamp;
        self.memo.clear();
        Ok(())
    }

    /// The edits for `names` (fully qualified CDI names of Tessera's kind).
    pub fn resolve(&mut self, names: &[String]) -> Result<Edits, ResolveError> {
        self.refresh()?;
        if let Some(e) = self.memo.get(names) {
            return Ok(e.clone());
        }
        let mut edits = Edits::default();
        let mut applied_specs: Vec<usize> = Vec::new();
        let mut unresolved = Vec::new();
        for qualified in names {
            let (kind, name) = parse_qualified(qualified).map_err(ResolveError::Name)?;
            let found = (kind == CDI_KIND)
                .then(|| {
                    self.specs
                        .iter()
                        .enumerate()
                        .find_map(|(i, s)| s.device(name).map(|d| (i, d)))
                })
                .flatten();
            match found {
                Some((i, d)) => {
                    if !applied_specs.contains(&i) {
                        edits.add(&self.specs[i].container_edits);
                        applied_specs.push(i);
                    }
                    edits.add(&d.container_edits);
                }
                None => unresolved.push(qualified.clone()),
            }
        }
        if !unresolved.is_empty() {
            return Err(ResolveError::Unresolvable(unresolved));
        }
        self.memo.insert(names.to_vec(), edits.clone());
        Ok(edits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolves_tessera_devices_and_skips_other_vendors() {
        let dir = tempfile::tempdir().unwrap();
        let spec = serde_json::json!({
            "cdiVersion": "0.5.0", "kind": CDI_KIND,
            "devices": [
                {"name": "0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0, "permissions": "rw"}]}},
                {"name": "1", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia1", "type": "c", "major": 195, "minor": 1, "permissions": "rw"}]}}
            ],
            "containerEdits": {"env": ["A=1"], "deviceNodes": [{"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255, "permissions": "rw"}],
                "mounts": [{"hostPath": "/x", "containerPath": "/y", "options": ["ro", "bind"]}]}
        });
        std::fs::write(dir.path().join("tessera.io-gpu.json"), spec.to_string()).unwrap();
        // Another vendor's YAML is left alone, even when we could not parse it as ours.
        std::fs::write(
            dir.path().join("nvidia.yaml"),
            "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\nhooks: []\n",
        )
        .unwrap();
        let mut r = CdiResolver::new(vec![dir.path().to_path_buf()]);
        let e = r.resolve(&[format!("{CDI_KIND}=0"), format!("{CDI_KIND}=1")]).unwrap();
        let paths: Vec<&str> = e.devices.iter().map(|d| d.path.as_str()).collect();
        assert_eq!(paths, ["/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia1"]);
        assert_eq!((e.env.len(), e.mounts.len()), (1, 1), "spec-wide edits once");
        let err = r.resolve(&[format!("{CDI_KIND}=9")]).unwrap_err().to_string();
        assert_eq!(err, "unresolvable CDI devices tessera.io/gpu=9");
        assert!(r.resolve(&["nvidia.com/gpu=0".into()]).is_err());
        // A later directory wins.
        let later = tempfile::tempdir().unwrap();
        let mut s2 = spec.clone();
        s2["devices"][0]["containerEdits"]["deviceNodes"][0]["minor"] = 7.into();
        std::fs::write(later.path().join("tessera.io-gpu.json"), s2.to_string()).unwrap();
        let mut r = CdiResolver::new(vec![dir.path().to_path_buf(), later.path().to_path_buf()]);
        let e = r.resolve(&[format!("{CDI_KIND}=0")]).unwrap();
        assert_eq!(e.devices[1].minor, 7);
    }

    /// A broken spec of Tessera's kind is reported with its parse error (it used to read as
    /// "unresolvable", as if the device were missing); a broken file of nobody in particular is
    /// still skipped.
    #[test]
    fn a_broken_spec_of_ours_says_why() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("other.json"), "{not json").unwrap();
        let mut r = CdiResolver::new(vec![dir.path().to_path_buf()]);
        assert_eq!(
            r.resolve(&[format!("{CDI_KIND}=0")]).unwrap_err().to_string(),
            "unresolvable CDI devices tessera.io/gpu=0"
        );
        let broken = dir.path().join("tessera.io-gpu.json");
        std::fs::write(
            &broken,
            r#"{"cdiVersion": "0.6.0", "kind": "tessera.io/gpu", "devices": ["#,
        )
        .unwrap();
        let err = r.resolve(&[format!("{CDI_KIND}=0")]).unwrap_err().to_string();
        assert!(
            err.starts_with(&format!(
                "{}: not a readable CDI spec: EOF while parsing",
                broken.display()
            )),
            "{err}"
        );
    }
}
