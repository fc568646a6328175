//! The intercepted driver entry points. Each is exported under the driver's own (versioned)
//! name, so programs linked against libcuda reach it; [`dlsym`] and `cuGetProcAddress` hand it
//! out to programs that look the driver up at run time (the CUDA runtime does both). A hook is
//! handed out only in place of the exact driver function it wraps (pointer equality), so a
//! legacy variant with another signature passes through untouched.

#![allow(non_snake_case)]

use std::ffi::{CStr, c_char, c_int, c_uint, c_ulonglong, c_void};
use std::sync::atomic::Ordering;

use crate::ffi::{
    Array3dDescriptor, ArrayDescriptor, CUDA_ERROR_NOT_FOUND, CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS, CuDevice,
    CuDevicePtr, CuLaunchConfig, CuMemHandle, CuResult, Handle, array_bytes,
};
use crate::real::Real;
use crate::state::{Hook, Kind, hook, protect};

/// Calls the driver's `$real` as `$ty`, or answers `CUDA_ERROR_NOT_FOUND` when the driver
/// lacks it.
macro_rules! call {
    ($real:expr, $ty:ty, $($arg:expr),*) => {{
        let p = $real.get();
        if p.is_null() {
            CUDA_ERROR_NOT_FOUND
        } else {
            // SAFETY: `p` is the driver's function of that name, whose C signature is `$ty`.
            let f: $ty = unsafe { std::mem::transmute::<*mut c_void, $ty>(p) };
            // SAFETY: the arguments are the caller's, passed through unchanged.
            unsafe { f($($arg),*) }
        }
    }};
}

macro_rules! reals {
    ($($id:ident = $name:literal;)*) => {
        $(static $id: Real = Real::new($name);)*
    };
}

reals! {
    GET_PROC_ADDRESS = c"cuGetProcAddress";
    GET_PROC_ADDRESS_V2 = c"cuGetProcAddress_v2";
    MEM_ALLOC = c"cuMemAlloc_v2";
    MEM_ALLOC_PITCH = c"cuMemAllocPitch_v2";
    MEM_ALLOC_MANAGED = c"cuMemAllocManaged";
    MEM_ALLOC_ASYNC = c"cuMemAllocAsync";
    MEM_ALLOC_ASYNC_PTSZ = c"cuMemAllocAsync_ptsz";
    MEM_ALLOC_POOL = c"cuMemAllocFromPoolAsync";
    MEM_ALLOC_POOL_PTSZ = c"cuMemAllocFromPoolAsync_ptsz";
    MEM_FREE = c"cuMemFree_v2";
    MEM_FREE_ASYNC = c"cuMemFreeAsync";
    MEM_FREE_ASYNC_PTSZ = c"cuMemFreeAsync_ptsz";
    MEM_CREATE = c"cuMemCreate";
    MEM_RELEASE = c"cuMemRelease";
    MEM_MAP = c"cuMemMap";
    MEM_UNMAP = c"cuMemUnmap";
    ARRAY_CREATE = c"cuArrayCreate_v2";
    ARRAY_3D_CREATE = c"cuArray3DCreate_v2";
    ARRAY_DESTROY = c"cuArrayDestroy";
    MEM_GET_INFO = c"cuMemGetInfo_v2";
    DEVICE_TOTAL_MEM = c"cuDeviceTotalMem_v2";
    LAUNCH_KERNEL = c"cuLaunchKernel";
    LAUNCH_KERNEL_PTSZ = c"cuLaunchKernel_ptsz";
    LAUNCH_KERNEL_EX = c"cuLaunchKernelEx";
    LAUNCH_KERNEL_EX_PTSZ = c"cuLaunchKernelEx_ptsz";
    LAUNCH_COOPERATIVE = c"cuLaunchCooperativeKernel";
    LAUNCH_COOPERATIVE_PTSZ = c"cuLaunchCooperativeKernel_ptsz";
    GRAPH_LAUNCH = c"cuGraphLaunch";
    GRAPH_LAUNCH_PTSZ = c"cuGraphLaunch_ptsz";
    PRIMARY_CTX_RETAIN = c"cuDevicePrimaryCtxRetain";
    CTX_CREATE = c"cuCtxCreate_v2";
    CTX_CREATE_V3 = c"cuCtxCreate_v3";
    MEM_POOL_TRIM = c"cuMemPoolTrimTo";
    MEM_POOL_DESTROY = c"cuMemPoolDestroy";
    // Not hooked: what the hook asks the driver.
    CTX_GET_DEVICE = c"cuCtxGetDevice";
    DEVICE_GET_MEM_POOL = c"cuDeviceGetMemPool";
    MEM_POOL_GET_ATTRIBUTE = c"cuMemPoolGetAttribute";
}

/// Every hook: the driver function it replaces and its own address.
fn table() -> [(&'static Real, usize); 34] {
    [
        (&GET_PROC_ADDRESS, cuGetProcAddress as *const () as usize),
        (&GET_PROC_ADDRESS_V2, cuGetProcAddress_v2 as *const () as usize),
        (&MEM_ALLOC, cuMemAlloc_v2 as *const () as usize),
        (&MEM_ALLOC_PITCH, cuMemAllocPitch_v2 as *const () as usize),
        (&MEM_ALLOC_MANAGED, cuMemAllocManaged as *const () as usize),
        (&MEM_ALLOC_ASYNC, cuMemAllocAsync as *const () as usize),
        (&MEM_ALLOC_ASYNC_PTSZ, cuMemAllocAsync_ptsz as *const () as usize),
        (&MEM_ALLOC_POOL, cuMemAllocFromPoolAsync as *const () as usize),
        (&MEM_ALLOC_POOL_PTSZ, cuMemAllocFromPoolAsync_ptsz as *const () as usize),
        (&MEM_FREE, cuMemFree_v2 as *const () as usize),
        (&MEM_FREE_ASYNC, cuMemFreeAsync as *const () as usize),
        (&MEM_FREE_ASYNC_PTSZ, cuMemFreeAsync_ptsz as *const () as usize),
        (&MEM_CREATE, cuMemCreate as *const () as usize),
        (&MEM_RELEASE, cuMemRelease as *const () as usize),
        (&MEM_MAP, cuMemMap as *const () as usize),
        (&MEM_UNMAP, cuMemUnmap as *const () as usize),
        (&ARRAY_CREATE, cuArrayCreate_v2 as *const () as usize),
        (&ARRAY_3D_CREATE, cuArray3DCreate_v2 as *const () as usize),
        (&ARRAY_DESTROY, cuArrayDestroy as *const () as usize),
        (&MEM_GET_INFO, cuMemGetInfo_v2 as *const () as usize),
        (&DEVICE_TOTAL_MEM, cuDeviceTotalMem_v2 as *const () as usize),
        (&LAUNCH_KERNEL, cuLaunchKernel as *const () as usize),
        (&LAUNCH_KERNEL_PTSZ, cuLaunchKernel_ptsz as *const () as usize),
        (&LAUNCH_KERNEL_EX, cuLaunchKernelEx as *const () as usize),
        (&LAUNCH_KERNEL_EX_PTSZ, cuLaunchKernelEx_ptsz as *const () as usize),
        (&LAUNCH_COOPERATIVE, cuLaunchCooperativeKernel as *const () as usize),
        (
            &LAUNCH_COOPERATIVE_PTSZ,
            cuLaunchCooperativeKernel_ptsz as *const () as usize,
        ),
        (&GRAPH_LAUNCH, cuGraphLaunch as *const () as usize),
        (&GRAPH_LAUNCH_PTSZ, cuGraphLaunch_ptsz as *const () as usize),
        (&PRIMARY_CTX_RETAIN, cuDevicePrimaryCtxRetain as *const () as usize),
        (&CTX_CREATE, cuCtxCreate_v2 as *const () as usize),
        (&CTX_CREATE_V3, cuCtxCreate_v3 as *const () as usize),
        (&MEM_POOL_TRIM, cuMemPoolTrimTo as *const () as usize),
        (&MEM_POOL_DESTROY, cuMemPoolDestroy as *const () as usize),
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

/// Admission before an allocation of `bytes`: `Err(OOM)` past the container's limit. A
/// refusal is checked once more after the pools' charges and the process's overhead are
/// brought up to date (a pool gives memory back at synchronisations the hook does not see).
fn admit(h: Option<&'static Hook>, bytes: u64) -> Result<(), CuResult> {
    match h {
        Some(h)
            if !protect(true, || {
                h.admit(bytes) || ((pools_gave_back(h) | h.reconcile()) && h.admit(bytes))
            }) =>
        {
            Err(CUDA_ERROR_OUT_OF_MEMORY)
        }
        _ => Ok(()),
    }
}

/// `CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`: what a pool holds of the card.
const POOL_ATTR_RESERVED_MEM_CURRENT: c_int = 5;

/// What `pool` holds now, as the driver says.
fn pool_reserved(pool: u64) -> Option<u64> {
    type F = unsafe extern "C" fn(Handle, c_int, *mut c_void) -> CuResult;
    let mut v: u64 = 0;
    let r = call!(
        MEM_POOL_GET_ATTRIBUTE,
        F,
        pool as Handle,
        POOL_ATTR_RESERVED_MEM_CURRENT,
        (&raw mut v).cast::<c_void>()
    );
    (r == CUDA_SUCCESS).then_some(v)
}

/// Charges this process's pools what they hold now: whether any gave memory back.
fn pools_gave_back(h: &Hook) -> bool {
    let readings: Vec<(u64, u64)> = h
        .pools()
        .into_iter()
        .filter_map(|p| pool_reserved(p).map(|r| (p, r)))
        .collect();
    !readings.is_empty() && h.pools_hold(&readings)
}

/// The current context's device's current pool (what `cuMemAllocAsync` allocates from).
fn current_pool() -> Option<u64> {
    type GetDevice = unsafe extern "C" fn(*mut CuDevice) -> CuResult;
    type GetPool = unsafe extern "C" fn(*mut Handle, CuDevice) -> CuResult;
    let mut dev: CuDevice = 0;
    if call!(CTX_GET_DEVICE, GetDevice, &raw mut dev) != CUDA_SUCCESS {
        return None;
    }
    let mut pool: Handle = std::ptr::null_mut();
    (call!(DEVICE_GET_MEM_POOL, GetPool, &raw mut pool, dev) == CUDA_SUCCESS && !pool.is_null()).then_some(pool as u64)
}

/// A stream-ordered allocation from `pool` (`None`: counted as a plain one).
fn alloc_from_pool(dptr: *mut CuDevicePtr, bytes: u64, pool: Option<u64>, make: impl FnOnce() -> CuResult) -> CuResult {
    let (Some(h), Some(pool)) = (hook(), pool) else {
        return alloc_ptr(dptr, bytes, make);
    };
    let admitted = protect(Some(0), || {
        h.pool_admit(pool, bytes)
            .or_else(|| pools_gave_back(h).then(|| h.pool_admit(pool, bytes)).flatten())
    });
    let Some(admitted) = admitted else {
        return CUDA_ERROR_OUT_OF_MEMORY;
    };
    let r = make();
    protect((), || {
        if r == CUDA_SUCCESS && !dptr.is_null() {
            // SAFETY: on success the driver wrote the pointer.
            let ptr = unsafe { *dptr };
            h.pool_made(pool, ptr, bytes, admitted, pool_reserved(pool));
        } else if admitted > 0 {
            h.unadmit(admitted);
        }
    });
    r
}

/// After the driver answered an admitted allocation: recorded, or the admission given back.
fn settle(h: Option<&'static Hook>, r: CuResult, bytes: u64, kind: Kind, id: impl FnOnce() -> u64) {
    if let Some(h) = h {
        protect((), || {
            if r == CUDA_SUCCESS {
                h.record(kind, id(), bytes);
            } else {
                h.unadmit(bytes);
            }
        });
    }
}

fn freed(kind: Kind, id: u64, r: CuResult) {
    if r == CUDA_SUCCESS
        && let Some(h) = hook()
    {
        protect((), || h.forget(kind, id));
    }
}

/// An allocation writing a device pointer: admitted, made, recorded.
fn alloc_ptr(dptr: *mut CuDevicePtr, bytes: u64, make: impl FnOnce() -> CuResult) -> CuResult {
    let h = hook();
    if let Err(e) = admit(h, bytes) {
        return e;
    }
    let r = make();
    // SAFETY: on success the driver wrote the pointer.
    settle(h, r, bytes, Kind::Ptr, || {
        if dptr.is_null() { 0 } else { unsafe { *dptr } }
    });
    r
}

/// # Safety
/// As the driver's `cuMemAlloc_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CuDevicePtr, bytes: usize) -> CuResult {
    type F = unsafe extern "C" fn(*mut CuDevicePtr, usize) -> CuResult;
    alloc_ptr(dptr, bytes as u64, || call!(MEM_ALLOC, F, dptr, bytes))
}

/// # Safety
/// As the driver's `cuMemAllocManaged`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocManaged(dptr: *mut CuDevicePtr, bytes: usize, flags: c_uint) -> CuResult {
    type F = unsafe extern "C" fn(*mut CuDevicePtr, usize, c_uint) -> CuResult;
    alloc_ptr(dptr, bytes as u64, || call!(MEM_ALLOC_MANAGED, F, dptr, bytes, flags))
}

/// # Safety
/// As the driver's `cuMemAllocPitch_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut CuDevicePtr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    element: c_uint,
) -> CuResult {
    type F = unsafe extern "C" fn(*mut CuDevicePtr, *mut usize, usize, usize, c_uint) -> CuResult;
    let h = hook();
    // The pitch is the driver's to choose: admit the unpadded size, then settle on the real one.
    let estimate = (width as u64).saturating_mul(height as u64);
    if let Err(e) = admit(h, estimate) {
        return e;
    }
    let r = call!(MEM_ALLOC_PITCH, F, dptr, pitch, width, height, element);
    let actual = if r == CUDA_SUCCESS && !pitch.is_null() {
        // SAFETY: the driver wrote the pitch.
        (unsafe { *pitch } as u64).saturating_mul(height as u64)
    } else {
        estimate
    };
    if let Some(h) = h
        && r == CUDA_SUCCESS
        && actual > estimate
    {
        // Padding is the driver's; counted, never refused.
        protect((), || {
            if !h.admit(actual - estimate) {
                h.force(actual - estimate)
            }
        });
    }
    // SAFETY: on success the driver wrote the pointer.
    settle(h, r, actual.max(estimate), Kind::Ptr, || {
        if dptr.is_null() { 0 } else { unsafe { *dptr } }
    });
    r
}

macro_rules! async_alloc {
    ($name:ident, $real:ident) => {
        /// # Safety
        /// As the driver's function of this name.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(dptr: *mut CuDevicePtr, bytes: usize, stream: Handle) -> CuResult {
            type F = unsafe extern "C" fn(*mut CuDevicePtr, usize, Handle) -> CuResult;
            let pool = hook().and_then(|_| protect(None, current_pool));
            alloc_from_pool(dptr, bytes as u64, pool, || call!($real, F, dptr, bytes, stream))
        }
    };
}
async_alloc!(cuMemAllocAsync, MEM_ALLOC_ASYNC);
async_alloc!(cuMemAllocAsync_ptsz, MEM_ALLOC_ASYNC_PTSZ);

macro_rules! pool_alloc {
    ($name:ident, $real:ident) => {
        /// # Safety
        /// As the driver's function of this name.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(dptr: *mut CuDevicePtr, bytes: usize, pool: Handle, stream: Handle) -> CuResult {
            type F = unsafe extern "C" fn(*mut CuDevicePtr, usize, Handle, Handle) -> CuResult;
            let from = (!pool.is_null()).then_some(pool as u64);
            alloc_from_pool(dptr, bytes as u64, from, || {
                call!($real, F, dptr, bytes, pool, stream)
            })
        }
    };
}
pool_alloc!(cuMemAllocFromPoolAsync, MEM_ALLOC_POOL);
pool_alloc!(cuMemAllocFromPoolAsync_ptsz, MEM_ALLOC_POOL_PTSZ);

/// # Safety
/// As the driver's `cuMemFree_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFree_v2(dptr: CuDevicePtr) -> CuResult {
    type F = unsafe extern "C" fn(CuDevicePtr) -> CuResult;
    let r = call!(MEM_FREE, F, dptr);
    freed_ptr(dptr, r);
    r
}

/// A freed device pointer: a pool's goes back to the pool, which keeps its memory charged.
fn freed_ptr(dptr: CuDevicePtr, r: CuResult) {
    if r == CUDA_SUCCESS
        && let Some(h) = hook()
        && !protect(false, || h.pool_freed(dptr))
    {
        freed(Kind::Ptr, dptr, r);
    }
}

macro_rules! async_free {
    ($name:ident, $real:ident) => {
        /// # Safety
        /// As the driver's function of this name.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(dptr: CuDevicePtr, stream: Handle) -> CuResult {
            type F = unsafe extern "C" fn(CuDevicePtr, Handle) -> CuResult;
            let r = call!($real, F, dptr, stream);
            freed_ptr(dptr, r);
            r
        }
    };
}
async_free!(cuMemFreeAsync, MEM_FREE_ASYNC);
async_free!(cuMemFreeAsync_ptsz, MEM_FREE_ASYNC_PTSZ);

/// A trimmed pool holds less: its charge follows.
///
/// # Safety
/// As the driver's `cuMemPoolTrimTo`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolTrimTo(pool: Handle, keep: usize) -> CuResult {
    type F = unsafe extern "C" fn(Handle, usize) -> CuResult;
    let r = call!(MEM_POOL_TRIM, F, pool, keep);
    if r == CUDA_SUCCESS
        && let Some(h) = hook()
        && let Some(held) = pool_reserved(pool as u64)
    {
        protect(false, || h.pools_hold(&[(pool as u64, held)]));
    }
    r
}

/// # Safety
/// As the driver's `cuMemPoolDestroy`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolDestroy(pool: Handle) -> CuResult {
    type F = unsafe extern "C" fn(Handle) -> CuResult;
    let r = call!(MEM_POOL_DESTROY, F, pool);
    if r == CUDA_SUCCESS
        && let Some(h) = hook()
    {
        protect((), || h.pool_destroyed(pool as u64));
    }
    r
}

/// # Safety
/// As the driver's `cuMemCreate` (virtual memory management: the physical allocation).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut CuMemHandle,
    bytes: usize,
    prop: *const c_void,
    flags: c_ulonglong,
) -> CuResult {
    type F = unsafe extern "C" fn(*mut CuMemHandle, usize, *const c_void, c_ulonglong) -> CuResult;
    let h = hook();
    if let Err(e) = admit(h, bytes as u64) {
        return e;
    }
    let r = call!(MEM_CREATE, F, handle, bytes, prop, flags);
    // SAFETY: on success the driver wrote the handle.
    settle(h, r, bytes as u64, Kind::Vmm, || {
        if handle.is_null() { 0 } else { unsafe { *handle } }
    });
    r
}

/// The driver frees a released handle's memory only when its last mapping goes (ggml-cuda
/// releases right after mapping): until then it stays counted.
///
/// # Safety
/// As the driver's `cuMemRelease`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRelease(handle: CuMemHandle) -> CuResult {
    type F = unsafe extern "C" fn(CuMemHandle) -> CuResult;
    let r = call!(MEM_RELEASE, F, handle);
    if r == CUDA_SUCCESS
        && let Some(h) = hook()
        && protect(true, || h.vmm_released(handle))
    {
        freed(Kind::Vmm, handle, r);
    }
    r
}

/// # Safety
/// As the driver's `cuMemMap`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemMap(
    ptr: CuDevicePtr,
    size: usize,
    offset: usize,
    handle: CuMemHandle,
    flags: c_ulonglong,
) -> CuResult {
    type F = unsafe extern "C" fn(CuDevicePtr, usize, usize, CuMemHandle, c_ulonglong) -> CuResult;
    let r = call!(MEM_MAP, F, ptr, size, offset, handle, flags);
    if r == CUDA_SUCCESS
        && let Some(h) = hook()
    {
        protect((), || h.vmm_mapped(ptr, size as u64, handle));
    }
    r
}

/// # Safety
/// As the driver's `cuMemUnmap`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemUnmap(ptr: CuDevicePtr, size: usize) -> CuResult {
    type F = unsafe extern "C" fn(CuDevicePtr, usize) -> CuResult;
    let r = call!(MEM_UNMAP, F, ptr, size);
    if r == CUDA_SUCCESS
        && let Some(h) = hook()
    {
        for handle in protect(Vec::new(), || h.vmm_unmapped(ptr, size as u64)) {
            freed(Kind::Vmm, handle, r);
        }
    }
    r
}

fn alloc_array(array: *mut Handle, bytes: u64, make: impl FnOnce() -> CuResult) -> CuResult {
    let h = hook();
    if let Err(e) = admit(h, bytes) {
        return e;
    }
    let r = make();
    // SAFETY: on success the driver wrote the array handle.
    settle(h, r, bytes, Kind::Array, || {
        if array.is_null() { 0 } else { unsafe { *array as u64 } }
    });
    r
}

/// # Safety
/// As the driver's `cuArrayCreate_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayCreate_v2(array: *mut Handle, desc: *const ArrayDescriptor) -> CuResult {
    type F = unsafe extern "C" fn(*mut Handle, *const ArrayDescriptor) -> CuResult;
    // SAFETY: a non-null descriptor is the caller's valid struct.
    let bytes = unsafe { desc.as_ref() }.map_or(0, |d| array_bytes(d.width, d.height, 0, d.format, d.num_channels));
    alloc_array(array, bytes, || call!(ARRAY_CREATE, F, array, desc))
}

/// # Safety
/// As the driver's `cuArray3DCreate_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArray3DCreate_v2(array: *mut Handle, desc: *const Array3dDescriptor) -> CuResult {
    type F = unsafe extern "C" fn(*mut Handle, *const Array3dDescriptor) -> CuResult;
    // SAFETY: as above.
    let bytes =
        unsafe { desc.as_ref() }.map_or(0, |d| array_bytes(d.width, d.height, d.depth, d.format, d.num_channels));
    alloc_array(array, bytes, || call!(ARRAY_3D_CREATE, F, array, desc))
}

/// # Safety
/// As the driver's `cuArrayDestroy`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayDestroy(array: Handle) -> CuResult {
    type F = unsafe extern "C" fn(Handle) -> CuResult;
    let r = call!(ARRAY_DESTROY, F, array);
    freed(Kind::Array, array as u64, r);
    r
}

/// The share as the container's total, and what is left of it as free.
///
/// # Safety
/// As the driver's `cuMemGetInfo_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CuResult {
    type F = unsafe extern "C" fn(*mut usize, *mut usize) -> CuResult;
    if let Some(h) = hook() {
        protect(false, || pools_gave_back(h) | h.reconcile());
    }
    let r = call!(MEM_GET_INFO, F, free, total);
    if r == CUDA_SUCCESS
        && !free.is_null()
        && !total.is_null()
        && let Some((used, limit)) = hook().and_then(|h| protect(None, || h.memory()))
    {
        // SAFETY: the driver filled both.
        unsafe {
            *total = (*total).min(limit as usize);
            *free = (*free).min(limit.saturating_sub(used) as usize);
        }
    }
    r
}

/// # Safety
/// As the driver's `cuDeviceTotalMem_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CuDevice) -> CuResult {
    type F = unsafe extern "C" fn(*mut usize, CuDevice) -> CuResult;
    let r = call!(DEVICE_TOTAL_MEM, F, bytes, dev);
    if r == CUDA_SUCCESS
        && !bytes.is_null()
        && let Some((_, limit)) = hook().and_then(|h| protect(None, || h.memory()))
    {
        // SAFETY: the driver filled it.
        unsafe { *bytes = (*bytes).min(limit as usize) };
    }
    r
}

fn throttle(cost: u64) {
    if let Some(h) = hook() {
        protect((), || {
            // A running mean of kernel costs (a graph launch is charged one mean launch).
            let m = h.mean_cost.load(Ordering::Relaxed);
            h.mean_cost.store((m * 15 + cost) / 16, Ordering::Relaxed);
            h.throttle(cost);
        });
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
            throttle(blocks(gx, gy, gz));
            call!($real, F, f, gx, gy, gz, bx, by, bz, shared, stream, params, extra)
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
            if let Some(c) = unsafe { config.as_ref() } {
                throttle(blocks(c.grid_dim_x, c.grid_dim_y, c.grid_dim_z));
            }
            call!($real, F, config, f, params, extra)
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
            throttle(blocks(gx, gy, gz));
            call!($real, F, f, gx, gy, gz, bx, by, bz, shared, stream, params)
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
            if let Some(h) = hook() {
                throttle(h.mean_cost.load(Ordering::Relaxed));
            }
            call!($real, F, exec, stream)
        }
    };
}
graph_launch!(cuGraphLaunch, GRAPH_LAUNCH);
graph_launch!(cuGraphLaunch_ptsz, GRAPH_LAUNCH_PTSZ);

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
    with_discovery(hook(), || call!(CTX_CREATE, F, ctx, flags, dev))
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
    with_discovery(hook(), || call!(CTX_CREATE_V3, F, ctx, params, num_params, flags, dev))
}
