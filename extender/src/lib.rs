//! Tessera's cluster-side service: the kube-scheduler HTTP extender and the placement
//! simulator, both driving `tessera_core::placement`.

pub mod manifests;
pub mod service;
pub mod simulate;
