//! The engine's helper threads: kept between requests, woken ahead of an evaluation on its
//! way, and placed on CPUs by the program that runs the engine.
//!
//! A parked helper is woken when an evaluation hands out its work, and on a busy or virtual
//! machine the wake can take longer than the work: on the 2-core bench machine, beside the
//! extender's HTTP threads, the helper of a 5,000-node filter started more than 0.3 ms late in
//! one request of five, and after the calling thread had done every node in one of three to
//! six. A caller that knows an evaluation is coming (the extender, as a filter's request is
//! read) wakes them first ([`wake_helpers`]): they wait, spinning, until the work is handed out,
//! the caller lets them go, or [`WAIT_AT_MOST`] passes.
//!
//! Where a woken helper runs is the kernel's choice, and that VM's kernel often chose the
//! calling thread's CPU, busy with its own share: the helper then took no block in up to a
//! quarter of the filters. Core does no node I/O, so where helpers may run is the embedding
//! program's say ([`place_helpers`]): the extender keeps them off the calling thread's CPU.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Below this many nodes to evaluate, one thread does it (threads cost more than they save).
const PARALLEL_MIN_NODES: usize = 512;

/// At most this many threads evaluate one request.
const MAX_THREADS: usize = 8;

/// How long a helper woken ahead waits for the work, at most (a 10,000-node filter's request
/// is read and parsed in about a third of this on the bench machine).
pub const WAIT_AT_MOST: Duration = Duration::from_millis(1);

/// Moves on each time an evaluation hands out its work and each time a [`Woken`] is let go: a
/// helper woken ahead waits while it stands still.
static ROUND: AtomicU64 = AtomicU64::new(0);

/// The helpers the last evaluation on several threads took: how many to wake ahead of the next.
static LAST_HELPERS: AtomicUsize = AtomicUsize::new(0);

/// Helpers woken ahead and waiting now.
static WAITING: AtomicUsize = AtomicUsize::new(0);

/// The threads that evaluate beside the calling thread: one fewer than the threads a request
/// may use (cores, at most [`MAX_THREADS`]), kept between requests; `None` on one core, or
/// where they could not be started (requests are then evaluated on the calling thread).
///
/// A pool of its own, not rayon's global one: the global pool has a thread per core, and
/// with the calling thread working too, one more thread than cores wants to run. On a
/// 2-core machine, filters back to back on the engine alone, the helper woken for a
/// request started within 60 µs in nine requests out of ten with a pool of one, and more
/// than a millisecond late (after the calling thread had done every node) in one of ten
/// with a pool of two.
pub(super) fn helpers() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let helpers = cores.min(MAX_THREADS) - 1;
        if helpers == 0 {
            return None;
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(helpers)
            .thread_name(|i| format!("tessera-eval-{i}"))
            .build()
            .map_err(|e| tracing::warn!("evaluating on one thread: the helper threads did not start: {e}"))
            .ok()
    })
    .as_ref()
}

/// How many threads to evaluate `misses` nodes on (the calling thread and helpers).
pub(super) fn threads_for(misses: usize) -> usize {
    if misses < PARALLEL_MIN_NODES {
        return 1;
    }
    let threads = helpers().map_or(1, |p| p.current_num_threads() + 1);
    threads.min(misses / (PARALLEL_MIN_NODES / 2)).max(1)
}

/// Where the engine's helper threads run, for a program that has a say in it (core itself
/// does no node I/O): told as a helper takes an evaluation's work and as the calling thread
/// hands it out.
pub trait HelperPlacement: Send + Sync {
    /// On a helper thread, each time it takes part in an evaluation (before its first node).
    /// Called on every evaluation on several threads: keep it to a few instructions once the
    /// thread is known.
    fn helper_working(&self);
    /// On the calling thread, just before it hands an evaluation's work to the helpers (it then
    /// takes its own share on the same thread).
    fn handing_out(&self);
}

/// The placement installed by [`place_helpers`].
static PLACEMENT: OnceLock<Box<dyn HelperPlacement>> = OnceLock::new();

/// Installs where the helpers run, once per process; a second one is given back. Helpers
/// register as they next take work, so it may come after the first evaluation.
pub fn place_helpers(placement: Box<dyn HelperPlacement>) -> Result<(), Box<dyn HelperPlacement>> {
    PLACEMENT.set(placement)
}

/// Says that this helper thread takes part in an evaluation.
pub(super) fn helper_working() {
    if let Some(p) = PLACEMENT.get() {
        p.helper_working();
    }
}

/// Says that the calling thread hands an evaluation's work to the helpers now.
pub(super) fn handing_out() {
    if let Some(p) = PLACEMENT.get() {
        p.handing_out();
    }
}

/// Says that an evaluation has handed its work to `helpers` helpers: those woken ahead stop
/// waiting and take it, and the next caller wakes as many.
pub(super) fn handed_out(helpers: usize) {
    LAST_HELPERS.store(helpers, Ordering::Relaxed);
    ROUND.fetch_add(1, Ordering::Release);
}

/// Helpers woken ahead of an evaluation; letting it go (dropping it) lets them go back to
/// sleep if the evaluation has not started.
#[must_use = "the helpers stop waiting as soon as it is dropped"]
#[derive(Debug)]
pub struct Woken(());

impl Drop for Woken {
    fn drop(&mut self) {
        ROUND.fetch_add(1, Ordering::Release);
    }
}

/// Wakes as many helper threads as the last evaluation on several threads took, to wait for
/// the next evaluation's work (each at most [`WAIT_AT_MOST`]); none before the first such
/// evaluation, and none on one core.
///
/// A helper spins while it waits, keeping a core busy: a caller wakes them only where an
/// evaluation of many nodes is likely to follow within a fraction of a millisecond.
pub fn wake_helpers() -> Woken {
    wake_for(WAIT_AT_MOST)
}

fn wake_for(at_most: Duration) -> Woken {
    let woken = Woken(());
    let Some(pool) = helpers() else {
        return woken;
    };
    let round = ROUND.load(Ordering::Acquire);
    for _ in 0..LAST_HELPERS.load(Ordering::Relaxed).min(pool.current_num_threads()) {
        pool.spawn(move || {
            WAITING.fetch_add(1, Ordering::Relaxed);
            let deadline = Instant::now() + at_most;
            let mut spins = 0u32;
            while ROUND.load(Ordering::Acquire) == round {
                std::hint::spin_loop();
                spins = spins.wrapping_add(1);
                // The clock is read now and then: a read costs tens of spins.
                if spins.is_multiple_of(64) && Instant::now() >= deadline {
                    break;
                }
            }
            WAITING.fetch_sub(1, Ordering::Relaxed);
        });
    }
    woken
}

/// Helpers woken ahead and waiting now.
#[cfg(test)]
pub(super) fn waiting() -> usize {
    WAITING.load(Ordering::Relaxed)
}

/// Waits up to `limit` for `cond`.
#[cfg(test)]
pub(super) fn within(limit: Duration, cond: impl Fn() -> bool) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    cond()
}

/// Wakes every helper to wait up to `at_most`, again until one is seen waiting (other tests'
/// evaluations move the round on too, which ends a wait); `None` on one core.
#[cfg(test)]
pub(super) fn wake_all_seen(at_most: Duration) -> Option<Woken> {
    let pool = helpers()?;
    for _ in 0..50 {
        LAST_HELPERS.store(pool.current_num_threads(), Ordering::Relaxed);
        let woken = wake_for(at_most);
        if within(Duration::from_millis(200), || waiting() > 0) {
            return Some(woken);
        }
    }
    panic!("no woken helper was ever seen waiting");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn woken_helpers_stop_waiting_once_let_go() {
        let Some(woken) = wake_all_seen(Duration::from_secs(120)) else {
            eprintln!("one core: no helper threads to wake");
            return;
        };
        drop(woken);
        // Waiting out the two minutes instead would fail here.
        assert!(
            within(Duration::from_secs(20), || waiting() == 0),
            "helpers still waiting after they were let go"
        );
    }
}
