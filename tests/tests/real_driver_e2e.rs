//! CDI specs made from NVIDIA's real driver files (Debian's 535 and 550, `tests/nvidia/fetch.sh`;
//! no GPU) on real containerd 1.7 and 2.x: the runtime accepts the spec and creates the
//! container, and a program in it loads the real `libcuda.so.1` by its soname, as every CUDA
//! program does, and calls it: `cuDriverGetVersion` answers the branch's CUDA version, `cuInit`
//! returns 100 (no device). Both ways of mounting the driver: one bundle, and file by file; the
//! MPS control client and server never reach the container.

use std::path::{Path, PathBuf};
use std::process::Command;

use tessera_cdi_generator::spec::{self, SpecOptions};
use tessera_cdi_generator::writer::{SPEC_FILE, write_spec};
use tessera_core::enforcement::ShareEnforcement;
use tessera_core::inventory::{FixtureSource, InventorySource};
use tessera_node::inventory::{FixtureWithHostDriver, create_device_nodes};
use tessera_tests::containerd::{ContainerSpec, Containerd, Version};
use tessera_tests::nvidia::{Branch, Layout, Userspace};

const IMAGE: &str = "docker.io/tessera/libcuda-probe:test";

/// An image holding Debian's glibc and the probe, built with this machine's compiler.
fn probe_image(work: &Path) -> anyhow::Result<PathBuf> {
    let rootfs = work.join("rootfs");
    Userspace::get()?.rootfs_with_libc6(&rootfs)?;
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("nvidia/libcuda-probe.c");
    let st = Command::new("cc")
        .args(["-O2", "-o"])
        .arg(rootfs.join("probe"))
        .arg(&src)
        .status()?;
    anyhow::ensure!(st.success(), "cc {}", src.display());
    let tar = work.join("probe.tar");
    tessera_tests::containerd::pack_image(&rootfs, IMAGE, &tar)?;
    Ok(tar)
}

async fn real_driver_on(version: Version) -> anyhow::Result<()> {
    let u = Userspace::get()?;
    let mut c = Containerd::start(version).await?;
    let work = tempfile::tempdir()?;
    c.import_image(&probe_image(work.path())?)?;
    let pod = c.run_pod("libcuda", &[]).await?;
    // (branch, layout, bundle): each branch, both mount styles, layouts with and without an
    // ld cache.
    let cases = [
        (Branch::R535, Layout::Distro, true),
        (Branch::R535, Layout::Cos, false),
        (Branch::R550, Layout::Gke, false),
        (Branch::R550, Layout::Operator, true),
    ];
    for (i, (b, layout, bundle)) in cases.into_iter().enumerate() {
        let what = format!("{b:?} {layout:?} bundle={bundle}");
        let host = u.root(b, layout);
        // The driver root as a path on this machine: the spec names real host paths.
        let driver_root = host.join(layout.driver_root().trim_start_matches('/'));
        let inv = FixtureWithHostDriver {
            fixture: FixtureSource {
                fixture: "t4x2".into(),
                driver_root: Some(driver_root),
            },
            host_root: "/".into(),
        }
        .discover()?;
        inv.driver_check().map_err(anyhow::Error::msg)?;
        assert_eq!(inv.driver_version, u.version(b), "{what}");
        let dev_root = work.path().join(format!("dev-{i}"));
        create_device_nodes(&inv, &dev_root)?;
        let mut opts = SpecOptions {
            dev_root,
            enforcement: ShareEnforcement::None,
            ..Default::default()
        };
        if bundle {
            opts.driver_bundle = Some(tessera_cdi_generator::bundle::prepare(
                &inv,
                Path::new("/"),
                &work.path().join("bundles"),
            )?);
        }
        let (spec, text) = spec::render(&inv, &opts)?;
        let missing = spec::missing_host_paths(&spec, &opts, Path::new("/"));
        assert!(missing.is_empty(), "{what}: {missing:?}");
        write_spec(&c.cdi_dir(), SPEC_FILE, &text)?;
        let id = c
            .create_container(
                &pod,
                ContainerSpec::new(&format!("probe-{i}"), &["/probe"])
                    .image(IMAGE)
                    .cdi("tessera.io/gpu=0"),
            )
            .await?;
        // The MPS control client and server stay on the host: with them a tenant could command
        // its card's daemon.
        let oci = c.oci_spec(&id).await?;
        let mounted = tessera_tests::containerd::mount_destinations(&oci);
        assert!(
            mounted
                .iter()
                .any(|m| m.ends_with("nvidia-smi") || m == "/usr/local/nvidia"),
            "{what}: {mounted:?}"
        );
        assert!(
            !mounted.iter().any(|m| m.contains("nvidia-cuda-mps")),
            "{what}: {mounted:?}"
        );
        if let Some(b) = &opts.driver_bundle {
            assert!(
                b.join("bin/nvidia-smi").is_file() && !b.join("bin/nvidia-cuda-mps-control").exists(),
                "{what}"
            );
        }
        let (code, out) = c.run_to_exit(&id).await?;
        println!("{what}: {}", out.trim());
        assert_eq!(code, 0, "{what}: {out}");
        let line = out
            .lines()
            .find(|l| l.starts_with("cuDriverGetVersion="))
            .unwrap_or_default();
        assert!(
            line.starts_with(&format!(
                "cuDriverGetVersion={} rc=0 cuInit=100 libcuda=",
                b.cuda_driver_version()
            )),
            "{what}: {out}"
        );
        // Loaded from where the spec put the driver, by its soname.
        assert!(line.ends_with("/usr/local/nvidia/lib64/libcuda.so.1"), "{what}: {out}");
    }
    c.remove_pod(&pod).await?;
    Ok(())
}

#[tokio::test]
async fn real_libcuda_in_a_container_on_containerd_1_7() -> anyhow::Result<()> {
    real_driver_on(Version::V1_7).await
}

#[tokio::test]
async fn real_libcuda_in_a_container_on_containerd_2() -> anyhow::Result<()> {
    real_driver_on(Version::V2).await
}

/// Dynamic MIG calls NVML entry points nvml-wrapper does not wrap, through raw symbols: each
/// is in NVIDIA's real 535 and 550 `libnvidia-ml` (loaded, not initialised: no GPU here).
#[test]
fn the_real_libnvidia_ml_has_every_entry_point_dynamic_mig_calls() -> anyhow::Result<()> {
    let u = Userspace::get()?;
    for b in [Branch::R535, Branch::R550] {
        let lib = u.library_dir(b).join(format!("libnvidia-ml.so.{}", u.version(b)));
        let missing = tessera_node::inventory::missing_mig_entry_points(&lib).map_err(anyhow::Error::msg)?;
        assert!(missing.is_empty(), "{b:?}: {} lacks {missing:?}", lib.display());
    }
    // The check itself: a library without them (libcuda) lacks every one.
    let cuda = u
        .library_dir(Branch::R535)
        .join(format!("libcuda.so.{}", u.version(Branch::R535)));
    let missing = tessera_node::inventory::missing_mig_entry_points(&cuda).map_err(anyhow::Error::msg)?;
    assert_eq!(missing, tessera_node::inventory::MIG_ENTRY_POINTS);
    Ok(())
}

/// NVIDIA's real 535 and 550 `libnvidia-ml` (no GPU here: loaded, not initialised) predate
/// per-cgroup memory limits: the probe finds the four calls it needs first and names the
/// missing `nvmlDeviceSetMemoryLimits_v1`, so such a node says why it keeps MPS and the hook.
#[test]
fn the_real_535_and_550_nvml_predate_per_cgroup_memory_limits() -> anyhow::Result<()> {
    use tessera_node::memory_limits::{Support, probe};
    let u = Userspace::get()?;
    let cgroup = tempfile::tempdir()?;
    std::fs::write(cgroup.path().join("cgroup.controllers"), "cpu memory dmem\n")?;
    for b in [Branch::R535, Branch::R550] {
        let lib = u.library_dir(b).join(format!("libnvidia-ml.so.{}", u.version(b)));
        let (support, limits) = probe(Some(&lib), cgroup.path());
        assert!(limits.is_none(), "{b:?}");
        let Support::Unsupported(why) = support else {
            panic!("{b:?}: {support:?}")
        };
        assert!(
            why.contains("has no nvmlDeviceSetMemoryLimits_v1") && why.contains("r615"),
            "{b:?}: {why}"
        );
    }
    Ok(())
}
