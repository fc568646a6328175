//! Tessera's one shared model: what pods ask for ([`request`]), what nodes have
//! ([`inventory`], [`driver`], [`topology`]), what the extender decided ([`handoff`]) and how it decides ([`placement`]).

pub mod cdi;
pub mod driver;
pub mod enforcement;
pub mod handoff;
pub mod injection;
pub mod inventory;
pub mod ledger;
pub mod mig;
pub mod names;
pub mod placement;
pub mod policy;
pub mod quantity;
pub mod request;
pub mod telemetry;
pub mod topology;
