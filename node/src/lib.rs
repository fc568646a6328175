//! What Tessera's node agents read off the NVIDIA driver and the node's files: where the
//! driver's user-space files are ([`driver`]), the GPUs through NVML ([`inventory`]), what they
//! are doing now and their XID errors ([`telemetry`]), the driver's per-cgroup memory limits
//! ([`memory_limits`]), and when another agent changes a file they read ([`dirwatch`]). The
//! model these fill in, and every decision made from it, is `tessera_core`'s. Their printing
//! commands write through [`stdout`].

// Production functions stay under clippy.toml's length (tests may run long; CONTRIBUTING.md).
#![cfg_attr(not(test), deny(clippy::too_many_lines))]

pub mod dirwatch;
pub mod driver;
pub mod inventory;
pub mod memory_limits;
pub mod stdout;
pub mod telemetry;
