//! `/proc/driver/nvidia-caps/mig-minors`: which `nvidia-cap<minor>` grants which MIG access.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::InventoryError;

/// Default location of the MIG capability minors table.
pub const MIG_MINORS_PATH: &str = "/proc/driver/nvidia-caps/mig-minors";

/// The parsed table: `(gpu minor, gi, ci)` -> capability minor (`ci = None` = GI access).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MigMinors {
    source: PathBuf,
    access: BTreeMap<(u32, u32, Option<u32>), u32>,
    /// `config` capability minor.
    pub config: Option<u32>,
    /// `monitor` capability minor.
    pub monitor: Option<u32>,
}

fn parse_id(part: &str, prefix: &str) -> Option<u32> {
    part.strip_prefix(prefix)?.parse().ok()
}

impl MigMinors {
    /// Parses the table's text; `source` names it in errors.
    pub fn parse(text: &str, source: &Path) -> Result<Self, InventoryError> {
        let mut table = MigMinors {
            source: source.to_path_buf(),
            ..Default::default()
        };
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            let bad = || InventoryError::MigMinors {
                path: source.to_path_buf(),
                reason: format!("line {}: {line:?} is not '<capability> <minor>'", n + 1),
            };
            let (cap, minor) = line.split_once(char::is_whitespace).ok_or_else(bad)?;
            let minor: u32 = minor.trim().parse().map_err(|_| bad())?;
            let parts: Vec<&str> = cap.split('/').collect();
            match parts.as_slice() {
                ["config"] => table.config = Some(minor),
                ["monitor"] => table.monitor = Some(minor),
                [gpu, gi, "access"] => {
                    let key = (
                        parse_id(gpu, "gpu").ok_or_else(bad)?,
                        parse_id(gi, "gi").ok_or_else(bad)?,
                        None,
                    );
                    table.access.insert(key, minor);
                }
                [gpu, gi, ci, "access"] => {
                    let key = (
                        parse_id(gpu, "gpu").ok_or_else(bad)?,
                        parse_id(gi, "gi").ok_or_else(bad)?,
                        Some(parse_id(ci, "ci").ok_or_else(bad)?),
                    );
                    table.access.insert(key, minor);
                }
                _ => return Err(bad()),
            }
        }
        Ok(table)
    }

    /// The table the driver makes for cards with device minors `gpu_minors`: `config` 1,
    /// `monitor` 2, then per card minor `m` and GPU instance `gi` (0..15) the GI's access at
    /// `3 + 135 m + 9 gi` followed by its 8 compute instances' (what the a100-mig fixture holds,
    /// copied from a host). For fixtures that do not spell the table out.
    pub fn standard(gpu_minors: impl IntoIterator<Item = u32>, source: &Path) -> Self {
        let mut table = MigMinors {
            source: source.to_path_buf(),
            config: Some(1),
            monitor: Some(2),
            ..Default::default()
        };
        for m in gpu_minors {
            for gi in 0..15 {
                let base = 3 + 135 * m + 9 * gi;
                table.access.insert((m, gi, None), base);
                for ci in 0..8 {
                    table.access.insert((m, gi, Some(ci)), base + 1 + ci);
                }
            }
        }
        table
    }

    /// Reads and parses the table from a file.
    pub fn read(path: &Path) -> Result<Self, InventoryError> {
        let text = std::fs::read_to_string(path).map_err(|source| InventoryError::Io {
            op: "read",
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text, path)
    }

    fn lookup(&self, key: (u32, u32, Option<u32>)) -> Result<u32, InventoryError> {
        self.access.get(&key).copied().ok_or_else(|| InventoryError::MigMinors {
            path: self.source.clone(),
            reason: match key.2 {
                None => format!("no entry gpu{}/gi{}/access", key.0, key.1),
                Some(ci) => format!("no entry gpu{}/gi{}/ci{ci}/access", key.0, key.1),
            },
        })
    }

    /// Capability minor granting access to GPU instance `gi` of the GPU with device minor `gpu_minor`.
    pub fn gi_access(&self, gpu_minor: u32, gi: u32) -> Result<u32, InventoryError> {
        self.lookup((gpu_minor, gi, None))
    }

    /// Capability minor granting access to compute instance `ci` of that GPU instance.
    pub fn ci_access(&self, gpu_minor: u32, gi: u32, ci: u32) -> Result<u32, InventoryError> {
        self.lookup((gpu_minor, gi, Some(ci)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_standard_table_is_the_drivers() {
        let text = crate::inventory::Fixture::builtin_text("a100-mig").expect("built in");
        let spelled = text
            .split("mig_minors: |\n")
            .nth(1)
            .unwrap()
            .split("\ngpus:")
            .next()
            .unwrap();
        let spelled = MigMinors::parse(&spelled.replace("  ", ""), Path::new("x")).unwrap();
        assert_eq!(MigMinors::standard(0..4, Path::new("x")), spelled);
    }

    #[test]
    fn parses_the_kernel_format() {
        let text = "config 1\nmonitor 2\ngpu0/gi0/access 3\ngpu0/gi0/ci0/access 4\ngpu2/gi7/ci0/access 337\n";
        let t = MigMinors::parse(text, Path::new("x")).unwrap();
        assert_eq!((t.config, t.monitor), (Some(1), Some(2)));
        assert_eq!(t.gi_access(0, 0).unwrap(), 3);
        assert_eq!(t.ci_access(0, 0, 0).unwrap(), 4);
        assert_eq!(t.ci_access(2, 7, 0).unwrap(), 337);
        let e = t.gi_access(2, 7).unwrap_err().to_string();
        assert!(e.contains("gpu2/gi7/access"), "{e}");
    }

    #[test]
    fn rejects_malformed_lines() {
        for bad in [
            "config",
            "gpu0/gi0/access x",
            "gpuX/gi0/access 3",
            "gpu0/gi0/ci0/foo 4",
            "bogus 5",
        ] {
            let e = MigMinors::parse(bad, Path::new("/proc/x")).unwrap_err().to_string();
            assert!(e.contains("line 1"), "{bad}: {e}");
        }
    }
}
