//! Finding this process's host pid (NVML reports host pids; the container has its own
//! namespace): the card's compute processes are listed before and after this process creates
//! its context, and the one that appeared is this process. Processes take turns: those of the
//! container on a lock file in its state directory, then every hooked process on the card on the
//! card's lock file (mounted read-only into each share container by the NRI plugin). The card
//! lock is waited for at most [`CARD_WAIT`], so a container that holds it forever cannot stall
//! another's start; when two processes still appear at once the answer is ambiguous and none is
//! recorded (utilization is then taken for the whole card, an over-estimate).

use std::fs::File;
use std::os::fd::AsRawFd as _;
use std::path::Path;
use std::time::{Duration, Instant};

/// The longest a context creation waits for another container's discovery on the card.
pub const CARD_WAIT: Duration = Duration::from_secs(5);

/// An exclusive lock on a discovery file, released on drop.
pub struct Lock(File);

impl Lock {
    /// Takes the container's lock (waits for another process of the container).
    pub fn container(dir: &Path) -> Option<Self> {
        let f = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join("discovery.lock"))
            .ok()?;
        // SAFETY: a valid descriptor.
        (unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } == 0).then_some(Self(f))
    }

    /// Takes the card's lock (an existing file, opened read-only: flock needs no write access),
    /// waiting at most `wait`.
    pub fn card(path: &Path, wait: Duration) -> Option<Self> {
        let f = File::open(path).ok()?;
        let deadline = Instant::now() + wait;
        loop {
            // SAFETY: a valid descriptor.
            if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                return Some(Self(f));
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Lock {
    fn drop(&mut self) {
        // SAFETY: a valid descriptor.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// The one pid in `after` that is not in `before`, if exactly one appeared.
pub fn newcomer(before: &[u32], after: &[u32]) -> Option<u32> {
    let mut new = after.iter().filter(|p| !before.contains(p));
    match (new.next(), new.next()) {
        (Some(&p), None) => Some(p),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exactly_one_newcomer() {
        assert_eq!(newcomer(&[1, 2], &[1, 2, 7]), Some(7));
        assert_eq!(newcomer(&[1, 2], &[2, 7, 1]), Some(7));
        assert_eq!(newcomer(&[1], &[1]), None);
        assert_eq!(newcomer(&[1], &[1, 7, 8]), None, "two at once: ambiguous");
        assert_eq!(newcomer(&[1, 2], &[7]), Some(7), "others leaving does not matter");
    }

    #[test]
    fn the_card_lock_is_exclusive_and_its_wait_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("discovery.lock");
        std::fs::write(&path, "").unwrap();
        let held = Lock::card(&path, Duration::ZERO).expect("free lock");
        let t = Instant::now();
        assert!(Lock::card(&path, Duration::from_millis(50)).is_none(), "held elsewhere");
        assert!(t.elapsed() >= Duration::from_millis(50));
        drop(held);
        assert!(Lock::card(&path, Duration::ZERO).is_some(), "released on drop");
        assert!(Lock::card(&dir.path().join("missing"), Duration::ZERO).is_none());
    }
}
