//! GPU memory limits per cgroup, where NVIDIA's driver has them (r615+).
//!
//! The driver charges every device allocation to the cgroup of the process that makes it, so a
//! limit set on a container's own cgroup holds for all its processes together, whatever their
//! count or user, and nothing inside the container can lift it. Tessera sets it through NVML
//! (`nvmlDeviceSetMemoryLimits_v1`, built from NVIDIA's published header: [`ffi`]) on the
//! container's cgroup once the runtime made it and before its process runs, and clears it
//! when the container stops. [`probe`] says at start whether the node's driver and kernel
//! have it, and why not.

mod cgroup;
pub mod ffi;
mod nvml;

use std::path::{Path, PathBuf};

pub use cgroup::{CgroupError, cgroup_of_container, cgroup_of_process, cgroup2_root, dmem_controller};
pub use nvml::NvmlMemoryLimits;

/// The hard limit that means "no limit" (`NVML_DEVICE_MEMORY_LIMIT_MAX`).
pub const NO_LIMIT: u64 = u64::MAX;

/// The limits a cgroup has on one card, and what it uses against them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Memory guaranteed before allocations may fail under pressure, bytes.
    pub soft: u64,
    /// The most the cgroup's processes together can allocate, bytes ([`NO_LIMIT`]: none).
    pub hard: u64,
    /// What they hold now, bytes.
    pub used: u64,
}

/// Why a per-cgroup limit could not be set or read.
#[derive(Debug, thiserror::Error)]
pub enum MemoryLimitError {
    /// NVML could not be loaded.
    #[error("cannot load NVML from {library}: {reason}")]
    Load { library: String, reason: String },
    /// The loaded NVML predates per-cgroup limits (driver r615).
    #[error("NVML at {library} has no {symbol} (per-cgroup memory limits came with driver r615)")]
    Missing { library: String, symbol: &'static str },
    /// An NVML call failed.
    #[error("{call} failed for {target}: {message} (NVML error {rc})")]
    Nvml {
        call: &'static str,
        target: String,
        message: String,
        rc: u32,
    },
    /// A cgroup path NVML cannot take (not UTF-8 or with a NUL byte).
    #[error("cgroup path {0} cannot be passed to NVML")]
    Path(PathBuf),
}

impl MemoryLimitError {
    /// NVML's `NVML_ERROR_NOT_FOUND`: the cgroup has no limit on the card.
    pub fn is_not_found(&self) -> bool {
        matches!(
            self,
            Self::Nvml {
                rc: ffi::NVML_ERROR_NOT_FOUND,
                ..
            }
        )
    }
}

/// Sets and reads GPU memory limits per cgroup. [`NvmlMemoryLimits`] is the driver's; tests
/// give their own.
pub trait CgroupMemoryLimits: Send + Sync {
    /// Sets card `uuid`'s limits for `cgroup` (its full sysfs path), in bytes.
    fn set(&self, uuid: &str, cgroup: &Path, soft: u64, hard: u64) -> Result<(), MemoryLimitError>;
    /// Card `uuid`'s limits for `cgroup`, `None` when it has none.
    fn get(&self, uuid: &str, cgroup: &Path) -> Result<Option<Limits>, MemoryLimitError>;
    /// Clears card `uuid`'s limits for `cgroup` (soft 0 first: on the kernel's `dmem`
    /// controller a soft limit left behind would protect memory for a cgroup that is gone).
    fn clear(&self, uuid: &str, cgroup: &Path) -> Result<(), MemoryLimitError> {
        self.set(uuid, cgroup, 0, NO_LIMIT)
    }
}

/// Whether this node can hold a container's GPU memory on its cgroup, and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Support {
    /// The driver sets limits per cgroup.
    PerCgroup {
        /// The driver's version, as NVML reports it.
        driver: String,
        /// `true` when the kernel's `dmem` controller backs them (Linux 6.14+), else the
        /// driver's own accounting.
        dmem: bool,
    },
    /// It cannot; the reason names what is missing.
    Unsupported(String),
}

impl std::fmt::Display for Support {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::PerCgroup { driver, dmem: true } => {
                write!(f, "per cgroup (driver {driver}, the kernel's dmem controller)")
            }
            Self::PerCgroup { driver, dmem: false } => {
                write!(f, "per cgroup (driver {driver}, the driver's own accounting)")
            }
            Self::Unsupported(why) => write!(f, "not per cgroup: {why}"),
        }
    }
}

/// Finds out whether the driver (NVML at `library`, else the loader's `libnvidia-ml.so.1`)
/// and the kernel (cgroup v2 at `cgroup_root`) hold GPU memory per cgroup; with it, the
/// limits to set them through.
pub fn probe(library: Option<&Path>, cgroup_root: &Path) -> (Support, Option<NvmlMemoryLimits>) {
    if !cgroup_root.join("cgroup.controllers").is_file() {
        return (
            Support::Unsupported(format!(
                "{} is not a cgroup v2 hierarchy (per-cgroup GPU memory needs cgroup v2)",
                cgroup_root.display()
            )),
            None,
        );
    }
    match NvmlMemoryLimits::open(library) {
        Ok(limits) => (
            Support::PerCgroup {
                driver: limits.driver_version().to_string(),
                dmem: dmem_controller(cgroup_root),
            },
            Some(limits),
        ),
        Err(e) => (Support::Unsupported(e.to_string()), None),
    }
}

#[cfg(test)]
mod tests;
