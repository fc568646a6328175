//! What of a card's MPS directories share containers get. The daemon's pipe directory holds
//! `control` (any user), `control_privileged` (root only: `quit` is refused through `control`,
//! seen on the real 535 daemon), `control_lock` and a log FIFO; a client needs only `control`,
//! the daemon handing it its server connection over that socket. So containers get the card's
//! client directory, holding a hard link to `control` made once the daemon holds its ceiling,
//! mounted read-only (connecting needs no write access). And the card's shm directory is a
//! tmpfs of its own, size-limited, so the card's clients cannot fill the host's `/run`.

use std::io;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

use nix::mount::{MntFlags, MsFlags, mount, umount2};
use tessera_core::enforcement::MpsLayout;

/// The daemon's socket for clients, in its pipe directory.
const CONTROL: &str = "control";

/// Links the daemon's `control` socket into the card's client directory, replacing an older
/// link atomically; does nothing when the link is already the daemon's socket.
pub fn publish(layout: &MpsLayout, uuid: &str) -> io::Result<()> {
    let socket = layout.pipe_dir(uuid).join(CONTROL);
    let dir = layout.client_dir(uuid);
    let link = dir.join(CONTROL);
    let want = std::fs::symlink_metadata(&socket)?;
    if let Ok(have) = std::fs::symlink_metadata(&link)
        && (have.dev(), have.ino()) == (want.dev(), want.ino())
    {
        return Ok(());
    }
    let new = dir.join(".control.new");
    match std::fs::remove_file(&new) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    std::fs::hard_link(&socket, &new)?;
    std::fs::rename(&new, &link)
}

/// Removes the link: no client reaches a daemon that is stopped or not yet ready.
pub fn withdraw(layout: &MpsLayout, uuid: &str) -> io::Result<()> {
    match std::fs::remove_file(layout.client_dir(uuid).join(CONTROL)) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// The file system type mounted at `dir` (the topmost mount), if `dir` is a mount point.
pub fn mounted_type(dir: &Path) -> Option<String> {
    let dir = dir.canonicalize().ok()?;
    let table = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    table.lines().rev().find_map(|line| {
        // id parent major:minor root mount-point options [optional...] - type source ...
        let (head, tail) = line.split_once(" - ")?;
        let point = unescape(head.split(' ').nth(4)?);
        (point == dir).then(|| tail.split(' ').next().unwrap_or_default().to_string())
    })
}

/// A mount point as mountinfo writes it (space, tab, newline and backslash as octal escapes).
fn unescape(s: &str) -> PathBuf {
    use std::os::unix::ffi::OsStringExt as _;
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && let Ok(v) = u8::from_str_radix(std::str::from_utf8(&b[i + 1..i + 4]).unwrap_or("x"), 8)
        {
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    PathBuf::from(std::ffi::OsString::from_vec(out))
}

/// Makes `dir` a tmpfs of `size_mib` MiB (mode 1777, as `/dev/shm`; no set-uid programs or
/// device files), or sets that size on the tmpfs already there (a restarted daemon keeps its
/// clients' segments).
pub fn mount_shm(dir: &Path, size_mib: u64) -> io::Result<()> {
    let data = format!("size={size_mib}m,mode=1777");
    let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    let (flags, what) = if mounted_type(dir).as_deref() == Some("tmpfs") {
        (flags | MsFlags::MS_REMOUNT, "resizing")
    } else {
        (flags, "mounting")
    };
    mount(Some("tmpfs"), dir, Some("tmpfs"), flags, Some(data.as_str()))
        .map_err(|e| io::Error::other(format!("{what} a {size_mib} MiB tmpfs at {}: {e}", dir.display())))
}

/// Detaches the tmpfs at `dir`, if one is there (containers still using it keep it).
pub fn unmount_shm(dir: &Path) -> io::Result<()> {
    if mounted_type(dir).as_deref() != Some("tmpfs") {
        return Ok(());
    }
    umount2(dir, MntFlags::MNT_DETACH).map_err(|e| io::Error::other(format!("unmounting {}: {e}", dir.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_points_are_unescaped() {
        assert_eq!(unescape(r"/run/a\040b\011c\134d"), PathBuf::from("/run/a b\tc\\d"));
        assert_eq!(unescape(r"/plain"), PathBuf::from("/plain"));
        assert_eq!(unescape(r"/short\04"), PathBuf::from(r"/short\04"));
    }

    #[test]
    fn the_link_follows_the_daemons_socket_and_goes_with_it() {
        let root = tempfile::tempdir().unwrap();
        let layout = MpsLayout::new(root.path());
        for d in [layout.pipe_dir("u"), layout.client_dir("u")] {
            std::fs::create_dir_all(d).unwrap();
        }
        let socket = layout.pipe_dir("u").join(CONTROL);
        let link = layout.client_dir("u").join(CONTROL);
        assert!(publish(&layout, "u").is_err(), "no daemon socket yet");
        let _first = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        publish(&layout, "u").unwrap();
        assert!(std::os::unix::net::UnixStream::connect(&link).is_ok());
        // A restarted daemon makes a new socket: the link is replaced.
        std::fs::remove_file(&socket).unwrap();
        let _second = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        publish(&layout, "u").unwrap();
        let ino = |p: &Path| std::fs::symlink_metadata(p).unwrap().ino();
        assert_eq!(ino(&link), ino(&socket));
        let names: Vec<_> = std::fs::read_dir(layout.client_dir("u"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, [CONTROL], "nothing else in the client directory");
        withdraw(&layout, "u").unwrap();
        withdraw(&layout, "u").unwrap();
        assert!(!link.exists());
    }
}
