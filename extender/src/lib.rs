//! Tessera's scheduler service: the kube-scheduler HTTP extender (filter, prioritize, bind,
//! preempt) over `tessera_core`'s ledger and placement, fed by watches, with leader election,
//! events and metrics; the ElasticGPU claims (admission webhook and controller) it runs.

// Production functions stay under clippy.toml's length (tests may run long; CONTRIBUTING.md).
#![cfg_attr(not(test), deny(clippy::too_many_lines))]

pub mod service;
