//! Tessera's kubelet DRA plugin: registers with the kubelet as driver `gpu.tessera.io`,
//! publishes the node's cards in a ResourceSlice (core's device model), and prepares the claims
//! the scheduler allocated from it: each prepared claim is recorded on the node and handed to
//! the container as a CDI marker, which Tessera's NRI plugin turns into devices and limits.

pub mod authority;
pub mod driver;
pub mod health;
pub mod registration;
pub mod service;
pub mod slices;
