//! Memory accounting shared by every process of a container: a small file in the container's
//! state directory, mapped shared, holding the bytes all processes hold (`total`, the admission
//! counter) and one slot per process (its pid, its host pid for utilization, its bytes). An
//! allocation is admitted by a compare-and-swap on `total` before the driver is called, so two
//! processes allocating at once cannot overshoot together; a process that died without freeing
//! is found by its slot (its pid no longer exists) and its bytes are given back.

use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Identifies the layout; a file with another value is left alone (pass-through).
const MAGIC: u64 = u64::from_le_bytes(*b"TSRHOOK1");
/// Processes of one container that can hold GPU memory at once.
pub const MAX_SLOTS: usize = 256;

/// One process's record.
#[repr(C)]
pub struct Slot {
    /// Its pid in the container, 0 when free.
    pub pid: AtomicU32,
    /// Its pid on the host (NVML's), 0 until found.
    pub host_pid: AtomicU32,
    /// Bytes it holds.
    pub used: AtomicU64,
}

/// The shared file's layout.
#[repr(C)]
pub struct Region {
    magic: AtomicU64,
    /// Bytes held by every process together.
    pub total: AtomicU64,
    /// Per process.
    pub slots: [Slot; MAX_SLOTS],
}

/// Why the accounting cannot be used (the hook then refuses allocations: a limit that fails
/// open is no limit).
#[derive(Debug)]
pub struct AccountError(pub String);

/// A process's view of the container's accounting.
pub struct Accounting {
    region: *mut Region,
    limit: u64,
    pid: u32,
    slot: usize,
}

// SAFETY: the region is only touched through atomics; the mapping lives as long as `self`.
unsafe impl Send for Accounting {}
// SAFETY: as above.
unsafe impl Sync for Accounting {}

impl Accounting {
    /// Maps `dir/memory` (creating it) and takes a slot for process `pid`.
    pub fn open(dir: &Path, limit: u64, pid: u32) -> Result<Self, AccountError> {
        let size = std::mem::size_of::<Region>();
        let p = crate::shared::map(dir, "memory", size, pid)
            .map_err(|(what, e)| AccountError(format!("{what} the accounting in {}: {e}", dir.display())))?;
        let path = dir.join("memory");
        let region = p.cast::<Region>();
        // SAFETY: `region` points at `size` mapped bytes laid out as `Region` (atomics only).
        let magic = unsafe { &(*region).magic };
        if let Err(found) = magic.compare_exchange(0, MAGIC, Ordering::AcqRel, Ordering::Acquire)
            && found != MAGIC
        {
            // SAFETY: unmapping what was mapped above.
            unsafe { libc::munmap(p, size) };
            return Err(AccountError(format!("{} has an unknown layout", path.display())));
        }
        let mut a = Self {
            region,
            limit,
            pid,
            slot: usize::MAX,
        };
        a.slot = a
            .claim_slot()
            .ok_or_else(|| AccountError(format!("all {MAX_SLOTS} process slots in use")))?;
        Ok(a)
    }

    fn region(&self) -> &Region {
        // SAFETY: mapped for the life of `self`.
        unsafe { &*self.region }
    }

    fn claim_slot(&self) -> Option<usize> {
        let r = self.region();
        // Already ours (a re-opened accounting in the same process).
        if let Some(i) = r.slots.iter().position(|s| s.pid.load(Ordering::Acquire) == self.pid) {
            return Some(i);
        }
        for _ in 0..2 {
            for (i, s) in r.slots.iter().enumerate() {
                if s.pid
                    .compare_exchange(0, self.pid, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    s.host_pid.store(0, Ordering::Release);
                    s.used.store(0, Ordering::Release);
                    return Some(i);
                }
            }
            self.reap();
        }
        None
    }

    /// Gives back what dead processes held; returns the bytes freed.
    pub fn reap(&self) -> u64 {
        let r = self.region();
        let mut freed = 0;
        for s in &r.slots {
            let pid = s.pid.load(Ordering::Acquire);
            if pid == 0 || pid == self.pid || crate::shared::alive(pid) {
                continue;
            }
            // Whoever clears the pid gives the bytes back, once.
            if s.pid
                .compare_exchange(pid, 0, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                let used = s.used.swap(0, Ordering::AcqRel);
                saturating_sub(&r.total, used);
                freed += used;
            }
        }
        freed
    }

    fn slot(&self) -> &Slot {
        &self.region().slots[self.slot]
    }

    /// Admits `bytes` more if the container stays within its limit.
    pub fn reserve(&self, bytes: u64) -> bool {
        let total = &self.region().total;
        let mut reaped = false;
        loop {
            let cur = total.load(Ordering::Acquire);
            if cur.saturating_add(bytes) > self.limit {
                if !reaped && self.reap() > 0 {
                    reaped = true;
                    continue;
                }
                return false;
            }
            if total
                .compare_exchange(cur, cur + bytes, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                self.slot().used.fetch_add(bytes, Ordering::AcqRel);
                return true;
            }
        }
    }

    /// Counts `bytes` whatever the limit (padding the driver chose after admission).
    pub fn force(&self, bytes: u64) {
        self.region().total.fetch_add(bytes, Ordering::AcqRel);
        self.slot().used.fetch_add(bytes, Ordering::AcqRel);
    }

    /// Gives back `bytes` (freed, or an allocation the driver refused).
    pub fn release(&self, bytes: u64) {
        saturating_sub(&self.slot().used, bytes);
        saturating_sub(&self.region().total, bytes);
    }

    /// Bytes this process holds.
    pub fn own_used(&self) -> u64 {
        self.slot().used.load(Ordering::Acquire)
    }

    /// Bytes the container holds.
    pub fn used(&self) -> u64 {
        self.region().total.load(Ordering::Acquire)
    }

    /// The limit, bytes.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The pid this accounting was opened for.
    pub fn owner(&self) -> u32 {
        self.pid
    }

    /// This process's host pid, 0 until found.
    pub fn own_host_pid(&self) -> u32 {
        self.slot().host_pid.load(Ordering::Acquire)
    }

    /// Records this process's host pid (for per-process utilization).
    pub fn set_host_pid(&self, host_pid: u32) {
        self.slot().host_pid.store(host_pid, Ordering::Release);
    }

    /// The pids NVML may sample the container's live processes under: each one's pid in the
    /// container (driver 580 answers a query in the querying process's pid namespace, seen on
    /// an H100) and its host pid when known (what drivers that answer in the host's namespace
    /// use).
    pub fn sampled_pids(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = self
            .region()
            .slots
            .iter()
            .filter(|s| s.pid.load(Ordering::Acquire) != 0)
            .flat_map(|s| [s.pid.load(Ordering::Acquire), s.host_pid.load(Ordering::Acquire)])
            .filter(|&p| p != 0)
            .collect();
        pids.sort_unstable();
        pids.dedup();
        pids
    }
}

fn saturating_sub(a: &AtomicU64, v: u64) {
    let _ = a.fetch_update(Ordering::AcqRel, Ordering::Acquire, |x| Some(x.saturating_sub(v)));
}

impl Drop for Accounting {
    fn drop(&mut self) {
        // The process's slot stays until the process ends (reaped then); only the mapping goes.
        // SAFETY: unmapping what `open` mapped.
        unsafe { libc::munmap(self.region.cast(), std::mem::size_of::<Region>()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn processes_share_one_limit_and_dead_ones_give_back() {
        let d = tempfile::tempdir().unwrap();
        let me = std::process::id();
        let a = Accounting::open(d.path(), 10 << 20, me).unwrap();
        assert!(a.reserve(6 << 20));
        // Another process of the container (a child that then dies without freeing).
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let b = Accounting::open(d.path(), 10 << 20, child.id()).unwrap();
        assert_ne!(a.slot, b.slot);
        assert!(b.reserve(4 << 20));
        assert!(!a.reserve(1), "the container is at its limit");
        assert_eq!(a.used(), 10 << 20);
        a.release(2 << 20);
        assert!(b.reserve(2 << 20));
        assert!(!a.reserve(1 << 20));
        // b's process dies holding 6 MiB: the next refused reservation reaps it.
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(a.reserve(5 << 20));
        assert_eq!(a.used(), 9 << 20);
        // Releases never go below zero.
        a.release(1 << 40);
        assert_eq!(a.used(), 0);
    }

    #[test]
    fn concurrent_reservations_never_overshoot() {
        let d = tempfile::tempdir().unwrap();
        let a = std::sync::Arc::new(Accounting::open(d.path(), 1000, std::process::id()).unwrap());
        let granted: u64 = (0..8)
            .map(|_| {
                let a = a.clone();
                std::thread::spawn(move || (0..1000).filter(|_| a.reserve(3)).count() as u64 * 3)
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap())
            .sum();
        assert_eq!(granted, 999);
        assert_eq!(a.used(), 999);
    }

    #[test]
    fn a_foreign_file_is_refused() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("memory"), vec![0xffu8; 64]).unwrap();
        let e = Accounting::open(d.path(), 1, 1).err().unwrap();
        assert!(e.0.contains("unknown layout"), "{}", e.0);
    }
}
