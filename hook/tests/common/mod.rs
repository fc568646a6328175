//! Builds the fakes and the client with `cc` (once per test binary) and finds the hook library
//! cargo built.

// Shared by several test crates, each of which uses part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The built fakes and clients.
pub struct Built {
    _dir: tempfile::TempDir,
    /// Where they are: libcuda.so.1, libnvidia-ml.so.1, client_dl, client_linked,
    /// replay_lookups; `limits/`, the fake NVML's per-cgroup limits.
    pub lib_dir: PathBuf,
}

fn cc(args: &[&str]) {
    let out = Command::new("cc").args(args).output().expect("cc runs");
    assert!(
        out.status.success(),
        "cc {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Builds once.
pub fn built() -> &'static Built {
    static B: OnceLock<Built> = OnceLock::new();
    B.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c");
        let s = |f: &str| src.join(f).display().to_string();
        let o = |f: &str| d.join(f).display().to_string();
        let inc = format!("-I{}", src.display());
        // -Bsymbolic: like the real driver, the fake's calls to its own functions stay inside it
        // (never reach the preloaded hook).
        cc(&[
            "-shared",
            "-fPIC",
            "-O2",
            &inc,
            "-Wl,-soname,libcuda.so.1",
            "-Wl,-Bsymbolic",
            "-o",
            &o("libcuda.so.1"),
            &s("fake_cuda.c"),
        ]);
        std::os::unix::fs::symlink("libcuda.so.1", d.join("libcuda.so")).unwrap();
        // As an r615+ driver: per-cgroup limits kept in `limits/` (the fake libcuda holds a
        // container's allocations to them where the container sees that directory).
        std::fs::create_dir(d.join("limits")).unwrap();
        cc(&[
            "-shared",
            "-fPIC",
            "-O2",
            &inc,
            &format!("-DFAKE_NVML_LIMITS_DIR=\"{}\"", d.join("limits").display()),
            "-o",
            &o("libnvidia-ml.so.1"),
            &s("fake_nvml.c"),
        ]);
        cc(&["-O2", "-o", &o("replay_lookups"), &s("replay_lookups.c"), "-ldl"]);
        cc(&[
            "-O2",
            &inc,
            "-o",
            &o("client_dl"),
            &s("cuda_client.c"),
            "-ldl",
            "-lpthread",
        ]);
        let lib = format!("-L{}", d.display());
        cc(&[
            "-O2",
            "-DLINKED",
            &inc,
            "-o",
            &o("client_linked"),
            &s("cuda_client.c"),
            &lib,
            "-lcuda",
            "-lpthread",
        ]);
        Built {
            lib_dir: d.to_path_buf(),
            _dir: dir,
        }
    })
}

/// The hook library cargo built beside this test: `cargo test` leaves it in `deps/` next to
/// the test binary, `cargo build` one directory up.
pub fn hook_lib() -> PathBuf {
    // The shipped build (hook/build-portable.sh), when the suite is run against it.
    if let Some(p) = std::env::var_os("TESSERA_HOOK_LIB") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    let candidates = [deps.to_path_buf(), deps.parent().unwrap().to_path_buf()];
    candidates
        .iter()
        .map(|d| d.join("libtessera_cuda_hook.so"))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("libtessera_cuda_hook.so not built in {candidates:?}"))
}

/// A host-pid socket served by the NRI plugin's own service, as each hooked container gets
/// (these processes run in the test's pid namespace, so the answer is their own pid).
pub fn pid_socket() -> &'static Path {
    struct Served {
        _runtime: tokio::runtime::Runtime,
        _services: tessera_nri_plugin::pid_service::PidServices,
        dir: tempfile::TempDir,
    }
    static S: OnceLock<Served> = OnceLock::new();
    let s = S.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let services = tessera_nri_plugin::pid_service::PidServices::default();
        {
            let _in = runtime.enter();
            services.serve("hook-tests", dir.path()).unwrap();
        }
        Served {
            _runtime: runtime,
            _services: services,
            dir,
        }
    });
    // Leaked with the process: the directory must outlive every test's children.
    Box::leak(
        s.dir
            .path()
            .join(tessera_core::enforcement::HOOK_PID_SOCKET)
            .into_boxed_path(),
    )
}

/// Dynamic symbols a library exports (defined ones).
pub fn exports(lib: &Path) -> Vec<String> {
    let out = Command::new("objdump").arg("-T").arg(lib).output().unwrap();
    assert!(out.status.success(), "objdump -T {}", lib.display());
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.contains("*UND*"))
        .filter_map(|l| l.split_whitespace().last().map(str::to_string))
        .collect()
}
