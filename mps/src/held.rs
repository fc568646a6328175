//! The connections a daemon has taken on its control socket, and cutting one it is stuck on.
//!
//! The control daemon serves one control connection at a time: it greets a client and waits for
//! its command, and every other client, the supervisor's health check among them, waits behind
//! it. A client that connects and says nothing (a tenant's, or one stopped or frozen while it
//! spoke) would hold the card's daemon until the supervisor gave up on it and restarted it,
//! stopping every MPS server of the card with it. Instead, a connection that the daemon held
//! through two unanswered checks in a row is shut down from the daemon's side (the supervisor's
//! `daemon` module says when): the supervisor takes a
//! copy of the daemon's descriptor (`pidfd_getfd`, as root) and shuts the socket down, so the
//! daemon reads an end of input, closes it and serves the next client.
//!
//! Only connections accepted on `control` are looked at (the socket share containers reach).
//! One whose client the daemon started (an MPS server and what it runs) is never cut, nor one
//! whose client has spoken or hung up (the daemon has input to read there: it is not waiting
//! on that client).

use std::collections::HashSet;
use std::ffi::OsStr;
use std::os::fd::{AsFd as _, AsRawFd as _, FromRawFd as _, OwnedFd, RawFd};
use std::path::Path;

use nix::poll::{PollFd, PollFlags, PollTimeout};

/// `__SO_ACCEPTCON` in `/proc/net/unix`'s flags: a listening socket.
const LISTENING: u32 = 1 << 16;
/// `SS_CONNECTED` in `/proc/net/unix`'s state column.
const CONNECTED: u32 = 3;
/// The socket's name share containers reach the daemon by.
const CONTROL: &str = "control";

/// One connection the daemon has accepted on its control socket: its descriptor in the daemon
/// and the socket's inode (which tells it from a later socket under the same descriptor).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Held {
    /// The descriptor in the daemon.
    pub fd: RawFd,
    /// The socket's inode.
    pub inode: u64,
}

/// The client at the other end of a connection, as the kernel recorded it at connect time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    /// Its process (in the supervisor's pid namespace).
    pub pid: i32,
    /// Its user.
    pub uid: u32,
    /// Its cgroup (the container it runs in), where it could be read.
    pub cgroup: Option<String>,
}

/// What became of a connection the daemon was stuck on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Shut down: the daemon moves on to its next client.
    Cut(Peer),
    /// Left: its client is the daemon's own (an MPS server).
    Kept(Peer),
    /// Not what holds the daemon: gone (its descriptor closed, or naming another socket since),
    /// or its client has spoken or hung up, which leaves the daemon input to read there.
    Gone,
}

/// The connections daemon `pid` has accepted on its `control` socket now.
pub fn connections(pid: u32) -> std::io::Result<Vec<Held>> {
    let table = std::fs::read_to_string(format!("/proc/{pid}/net/unix"))?;
    let inodes = accepted_on_control(&table);
    let mut held = Vec::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))? {
        let entry = entry?;
        // A descriptor closed since the listing is not an error.
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue;
        };
        let inode = socket_inode(target.as_os_str());
        let fd = entry.file_name().to_str().and_then(|n| n.parse().ok());
        if let (Some(inode), Some(fd)) = (inode, fd)
            && inodes.contains(&inode)
        {
            held.push(Held { fd, inode });
        }
    }
    held.sort_by_key(|h| h.fd);
    Ok(held)
}

/// The inodes of the connections accepted on a socket named `control`, from a
/// `/proc/<pid>/net/unix` table (an accepted socket bears its listener's name).
fn accepted_on_control(table: &str) -> HashSet<u64> {
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            // Num RefCount Protocol Flags Type St Inode [Path]; a name's last word holds its
            // file name.
            let mut cols = line.split_whitespace();
            let (flags, state, inode, path) = (cols.nth(3)?, cols.nth(1)?, cols.next()?, cols.last()?);
            let flags = u32::from_str_radix(flags, 16).ok()?;
            let state = u32::from_str_radix(state, 16).ok()?;
            let named_control = Path::new(path).file_name() == Some(OsStr::new(CONTROL));
            (flags & LISTENING == 0 && state == CONNECTED && named_control)
                .then(|| inode.parse().ok())
                .flatten()
        })
        .collect()
}

/// The inode of a `socket:[N]` link.
fn socket_inode(target: &OsStr) -> Option<u64> {
    target
        .to_str()?
        .strip_prefix("socket:[")?
        .strip_suffix(']')?
        .parse()
        .ok()
}

/// Shuts down `held`, daemon `pid`'s connection, unless its client is one the daemon started.
pub fn cut(pid: u32, held: Held) -> std::io::Result<Outcome> {
    let daemon = pidfd_open(pid)?;
    let fd = match pidfd_getfd(&daemon, held.fd) {
        Ok(fd) => fd,
        Err(e) if e.raw_os_error() == Some(libc::EBADF) => return Ok(Outcome::Gone),
        Err(e) => return Err(e),
    };
    if nix::sys::stat::fstat(fd.as_fd())?.st_ino != held.inode {
        return Ok(Outcome::Gone);
    }
    let mut ready = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
    if nix::poll::poll(&mut ready, PollTimeout::ZERO)? > 0 {
        return Ok(Outcome::Gone);
    }
    let cred = nix::sys::socket::getsockopt(&fd, nix::sys::socket::sockopt::PeerCredentials)?;
    let peer = Peer {
        pid: cred.pid(),
        uid: cred.uid(),
        cgroup: cgroup_of(cred.pid()),
    };
    if descends_from(cred.pid(), pid) {
        return Ok(Outcome::Kept(peer));
    }
    nix::sys::socket::shutdown(fd.as_raw_fd(), nix::sys::socket::Shutdown::Both)?;
    Ok(Outcome::Cut(peer))
}

/// Whether process `pid` is `ancestor` or was started under it (followed up its parents).
pub fn descends_from(pid: i32, ancestor: u32) -> bool {
    let mut at = pid;
    // Parents' chains are short; a bound keeps a racing reuse of pids from looping.
    for _ in 0..64 {
        if at <= 0 {
            return false;
        }
        if at.unsigned_abs() == ancestor {
            return true;
        }
        match parent_of(at) {
            Some(p) => at = p,
            None => return false,
        }
    }
    false
}

/// A process's parent, from `/proc/<pid>/stat` (the field after the name's closing paren).
fn parent_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()
}

/// A process's cgroup (v2: the `0::` line), to name the container a client runs in.
fn cgroup_of(pid: i32) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let line = text
        .lines()
        .find(|l| l.starts_with("0::"))
        .or_else(|| text.lines().next())?;
    // hierarchy-ID:controllers:path, the path free to hold colons.
    Some(line.splitn(3, ':').nth(2)?.to_string())
}

fn pidfd_open(pid: u32) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, libc::pid_t::try_from(pid).unwrap_or(-1), 0) };
    owned(fd)
}

fn pidfd_getfd(pidfd: &OwnedFd, target: RawFd) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_getfd takes a pidfd we own, a descriptor number in that process and flags,
    // and returns a new descriptor of ours or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), target, 0) };
    owned(fd)
}

/// A syscall's new descriptor, owned, or its error.
fn owned(ret: libc::c_long) -> std::io::Result<OwnedFd> {
    if ret < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let fd = RawFd::try_from(ret).map_err(|_| std::io::Error::other("descriptor out of range"))?;
    // SAFETY: the kernel just returned this descriptor to us and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests;
