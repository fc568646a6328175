//! MIG through NVML's raw entry points (nvml-wrapper wraps few of them): the GPU instance
//! profiles a card can create and where ([`profiles`]), where an instance sits
//! ([`placement_of`]), and creating and destroying instances ([`NvmlMig`], dynamic MIG). A card
//! is never switched into or out of MIG mode here: that is the operator's setting.

use std::mem::MaybeUninit;

use nvml_wrapper::Nvml;
use nvml_wrapper_sys::bindings::{
    nvmlComputeInstance_t, nvmlComputeInstanceInfo_t, nvmlComputeInstanceProfileInfo_t, nvmlDevice_t,
    nvmlGpuInstance_t, nvmlGpuInstanceInfo_t, nvmlGpuInstancePlacement_t, nvmlGpuInstanceProfileInfo_t,
};
use tessera_core::inventory::{MadeInstance, MigError, MigPartitioner, MigPlacement, MigProfileInfo};
use tessera_core::mig::MigProfile;

/// NVML's "not found" return code.
const NOT_FOUND: u32 = 6;
/// NVML's "invalid argument" return code.
const INVALID_ARGUMENT: u32 = 2;
/// `NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED`.
const ENGINE_SHARED: u32 = 0;
/// GPU instance profile indices and the attribute their names carry (`NVML_GPU_INSTANCE_PROFILE_*`):
/// the plain ones, `+me` (the REV1s), the double-memory 1-slice (REV2) and `+gfx`. The media-less and
/// all-media ones (13 to 16) have names Tessera's profile names cannot carry, and are not offered.
const GI_PROFILES: &[(u32, Option<&str>)] = &[
    (0, None),
    (1, None),
    (2, None),
    (3, None),
    (4, None),
    (5, None),
    (6, None),
    (7, Some("me")),
    (8, Some("me")),
    (9, None),
    (10, Some("gfx")),
    (11, Some("gfx")),
    (12, Some("gfx")),
];
/// `NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE` .. `_6_SLICE` (REV1, 7, is left out).
const CI_PROFILES: std::ops::Range<u32> = 0..7;

/// The entry points dynamic MIG calls ([`ENTRY_POINTS`]) and whether a loaded library has
/// each, from one list.
macro_rules! entry_points {
    ($($name:ident),* $(,)?) => {
        /// The entry points dynamic MIG calls.
        pub const ENTRY_POINTS: &[&str] = &[$(stringify!($name)),*];

        fn present(lib: &nvml_wrapper_sys::bindings::NvmlLib) -> Vec<bool> {
            vec![$(lib.$name.is_ok()),*]
        }
    };
}

entry_points!(
    nvmlDeviceGetGpuInstanceProfileInfo,
    nvmlDeviceGetGpuInstancePossiblePlacements_v2,
    nvmlDeviceGetGpuInstanceById,
    nvmlGpuInstanceGetInfo,
    nvmlDeviceCreateGpuInstanceWithPlacement,
    nvmlGpuInstanceGetComputeInstanceProfileInfo,
    nvmlGpuInstanceCreateComputeInstance,
    nvmlComputeInstanceGetInfo_v2,
    nvmlDeviceGetUUID,
    nvmlDeviceGetMaxMigDeviceCount,
    nvmlDeviceGetMigDeviceHandleByIndex,
    nvmlDeviceGetGpuInstanceId,
    nvmlDeviceGetComputeInstanceId,
    nvmlGpuInstanceGetComputeInstanceById,
    nvmlComputeInstanceDestroy,
    nvmlGpuInstanceDestroy,
);

/// Which of [`ENTRY_POINTS`] the `libnvidia-ml` at `path` lacks (it is loaded, not
/// initialised: no GPU is needed).
pub fn missing_entry_points(path: &std::path::Path) -> Result<Vec<&'static str>, String> {
    // SAFETY: loading NVIDIA's library runs no code of ours; its initialisers are the
    // driver's, as for any NVML user.
    let lib = unsafe { libloading::Library::new(path) }.map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(ENTRY_POINTS
        .iter()
        .copied()
        .filter(|name| {
            // SAFETY: the symbol is only looked up, never called.
            unsafe { lib.get::<*const ()>(name.as_bytes()) }.is_err()
        })
        .collect())
}

fn check(call: &'static str, rc: u32) -> Result<(), MigError> {
    nvml_wrapper::error::nvml_try(rc).map_err(|e| MigError::Nvml {
        call,
        message: e.to_string(),
        rc,
    })
}

/// The error of NVML call `call` (about `target`, when it names one) through the wrapper.
fn call_failed(call: &'static str, target: Option<&str>) -> impl FnOnce(nvml_wrapper::error::NvmlError) -> MigError {
    let target = target.map(str::to_string);
    move |e| MigError::Call {
        call,
        target,
        message: e.to_string(),
    }
}

macro_rules! sym {
    ($nvml:expr, $name:ident) => {
        $nvml.lib().$name.as_ref().map_err(|e| MigError::Missing {
            symbol: stringify!($name),
            reason: e.to_string(),
        })?
    };
}

/// The GPU instance profiles card `device` can create, named as NVIDIA names them for a card
/// of `total_mib`, each with its possible placements (profiles the card does not support, or
/// whose placements cannot be read, are skipped).
pub(crate) fn profiles(nvml: &Nvml, device: nvmlDevice_t, total_mib: u64) -> Result<Vec<MigProfileInfo>, MigError> {
    let info_of = sym!(nvml, nvmlDeviceGetGpuInstanceProfileInfo);
    let placements_of = sym!(nvml, nvmlDeviceGetGpuInstancePossiblePlacements_v2);
    let mut out = Vec::new();
    for &(index, attribute) in GI_PROFILES {
        let mut info = MaybeUninit::zeroed();
        // SAFETY: `device` is a live handle of `nvml`; `info` is a valid out-pointer.
        let rc = unsafe { info_of(device, index, info.as_mut_ptr()) };
        if rc != 0 {
            continue;
        }
        // SAFETY: NVML filled it (rc 0).
        let info: nvmlGpuInstanceProfileInfo_t = unsafe { info.assume_init() };
        let mut count: u32 = 0;
        // SAFETY: a null array asks for the count only.
        let rc = unsafe { placements_of(device, info.id, std::ptr::null_mut(), &mut count) };
        if rc != 0 || count == 0 {
            // A profile with nowhere to go is not offered.
            continue;
        }
        let mut raw = vec![nvmlGpuInstancePlacement_t { start: 0, size: 0 }; count as usize];
        // SAFETY: `raw` has room for `count` placements.
        let rc = unsafe { placements_of(device, info.id, raw.as_mut_ptr(), &mut count) };
        if rc != 0 {
            continue;
        }
        raw.truncate(count as usize);
        let mut name = super::nvml::mig_profile_name(info.sliceCount, info.sliceCount, info.memorySizeMB, total_mib);
        if let Some(a) = attribute {
            name.push('+');
            name.push_str(a);
        }
        let Ok(profile) = name.parse::<MigProfile>() else {
            continue;
        };
        out.push(MigProfileInfo {
            profile,
            id: info.id,
            memory_mib: info.memorySizeMB,
            slices: info.sliceCount,
            decoders: info.decoderCount,
            encoders: info.encoderCount,
            jpeg_decoders: info.jpegCount,
            ofas: info.ofaCount,
            placements: raw
                .iter()
                .map(|p| MigPlacement {
                    start: p.start,
                    size: p.size,
                })
                .collect(),
        });
    }
    Ok(out)
}

fn gpu_instance(nvml: &Nvml, device: nvmlDevice_t, gi: u32) -> Result<Option<nvmlGpuInstance_t>, MigError> {
    let by_id = sym!(nvml, nvmlDeviceGetGpuInstanceById);
    let mut handle = MaybeUninit::zeroed();
    // SAFETY: `device` is live; `handle` is a valid out-pointer.
    let rc = unsafe { by_id(device, gi, handle.as_mut_ptr()) };
    if rc == NOT_FOUND {
        return Ok(None);
    }
    check("nvmlDeviceGetGpuInstanceById", rc)?;
    // SAFETY: NVML filled it (rc 0).
    Ok(Some(unsafe { handle.assume_init() }))
}

/// Where GPU instance `gi` of card `device` sits.
pub(crate) fn placement_of(nvml: &Nvml, device: nvmlDevice_t, gi: u32) -> Result<Option<MigPlacement>, MigError> {
    let Some(handle) = gpu_instance(nvml, device, gi)? else {
        return Ok(None);
    };
    let get_info = sym!(nvml, nvmlGpuInstanceGetInfo);
    let mut info = MaybeUninit::<nvmlGpuInstanceInfo_t>::zeroed();
    // SAFETY: `handle` is a live GPU instance; `info` is a valid out-pointer.
    check("nvmlGpuInstanceGetInfo", unsafe { get_info(handle, info.as_mut_ptr()) })?;
    // SAFETY: NVML filled it (rc 0).
    let info = unsafe { info.assume_init() };
    Ok(Some(MigPlacement {
        start: info.placement.start,
        size: info.placement.size,
    }))
}

/// Creates and destroys MIG instances through NVML (dynamic MIG).
pub struct NvmlMig {
    nvml: Nvml,
}

impl NvmlMig {
    /// Instances through `nvml` (see [`super::NvmlSource::open`]); refused when its library
    /// lacks an entry point dynamic MIG calls.
    pub fn new(nvml: Nvml) -> Result<Self, MigError> {
        let present = present(nvml.lib());
        let missing: Vec<&str> = ENTRY_POINTS
            .iter()
            .zip(present)
            .filter(|(_, ok)| !ok)
            .map(|(n, _)| *n)
            .collect();
        if !missing.is_empty() {
            return Err(MigError::Unsupported { missing });
        }
        Ok(Self { nvml })
    }

    fn device(&self, uuid: &str) -> Result<nvmlDevice_t, MigError> {
        let dev = self
            .nvml
            .device_by_uuid(uuid)
            .map_err(call_failed("nvmlDeviceGetHandleByUUID", Some(uuid)))?;
        // SAFETY: the handle stays valid while `self.nvml` is initialised (NVML handles are
        // not freed per device).
        Ok(unsafe { dev.handle() })
    }

    /// The UUID of the MIG device of GPU instance `gi`, compute instance `ci` (any compute
    /// instance when `None`) on card `parent_uuid`, when there is one. (A compute instance's
    /// info names its parent card, not the MIG device: the MIG device is found among the
    /// card's.)
    fn mig_uuid(&self, parent_uuid: &str, gi: u32, ci: Option<u32>) -> Result<Option<String>, MigError> {
        let parent = self
            .nvml
            .device_by_uuid(parent_uuid)
            .map_err(call_failed("nvmlDeviceGetHandleByUUID", Some(parent_uuid)))?;
        let max = parent
            .mig_device_count()
            .map_err(call_failed("nvmlDeviceGetMaxMigDeviceCount", None))?;
        for i in 0..max {
            let Ok(mig) = parent.mig_device_by_index(i) else {
                continue;
            };
            let (g, c) =
                super::nvml::instance_ids(&self.nvml, &mig).map_err(|e| MigError::InstanceIds(e.to_string()))?;
            if g == gi && ci.is_none_or(|ci| ci == c) {
                return mig.uuid().map(Some).map_err(call_failed("nvmlDeviceGetUUID", None));
            }
        }
        Ok(None)
    }

    fn destroy_compute_instances(&self, gi: nvmlGpuInstance_t) -> Result<(), MigError> {
        let by_id = sym!(self.nvml, nvmlGpuInstanceGetComputeInstanceById);
        let destroy = sym!(self.nvml, nvmlComputeInstanceDestroy);
        for id in 0..8 {
            let mut ci = MaybeUninit::<nvmlComputeInstance_t>::zeroed();
            // SAFETY: `gi` is live; `ci` is a valid out-pointer.
            let rc = unsafe { by_id(gi, id, ci.as_mut_ptr()) };
            // Not found (or an id past the instance's): nothing there.
            if rc == NOT_FOUND || rc == INVALID_ARGUMENT {
                continue;
            }
            check("nvmlGpuInstanceGetComputeInstanceById", rc)?;
            // SAFETY: NVML filled it (rc 0) and it is destroyed once.
            check("nvmlComputeInstanceDestroy", unsafe { destroy(ci.assume_init()) })?;
        }
        Ok(())
    }
}

impl MigPartitioner for NvmlMig {
    fn create(&self, parent_uuid: &str, profile_id: u32, placement: MigPlacement) -> Result<MadeInstance, MigError> {
        let device = self.device(parent_uuid)?;
        let create_gi = sym!(self.nvml, nvmlDeviceCreateGpuInstanceWithPlacement);
        let gi_info_of = sym!(self.nvml, nvmlGpuInstanceGetInfo);
        let ci_profile_of = sym!(self.nvml, nvmlGpuInstanceGetComputeInstanceProfileInfo);
        let create_ci = sym!(self.nvml, nvmlGpuInstanceCreateComputeInstance);
        let ci_info_of = sym!(self.nvml, nvmlComputeInstanceGetInfo_v2);
        let destroy_gi = sym!(self.nvml, nvmlGpuInstanceDestroy);
        let at = nvmlGpuInstancePlacement_t {
            start: placement.start,
            size: placement.size,
        };
        let mut gi = MaybeUninit::<nvmlGpuInstance_t>::zeroed();
        // SAFETY: `device` is live; `at` and `gi` are valid for the call.
        check("nvmlDeviceCreateGpuInstanceWithPlacement", unsafe {
            create_gi(device, profile_id, &at, gi.as_mut_ptr())
        })?;
        // SAFETY: NVML filled it (rc 0).
        let gi = unsafe { gi.assume_init() };
        let made = (|| -> Result<MadeInstance, MigError> {
            let mut gi_info = MaybeUninit::<nvmlGpuInstanceInfo_t>::zeroed();
            // SAFETY: `gi` is live; `gi_info` is a valid out-pointer.
            check("nvmlGpuInstanceGetInfo", unsafe {
                gi_info_of(gi, gi_info.as_mut_ptr())
            })?;
            // SAFETY: NVML filled it (rc 0).
            let gi_info = unsafe { gi_info.assume_init() };
            let info_of = sym!(self.nvml, nvmlDeviceGetGpuInstanceProfileInfo);
            // The compute instance profile that covers the whole GPU instance.
            let slices = GI_PROFILES
                .iter()
                .find_map(|&(index, _)| {
                    let mut p = MaybeUninit::<nvmlGpuInstanceProfileInfo_t>::zeroed();
                    // SAFETY: `device` is live; `p` is a valid out-pointer.
                    let rc = unsafe { info_of(device, index, p.as_mut_ptr()) };
                    // SAFETY: NVML filled it (rc 0).
                    (rc == 0)
                        .then(|| unsafe { p.assume_init() })
                        .filter(|p| p.id == profile_id)
                })
                .map(|p| p.sliceCount)
                .ok_or_else(|| MigError::NoSuchProfile {
                    card: parent_uuid.to_string(),
                    profile: profile_id,
                })?;
            let ci_profile = CI_PROFILES
                .filter_map(|index| {
                    let mut p = MaybeUninit::<nvmlComputeInstanceProfileInfo_t>::zeroed();
                    // SAFETY: `gi` is live; `p` is a valid out-pointer.
                    let rc = unsafe { ci_profile_of(gi, index, ENGINE_SHARED, p.as_mut_ptr()) };
                    // SAFETY: NVML filled it (rc 0).
                    (rc == 0).then(|| unsafe { p.assume_init() })
                })
                .find(|p| p.sliceCount == slices)
                .ok_or(MigError::NoComputeProfile { slices })?;
            let mut ci = MaybeUninit::<nvmlComputeInstance_t>::zeroed();
            // SAFETY: `gi` is live; `ci` is a valid out-pointer.
            check("nvmlGpuInstanceCreateComputeInstance", unsafe {
                create_ci(gi, ci_profile.id, ci.as_mut_ptr())
            })?;
            // SAFETY: NVML filled it (rc 0).
            let ci = unsafe { ci.assume_init() };
            let mut ci_info = MaybeUninit::<nvmlComputeInstanceInfo_t>::zeroed();
            // SAFETY: `ci` is live; `ci_info` is a valid out-pointer.
            check("nvmlComputeInstanceGetInfo_v2", unsafe {
                ci_info_of(ci, ci_info.as_mut_ptr())
            })?;
            // SAFETY: NVML filled it (rc 0).
            let ci_info = unsafe { ci_info.assume_init() };
            let uuid = self
                .mig_uuid(parent_uuid, gi_info.id, Some(ci_info.id))?
                .ok_or(MigError::NoMigDevice {
                    gi: gi_info.id,
                    ci: ci_info.id,
                })?;
            Ok(MadeInstance {
                gi: gi_info.id,
                ci: ci_info.id,
                uuid,
            })
        })();
        if let Err(e) = &made {
            // Nothing half made stays: the compute instances, then the GPU instance.
            let undone = self.destroy_compute_instances(gi).and_then(|()| {
                // SAFETY: `gi` is live and destroyed once.
                check("nvmlGpuInstanceDestroy", unsafe { destroy_gi(gi) })
            });
            if let Err(left) = undone {
                return Err(MigError::LeftHalfMade {
                    made: Box::new(e.clone()),
                    left: Box::new(left),
                });
            }
        }
        made.map_err(|e| MigError::Create {
            card: parent_uuid.to_string(),
            profile: profile_id,
            start: placement.start,
            size: placement.size,
            reason: Box::new(e),
        })
    }

    fn destroy(
        &self,
        parent_uuid: &str,
        gi: u32,
        uuid: &str,
        profile_id: u32,
        placement: MigPlacement,
    ) -> Result<(), MigError> {
        let device = self.device(parent_uuid)?;
        let Some(handle) = gpu_instance(&self.nvml, device, gi)? else {
            return Ok(());
        };
        // The id may name a later instance: destroyed only as the one it was, by its MIG
        // device's UUID, or, without a compute instance (a destroy cut short), by its profile
        // and placement.
        match self.mig_uuid(parent_uuid, gi, None)? {
            Some(now) if now == uuid => {}
            Some(_) => return Ok(()),
            None => {
                let get_info = sym!(self.nvml, nvmlGpuInstanceGetInfo);
                let mut info = MaybeUninit::<nvmlGpuInstanceInfo_t>::zeroed();
                // SAFETY: `handle` is a live GPU instance; `info` is a valid out-pointer.
                check("nvmlGpuInstanceGetInfo", unsafe { get_info(handle, info.as_mut_ptr()) })?;
                // SAFETY: NVML filled it (rc 0).
                let info = unsafe { info.assume_init() };
                if info.profileId != profile_id
                    || info.placement.start != placement.start
                    || info.placement.size != placement.size
                {
                    return Ok(());
                }
            }
        }
        self.destroy_compute_instances(handle)?;
        let destroy_gi = sym!(self.nvml, nvmlGpuInstanceDestroy);
        // SAFETY: `handle` is live and destroyed once.
        check("nvmlGpuInstanceDestroy", unsafe { destroy_gi(handle) })
    }
}
