//! Where the NVIDIA driver's user-space files are on a node, found the way GPU nodes really lay
//! them out, with no GPU needed.
//!
//! A *driver root* is a host directory the driver's files live under: `/` for distribution
//! packages, `/run/nvidia/driver` for the GPU operator's driver container, `/usr/local/nvidia`
//! (GKE) and `/home/kubernetes/bin/nvidia` (COS) with `lib64/` and `bin/` directly under it.
//! Each library is looked up by name, in this order:
//! 1. the root's own `etc/ld.so.cache` ([`ldcache`]), as the dynamic loader would find it;
//! 2. the directory NVML was loaded from, when the caller loaded it;
//! 3. a search of the root's library directories.
//!
//! Every other `lib*.so.<driver version>` in libcuda's own directory is taken too, as NVIDIA's
//! container toolkit does (a driver's libraries are installed together; a newer driver's new
//! library needs no change here). Programs are looked up by name beside NVML, in the root's
//! program directories and beside the libraries; GSP firmware under the root, beside the
//! libraries, then where the kernel loads it from on the host; the driver's daemons' sockets
//! under the root, then on the host.
//!
//! Links are followed inside the root (an absolute link in `/run/nvidia/driver` points inside
//! it, not at the host's `/`), down to the versioned file. Every file records how it was found.

mod elf;
pub mod ldcache;
mod resolve;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

use std::collections::BTreeSet;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use tessera_core::driver::{DriverFile, DriverFileKind, FoundBy};

pub use elf::soname;
pub use resolve::resolve_in_root;

use ldcache::LdCache;

/// Driver roots tried, in order, when none is given.
pub const DRIVER_ROOTS: &[&str] = &[
    "/run/nvidia/driver",
    "/",
    "/usr/local/nvidia",
    "/home/kubernetes/bin/nvidia",
];

/// The multiarch directory name of this build's machine (`x86_64-linux-gnu`).
fn triplet() -> &'static str {
    match std::env::consts::ARCH {
        "aarch64" => "aarch64-linux-gnu",
        "powerpc64" => "powerpc64le-linux-gnu",
        _ => "x86_64-linux-gnu",
    }
}

/// Library directories searched under a root, in order.
pub fn library_dirs() -> Vec<String> {
    let t = triplet();
    vec![
        format!("usr/lib/{t}"),
        "usr/lib64".into(),
        "usr/lib".into(),
        "lib64".into(),
        format!("lib/{t}"),
        "lib".into(),
    ]
}

/// Program directories searched under a root, in order.
pub const BINARY_DIRS: &[&str] = &["usr/bin", "bin", "usr/local/bin", "usr/sbin", "sbin"];
/// Firmware directories under a root (`<dir>/<driver version>/gsp_*.bin`).
pub const FIRMWARE_DIRS: &[&str] = &["lib/firmware/nvidia", "usr/lib/firmware/nvidia", "firmware/nvidia"];

/// Where the kernel loads firmware from on the host, in its own order (`<release>` is the
/// running kernel's `uname -r`); `firmware_class.path`, when set, comes first.
pub const KERNEL_FIRMWARE_DIRS: &[&str] = &[
    "lib/firmware/updates/<release>",
    "lib/firmware/updates",
    "lib/firmware/<release>",
    "lib/firmware",
];

/// The driver's daemons' sockets given to containers when present (under the root, else on the
/// host): nvidia-persistenced, and NVIDIA Fabric Manager on NVSwitch systems.
pub const SOCKETS: &[&str] = &[
    "run/nvidia-persistenced/socket",
    "var/run/nvidia-persistenced/socket",
    "run/nvidia-fabricmanager/socket",
    "var/run/nvidia-fabricmanager/socket",
];

/// One driver library Tessera gives GPU containers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LibrarySpec {
    /// File name before `.so` (`libcuda`).
    pub stem: &'static str,
    /// Containers cannot use the GPU without it.
    pub required: bool,
}

const fn lib(stem: &'static str, required: bool) -> LibrarySpec {
    LibrarySpec { stem, required }
}

/// The driver's compute, utility and video libraries (NVIDIA's `compute,utility,video`
/// capabilities), the set CUDA, NVML, OpenCL and NVDEC/NVENC workloads load.
pub const LIBRARIES: &[LibrarySpec] = &[
    lib("libcuda", true),
    lib("libnvidia-ml", true),
    lib("libnvidia-ptxjitcompiler", false),
    lib("libnvidia-nvvm", false),
    lib("libnvidia-gpucomp", false),
    lib("libnvidia-allocator", false),
    lib("libnvidia-cfg", false),
    lib("libnvidia-opencl", false),
    lib("libcudadebugger", false),
    lib("libnvidia-pkcs11", false),
    lib("libnvidia-pkcs11-openssl3", false),
    lib("libnvcuvid", false),
    lib("libnvidia-encode", false),
    lib("libnvidia-opticalflow", false),
    // NVSwitch systems (HGX): NVML reads the switches through it.
    lib("libnvidia-nscq", false),
    // Tile IR compiler (580 on).
    lib("libnvidia-tileiras", false),
];

/// The driver's programs given to containers when present.
pub const BINARIES: &[&str] = &[
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
    // NVSwitch / multi-node NVLink systems.
    "nv-fabricmanager",
    "nvidia-imex",
    "nvidia-imex-ctl",
];

/// Where the driver version came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum VersionSource {
    /// `nvmlSystemGetDriverVersion`.
    Nvml,
    /// The versioned file name of libcuda (`libcuda.so.580.95.05`).
    LibcudaName,
}

/// How the driver root was chosen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RootChoice {
    /// Given by the operator (`--driver-root`).
    Given,
    /// The first of [`DRIVER_ROOTS`] holding libcuda (NVML's own root first).
    Detected,
    /// No root holds libcuda: the first that holds any driver library, else `/`.
    Fallback,
}

/// Why the driver found cannot serve GPU containers.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DriverError {
    /// No libcuda anywhere: every CUDA program in a GPU container would fail.
    #[error(
        "no libcuda found under driver root {root} (tried {tried}): GPU containers could not run CUDA; \
         pass --driver-root where the driver's libraries are"
    )]
    NoLibcuda { root: String, tried: String },
    /// A required library is missing.
    #[error("driver root {root}: {library} not found")]
    Missing { root: String, library: String },
    /// libcuda is of another version than the loaded driver.
    #[error("driver root {root}: {file} does not match driver version {version}")]
    VersionMismatch {
        root: String,
        file: String,
        version: String,
    },
}

/// What to look for.
#[derive(Debug, Clone)]
pub struct DriverSearch {
    /// Where this process sees the host's `/` (`/`, or `/host` in a container).
    pub host_root: PathBuf,
    /// The driver root as a host path; `None` detects it.
    pub driver_root: Option<PathBuf>,
    /// The host directory NVML was loaded from, when the caller loaded it.
    pub nvml_dir: Option<PathBuf>,
    /// The driver version from NVML, when the caller has it.
    pub version: Option<String>,
}

impl Default for DriverSearch {
    fn default() -> Self {
        Self {
            host_root: "/".into(),
            driver_root: None,
            nvml_dir: None,
            version: None,
        }
    }
}

/// A wanted file that was found at a different version than the driver's, and left out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    /// Path under the root.
    pub path: PathBuf,
    /// Why.
    pub reason: String,
}

/// The driver found under one root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Driver {
    /// Host path of the root.
    pub root: PathBuf,
    /// How it was chosen.
    pub choice: RootChoice,
    /// Roots looked at, in order (one when given).
    pub tried: Vec<PathBuf>,
    /// Driver version, when known.
    pub version: Option<String>,
    /// Where it came from.
    pub version_source: Option<VersionSource>,
    /// Files to mount, sorted by path.
    pub files: Vec<DriverFile>,
    /// Wanted libraries not found (stems).
    pub missing: Vec<&'static str>,
    /// Files found and left out.
    pub skipped: Vec<Skipped>,
}

impl Driver {
    /// The libcuda file.
    pub fn libcuda(&self) -> Option<&DriverFile> {
        self.files.iter().find(|f| f.stem().as_deref() == Some("libcuda"))
    }

    /// Host path of a file.
    pub fn host_path(&self, f: &DriverFile) -> PathBuf {
        f.host_path(&self.root)
    }

    /// Whether GPU containers can run with these files; the error says what is missing.
    pub fn check(&self) -> Result<(), DriverError> {
        let root = self.root.display().to_string();
        if self.libcuda().is_none() {
            if let Some(s) = self
                .skipped
                .iter()
                .find(|s| s.path.to_string_lossy().contains("libcuda.so"))
            {
                return Err(DriverError::VersionMismatch {
                    root,
                    file: s.path.display().to_string(),
                    version: self.version.clone().unwrap_or_default(),
                });
            }
            return Err(DriverError::NoLibcuda {
                root,
                tried: self
                    .tried
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        }
        if let Some(l) = LIBRARIES.iter().find(|l| l.required && self.missing.contains(&l.stem)) {
            return Err(DriverError::Missing {
                root,
                library: format!("{}.so", l.stem),
            });
        }
        Ok(())
    }
}

/// A root as this process reads it.
struct Root {
    /// Host path.
    host: PathBuf,
    /// Where this process reads it.
    local: PathBuf,
    cache: Option<LdCache>,
    /// NVML's directory, relative to the root, when it lies inside it.
    nvml_dir: Option<PathBuf>,
}

impl Root {
    fn new(search: &DriverSearch, host: &Path) -> Self {
        let local = search.host_root.join(host.strip_prefix("/").unwrap_or(host));
        let cache = LdCache::read(&local.join("etc/ld.so.cache")).ok();
        let nvml_dir = search
            .nvml_dir
            .as_ref()
            .and_then(|d| d.strip_prefix(host).ok())
            .map(|rel| Path::new("/").join(rel));
        Self {
            host: host.to_path_buf(),
            local,
            cache,
            nvml_dir,
        }
    }

    fn resolve(&self, path: &Path) -> Option<PathBuf> {
        resolve_in_root(&self.local, path)
    }

    /// Files in `dir` (under the root, its links resolved) whose names `keep`, each resolved
    /// to the file it is, sorted and without repeats; empty when there is no such directory.
    fn matching(&self, dir: &Path, keep: impl Fn(&str) -> bool) -> Vec<PathBuf> {
        let Some(real) = self.resolve_dir(dir) else {
            return Vec::new();
        };
        let Ok(entries) = std::fs::read_dir(self.local.join(real.strip_prefix("/").unwrap_or(&real))) else {
            return Vec::new();
        };
        let out: BTreeSet<PathBuf> = entries
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| keep(n))
            .filter_map(|n| self.resolve(&real.join(n)))
            .collect();
        out.into_iter().collect()
    }

    /// Files in `dir` named `stem.so.*`.
    fn in_dir(&self, dir: &Path, stem: &str) -> Vec<PathBuf> {
        let prefix = format!("{stem}.so.");
        self.matching(dir, |n| n.starts_with(&prefix))
    }

    /// Files in `dir` named `lib*.so.<version>`.
    fn versioned_in_dir(&self, dir: &Path, version: &str) -> Vec<PathBuf> {
        let suffix = format!(".so.{version}");
        self.matching(dir, |n| n.starts_with("lib") && n.ends_with(&suffix))
    }

    /// GSP firmware files (`gsp*.bin`) in `dir`.
    fn firmware_in(&self, dir: &Path) -> Vec<PathBuf> {
        self.matching(dir, |n| n.starts_with("gsp") && n.ends_with(".bin"))
    }

    /// A socket at `path` under the root, resolved.
    fn socket(&self, path: &Path) -> Option<PathBuf> {
        use std::os::unix::fs::FileTypeExt as _;
        let p = resolve::resolve_components(&self.local, path)?;
        std::fs::metadata(self.local.join(p.strip_prefix("/").unwrap_or(&p)))
            .ok()?
            .file_type()
            .is_socket()
            .then_some(p)
    }

    /// A directory under the root with its links resolved.
    fn resolve_dir(&self, dir: &Path) -> Option<PathBuf> {
        let p = resolve::resolve_components(&self.local, dir)?;
        self.local.join(p.strip_prefix("/").unwrap_or(&p)).is_dir().then_some(p)
    }

    /// A library by stem: candidates in lookup order, each with how it was found.
    fn library(&self, stem: &str) -> Vec<(PathBuf, FoundBy, Option<String>)> {
        let mut out = Vec::new();
        if let Some(e) = self.cache.as_ref().and_then(|c| c.find(stem))
            && let Some(p) = self.resolve(Path::new(&e.path))
        {
            out.push((p, FoundBy::LdCache, Some(e.soname.clone())));
        }
        if let Some(d) = &self.nvml_dir {
            out.extend(self.in_dir(d, stem).into_iter().map(|p| (p, FoundBy::NvmlDir, None)));
        }
        for d in library_dirs() {
            out.extend(
                self.in_dir(Path::new("/").join(d).as_path(), stem)
                    .into_iter()
                    .map(|p| (p, FoundBy::Search, None)),
            );
        }
        out
    }

    /// A program by name: beside NVML (`../bin`), in the standard directories, then beside the
    /// libraries found (`/usr/local/nvidia/lib64` -> `/usr/local/nvidia/bin`).
    fn binary(&self, name: &str, lib_dirs: &[PathBuf]) -> Option<(PathBuf, FoundBy)> {
        let nvml_bin = self
            .nvml_dir
            .as_ref()
            .and_then(|d| d.parent())
            .map(|p| (p.join("bin"), FoundBy::NvmlDir));
        let beside = lib_dirs
            .iter()
            .filter_map(|d| d.parent())
            .map(|p| (p.join("bin"), FoundBy::Search));
        nvml_bin
            .into_iter()
            .chain(BINARY_DIRS.iter().map(|d| (Path::new("/").join(d), FoundBy::Search)))
            .chain(beside)
            .find_map(|(dir, how)| {
                let p = self.resolve(&dir.join(name))?;
                Some((p, how))
            })
    }
}

/// The version in a versioned library name (`libcuda.so.580.95.05` -> `580.95.05`).
pub fn version_of(file_name: &str) -> Option<&str> {
    let (_, v) = file_name.split_once(".so.")?;
    (v.contains('.')
        && v.split('.')
            .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit())))
    .then_some(v)
}

fn choose(found: &[(PathBuf, FoundBy, Option<String>)], version: Option<&str>) -> Option<usize> {
    match version {
        // The file of the driver's version, by the first method that finds one.
        Some(v) => found
            .iter()
            .position(|(p, _, _)| p.file_name().and_then(|n| n.to_str()).and_then(version_of) == Some(v)),
        // No version known: the first versioned file, in lookup order.
        None => found
            .iter()
            .position(|(p, _, _)| p.file_name().and_then(|n| n.to_str()).and_then(version_of).is_some()),
    }
}

/// Finds the driver: the root (given, or detected), the version, and every file.
pub fn discover(search: &DriverSearch) -> Driver {
    let (roots, choice): (Vec<PathBuf>, RootChoice) = match &search.driver_root {
        Some(r) => (vec![r.clone()], RootChoice::Given),
        None => {
            let mut rs: Vec<PathBuf> = DRIVER_ROOTS.iter().map(PathBuf::from).collect();
            // The root NVML was loaded from goes first (the deepest one holding its directory).
            if let Some(d) = &search.nvml_dir
                && let Some(best) = rs
                    .iter()
                    .filter(|r| d.starts_with(r))
                    .max_by_key(|r| r.as_os_str().len())
                    .cloned()
            {
                rs.retain(|r| *r != best);
                rs.insert(0, best);
            }
            (rs, RootChoice::Detected)
        }
    };
    let existing: Vec<Root> = roots
        .iter()
        .map(|r| Root::new(search, r))
        .filter(|r| r.local.is_dir())
        .collect();
    let has = |r: &Root, stem: &str| choose(&r.library(stem), search.version.as_deref()).is_some();
    let (root, choice) = match existing.iter().position(|r| has(r, "libcuda")) {
        Some(i) => (i, choice),
        None => {
            let any = existing.iter().position(|r| LIBRARIES.iter().any(|l| has(r, l.stem)));
            (
                any.unwrap_or(0),
                if choice == RootChoice::Given {
                    choice
                } else {
                    RootChoice::Fallback
                },
            )
        }
    };
    let tried = roots.clone();
    let Some(root) = existing.get(root) else {
        return Driver {
            root: roots.first().cloned().unwrap_or_else(|| "/".into()),
            choice,
            tried,
            version: search.version.clone(),
            version_source: search.version.as_ref().map(|_| VersionSource::Nvml),
            files: Vec::new(),
            missing: LIBRARIES.iter().map(|l| l.stem).collect(),
            skipped: Vec::new(),
        };
    };
    collect(search, root, choice, tried)
}

/// The kernel's firmware search path (`firmware_class.path`), as the host sets it.
fn firmware_class_path(search: &DriverSearch) -> Option<PathBuf> {
    const PARAM: &str = "sys/module/firmware_class/parameters/path";
    [search.host_root.join(PARAM), Path::new("/").join(PARAM)]
        .iter()
        .find_map(|p| std::fs::read_to_string(p).ok())
        .map(|s| s.trim().to_string())
        .filter(|s| s.starts_with('/'))
        .map(PathBuf::from)
}

/// GSP firmware of `version`: the first directory holding some, under the root, beside the
/// libraries (`/usr/local/nvidia/firmware`), then where the kernel loads it on the host.
fn firmware(
    search: &DriverSearch,
    root: &Root,
    host: Option<&Root>,
    lib_dirs: &[PathBuf],
    version: &str,
) -> Vec<DriverFile> {
    let in_root = FIRMWARE_DIRS.iter().map(|d| Path::new("/").join(d)).chain(
        lib_dirs
            .iter()
            .filter_map(|d| d.parent())
            .map(|p| p.join("firmware/nvidia")),
    );
    for dir in in_root {
        let fw = root.firmware_in(&dir.join(version));
        if !fw.is_empty() {
            return fw.into_iter().map(|path| firmware_file(path, false)).collect();
        }
    }
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let on_host = host.is_some();
    let host = host.unwrap_or(root);
    let kernel = firmware_class_path(search).into_iter().chain(
        KERNEL_FIRMWARE_DIRS
            .iter()
            .filter(|d| !release.is_empty() || !d.contains("<release>"))
            .map(|d| Path::new("/").join(d.replace("<release>", &release))),
    );
    for dir in kernel {
        let fw = host.firmware_in(&dir.join("nvidia").join(version));
        if !fw.is_empty() {
            return fw.into_iter().map(|path| firmware_file(path, on_host)).collect();
        }
    }
    Vec::new()
}

fn firmware_file(path: PathBuf, on_host: bool) -> DriverFile {
    DriverFile {
        path,
        kind: DriverFileKind::Firmware,
        found_by: if on_host { FoundBy::Host } else { FoundBy::Search },
        soname: None,
        on_host,
    }
}

/// The daemons' sockets present under the root, else on the host.
fn sockets(root: &Root, host: Option<&Root>) -> Vec<DriverFile> {
    let mut out: Vec<DriverFile> = Vec::new();
    for s in SOCKETS {
        let path = Path::new("/").join(s);
        let found = root
            .socket(&path)
            .map(|p| (p, false))
            .or_else(|| host.and_then(|h| h.socket(&path)).map(|p| (p, true)));
        if let Some((path, on_host)) = found
            && !out.iter().any(|f| f.path == path)
        {
            out.push(DriverFile {
                path,
                kind: DriverFileKind::Socket,
                found_by: if on_host { FoundBy::Host } else { FoundBy::Search },
                soname: None,
                on_host,
            });
        }
    }
    out
}

fn collect(search: &DriverSearch, root: &Root, choice: RootChoice, tried: Vec<PathBuf>) -> Driver {
    let mut version = search.version.clone();
    let mut version_source = version.as_ref().map(|_| VersionSource::Nvml);
    if version.is_none() {
        let cuda = root.library("libcuda");
        if let Some(i) = choose(&cuda, None) {
            version = cuda[i]
                .0
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(version_of)
                .map(str::to_string);
            version_source = version.as_ref().map(|_| VersionSource::LibcudaName);
        }
    }
    let mut files = Vec::new();
    let mut missing = Vec::new();
    let mut skipped = Vec::new();
    for l in LIBRARIES {
        let found = root.library(l.stem);
        match choose(&found, version.as_deref()) {
            Some(i) => {
                let (path, found_by, cache_soname) = found[i].clone();
                let local = root.local.join(path.strip_prefix("/").unwrap_or(&path));
                let soname = cache_soname.or_else(|| soname(&local));
                files.push(DriverFile {
                    path,
                    kind: DriverFileKind::Library,
                    found_by,
                    soname,
                    on_host: false,
                });
            }
            None => {
                missing.push(l.stem);
                if let Some((p, _, _)) = found.first() {
                    skipped.push(Skipped {
                        path: p.clone(),
                        reason: format!("not of driver version {}", version.as_deref().unwrap_or("(unknown)")),
                    });
                }
            }
        }
    }
    // Every other library of the driver's version beside libcuda, as NVIDIA's toolkit mounts.
    let libcuda_dir = files
        .iter()
        .find(|f| f.stem().as_deref() == Some("libcuda"))
        .and_then(|f| f.path.parent().map(Path::to_path_buf));
    if let (Some(v), Some(dir)) = (&version, libcuda_dir) {
        for path in root.versioned_in_dir(&dir, v) {
            if files.iter().any(|f| f.path == path) {
                continue;
            }
            let local = root.local.join(path.strip_prefix("/").unwrap_or(&path));
            files.push(DriverFile {
                soname: soname(&local),
                path,
                kind: DriverFileKind::Library,
                found_by: FoundBy::LibcudaDir,
                on_host: false,
            });
        }
        missing.retain(|stem| !files.iter().any(|f| f.stem().as_deref() == Some(*stem)));
    }
    let mut lib_dirs: Vec<PathBuf> = files
        .iter()
        .filter_map(|f| f.path.parent().map(Path::to_path_buf))
        .collect();
    lib_dirs.sort();
    lib_dirs.dedup();
    for b in BINARIES {
        if let Some((path, found_by)) = root.binary(b, &lib_dirs) {
            files.push(DriverFile {
                path,
                kind: DriverFileKind::Binary,
                found_by,
                soname: None,
                on_host: false,
            });
        }
    }
    let host = (root.host != Path::new("/")).then(|| Root::new(search, Path::new("/")));
    if let Some(v) = &version {
        files.extend(firmware(search, root, host.as_ref(), &lib_dirs, v));
    }
    files.extend(sockets(root, host.as_ref()));
    files.sort();
    files.dedup_by(|a, b| a.path == b.path);
    Driver {
        root: root.host.clone(),
        choice,
        tried,
        version,
        version_source,
        files,
        missing,
        skipped,
    }
}

#[cfg(test)]
mod tests;
