//! The CUDA 11.8 runtime's driver lookups, recorded on a real GPU (an H100 with driver 580:
//! `tests/fixtures/cudart-11.8-lookups.txt`, 386 `cuGetProcAddress` calls), replayed against
//! NVIDIA's real libcuda (Debian's 535 and 550, `tests/nvidia/fetch.sh`; answering needs no GPU)
//! without and with the hook: every answer that is a function the hook wraps comes back as the
//! hook's, every other answer is the driver's own, untouched.

use std::collections::BTreeSet;
use std::io::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};

use tessera_tests::nvidia::{Branch, Userspace};

mod common;

/// One answer: `(symbol, version, flags, library, answer's symbol)`.
type Answer = (String, String, String, String, String);

fn replay(libcuda_dir: &Path, hook: Option<&Path>, lookups: &str) -> Vec<Answer> {
    let mut cmd = Command::new(common::built().lib_dir.join("replay_lookups"));
    cmd.env("LD_LIBRARY_PATH", libcuda_dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    if let Some(h) = hook {
        cmd.env("LD_PRELOAD", h);
    }
    let mut child = cmd.spawn().unwrap();
    child.stdin.take().unwrap().write_all(lookups.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{text}");
    text.lines()
        .map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            assert_eq!(f.len(), 5, "{l}");
            (f[0].into(), f[1].into(), f[2].into(), f[3].into(), f[4].into())
        })
        .collect()
}

#[test]
fn the_cuda_11_8_runtimes_lookups_land_on_the_wrappers() {
    let fixture =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/cudart-11.8-lookups.txt"))
            .unwrap();
    let lookups: String = fixture
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| format!("{l}\n"))
        .collect();
    let n = lookups.lines().count();
    assert_eq!(n, 386);
    let hook = common::hook_lib();
    let hook_name = hook.file_name().unwrap().to_string_lossy().into_owned();
    let wrapped: BTreeSet<String> = common::exports(&hook)
        .into_iter()
        .filter(|s| s.starts_with("cu"))
        .collect();
    let u = Userspace::get().unwrap();
    for b in Branch::ALL {
        let dir = u.library_dir(b);
        let plain = replay(&dir, None, &lookups);
        let hooked = replay(&dir, Some(&hook), &lookups);
        assert_eq!((plain.len(), hooked.len()), (n, n), "{b:?}");
        let mut handed = BTreeSet::new();
        for (p, h) in plain.iter().zip(&hooked) {
            assert!(p.3 == "libcuda.so.1" || p.3 == "-", "{b:?}: {p:?}");
            if wrapped.contains(&p.4) {
                assert_eq!((&h.3, &h.4), (&hook_name, &p.4), "{b:?}: {p:?} not handed the wrapper");
                handed.insert(format!("{}@{}/{}", p.0, p.1, p.2));
            } else {
                assert_eq!(h, p, "{b:?}: an answer the hook does not wrap was changed");
            }
        }
        // What the runtime uses to allocate, free, report memory, make contexts and launch.
        for must in [
            "cuMemAlloc@3020/0",
            "cuMemFree@3020/0",
            "cuMemGetInfo@3020/0",
            "cuMemAllocAsync@11020/0",
            "cuMemAllocAsync@11020/2",
            "cuMemFreeAsync@11020/2",
            "cuMemAllocFromPoolAsync@11020/0",
            "cuMemPoolTrimTo@11020/0",
            "cuDevicePrimaryCtxRetain@7000/0",
            "cuCtxCreate@3020/0",
            "cuLaunchKernel@7000/2",
            "cuLaunchKernelEx@11060/0",
            "cuGraphLaunch@10000/0",
            "cuGetProcAddress@11030/0",
        ] {
            assert!(handed.contains(must), "{b:?}: {must} not handed a wrapper: {handed:?}");
        }
        eprintln!("{b:?}: {} of {n} lookups handed the hook's wrappers", handed.len());
    }
}
