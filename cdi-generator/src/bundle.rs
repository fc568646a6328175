//! One mount for the driver: per driver version, a host directory holding exactly the driver's
//! libraries (`lib64/`, with a link from each soname) and programs (`bin/`), which the spec
//! mounts once at `/usr/local/nvidia` instead of one bind mount per file.
//!
//! Files are hard links when the driver lives on the same filesystem (free), else copies
//! (`std::fs::copy`: a reflink where the filesystem can). Bind mounts made from a pod would
//! need bidirectional mount propagation and outlive a crashed agent; symbolic links would
//! point outside the container's root. A bundle is built in a temporary directory and renamed
//! into place, so a container never sees half of one; it is named by the driver version and a
//! digest of its files, so a changed driver gets a new one. The newest two are kept.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use sha2::{Digest, Sha256};
use tessera_core::driver::DriverFileKind;
use tessera_core::inventory::NodeInventory;

pub use tessera_core::driver::DEFAULT_BUNDLE_ROOT;
/// Bundles kept (the current one and the one before, for containers still running on it).
const KEEP: usize = 2;
const COMPLETE: &str = ".complete";

/// Why a bundle could not be made.
#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    /// The bundle's own directory.
    #[error("driver bundle {path}: {source}")]
    Io {
        /// What could not be written.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A driver file that could not be read into it.
    #[error(
        "driver file {file} could not be put into the driver bundle under {root}: {source} \
         (is this machine's driver the inventory's? --no-driver-bundle mounts the files one by one)"
    )]
    File {
        /// The driver file, as this process reads it.
        file: PathBuf,
        /// The bundles' root.
        root: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

fn err(path: &Path) -> impl FnOnce(std::io::Error) -> BundleError + '_ {
    move |source| BundleError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// What this process reads a host path as.
fn local(host_root: &Path, host: &Path) -> PathBuf {
    host_root.join(host.strip_prefix("/").unwrap_or(host))
}

/// The bundle's name: the driver version and a digest of what goes in (names, sizes, mtimes).
fn key(inv: &NodeInventory, host_root: &Path) -> String {
    let mut h = Sha256::new();
    for f in bundled(inv) {
        let meta = std::fs::metadata(local(host_root, &inv.host_path(f))).ok();
        let mtime = meta
            .as_ref()
            .and_then(|m| m.modified().ok())
            .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        h.update(format!(
            "{}|{}|{}|{mtime}\n",
            f.path.display(),
            f.loader_name().unwrap_or_default(),
            meta.map(|m| m.len()).unwrap_or_default()
        ));
    }
    let digest = h.finalize();
    let hex: String = digest[..6].iter().map(|b| format!("{b:02x}")).collect();
    format!("{}-{hex}", inv.driver_version)
}

/// The files a bundle holds: libraries and programs (firmware keeps its own path), but none of
/// the host-only programs.
fn bundled(inv: &NodeInventory) -> impl Iterator<Item = &tessera_core::driver::DriverFile> {
    inv.driver_files
        .iter()
        .filter(|f| matches!(f.kind, DriverFileKind::Library | DriverFileKind::Binary) && f.for_containers())
}

fn link_or_copy(from: &Path, to: &Path) -> std::io::Result<()> {
    match std::fs::hard_link(from, to) {
        Ok(()) => Ok(()),
        Err(_) => std::fs::copy(from, to).map(|_| ()),
    }
}

/// Where [`prepare`] puts the bundle of `inv`'s driver under `root`, without making it.
pub fn planned(inv: &NodeInventory, host_root: &Path, root: &Path) -> PathBuf {
    root.join(key(inv, host_root))
}

/// Makes (or finds) the bundle of `inv`'s driver under `root` (a host path this process can
/// write at the same path); driver files are read under `host_root`. Returns the bundle's
/// path.
pub fn prepare(inv: &NodeInventory, host_root: &Path, root: &Path) -> Result<PathBuf, BundleError> {
    std::fs::create_dir_all(root).map_err(err(root))?;
    let dir = planned(inv, host_root, root);
    if dir.join(COMPLETE).exists() {
        return Ok(dir);
    }
    let tmp = root.join(format!(
        ".tmp-{}-{}",
        dir.file_name().and_then(|n| n.to_str()).unwrap_or("bundle"),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&tmp);
    let fill = || -> Result<(), BundleError> {
        for sub in ["lib64", "bin"] {
            std::fs::create_dir_all(tmp.join(sub)).map_err(err(&tmp))?;
        }
        for f in bundled(inv) {
            let name = f.name();
            let sub = if f.kind == DriverFileKind::Library {
                "lib64"
            } else {
                "bin"
            };
            let from = local(host_root, &inv.host_path(f));
            link_or_copy(&from, &tmp.join(sub).join(&name)).map_err(|source| BundleError::File {
                file: from.clone(),
                root: root.to_path_buf(),
                source,
            })?;
            if let Some(so) = f.loader_name().filter(|so| *so != name) {
                let link = tmp.join(sub).join(&so);
                std::os::unix::fs::symlink(&name, &link).map_err(err(&link))?;
            }
        }
        std::fs::write(tmp.join(COMPLETE), b"").map_err(err(&tmp))
    };
    if let Err(e) = fill() {
        // Nothing half-made is left behind.
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if let Err(e) = std::fs::rename(&tmp, &dir) {
        // Another agent finished the same bundle first: use it.
        let _ = std::fs::remove_dir_all(&tmp);
        if !dir.join(COMPLETE).exists() {
            return Err(err(&dir)(e));
        }
    }
    collect(root, &dir);
    Ok(dir)
}

/// Keeps `current` and the newest other bundles (up to [`KEEP`] in all); removes the rest and
/// any abandoned temporary directory.
fn collect(root: &Path, current: &Path) {
    let Ok(rd) = std::fs::read_dir(root) else { return };
    let mut bundles: Vec<(SystemTime, PathBuf)> = Vec::new();
    for e in rd.flatten() {
        let p = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(".tmp-") && !name.ends_with(&format!("-{}", std::process::id())) {
            let _ = std::fs::remove_dir_all(&p);
        } else if !name.starts_with('.') && p != current {
            let t = e
                .metadata()
                .and_then(|m| m.modified())
                .unwrap_or(SystemTime::UNIX_EPOCH);
            bundles.push((t, p));
        }
    }
    bundles.sort_by_key(|b| std::cmp::Reverse(b.0));
    for (_, p) in bundles.into_iter().skip(KEEP - 1) {
        let _ = std::fs::remove_dir_all(p);
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt as _;

    use super::*;
    use tessera_core::inventory::{FixtureSource, InventorySource};

    fn fake_driver(root: &Path) -> NodeInventory {
        let inv = FixtureSource {
            fixture: "t4x2".into(),
            driver_root: Some(root.join("driver")),
        }
        .discover()
        .unwrap();
        for f in &inv.driver_files {
            let p = inv.host_path(f);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, format!("contents of {}", f.name())).unwrap();
        }
        inv
    }

    /// A driver file that is not there: the error names it (not a temporary destination) and
    /// says what to do, and nothing half-made is left.
    #[test]
    fn a_missing_driver_file_is_named_and_nothing_is_left_behind() {
        let d = tempfile::tempdir().unwrap();
        let inv = fake_driver(d.path());
        let gone = inv
            .driver_files
            .iter()
            .find(|f| f.kind == DriverFileKind::Library)
            .map(|f| inv.host_path(f))
            .unwrap();
        std::fs::remove_file(&gone).unwrap();
        let root = d.path().join("bundles");
        let e = prepare(&inv, Path::new("/"), &root).unwrap_err().to_string();
        assert!(
            e.contains(&gone.display().to_string()) && e.contains("--no-driver-bundle"),
            "{e}"
        );
        assert_eq!(
            std::fs::read_dir(&root).unwrap().count(),
            0,
            "left behind in {}",
            root.display()
        );
    }

    #[test]
    fn a_bundle_per_driver_with_sonames_linked_and_old_ones_collected() {
        let d = tempfile::tempdir().unwrap();
        let inv = fake_driver(d.path());
        let root = d.path().join("bundles");
        let b = prepare(&inv, Path::new("/"), &root).unwrap();
        assert!(b.file_name().unwrap().to_str().unwrap().starts_with("550.54.15-"));
        let lib = b.join("lib64");
        assert_eq!(
            std::fs::read_to_string(lib.join("libcuda.so.550.54.15")).unwrap(),
            "contents of libcuda.so.550.54.15"
        );
        assert_eq!(
            std::fs::read_link(lib.join("libcuda.so.1")).unwrap(),
            Path::new("libcuda.so.550.54.15")
        );
        assert_eq!(
            std::fs::read_link(lib.join("libnvidia-nvvm.so.4")).unwrap(),
            Path::new("libnvidia-nvvm.so.550.54.15")
        );
        assert!(b.join("bin/nvidia-smi").is_file());
        assert!(!b.join("lib64/gsp_ga10x.bin").exists(), "firmware keeps its own path");
        // Same filesystem: hard links, no copy.
        let src = inv.host_path(inv.driver_files.iter().find(|f| f.name() == "nvidia-smi").unwrap());
        assert_eq!(
            std::fs::metadata(&src).unwrap().ino(),
            std::fs::metadata(b.join("bin/nvidia-smi")).unwrap().ino()
        );
        // Nothing changed: the same bundle, untouched.
        let t = std::fs::metadata(&b).unwrap().modified().unwrap();
        assert_eq!(prepare(&inv, Path::new("/"), &root).unwrap(), b);
        assert_eq!(std::fs::metadata(&b).unwrap().modified().unwrap(), t);
        // The driver changes twice: new bundles; the newest two stay.
        let cuda = inv.host_path(
            inv.driver_files
                .iter()
                .find(|f| f.name().starts_with("libcuda."))
                .unwrap(),
        );
        std::fs::write(&cuda, "a new build").unwrap();
        let b2 = prepare(&inv, Path::new("/"), &root).unwrap();
        assert_ne!(b2, b);
        std::fs::write(&cuda, "another build, longer").unwrap();
        let b3 = prepare(&inv, Path::new("/"), &root).unwrap();
        let mut left: Vec<PathBuf> = std::fs::read_dir(&root).unwrap().flatten().map(|e| e.path()).collect();
        left.sort();
        let mut want = vec![b2, b3];
        want.sort();
        assert_eq!(left, want);
    }
}
