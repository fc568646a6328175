//! Memory hooks: allocations, frees, pools, VMM and arrays are counted; the card reports the share.

use std::ffi::{c_int, c_uint, c_ulonglong, c_void};

use crate::ffi::{
    Array3dDescriptor, ArrayDescriptor, CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS, CuDevice, CuDevicePtr, CuMemHandle,
    CuResult, Handle, array_bytes,
};
use crate::state::{Hook, Kind, hook, protect};

reals! {
    pub(super) MEM_ALLOC = c"cuMemAlloc_v2";
    pub(super) MEM_ALLOC_PITCH = c"cuMemAllocPitch_v2";
    pub(super) MEM_ALLOC_MANAGED = c"cuMemAllocManaged";
    pub(super) MEM_ALLOC_ASYNC = c"cuMemAllocAsync";
    pub(super) MEM_ALLOC_ASYNC_PTSZ = c"cuMemAllocAsync_ptsz";
    pub(super) MEM_ALLOC_POOL = c"cuMemAllocFromPoolAsync";
    pub(super) MEM_ALLOC_POOL_PTSZ = c"cuMemAllocFromPoolAsync_ptsz";
    pub(super) MEM_FREE = c"cuMemFree_v2";
    pub(super) MEM_FREE_ASYNC = c"cuMemFreeAsync";
    pub(super) MEM_FREE_ASYNC_PTSZ = c"cuMemFreeAsync_ptsz";
    pub(super) MEM_CREATE = c"cuMemCreate";
    pub(super) MEM_RELEASE = c"cuMemRelease";
    pub(super) MEM_MAP = c"cuMemMap";
    pub(super) MEM_UNMAP = c"cuMemUnmap";
    pub(super) ARRAY_CREATE = c"cuArrayCreate_v2";
    pub(super) ARRAY_3D_CREATE = c"cuArray3DCreate_v2";
    pub(super) ARRAY_DESTROY = c"cuArrayDestroy";
    pub(super) MEM_GET_INFO = c"cuMemGetInfo_v2";
    pub(super) DEVICE_TOTAL_MEM = c"cuDeviceTotalMem_v2";
    pub(super) MEM_POOL_TRIM = c"cuMemPoolTrimTo";
    pub(super) MEM_POOL_DESTROY = c"cuMemPoolDestroy";
    // Not hooked: what the hook asks the driver.
    CTX_GET_DEVICE = c"cuCtxGetDevice";
    DEVICE_GET_MEM_POOL = c"cuDeviceGetMemPool";
    MEM_POOL_GET_ATTRIBUTE = c"cuMemPoolGetAttribute";
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
