//! Context hooks: creating a context learns the host pid and charges the context's own memory;
//! where the container's processes take turns, created contexts are what a handover waits on.

use std::ffi::{c_int, c_uint, c_void};

use crate::ffi::{CUDA_SUCCESS, CuDevice, CuResult, Handle};
use crate::state::{Hook, hook, protect};

reals! {
    pub(super) PRIMARY_CTX_RETAIN = c"cuDevicePrimaryCtxRetain";
    pub(super) CTX_CREATE = c"cuCtxCreate_v2";
    pub(super) CTX_CREATE_V3 = c"cuCtxCreate_v3";
    pub(super) CTX_DESTROY = c"cuCtxDestroy_v2";
    pub(super) PRIMARY_CTX_RELEASE = c"cuDevicePrimaryCtxRelease_v2";
    pub(super) PRIMARY_CTX_RESET = c"cuDevicePrimaryCtxReset_v2";
}

/// Whether a gate drains the process's work (its contexts are then what a handover drains).
fn drains() -> bool {
    hook().is_some_and(|h| h.config.drains())
}

/// Creates a context and, for a throttled process that does not know it yet, learns its host
/// pid from the node agent (drivers that sample processes by host pid); then charges the
/// process the context's own memory.
fn with_discovery(h: Option<&'static Hook>, make: impl FnOnce() -> CuResult) -> CuResult {
    let r = make();
    if r == CUDA_SUCCESS
        && let Some(h) = h
    {
        protect((), || {
            if h.needs_host_pid()
                && let Some(pid) = h.config.pid_socket.as_deref().and_then(crate::discover::host_pid)
            {
                h.set_host_pid(pid);
            }
        });
        protect(false, || h.reconcile());
    }
    r
}

/// # Safety
/// As the driver's `cuDevicePrimaryCtxRetain`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut Handle, dev: CuDevice) -> CuResult {
    type F = unsafe extern "C" fn(*mut Handle, CuDevice) -> CuResult;
    with_discovery(hook(), || call!(PRIMARY_CTX_RETAIN, F, ctx, dev))
}

/// # Safety
/// As the driver's `cuCtxCreate_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v2(ctx: *mut Handle, flags: c_uint, dev: CuDevice) -> CuResult {
    type F = unsafe extern "C" fn(*mut Handle, c_uint, CuDevice) -> CuResult;
    let r = with_discovery(hook(), || call!(CTX_CREATE, F, ctx, flags, dev));
    created(r, ctx);
    r
}

/// A context the process made is one a handover of the container's turn waits on.
fn created(r: CuResult, ctx: *mut Handle) {
    if r == CUDA_SUCCESS && !ctx.is_null() && hook().is_some_and(|h| h.config.drains()) {
        // SAFETY: the driver filled `*ctx`.
        crate::state::DRAINER.created(unsafe { *ctx });
    }
}

/// Destroying a context waits for a handover's wait on it first.
///
/// # Safety
/// As the driver's `cuCtxDestroy_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxDestroy_v2(ctx: Handle) -> CuResult {
    type F = unsafe extern "C" fn(Handle) -> CuResult;
    if drains() {
        protect((), || crate::state::DRAINER.destroying(ctx));
    }
    call!(CTX_DESTROY, F, ctx)
}

/// Releasing a primary context (its last release destroys it) waits for a handover's wait
/// first.
///
/// # Safety
/// As the driver's `cuDevicePrimaryCtxRelease_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CuDevice) -> CuResult {
    type F = unsafe extern "C" fn(CuDevice) -> CuResult;
    if drains() {
        protect((), || crate::state::DRAINER.quiesce());
    }
    call!(PRIMARY_CTX_RELEASE, F, dev)
}

/// Resetting a primary context (`cudaDeviceReset`) waits for a handover's wait first.
///
/// # Safety
/// As the driver's `cuDevicePrimaryCtxReset_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxReset_v2(dev: CuDevice) -> CuResult {
    type F = unsafe extern "C" fn(CuDevice) -> CuResult;
    if drains() {
        protect((), || crate::state::DRAINER.quiesce());
    }
    call!(PRIMARY_CTX_RESET, F, dev)
}

/// What `cuGetProcAddress("cuCtxCreate")` hands out from CUDA 11.4 on (the real 535 libcuda
/// answers `cuCtxCreate_v3` at 11040, 12000 and 12020): contexts with execution affinity.
///
/// # Safety
/// As the driver's `cuCtxCreate_v3`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v3(
    ctx: *mut Handle,
    params: *mut c_void,
    num_params: c_int,
    flags: c_uint,
    dev: CuDevice,
) -> CuResult {
    type F = unsafe extern "C" fn(*mut Handle, *mut c_void, c_int, c_uint, CuDevice) -> CuResult;
    let r = with_discovery(hook(), || call!(CTX_CREATE_V3, F, ctx, params, num_params, flags, dev));
    created(r, ctx);
    r
}
