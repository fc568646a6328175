//! Tessera's model and its decisions: what pods ask for ([`request`]), what nodes have
//! ([`inventory`], [`driver`], [`topology`]), how the extender decides ([`placement`],
//! [`ledger`]) and what it decided ([`handoff`]), what a container is given ([`injection`],
//! [`cdi`]) and how its share is held ([`enforcement`]). Nothing here talks to the driver or
//! runs processes: reading a node is `tessera_node`'s, the I/O of the services their own. The
//! binaries check their flags' values alike with [`flags`].

// Production functions stay under clippy.toml's length (tests may run long; CONTRIBUTING.md).
#![cfg_attr(not(test), deny(clippy::too_many_lines))]

pub mod cdi;
pub mod dra;
pub mod driver;
pub mod enforcement;
pub mod files;
pub mod flags;
pub mod granted;
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
pub mod taints;
pub mod topology;
pub mod windows;
