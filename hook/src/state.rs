//! The hook's per-process state, set up on the first intercepted call: the container's limits,
//! its shared memory accounting, what this process allocated, the launch bucket and its
//! controller. Anything missing or broken means pass-through, said once.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::{Mutex, Once, OnceLock, RwLock};

use crate::account::Accounting;
use crate::config::Config;
use crate::drain::Drainer;
use crate::log;
use crate::nvml::Nvml;
use crate::throttle::{Bucket, Controller, PERIOD};
use crate::turns::Turns;
use crate::windows::Windows;

/// What an allocation record is keyed by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// A device pointer (`cuMemAlloc*`).
    Ptr,
    /// An array handle.
    Array,
    /// A VMM allocation handle (`cuMemCreate`).
    Vmm,
}

/// The state of a configured process.
pub struct Hook {
    /// The limits.
    pub config: Config,
    account: RwLock<Option<Accounting>>,
    allocs: Mutex<HashMap<(Kind, u64), u64>>,
    vmm: Mutex<Vmm>,
    pools: Mutex<Pools>,
    /// Present when launches are throttled.
    pub bucket: Option<Bucket>,
    /// What holds launches to the container's turn or window, when one does (this process's
    /// view; a forked child makes its own).
    gate: RwLock<Option<Gate>>,
    controller: Once,
    /// NVML, for the controller.
    pub nvml: Mutex<Option<Nvml>>,
    nvml_tried: Once,
    /// Mean blocks of a kernel launch (a graph launch is charged one such launch).
    pub mean_cost: std::sync::atomic::AtomicU64,
    /// What this process is charged beyond what the hook counted: what the driver says it
    /// holds more (its context, modules, memory made past the hook).
    overhead: std::sync::atomic::AtomicU64,
}

/// VMM handles' mappings: a released handle's memory is the driver's until its last mapping
/// goes.
#[derive(Default)]
struct Vmm {
    /// Handle -> (mappings, released).
    handles: HashMap<u64, (u32, bool)>,
    /// Mapped address -> (size, handle).
    maps: std::collections::BTreeMap<u64, (u64, u64)>,
}

/// Stream-ordered pools. A pool is charged what it holds (the driver's reserved memory), not
/// what is allocated from it: memory freed into a pool stays the pool's (up to its release
/// threshold) until a synchronisation or a trim gives it back to the card.
#[derive(Default)]
struct Pools {
    /// Pool -> (charged, allocated from it now).
    held: HashMap<u64, (u64, u64)>,
    /// Pointer -> (pool, bytes).
    ptrs: HashMap<u64, (u64, u64)>,
}

/// Set (to anything) in a process's environment, the throttle's first control steps are printed
/// to stderr.
pub const DEBUG_ENV: &str = "TESSERA_HOOK_DEBUG";

static HOOK: OnceLock<Option<Hook>> = OnceLock::new();
static BROKEN: log::Once = log::Once::new();
static INTERNAL: log::Once = log::Once::new();
static NO_NVML: log::Once = log::Once::new();
static NO_TURNS: log::Once = log::Once::new();

/// This process's pid, remembered (a launch asks for it) and forgotten in a forked child.
static PID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

extern "C" fn forked() {
    PID.store(0, std::sync::atomic::Ordering::Release);
}

/// This process's pid.
pub fn pid() -> u32 {
    use std::sync::atomic::Ordering;
    static AT_FORK: Once = Once::new();
    let p = PID.load(Ordering::Acquire);
    if p != 0 {
        return p;
    }
    AT_FORK.call_once(|| {
        // SAFETY: registers a handler that only stores to an atomic.
        unsafe { libc::pthread_atfork(None, None, Some(forked)) };
    });
    let p = std::process::id();
    PID.store(p, Ordering::Release);
    p
}

/// The process's drainer (what a handover of the container's turn waits on).
pub static DRAINER: std::sync::LazyLock<Drainer> = std::sync::LazyLock::new(Drainer::default);

/// The process's hook state; `None`: pass everything through.
pub fn hook() -> Option<&'static Hook> {
    HOOK.get_or_init(|| match Config::load() {
        Ok(Some(config)) => Some(Hook::new(config)),
        Ok(None) => None,
        Err(e) => {
            // The container has limits but they cannot be read: it gets no GPU memory rather
            // than all of it.
            BROKEN.print(format_args!(
                "configuration unusable ({e}): refusing GPU memory allocations"
            ));
            Some(Hook::new(Config::closed()))
        }
    })
    .as_ref()
}

/// Runs `f`; a panic inside it is reported once and yields `fallback` (no panic crosses the C
/// boundary).
pub fn protect<T>(fallback: T, f: impl FnOnce() -> T) -> T {
    match std::panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(_) => {
            INTERNAL.print(format_args!("internal error: passing this call through"));
            fallback
        }
    }
}

impl Hook {
    fn new(config: Config) -> Self {
        // No accounting for a limit of nothing (a closed configuration): every allocation is
        // refused without touching any file.
        let account = config.memory_limit.filter(|l| *l > 0).and_then(|limit| {
            Accounting::open(&config.state_dir, limit, pid())
                .map_err(|e| {
                    BROKEN.print(format_args!(
                        "memory accounting unavailable ({}): refusing GPU memory allocations",
                        e.0
                    ))
                })
                .ok()
        });
        let bucket = config.throttle().map(|_| Bucket::new());
        let gate = RwLock::new(open_gate(&config));
        Self {
            gate,
            config,
            account: RwLock::new(account),
            allocs: Mutex::new(HashMap::new()),
            vmm: Mutex::new(Vmm::default()),
            pools: Mutex::new(Pools::default()),
            bucket,
            controller: Once::new(),
            nvml: Mutex::new(None),
            nvml_tried: Once::new(),
            mean_cost: std::sync::atomic::AtomicU64::new(1024),
            overhead: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Runs `f` on this process's accounting (re-opened after a fork, when the pid changed).
    fn with_account<T>(&self, f: impl FnOnce(&Accounting) -> T) -> Option<T> {
        {
            let a = self.account.read().unwrap_or_else(|p| p.into_inner());
            match a.as_ref() {
                None => return None,
                Some(acc) if acc_pid(acc) == pid() => return Some(f(acc)),
                Some(_) => {}
            }
        }
        let mut a = self.account.write().unwrap_or_else(|p| p.into_inner());
        let limit = a.as_ref().map(Accounting::limit)?;
        *a = Accounting::open(&self.config.state_dir, limit, pid()).ok();
        self.allocs.lock().unwrap_or_else(|p| p.into_inner()).clear();
        *self.pools.lock().unwrap_or_else(|p| p.into_inner()) = Pools::default();
        self.overhead.store(0, std::sync::atomic::Ordering::Release);
        a.as_ref().map(f)
    }

    /// Whether the container may take `bytes` more; `true` when memory is not limited. A
    /// limit whose accounting cannot be used refuses (a limit that fails open is no limit).
    pub fn admit(&self, bytes: u64) -> bool {
        self.with_account(|a| a.reserve(bytes))
            .unwrap_or(self.config.memory_limit.is_none())
    }

    /// Counts `bytes` past the limit (driver padding).
    pub fn force(&self, bytes: u64) {
        self.with_account(|a| a.force(bytes));
    }

    /// Gives back an admission the driver then refused.
    pub fn unadmit(&self, bytes: u64) {
        self.with_account(|a| a.release(bytes));
    }

    /// Records what an allocation took.
    pub fn record(&self, kind: Kind, id: u64, bytes: u64) {
        if self.with_account(|_| ()).is_some() {
            self.allocs
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert((kind, id), bytes);
        }
    }

    /// A VMM handle was mapped at `va`.
    pub fn vmm_mapped(&self, va: u64, size: u64, handle: u64) {
        let mut v = self.vmm.lock().unwrap_or_else(|p| p.into_inner());
        v.handles.entry(handle).or_default().0 += 1;
        v.maps.insert(va, (size, handle));
    }

    /// A VMM handle was released: whether its memory goes now (it is mapped nowhere).
    pub fn vmm_released(&self, handle: u64) -> bool {
        let mut v = self.vmm.lock().unwrap_or_else(|p| p.into_inner());
        match v.handles.get_mut(&handle) {
            Some((maps, released)) if *maps > 0 => {
                *released = true;
                false
            }
            _ => {
                v.handles.remove(&handle);
                true
            }
        }
    }

    /// `[va, va + size)` was unmapped: the released handles whose last mapping that was.
    pub fn vmm_unmapped(&self, va: u64, size: u64) -> Vec<u64> {
        let mut v = self.vmm.lock().unwrap_or_else(|p| p.into_inner());
        let gone: Vec<u64> = v.maps.range(va..va.saturating_add(size)).map(|(a, _)| *a).collect();
        let mut free = Vec::new();
        for a in gone {
            let Some((_, handle)) = v.maps.remove(&a) else { continue };
            if let Some((maps, released)) = v.handles.get_mut(&handle) {
                *maps = maps.saturating_sub(1);
                if *maps == 0 && *released {
                    v.handles.remove(&handle);
                    free.push(handle);
                }
            }
        }
        free
    }

    /// Forgets a freed allocation and gives its bytes back.
    pub fn forget(&self, kind: Kind, id: u64) {
        let bytes = self
            .allocs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&(kind, id));
        if let Some(b) = bytes {
            self.unadmit(b);
        }
    }

    /// Admission of `bytes` from `pool`: what the pool holds unallocated is charged already,
    /// so only the rest is admitted. `Some(admitted)`, or `None` past the limit.
    pub fn pool_admit(&self, pool: u64, bytes: u64) -> Option<u64> {
        let need = {
            let p = self.pools.lock().unwrap_or_else(|p| p.into_inner());
            let (charged, allocated) = p.held.get(&pool).copied().unwrap_or_default();
            bytes.saturating_sub(charged.saturating_sub(allocated))
        };
        (need == 0 || self.admit(need)).then_some(need)
    }

    /// The driver made `ptr` (`bytes` from `pool`, `admitted` of them admitted); `reserved`:
    /// what the pool now holds, when the driver said.
    pub fn pool_made(&self, pool: u64, ptr: u64, bytes: u64, admitted: u64, reserved: Option<u64>) {
        if self.with_account(|_| ()).is_none() {
            return;
        }
        let mut p = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        let e = p.held.entry(pool).or_default();
        e.0 += admitted;
        e.1 += bytes;
        p.ptrs.insert(ptr, (pool, bytes));
        if let Some(r) = reserved {
            self.recharge(&mut p, pool, r);
        }
    }

    /// `ptr` went back to its pool (which keeps the memory): whether it was a pool's.
    pub fn pool_freed(&self, ptr: u64) -> bool {
        let mut p = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        let Some((pool, bytes)) = p.ptrs.remove(&ptr) else {
            return false;
        };
        if let Some(e) = p.held.get_mut(&pool) {
            e.1 = e.1.saturating_sub(bytes);
        }
        true
    }

    /// The pools this process has allocated from.
    pub fn pools(&self) -> Vec<u64> {
        let p = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        p.held.keys().copied().collect()
    }

    /// Charges each `(pool, reserved)` what it holds now: whether any charge went down.
    pub fn pools_hold(&self, readings: &[(u64, u64)]) -> bool {
        // (A fork is noticed here, before the pools' lock: noticing it resets them.)
        if self.with_account(|_| ()).is_none() {
            return false;
        }
        let mut p = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        let mut lower = false;
        for &(pool, reserved) in readings {
            lower |= self.recharge(&mut p, pool, reserved);
        }
        lower
    }

    /// A destroyed pool holds nothing.
    pub fn pool_destroyed(&self, pool: u64) {
        if self.with_account(|_| ()).is_none() {
            return;
        }
        let mut p = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((charged, _)) = p.held.remove(&pool) {
            self.unadmit(charged);
        }
        p.ptrs.retain(|_, (owner, _)| *owner != pool);
    }

    /// Sets `pool`'s charge to what it holds (never below what is allocated from it): whether
    /// the charge went down.
    fn recharge(&self, p: &mut Pools, pool: u64, reserved: u64) -> bool {
        let Some(e) = p.held.get_mut(&pool) else {
            return false;
        };
        let target = reserved.max(e.1);
        let lower = target < e.0;
        if target > e.0 {
            // The driver reserves in its own granules: counted, never refused.
            self.force(target - e.0);
        } else if lower {
            self.unadmit(e.0 - target);
        }
        e.0 = target;
        lower
    }

    /// Charges this process what the driver (NVML) says it holds beyond what the hook counted:
    /// its context (about 520 MiB per process on an H100), modules, anything made past the
    /// hook. Whether the charge went down. Nothing happens where memory is not limited or NVML
    /// cannot say.
    pub fn reconcile(&self) -> bool {
        use std::sync::atomic::Ordering;
        let Some((counted, host_pid)) = self.with_account(|a| (a.own_used(), a.own_host_pid())) else {
            return false;
        };
        // NVML names the process by its pid in the querying namespace (driver 580) or on the
        // host (older drivers): each process appears under one of them.
        let pids: Vec<u32> = [pid(), host_pid].into_iter().filter(|p| *p != 0).collect();
        let Some(held) = self.with_nvml(|n| n.memory_of(&pids)).flatten() else {
            return false;
        };
        let before = self.overhead.load(Ordering::Acquire);
        let after = held.saturating_sub(counted.saturating_sub(before));
        if after > before {
            // Already held on the card: counted, never refused.
            self.force(after - before);
        } else if after < before {
            self.unadmit(before - after);
        }
        self.overhead.store(after, Ordering::Release);
        after < before
    }

    /// `(used, limit)` of the container, when memory is limited.
    pub fn memory(&self) -> Option<(u64, u64)> {
        self.with_account(|a| (a.used(), a.limit()))
    }

    /// NVML for this card, loaded once.
    pub fn with_nvml<T>(&self, f: impl FnOnce(&mut Nvml) -> T) -> Option<T> {
        self.nvml_tried.call_once(|| {
            *self.nvml.lock().unwrap_or_else(|p| p.into_inner()) = Nvml::open(&self.config.uuid);
        });
        self.nvml.lock().unwrap_or_else(|p| p.into_inner()).as_mut().map(f)
    }

    /// Whether this process's host pid is still to be found (only throttled processes need it).
    pub fn needs_host_pid(&self) -> bool {
        self.bucket.is_some() && self.with_account(|a| a.own_host_pid() == 0).unwrap_or(false)
    }

    /// Records this process's host pid.
    pub fn set_host_pid(&self, host_pid: u32) {
        self.with_account(|a| a.set_host_pid(host_pid));
    }

    /// This process's view of what holds its launches (the container's turn or window), if
    /// anything does.
    pub fn gate(&self) -> Option<Gate> {
        {
            let g = self.gate.read().unwrap_or_else(|p| p.into_inner());
            match *g {
                None => return None,
                Some(g) if g.owner() == pid() => return Some(g),
                Some(_) => {}
            }
        }
        let mut g = self.gate.write().unwrap_or_else(|p| p.into_inner());
        if g.is_some_and(|g| g.owner() != pid()) {
            *g = open_gate(&self.config);
        }
        *g
    }

    /// Holds a launch of `cost` blocks back as the bucket says, starting the controller on the
    /// first launch.
    pub fn throttle(&'static self, cost: u64) {
        let Some(bucket) = &self.bucket else { return };
        self.controller.call_once(|| self.start_controller());
        if let Some(wait) = bucket.take(cost) {
            std::thread::sleep(wait);
        }
    }

    fn start_controller(&'static self) {
        let target = self.config.throttle().unwrap_or(100);
        let spawned = std::thread::Builder::new()
            .name("tessera-throttle".into())
            .spawn(move || {
                let mut controller = Controller::new(target);
                // Each control step on stderr, for a while, when asked (prints only).
                let mut trace = if std::env::var_os(DEBUG_ENV).is_some() { 100 } else { 0 };
                loop {
                    std::thread::sleep(PERIOD);
                    let pids = self.with_account(|a| a.sampled_pids()).unwrap_or_default();
                    let util = self.with_nvml(|n| n.utilization(&pids)).flatten();
                    if trace > 0 {
                        trace -= 1;
                        let rate = self.bucket.as_ref().and_then(Bucket::rate);
                        eprintln!("tessera-cuda-hook: throttle pids={pids:?} util={util:?} rate={rate:?}");
                    }
                    if util.is_none() && self.with_nvml(|_| ()).is_none() {
                        NO_NVML.print(format_args!(
                            "NVML unavailable: kernel launches are not throttled to the {target}% share"
                        ));
                        return;
                    }
                    if let Some(b) = &self.bucket {
                        controller.step(b, util, PERIOD);
                    }
                }
            });
        if spawned.is_err() {
            NO_NVML.print(format_args!(
                "cannot start the throttle thread: launches are not throttled"
            ));
        }
    }
}

/// What holds a process's launches: the container's turn (MPS nodes) or its window of the
/// card's time (hook nodes).
#[derive(Clone, Copy)]
pub enum Gate {
    /// The container's processes take turns.
    Turns(&'static Turns),
    /// The container's processes launch in its window.
    Windows(&'static Windows),
}

impl Gate {
    /// The process this view is of.
    pub fn owner(self) -> u32 {
        match self {
            Gate::Turns(t) => t.owner(),
            Gate::Windows(w) => w.owner(),
        }
    }

    /// Runs `launch` when the gate lets it.
    pub fn run<T>(self, launch: impl FnOnce() -> T) -> T {
        match self {
            Gate::Turns(t) => t.run(launch),
            Gate::Windows(w) => w.run(launch),
        }
    }

    /// A stream capture began: no drain until it ends.
    pub fn capture_began(self) {
        match self {
            Gate::Turns(t) => t.capture_began(),
            Gate::Windows(w) => w.capture_began(),
        }
    }

    /// A stream capture ended (or failed to begin).
    pub fn capture_ended(self) {
        match self {
            Gate::Turns(t) => t.capture_ended(),
            Gate::Windows(w) => w.capture_ended(),
        }
    }
}

/// This process's gate, as the configuration asks (leaked: it lives as long as the process,
/// its keeper thread with it).
fn open_gate(config: &Config) -> Option<Gate> {
    if let Some(schedule) = config.windows() {
        let drain = Box::new(|within| DRAINER.drain(within));
        return Some(Gate::Windows(Box::leak(Box::new(Windows::new(
            schedule.clone(),
            pid(),
            drain,
        )))));
    }
    config.turns().then(|| open_turns(config)).flatten().map(Gate::Turns)
}

/// This process's view of the container's turn. Unusable, launches are not held to turns,
/// said once.
fn open_turns(config: &Config) -> Option<&'static Turns> {
    let drain = Box::new(|within| DRAINER.drain(within));
    match Turns::open(&config.state_dir, pid(), drain) {
        Ok(t) => {
            static AT_EXIT: Once = Once::new();
            AT_EXIT.call_once(|| {
                // SAFETY: registers a handler that runs at exit, in this process.
                unsafe { libc::atexit(leave_at_exit) };
            });
            Some(Box::leak(Box::new(t)))
        }
        Err(e) => {
            NO_TURNS.print(format_args!(
                "compute turns unavailable ({e}): this process's launches are held by MPS alone"
            ));
            None
        }
    }
}

/// A process that ends in its turn hands it over (its work drained) rather than leave the
/// others waiting until it is reaped: only its own view (a forked child opens none here), and
/// only if its launches can be held within 100 ms (the thread that called `exit()` may be a
/// signal handler's, over a launch in progress); else a dead holder's turn is taken anyway.
extern "C" fn leave_at_exit() {
    protect((), || {
        let turns = HOOK
            .get()
            .and_then(Option::as_ref)
            .and_then(|h| h.gate.try_read().ok().and_then(|g| *g));
        if let Some(Gate::Turns(t)) = turns
            && t.owner() == pid()
            && t.holds()
        {
            t.hand_over_within(std::time::Duration::from_millis(100));
        }
    });
}

fn acc_pid(a: &Accounting) -> u32 {
    a.owner()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_the_fallback() {
        // With the unwinder linked statically (build.rs), unwinding still works.
        assert_eq!(protect(7, || panic!("a bug in the hook")), 7);
        assert_eq!(protect(7, || 8), 8);
    }
}
