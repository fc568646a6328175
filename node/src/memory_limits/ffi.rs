//! NVML's per-cgroup memory limit calls, as NVIDIA's `nvml.h` (CUDA 13.4+) declares them; a
//! test compiles the header and checks these layouts against it.

use std::os::raw::{c_char, c_uint};

/// `nvmlReturn_t`.
pub type NvmlReturn = c_uint;
/// `nvmlDevice_t` (an opaque pointer).
pub type NvmlDevice = *mut std::ffi::c_void;

/// `NVML_SUCCESS`.
pub const NVML_SUCCESS: NvmlReturn = 0;
/// `NVML_ERROR_NOT_FOUND`.
pub const NVML_ERROR_NOT_FOUND: NvmlReturn = 6;
/// `NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE`.
pub const DRIVER_VERSION_BUFFER_SIZE: usize = 80;

/// `nvmlSetMemoryLimits_v1_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct SetMemoryLimitsV1 {
    /// `nameSpace`: the full sysfs path of the cgroup.
    pub name_space: *const c_char,
    /// `softLimit`, bytes.
    pub soft_limit: u64,
    /// `hardLimit`, bytes.
    pub hard_limit: u64,
}

/// `nvmlGetMemoryLimits_v1_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct GetMemoryLimitsV1 {
    /// `nameSpace` (in).
    pub name_space: *const c_char,
    /// `softLimit` (out), bytes.
    pub soft_limit: u64,
    /// `hardLimit` (out), bytes.
    pub hard_limit: u64,
    /// `currentUsed` (out), bytes.
    pub current_used: u64,
}

/// `nvmlInit_v2`.
pub type InitV2 = unsafe extern "C" fn() -> NvmlReturn;
/// `nvmlErrorString`.
pub type ErrorString = unsafe extern "C" fn(NvmlReturn) -> *const c_char;
/// `nvmlSystemGetDriverVersion`.
pub type SystemGetDriverVersion = unsafe extern "C" fn(*mut c_char, c_uint) -> NvmlReturn;
/// `nvmlDeviceGetHandleByUUID`.
pub type DeviceGetHandleByUuid = unsafe extern "C" fn(*const c_char, *mut NvmlDevice) -> NvmlReturn;
/// `nvmlDeviceSetMemoryLimits_v1`.
pub type DeviceSetMemoryLimitsV1 = unsafe extern "C" fn(NvmlDevice, *mut SetMemoryLimitsV1) -> NvmlReturn;
/// `nvmlDeviceGetMemoryLimits_v1`.
pub type DeviceGetMemoryLimitsV1 = unsafe extern "C" fn(NvmlDevice, *mut GetMemoryLimitsV1) -> NvmlReturn;

/// The symbols Tessera calls, by their names in `libnvidia-ml.so.1`.
pub const SYMBOLS: &[&str] = &[
    "nvmlInit_v2",
    "nvmlErrorString",
    "nvmlSystemGetDriverVersion",
    "nvmlDeviceGetHandleByUUID",
    "nvmlDeviceSetMemoryLimits_v1",
    "nvmlDeviceGetMemoryLimits_v1",
];
