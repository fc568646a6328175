use std::path::PathBuf;

use thiserror::Error;

/// Why the inventory could not be read.
#[derive(Debug, Error)]
pub enum InventoryError {
    /// A fixture file could not be read (and it names no built-in fixture).
    #[error(
        "cannot read fixture {path} (neither a readable file nor a built-in: {})",
        crate::inventory::BUILTIN_FIXTURES.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
    )]
    ReadFixture {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A fixture file is not valid YAML of the fixture schema.
    #[error("fixture {path} is malformed: {reason}")]
    ParseFixture { path: PathBuf, reason: String },
    /// A fixture's card with a value no card has.
    #[error("fixture {path}: {card}: {field}: {reason}")]
    FixtureCard {
        path: PathBuf,
        /// `card <index> (<uuid>)`.
        card: String,
        /// `<field>=<value>`.
        field: String,
        reason: String,
    },
    /// Inconsistent inventory content.
    #[error("inventory field {field}={value:?} is invalid: {reason}")]
    Invalid {
        field: String,
        value: String,
        reason: String,
    },
    /// The NVML library could not be loaded.
    #[error(
        "NVML is not available (is the NVIDIA driver installed and libnvidia-ml.so.1 on the library path?): {reason}"
    )]
    NvmlUnavailable { reason: String },
    /// An NVML call failed.
    #[error("NVML call {call} failed: {reason}")]
    Nvml { call: String, reason: String },
    /// `/proc/driver/nvidia-caps/mig-minors` content is malformed or lacks an entry.
    #[error("MIG minors {path}: {reason}")]
    MigMinors { path: PathBuf, reason: String },
    /// A file-system operation failed.
    #[error("{op} {path}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}
