//! Turns on the card for the processes of one container, on MPS nodes.
//!
//! MPS holds each client process to the share's SMs, and NVML gives MPS clients' SM use to the
//! server, so no throttle can measure a container's processes together (see `throttle` for
//! hook nodes, where it can). Instead the container's processes take turns: one of them has
//! work on the card at a time, so N busy processes together get what one gets, the share, and
//! not N times it. A turn lasts [`SLICE`] while another process waits (as long as it likes
//! while none does), or ends sooner when its process stops launching for [`IDLE`]; it is not
//! handed over while its process captures a stream into a graph (a synchronisation would
//! break the capture), for up to [`CAPTURE_MAX`]. Before a turn is handed over, its process's
//! launches are held and its queued work drained (at most [`DRAIN_MAX`]: work that waits on
//! another process's work cannot deadlock the two), so the next process's work never runs
//! beside it. A process that died holding the turn loses it within 10 ms, one that stopped
//! answering after [`STALE`].
//!
//! The turn lives in a small file of the container's state directory, mapped shared by all its
//! processes ([`crate::shared`]): its holder and deadline in one word, changed only by
//! compare-and-swap, and the waiting processes with a heartbeat each. The waiting is by
//! polling, so a process that dies anywhere leaves nothing that blocks the others.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

use crate::shared::alive;

/// How long a turn lasts while another process of the container waits.
pub const SLICE: Duration = Duration::from_millis(25);
/// A turn ends early when its process has launched nothing for this long and another waits.
pub const IDLE: Duration = Duration::from_millis(2);
/// The longest a handover waits for the process's queued work.
pub const DRAIN_MAX: Duration = Duration::from_secs(5);
/// The process whose turn ended lets a waiting one go first for this long.
pub const HANDOFF: Duration = Duration::from_millis(2);
/// A holder that has not renewed its turn this long past its end (stopped, frozen) loses it.
pub const STALE: Duration = Duration::from_secs(10);
/// The longest a turn is kept past its end for a stream capture in progress.
pub const CAPTURE_MAX: Duration = Duration::from_secs(2);
/// How often a waiting process looks at the turn, and how many looks between two looks at
/// whether its holder lives.
const POLL: Duration = Duration::from_micros(200);
const LIVENESS_POLLS: u64 = 50;
/// A waiting process whose heartbeat is older than this (stopped) is not waited for.
const HEARTBEAT_STALE: Duration = Duration::from_millis(100);
/// How often the keeper looks while its process holds the turn, and while it does not.
const KEEP_HELD: Duration = Duration::from_millis(1);
const KEEP_IDLE: Duration = Duration::from_millis(5);
/// Identifies the layout.
const MAGIC: u64 = u64::from_le_bytes(*b"TSRTURN2");
/// Processes that can be seen waiting at once (more still wait, unseen by the holder).
pub const WAITING_SLOTS: usize = 64;

/// `CLOCK_MONOTONIC`, which every process of the container reads alike.
pub fn now_ns() -> u64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid clock and a valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// [`now_ns`] in milliseconds, modulo 2^32 (compared by [`since`], so the wrap every 49 days
/// does not matter).
fn now_ms() -> u32 {
    (now_ns() / 1_000_000) as u32
}

/// Milliseconds from `then` to `now`, negative when `then` is later.
fn since(now: u32, then: u32) -> i64 {
    i64::from(now.wrapping_sub(then) as i32)
}

fn ms(d: Duration) -> u32 {
    d.as_millis() as u32
}

/// A pid and a time in one word: the turn (its holder, 0 when nobody's, and its deadline, or
/// when it ended) and a waiting slot (its process and heartbeat).
fn pack(pid: u32, at: u32) -> u64 {
    (u64::from(pid) << 32) | u64::from(at)
}

fn unpack(v: u64) -> (u32, u32) {
    ((v >> 32) as u32, v as u32)
}

/// The shared file's layout.
#[repr(C)]
pub struct Region {
    magic: AtomicU64,
    /// [`pack`]ed: the holder's pid (0: nobody's) and its deadline (ms), or when it ended.
    turn: AtomicU64,
    /// Who had the last turn.
    released_by: AtomicU32,
    _pad: u32,
    /// Turns handed over.
    handovers: AtomicU64,
    /// Handovers whose drain did not finish within [`DRAIN_MAX`].
    overdue: AtomicU64,
    /// [`pack`]ed: waiting processes and their heartbeats; 0 for a free slot.
    waiting: [AtomicU64; WAITING_SLOTS],
}

/// What a handover waits on: the process's queued work, for at most the given time; whether
/// it finished.
pub type Drain = Box<dyn Fn(Duration) -> bool + Send + Sync>;

/// One process's view of its container's turn.
pub struct Turns {
    region: *mut Region,
    pid: u32,
    /// Launches hold it shared; a handover holds it alone, so no launch slips in meanwhile.
    gate: RwLock<()>,
    /// One thread of the process waits for a turn; the others wait for that one.
    acquiring: Mutex<()>,
    /// Launches so far (the keeper tells an idle process by this not moving).
    launches: AtomicU64,
    /// Stream captures in progress in this process, and when the first of them began (ms).
    captures: AtomicU32,
    capture_since: AtomicU32,
    keeper: std::sync::Once,
    drain: Drain,
}

// SAFETY: the region is only touched through atomics; the mapping lives as long as `self`.
unsafe impl Send for Turns {}
// SAFETY: as above.
unsafe impl Sync for Turns {}

impl Turns {
    /// Maps `dir/turn` (creating it) for process `pid`.
    pub fn open(dir: &std::path::Path, pid: u32, drain: Drain) -> Result<Self, String> {
        let size = std::mem::size_of::<Region>();
        let p = crate::shared::map(dir, "turn", size, pid)
            .map_err(|(what, e)| format!("{what} the turn in {}: {e}", dir.display()))?;
        let region = p.cast::<Region>();
        // SAFETY: `region` points at `size` mapped bytes laid out as `Region` (atomics only).
        let magic = unsafe { &(*region).magic };
        if let Err(found) = magic.compare_exchange(0, MAGIC, Ordering::AcqRel, Ordering::Acquire)
            && found != MAGIC
        {
            // SAFETY: unmapping what was mapped above.
            unsafe { libc::munmap(p, size) };
            return Err(format!("{} has an unknown layout", dir.join("turn").display()));
        }
        Ok(Self {
            region,
            pid,
            gate: RwLock::new(()),
            acquiring: Mutex::new(()),
            launches: AtomicU64::new(0),
            captures: AtomicU32::new(0),
            capture_since: AtomicU32::new(0),
            keeper: std::sync::Once::new(),
            drain,
        })
    }

    fn region(&self) -> &Region {
        // SAFETY: mapped for the life of `self`.
        unsafe { &*self.region }
    }

    /// The pid this view was opened for.
    pub fn owner(&self) -> u32 {
        self.pid
    }

    /// Runs `launch` in this process's turn, waiting for the turn first.
    pub fn run<T>(&'static self, launch: impl FnOnce() -> T) -> T {
        self.keeper.call_once(|| self.start_keeper());
        let _turn = self.enter();
        self.launches.fetch_add(1, Ordering::Relaxed);
        launch()
    }

    /// A stream capture began (the capture hooks call it): no handover until it ends, for up
    /// to [`CAPTURE_MAX`].
    pub fn capture_began(&self) {
        if self.captures.fetch_add(1, Ordering::AcqRel) == 0 {
            self.capture_since.store(now_ms(), Ordering::Release);
        }
    }

    /// A stream capture ended (or failed to begin).
    pub fn capture_ended(&self) {
        let _ = self
            .captures
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |c| Some(c.saturating_sub(1)));
    }

    /// Whether a capture keeps this process's turn at `now`.
    fn capturing(&self, now: u32) -> bool {
        self.captures.load(Ordering::Acquire) > 0
            && since(now, self.capture_since.load(Ordering::Acquire)) < i64::from(ms(CAPTURE_MAX))
    }

    /// Whether it is this process's turn.
    pub fn holds(&self) -> bool {
        unpack(self.region().turn.load(Ordering::Acquire)).0 == self.pid
    }

    /// `(handovers, overdue)` so far, for the whole container.
    pub fn handovers(&self) -> (u64, u64) {
        let r = self.region();
        (r.handovers.load(Ordering::Acquire), r.overdue.load(Ordering::Acquire))
    }

    fn enter(&self) -> RwLockReadGuard<'_, ()> {
        loop {
            let g = self.gate.read().unwrap_or_else(|p| p.into_inner());
            if self.holds() {
                return g;
            }
            drop(g);
            self.acquire();
        }
    }

    /// Waits until it is this process's turn.
    fn acquire(&self) {
        let _one = self.acquiring.lock().unwrap_or_else(|p| p.into_inner());
        if self.holds() {
            return;
        }
        let r = self.region();
        let slot = r.waiting.iter().find(|w| {
            w.compare_exchange(0, pack(self.pid, now_ms()), Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        });
        for polls in 0u64.. {
            let now = now_ms();
            if let Some(w) = slot {
                w.store(pack(self.pid, now), Ordering::Release);
            }
            let turn = r.turn.load(Ordering::Acquire);
            let (holder, at) = unpack(turn);
            let take = if holder == 0 {
                // The process whose turn just ended lets a waiting one go first.
                r.released_by.load(Ordering::Acquire) != self.pid
                    || since(now, at) >= i64::from(ms(HANDOFF))
                    || !self.others_wait(now)
            } else {
                since(now, at) > i64::from(ms(STALE))
                    // Whether the holder lives is read from /proc: every 10 ms is enough.
                    || (polls % LIVENESS_POLLS == 0 && !alive(holder))
            };
            if take
                && r.turn
                    .compare_exchange(
                        turn,
                        pack(self.pid, now.wrapping_add(ms(SLICE))),
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    )
                    .is_ok()
            {
                break;
            }
            std::thread::sleep(POLL);
        }
        if let Some(w) = slot {
            w.store(0, Ordering::Release);
        }
    }

    /// Whether a process other than this one waits for a turn: one whose heartbeat is recent
    /// (a stopped one is not waited for; a dead one's slot is freed).
    fn others_wait(&self, now: u32) -> bool {
        let mut any = false;
        for w in &self.region().waiting {
            let v = w.load(Ordering::Acquire);
            let (pid, beat) = unpack(v);
            if pid == 0 || pid == self.pid {
                continue;
            }
            if since(now, beat) <= i64::from(ms(HEARTBEAT_STALE)) {
                any = true;
            } else if !alive(pid) {
                let _ = w.compare_exchange(v, 0, Ordering::AcqRel, Ordering::Acquire);
            }
        }
        any
    }

    fn start_keeper(&'static self) {
        // Without a keeper a turn still ends: others take it once it is stale.
        let _ = std::thread::Builder::new()
            .name("tessera-turns".into())
            .spawn(move || self.keep());
    }

    /// Renews the process's turn while nobody waits (or a capture is in progress) and hands it
    /// over when its time is up.
    fn keep(&self) {
        // When the process last launched, as far as the keeper has seen.
        let (mut seen, mut moved_at) = (0, 0u32);
        loop {
            if !self.holds() {
                std::thread::sleep(KEEP_IDLE);
                continue;
            }
            std::thread::sleep(KEEP_HELD);
            let now = now_ms();
            let launches = self.launches.load(Ordering::Relaxed);
            if launches != seen {
                (seen, moved_at) = (launches, now);
            }
            if self.capturing(now) || !self.others_wait(now) {
                self.renew(now);
                continue;
            }
            let deadline = unpack(self.region().turn.load(Ordering::Acquire)).1;
            let idle = since(now, moved_at) > i64::from(ms(IDLE));
            if idle || since(now, deadline) >= 0 {
                self.hand_over();
            }
        }
    }

    /// Moves this process's deadline to a slice from `now`, if the turn is still its own.
    fn renew(&self, now: u32) {
        let r = self.region();
        let turn = r.turn.load(Ordering::Acquire);
        if unpack(turn).0 == self.pid {
            let _ = r.turn.compare_exchange(
                turn,
                pack(self.pid, now.wrapping_add(ms(SLICE))),
                Ordering::AcqRel,
                Ordering::Acquire,
            );
        }
    }

    /// Holds the process's launches, drains its queued work and gives the turn up.
    pub fn hand_over(&self) {
        let held = self.gate.write().unwrap_or_else(|p| p.into_inner());
        self.give_up(held);
    }

    /// As [`Self::hand_over`], but only if the process's launches can be held within `within`
    /// (at exit: a thread that called `exit()` may itself be in a launch); whether it did.
    pub fn hand_over_within(&self, within: Duration) -> bool {
        let end = std::time::Instant::now() + within;
        loop {
            match self.gate.try_write() {
                Ok(held) => {
                    self.give_up(held);
                    return true;
                }
                Err(std::sync::TryLockError::Poisoned(p)) => {
                    self.give_up(p.into_inner());
                    return true;
                }
                Err(std::sync::TryLockError::WouldBlock) if std::time::Instant::now() < end => {
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(std::sync::TryLockError::WouldBlock) => return false,
            }
        }
    }

    fn give_up(&self, _held: RwLockWriteGuard<'_, ()>) {
        if !self.holds() {
            return;
        }
        let drained = (self.drain)(DRAIN_MAX);
        let r = self.region();
        if !drained {
            r.overdue.fetch_add(1, Ordering::AcqRel);
        }
        r.released_by.store(self.pid, Ordering::Release);
        loop {
            let turn = r.turn.load(Ordering::Acquire);
            if unpack(turn).0 != self.pid {
                return;
            }
            if r.turn
                .compare_exchange(turn, pack(0, now_ms()), Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                r.handovers.fetch_add(1, Ordering::AcqRel);
                return;
            }
        }
    }
}

impl Drop for Turns {
    fn drop(&mut self) {
        // SAFETY: unmapping what `open` mapped.
        unsafe { libc::munmap(self.region.cast(), std::mem::size_of::<Region>()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;

    fn leak(t: Turns) -> &'static Turns {
        Box::leak(Box::new(t))
    }

    /// Two views of one container's turn (as two processes would have), each "running work"
    /// by marking itself busy during its launches and until its drain: the two are never busy
    /// at once, and both get turns.
    #[test]
    fn two_processes_are_never_on_the_card_at_once_and_both_get_turns() {
        let d = tempfile::tempdir().unwrap();
        let busy = Arc::new(AtomicU32::new(0));
        let overlap = Arc::new(AtomicBool::new(false));
        // A stand-in for a second process: a child that lives as long as the test.
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let views: Vec<&'static Turns> = [std::process::id(), child.id()]
            .into_iter()
            .map(|pid| {
                let b = busy.clone();
                leak(
                    Turns::open(
                        d.path(),
                        pid,
                        Box::new(move |_| {
                            // The queued work finishes: this view is off the card.
                            b.fetch_and(!(1 << (pid % 31)), Ordering::AcqRel);
                            true
                        }),
                    )
                    .unwrap(),
                )
            })
            .collect();
        let counts: Vec<u64> = views
            .iter()
            .map(|&t| {
                let (busy, overlap) = (busy.clone(), overlap.clone());
                std::thread::spawn(move || {
                    let mut n = 0u64;
                    let end = std::time::Instant::now() + Duration::from_millis(600);
                    while std::time::Instant::now() < end {
                        t.run(|| {
                            let me = 1 << (t.owner() % 31);
                            if busy.fetch_or(me, Ordering::AcqRel) & !me != 0 {
                                overlap.store(true, Ordering::Release);
                            }
                        });
                        n += 1;
                        std::thread::sleep(Duration::from_micros(50));
                    }
                    n
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect();
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(
            !overlap.load(Ordering::Acquire),
            "two processes had work on the card at once"
        );
        assert!(counts.iter().all(|&n| n > 10), "each got turns: {counts:?}");
        let (handovers, overdue) = views[0].handovers();
        assert!(handovers >= 4, "turns went back and forth: {handovers}");
        assert_eq!(overdue, 0);
    }

    /// A holder whose work never drains (it waits on the other's) still hands over, late.
    #[test]
    fn a_drain_that_never_finishes_still_hands_the_turn_over() {
        let d = tempfile::tempdir().unwrap();
        let stuck = leak(
            Turns::open(
                d.path(),
                std::process::id(),
                Box::new(|within| {
                    std::thread::sleep(within.min(Duration::from_millis(50)));
                    false
                }),
            )
            .unwrap(),
        );
        stuck.run(|| ());
        assert!(stuck.holds());
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let other = leak(Turns::open(d.path(), child.id(), Box::new(|_| true)).unwrap());
        let t = std::time::Instant::now();
        other.run(|| ());
        assert!(other.holds() && !stuck.holds());
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        assert_eq!(stuck.handovers(), (1, 1));
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// A waiter whose heartbeat stopped (a stopped process, a slot left behind) does not make
    /// the holder hand over; one that beats does. A capture in progress keeps the turn.
    #[test]
    fn only_a_live_waiter_and_no_capture_make_the_holder_hand_over() {
        let d = tempfile::tempdir().unwrap();
        let me = leak(Turns::open(d.path(), std::process::id(), Box::new(|_| true)).unwrap());
        me.run(|| ());
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let slot = &me.region().waiting[0];
        let launch_for = |ms: u64| {
            let end = std::time::Instant::now() + Duration::from_millis(ms);
            while std::time::Instant::now() < end {
                me.run(|| ());
                std::thread::sleep(Duration::from_micros(200));
            }
        };
        slot.store(pack(child.id(), now_ms().wrapping_sub(1000)), Ordering::Release);
        launch_for(150);
        assert_eq!(me.handovers().0, 0, "a stale waiter is not waited for");
        me.capture_began();
        let beat = |ms: u64| {
            let end = std::time::Instant::now() + Duration::from_millis(ms);
            while std::time::Instant::now() < end {
                slot.store(pack(child.id(), now_ms()), Ordering::Release);
                std::thread::sleep(Duration::from_millis(1));
            }
        };
        beat(150);
        assert_eq!(me.handovers().0, 0, "no handover during a capture");
        me.capture_ended();
        beat(150);
        assert!(me.handovers().0 >= 1, "a live waiter gets the turn");
        slot.store(0, Ordering::Release);
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// A dead holder's turn is taken at once.
    #[test]
    fn a_dead_holders_turn_is_taken() {
        let d = tempfile::tempdir().unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        let dead = Turns::open(d.path(), pid, Box::new(|_| true)).unwrap();
        dead.region()
            .turn
            .store(pack(pid, now_ms().wrapping_add(60_000)), Ordering::Release);
        let me = leak(Turns::open(d.path(), std::process::id(), Box::new(|_| true)).unwrap());
        let t = std::time::Instant::now();
        me.run(|| ());
        assert!(me.holds());
        assert!(t.elapsed() < Duration::from_millis(500));
    }
}
