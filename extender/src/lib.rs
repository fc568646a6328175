//! Tessera's cluster-side service: the kube-scheduler HTTP extender, the ElasticGPU claims
//! (admission webhook and controller), and the placement simulator, all driving
//! `tessera_core::placement`.

pub mod admission;
pub mod claims;
pub mod manifests;
pub mod service;
