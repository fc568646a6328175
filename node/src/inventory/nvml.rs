//! Inventory from NVML (real hardware). `libnvidia-ml.so.1` is loaded at run time: when it is
//! absent, [`NvmlSource::discover`] returns [`InventoryError::NvmlUnavailable`]. The driver's
//! files come from [`crate::driver::discover`], told NVML's version and directory.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use nvml_wrapper::Nvml;
use nvml_wrapper::error::NvmlError;

use tessera_core::inventory::{
    ComputeMode, DeviceNode, Gpu, Health, InventoryError, InventorySource, MIG_MINORS_PATH, MigDevice, MigMinors,
    NodeInventory, cap_path,
};
use tessera_core::mig::MigProfile;

use crate::driver::{self, Driver, DriverSearch};

/// Control device nodes, when present.
const CONTROL_DEVICES: &[&str] = &["nvidiactl", "nvidia-modeset", "nvidia-uvm", "nvidia-uvm-tools"];

/// Reads the inventory from NVML, the driver files from the driver root, device nodes from
/// `dev_root`.
#[derive(Debug, Clone)]
pub struct NvmlSource {
    /// Where this process sees the host's `/` (`/`, or `/host` in the node DaemonSet).
    pub host_root: PathBuf,
    /// The driver root as a host path (`/`, `/run/nvidia/driver`); `None` detects it.
    pub driver_root: Option<PathBuf>,
    /// Where `/dev` is (`/` on the host; a host mount in a container).
    pub dev_root: PathBuf,
    /// Where `/proc` is.
    pub proc_root: PathBuf,
    /// Explicit `libnvidia-ml.so.1` path (as this process sees it); default: the dynamic
    /// loader's search on the host, else the one the driver search finds.
    pub library: Option<PathBuf>,
}

impl Default for NvmlSource {
    fn default() -> Self {
        Self {
            host_root: "/".into(),
            driver_root: None,
            dev_root: "/".into(),
            proc_root: "/".into(),
            library: None,
        }
    }
}

fn call(name: &str) -> impl FnOnce(NvmlError) -> InventoryError + '_ {
    move |e| InventoryError::Nvml {
        call: name.to_string(),
        reason: e.to_string(),
    }
}

fn rooted(root: &Path, path: &str) -> PathBuf {
    root.join(path.trim_start_matches('/'))
}

/// Reads a character device's major/minor.
fn device_node(dev_root: &Path, path: &str) -> Option<DeviceNode> {
    let meta = std::fs::metadata(rooted(dev_root, path)).ok()?;
    if !meta.file_type().is_char_device() {
        return None;
    }
    let rdev = meta.rdev();
    Some(DeviceNode {
        path: path.into(),
        major: libc::major(rdev),
        minor: libc::minor(rdev),
    })
}

/// NVIDIA's MIG profile naming (go-nvlib): memory as a fraction of the card rounded up to
/// eighths, times the card's GB, rounded.
pub(crate) fn mig_profile_name(
    gpu_slices: u32,
    compute_slices: u32,
    mig_memory_mb: u64,
    total_memory_mb: u64,
) -> String {
    let eighths = (mig_memory_mb * 8).div_ceil(total_memory_mb.max(1));
    let gb = ((eighths as f64 / 8.0) * (total_memory_mb as f64 / 1024.0)).round() as u64;
    if compute_slices < gpu_slices {
        format!("{compute_slices}c.{gpu_slices}g.{gb}gb")
    } else {
        format!("{gpu_slices}g.{gb}gb")
    }
}

/// The libnvidia-ml this process has loaded (`/proc/self/maps`).
fn loaded_library() -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.rsplit('/').next().is_some_and(|n| n.starts_with("libnvidia-ml.so")))
        .map(PathBuf::from)
}

impl NvmlSource {
    fn load(&self, lib: Option<&Path>) -> Result<Nvml, InventoryError> {
        let mut builder = Nvml::builder();
        if let Some(lib) = lib {
            builder.lib_path(lib.as_os_str());
        }
        builder.init().map_err(|e| match e {
            NvmlError::LibloadingError(_) | NvmlError::FailedToLoadSymbol(_) | NvmlError::DriverNotLoaded => {
                InventoryError::NvmlUnavailable { reason: e.to_string() }
            }
            other => InventoryError::Nvml {
                call: "nvmlInit".into(),
                reason: other.to_string(),
            },
        })
    }

    fn search(&self) -> DriverSearch {
        DriverSearch {
            host_root: self.host_root.clone(),
            driver_root: self.driver_root.clone(),
            ..Default::default()
        }
    }

    /// Loads NVML: the given library; else, on the host, the loader's search; else the
    /// `libnvidia-ml` the driver search finds (in a container that sees the host under
    /// `host_root`). Returns it with the host directory it was loaded from, when known.
    /// NVML, loaded as [`InventorySource::discover`] loads it (the library named, else the
    /// driver's under the host root, else the loader's search path).
    pub fn open(&self) -> Result<Nvml, InventoryError> {
        self.init().map(|(nvml, _)| nvml)
    }

    fn init(&self) -> Result<(Nvml, Option<PathBuf>), InventoryError> {
        if let Some(lib) = &self.library {
            let nvml = self.load(Some(lib))?;
            return Ok((nvml, self.loaded_dir()));
        }
        let first = if self.host_root == Path::new("/") {
            match self.load(None) {
                Ok(nvml) => return Ok((nvml, self.loaded_dir())),
                Err(e) => Some(e),
            }
        } else {
            None
        };
        let found = driver::discover(&self.search());
        let ml = found
            .files
            .iter()
            .find(|f| f.stem().as_deref() == Some("libnvidia-ml"))
            .map(|f| {
                self.host_root
                    .join(found.host_path(f).strip_prefix("/").unwrap_or(&found.host_path(f)))
            });
        match ml {
            Some(lib) => {
                let nvml = self.load(Some(&lib))?;
                Ok((nvml, self.loaded_dir()))
            }
            None => Err(first.unwrap_or_else(|| InventoryError::NvmlUnavailable {
                reason: format!(
                    "no libnvidia-ml under {} (driver roots tried: {})",
                    self.host_root.display(),
                    found
                        .tried
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            })),
        }
    }

    /// The `libnvidia-ml` NVML loads from, as this process sees it (loaded as [`Self::open`]
    /// loads it): for the calls the wrapper lacks, loaded again from the same file.
    pub fn library_path(&self) -> Result<PathBuf, InventoryError> {
        let _nvml = self.open()?;
        loaded_library().ok_or_else(|| InventoryError::NvmlUnavailable {
            reason: "NVML loaded, but /proc/self/maps does not show from where".into(),
        })
    }

    /// The host directory this process loaded libnvidia-ml from (`/proc/self/maps`).
    fn loaded_dir(&self) -> Option<PathBuf> {
        let lib = loaded_library()?;
        let dir = lib.parent()?;
        let host = dir.strip_prefix(&self.host_root).ok()?;
        Some(Path::new("/").join(host))
    }

    /// The driver's files, found with NVML's help (its version and directory) when it loads.
    /// Needs no GPU: without NVML the version comes from libcuda's file name.
    pub fn driver(&self) -> Driver {
        match self.init() {
            Ok((nvml, dir)) => self.driver_with(&nvml, dir),
            Err(_) => driver::discover(&self.search()),
        }
    }

    fn driver_with(&self, nvml: &Nvml, nvml_dir: Option<PathBuf>) -> Driver {
        driver::discover(&DriverSearch {
            nvml_dir,
            version: nvml.sys_driver_version().ok(),
            ..self.search()
        })
    }

    fn mig_devices(
        &self,
        nvml: &Nvml,
        parent: &nvml_wrapper::Device<'_>,
        parent_minor: u32,
        parent_memory_mb: u64,
        minors: &mut Option<MigMinors>,
    ) -> Result<Vec<MigDevice>, InventoryError> {
        let max = parent
            .mig_device_count()
            .map_err(call("nvmlDeviceGetMaxMigDeviceCount"))?;
        let mut out = Vec::new();
        for i in 0..max {
            let mig = match parent.mig_device_by_index(i) {
                Ok(m) => m,
                Err(NvmlError::NotFound | NvmlError::InvalidArg) => continue,
                Err(e) => return Err(call("nvmlDeviceGetMigDeviceHandleByIndex")(e)),
            };
            let uuid = mig.uuid().map_err(call("nvmlDeviceGetUUID"))?;
            let attrs = mig.attributes().map_err(call("nvmlDeviceGetAttributes"))?;
            let (gi, ci) = instance_ids(nvml, &mig)?;
            let profile_name = mig_profile_name(
                attrs.gpu_instance_slice_count,
                attrs.compute_instance_slice_count,
                attrs.memory_size_mb,
                parent_memory_mb,
            );
            let profile: MigProfile =
                profile_name
                    .parse()
                    .map_err(|e: tessera_core::mig::BadMigProfile| InventoryError::Nvml {
                        call: "nvmlDeviceGetAttributes".into(),
                        reason: e.to_string(),
                    })?;
            if minors.is_none() {
                *minors = Some(MigMinors::read(&rooted(&self.proc_root, MIG_MINORS_PATH))?);
            }
            let table = minors.as_ref().expect("just read");
            let caps_major = device_node(&self.dev_root, "/dev/nvidia-caps")
                .map(|n| n.major)
                .or_else(|| proc_devices_major(&self.proc_root, "nvidia-caps"))
                .ok_or_else(|| InventoryError::Invalid {
                    field: "/proc/devices".into(),
                    value: "nvidia-caps".into(),
                    reason: "no character major for nvidia-caps".into(),
                })?;
            let gm = table.gi_access(parent_minor, gi)?;
            let cm = table.ci_access(parent_minor, gi, ci)?;
            out.push(MigDevice {
                index: out.len() as u32,
                uuid,
                gi,
                ci,
                profile,
                memory_mib: attrs.memory_size_mb,
                gi_access: DeviceNode {
                    path: cap_path(gm),
                    major: caps_major,
                    minor: gm,
                },
                ci_access: DeviceNode {
                    path: cap_path(cm),
                    major: caps_major,
                    minor: cm,
                },
                // SAFETY: `parent.handle()` is a live handle owned by `nvml`.
                placement: super::nvml_mig::placement_of(nvml, unsafe { parent.handle() }, gi).map_err(|e| {
                    InventoryError::Nvml {
                        call: "nvmlGpuInstanceGetInfo".into(),
                        reason: e.to_string(),
                    }
                })?,
            });
        }
        Ok(out)
    }
}

/// GPU and compute instance ids of a MIG handle (not wrapped by nvml-wrapper; called through
/// the raw bindings it exposes).
pub(crate) fn instance_ids(nvml: &Nvml, mig: &nvml_wrapper::Device<'_>) -> Result<(u32, u32), InventoryError> {
    let lib = nvml.lib();
    let get_gi = lib
        .nvmlDeviceGetGpuInstanceId
        .as_ref()
        .map_err(|e| InventoryError::Nvml {
            call: "nvmlDeviceGetGpuInstanceId".into(),
            reason: e.to_string(),
        })?;
    let get_ci = lib
        .nvmlDeviceGetComputeInstanceId
        .as_ref()
        .map_err(|e| InventoryError::Nvml {
            call: "nvmlDeviceGetComputeInstanceId".into(),
            reason: e.to_string(),
        })?;
    let (mut gi, mut ci) = (0u32, 0u32);
    // SAFETY: `mig.handle()` is a live MIG device handle owned by `nvml`, and both out-pointers
    // point at valid u32s for the duration of the calls.
    let (r1, r2) = unsafe { (get_gi(mig.handle(), &mut gi), get_ci(mig.handle(), &mut ci)) };
    for (name, r) in [
        ("nvmlDeviceGetGpuInstanceId", r1),
        ("nvmlDeviceGetComputeInstanceId", r2),
    ] {
        if r != 0 {
            return Err(InventoryError::Nvml {
                call: name.into(),
                reason: format!("NVML return code {r}"),
            });
        }
    }
    Ok((gi, ci))
}

/// The major of a character driver in `/proc/devices`.
fn proc_devices_major(proc_root: &Path, driver: &str) -> Option<u32> {
    let text = std::fs::read_to_string(rooted(proc_root, "/proc/devices")).ok()?;
    text.lines()
        .take_while(|l| !l.starts_with("Block"))
        .filter_map(|l| l.trim().split_once(' '))
        .find(|(_, name)| *name == driver)
        .and_then(|(major, _)| major.parse().ok())
}

/// NVML's compute mode in the inventory's words.
fn compute_mode(mode: nvml_wrapper::enum_wrappers::device::ComputeMode) -> ComputeMode {
    use nvml_wrapper::enum_wrappers::device::ComputeMode as Nvml;
    match mode {
        Nvml::Default => ComputeMode::Default,
        Nvml::ExclusiveThread => ComputeMode::ExclusiveThread,
        Nvml::Prohibited => ComputeMode::Prohibited,
        Nvml::ExclusiveProcess => ComputeMode::ExclusiveProcess,
    }
}

impl InventorySource for NvmlSource {
    fn discover(&self) -> Result<NodeInventory, InventoryError> {
        let (nvml, nvml_dir) = self.init()?;
        let driver_version = nvml.sys_driver_version().map_err(call("nvmlSystemGetDriverVersion"))?;
        let driver = self.driver_with(&nvml, nvml_dir);
        let cuda_version = nvml
            .sys_cuda_driver_version()
            .ok()
            .map(|v| format!("{}.{}", v / 1000, (v % 1000) / 10));
        let count = nvml.device_count().map_err(call("nvmlDeviceGetCount"))?;
        let nvidia_major = proc_devices_major(&self.proc_root, "nvidia-frontend")
            .or_else(|| proc_devices_major(&self.proc_root, "nvidia"))
            .unwrap_or(195);
        let mut minors = None;
        let mut gpus = Vec::new();
        for index in 0..count {
            let dev = nvml
                .device_by_index(index)
                .map_err(call("nvmlDeviceGetHandleByIndex"))?;
            let minor = dev.minor_number().map_err(call("nvmlDeviceGetMinorNumber"))?;
            let memory_mib = dev.memory_info().map_err(call("nvmlDeviceGetMemoryInfo"))?.total >> 20;
            let pci_bus_id = dev
                .pci_info()
                .map_err(call("nvmlDeviceGetPciInfo"))?
                .bus_id
                .to_lowercase();
            let mig_enabled = dev.mig_mode().is_ok_and(|m| m.current == 1);
            let (mig_devices, mig_profiles) = if mig_enabled {
                // SAFETY: `dev.handle()` is a live handle owned by `nvml`.
                let profiles = super::nvml_mig::profiles(&nvml, unsafe { dev.handle() }, memory_mib).map_err(|e| {
                    InventoryError::Nvml {
                        call: "nvmlDeviceGetGpuInstanceProfileInfo".into(),
                        reason: e.to_string(),
                    }
                })?;
                (self.mig_devices(&nvml, &dev, minor, memory_mib, &mut minors)?, profiles)
            } else {
                (Vec::new(), Vec::new())
            };
            let path = format!("/dev/nvidia{minor}");
            gpus.push(Gpu {
                index,
                minor,
                uuid: dev.uuid().map_err(call("nvmlDeviceGetUUID"))?,
                model: dev.name().map_err(call("nvmlDeviceGetName"))?,
                memory_mib,
                numa_node: dev.numa_node_id().ok(),
                cpu_affinity: super::nvml_topology::cpu_affinity(&nvml, index),
                pci_bus_id,
                health: Health::Healthy,
                device: device_node(&self.dev_root, &path).unwrap_or(DeviceNode {
                    path: path.into(),
                    major: nvidia_major,
                    minor,
                }),
                mig_enabled,
                mig_devices,
                mig_profiles,
                compute_mode: dev.compute_mode().ok().map(compute_mode),
            });
        }
        let control_devices = CONTROL_DEVICES
            .iter()
            .filter_map(|d| device_node(&self.dev_root, &format!("/dev/{d}")))
            .collect();
        let bus_ids: Vec<String> = gpus.iter().map(|g| g.pci_bus_id.clone()).collect();
        let topology = super::nvml_topology::discover(&nvml, &bus_ids);
        let inventory = NodeInventory {
            topology,
            driver_error: driver.check().err().map(|e| e.to_string()),
            driver_files: driver.files,
            driver_version,
            cuda_version,
            gpus,
            control_devices,
            driver_root: driver.root,
        };
        inventory.validate()?;
        Ok(inventory)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profile_names_follow_nvidia() {
        // A100-SXM4-40GB (40960 MiB).
        assert_eq!(mig_profile_name(1, 1, 4864, 40960), "1g.5gb");
        assert_eq!(mig_profile_name(3, 3, 19968, 40960), "3g.20gb");
        assert_eq!(mig_profile_name(7, 7, 40192, 40960), "7g.40gb");
        assert_eq!(mig_profile_name(3, 1, 19968, 40960), "1c.3g.20gb");
        // A100 80GB (81920 MiB): a one-slice instance is 1g.10gb.
        assert_eq!(mig_profile_name(1, 1, 9728, 81920), "1g.10gb");
    }

    #[test]
    fn missing_library_is_a_clear_error() {
        let src = NvmlSource {
            library: Some("/nonexistent/libnvidia-ml.so.1".into()),
            ..Default::default()
        };
        let err = src.discover().unwrap_err();
        assert!(matches!(err, InventoryError::NvmlUnavailable { .. }), "{err}");
        assert!(err.to_string().contains("NVML is not available"));
    }

    #[test]
    fn reads_majors_from_proc_devices() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("proc")).unwrap();
        std::fs::write(
            dir.path().join("proc/devices"),
            "Character devices:\n  1 mem\n195 nvidia-frontend\n508 nvidia-uvm\n509 nvidia-caps\n\nBlock devices:\n  8 sd\n",
        )
        .unwrap();
        assert_eq!(proc_devices_major(dir.path(), "nvidia-caps"), Some(509));
        assert_eq!(proc_devices_major(dir.path(), "nvidia-frontend"), Some(195));
        assert_eq!(proc_devices_major(dir.path(), "sd"), None);
    }
}
