//! The hook as containers get it (hook/build-portable.sh: glibc 2.28's symbol versions) loads
//! in a process of an old glibc: Debian bullseye's real 2.31 (`tests/nvidia/fetch.sh`; the
//! oldest reachable here, Ubuntu 20.04's too) runs a program with it preloaded. The library
//! cargo builds for the tests needs this machine's newer glibc and stops the same program,
//! which shows the check bites.

use std::path::{Path, PathBuf};
use std::process::Command;

use tessera_tests::nvidia::Userspace;

fn portable() -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("build-portable.sh");
    let out = Command::new("bash").arg(&script).output().unwrap();
    assert!(
        out.status.success(),
        "{}: {}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// The newest `GLIBC_x.y` version `lib` needs.
fn newest_glibc(lib: &Path) -> (u32, u32) {
    let out = Command::new("objdump").arg("-T").arg(lib).output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split(|c: char| c.is_whitespace() || c == '(' || c == ')')
        .filter_map(|w| w.strip_prefix("GLIBC_"))
        .filter_map(|v| {
            let mut p = v.split('.').map(|n| n.parse::<u32>().ok());
            Some((p.next()??, p.next().flatten().unwrap_or(0)))
        })
        .max()
        .unwrap()
}

/// Runs bullseye's `getent` on bullseye's loader and libraries with `preload`.
fn getent_with(preload: &Path) -> (bool, String) {
    let root = Userspace::get().unwrap().libc6_2_31();
    let libs = root.join("lib/x86_64-linux-gnu");
    let out = Command::new(libs.join("ld-2.31.so"))
        .arg("--library-path")
        .arg(&libs)
        .arg("--preload")
        .arg(preload)
        .arg(root.join("usr/bin/getent"))
        .args(["hosts", "localhost"])
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

#[cfg(target_arch = "x86_64")]
#[test]
fn the_shipped_hook_loads_under_glibc_2_31() {
    let lib = portable();
    assert!(
        newest_glibc(&lib) <= (2, 28),
        "{}: {:?}",
        lib.display(),
        newest_glibc(&lib)
    );
    let (ok, text) = getent_with(&lib);
    assert!(ok && text.contains("localhost"), "{text}");
    // The library built against this machine's glibc stops the program.
    let native = native_hook();
    assert!(newest_glibc(&native) > (2, 31), "{:?}", newest_glibc(&native));
    let (ok, text) = getent_with(&native);
    assert!(!ok && text.contains("version `GLIBC_2.3"), "{text}");
}

/// The library cargo built beside this test (not `TESSERA_HOOK_LIB`, which may name the
/// portable build).
fn native_hook() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    [deps.to_path_buf(), deps.parent().unwrap().to_path_buf()]
        .iter()
        .map(|d| d.join("libtessera_cuda_hook.so"))
        .find(|p| p.exists())
        .expect("cargo builds the hook beside its tests")
}
