//! Tessera's kubelet DRA plugin: registers with the kubelet as driver `gpu.tessera.io`,
//! publishes the node's cards in a ResourceSlice (core's device model), and prepares the claims
//! the scheduler allocated from it: each prepared claim is recorded on the node and handed to
//! the container as a CDI marker, which Tessera's NRI plugin turns into devices and limits.

// Production functions stay under clippy.toml's length (tests may run long; CONTRIBUTING.md).
#![cfg_attr(not(test), deny(clippy::too_many_lines))]

pub mod authority;
pub mod driver;
pub mod health;
pub mod registration;
pub mod service;
pub mod slices;
