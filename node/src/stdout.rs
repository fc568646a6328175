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

/// For the printing commands' tests: the two ways standard output fails, each run against a
/// built binary.
#[cfg(feature = "testing")]
pub mod testing {
    use std::os::unix::process::ExitStatusExt as _;
    use std::process::{Command, Output, Stdio};

    /// Runs `cmd` with its standard output on `stdout` and its standard error captured, without
    /// backtraces.
    pub fn run(mut cmd: Command, stdout: Stdio) -> Output {
        let child = cmd
            .env("RUST_BACKTRACE", "0")
            .stdout(stdout)
            .stderr(Stdio::piped())
            .spawn()
            .expect("the command starts");
        child.wait_with_output().expect("the command ends")
    }

    /// What `command()` prints, into a full disk (`/dev/full`): exit code 1 and an error naming
    /// standard output, no panic; into a reader that stops early: the quiet end SIGPIPE gives,
    /// as Unix tools have.
    pub fn assert_stdout_failures_handled(mut command: impl FnMut() -> Command) {
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .expect("/dev/full opens");
        let what = format!("{:?}", command());
        let out = run(command(), full.into());
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{what} into /dev/full: {err}");
        assert!(
            err.contains("writing to standard output: No space left on device") && !err.contains("panicked"),
            "{what} into /dev/full: {err}"
        );
        // A pipe whose reader is gone before the command starts: its first write meets it
        // closed, however fast it writes. (A reader closed after the spawn raced a quick
        // command, which could write into the pipe's buffer first and exit as it would.)
        let (reader, writer) = std::io::pipe().expect("a pipe");
        drop(reader);
        let out = run(command(), writer.into());
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.signal(),
            Some(libc::SIGPIPE),
            "{what} into a closed pipe: {:?}: {err}",
            out.status
        );
        assert!(!err.contains("panicked"), "{what} into a closed pipe: {err}");
    }
}
