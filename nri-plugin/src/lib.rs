//! Tessera's NRI plugin: at CreateContainer it verifies the pod's signed allocation, resolves
//! the allocated devices in the CDI specs on disk and applies their edits directly as NRI
//! adjustments, with share limits as env. Containers without an allocation get no GPU.

// Production functions stay under clippy.toml's length (tests may run long; CONTRIBUTING.md).
#![cfg_attr(not(test), deny(clippy::too_many_lines))]

pub mod adjust;
pub mod cdi;
pub mod check;
pub mod metrics;
pub mod mux;
pub mod pid_service;
pub mod plugin;
pub mod session;
