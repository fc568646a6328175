//! The cdi-generator: turns a node's GPU inventory (NVML or a fixture) into the CDI spec
//! `tessera.io-gpu.json`, keeps it current, and publishes the inventory on the Node object.

// Production functions stay under clippy.toml's length (tests may run long; CONTRIBUTING.md).
#![cfg_attr(not(test), deny(clippy::too_many_lines))]

pub mod bundle;
pub mod daemon;
pub mod driver_report;
pub mod publish;
pub mod spec;
pub mod topology_report;
pub mod writer;
