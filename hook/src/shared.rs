//! Files in a container's state directory that all its processes map shared (the memory
//! accounting, the compute turns): made whole and open to every user, then mapped.

use std::fs::OpenOptions;
use std::os::fd::AsRawFd as _;
use std::path::Path;

/// Whether a process exists (in this PID namespace) and has not exited: a zombie, whose
/// parent has not reaped it yet, holds nothing on the card any more. (A process whose main
/// thread exited while others run also shows as a zombie in its `stat`: it has more than one
/// task, and lives.)
pub fn alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks for existence.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    if r != 0 {
        return std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH);
    }
    // `/proc/<pid>/stat`: "pid (comm) S ...", the state after the last ')'.
    let zombie = match std::fs::read(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .iter()
            .rposition(|b| *b == b')')
            .and_then(|i| stat.get(i + 2))
            .is_some_and(|state| *state == b'Z'),
        Err(e) => return e.kind() != std::io::ErrorKind::NotFound,
    };
    !zombie || std::fs::read_dir(format!("/proc/{pid}/task")).is_ok_and(|tasks| tasks.count() > 1)
}

/// Opens `dir/name`, making it first when there is none: every process of the container,
/// whatever its user, must be able to open it (a process that cannot is refused what the file
/// holds it to), so it is made whole and open to all under a name of its own, then linked into
/// place; a process that loses that race opens the winner's.
fn open(dir: &Path, name: &str, size: usize, pid: u32) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::PermissionsExt as _;
    let path = dir.join(name);
    let open = || OpenOptions::new().read(true).write(true).open(&path);
    match open() {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        other => return other,
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let tmp = dir.join(format!(".{name}.{pid}.{nanos}"));
    let made = OpenOptions::new().read(true).write(true).create_new(true).open(&tmp)?;
    // The umask does not apply to an explicit change of mode.
    made.set_permissions(std::fs::Permissions::from_mode(0o666))?;
    made.set_len(size as u64)?;
    let linked = std::fs::hard_link(&tmp, &path);
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Ok(()) => Ok(made),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => open(),
        Err(e) => Err(e),
    }
}

/// Maps `dir/name` (creating both) shared, `size` bytes; all zero is what a fresh file holds.
/// The error says which step failed ("creating", "opening", "sizing", "mapping").
pub fn map(dir: &Path, name: &str, size: usize, pid: u32) -> Result<*mut libc::c_void, (&'static str, std::io::Error)> {
    std::fs::create_dir_all(dir).map_err(|e| ("creating", e))?;
    let file = open(dir, name, size, pid).map_err(|e| ("opening", e))?;
    // Growing a shorter file zero-fills it.
    if file.metadata().map(|m| m.len()).unwrap_or(0) < size as u64 {
        file.set_len(size as u64).map_err(|e| ("sizing", e))?;
    }
    // SAFETY: a shared read-write mapping of a file at least `size` long.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(("mapping", std::io::Error::last_os_error()));
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process that exited is not alive even before its parent reaps it (a zombie holds
    /// nothing on the card; a holder of the container's turn must not keep it for that).
    #[test]
    fn a_zombie_is_not_alive() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        // Not reaped: wait for it to exit by looking, as a zombie it stays in /proc.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while alive(pid) {
            assert!(std::time::Instant::now() < deadline, "{pid} still alive");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(Path::new(&format!("/proc/{pid}")).exists(), "a zombie until reaped");
        child.wait().unwrap();
        assert!(!alive(pid));
        assert!(alive(std::process::id()));
    }

    /// A process whose main thread exited while another thread runs is alive (its `stat` says
    /// zombie all the same).
    #[test]
    fn a_process_whose_main_thread_exited_is_alive() {
        // A small C program (cc, as the hook's tests use) whose main thread calls pthread_exit.
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("leader.c");
        std::fs::write(
            &src,
            "#include <pthread.h>\n#include <unistd.h>\nstatic void *run(void *a) { (void)a; sleep(30); return 0; }\nint main(void) { pthread_t t; pthread_create(&t, 0, run, 0); pthread_exit(0); }\n",
        )
        .unwrap();
        let bin = dir.path().join("leader");
        let cc = std::process::Command::new("cc")
            .arg("-o")
            .arg(&bin)
            .arg(&src)
            .arg("-lpthread")
            .status()
            .unwrap();
        assert!(cc.success());
        let mut child = std::process::Command::new(&bin).spawn().unwrap();
        let pid = child.id();
        let stat = || std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !stat().contains(") Z ") {
            assert!(std::time::Instant::now() < deadline, "{}", stat());
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(alive(pid), "a live thread keeps it alive");
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!alive(pid));
    }
}
