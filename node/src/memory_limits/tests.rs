use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use super::*;

/// The hook's fake NVML (hook/tests/c/fake_nvml.c), as r615+ (limits kept in the directory
/// compiled in) and as r580 (no limit calls).
struct Fakes {
    _dir: tempfile::TempDir,
    r615: PathBuf,
    r580: PathBuf,
    limits: PathBuf,
}

fn fakes() -> &'static Fakes {
    static F: OnceLock<Fakes> = OnceLock::new();
    F.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../hook/tests/c");
        let limits = dir.path().join("limits");
        std::fs::create_dir(&limits).unwrap();
        let build = |out: &Path, define: &str| {
            let status = Command::new("cc")
                .args(["-shared", "-fPIC", "-O2"])
                .arg(format!("-I{}", src.display()))
                .arg(define)
                .arg("-o")
                .arg(out)
                .arg(src.join("fake_nvml.c"))
                .status()
                .unwrap();
            assert!(status.success());
        };
        let r615 = dir.path().join("r615/libnvidia-ml.so.1");
        let r580 = dir.path().join("r580/libnvidia-ml.so.1");
        std::fs::create_dir_all(r615.parent().unwrap()).unwrap();
        std::fs::create_dir_all(r580.parent().unwrap()).unwrap();
        build(&r615, &format!("-DFAKE_NVML_LIMITS_DIR=\"{}\"", limits.display()));
        build(&r580, "-DFAKE_NVML_R580");
        Fakes {
            _dir: dir,
            r615,
            r580,
            limits,
        }
    })
}

const UUID: &str = "GPU-00000000-0000-0000-0000-000000000001";
const GIB: u64 = 1 << 30;

#[test]
fn a_limit_set_on_a_cgroup_is_read_back_and_cleared() {
    let nvml = NvmlMemoryLimits::open(Some(&fakes().r615)).unwrap();
    assert_eq!(nvml.driver_version(), "615.29.01");
    let cgroup = tempfile::tempdir().unwrap();
    assert_eq!(nvml.get(UUID, cgroup.path()).unwrap(), None);
    nvml.set(UUID, cgroup.path(), 4 * GIB, 4 * GIB).unwrap();
    let got = nvml.get(UUID, cgroup.path()).unwrap().unwrap();
    assert_eq!((got.soft, got.hard), (4 * GIB, 4 * GIB));
    nvml.clear(UUID, cgroup.path()).unwrap();
    assert_eq!(nvml.get(UUID, cgroup.path()).unwrap(), None);
    let ino = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(cgroup.path()).unwrap());
    assert!(
        !fakes().limits.join(format!("ino-{ino}")).exists(),
        "a cleared limit is gone"
    );
}

#[test]
fn nvmls_refusals_name_the_call_the_card_and_the_cgroup() {
    let nvml = NvmlMemoryLimits::open(Some(&fakes().r615)).unwrap();
    let gone = Path::new("/sys/fs/cgroup/no-such-cgroup-of-tessera");
    let e = nvml.set(UUID, gone, 0, GIB).unwrap_err();
    assert!(matches!(e, MemoryLimitError::Nvml { rc: 17, .. }), "{e:?}");
    let text = e.to_string();
    assert!(text.contains("nvmlDeviceSetMemoryLimits_v1"), "{text}");
    assert!(
        text.contains(UUID) && text.contains("no-such-cgroup-of-tessera"),
        "{text}"
    );
    assert!(text.contains("Operating System"), "{text}");
    let cgroup = tempfile::tempdir().unwrap();
    let e = nvml.set(UUID, cgroup.path(), 2 * GIB, GIB).unwrap_err();
    assert!(
        matches!(e, MemoryLimitError::Nvml { rc: 2, .. }),
        "soft above hard: {e:?}"
    );
    let e = nvml.set("not-a-uuid", cgroup.path(), 0, GIB).unwrap_err();
    assert!(e.to_string().contains("nvmlDeviceGetHandleByUUID"), "{e}");
}

fn cgroup_root(controllers: &str) -> tempfile::TempDir {
    let root = tempfile::tempdir().unwrap();
    std::fs::write(root.path().join("cgroup.controllers"), controllers).unwrap();
    root
}

#[test]
fn probe_finds_the_drivers_limits_and_the_kernels_dmem() {
    let with_dmem = cgroup_root("cpuset cpu io memory hugetlb pids rdma misc dmem\n");
    let (support, limits) = probe(Some(&fakes().r615), with_dmem.path());
    assert_eq!(
        support,
        Support::PerCgroup {
            driver: "615.29.01".into(),
            dmem: true
        }
    );
    assert!(limits.is_some());
    let without = cgroup_root("cpuset cpu io memory pids\n");
    let (support, _) = probe(Some(&fakes().r615), without.path());
    assert_eq!(
        support.to_string(),
        "per cgroup (driver 615.29.01, the driver's own accounting)"
    );
}

#[test]
fn probe_says_why_a_node_has_no_per_cgroup_limits() {
    let root = cgroup_root("cpu memory\n");
    let (support, limits) = probe(Some(&fakes().r580), root.path());
    assert!(limits.is_none());
    let Support::Unsupported(why) = support else {
        panic!("{support:?}")
    };
    assert!(
        why.contains("nvmlDeviceSetMemoryLimits_v1") && why.contains("r615"),
        "{why}"
    );
    let v1 = tempfile::tempdir().unwrap();
    let (support, _) = probe(Some(&fakes().r615), v1.path());
    assert!(support.to_string().contains("not a cgroup v2 hierarchy"), "{support}");
    let (support, _) = probe(Some(Path::new("/nonexistent/libnvidia-ml.so.1")), root.path());
    assert!(support.to_string().contains("cannot load NVML"), "{support}");
}

fn proc_with(pid: u32, cgroup: &str) -> tempfile::TempDir {
    let proc = tempfile::tempdir().unwrap();
    std::fs::create_dir(proc.path().join(pid.to_string())).unwrap();
    std::fs::write(proc.path().join(pid.to_string()).join("cgroup"), cgroup).unwrap();
    proc
}

#[test]
fn a_processs_cgroup_is_its_v2_entry_under_the_hierarchy() {
    let root = cgroup_root("memory\n");
    let dir = root
        .path()
        .join("kubepods.slice/kubepods-pod1.slice/cri-containerd-abc.scope");
    std::fs::create_dir_all(&dir).unwrap();
    let proc = proc_with(7, "0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-abc.scope\n");
    assert_eq!(cgroup_of_process(proc.path(), 7, root.path()).unwrap(), dir);
    let proc = proc_with(7, "0::/../../kubepods.slice/x.scope\n");
    assert!(matches!(
        cgroup_of_process(proc.path(), 7, root.path()),
        Err(CgroupError::OutsideNamespace { .. })
    ));
    let proc = proc_with(7, "12:memory:/kubepods/x\n");
    assert!(matches!(
        cgroup_of_process(proc.path(), 7, root.path()),
        Err(CgroupError::NotV2(_))
    ));
    let proc = proc_with(7, "0::/kubepods.slice/gone.scope\n");
    let e = cgroup_of_process(proc.path(), 7, root.path()).unwrap_err();
    assert!(e.to_string().contains("gone.scope does not exist"), "{e}");
    assert!(matches!(
        cgroup_of_process(proc.path(), 8, root.path()),
        Err(CgroupError::Read { .. })
    ));
}

#[test]
fn this_processs_own_cgroup_is_found_in_the_cgroup_v2_hierarchy() {
    let root = cgroup2_root().expect("a cgroup v2 hierarchy is mounted (pure or hybrid)");
    assert!(root.join("cgroup.controllers").exists(), "{}", root.display());
    let own = cgroup_of_process(Path::new("/proc"), std::process::id(), &root).unwrap();
    assert!(own.join("cgroup.procs").exists(), "{}", own.display());
}

#[test]
fn a_container_outside_this_namespace_is_found_by_the_runtimes_cgroup_path() {
    let root = cgroup_root("memory\n");
    let systemd = root
        .path()
        .join("kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1.slice/cri-containerd-abc.scope");
    std::fs::create_dir_all(&systemd).unwrap();
    let proc = proc_with(7, "0::/../../kubepods.slice/x.scope\n");
    let found = cgroup_of_container(
        proc.path(),
        7,
        "kubepods-besteffort-pod1.slice:cri-containerd:abc",
        root.path(),
    );
    assert_eq!(found.unwrap(), systemd);
    let cgroupfs = root.path().join("kubepods/besteffort/pod1/abc");
    std::fs::create_dir_all(&cgroupfs).unwrap();
    let found = cgroup_of_container(proc.path(), 7, "/kubepods/besteffort/pod1/abc", root.path());
    assert_eq!(found.unwrap(), cgroupfs);
    let e = cgroup_of_container(proc.path(), 7, "/kubepods/gone", root.path()).unwrap_err();
    assert!(e.to_string().contains("kubepods/gone does not exist"), "{e}");
    // In this namespace, the process's own entry is taken over the runtime's path.
    let proc = proc_with(7, "0::/kubepods/besteffort/pod1/abc\n");
    assert_eq!(
        cgroup_of_container(proc.path(), 7, "elsewhere", root.path()).unwrap(),
        cgroupfs
    );
}
