//! Tessera's scheduler service: the kube-scheduler HTTP extender (filter, prioritize, bind,
//! preempt) over `tessera_core`'s ledger and placement, fed by watches, with leader election,
//! events and metrics; the ElasticGPU claims (admission webhook and controller) it runs.

pub mod service;
