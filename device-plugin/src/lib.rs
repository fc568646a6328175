//! Tessera's kubelet device plugin: advertises `tessera.io/gpu-core`, `tessera.io/gpu-memory`
//! and `tessera.io/mig-<profile>` with health, answers Allocate with annotations the NRI
//! plugin cross-checks, and re-registers when the kubelet restarts.

pub mod health;
pub mod manager;
pub mod resources;
pub mod server;
