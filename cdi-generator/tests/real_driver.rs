//! Discovery and CDI specs on NVIDIA's real driver files (Debian's packages of the 535 and 550
//! branches, `tests/nvidia/fetch.sh`), laid out as distro, GKE, COS and GPU-operator nodes
//! lay them out: every file the packages ship is found, on every layout; a fixture's GPUs with
//! a real driver root get the real files; a spec whose mounted files do not exist is refused.

mod support;

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;

use tessera_cdi_generator::spec::{self, CdiSpec};
use tessera_core::driver::DriverFileKind;
use tessera_node::driver::{DriverSearch, discover};
use tessera_tests::nvidia::{Branch, Layout, Userspace};

const BIN: &str = env!("CARGO_BIN_EXE_tessera-cdi-generator");

fn under(root: &Path, host: &Path) -> std::path::PathBuf {
    root.join(host.strip_prefix("/").unwrap_or(host))
}

#[test]
fn every_real_driver_file_is_found_in_every_layout() {
    let u = Userspace::get().unwrap();
    let mut table = String::from("branch layout   root                         found/shipped\n");
    let mut failures = Vec::new();
    for b in Branch::ALL {
        let shipped = u.driver_file_names(b);
        assert!(shipped.len() >= 17, "{b:?}: {shipped:?}");
        for l in Layout::ALL {
            let host = u.root(b, l);
            let d = discover(&DriverSearch {
                host_root: host.to_path_buf(),
                ..Default::default()
            });
            let got: BTreeSet<String> = d.files.iter().map(|f| f.name()).collect();
            let missed: Vec<&String> = shipped.difference(&got).collect();
            let extra: Vec<&String> = got.difference(&shipped).collect();
            writeln!(
                table,
                "{:<6} {:<8} {:<28} {}/{}{}",
                u.version(b).split('.').next().unwrap(),
                l.name(),
                d.root.display(),
                shipped.len() - missed.len(),
                shipped.len(),
                if missed.is_empty() {
                    String::new()
                } else {
                    format!("  missed {missed:?}")
                }
            )
            .unwrap();
            let what = format!("{b:?} {l:?}");
            if d.root != Path::new(l.driver_root()) {
                failures.push(format!("{what}: root {}", d.root.display()));
            }
            if d.version.as_deref() != Some(u.version(b)) {
                failures.push(format!("{what}: version {:?}", d.version));
            }
            if let Err(e) = d.check() {
                failures.push(format!("{what}: {e}"));
            }
            if !missed.is_empty() || !extra.is_empty() {
                failures.push(format!("{what}: missed {missed:?}, unexpected {extra:?}"));
            }
            for f in &d.files {
                let local = under(host, &d.host_path(f));
                if !local.is_file() {
                    failures.push(format!("{what}: {} is not a file", local.display()));
                }
                // The loader's name is the one the library itself declares.
                if f.kind == DriverFileKind::Library
                    && f.loader_name() != tessera_node::driver::soname(&local).or(Some(f.name()))
                {
                    failures.push(format!("{what}: {} loader name {:?}", f.name(), f.loader_name()));
                }
            }
            let libcuda = d.libcuda().map(|f| f.loader_name());
            if libcuda != Some(Some("libcuda.so.1".into())) {
                failures.push(format!("{what}: libcuda {libcuda:?}"));
            }
        }
    }
    println!("{table}");
    assert!(failures.is_empty(), "{}\n{table}", failures.join("\n"));
}

fn generate(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(BIN).arg("generate").args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Every device of `spec`, with the spec-wide edits, mounts no container path twice.
fn container_paths_unique(spec: &CdiSpec) -> Result<(), String> {
    for d in &spec.devices {
        let mut seen = BTreeSet::new();
        for m in spec.container_edits.mounts.iter().chain(&d.container_edits.mounts) {
            if !seen.insert(&m.container_path) {
                return Err(format!("device {}: {} mounted twice", d.name, m.container_path));
            }
        }
    }
    Ok(())
}

#[test]
fn a_fixture_with_a_real_driver_root_gets_the_real_files_and_a_spec_the_runtimes_accept() {
    let u = Userspace::get().unwrap();
    for b in Branch::ALL {
        for l in Layout::ALL {
            let host = u.root(b, l);
            let root = under(host, Path::new(l.driver_root()));
            let what = format!("{b:?} {l:?}");
            for bundle in [false, true] {
                let out = tempfile::tempdir().unwrap();
                let bundles = out.path().join("bundles");
                let mut args = vec![
                    "--fixture",
                    "h100x8",
                    "--share-enforcement",
                    "none",
                    "--out-dir",
                    out.path().to_str().unwrap(),
                    "--host-root",
                    host.to_str().unwrap(),
                    "--driver-root",
                    l.driver_root(),
                ];
                if bundle {
                    args.extend(["--driver-bundle-dir", bundles.to_str().unwrap()]);
                } else {
                    args.push("--no-driver-bundle");
                }
                let (code, _, err) = generate(&args);
                assert_eq!(code, 0, "{what} bundle={bundle}: {err}");
                let text = std::fs::read_to_string(out.path().join("tessera.io-gpu.json")).unwrap();
                let spec: CdiSpec = serde_json::from_str(&text).unwrap();
                support::cdi_crate_accepts(&text, &spec.cdi_version, &what);
                container_paths_unique(&spec).unwrap_or_else(|e| panic!("{what}: {e}"));
                let missing: Vec<String> = spec::missing_host_paths(&spec, &Default::default(), host)
                    .into_iter()
                    .filter(|p| !(bundle && Path::new(p).starts_with(&bundles)))
                    .collect();
                assert!(missing.is_empty(), "{what}: {missing:?}");
                let v = u.version(b);
                let sources: Vec<&str> = spec
                    .container_edits
                    .mounts
                    .iter()
                    .map(|m| m.host_path.as_str())
                    .collect();
                if bundle {
                    let lib = bundles.read_dir().unwrap().next().unwrap().unwrap().path();
                    assert!(
                        lib.file_name().unwrap().to_string_lossy().starts_with(v),
                        "{what}: bundle {}",
                        lib.display()
                    );
                    assert!(lib.join("lib64/libcuda.so.1").is_file(), "{what}");
                } else {
                    let libcuda = format!("libcuda.so.{v}");
                    assert!(
                        sources
                            .iter()
                            .any(|s| s.ends_with(&libcuda) && s.starts_with(l.driver_root())),
                        "{what}: {sources:?}"
                    );
                    assert!(root.is_dir());
                }
            }
        }
    }
}

/// On an MPS node the share devices mount each card's MPS directories, which the supervisor makes
/// at run time (after a reboot, /run is empty): their absence does not hold the spec back.
#[test]
fn mps_directories_not_made_yet_do_not_hold_the_spec_back() {
    let u = Userspace::get().unwrap();
    let host = u.root(Branch::R550, Layout::Operator);
    let out = tempfile::tempdir().unwrap();
    let mps = out.path().join("mps-not-yet");
    // MPS nodes preload the CUDA hook too (it holds a share's processes to its memory together).
    let library = out.path().join("libtessera-cuda-hook.so");
    std::fs::write(&library, b"the hook").unwrap();
    let hook_root = out.path().join("hook");
    let (code, _, err) = generate(&[
        "--fixture",
        "t4x2",
        "--share-enforcement",
        "mps",
        "--mps-root",
        mps.to_str().unwrap(),
        "--hook-root",
        hook_root.to_str().unwrap(),
        "--hook-library",
        library.to_str().unwrap(),
        "--no-driver-bundle",
        "--out-dir",
        out.path().to_str().unwrap(),
        "--host-root",
        host.to_str().unwrap(),
        "--driver-root",
        Layout::Operator.driver_root(),
    ]);
    assert_eq!(code, 0, "{err}");
    let text = std::fs::read_to_string(out.path().join("tessera.io-gpu.json")).unwrap();
    assert!(
        text.contains(&format!("{}/", mps.display())),
        "the share devices mount the MPS directories"
    );
    assert!(!mps.exists());
    assert!(
        text.contains("/etc/ld.so.preload"),
        "the share devices preload the hook"
    );
}

#[test]
fn a_spec_naming_files_that_do_not_exist_is_refused_when_written_and_flagged_when_printed() {
    // The fixture's own list (550.54.15 files under /) is not on this machine.
    let out = tempfile::tempdir().unwrap();
    let (code, _, err) = generate(&[
        "--fixture",
        "t4x2",
        "--share-enforcement",
        "none",
        "--no-driver-bundle",
        "--out-dir",
        out.path().to_str().unwrap(),
    ]);
    assert_ne!(code, 0, "{err}");
    assert!(err.contains("mounted host path(s) do not exist"), "{err}");
    assert!(err.contains("/lib/firmware/nvidia/550.54.15/gsp_ga10x.bin"), "{err}");
    assert!(!out.path().join("tessera.io-gpu.json").exists());
    // Printed for reading: the spec, and a warning saying what a node would need.
    let (code, text, err) = generate(&["--fixture", "t4x2", "--share-enforcement", "none", "--no-driver-bundle"]);
    assert_eq!(code, 0, "{err}");
    assert!(text.contains("\"cdiVersion\""), "{text}");
    assert!(
        err.contains("warning") && err.contains("do not exist on this machine"),
        "{err}"
    );
}
