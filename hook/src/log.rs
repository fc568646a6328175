//! The hook's few messages, to stderr, each at most once per process: it lives inside the
//! user's program and must not flood its output.

use std::io::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};

/// A message that is printed once.
pub struct Once(AtomicBool);

impl Once {
    /// Not printed yet.
    pub const fn new() -> Self {
        Self(AtomicBool::new(false))
    }

    /// Prints `msg` unless this was printed before.
    pub fn print(&self, msg: std::fmt::Arguments<'_>) {
        if !self.0.swap(true, Ordering::Relaxed) {
            let _ = writeln!(std::io::stderr(), "tessera-cuda-hook: {msg}");
        }
    }
}

impl Default for Once {
    fn default() -> Self {
        Self::new()
    }
}
