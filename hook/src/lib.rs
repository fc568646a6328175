//! Tessera's CUDA driver hook: on nodes whose share enforcement is `hook` or `mps`, the NRI plugin
//! preloads this library into every process of a share container (a read-only
//! `/etc/ld.so.preload`) and mounts the container's limits beside it. Then:
//! - memory: `cuMemAlloc*`, `cuMemAllocPitch`, `cuMemAllocManaged`, the async and pool
//!   allocations, `cuMemCreate` (VMM) and arrays are admitted against the container's limit,
//!   counted across all its processes ([`account`]), and refused with
//!   `CUDA_ERROR_OUT_OF_MEMORY` past it; frees give the memory back (a VMM handle's at its last
//!   unmap when it was released while mapped, as the driver frees it); `cuMemGetInfo` and
//!   `cuDeviceTotalMem` report the share; a limit whose accounting cannot be opened refuses;
//! - compute: on `hook` nodes kernel launches (plain, `Ex`, cooperative, graphs) run only in the
//!   container's window of the card's time, which no co-tenant's overlaps ([`windows`]), or,
//!   given no window, are throttled by a token bucket whose rate follows the container's
//!   measured SM utilization ([`throttle`]); on MPS nodes, where MPS caps each process's SMs and
//!   NVML cannot measure MPS clients, the container's processes take turns on the card
//!   ([`turns`]); both drain queued work at a handover ([`drain`]).
//!
//! Programs reach the hooks whether they link libcuda or load it: every hooked entry point is
//! exported under the driver's name, and `dlsym` and `cuGetProcAddress` hand out the hooks in
//! place of the driver's functions ([`hooks`]); `dlsym(RTLD_NEXT, ...)` keeps its caller. Without
//! a configuration everything passes through; no panic crosses the C boundary.

// Production functions stay under clippy.toml's length (tests may run long; CONTRIBUTING.md).
#![cfg_attr(not(test), deny(clippy::too_many_lines))]

// The driver-calling macros the hooks and the drainer share (textual scope: defined before
// the modules that use them).
/// Calls the driver's `$real` as `$ty`, or answers `CUDA_ERROR_NOT_FOUND` when the driver
/// lacks it.
macro_rules! call {
    ($real:expr, $ty:ty, $($arg:expr),*) => {{
        let p = $real.get();
        if p.is_null() {
            $crate::ffi::CUDA_ERROR_NOT_FOUND
        } else {
            // SAFETY: `p` is the driver's function of that name, whose C signature is `$ty`.
            let f: $ty = unsafe { std::mem::transmute::<*mut std::ffi::c_void, $ty>(p) };
            // SAFETY: the arguments are the caller's (a hook's, passed through unchanged; the
            // drainer's, valid for the function).
            unsafe { f($($arg),*) }
        }
    }};
}

macro_rules! reals {
    ($($vis:vis $id:ident = $name:literal;)*) => {
        $($vis static $id: $crate::real::Real = $crate::real::Real::new($name);)*
    };
}

pub mod account;
pub mod config;
pub mod discover;
pub mod drain;
pub mod ffi;
pub mod hooks;
mod log;
pub mod nvml;
pub mod real;
pub mod shared;
pub mod state;
pub mod throttle;
pub mod turns;
pub mod windows;
