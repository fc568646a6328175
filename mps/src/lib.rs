//! Tessera's MPS supervisor: on nodes that enforce shares with NVIDIA MPS, one control daemon
//! per card that can host shares, run from the node's own driver, each with its own pipe, log
//! and shm directories ([`tessera_core::enforcement::MpsLayout`]), restarted with backoff when
//! it dies and stopped cleanly. The GPU's compute mode is left as it is (MPS runs in Default
//! mode) unless the node asks for exclusive-process mode ([`compute_mode`]).

// Production functions stay under clippy.toml's length (tests may run long; CONTRIBUTING.md).
#![cfg_attr(not(test), deny(clippy::too_many_lines))]

pub mod card_dirs;
pub mod compute_mode;
pub mod control;
pub mod held;
pub mod leftover;
pub mod namespace;
pub mod status;
pub mod supervisor;
pub mod tamper;
