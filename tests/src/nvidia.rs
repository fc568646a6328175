//! NVIDIA's real driver userspace, no GPU needed: Debian's non-free packages of two driver
//! branches unpacked by `tests/nvidia/fetch.sh` (cached under `.cache/nvidia`), and fake host
//! roots built from those real files in the layouts GPU nodes have. Without a GPU the real
//! `nvidia-cuda-mps-control` runs (it answers every control command), libcuda loads and answers
//! `cuDriverGetVersion`, and `cuInit` returns 100 (no device).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::fetched::{self, Items};

/// A driver branch, as Debian ships it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Branch {
    /// bookworm's 535.x (CUDA 12.2 driver API).
    R535,
    /// trixie's 550.x (CUDA 12.4 driver API).
    R550,
}

impl Branch {
    /// Both, for tests that run on each.
    pub const ALL: [Branch; 2] = [Branch::R535, Branch::R550];

    fn key(self) -> &'static str {
        match self {
            Branch::R535 => "535",
            Branch::R550 => "550",
        }
    }

    /// What libcuda's `cuDriverGetVersion` reports for the branch.
    pub fn cuda_driver_version(self) -> i32 {
        match self {
            Branch::R535 => 12020,
            Branch::R550 => 12040,
        }
    }
}

/// Where a node keeps the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Layout {
    /// Distribution packages at `/` (Debian's, with its update-alternatives links and an
    /// `ld.so.cache` made by `ldconfig`).
    Distro,
    /// GKE: `/usr/local/nvidia/{lib64,bin,firmware}`, lib64 in the host's ld cache.
    Gke,
    /// Container-Optimized OS: `/home/kubernetes/bin/nvidia`, in no ld cache.
    Cos,
    /// The GPU operator's driver container at `/run/nvidia/driver`; nothing on the host.
    Operator,
}

impl Layout {
    /// Every layout.
    pub const ALL: [Layout; 4] = [Layout::Distro, Layout::Gke, Layout::Cos, Layout::Operator];

    /// The name `fetch.sh` gives it.
    pub fn name(self) -> &'static str {
        match self {
            Layout::Distro => "distro",
            Layout::Gke => "gke",
            Layout::Cos => "cos",
            Layout::Operator => "operator",
        }
    }

    /// The driver root discovery should choose on this layout (a host path).
    pub fn driver_root(self) -> &'static str {
        match self {
            Layout::Distro | Layout::Gke => "/",
            Layout::Cos => "/home/kubernetes/bin/nvidia",
            Layout::Operator => "/run/nvidia/driver",
        }
    }
}

/// The fetched userspace.
#[derive(Debug)]
pub struct Userspace {
    items: Items,
}

impl Userspace {
    /// Fetches (or finds cached) packages; the first call in a process runs `fetch.sh`.
    pub fn get() -> anyhow::Result<&'static Userspace> {
        static USERSPACE: OnceLock<Result<Userspace, String>> = OnceLock::new();
        USERSPACE
            .get_or_init(|| {
                let want: Vec<String> = Branch::ALL
                    .iter()
                    .flat_map(|b| {
                        ["pkg"]
                            .into_iter()
                            .chain(Layout::ALL.iter().map(|l| l.name()))
                            .map(move |l| format!("{}/{l}", b.key()))
                    })
                    .chain([
                        "cudart11".to_string(),
                        "libomp5".to_string(),
                        "libc6".to_string(),
                        "libc6-2.31".to_string(),
                    ])
                    .collect();
                let want: Vec<&str> = want.iter().map(String::as_str).collect();
                fetched::fetch("nvidia/fetch.sh", "TESSERA_NVIDIA_CACHE", "ready-v4", &want)
                    .map(|items| Userspace { items })
                    .map_err(|e| format!("{e:#}"))
            })
            .as_ref()
            .map_err(|e| anyhow::anyhow!("{e}"))
    }

    fn item(&self, name: &str) -> &(String, PathBuf) {
        &self.items[name]
    }

    /// The driver version (`535.261.03`).
    pub fn version(&self, b: Branch) -> &str {
        &self.item(&format!("{}/pkg", b.key())).0
    }

    /// The packages unpacked as they are (`usr/bin/nvidia-cuda-mps-control`, ...).
    pub fn packages(&self, b: Branch) -> &Path {
        &self.item(&format!("{}/pkg", b.key())).1
    }

    /// A fake host root holding the driver in `layout`.
    pub fn root(&self, b: Branch, layout: Layout) -> &Path {
        &self.item(&format!("{}/{}", b.key(), layout.name())).1
    }

    /// The real `nvidia-cuda-mps-control`.
    pub fn mps_control(&self, b: Branch) -> PathBuf {
        self.packages(b).join("usr/bin/nvidia-cuda-mps-control")
    }

    /// The directory holding the real libcuda (and the rest of the driver's libraries).
    pub fn library_dir(&self, b: Branch) -> PathBuf {
        self.packages(b).join("usr/lib/x86_64-linux-gnu/nvidia/current")
    }

    /// Debian's glibc, unpacked (a root for images that need a C library).
    pub fn libc6(&self) -> &Path {
        &self.item("libc6").1
    }

    /// Starts an image's root filesystem at `rootfs`: Debian's glibc ([`Userspace::libc6`]),
    /// which NVIDIA's programs and libraries need, and an empty `/tmp`.
    pub fn rootfs_with_libc6(&self, rootfs: &Path) -> anyhow::Result<()> {
        std::fs::create_dir_all(rootfs.join("tmp"))?;
        let st = std::process::Command::new("cp")
            .arg("-a")
            .arg(format!("{}/.", self.libc6().display()))
            .arg(rootfs)
            .status()?;
        anyhow::ensure!(st.success(), "copying libc6 into {}", rootfs.display());
        Ok(())
    }

    /// Debian bullseye's glibc 2.31 and its programs (`usr/bin/getent`, ...), unpacked: the
    /// oldest glibc reachable here.
    pub fn libc6_2_31(&self) -> &Path {
        &self.item("libc6-2.31").1
    }

    /// The CUDA 11.8 runtime (`usr/lib/x86_64-linux-gnu/libcudart.so.11.0`).
    pub fn cudart11(&self) -> &Path {
        &self.item("cudart11").1
    }

    /// LLVM's OpenMP runtime 14 (`usr/lib/llvm-14/lib/libomp.so.5`).
    pub fn libomp5(&self) -> &Path {
        &self.item("libomp5").1
    }

    /// The names of the files the branch's packages ship that GPU containers should get: every
    /// versioned library, the MPS and management programs, the GSP firmware.
    pub fn driver_file_names(&self, b: Branch) -> BTreeSet<String> {
        let v = self.version(b);
        let pkg = self.packages(b);
        let mut out = BTreeSet::new();
        let mut walk = vec![pkg.to_path_buf()];
        while let Some(dir) = walk.pop() {
            for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                let t = e.file_type().expect("file type");
                let name = e.file_name().to_string_lossy().into_owned();
                if t.is_dir() {
                    walk.push(e.path());
                } else if t.is_file()
                    && ((name.starts_with("lib") && name.ends_with(&format!(".so.{v}")))
                        || (name.starts_with("gsp") && name.ends_with(".bin"))
                        || ["nvidia-smi", "nvidia-cuda-mps-control", "nvidia-cuda-mps-server"].contains(&name.as_str()))
                {
                    out.insert(name);
                }
            }
        }
        out
    }
}
