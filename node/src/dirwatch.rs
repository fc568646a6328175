//! Wakes a node agent as soon as another writes, replaces or removes a file it reads.
//!
//! The node's agents hand each other files: the DRA plugin writes a claim's marker into the
//! CDI directory right after it made the claim's MIG instance, the CDI generator then lists
//! the instance in its spec, and the plugin tells the kubelet once it does. Polled, each hand
//! takes up to its poll's period (a prepare that makes an instance waited half a second for
//! it). A [`DirWatch`] is told by the kernel (inotify) instead.
//!
//! Files are watched through their directory: the agents replace a file by renaming a new one
//! over it, which a watch on the old file would not see. Names beginning with a dot are left
//! out: they are the writers' temporary files ([`tessera_core::files::write_atomic`]), whose
//! rename into place is what is told. Not told: an entry created and not yet written, and a
//! file that is a link swapped in its directory (a ConfigMap volume's): readers that must see
//! those keep a slower check of their own beside the watch.

use std::collections::HashMap;
use std::ffi::OsString;
use std::io;
use std::os::fd::{AsFd as _, AsRawFd, RawFd};
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, WatchDescriptor};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

/// An entry written and closed, renamed in or out, or removed.
const CHANGES: AddWatchFlags = AddWatchFlags::IN_CLOSE_WRITE
    .union(AddWatchFlags::IN_MOVED_TO)
    .union(AddWatchFlags::IN_MOVED_FROM)
    .union(AddWatchFlags::IN_DELETE);

/// The inotify descriptor, as Tokio's reactor takes it.
struct Fd(Inotify);

impl AsRawFd for Fd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

/// Watches files and directories for changes; made and read within a Tokio runtime.
pub struct DirWatch {
    fd: AsyncFd<Fd>,
    /// Each watch's directory, and the names in it watched (`None`: any).
    watches: HashMap<WatchDescriptor, (PathBuf, Option<Vec<OsString>>)>,
}

impl std::fmt::Debug for DirWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirWatch").field("watches", &self.watches).finish()
    }
}

impl DirWatch {
    /// Watches `paths`: a directory for any entry in it, a file for that name in its
    /// directory. Each must exist.
    pub fn new(paths: &[PathBuf]) -> io::Result<Self> {
        let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)?;
        let mut watches = HashMap::new();
        for path in paths {
            let (dir, only) = if path.is_dir() {
                (path.clone(), None)
            } else {
                if !path.exists() {
                    return Err(io::Error::new(
                        io::ErrorKind::NotFound,
                        format!("{}: not there to watch", path.display()),
                    ));
                }
                let name = path.file_name().ok_or_else(|| {
                    io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("{}: no file name to watch", path.display()),
                    )
                })?;
                let dir = path
                    .parent()
                    .filter(|d| !d.as_os_str().is_empty())
                    .unwrap_or(Path::new("."));
                (dir.to_path_buf(), Some(name.to_os_string()))
            };
            let wd = inotify
                .add_watch(&dir, CHANGES | AddWatchFlags::IN_MOVE_SELF | AddWatchFlags::IN_ONLYDIR)
                .map_err(|e| io::Error::new(io::Error::from(e).kind(), format!("watching {}: {e}", dir.display())))?;
            // Paths in one directory share its watch; the directory itself takes every name.
            let (_, names) = watches.entry(wd).or_insert_with(|| (dir, Some(Vec::new())));
            match (names.as_mut(), only) {
                (Some(names), Some(name)) => names.push(name),
                (_, None) => *names = None,
                (None, Some(_)) => {}
            }
        }
        // SAFETY: the descriptor is the inotify instance's own (an `OwnedFd` it holds), open
        // until the instance is dropped with the `AsyncFd`, and `Fd::as_raw_fd` always gives it.
        let fd = unsafe { AsyncFd::register_with_interest(Fd(inotify), Interest::READABLE) }
            .map_err(|e| e.into_parts().1)?;
        Ok(Self { fd, watches })
    }

    /// Waits until something watched changes: the entries changed since the last call (each
    /// once; written, renamed in or out, or removed), or every path watched when the kernel's queue overflowed and the names were lost.
    /// An error where a watched directory went (removed, moved, or its file system unmounted):
    /// nothing more is told of it, and changes read with that news are not told either (take
    /// the error as "anything may have changed").
    ///
    /// Cancel safe: a change read is returned by the same call, with no wait in between.
    pub async fn changed(&mut self) -> io::Result<Vec<PathBuf>> {
        loop {
            let mut ready = self.fd.readable().await?;
            let mut out = Vec::new();
            let mut lost = None;
            loop {
                match ready.get_inner().0.read_events() {
                    Ok(events) => {
                        for e in events {
                            // Removed or unmounted (the kernel drops the watch), or moved
                            // (the watch would follow the directory away from its path).
                            if e.mask
                                .intersects(AddWatchFlags::IN_IGNORED | AddWatchFlags::IN_MOVE_SELF)
                            {
                                lost = self.watches.remove(&e.wd).map(|(dir, _)| dir).or(lost);
                                continue;
                            }
                            self.note(e.wd, e.mask, e.name, &mut out);
                        }
                    }
                    Err(Errno::EAGAIN) => {
                        ready.clear_ready();
                        break;
                    }
                    Err(Errno::EINTR) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            if let Some(dir) = lost {
                return Err(io::Error::new(
                    io::ErrorKind::NotFound,
                    format!("{}: no longer watched (removed, moved or unmounted)", dir.display()),
                ));
            }
            if !out.is_empty() {
                out.sort();
                out.dedup();
                return Ok(out);
            }
        }
    }

    fn note(&self, wd: WatchDescriptor, mask: AddWatchFlags, name: Option<OsString>, out: &mut Vec<PathBuf>) {
        if mask.contains(AddWatchFlags::IN_Q_OVERFLOW) {
            for (dir, names) in self.watches.values() {
                match names {
                    Some(names) => out.extend(names.iter().map(|n| dir.join(n))),
                    None => out.push(dir.clone()),
                }
            }
            return;
        }
        let (Some((dir, only)), Some(name)) = (self.watches.get(&wd), name) else {
            return;
        };
        if name.as_bytes().starts_with(b".") || only.as_ref().is_some_and(|names| !names.contains(&name)) {
            return;
        }
        out.push(dir.join(name));
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// The next change within a second, or `None`.
    async fn next(w: &mut DirWatch) -> Option<Vec<PathBuf>> {
        tokio::time::timeout(Duration::from_secs(1), w.changed())
            .await
            .ok()
            .map(Result::unwrap)
    }

    fn told(path: &Path) -> Option<Vec<PathBuf>> {
        Some(vec![path.to_path_buf()])
    }

    #[tokio::test]
    async fn a_file_renamed_into_a_directory_is_told_by_its_name_and_its_temporary_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = DirWatch::new(&[dir.path().to_path_buf()]).unwrap();
        let path = dir.path().join("tessera.io-claim-a.json");
        tessera_core::files::write_atomic(dir.path(), &path, b"{}", 0o755, 0o644).unwrap();
        assert_eq!(next(&mut w).await, told(&path));
        std::fs::remove_file(&path).unwrap();
        assert_eq!(next(&mut w).await, told(&path));
        std::fs::write(dir.path().join(".only-a-temporary"), b"x").unwrap();
        assert_eq!(next(&mut w).await, None);
    }

    #[tokio::test]
    async fn a_file_is_told_when_replaced_and_its_neighbours_are_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.yaml");
        std::fs::write(&path, b"a").unwrap();
        let mut w = DirWatch::new(std::slice::from_ref(&path)).unwrap();
        std::fs::write(dir.path().join("other.yaml"), b"b").unwrap();
        assert_eq!(next(&mut w).await, None);
        tessera_core::files::write_atomic(dir.path(), &path, b"c", 0o755, 0o644).unwrap();
        assert_eq!(next(&mut w).await, told(&path));
        std::fs::write(&path, b"d").unwrap();
        assert_eq!(next(&mut w).await, told(&path));
    }

    /// Paths in one directory share its watch: two files there are told and a third is not;
    /// with the directory itself watched too, every name is.
    #[tokio::test]
    async fn paths_in_one_directory_share_its_watch() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b, c) = (dir.path().join("a"), dir.path().join("b"), dir.path().join("c"));
        for p in [&a, &b] {
            std::fs::write(p, b"x").unwrap();
        }
        let mut w = DirWatch::new(&[a.clone(), b.clone()]).unwrap();
        std::fs::write(&c, b"x").unwrap();
        assert_eq!(next(&mut w).await, None);
        std::fs::write(&b, b"y").unwrap();
        assert_eq!(next(&mut w).await, told(&b));
        std::fs::write(&a, b"y").unwrap();
        assert_eq!(next(&mut w).await, told(&a));
        let mut w = DirWatch::new(&[a.clone(), dir.path().to_path_buf()]).unwrap();
        std::fs::write(&c, b"y").unwrap();
        assert_eq!(next(&mut w).await, told(&c));
    }

    /// A watched directory that goes (removed, or moved away) is an error (its readers fall
    /// back to their own check), not a watch that waits for ever.
    #[tokio::test]
    async fn a_watched_directory_that_goes_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let cdi = dir.path().join("cdi");
        std::fs::create_dir(&cdi).unwrap();
        let mut w = DirWatch::new(std::slice::from_ref(&cdi)).unwrap();
        std::fs::remove_dir(&cdi).unwrap();
        let e = tokio::time::timeout(Duration::from_secs(1), w.changed())
            .await
            .expect("not told that the directory went")
            .unwrap_err();
        assert!(e.to_string().contains("cdi: no longer watched"), "{e}");
        // Moved away: the watch would follow it, away from its path.
        std::fs::create_dir(&cdi).unwrap();
        let mut w = DirWatch::new(std::slice::from_ref(&cdi)).unwrap();
        std::fs::rename(&cdi, dir.path().join("elsewhere")).unwrap();
        let e = tokio::time::timeout(Duration::from_secs(1), w.changed())
            .await
            .expect("not told that the directory moved")
            .unwrap_err();
        assert!(e.to_string().contains("cdi: no longer watched"), "{e}");
    }

    #[tokio::test]
    async fn a_path_that_is_not_there_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        for missing in [
            dir.path().join("no-such-dir").join("spec.json"),
            dir.path().join("no-such-dir"),
        ] {
            let e = DirWatch::new(std::slice::from_ref(&missing)).unwrap_err();
            assert!(e.to_string().contains("no-such-dir"), "{e}");
        }
    }
}
