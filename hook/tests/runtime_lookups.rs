//! The CUDA 11.8 and 12.9 runtimes' driver lookups, recorded on a real GPU (an H100 with driver
//! 580: `tests/fixtures/cudart-*-lookups.txt`, 386 and 420 `cuGetProcAddress` calls), replayed
//! against NVIDIA's real libcuda (Debian's 535 and 550, `tests/nvidia/fetch.sh`; answering needs
//! no GPU) without and with the hook: every answer that is a function the hook wraps comes back
//! as the hook's, every other answer is the driver's own, untouched. The fake libcuda the other
//! hook tests use answers those lookups as the real one does, where it answers at all.

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

/// A recorded fixture's lookups, one "symbol version flags" line each.
fn lookups(runtime: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/cudart-{runtime}-lookups.txt"));
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| format!("{l}\n"))
        .collect()
}

const RUNTIMES: [(&str, usize); 2] = [("11.8", 386), ("12.9", 420)];

#[test]
fn the_cuda_runtimes_lookups_land_on_the_wrappers() {
    let hook = common::hook_lib();
    let hook_name = hook.file_name().unwrap().to_string_lossy().into_owned();
    let wrapped: BTreeSet<String> = common::exports(&hook)
        .into_iter()
        .filter(|s| s.starts_with("cu"))
        .collect();
    let u = Userspace::get().unwrap();
    for (runtime, n) in RUNTIMES {
        let lookups = lookups(runtime);
        assert_eq!(lookups.lines().count(), n, "{runtime}");
        for b in Branch::ALL {
            let dir = u.library_dir(b);
            let plain = replay(&dir, None, &lookups);
            let hooked = replay(&dir, Some(&hook), &lookups);
            assert_eq!((plain.len(), hooked.len()), (n, n), "{runtime} {b:?}");
            let mut handed = BTreeSet::new();
            for (p, h) in plain.iter().zip(&hooked) {
                assert!(p.3 == "libcuda.so.1" || p.3 == "-", "{runtime} {b:?}: {p:?}");
                if wrapped.contains(&p.4) {
                    assert_eq!(
                        (&h.3, &h.4),
                        (&hook_name, &p.4),
                        "{runtime} {b:?}: {p:?} not handed the wrapper"
                    );
                    handed.insert(format!("{}@{}/{}", p.0, p.1, p.2));
                } else {
                    assert_eq!(h, p, "{runtime} {b:?}: an answer the hook does not wrap was changed");
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
                assert!(
                    handed.contains(must),
                    "{runtime} {b:?}: {must} not handed a wrapper: {handed:?}"
                );
            }
            eprintln!(
                "cudart {runtime} on {b:?}: {} distinct lookups of {n} handed the hook's wrappers",
                handed.len()
            );
        }
    }
}

/// The fake libcuda (tests/c/fake_cuda.c) against the real 535 one: every recorded lookup the
/// fake answers, it answers with the function the real driver gives (the versioned variant).
#[test]
fn the_fake_driver_answers_lookups_as_the_real_one() {
    let real_dir = Userspace::get().unwrap().library_dir(Branch::R535);
    let fake_dir = &common::built().lib_dir;
    let mut compared = 0;
    for (runtime, _) in RUNTIMES {
        let lookups = lookups(runtime);
        let real = replay(&real_dir, None, &lookups);
        let fake = replay(fake_dir, None, &lookups);
        for (r, f) in real.iter().zip(&fake) {
            if f.4 != "-" {
                assert_eq!(
                    f.4, r.4,
                    "{runtime}: the fake answers {}@{}/{} unlike the real driver",
                    f.0, f.1, f.2
                );
                compared += 1;
            }
        }
    }
    assert!(compared >= 60, "only {compared} lookups compared");
}
