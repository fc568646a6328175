//! The driver's per-cgroup limits, through `libnvidia-ml.so.1` loaded at run time.

use std::ffi::{CStr, CString};
use std::path::Path;

use super::ffi::{self, NvmlDevice, NvmlReturn};
use super::{CgroupMemoryLimits, Limits, MemoryLimitError};

/// NVML, loaded and initialised, with the per-cgroup limit calls found.
pub struct NvmlMemoryLimits {
    library: String,
    driver: String,
    error_string: ffi::ErrorString,
    handle_by_uuid: ffi::DeviceGetHandleByUuid,
    set_limits: ffi::DeviceSetMemoryLimitsV1,
    get_limits: ffi::DeviceGetMemoryLimitsV1,
    // Keeps the functions above loaded.
    _lib: libloading::Library,
}

impl std::fmt::Debug for NvmlMemoryLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlMemoryLimits")
            .field("library", &self.library)
            .field("driver", &self.driver)
            .finish_non_exhaustive()
    }
}

/// Looks `name` up in `lib` as a `T`.
///
/// # Safety
/// `T` must be the symbol's true C type.
unsafe fn symbol<T: Copy>(lib: &libloading::Library, library: &str, name: &'static str) -> Result<T, MemoryLimitError> {
    // SAFETY: the caller names the symbol's type.
    unsafe { lib.get::<T>(name.as_bytes()) }
        .map(|s| *s)
        .map_err(|_| MemoryLimitError::Missing {
            library: library.to_string(),
            symbol: name,
        })
}

impl NvmlMemoryLimits {
    /// Loads NVML (`library`, else `libnvidia-ml.so.1` by the loader's search) and initialises
    /// it; fails when it has no per-cgroup limits.
    pub fn open(library: Option<&Path>) -> Result<Self, MemoryLimitError> {
        let name = library.map_or_else(|| "libnvidia-ml.so.1".to_string(), |p| p.display().to_string());
        // SAFETY: loading NVIDIA's library runs the driver's initialisers, as for any NVML user.
        let lib = unsafe { libloading::Library::new(library.map_or("libnvidia-ml.so.1".as_ref(), Path::as_os_str)) }
            .map_err(|e| MemoryLimitError::Load {
                library: name.clone(),
                reason: e.to_string(),
            })?;
        // SAFETY: each type is the one nvml.h declares (checked against the header in tests).
        let (init, error_string, version, handle_by_uuid, set_limits, get_limits) = unsafe {
            (
                symbol::<ffi::InitV2>(&lib, &name, "nvmlInit_v2")?,
                symbol::<ffi::ErrorString>(&lib, &name, "nvmlErrorString")?,
                symbol::<ffi::SystemGetDriverVersion>(&lib, &name, "nvmlSystemGetDriverVersion")?,
                symbol::<ffi::DeviceGetHandleByUuid>(&lib, &name, "nvmlDeviceGetHandleByUUID")?,
                symbol::<ffi::DeviceSetMemoryLimitsV1>(&lib, &name, "nvmlDeviceSetMemoryLimits_v1")?,
                symbol::<ffi::DeviceGetMemoryLimitsV1>(&lib, &name, "nvmlDeviceGetMemoryLimits_v1")?,
            )
        };
        let mut this = Self {
            library: name,
            driver: String::new(),
            error_string,
            handle_by_uuid,
            set_limits,
            get_limits,
            _lib: lib,
        };
        // SAFETY: no arguments; NVML counts initialisations.
        this.check("nvmlInit_v2", "the driver", unsafe { init() })?;
        let mut buf = [0 as std::os::raw::c_char; ffi::DRIVER_VERSION_BUFFER_SIZE];
        // SAFETY: `buf` holds the length passed.
        let rc = unsafe { version(buf.as_mut_ptr(), ffi::DRIVER_VERSION_BUFFER_SIZE as u32) };
        this.check("nvmlSystemGetDriverVersion", "the driver", rc)?;
        // SAFETY: NVML wrote a NUL-terminated string within `buf`.
        this.driver = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned();
        Ok(this)
    }

    /// The driver's version, as NVML reports it.
    pub fn driver_version(&self) -> &str {
        &self.driver
    }

    fn check(&self, call: &'static str, target: &str, rc: NvmlReturn) -> Result<(), MemoryLimitError> {
        if rc == ffi::NVML_SUCCESS {
            return Ok(());
        }
        // SAFETY: NVML returns a static string for any code.
        let text = unsafe { (self.error_string)(rc) };
        let message = if text.is_null() {
            "unknown error".to_string()
        } else {
            // SAFETY: non-null, NUL-terminated, static.
            unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned()
        };
        Err(MemoryLimitError::Nvml {
            call,
            target: target.to_string(),
            message,
            rc,
        })
    }

    fn device(&self, uuid: &str) -> Result<NvmlDevice, MemoryLimitError> {
        let c = CString::new(uuid).map_err(|_| MemoryLimitError::Nvml {
            call: "nvmlDeviceGetHandleByUUID",
            target: uuid.to_string(),
            message: "the UUID has a NUL byte".into(),
            rc: 2,
        })?;
        let mut device: NvmlDevice = std::ptr::null_mut();
        // SAFETY: `c` is NUL-terminated; `device` is a valid out-pointer.
        let rc = unsafe { (self.handle_by_uuid)(c.as_ptr(), &mut device) };
        self.check("nvmlDeviceGetHandleByUUID", uuid, rc)?;
        Ok(device)
    }
}

fn c_path(cgroup: &Path) -> Result<CString, MemoryLimitError> {
    cgroup
        .to_str()
        .and_then(|s| CString::new(s).ok())
        .ok_or_else(|| MemoryLimitError::Path(cgroup.to_path_buf()))
}

impl CgroupMemoryLimits for NvmlMemoryLimits {
    fn set(&self, uuid: &str, cgroup: &Path, soft: u64, hard: u64) -> Result<(), MemoryLimitError> {
        let device = self.device(uuid)?;
        let path = c_path(cgroup)?;
        let mut limits = ffi::SetMemoryLimitsV1 {
            name_space: path.as_ptr(),
            soft_limit: soft,
            hard_limit: hard,
        };
        // SAFETY: `device` is a live handle; `limits` points at `path`, alive for the call.
        let rc = unsafe { (self.set_limits)(device, &mut limits) };
        self.check(
            "nvmlDeviceSetMemoryLimits_v1",
            &format!("{uuid} on {}", cgroup.display()),
            rc,
        )
    }

    fn get(&self, uuid: &str, cgroup: &Path) -> Result<Option<Limits>, MemoryLimitError> {
        let device = self.device(uuid)?;
        let path = c_path(cgroup)?;
        let mut limits = ffi::GetMemoryLimitsV1 {
            name_space: path.as_ptr(),
            soft_limit: 0,
            hard_limit: 0,
            current_used: 0,
        };
        // SAFETY: as for `set`; NVML fills the out fields.
        let rc = unsafe { (self.get_limits)(device, &mut limits) };
        match self.check(
            "nvmlDeviceGetMemoryLimits_v1",
            &format!("{uuid} on {}", cgroup.display()),
            rc,
        ) {
            Ok(()) => Ok(Some(Limits {
                soft: limits.soft_limit,
                hard: limits.hard_limit,
                used: limits.current_used,
            })),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e),
        }
    }
}
