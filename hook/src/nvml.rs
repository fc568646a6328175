//! What the hook asks NVML (`libnvidia-ml.so.1`, mounted with the driver): per-process SM
//! utilization (to throttle to the container's share), and the card's when no process is
//! known; the device memory a process holds (its context and modules too). Loaded lazily, off
//! the application's threads where it can be.

use std::ffi::{CString, c_char, c_int, c_uint, c_ulonglong, c_void};

type NvmlReturn = c_int;
const NVML_SUCCESS: NvmlReturn = 0;
const NVML_ERROR_NOT_FOUND: NvmlReturn = 6;
const NVML_ERROR_INSUFFICIENT_SIZE: NvmlReturn = 7;

/// `nvmlProcessUtilizationSample_t`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Sample {
    pid: c_uint,
    time_stamp: c_ulonglong,
    sm_util: c_uint,
    mem_util: c_uint,
    enc_util: c_uint,
    dec_util: c_uint,
}

/// `nvmlProcessInfo_t` (v2/v3 layout).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct ProcessInfo {
    pid: c_uint,
    used_gpu_memory: c_ulonglong,
    gpu_instance_id: c_uint,
    compute_instance_id: c_uint,
}

/// NVML's `NVML_VALUE_NOT_AVAILABLE` for a process's memory.
const NOT_AVAILABLE: c_ulonglong = c_ulonglong::MAX;

/// `nvmlUtilization_t`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Utilization {
    gpu: c_uint,
    memory: c_uint,
}

type InitFn = unsafe extern "C" fn() -> NvmlReturn;
type ByUuidFn = unsafe extern "C" fn(*const c_char, *mut *mut c_void) -> NvmlReturn;
type ProcUtilFn = unsafe extern "C" fn(*mut c_void, *mut Sample, *mut c_uint, c_ulonglong) -> NvmlReturn;
type UtilFn = unsafe extern "C" fn(*mut c_void, *mut Utilization) -> NvmlReturn;
type ProcessesFn = unsafe extern "C" fn(*mut c_void, *mut c_uint, *mut ProcessInfo) -> NvmlReturn;

/// How old (microseconds, by the driver's clock) a process's newest sample may be and still
/// count: five of the driver's 200 ms sampling periods.
const STALE_SAMPLE_US: c_ulonglong = 1_000_000;

/// NVML, loaded and initialised, with the container's card.
pub struct Nvml {
    device: *mut c_void,
    proc_util: ProcUtilFn,
    util: UtilFn,
    processes: Option<ProcessesFn>,
    last_seen: c_ulonglong,
    /// The newest sample seen of each of the container's processes: `(pid, time_stamp, sm_util)`.
    latest: Vec<(c_uint, c_ulonglong, c_uint)>,
}

// SAFETY: NVML handles may be used from any thread.
unsafe impl Send for Nvml {}

fn sym<T>(h: *mut c_void, name: &std::ffi::CStr) -> Option<T> {
    let dlsym = crate::real::real_dlsym()?;
    // SAFETY: `h` is a live dlopen handle and `name` NUL-terminated.
    let p = unsafe { dlsym(h, name.as_ptr()) };
    // SAFETY: the caller names the function's real signature as `T` (a fn pointer).
    (!p.is_null()).then(|| unsafe { std::mem::transmute_copy::<*mut c_void, T>(&p) })
}

impl Nvml {
    /// Loads NVML and finds `uuid`; `None` when either is unavailable.
    pub fn open(uuid: &str) -> Option<Self> {
        // SAFETY: a NUL-terminated name and valid flags.
        let h = unsafe { libc::dlopen(c"libnvidia-ml.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if h.is_null() {
            return None;
        }
        let init: InitFn = sym(h, c"nvmlInit_v2").or_else(|| sym(h, c"nvmlInit"))?;
        let by_uuid: ByUuidFn = sym(h, c"nvmlDeviceGetHandleByUUID")?;
        // SAFETY: NVML's documented init.
        if unsafe { init() } != NVML_SUCCESS {
            return None;
        }
        let uuid = CString::new(uuid).ok()?;
        let mut device = std::ptr::null_mut();
        // SAFETY: valid string and out-pointer.
        if unsafe { by_uuid(uuid.as_ptr(), &mut device) } != NVML_SUCCESS {
            return None;
        }
        Some(Self {
            device,
            proc_util: sym(h, c"nvmlDeviceGetProcessUtilization")?,
            util: sym(h, c"nvmlDeviceGetUtilizationRates")?,
            processes: sym(h, c"nvmlDeviceGetComputeRunningProcesses_v3"),
            last_seen: 0,
            latest: Vec::new(),
        })
    }

    /// SM utilization (percent of the card) of `pids`, the newest sample of each; of the whole
    /// card when `pids` is empty (no process known) or NVML keeps no per-process samples
    /// (an over-estimate, so the container never exceeds its share, though it may get less
    /// while others are busy). `None`: no new sample of `pids` since the last call.
    ///
    /// The driver samples each process about every 200 ms (seen on an H100 with driver 580)
    /// and answers `NOT_FOUND` in between: that is no news, not an idle GPU.
    pub fn utilization(&mut self, pids: &[u32]) -> Option<u32> {
        if pids.is_empty() {
            return self.card();
        }
        let mut n: c_uint = 0;
        // SAFETY: a null buffer asks for the sample count.
        let r = unsafe { (self.proc_util)(self.device, std::ptr::null_mut(), &mut n, self.last_seen) };
        match r {
            NVML_SUCCESS | NVML_ERROR_INSUFFICIENT_SIZE => {}
            NVML_ERROR_NOT_FOUND => return None,
            _ => return self.card(),
        }
        let mut buf = vec![Sample::default(); n.max(1) as usize];
        let mut n = buf.len() as c_uint;
        // SAFETY: `buf` holds `n` samples.
        match unsafe { (self.proc_util)(self.device, buf.as_mut_ptr(), &mut n, self.last_seen) } {
            NVML_SUCCESS => {}
            NVML_ERROR_NOT_FOUND => return None,
            _ => return self.card(),
        }
        let samples = &buf[..n as usize];
        self.last_seen = samples.iter().map(|s| s.time_stamp).max().unwrap_or(self.last_seen);
        // The driver samples each process on a phase of its own, so one reading holds new
        // samples of some processes only: the container's figure is the newest sample of each of
        // its processes, kept across readings, and a reading with new samples of other
        // processes only is no news of the container's (not 0%, which would read as idle and
        // lift the rate).
        let mut news = false;
        for s in samples.iter().filter(|s| pids.contains(&s.pid)) {
            news = true;
            match self.latest.iter_mut().find(|(pid, ..)| *pid == s.pid) {
                Some(l) if l.1 >= s.time_stamp => {}
                Some(l) => *l = (s.pid, s.time_stamp, s.sm_util),
                None => self.latest.push((s.pid, s.time_stamp, s.sm_util)),
            }
        }
        // A process with no sample for a second has ended or gone idle.
        let newest = self.last_seen;
        self.latest
            .retain(|(pid, ts, _)| pids.contains(pid) && newest.saturating_sub(*ts) <= STALE_SAMPLE_US);
        news.then(|| self.latest.iter().map(|(.., sm)| *sm).sum::<c_uint>().min(100))
    }

    /// Device memory the compute processes among `pids` hold on the card (their allocations,
    /// contexts, modules), as the driver counts it; `None` when NVML cannot say.
    pub fn memory_of(&mut self, pids: &[u32]) -> Option<u64> {
        let f = self.processes?;
        let mut buf = vec![ProcessInfo::default(); 64];
        loop {
            let mut n = buf.len() as c_uint;
            // SAFETY: `buf` holds `n` entries.
            match unsafe { f(self.device, &mut n, buf.as_mut_ptr()) } {
                NVML_SUCCESS => {
                    let held = buf[..n as usize]
                        .iter()
                        .filter(|p| pids.contains(&p.pid) && p.used_gpu_memory != NOT_AVAILABLE)
                        .map(|p| p.used_gpu_memory)
                        .sum();
                    return Some(held);
                }
                NVML_ERROR_INSUFFICIENT_SIZE if (n as usize) > buf.len() && n < 65536 => {
                    buf = vec![ProcessInfo::default(); n as usize + 8];
                }
                _ => return None,
            }
        }
    }

    /// The whole card's utilization.
    fn card(&mut self) -> Option<u32> {
        let mut u = Utilization::default();
        // SAFETY: valid device and out-pointer.
        (unsafe { (self.util)(self.device, &mut u) } == NVML_SUCCESS).then_some(u.gpu)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_match_nvml_h() {
        assert_eq!(std::mem::size_of::<Sample>(), 32);
        assert_eq!(std::mem::size_of::<ProcessInfo>(), 24);
        assert_eq!(std::mem::size_of::<Utilization>(), 8);
    }
}
