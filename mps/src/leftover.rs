//! A control daemon left on a card's pipe directory by an earlier supervisor (one killed with
//! SIGKILL before its daemons had `quit`). NVIDIA's `nvidia-cuda-mps-control` holds a POSIX
//! write lock on `<pipe dir>/control_lock` while it runs and refuses to start beside a holder
//! ("An instance of this daemon is already running"), so a leftover would keep the card's
//! daemon down for good. The lock names its holder (`F_GETLK`); a holder that is an MPS
//! program is stopped before a new daemon starts, anything else is left alone and reported.

use std::os::fd::AsFd as _;
use std::path::Path;

use nix::fcntl::{FcntlArg, fcntl};

/// The lock file the control daemon holds.
pub const CONTROL_LOCK: &str = "control_lock";

/// Who holds a pipe directory's lock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// Its pid, as this process sees it.
    pub pid: i32,
    /// Its command name (`/proc/<pid>/comm`).
    pub comm: String,
}

impl Holder {
    /// Whether it is one of NVIDIA's MPS programs (the control daemon, or a server).
    pub fn is_mps(&self) -> bool {
        self.comm.starts_with("nvidia-cuda-mps")
    }

    /// Whether it still runs.
    pub fn alive(&self) -> bool {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid), None).is_ok()
            // A zombie holds no lock: it is gone for our purpose.
            && !std::fs::read_to_string(format!("/proc/{}/stat", self.pid))
                .is_ok_and(|s| s.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')))
    }
}

/// The process holding `pipe_dir`'s control lock, if any.
pub fn lock_holder(pipe_dir: &Path) -> Option<Holder> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(pipe_dir.join(CONTROL_LOCK))
        .ok()?;
    // SAFETY: flock is plain data; zeroed is a valid value to fill in.
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = libc::F_WRLCK as libc::c_short;
    lock.l_whence = libc::SEEK_SET as libc::c_short;
    fcntl(file.as_fd(), FcntlArg::F_GETLK(&mut lock)).ok()?;
    if lock.l_type == libc::F_UNLCK as libc::c_short || lock.l_pid <= 0 {
        return None;
    }
    let comm = std::fs::read_to_string(format!("/proc/{}/comm", lock.l_pid))
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    Some(Holder { pid: lock.l_pid, comm })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lock_names_its_holder() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(lock_holder(d.path()), None, "no lock file");
        std::fs::write(d.path().join(CONTROL_LOCK), b"").unwrap();
        assert_eq!(lock_holder(d.path()), None, "nobody holds it");
        // A child holding the lock the way the control daemon does (fcntl F_SETLK).
        let script = format!(
            "import fcntl,os,time; fd=os.open('{}',os.O_RDWR); fcntl.lockf(fd,fcntl.LOCK_EX); print('locked',flush=True); time.sleep(30)",
            d.path().join(CONTROL_LOCK).display()
        );
        let mut child = std::process::Command::new("python3")
            .args(["-c", &script])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.as_mut().unwrap()), &mut line).unwrap();
        let h = lock_holder(d.path()).expect("a holder");
        assert_eq!(h.pid, child.id() as i32);
        assert!(h.comm.starts_with("python"), "{h:?}");
        assert!(!h.is_mps() && h.alive());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!h.alive());
        assert_eq!(lock_holder(d.path()), None);
    }
}
