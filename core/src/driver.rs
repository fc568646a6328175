//! The driver's user-space files as the model knows them: what a file is, how it was found,
//! and whether GPU containers get it. Finding them on a node is `tessera_node::driver`'s.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Where the node agent keeps per-version driver bundles on the host (one directory of the
/// driver's files that share devices mount once).
pub const DEFAULT_BUNDLE_ROOT: &str = "/var/lib/tessera/driver";

/// Programs found for the node's own agents and never given to containers: the MPS control
/// client would let a tenant send commands to its card's daemon (change the limits every share
/// on the card gets, stop servers), and only the daemon starts the server.
pub const HOST_ONLY_BINARIES: &[&str] = &["nvidia-cuda-mps-control", "nvidia-cuda-mps-server"];

/// What a driver file is, which decides how it is exposed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DriverFileKind {
    /// A shared library (`libcuda.so.550.54.15`).
    Library,
    /// A program (`nvidia-smi`).
    Binary,
    /// GSP firmware.
    Firmware,
    /// A config file (Vulkan/EGL ICDs).
    Config,
    /// An IPC socket (persistenced, MPS).
    Socket,
}

/// How a driver file was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FoundBy {
    /// Listed by a fixture file.
    #[default]
    Fixture,
    /// The driver root's `etc/ld.so.cache`.
    LdCache,
    /// The directory NVML was loaded from (or its `../bin`).
    NvmlDir,
    /// A search of the root's standard directories.
    Search,
    /// Another library of the driver's version in libcuda's directory.
    LibcudaDir,
    /// A host path outside the driver root: the kernel's firmware search path, a daemon's
    /// socket.
    Host,
}

impl fmt::Display for FoundBy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FoundBy::Fixture => "fixture",
            FoundBy::LdCache => "ld.so.cache",
            FoundBy::NvmlDir => "NVML's directory",
            FoundBy::Search => "directory search",
            FoundBy::LibcudaDir => "beside libcuda",
            FoundBy::Host => "host path",
        })
    }
}

/// A driver user-space file to expose read-only to GPU containers.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct DriverFile {
    /// Path under the driver root (`/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15`); the host
    /// path is the root joined with it. Always the file itself, never a link.
    pub path: PathBuf,
    /// What it is.
    pub kind: DriverFileKind,
    /// How it was found.
    #[serde(default)]
    pub found_by: FoundBy,
    /// The name the loader finds a library by (`libcuda.so.1`), when it differs from the file
    /// name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub soname: Option<String>,
    /// `path` is a host path outside the driver root (firmware where the kernel loads it, a
    /// daemon's socket on the host).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub on_host: bool,
}

impl DriverFile {
    /// The file name.
    pub fn name(&self) -> String {
        self.path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    }

    /// For a library, the name the loader looks it up by: the recorded soname, else the
    /// driver's convention (`libX.so.1`; `libnvidia-nvvm.so.4`).
    pub fn loader_name(&self) -> Option<String> {
        if self.kind != DriverFileKind::Library {
            return None;
        }
        if let Some(s) = &self.soname {
            return Some(s.clone());
        }
        let name = self.name();
        let (stem, _) = name.split_once(".so.")?;
        let major = if stem == "libnvidia-nvvm" { 4 } else { 1 };
        Some(format!("{stem}.so.{major}"))
    }

    /// Whether GPU containers get it (all but [`HOST_ONLY_BINARIES`]).
    pub fn for_containers(&self) -> bool {
        !(self.kind == DriverFileKind::Binary && HOST_ONLY_BINARIES.contains(&self.name().as_str()))
    }

    /// Host path of the file when the driver is under `root`.
    pub fn host_path(&self, root: &Path) -> PathBuf {
        if self.on_host {
            self.path.clone()
        } else {
            root.join(self.path.strip_prefix("/").unwrap_or(&self.path))
        }
    }

    /// The library stem (`libcuda` for `libcuda.so.550.54.15`).
    pub fn stem(&self) -> Option<String> {
        let name = self.name();
        name.split_once(".so").map(|(s, _)| s.to_string())
    }
}
