//! The CUDA driver API types the hook touches, as `cuda.h` declares them (64-bit Linux).

use std::ffi::{c_uint, c_void};

/// `CUresult`.
pub type CuResult = i32;
/// `CUDA_SUCCESS`.
pub const CUDA_SUCCESS: CuResult = 0;
/// `CUDA_ERROR_INVALID_VALUE`.
pub const CUDA_ERROR_INVALID_VALUE: CuResult = 1;
/// `CUDA_ERROR_OUT_OF_MEMORY`.
pub const CUDA_ERROR_OUT_OF_MEMORY: CuResult = 2;
/// `CUDA_ERROR_NOT_FOUND`: what the hook answers when the driver lacks a function.
pub const CUDA_ERROR_NOT_FOUND: CuResult = 500;

/// `CUdeviceptr` (the `_v2` API's 64-bit form).
pub type CuDevicePtr = u64;
/// `CUdevice`.
pub type CuDevice = i32;
/// Opaque handles (`CUstream`, `CUfunction`, `CUarray`, `CUmemoryPool`, `CUgraphExec`, `CUcontext`).
pub type Handle = *mut c_void;
/// `CUmemGenericAllocationHandle`.
pub type CuMemHandle = u64;

/// `CUlaunchConfig` (`cuLaunchKernelEx`).
#[repr(C)]
pub struct CuLaunchConfig {
    /// Grid width in blocks.
    pub grid_dim_x: c_uint,
    /// Grid height.
    pub grid_dim_y: c_uint,
    /// Grid depth.
    pub grid_dim_z: c_uint,
    /// Block width.
    pub block_dim_x: c_uint,
    /// Block height.
    pub block_dim_y: c_uint,
    /// Block depth.
    pub block_dim_z: c_uint,
    /// Dynamic shared memory.
    pub shared_mem_bytes: c_uint,
    /// Stream.
    pub h_stream: Handle,
    /// Launch attributes.
    pub attrs: *mut c_void,
    /// Number of attributes.
    pub num_attrs: c_uint,
}

/// `CUDA_ARRAY_DESCRIPTOR`.
#[repr(C)]
pub struct ArrayDescriptor {
    /// Width in elements.
    pub width: usize,
    /// Height (0 for 1D).
    pub height: usize,
    /// `CUarray_format`.
    pub format: c_uint,
    /// Channels per element.
    pub num_channels: c_uint,
}

/// `CUDA_ARRAY3D_DESCRIPTOR`.
#[repr(C)]
pub struct Array3dDescriptor {
    /// Width in elements.
    pub width: usize,
    /// Height (0 for 1D).
    pub height: usize,
    /// Depth (0 for 1D/2D).
    pub depth: usize,
    /// `CUarray_format`.
    pub format: c_uint,
    /// Channels per element.
    pub num_channels: c_uint,
    /// Flags.
    pub flags: c_uint,
}

/// Bytes per channel of a `CUarray_format` (4 for formats the hook does not know: an
/// over-estimate, so a share never gets more than it asked).
pub fn format_bytes(format: c_uint) -> usize {
    match format {
        0x01 | 0x08 => 1,        // UNSIGNED_INT8, SIGNED_INT8
        0x02 | 0x09 | 0x10 => 2, // UNSIGNED_INT16, SIGNED_INT16, HALF
        0x03 | 0x0a | 0x20 => 4, // UNSIGNED_INT32, SIGNED_INT32, FLOAT
        _ => 4,
    }
}

/// Bytes an array of this shape holds (dimensions of 0 count as 1).
pub fn array_bytes(width: usize, height: usize, depth: usize, format: c_uint, channels: c_uint) -> u64 {
    [
        width,
        height.max(1),
        depth.max(1),
        channels.max(1) as usize,
        format_bytes(format),
    ]
    .iter()
    .fold(1u64, |acc, &d| acc.saturating_mul(d as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_match_cuda_h() {
        // Offsets as cuda.h lays the structs out on 64-bit Linux.
        assert_eq!(std::mem::size_of::<CuLaunchConfig>(), 56);
        assert_eq!(std::mem::offset_of!(CuLaunchConfig, h_stream), 32);
        assert_eq!(std::mem::size_of::<ArrayDescriptor>(), 24);
        assert_eq!(std::mem::size_of::<Array3dDescriptor>(), 40);
        assert_eq!(std::mem::offset_of!(Array3dDescriptor, format), 24);
    }

    #[test]
    fn array_sizes() {
        assert_eq!(array_bytes(1024, 0, 0, 0x20, 1), 4096);
        assert_eq!(array_bytes(640, 480, 0, 0x01, 4), 640 * 480 * 4);
        assert_eq!(array_bytes(64, 64, 64, 0x10, 2), 64 * 64 * 64 * 2 * 2);
        assert_eq!(array_bytes(usize::MAX, 2, 2, 0x20, 4), u64::MAX);
    }
}
