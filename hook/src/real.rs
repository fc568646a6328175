//! The real functions behind the hooks: glibc's own `dlsym` (this library exports one of its
//! own), the driver library, and each driver entry point, resolved once and cached.

use std::ffi::{CStr, c_char, c_void};
use std::sync::atomic::{AtomicPtr, Ordering};

type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

static REAL_DLSYM: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
static LIBCUDA: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());

/// glibc's `dlsym`, found with `dlvsym` (a different symbol, so finding it never re-enters the
/// `dlsym` this library exports). Null only on a libc without versioned `dlsym`.
pub fn real_dlsym() -> Option<DlsymFn> {
    let mut p = REAL_DLSYM.load(Ordering::Acquire);
    if p.is_null() {
        // glibc 2.34 moved dlsym into libc; before, x86-64 and aarch64 had it from libdl.
        for version in [c"GLIBC_2.34", c"GLIBC_2.2.5", c"GLIBC_2.17"] {
            // SAFETY: both arguments are NUL-terminated strings; RTLD_NEXT is a valid pseudo-handle.
            p = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), version.as_ptr()) };
            if !p.is_null() {
                break;
            }
        }
        if p.is_null() {
            return None;
        }
        REAL_DLSYM.store(p, Ordering::Release);
    }
    // SAFETY: `p` is glibc's dlsym, whose signature is `DlsymFn`.
    Some(unsafe { std::mem::transmute::<*mut c_void, DlsymFn>(p) })
}

/// The driver library's handle (loaded if the program has not loaded it yet).
pub fn libcuda() -> *mut c_void {
    let mut h = LIBCUDA.load(Ordering::Acquire);
    if h.is_null() {
        // SAFETY: a NUL-terminated name and valid flags.
        h = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
        if h.is_null() {
            // SAFETY: as above.
            h = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        }
        if !h.is_null() {
            LIBCUDA.store(h, Ordering::Release);
        }
    }
    h
}

/// Whether the program has loaded the driver (never loads it).
pub fn libcuda_loaded() -> bool {
    if !LIBCUDA.load(Ordering::Acquire).is_null() {
        return true;
    }
    // SAFETY: a NUL-terminated name and valid flags; RTLD_NOLOAD only looks.
    let h = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    if !h.is_null() {
        LIBCUDA.store(h, Ordering::Release);
    }
    !h.is_null()
}

/// The driver's own `name` (never this library's: the lookup is scoped to libcuda).
pub fn driver_symbol(name: &CStr) -> *mut c_void {
    let (Some(dlsym), h) = (real_dlsym(), libcuda()) else {
        return std::ptr::null_mut();
    };
    if h.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: `h` is a live handle from dlopen and `name` is NUL-terminated.
    unsafe { dlsym(h, name.as_ptr()) }
}

/// One driver entry point, resolved on first use (and remembered as missing once the driver
/// is loaded and lacks it).
pub struct Real {
    name: &'static CStr,
    ptr: AtomicPtr<c_void>,
    missing: std::sync::atomic::AtomicBool,
}

impl Real {
    /// An entry point by its exported (versioned) name.
    pub const fn new(name: &'static CStr) -> Self {
        Self {
            name,
            ptr: AtomicPtr::new(std::ptr::null_mut()),
            missing: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// The exported name.
    pub fn name(&self) -> &'static CStr {
        self.name
    }

    /// The driver's function, or null when the driver does not have it.
    pub fn get(&self) -> *mut c_void {
        let p = self.ptr.load(Ordering::Acquire);
        if !p.is_null() || self.missing.load(Ordering::Acquire) {
            return p;
        }
        let p = driver_symbol(self.name);
        if !p.is_null() {
            self.ptr.store(p, Ordering::Release);
        } else if !LIBCUDA.load(Ordering::Acquire).is_null() {
            self.missing.store(true, Ordering::Release);
        }
        p
    }
}
