//! Fetching the runtimes (once per process; `tests/runtimes/fetch.sh` caches across runs).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Which containerd (`1.7` or `2` on a command line).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum Version {
    /// Newest 1.7.x of Debian trixie (NRI v0.6-era, config version 2).
    #[value(name = "1.7")]
    V1_7,
    /// Newest 2.x of Debian sid (config version 3).
    #[value(name = "2")]
    V2,
}

impl Version {
    /// Both, for tests that run on each.
    pub const ALL: [Version; 2] = [Version::V1_7, Version::V2];

    fn key(self) -> &'static str {
        match self {
            Version::V1_7 => "containerd-1.7",
            Version::V2 => "containerd-2",
        }
    }
}

/// Where the fetched runtimes are.
#[derive(Debug, Clone)]
pub struct Runtimes {
    entries: HashMap<String, (String, PathBuf)>,
}

impl Runtimes {
    /// Fetches (or finds cached) runtimes; the first call in a process runs `fetch.sh`.
    pub fn get() -> anyhow::Result<&'static Runtimes> {
        static RUNTIMES: OnceLock<Result<Runtimes, String>> = OnceLock::new();
        RUNTIMES
            .get_or_init(|| Self::fetch().map_err(|e| format!("{e:#}")))
            .as_ref()
            .map_err(|e| anyhow::anyhow!("{e}"))
    }

    fn fetch() -> anyhow::Result<Runtimes> {
        let entries = crate::fetched::fetch(
            "runtimes/fetch.sh",
            "TESSERA_RUNTIME_CACHE",
            "ready-v3",
            &["containerd-1.7", "containerd-2", "runc", "busybox", "image"],
        )?;
        Ok(Runtimes { entries })
    }

    /// The directory holding `containerd`, `ctr` and the shim.
    pub fn bin_dir(&self, v: Version) -> &Path {
        &self.entries[v.key()].1
    }

    /// The Debian package version of a containerd.
    pub fn version(&self, v: Version) -> &str {
        &self.entries[v.key()].0
    }

    /// The runc binary.
    pub fn runc(&self) -> &Path {
        &self.entries["runc"].1
    }

    /// The static busybox binary (for images a test builds).
    pub fn busybox(&self) -> &Path {
        &self.entries["busybox"].1
    }

    /// The busybox OCI image tarball and its name.
    pub fn image(&self) -> (&str, &Path) {
        let (name, path) = &self.entries["image"];
        (name, path)
    }
}
