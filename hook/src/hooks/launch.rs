//! Launch hooks: kernel and graph launches wait on the compute throttle, for the process's turn
//! on the card, or for the container's window of its time, before reaching the driver.

use std::ffi::{c_uint, c_void};
use std::sync::atomic::Ordering;

use crate::ffi::{CuLaunchConfig, CuResult, Handle};
use crate::state::{hook, protect};

reals! {
    pub(super) LAUNCH_KERNEL = c"cuLaunchKernel";
    pub(super) LAUNCH_KERNEL_PTSZ = c"cuLaunchKernel_ptsz";
    pub(super) LAUNCH_KERNEL_EX = c"cuLaunchKernelEx";
    pub(super) LAUNCH_KERNEL_EX_PTSZ = c"cuLaunchKernelEx_ptsz";
    pub(super) LAUNCH_COOPERATIVE = c"cuLaunchCooperativeKernel";
    pub(super) LAUNCH_COOPERATIVE_PTSZ = c"cuLaunchCooperativeKernel_ptsz";
    pub(super) GRAPH_LAUNCH = c"cuGraphLaunch";
    pub(super) GRAPH_LAUNCH_PTSZ = c"cuGraphLaunch_ptsz";
}

/// Runs `launch` (of `cost` blocks) once the throttle lets it go, in the process's turn or the
/// container's window where it has one.
fn gated(cost: u64, launch: impl FnOnce() -> CuResult) -> CuResult {
    let Some(h) = hook() else { return launch() };
    protect((), || {
        // A running mean of kernel costs (a graph launch is charged one mean launch).
        let m = h.mean_cost.load(Ordering::Relaxed);
        h.mean_cost.store((m * 15 + cost) / 16, Ordering::Relaxed);
        h.throttle(cost);
    });
    match protect(None, || h.gate()) {
        Some(gate) => gate.run(launch),
        None => launch(),
    }
}

fn blocks(x: c_uint, y: c_uint, z: c_uint) -> u64 {
    u64::from(x.max(1)) * u64::from(y.max(1)) * u64::from(z.max(1))
}

macro_rules! launch_kernel {
    ($name:ident, $real:ident) => {
        /// # Safety
        /// As the driver's function of this name.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            f: Handle,
            gx: c_uint,
            gy: c_uint,
            gz: c_uint,
            bx: c_uint,
            by: c_uint,
            bz: c_uint,
            shared: c_uint,
            stream: Handle,
            params: *mut *mut c_void,
            extra: *mut *mut c_void,
        ) -> CuResult {
            type F = unsafe extern "C" fn(
                Handle,
                c_uint,
                c_uint,
                c_uint,
                c_uint,
                c_uint,
                c_uint,
                c_uint,
                Handle,
                *mut *mut c_void,
                *mut *mut c_void,
            ) -> CuResult;
            gated(blocks(gx, gy, gz), || {
                call!($real, F, f, gx, gy, gz, bx, by, bz, shared, stream, params, extra)
            })
        }
    };
}
launch_kernel!(cuLaunchKernel, LAUNCH_KERNEL);
launch_kernel!(cuLaunchKernel_ptsz, LAUNCH_KERNEL_PTSZ);

macro_rules! launch_ex {
    ($name:ident, $real:ident) => {
        /// # Safety
        /// As the driver's function of this name.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            config: *const CuLaunchConfig,
            f: Handle,
            params: *mut *mut c_void,
            extra: *mut *mut c_void,
        ) -> CuResult {
            type F =
                unsafe extern "C" fn(*const CuLaunchConfig, Handle, *mut *mut c_void, *mut *mut c_void) -> CuResult;
            // SAFETY: a non-null config is the caller's valid struct.
            let cost = unsafe { config.as_ref() }.map_or(0, |c| blocks(c.grid_dim_x, c.grid_dim_y, c.grid_dim_z));
            gated(cost, || call!($real, F, config, f, params, extra))
        }
    };
}
launch_ex!(cuLaunchKernelEx, LAUNCH_KERNEL_EX);
launch_ex!(cuLaunchKernelEx_ptsz, LAUNCH_KERNEL_EX_PTSZ);

macro_rules! launch_cooperative {
    ($name:ident, $real:ident) => {
        /// # Safety
        /// As the driver's function of this name.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            f: Handle,
            gx: c_uint,
            gy: c_uint,
            gz: c_uint,
            bx: c_uint,
            by: c_uint,
            bz: c_uint,
            shared: c_uint,
            stream: Handle,
            params: *mut *mut c_void,
        ) -> CuResult {
            type F = unsafe extern "C" fn(
                Handle,
                c_uint,
                c_uint,
                c_uint,
                c_uint,
                c_uint,
                c_uint,
                c_uint,
                Handle,
                *mut *mut c_void,
            ) -> CuResult;
            gated(blocks(gx, gy, gz), || {
                call!($real, F, f, gx, gy, gz, bx, by, bz, shared, stream, params)
            })
        }
    };
}
launch_cooperative!(cuLaunchCooperativeKernel, LAUNCH_COOPERATIVE);
launch_cooperative!(cuLaunchCooperativeKernel_ptsz, LAUNCH_COOPERATIVE_PTSZ);

macro_rules! graph_launch {
    ($name:ident, $real:ident) => {
        /// # Safety
        /// As the driver's function of this name.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(exec: Handle, stream: Handle) -> CuResult {
            type F = unsafe extern "C" fn(Handle, Handle) -> CuResult;
            let cost = hook().map_or(0, |h| h.mean_cost.load(Ordering::Relaxed));
            gated(cost, || call!($real, F, exec, stream))
        }
    };
}
graph_launch!(cuGraphLaunch, GRAPH_LAUNCH);
graph_launch!(cuGraphLaunch_ptsz, GRAPH_LAUNCH_PTSZ);
