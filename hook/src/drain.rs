//! Waiting for a process's queued GPU work from a thread of its own, for at most a while: what
//! a handover of the container's turn ([`crate::turns`]) waits on.
//!
//! The work is every context's: the devices' primary contexts that are active (retained for
//! the wait, so none is destroyed under it) and the contexts the process created (noted by
//! the context hooks). Destroying a context, releasing or resetting a primary one waits for a
//! wait in progress first. A synchronisation the driver refuses counts as not drained.

use std::sync::{Condvar, Mutex};
use std::time::Duration;

use crate::ffi::{CUDA_SUCCESS, CuResult, Handle};

reals! {
    DEVICE_GET_COUNT = c"cuDeviceGetCount";
    DEVICE_GET = c"cuDeviceGet";
    PRIMARY_STATE = c"cuDevicePrimaryCtxGetState";
    PRIMARY_RETAIN = c"cuDevicePrimaryCtxRetain";
    PRIMARY_RELEASE = c"cuDevicePrimaryCtxRelease_v2";
    CTX_PUSH = c"cuCtxPushCurrent_v2";
    CTX_POP = c"cuCtxPopCurrent_v2";
    CTX_SYNC = c"cuCtxSynchronize";
}

#[derive(Default)]
struct State {
    /// Contexts the process created (as addresses).
    created: Vec<usize>,
    asked: u64,
    done: u64,
    /// Whether the last wait's synchronisations all succeeded.
    ok: bool,
    /// A wait is in progress on the drainer's thread.
    running: bool,
    /// The process whose drainer thread runs (a forked child has none: it starts its own).
    thread_of: u32,
}

/// The process's drainer.
#[derive(Default)]
pub struct Drainer {
    state: Mutex<State>,
    changed: Condvar,
}

impl Drainer {
    /// A context the process created.
    pub fn created(&self, ctx: Handle) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if !s.created.contains(&(ctx as usize)) {
            s.created.push(ctx as usize);
        }
    }

    /// A context about to be destroyed: forgotten, after a wait in progress ends (the driver
    /// must not destroy a context another thread synchronises).
    pub fn destroying(&self, ctx: Handle) {
        let mut s = self.quiet();
        s.created.retain(|c| *c != ctx as usize);
    }

    /// Waits for a wait in progress to end (before a primary context is released or reset);
    /// the next one starts only after the caller's call, or finds the context gone.
    pub fn quiesce(&self) {
        drop(self.quiet());
    }

    fn quiet(&self) -> std::sync::MutexGuard<'_, State> {
        let s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        self.changed
            .wait_while(s, |s| s.running)
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Waits up to `within` for the process's queued work: whether it finished.
    pub fn drain(&'static self, within: Duration) -> bool {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let pid = crate::state::pid();
        if s.thread_of != pid {
            // A forked child: no thread serves it, and its parent's contexts are not its own.
            (s.done, s.running) = (s.asked, false);
            s.created.clear();
            if std::thread::Builder::new()
                .name("tessera-drain".into())
                .spawn(move || self.serve())
                .is_err()
            {
                return false;
            }
            s.thread_of = pid;
        }
        s.asked += 1;
        let ticket = s.asked;
        self.changed.notify_all();
        let (s, _) = self
            .changed
            .wait_timeout_while(s, within, |s| s.done < ticket)
            .unwrap_or_else(|p| p.into_inner());
        s.done >= ticket && s.ok
    }

    fn serve(&self) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            s = self
                .changed
                .wait_while(s, |s| s.done >= s.asked)
                .unwrap_or_else(|p| p.into_inner());
            let ticket = s.asked;
            let created = s.created.clone();
            s.running = true;
            drop(s);
            let ok = crate::state::protect(false, || sync_all(&created));
            s = self.state.lock().unwrap_or_else(|p| p.into_inner());
            s.running = false;
            s.done = ticket;
            s.ok = ok;
            self.changed.notify_all();
        }
    }
}

/// Waits for every active primary context's work and every created context's: whether every
/// synchronisation succeeded.
fn sync_all(created: &[usize]) -> bool {
    type Count = unsafe extern "C" fn(*mut i32) -> CuResult;
    type Get = unsafe extern "C" fn(*mut i32, i32) -> CuResult;
    type State = unsafe extern "C" fn(i32, *mut u32, *mut i32) -> CuResult;
    type Retain = unsafe extern "C" fn(*mut Handle, i32) -> CuResult;
    type Release = unsafe extern "C" fn(i32) -> CuResult;
    let mut n = 0i32;
    if call!(DEVICE_GET_COUNT, Count, &mut n) != CUDA_SUCCESS {
        n = 0;
    }
    let mut ok = true;
    for ordinal in 0..n {
        let (mut dev, mut flags, mut active) = (0i32, 0u32, 0i32);
        if call!(DEVICE_GET, Get, &mut dev, ordinal) != CUDA_SUCCESS
            || call!(PRIMARY_STATE, State, dev, &mut flags, &mut active) != CUDA_SUCCESS
            || active == 0
        {
            continue;
        }
        let mut ctx: Handle = std::ptr::null_mut();
        // The real retain, not the hook's (which would charge a context's memory again).
        if call!(PRIMARY_RETAIN, Retain, &mut ctx, dev) == CUDA_SUCCESS {
            ok &= sync(ctx);
            call!(PRIMARY_RELEASE, Release, dev);
        }
    }
    for &c in created {
        ok &= sync(c as Handle);
    }
    ok
}

/// Synchronises `ctx`: whether the driver did (a context it no longer knows has no work).
fn sync(ctx: Handle) -> bool {
    type Push = unsafe extern "C" fn(Handle) -> CuResult;
    type Pop = unsafe extern "C" fn(*mut Handle) -> CuResult;
    type Sync = unsafe extern "C" fn() -> CuResult;
    if call!(CTX_PUSH, Push, ctx) != CUDA_SUCCESS {
        return true;
    }
    let synced = call!(CTX_SYNC, Sync,) == CUDA_SUCCESS;
    let mut out: Handle = std::ptr::null_mut();
    call!(CTX_POP, Pop, &mut out);
    synced
}
