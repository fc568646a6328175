//! Where the placement engine's helper threads run: off the CPU of the thread that hands them
//! work.
//!
//! The thread that evaluates a filter hands part of it to the engine's helpers and takes its
//! own share on its CPU. Left to the kernel, a woken helper often lands on that same busy CPU
//! (on the 2-core bench VM it took no block of a 5,000-node filter in up to a quarter of the
//! filters, and 35-43% of the blocks in all); kept off it, on any other CPU the process may
//! use, it took part in all but a handful and about half the blocks. A system call per helper
//! only when the calling thread's CPU is not the one they were last kept off.

/// Installs the placement for the engine's helpers, once per process (later calls do
/// nothing); nothing outside Linux.
pub fn keep_helpers_off_the_caller() {
    #[cfg(target_os = "linux")]
    linux::install();
}

#[cfg(target_os = "linux")]
mod linux {
    use std::cell::Cell;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Mutex, OnceLock};

    use nix::sched::{CpuSet, sched_getaffinity, sched_getcpu, sched_setaffinity};
    use nix::unistd::{Pid, gettid};
    use tessera_core::placement::{HelperPlacement, place_helpers};

    /// No CPU: the helpers are to be kept off the caller's on its next hand-out.
    const NONE: usize = usize::MAX;

    /// The helpers' thread ids, and the CPU they are kept off.
    struct KeepOffCaller {
        helpers: Mutex<Vec<Pid>>,
        /// The CPU the helpers are kept off now ([`NONE`] once a helper is new).
        off: AtomicUsize,
    }

    thread_local! {
        /// Whether this thread is among [`KeepOffCaller::helpers`].
        static KNOWN: Cell<bool> = const { Cell::new(false) };
    }

    /// The placement installed, once per process (`None` where the engine had one already).
    static PLACED: OnceLock<Option<&'static KeepOffCaller>> = OnceLock::new();

    pub(super) fn install() {
        PLACED.get_or_init(|| {
            let placement: &'static KeepOffCaller = Box::leak(Box::new(KeepOffCaller {
                helpers: Mutex::new(Vec::new()),
                off: AtomicUsize::new(NONE),
            }));
            match place_helpers(Box::new(placement)) {
                Ok(()) => Some(placement),
                Err(_) => {
                    tracing::warn!("the engine's helpers were placed already; kept as they are");
                    None
                }
            }
        });
    }

    impl HelperPlacement for &'static KeepOffCaller {
        fn helper_working(&self) {
            if KNOWN.get() {
                return;
            }
            KNOWN.set(true);
            self.helpers.lock().unwrap_or_else(|p| p.into_inner()).push(gettid());
            // The next hand-out keeps this one off the caller's CPU too.
            self.off.store(NONE, Ordering::Relaxed);
        }

        fn handing_out(&self) {
            let Ok(cpu) = sched_getcpu() else {
                return;
            };
            if self.off.load(Ordering::Relaxed) == cpu {
                return;
            }
            // The CPUs the process may use now (its main thread's: a container's CPU set can
            // change while it runs).
            let Ok(mut others) = sched_getaffinity(Pid::this()) else {
                return;
            };
            // A CPU the set cannot hold is not in it.
            let _ = others.unset(cpu);
            if !(0..CpuSet::count()).any(|c| others.is_set(c).unwrap_or(false)) {
                return;
            }
            for &tid in self.helpers.lock().unwrap_or_else(|p| p.into_inner()).iter() {
                if let Err(e) = sched_setaffinity(tid, &others) {
                    tracing::debug!("engine helper thread {tid}: its CPUs were not set: {e}");
                }
            }
            self.off.store(cpu, Ordering::Relaxed);
        }
    }

    /// The CPUs of each helper known so far.
    #[cfg(test)]
    pub(super) fn helper_cpus() -> Vec<Vec<usize>> {
        let Some(p) = PLACED.get().copied().flatten() else {
            return Vec::new();
        };
        p.helpers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|&tid| sched_getaffinity(tid).map_or_else(|_| Vec::new(), |set| cpus_of(&set)))
            .collect()
    }

    #[cfg(test)]
    pub(super) fn cpus_of(set: &CpuSet) -> Vec<usize> {
        (0..CpuSet::count())
            .filter(|&c| set.is_set(c).unwrap_or(false))
            .collect()
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use nix::sched::{CpuSet, sched_getaffinity, sched_setaffinity};
    use nix::unistd::Pid;
    use tessera_core::inventory::{FixtureSource, InventorySource};
    use tessera_core::ledger::{Ledger, NodeCapacity};
    use tessera_core::placement::{CardDemand, EngineConfig, PodDemand, TargetWorkload};
    use tessera_core::policy::PolicyKind;

    use super::linux::{cpus_of, helper_cpus};

    /// A ledger of `nodes` idle H100x8 nodes.
    fn ledger(nodes: usize) -> Ledger {
        let gpus = FixtureSource::new("h100x8")
            .discover()
            .expect("the h100x8 fixture")
            .gpus;
        let config = EngineConfig {
            node_policy: PolicyKind::Fgd,
            gpu_policy: PolicyKind::Fgd,
            seed: 7,
        };
        let mut l = Ledger::new(config, &TargetWorkload::default());
        for n in 0..nodes {
            let capacity = NodeCapacity {
                cpu_milli: 64_000,
                memory_bytes: 256 << 30,
                gpus: gpus.clone(),
                schedulable: true,
                share_enforcement: Default::default(),
                topology: None,
                cross_tenant: false,
            };
            assert!(l.set_node(&format!("node-{n}"), capacity).is_empty());
        }
        l
    }

    /// The helpers may run on every CPU of the process but the one the thread that hands them
    /// work is on, and follow it when it moves.
    #[test]
    fn helpers_are_kept_off_the_cpu_of_the_thread_that_hands_them_work() {
        let this = Pid::from_raw(0);
        let allowed = sched_getaffinity(this).expect("this thread's CPUs");
        let cpus = cpus_of(&allowed);
        let [first, second, ..] = cpus[..] else {
            eprintln!("one CPU: nowhere else to keep the helpers");
            return;
        };
        super::keep_helpers_off_the_caller();
        let mut l = ledger(600);
        let e = l.engine();
        let nodes: Vec<usize> = (0..600).collect();
        let ask = |core_milli| {
            PodDemand::single(
                1000,
                1 << 30,
                Some(CardDemand::Share {
                    core_milli,
                    memory_mib: Some(4 << 10),
                }),
            )
        };
        // The engine's helpers start with its first evaluation, as many as this thread's CPUs
        // allow: all of them here.
        e.evaluate_nodes(&ask(100), &nodes);
        let mut shape = 100;
        for cpu in [first, second, first] {
            let mut only = CpuSet::new();
            only.set(cpu).expect("a CPU of this machine");
            sched_setaffinity(this, &only).expect("this thread kept to one CPU");
            // An ask no node has seen, so that the evaluation is shared with the helpers;
            // other tests evaluating from other CPUs move the helpers too: try again until
            // this thread's evaluation is the last one seen.
            let kept_off = (0..200).any(|_| {
                shape += 1;
                assert_eq!(e.evaluate_nodes(&ask(shape), &nodes).len(), nodes.len());
                let helpers = helper_cpus();
                !helpers.is_empty()
                    && helpers
                        .iter()
                        .all(|h| !h.is_empty() && !h.contains(&cpu) && h.iter().all(|c| cpus.contains(c)))
            });
            sched_setaffinity(this, &allowed).expect("this thread's CPUs back");
            assert!(kept_off, "helpers never kept off CPU {cpu}: {:?}", helper_cpus());
        }
    }
}
