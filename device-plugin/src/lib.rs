//! Tessera's kubelet device plugin: advertises `tessera.io/gpu-core`, `tessera.io/gpu-memory`
//! and `tessera.io/mig-<profile>` with health, answers Allocate with annotations the NRI
//! plugin cross-checks, and re-registers when the kubelet restarts.

// Production functions stay under clippy.toml's length (tests may run long; CONTRIBUTING.md).
#![cfg_attr(not(test), deny(clippy::too_many_lines))]

pub mod health;
pub mod manager;
pub mod resources;
pub mod server;
