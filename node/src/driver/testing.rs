//! Fake driver roots for tests: real ELF shared objects (built with `cc`, so their sonames are
//! real), installed as the NVIDIA installer lays them out, and caches written by the system's
//! own `ldconfig`. Behind the `testing` feature.

use std::collections::BTreeMap;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};

/// A shared object with `soname`, built once per soname and copied.
pub fn fake_lib(path: &Path, soname: &str) {
    static BUILT: OnceLock<Mutex<BTreeMap<String, PathBuf>>> = OnceLock::new();
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    let dir = DIR.get_or_init(|| tempfile::tempdir().unwrap()).path();
    let mut built = BUILT.get_or_init(Default::default).lock().unwrap();
    let src = built
        .entry(soname.to_string())
        .or_insert_with(|| {
            let c = dir.join("empty.c");
            std::fs::write(&c, "int tessera_fake(void) { return 0; }\n").unwrap();
            let out = dir.join(soname);
            let st = Command::new("cc")
                .args(["-shared", "-fPIC", "-o"])
                .arg(&out)
                .arg(format!("-Wl,-soname,{soname}"))
                .arg(&c)
                .status()
                .expect("cc runs");
            assert!(st.success(), "cc failed for {soname}");
            out
        })
        .clone();
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::copy(src, path).unwrap();
}

/// Installs the driver's libraries into `dir` (under `root`) as the installer does: the
/// versioned file and a soname link.
pub fn install_libs(root: &Path, dir: &str, version: &str, stems: &[&str]) {
    let d = root.join(dir.trim_start_matches('/'));
    for stem in stems {
        let file = format!("{stem}.so.{version}");
        let so = match *stem {
            "libnvidia-nvvm" => format!("{stem}.so.4"),
            "libnvidia-gpucomp" => file.clone(),
            _ => format!("{stem}.so.1"),
        };
        fake_lib(&d.join(&file), &so);
        if so != file {
            symlink(&file, d.join(&so)).unwrap();
        }
    }
}

pub fn install_bins(root: &Path, dir: &str, names: &[&str]) {
    let d = root.join(dir.trim_start_matches('/'));
    std::fs::create_dir_all(&d).unwrap();
    for n in names {
        std::fs::write(d.join(n), b"#!/bin/sh\n").unwrap();
    }
}

/// `ldconfig` writes `root/etc/ld.so.cache` in `format` for `dirs`.
pub fn ldconfig(root: &Path, format: &str, dirs: &[&str]) {
    std::fs::create_dir_all(root.join("etc")).unwrap();
    std::fs::write(root.join("etc/ld.so.conf"), dirs.join("\n") + "\n").unwrap();
    let out = Command::new("ldconfig")
        .args(["-X", "-c", format, "-r"])
        .arg(root)
        .output()
        .expect("ldconfig runs");
    assert!(
        out.status.success(),
        "ldconfig: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The compute libraries most tests install.
pub const COMPUTE: &[&str] = &[
    "libcuda",
    "libnvidia-ml",
    "libnvidia-ptxjitcompiler",
    "libnvidia-nvvm",
    "libnvidia-gpucomp",
];
