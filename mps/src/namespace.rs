//! Each card's MPS daemon (and the server it starts) sees the card's own shm directory as
//! `/dev/shm`, as its clients do (the share device's CDI edits mount the same directory there),
//! so the clients of one card share memory with that card's server and no one else's. The
//! supervisor starts each daemon through itself (`tessera-mps-supervisor exec-daemon`): a fresh,
//! single-threaded process that asks the kernel to kill it when the supervisor dies (so no
//! daemon outlives a supervisor killed with SIGKILL and blocks the next one's start), enters a
//! private mount namespace, binds the directory over `/dev/shm` and execs the daemon.

use std::ffi::{CString, OsString};
use std::os::unix::ffi::OsStrExt as _;
use std::path::Path;

use anyhow::Context as _;
use nix::mount::{MsFlags, mount};
use nix::sched::{CloneFlags, unshare};

/// Dies with `parent` (when given), enters a private mount namespace with `shm` at `/dev/shm`,
/// then execs `argv`. Returns only on failure.
pub fn exec_with_shm(shm: &Path, parent: Option<i32>, argv: &[OsString]) -> anyhow::Error {
    let run = || -> anyhow::Result<std::convert::Infallible> {
        anyhow::ensure!(!argv.is_empty(), "exec-daemon: no program given");
        if let Some(parent) = parent {
            // Kept across exec (the daemon is not set-uid).
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL).context("prctl(PR_SET_PDEATHSIG)")?;
            // The supervisor may have died before the line above.
            anyhow::ensure!(
                nix::unistd::getppid().as_raw() == parent,
                "exec-daemon: the supervisor (pid {parent}) is gone"
            );
        }
        unshare(CloneFlags::CLONE_NEWNS).context("unshare(CLONE_NEWNS): the supervisor must run as root")?;
        // Keep the binds below out of the host's mount table.
        mount(
            None::<&str>,
            "/",
            None::<&str>,
            MsFlags::MS_REC | MsFlags::MS_PRIVATE,
            None::<&str>,
        )
        .context("making / private in the daemon's mount namespace")?;
        mount(Some(shm), "/dev/shm", None::<&str>, MsFlags::MS_BIND, None::<&str>)
            .with_context(|| format!("binding {} over /dev/shm", shm.display()))?;
        let args: Vec<CString> = argv
            .iter()
            .map(|a| CString::new(a.as_bytes()))
            .collect::<Result<_, _>>()
            .context("an argument holds a NUL byte")?;
        nix::unistd::execv(&args[0], &args).with_context(|| format!("executing {:?}", argv[0]))
    };
    match run() {
        Ok(never) => match never {},
        Err(e) => e,
    }
}
