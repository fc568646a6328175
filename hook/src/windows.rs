//! A container's window of the card's time, on `hook` nodes: its processes launch work only in
//! the window's spans, and drain what they queued by each span's end.
//!
//! Under time-slicing NVML counts the time a process waits for another's slice as its own
//! use, so a throttle holding each container at its measured figure gives busy co-tenants less
//! than their shares (two 50% shares of an H100 got 0.18x to 0.33x each). The node agent
//! instead gives each share of a card spans of a repeating period that no other share of the
//! card has ([`crate::config::Schedule`]); every process of the container clocks them from
//! `CLOCK_MONOTONIC`, which all containers of a node read alike, so the container's work and
//! its co-tenants' take the card in turn, each for its share of the time, however many
//! processes each runs.
//!
//! A keeper thread per process opens the gate at a span's start and closes it a guard before
//! the span's end: launches then wait (those in progress finish first) and the process's queued
//! work is drained (at most [`DRAIN_MAX`]). The guard follows how long the drains take, so the
//! work ends near the span's end. A stream capture in progress is not drained (a
//! synchronisation would invalidate it); its launches still wait for the next span.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Once, RwLock};
use std::time::Duration;

use crate::config::Schedule;
use crate::turns::{Drain, now_ns};

/// The longest a span's end waits for the process's queued work.
pub const DRAIN_MAX: Duration = Duration::from_secs(1);
/// How often a launch that found the gate closed inside a span looks again.
const POLL: Duration = Duration::from_micros(200);

static NO_KEEPER: crate::log::Once = crate::log::Once::new();

/// One process's view of its container's window.
pub struct Windows {
    pid: u32,
    schedule: Schedule,
    /// Launches hold it shared; closing holds it alone, so no launch slips in meanwhile.
    gate: RwLock<()>,
    /// Until when launches may go (the open span's end less the guard), nanoseconds; 0 when
    /// closed.
    open_until: AtomicU64,
    /// No keeper could be started: launches go unheld.
    unheld: AtomicBool,
    /// Stream captures in progress in this process.
    captures: AtomicU32,
    /// How long before a span's end the gate closes, nanoseconds.
    guard_ns: AtomicU64,
    /// Spans closed, and closes whose drain did not finish within [`DRAIN_MAX`].
    closes: AtomicU64,
    overdue: AtomicU64,
    keeper: Once,
    drain: Drain,
}

impl Windows {
    /// Process `pid`'s view of `schedule`; `drain` waits on its queued work.
    pub fn new(schedule: Schedule, pid: u32, drain: Drain) -> Self {
        Self {
            pid,
            schedule,
            gate: RwLock::new(()),
            open_until: AtomicU64::new(0),
            unheld: AtomicBool::new(false),
            captures: AtomicU32::new(0),
            guard_ns: AtomicU64::new(0),
            closes: AtomicU64::new(0),
            overdue: AtomicU64::new(0),
            keeper: Once::new(),
            drain,
        }
    }

    /// The pid this view was made for.
    pub fn owner(&self) -> u32 {
        self.pid
    }

    /// `(closes, overdue)` so far in this process.
    pub fn closes(&self) -> (u64, u64) {
        (
            self.closes.load(Ordering::Acquire),
            self.overdue.load(Ordering::Acquire),
        )
    }

    /// Runs `launch` inside a span, waiting for one first.
    pub fn run<T>(&'static self, launch: impl FnOnce() -> T) -> T {
        self.keeper.call_once(|| self.start_keeper());
        loop {
            {
                let _g = self.gate.read().unwrap_or_else(|p| p.into_inner());
                // The clock decides, not only the keeper (whose wake-up may come late).
                if self.open_until.load(Ordering::Acquire) > now_ns() || self.unheld.load(Ordering::Acquire) {
                    return launch();
                }
            }
            let now = now_ns();
            let wait = match self.schedule.at(now) {
                // In a span, the gate closed: its guard (or the keeper not there yet).
                Ok(_) => POLL,
                Err(start) => Duration::from_nanos(start - now).max(POLL),
            };
            std::thread::sleep(wait);
        }
    }

    /// A stream capture began: its process's work is not drained until it ends.
    pub fn capture_began(&self) {
        self.captures.fetch_add(1, Ordering::AcqRel);
    }

    /// A stream capture ended (or failed to begin).
    pub fn capture_ended(&self) {
        let _ = self
            .captures
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |c| Some(c.saturating_sub(1)));
    }

    fn start_keeper(&'static self) {
        // Open at once when the process starts inside a span (the keeper may take a while).
        if let Ok(end) = self.schedule.at(now_ns()) {
            self.open_until.store(end, Ordering::Release);
        }
        let spawned = std::thread::Builder::new()
            .name("tessera-windows".into())
            .spawn(move || self.keep());
        if spawned.is_err() {
            // Without a keeper nothing would ever open the gate: launches go unheld.
            NO_KEEPER.print(format_args!(
                "cannot start the window thread: launches are not held to the share's window"
            ));
            self.unheld.store(true, Ordering::Release);
        }
    }

    /// Opens the gate at each span's start and closes it a guard before its end.
    fn keep(&self) {
        loop {
            let now = now_ns();
            match self.schedule.at(now) {
                Ok(end) => {
                    let close_at = end.saturating_sub(self.guard_ns.load(Ordering::Acquire));
                    if now < close_at {
                        self.open_until.store(close_at, Ordering::Release);
                        sleep_until(close_at);
                    }
                    self.close(end);
                    sleep_until(end);
                }
                Err(start) => {
                    self.open_until.store(0, Ordering::Release);
                    sleep_until(start);
                }
            }
        }
    }

    /// Closes the gate and drains the process's queued work, for a span that ends at `end`;
    /// moves the guard by half of how far the drain ended from `end`.
    fn close(&self, end: u64) {
        {
            let _alone = self.gate.write().unwrap_or_else(|p| p.into_inner());
            self.open_until.store(0, Ordering::Release);
        }
        if self.captures.load(Ordering::Acquire) > 0 {
            return;
        }
        let done = (self.drain)(DRAIN_MAX);
        self.closes.fetch_add(1, Ordering::AcqRel);
        if !done {
            self.overdue.fetch_add(1, Ordering::AcqRel);
        }
        let over = now_ns() as i64 - end as i64;
        let guard = self.guard_ns.load(Ordering::Acquire) as i64;
        let most = (self.schedule.longest() / 2) as i64;
        self.guard_ns
            .store((guard + over / 2).clamp(0, most) as u64, Ordering::Release);
    }
}

fn sleep_until(at_ns: u64) {
    let now = now_ns();
    if at_ns > now {
        std::thread::sleep(Duration::from_nanos(at_ns - now));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::AtomicU64;

    use super::*;

    fn leak(w: Windows) -> &'static Windows {
        Box::leak(Box::new(w))
    }

    /// Times this thread was preempted so far.
    fn preemptions() -> i64 {
        // SAFETY: getrusage writes the struct it is given and nothing else.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut usage) }, 0);
        usage.ru_nivcsw
    }

    /// Launches run only inside the spans: a launch's time, modulo the period, is in one or
    /// at most 20 us past its end (the time from the gate's look at the clock to the
    /// launch's). A launch whose thread was preempted on its way through the gate says nothing
    /// either way (its clock read may come any time later, as on a loaded machine) and is not
    /// counted.
    #[test]
    fn launches_run_inside_the_spans_only() {
        let schedule = Schedule::parse("20-50", 20).unwrap();
        let w = leak(Windows::new(schedule.clone(), 1, Box::new(|_| true)));
        let mut outside = Vec::new();
        let start = now_ns();
        let mut n = 0;
        while now_ns() - start < 300_000_000 {
            let before = preemptions();
            let at = w.run(now_ns);
            if preemptions() != before {
                continue;
            }
            n += 1;
            // The clock read inside the launch comes a little after the gate's own: in a span,
            // or just past its end. (Only the end is given that slack: a launch read 16 us
            // into a span was once counted outside, its time less 20 us being before it.)
            if schedule.at(at).is_err() && schedule.at(at.saturating_sub(20_000)).is_err() {
                outside.push((at % schedule.period_ns) / 1000);
            }
        }
        assert!(n > 100, "{n} launches not preempted");
        assert!(
            outside.is_empty(),
            "launched outside the span at {outside:?} us of the period"
        );
    }

    /// Each span's end drains the process's work, and the guard grows to what a drain takes,
    /// so the drains end near the span's end rather than past it.
    #[test]
    fn the_guard_follows_the_drains() {
        let schedule = Schedule::parse("0-50", 20).unwrap();
        let drains = Arc::new(AtomicU64::new(0));
        let d = drains.clone();
        let w = leak(Windows::new(
            schedule,
            1,
            Box::new(move |_| {
                d.fetch_add(1, Ordering::AcqRel);
                std::thread::sleep(Duration::from_millis(2));
                true
            }),
        ));
        let start = now_ns();
        while now_ns() - start < 400_000_000 {
            w.run(|| ());
            std::thread::sleep(Duration::from_micros(100));
        }
        let (closes, overdue) = w.closes();
        assert!(closes >= 10 && overdue == 0, "{closes} closes, {overdue} overdue");
        assert_eq!(drains.load(Ordering::Acquire), closes);
        let guard = w.guard_ns.load(Ordering::Acquire);
        assert!(
            (1_000_000..=5_000_000).contains(&guard),
            "guard {guard} ns for 2 ms drains"
        );
    }

    /// A capture in progress is not drained at a span's end.
    #[test]
    fn a_capture_is_not_drained() {
        let drains = Arc::new(AtomicU64::new(0));
        let d = drains.clone();
        let w = leak(Windows::new(
            Schedule::parse("0-50", 10).unwrap(),
            1,
            Box::new(move |_| {
                d.fetch_add(1, Ordering::AcqRel);
                true
            }),
        ));
        w.capture_began();
        w.run(|| ());
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(drains.load(Ordering::Acquire), 0);
        w.capture_ended();
        std::thread::sleep(Duration::from_millis(30));
        assert!(drains.load(Ordering::Acquire) > 0);
    }
}
