//! Standard output for the node agents' commands that print (`status`, `check`, `generate`).
//!
//! Rust ignores SIGPIPE and `print!` panics when a write fails; a printing command instead
//! ends quietly when its reader stops early (`| head -1`), as Unix tools do, and reports a
//! write that fails (`> /dev/full`, a full disk) as an error naming standard output. A server
//! keeps SIGPIPE ignored: its socket writes get errors instead.

use std::io::Write as _;

/// A write to standard output that failed.
#[derive(Debug, thiserror::Error)]
#[error("writing to standard output: {0}")]
pub struct StdoutError(#[from] std::io::Error);

/// Lets a closed pipe end this process quietly (SIGPIPE's default action), for a command that
/// prints. Called first thing, before any thread that could race on it exists.
pub fn quiet_on_closed_stdout() {
    // SAFETY: restoring the default disposition of one signal, before any thread that could
    // race on it prints.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Writes `text` to standard output and flushes it: a failed write is an error, not a panic.
pub fn print(text: &str) -> Result<(), StdoutError> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()?;
    Ok(())
}
