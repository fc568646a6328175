//! `tessera-cdi-generator driver` on fake driver roots (no GPU): the root it chooses, the
//! version from libcuda's name, every file with how it was found, and a non-zero exit when
//! there is no libcuda. And the daemon refusing a spec that would break GPU containers.

use std::os::unix::fs::symlink;
use std::path::Path;
use std::process::Command;

use tessera_cdi_generator::daemon::{DaemonConfig, Generator};
use tessera_cdi_generator::spec::{self, SpecError, SpecOptions};
use tessera_cdi_generator::writer::SPEC_FILE;
use tessera_core::inventory::{FixtureSource, InventorySource, PublishedInventory};
use tessera_node::driver::testing::{COMPUTE, install_bins, install_libs, ldconfig};

const BIN: &str = env!("CARGO_BIN_EXE_tessera-cdi-generator");
const V: &str = "580.95.05";

fn driver(host: &Path, extra: &[&str]) -> (i32, String) {
    let out = Command::new(BIN)
        .arg("driver")
        .arg("--host-root")
        .arg(host)
        .args(extra)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

#[test]
fn driver_command_on_the_h100_node_layout() {
    // As on the GPU machine of the issue: the driver in /usr/local/nvidia/{lib64,bin},
    // registered in /'s ld cache, /usr/bin/nvidia-smi a link into it.
    let h = tempfile::tempdir().unwrap();
    let r = h.path();
    install_libs(r, "/usr/local/nvidia/lib64", V, COMPUTE);
    install_bins(r, "/usr/local/nvidia/bin", &["nvidia-smi", "nvidia-cuda-mps-control"]);
    std::fs::create_dir_all(r.join("usr/bin")).unwrap();
    symlink("/usr/local/nvidia/bin/nvidia-smi", r.join("usr/bin/nvidia-smi")).unwrap();
    ldconfig(r, "new", &["/usr/local/nvidia/lib64"]);
    // NVML cannot load here (no GPU): the version comes from libcuda's file name.
    let (code, text) = driver(r, &["--nvml-library", "/nonexistent/libnvidia-ml.so.1"]);
    assert_eq!(code, 0, "{text}");
    assert!(
        text.contains("driver root:    / (detected; tried /run/nvidia/driver, /, "),
        "{text}"
    );
    assert!(
        text.contains(&format!("driver version: {V} (from the libcuda file name")),
        "{text}"
    );
    let line = |needle: &str| {
        text.lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no line with {needle:?} in:\n{text}"))
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert_eq!(
        line(&format!("libcuda.so.{V}")),
        format!("library /usr/local/nvidia/lib64/libcuda.so.{V} ld.so.cache as libcuda.so.1")
    );
    assert_eq!(
        line(&format!("libnvidia-nvvm.so.{V}")),
        format!("library /usr/local/nvidia/lib64/libnvidia-nvvm.so.{V} ld.so.cache as libnvidia-nvvm.so.4")
    );
    assert_eq!(
        line("nvidia-smi"),
        "binary /usr/local/nvidia/bin/nvidia-smi directory search"
    );
    assert!(text.contains("ready:          yes"), "{text}");

    // JSON for tools.
    let (code, json) = driver(r, &["--json", "--nvml-library", "/nonexistent/libnvidia-ml.so.1"]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(
        json.lines()
            .skip_while(|l| !l.starts_with('{'))
            .collect::<Vec<_>>()
            .join("\n")
            .as_str(),
    )
    .unwrap();
    assert_eq!(v["root"], "/");
    assert_eq!(v["version"], V);
    assert_eq!(v["version_source"], "libcuda-name");
    assert_eq!(v["files"].as_array().unwrap().len(), COMPUTE.len() + 2);

    // libcuda gone: exit 1, and the reason.
    std::fs::remove_file(r.join(format!("usr/local/nvidia/lib64/libcuda.so.{V}"))).unwrap();
    let (code, text) = driver(r, &["--nvml-library", "/nonexistent/libnvidia-ml.so.1"]);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("ready:          NO: no libcuda found under driver root /"),
        "{text}"
    );
}

#[test]
fn driver_command_with_a_given_root() {
    let h = tempfile::tempdir().unwrap();
    install_libs(&h.path().join("opt/drv"), "/lib64", V, &["libcuda", "libnvidia-ml"]);
    let (code, text) = driver(
        h.path(),
        &["--driver-root", "/opt/drv", "--nvml-library", "/nonexistent"],
    );
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("driver root:    /opt/drv (given)"), "{text}");
    assert!(text.contains(&format!("/opt/drv/lib64/libcuda.so.{V}")), "{text}");
}

#[test]
fn no_spec_without_libcuda_and_the_node_is_published_not_ready() {
    let dir = tempfile::tempdir().unwrap();
    let fixture = dir.path().join("node.yaml");
    let t4 = tessera_core::inventory::BUILTIN_FIXTURES
        .iter()
        .find(|(n, _)| *n == "t4x2")
        .unwrap()
        .1;
    std::fs::write(&fixture, t4).unwrap();
    let config = DaemonConfig {
        cdi_dir: dir.path().join("cdi"),
        spec: SpecOptions::default(),
        interval: std::time::Duration::from_secs(1),
        node_name: None,
        bundle: None,
        check_host_paths: None,
        share_memory: None,
    };
    let source = FixtureSource::new(&fixture);
    let mut g = Generator::default();
    g.step(&source, &config).unwrap();
    let good = std::fs::read_to_string(config.cdi_dir.join(SPEC_FILE)).unwrap();

    // The driver loses libcuda.
    std::fs::write(
        &fixture,
        t4.replace("    - /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15\n", ""),
    )
    .unwrap();
    let inv = source.discover().unwrap();
    let err = spec::render(&inv, &SpecOptions::default()).unwrap_err();
    assert!(matches!(err, SpecError::Driver(_)), "{err}");
    let r = g.refresh(&source, &config).unwrap();
    let e = format!("{:#}", r.spec.unwrap_err());
    assert!(e.contains("not writing a CDI spec: no libcuda among"), "{e}");
    // The previous spec stays; the published inventory says why GPU pods cannot come.
    assert_eq!(std::fs::read_to_string(config.cdi_dir.join(SPEC_FILE)).unwrap(), good);
    let published = PublishedInventory::decode(&PublishedInventory::of(&r.inventory).encode()).unwrap();
    assert!(published.not_ready.unwrap().contains("no libcuda"));
    assert_eq!(published.gpus.len(), 2);
}

/// A fixture with `--driver-root`: its GPUs get the real driver files found there, and every
/// mount the spec names exists (without it, a written spec naming missing files is refused:
/// `real_driver.rs`).
#[test]
fn a_fixture_with_a_driver_root_names_only_files_that_exist() {
    let root = tessera_tests::nvidia::Userspace::get()
        .unwrap()
        .root(
            tessera_tests::nvidia::Branch::R535,
            tessera_tests::nvidia::Layout::Distro,
        )
        .to_path_buf();
    let out = std::process::Command::new(BIN)
        .args(["generate", "--fixture", "t4x2", "--no-driver-bundle", "--driver-root"])
        .arg(&root)
        .output()
        .unwrap();
    let spec = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_str(&spec).unwrap();
    let mut mounted = 0;
    for m in v["containerEdits"]["mounts"].as_array().into_iter().flatten() {
        let host = m["hostPath"].as_str().unwrap();
        assert!(std::path::Path::new(host).exists(), "{host} named but absent");
        mounted += 1;
    }
    assert!(mounted > 5, "{spec}");
}

/// Printing a spec to read writes nothing on the machine: no driver bundle (it is named where
/// the daemon would make it), no hook installed, nothing left behind.
#[test]
fn printing_a_spec_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (bundles, hook) = (dir.path().join("bundles"), dir.path().join("hook"));
    let out = std::process::Command::new(BIN)
        .args([
            "generate",
            "--fixture",
            "t4x2",
            "--share-enforcement",
            "hook",
            "--driver-bundle-dir",
        ])
        .arg(&bundles)
        .arg("--hook-root")
        .arg(&hook)
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let spec = String::from_utf8_lossy(&out.stdout);
    assert!(spec.contains(&format!("{}/550.54.15-", bundles.display())), "{spec}");
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "written under {}",
        dir.path().display()
    );
}
