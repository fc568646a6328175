//! Helpers for Tessera's cross-crate and end-to-end tests: chiefly a harness that runs real
//! containerd (1.7 and 2.x) on private paths and drives it through CRI, as the kubelet does.

pub mod apiserver;
pub mod cluster;
pub mod containerd;
pub mod fake_node;
pub mod fetched;
pub mod gpu_cluster;
pub mod http;
pub mod kubelet;
pub mod nvidia;
pub mod uds;
