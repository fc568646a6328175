//! Driver discovery on fake roots of each real layout. The libraries are real ELF shared
//! objects built with `cc` (so sonames are real) and the caches are written by the system's
//! own `ldconfig` in each of its formats.

use std::collections::BTreeMap;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use super::testing::{install_bins, install_libs, ldconfig};
use super::*;

const V: &str = "580.95.05";

use super::testing::COMPUTE;

fn search(host: &Path) -> DriverSearch {
    DriverSearch {
        host_root: host.to_path_buf(),
        ..Default::default()
    }
}

fn by_name(d: &Driver) -> BTreeMap<String, (PathBuf, FoundBy, Option<String>)> {
    d.files
        .iter()
        .map(|f| (f.name(), (f.path.clone(), f.found_by, f.loader_name())))
        .collect()
}

#[test]
fn ld_cache_formats_written_by_ldconfig_agree() {
    for format in ["new", "compat", "old"] {
        let h = tempfile::tempdir().unwrap();
        install_libs(h.path(), "/usr/lib/x86_64-linux-gnu", V, COMPUTE);
        ldconfig(h.path(), format, &["/usr/lib/x86_64-linux-gnu"]);
        let c = ldcache::LdCache::read(&h.path().join("etc/ld.so.cache")).unwrap();
        let got: BTreeMap<&str, &str> = c
            .for_arch(ldcache::native_arch_flag())
            .map(|e| (e.soname.as_str(), e.path.as_str()))
            .collect();
        assert_eq!(
            got.get("libnvidia-nvvm.so.4"),
            Some(&"/usr/lib/x86_64-linux-gnu/libnvidia-nvvm.so.4"),
            "{format}: {got:?}"
        );
        let gpucomp = format!("libnvidia-gpucomp.so.{V}");
        assert!(got.contains_key(gpucomp.as_str()), "{format}: {got:?}");
        assert_eq!(got.len(), COMPUTE.len(), "{format}: {got:?}");
    }
}

#[test]
fn distribution_packages_found_through_the_ld_cache() {
    let h = tempfile::tempdir().unwrap();
    let r = h.path();
    install_libs(r, "/usr/lib/x86_64-linux-gnu", V, COMPUTE);
    install_bins(r, "/usr/bin", &["nvidia-smi", "nvidia-cuda-mps-control"]);
    std::fs::create_dir_all(r.join(format!("lib/firmware/nvidia/{V}"))).unwrap();
    std::fs::write(r.join(format!("lib/firmware/nvidia/{V}/gsp_ga10x.bin")), b"fw").unwrap();
    ldconfig(r, "new", &["/usr/lib/x86_64-linux-gnu"]);
    let d = discover(&search(r));
    assert_eq!(d.root, Path::new("/"));
    assert_eq!(d.choice, RootChoice::Detected);
    assert_eq!(d.version.as_deref(), Some(V));
    assert_eq!(d.version_source, Some(VersionSource::LibcudaName));
    d.check().unwrap();
    let f = by_name(&d);
    let cuda = &f[&format!("libcuda.so.{V}")];
    assert_eq!(
        cuda.0,
        PathBuf::from(format!("/usr/lib/x86_64-linux-gnu/libcuda.so.{V}"))
    );
    assert_eq!(cuda.1, FoundBy::LdCache);
    assert_eq!(cuda.2.as_deref(), Some("libcuda.so.1"));
    // Sonames come from the cache, not a naming rule.
    assert_eq!(
        f[&format!("libnvidia-nvvm.so.{V}")].2.as_deref(),
        Some("libnvidia-nvvm.so.4")
    );
    let gpucomp = format!("libnvidia-gpucomp.so.{V}");
    assert_eq!(f[&gpucomp].2.as_deref(), Some(gpucomp.as_str()));
    assert_eq!(f["nvidia-smi"].0, PathBuf::from("/usr/bin/nvidia-smi"));
    assert_eq!(
        f["gsp_ga10x.bin"].0,
        PathBuf::from(format!("/lib/firmware/nvidia/{V}/gsp_ga10x.bin"))
    );
    assert!(d.missing.contains(&"libnvidia-opencl") && !d.missing.contains(&"libcuda"));
}

#[test]
fn gpu_operator_driver_container_wins_and_its_links_stay_inside_it() {
    let h = tempfile::tempdir().unwrap();
    let host = h.path();
    // A stale driver on the host itself.
    install_libs(
        host,
        "/usr/lib/x86_64-linux-gnu",
        "470.1.2",
        &["libcuda", "libnvidia-ml"],
    );
    ldconfig(host, "new", &["/usr/lib/x86_64-linux-gnu"]);
    // The operator's driver root (compat cache, as older driver images write), with an
    // absolute link that means the driver root's /usr, not the host's.
    let r = host.join("run/nvidia/driver");
    install_libs(&r, "/usr/lib64", V, COMPUTE);
    std::fs::remove_file(r.join("usr/lib64/libcuda.so.1")).unwrap();
    symlink(format!("/usr/lib64/libcuda.so.{V}"), r.join("usr/lib64/libcuda.so.1")).unwrap();
    ldconfig(&r, "compat", &["/usr/lib64"]);
    install_bins(&r, "/usr/bin", &["nvidia-smi"]);
    let d = discover(&search(host));
    assert_eq!(d.root, Path::new("/run/nvidia/driver"));
    d.check().unwrap();
    assert_eq!(d.version.as_deref(), Some(V));
    let f = by_name(&d);
    assert_eq!(f[&format!("libcuda.so.{V}")].1, FoundBy::LdCache);
    assert_eq!(
        d.host_path(d.libcuda().unwrap()),
        PathBuf::from(format!("/run/nvidia/driver/usr/lib64/libcuda.so.{V}"))
    );
    assert!(f.keys().all(|n| !n.contains("470")), "{f:?}");
}

#[test]
fn gke_layout_by_search_and_the_h100_node_through_its_ld_cache() {
    // GKE / COS: lib64/ and bin/ directly under the root, no ld.so.cache there.
    for root in ["/usr/local/nvidia", "/home/kubernetes/bin/nvidia"] {
        let h = tempfile::tempdir().unwrap();
        let r = h.path().join(root.trim_start_matches('/'));
        install_libs(&r, "/lib64", V, COMPUTE);
        install_bins(
            &r,
            "/bin",
            &["nvidia-smi", "nvidia-cuda-mps-control", "nvidia-cuda-mps-server"],
        );
        let d = discover(&search(h.path()));
        assert_eq!(d.root, Path::new(root));
        d.check().unwrap();
        let f = by_name(&d);
        assert_eq!(
            f[&format!("libcuda.so.{V}")],
            (
                PathBuf::from(format!("/lib64/libcuda.so.{V}")),
                FoundBy::Search,
                Some("libcuda.so.1".to_string()) // read from the ELF file
            )
        );
        assert_eq!(f["nvidia-smi"].0, PathBuf::from("/bin/nvidia-smi"));
        assert_eq!(f["nvidia-cuda-mps-server"].1, FoundBy::Search);
    }

    // The H100 node: root `/`, the driver in /usr/local/nvidia registered in `/`'s ld
    // cache, /usr/lib/libcuda.so.1 a link into it, binaries in /usr/local/nvidia/bin linked
    // from /usr/bin.
    let h = tempfile::tempdir().unwrap();
    let r = h.path();
    install_libs(r, "/usr/local/nvidia/lib64", V, COMPUTE);
    install_bins(r, "/usr/local/nvidia/bin", &["nvidia-smi"]);
    std::fs::create_dir_all(r.join("usr/lib")).unwrap();
    std::fs::create_dir_all(r.join("usr/bin")).unwrap();
    symlink("/usr/local/nvidia/lib64/libcuda.so.1", r.join("usr/lib/libcuda.so.1")).unwrap();
    symlink("/usr/local/nvidia/bin/nvidia-smi", r.join("usr/bin/nvidia-smi")).unwrap();
    ldconfig(r, "new", &["/usr/local/nvidia/lib64"]);
    let d = discover(&search(r));
    assert_eq!(d.root, Path::new("/"));
    d.check().unwrap();
    let f = by_name(&d);
    assert_eq!(
        f[&format!("libcuda.so.{V}")].0,
        PathBuf::from(format!("/usr/local/nvidia/lib64/libcuda.so.{V}"))
    );
    assert_eq!(f[&format!("libcuda.so.{V}")].1, FoundBy::LdCache);
    // The /usr/bin link resolves to the file, which is what gets mounted.
    assert_eq!(f["nvidia-smi"].0, PathBuf::from("/usr/local/nvidia/bin/nvidia-smi"));
    assert_eq!(
        d.files.iter().filter(|f| f.kind == DriverFileKind::Library).count(),
        COMPUTE.len()
    );
}

#[test]
fn nvml_directory_finds_what_no_cache_lists() {
    // Root `/` with no ld cache; NVML was loaded from /opt/nvidia/lib: its directory and
    // ../bin are searched, and its root is tried first.
    let h = tempfile::tempdir().unwrap();
    let r = h.path();
    install_libs(r, "/opt/nvidia/lib", V, COMPUTE);
    install_bins(r, "/opt/nvidia/bin", &["nvidia-smi"]);
    let d = discover(&DriverSearch {
        host_root: r.to_path_buf(),
        nvml_dir: Some("/opt/nvidia/lib".into()),
        version: Some(V.into()),
        ..Default::default()
    });
    assert_eq!(d.root, Path::new("/"));
    assert_eq!(d.version_source, Some(VersionSource::Nvml));
    d.check().unwrap();
    let f = by_name(&d);
    assert_eq!(f[&format!("libnvidia-ml.so.{V}")].1, FoundBy::NvmlDir);
    assert_eq!(
        f["nvidia-smi"],
        (PathBuf::from("/opt/nvidia/bin/nvidia-smi"), FoundBy::NvmlDir, None)
    );
}

#[test]
fn no_libcuda_is_an_error_that_names_the_roots() {
    let h = tempfile::tempdir().unwrap();
    let r = h.path();
    // NVML only (the node after a partial install): the root is still chosen.
    install_libs(r, "/usr/lib/x86_64-linux-gnu", V, &["libnvidia-ml"]);
    let d = discover(&search(r));
    assert_eq!((d.root.as_path(), &d.choice), (Path::new("/"), &RootChoice::Fallback));
    let err = d.check().unwrap_err().to_string();
    assert!(err.contains("no libcuda found under driver root /"), "{err}");
    assert!(
        err.contains("/run/nvidia/driver") && err.contains("/usr/local/nvidia"),
        "{err}"
    );

    // An empty root given by the operator.
    let d = discover(&DriverSearch {
        host_root: r.to_path_buf(),
        driver_root: Some("/srv/driver".into()),
        ..Default::default()
    });
    assert_eq!(d.choice, RootChoice::Given);
    assert!(d.files.is_empty());
    assert!(d.check().unwrap_err().to_string().contains("/srv/driver"));
}

#[test]
fn a_libcuda_of_another_version_is_refused() {
    let h = tempfile::tempdir().unwrap();
    let r = h.path();
    install_libs(r, "/usr/lib/x86_64-linux-gnu", "575.1.1", &["libcuda"]);
    install_libs(r, "/usr/lib/x86_64-linux-gnu", V, &["libnvidia-ml"]);
    let d = discover(&DriverSearch {
        host_root: r.to_path_buf(),
        version: Some(V.into()),
        ..Default::default()
    });
    let err = d.check().unwrap_err();
    assert!(
        matches!(&err, DriverError::VersionMismatch { file, .. } if file.contains("575.1.1")),
        "{err}"
    );
}

#[test]
fn loader_names_and_versions() {
    let f = |name: &str, soname: Option<&str>| DriverFile {
        path: PathBuf::from("/lib").join(name),
        kind: DriverFileKind::Library,
        found_by: FoundBy::Search,
        soname: soname.map(str::to_string),
        on_host: false,
    };
    assert_eq!(f("libcuda.so.1.2", None).loader_name().as_deref(), Some("libcuda.so.1"));
    assert_eq!(
        f("libnvidia-nvvm.so.1.2", None).loader_name().as_deref(),
        Some("libnvidia-nvvm.so.4")
    );
    assert_eq!(
        f("libx.so.1.2", Some("libx.so.7")).loader_name().as_deref(),
        Some("libx.so.7")
    );
    assert_eq!(version_of("libcuda.so.580.95.05"), Some("580.95.05"));
    assert_eq!(version_of("libcuda.so.1"), None);
    assert_eq!(version_of("libcuda.so.580.x"), None);
}

#[test]
fn firmware_beside_the_libraries_then_where_the_kernel_loads_it() {
    // GKE: /usr/local/nvidia/firmware, with the libraries in the host's ld cache.
    let h = tempfile::tempdir().unwrap();
    let r = h.path();
    install_libs(r, "/usr/local/nvidia/lib64", V, COMPUTE);
    ldconfig(r, "new", &["/usr/local/nvidia/lib64"]);
    let fw = r.join(format!("usr/local/nvidia/firmware/nvidia/{V}"));
    std::fs::create_dir_all(&fw).unwrap();
    std::fs::write(fw.join("gsp_ga10x.bin"), b"fw").unwrap();
    let d = discover(&search(r));
    let got = by_name(&d);
    assert_eq!(
        got.get("gsp_ga10x.bin").map(|g| g.0.clone()),
        Some(PathBuf::from(format!(
            "/usr/local/nvidia/firmware/nvidia/{V}/gsp_ga10x.bin"
        )))
    );

    // COS with firmware_class.path pointing at the host's firmware, outside the driver root.
    let h = tempfile::tempdir().unwrap();
    let r = h.path();
    install_libs(r, "/home/kubernetes/bin/nvidia/lib64", V, COMPUTE);
    let fw = r.join(format!("opt/fw/nvidia/{V}"));
    std::fs::create_dir_all(&fw).unwrap();
    std::fs::write(fw.join("gsp_tu10x.bin"), b"fw").unwrap();
    std::fs::create_dir_all(r.join("sys/module/firmware_class/parameters")).unwrap();
    std::fs::write(r.join("sys/module/firmware_class/parameters/path"), "/opt/fw\n").unwrap();
    let d = discover(&search(r));
    assert_eq!(d.root, Path::new("/home/kubernetes/bin/nvidia"));
    let f = d
        .files
        .iter()
        .find(|f| f.kind == DriverFileKind::Firmware)
        .expect("firmware");
    assert!(f.on_host && f.found_by == FoundBy::Host, "{f:?}");
    assert_eq!(
        d.host_path(f),
        PathBuf::from(format!("/opt/fw/nvidia/{V}/gsp_tu10x.bin"))
    );
}

#[test]
fn every_library_of_the_version_beside_libcuda_and_the_daemons_sockets() {
    let h = tempfile::tempdir().unwrap();
    let r = h.path();
    install_libs(r, "/run/nvidia/driver/usr/lib64", V, COMPUTE);
    // A library Tessera does not name, and one of another version: only the first is taken.
    super::testing::fake_lib(
        &r.join(format!("run/nvidia/driver/usr/lib64/libnvidia-future.so.{V}")),
        "libnvidia-future.so.1",
    );
    super::testing::fake_lib(
        &r.join("run/nvidia/driver/usr/lib64/libnvidia-old.so.1.2.3"),
        "libnvidia-old.so.1",
    );
    // persistenced's socket in the driver container, fabric manager's on the host.
    let bind = |p: PathBuf| {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::os::unix::net::UnixListener::bind(&p).unwrap()
    };
    let _a = bind(r.join("run/nvidia/driver/run/nvidia-persistenced/socket"));
    let _b = bind(r.join("run/nvidia-fabricmanager/socket"));
    let d = discover(&search(r));
    assert_eq!(d.root, Path::new("/run/nvidia/driver"));
    let got = by_name(&d);
    let future = &got[&format!("libnvidia-future.so.{V}")];
    assert_eq!(
        (future.1, future.2.as_deref()),
        (FoundBy::LibcudaDir, Some("libnvidia-future.so.1"))
    );
    assert!(!got.keys().any(|n| n.contains("libnvidia-old")), "{got:?}");
    let mut sockets: Vec<(PathBuf, bool)> = d
        .files
        .iter()
        .filter(|f| f.kind == DriverFileKind::Socket)
        .map(|f| (d.host_path(f), f.on_host))
        .collect();
    sockets.sort_by_key(|s| s.1);
    assert_eq!(
        sockets,
        [
            (
                PathBuf::from("/run/nvidia/driver/run/nvidia-persistenced/socket"),
                false
            ),
            (PathBuf::from("/run/nvidia-fabricmanager/socket"), true),
        ]
    );
}
