//! The intercepted driver entry points. Each is exported under the driver's own (versioned)
//! name, so programs linked against libcuda reach it; [`dlsym`] and `cuGetProcAddress` hand it
//! out to programs that look the driver up at run time (the CUDA runtime does both). A hook is
//! handed out only in place of the exact driver function it wraps (pointer equality), so a
//! legacy variant with another signature passes through untouched.
//!
//! This module holds that lookup path; the hooks themselves live by API family: `memory`
//! (allocations, frees, pools, VMM, arrays, and what the process is told of the card's memory),
//! `launch` (kernel and graph launches), `context` (context creation and teardown) and
//! `capture` (stream captures, where processes take turns).

#![allow(non_snake_case)]

use std::ffi::{CStr, c_char, c_int, c_ulonglong, c_void};

use crate::ffi::{CUDA_SUCCESS, CuResult};
use crate::real::Real;
use crate::state::protect;

mod capture;
mod context;
mod launch;
mod memory;

reals! {
    GET_PROC_ADDRESS = c"cuGetProcAddress";
    GET_PROC_ADDRESS_V2 = c"cuGetProcAddress_v2";
}

/// Every hook: the driver function it replaces and its own address.
fn table() -> [(&'static Real, usize); 45] {
    [
        (&GET_PROC_ADDRESS, cuGetProcAddress as *const () as usize),
        (&GET_PROC_ADDRESS_V2, cuGetProcAddress_v2 as *const () as usize),
        (&memory::MEM_ALLOC, memory::cuMemAlloc_v2 as *const () as usize),
        (
            &memory::MEM_ALLOC_PITCH,
            memory::cuMemAllocPitch_v2 as *const () as usize,
        ),
        (
            &memory::MEM_ALLOC_MANAGED,
            memory::cuMemAllocManaged as *const () as usize,
        ),
        (&memory::MEM_ALLOC_ASYNC, memory::cuMemAllocAsync as *const () as usize),
        (
            &memory::MEM_ALLOC_ASYNC_PTSZ,
            memory::cuMemAllocAsync_ptsz as *const () as usize,
        ),
        (
            &memory::MEM_ALLOC_POOL,
            memory::cuMemAllocFromPoolAsync as *const () as usize,
        ),
        (
            &memory::MEM_ALLOC_POOL_PTSZ,
            memory::cuMemAllocFromPoolAsync_ptsz as *const () as usize,
        ),
        (&memory::MEM_FREE, memory::cuMemFree_v2 as *const () as usize),
        (&memory::MEM_FREE_ASYNC, memory::cuMemFreeAsync as *const () as usize),
        (
            &memory::MEM_FREE_ASYNC_PTSZ,
            memory::cuMemFreeAsync_ptsz as *const () as usize,
        ),
        (&memory::MEM_CREATE, memory::cuMemCreate as *const () as usize),
        (&memory::MEM_RELEASE, memory::cuMemRelease as *const () as usize),
        (&memory::MEM_MAP, memory::cuMemMap as *const () as usize),
        (&memory::MEM_UNMAP, memory::cuMemUnmap as *const () as usize),
        (&memory::ARRAY_CREATE, memory::cuArrayCreate_v2 as *const () as usize),
        (
            &memory::ARRAY_3D_CREATE,
            memory::cuArray3DCreate_v2 as *const () as usize,
        ),
        (&memory::ARRAY_DESTROY, memory::cuArrayDestroy as *const () as usize),
        (&memory::MEM_GET_INFO, memory::cuMemGetInfo_v2 as *const () as usize),
        (
            &memory::DEVICE_TOTAL_MEM,
            memory::cuDeviceTotalMem_v2 as *const () as usize,
        ),
        (&launch::LAUNCH_KERNEL, launch::cuLaunchKernel as *const () as usize),
        (
            &launch::LAUNCH_KERNEL_PTSZ,
            launch::cuLaunchKernel_ptsz as *const () as usize,
        ),
        (
            &launch::LAUNCH_KERNEL_EX,
            launch::cuLaunchKernelEx as *const () as usize,
        ),
        (
            &launch::LAUNCH_KERNEL_EX_PTSZ,
            launch::cuLaunchKernelEx_ptsz as *const () as usize,
        ),
        (
            &launch::LAUNCH_COOPERATIVE,
            launch::cuLaunchCooperativeKernel as *const () as usize,
        ),
        (
            &launch::LAUNCH_COOPERATIVE_PTSZ,
            launch::cuLaunchCooperativeKernel_ptsz as *const () as usize,
        ),
        (&launch::GRAPH_LAUNCH, launch::cuGraphLaunch as *const () as usize),
        (
            &launch::GRAPH_LAUNCH_PTSZ,
            launch::cuGraphLaunch_ptsz as *const () as usize,
        ),
        (
            &context::PRIMARY_CTX_RETAIN,
            context::cuDevicePrimaryCtxRetain as *const () as usize,
        ),
        (&context::CTX_CREATE, context::cuCtxCreate_v2 as *const () as usize),
        (&context::CTX_CREATE_V3, context::cuCtxCreate_v3 as *const () as usize),
        (&context::CTX_DESTROY, context::cuCtxDestroy_v2 as *const () as usize),
        (
            &context::PRIMARY_CTX_RELEASE,
            context::cuDevicePrimaryCtxRelease_v2 as *const () as usize,
        ),
        (
            &context::PRIMARY_CTX_RESET,
            context::cuDevicePrimaryCtxReset_v2 as *const () as usize,
        ),
        (&capture::BEGIN, capture::cuStreamBeginCapture as *const () as usize),
        (
            &capture::BEGIN_PTSZ,
            capture::cuStreamBeginCapture_ptsz as *const () as usize,
        ),
        (
            &capture::BEGIN_V2,
            capture::cuStreamBeginCapture_v2 as *const () as usize,
        ),
        (
            &capture::BEGIN_V2_PTSZ,
            capture::cuStreamBeginCapture_v2_ptsz as *const () as usize,
        ),
        (
            &capture::BEGIN_TO_GRAPH,
            capture::cuStreamBeginCaptureToGraph as *const () as usize,
        ),
        (
            &capture::BEGIN_TO_GRAPH_PTSZ,
            capture::cuStreamBeginCaptureToGraph_ptsz as *const () as usize,
        ),
        (&capture::END, capture::cuStreamEndCapture as *const () as usize),
        (
            &capture::END_PTSZ,
            capture::cuStreamEndCapture_ptsz as *const () as usize,
        ),
        (&memory::MEM_POOL_TRIM, memory::cuMemPoolTrimTo as *const () as usize),
        (
            &memory::MEM_POOL_DESTROY,
            memory::cuMemPoolDestroy as *const () as usize,
        ),
    ]
}

/// The hook for driver function `p`, or `p` itself. Only consulted once libcuda is loaded, so
/// a process without CUDA never loads it here.
fn substitute(p: *mut c_void) -> *mut c_void {
    if p.is_null() || !crate::real::libcuda_loaded() {
        return p;
    }
    protect(p, || {
        table()
            .iter()
            .find(|(real, _)| real.get() == p)
            .map_or(p, |(_, hook)| *hook as *mut c_void)
    })
}

/// The runtime looks driver functions up with `dlsym`: the driver's own are swapped for hooks.
///
/// `dlsym(RTLD_NEXT, ...)` means "the next definition after the *caller's* object", which glibc
/// finds from the return address. An ordinary call from here would make this library the
/// caller: an interposer preloaded after it (LLVM OpenMP's `ompt_start_tool`, any
/// `dlsym(RTLD_NEXT)` wrapper) would get its own symbol back and loop. So the exported entry
/// is a bare jump: `RTLD_NEXT` lookups go to glibc's `dlsym` with the caller's return address
/// untouched (only the real `dlsym`'s address is fetched first, with the arguments saved);
/// every other lookup goes to `dlsym_hooked`.
///
/// # Safety
/// As `dlsym(3)`.
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    std::arch::naked_asm!(
        "cmp rdi, -1", // RTLD_NEXT is ((void *) -1)
        "jne {hooked}",
        "push rdi",
        "push rsi",
        "sub rsp, 8", // 16-byte alignment for the call
        "call {resolve}",
        "add rsp, 8",
        "pop rsi",
        "pop rdi",
        "test rax, rax",
        "jz 2f",
        "jmp rax", // glibc's dlsym returns straight to our caller
        "2:",
        "xor eax, eax",
        "ret",
        hooked = sym dlsym_hooked,
        resolve = sym real_dlsym_address,
    )
}

/// # Safety
/// As `dlsym(3)`; see the x86-64 variant.
#[cfg(target_arch = "aarch64")]
#[unsafe(naked)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    std::arch::naked_asm!(
        "cmn x0, #1", // RTLD_NEXT is ((void *) -1)
        "b.ne {hooked}",
        "stp x0, x1, [sp, #-32]!",
        "str x30, [sp, #16]",
        "bl {resolve}",
        "mov x16, x0",
        "ldr x30, [sp, #16]",
        "ldp x0, x1, [sp], #32",
        "cbz x16, 2f",
        "br x16", // glibc's dlsym returns straight to our caller (x30)
        "2:",
        "mov x0, #0",
        "ret",
        hooked = sym dlsym_hooked,
        resolve = sym real_dlsym_address,
    )
}

/// glibc's `dlsym`, as an address (0 when not found), for the bare entry above.
extern "C" fn real_dlsym_address() -> usize {
    crate::real::real_dlsym().map_or(0, |f| f as usize)
}

/// `dlsym` for every handle but `RTLD_NEXT`: glibc's answer, with the driver's functions
/// swapped for hooks.
///
/// # Safety
/// As `dlsym(3)`.
unsafe extern "C" fn dlsym_hooked(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    let Some(real) = crate::real::real_dlsym() else {
        return std::ptr::null_mut();
    };
    // SAFETY: the caller's arguments, passed to glibc's dlsym.
    let p = unsafe { real(handle, symbol) };
    // SAFETY: a non-null `symbol` is a C string (dlsym's contract).
    if p.is_null() || symbol.is_null() || !unsafe { CStr::from_ptr(symbol) }.to_bytes().starts_with(b"cu") {
        return p;
    }
    substitute(p)
}

/// # Safety
/// As the driver's `cuGetProcAddress`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: c_ulonglong,
) -> CuResult {
    type F = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, c_ulonglong) -> CuResult;
    let r = call!(GET_PROC_ADDRESS, F, symbol, pfn, version, flags);
    if r == CUDA_SUCCESS && !pfn.is_null() {
        // SAFETY: the driver filled `*pfn`.
        unsafe { *pfn = substitute(*pfn) };
    }
    r
}

/// # Safety
/// As the driver's `cuGetProcAddress_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: c_ulonglong,
    status: *mut c_int,
) -> CuResult {
    type F = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, c_ulonglong, *mut c_int) -> CuResult;
    let r = call!(GET_PROC_ADDRESS_V2, F, symbol, pfn, version, flags, status);
    if r == CUDA_SUCCESS && !pfn.is_null() {
        // SAFETY: the driver filled `*pfn`.
        unsafe { *pfn = substitute(*pfn) };
    }
    r
}
