//! Finding this process's host pid (NVML reports host pids; the container has its own
//! namespace): the card's compute processes are listed before and after this process creates
//! its context, and the one that appeared is this process. The container's processes take turns
//! (a lock file in the shared state directory); when another container's process appears at the
//! same moment the answer is ambiguous and none is recorded (utilization is then taken for the
//! whole card).

use std::fs::File;
use std::os::fd::AsRawFd as _;
use std::path::Path;

/// An exclusive lock on the container's discovery file, released on drop.
pub struct Lock(File);

impl Lock {
    /// Takes the lock (waits for another process of the container).
    pub fn take(dir: &Path) -> Option<Self> {
        let f = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join("discovery.lock"))
            .ok()?;
        // SAFETY: a valid descriptor.
        (unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } == 0).then_some(Self(f))
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
}
