//! Tessera's CUDA driver hook: on nodes whose share enforcement is `hook`, the NRI plugin
//! preloads this library into every process of a share container (a read-only
//! `/etc/ld.so.preload`) and mounts the container's limits beside it. Then:
//! - memory: `cuMemAlloc*`, `cuMemAllocPitch`, `cuMemAllocManaged`, the async and pool
//!   allocations, `cuMemCreate` (VMM) and arrays are admitted against the container's limit,
//!   counted across all its processes ([`account`]), and refused with
//!   `CUDA_ERROR_OUT_OF_MEMORY` past it; frees give the memory back (a VMM handle's at its last
//!   unmap when it was released while mapped, as the driver frees it); `cuMemGetInfo` and
//!   `cuDeviceTotalMem` report the share; a limit whose accounting cannot be opened refuses;
//! - compute: kernel launches (plain, `Ex`, cooperative, graphs) are throttled by a token bucket
//!   whose rate follows the container's measured SM utilization ([`throttle`]).
//!
//! Programs reach the hooks whether they link libcuda or load it: every hooked entry point is
//! exported under the driver's name, and `dlsym` and `cuGetProcAddress` hand out the hooks in
//! place of the driver's functions ([`hooks`]); `dlsym(RTLD_NEXT, ...)` keeps its caller. Without
//! a configuration everything passes through; no panic crosses the C boundary.

pub mod account;
pub mod config;
pub mod discover;
pub mod ffi;
pub mod hooks;
mod log;
pub mod nvml;
pub mod real;
pub mod state;
pub mod throttle;
