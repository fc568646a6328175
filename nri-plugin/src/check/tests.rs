use super::*;
use tessera_core::enforcement::HookLayout;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn levels(f: &[Finding]) -> Vec<(&'static str, Level)> {
    f.iter().map(|f| (f.what, f.level)).collect()
}

#[test]
fn the_shipped_runtime_snippets_pass() {
    for file in ["containerd-1.7.toml", "containerd-2.x.toml"] {
        let f = check_containerd_config(&root().join("deploy/runtime").join(file));
        assert_eq!(
            levels(&f),
            [("containerd NRI", Level::Ok), ("containerd CDI", Level::Ok)],
            "{file}: {f:?}"
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let main = dir.path().join("crio.conf");
    std::fs::write(&main, "[crio.runtime]\n").unwrap();
    std::fs::create_dir(dir.path().join("crio.conf.d")).unwrap();
    std::fs::copy(
        root().join("deploy/runtime/crio-nri.conf"),
        dir.path().join("crio.conf.d/10-tessera-nri.conf"),
    )
    .unwrap();
    assert_eq!(check_crio_config(&main).unwrap().level, Level::Ok);
}

#[test]
fn defaults_and_disabled_nri_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("config.toml");
    // containerd 1.7 with no NRI section: NRI is off by default there.
    std::fs::write(&p, "version = 2\n").unwrap();
    let f = check_containerd_config(&p);
    assert_eq!(f[0].level, Level::Fail);
    assert!(f[0].detail.contains("disable = false"), "{}", f[0]);
    assert_eq!(f[1].level, Level::Warn);
    // containerd 2.x defaults: both on.
    std::fs::write(&p, "version = 3\n").unwrap();
    assert!(check_containerd_config(&p).iter().all(|f| f.level == Level::Ok));
    // Explicitly disabled on 2.x.
    std::fs::write(
        &p,
        "version = 3\n[plugins.\"io.containerd.nri.v1.nri\"]\ndisable = true\n",
    )
    .unwrap();
    assert_eq!(check_containerd_config(&p)[0].level, Level::Fail);
    // Not TOML.
    std::fs::write(&p, "version = = 3").unwrap();
    let f = check_containerd_config(&p);
    assert!(
        f[0].level == Level::Fail && f[0].detail.contains("not valid TOML"),
        "{f:?}"
    );
    // CRI-O with NRI off.
    let main = dir.path().join("crio.conf");
    std::fs::write(&main, "[crio.nri]\nenable_nri = false\n").unwrap();
    assert_eq!(check_crio_config(&main).unwrap().level, Level::Fail);
}

#[test]
fn a_bare_node_fails_every_node_check_with_a_reason() {
    let dir = tempfile::tempdir().unwrap();
    let f = run(&CheckOptions {
        socket: dir.path().join("nri.sock"),
        containerd_config: dir.path().join("containerd.toml"),
        crio_config: dir.path().join("crio.conf"),
        cdi_dirs: vec![dir.path().join("cdi")],
        keys_dir: dir.path().join("keys"),
        host_root: dir.path().to_path_buf(),
        driver_root: None,
        dev_root: dir.path().to_path_buf(),
        enforcement: ShareEnforcement::None,
        mps: MpsLayout::new(dir.path().join("mps")),
        hook: HookLayout::default(),
        cgroup_root: dir.path().join("no-cgroup"),
        nvml_library: None,
    });
    assert_eq!(
        levels(&f),
        [
            ("NRI socket", Level::Fail),
            ("runtime config", Level::Warn),
            ("CDI spec", Level::Fail),
            ("NVIDIA driver", Level::Fail),
            ("share limits", Level::Warn),
            ("share memory", Level::Ok),
            ("hand-off keys", Level::Fail),
        ]
    );
    assert!(f[0].detail.contains("absent"), "{}", f[0]);
    assert!(f[3].detail.contains("nvidiactl"), "{}", f[3]);
}

/// The node: NVML reachable through a link, no libcuda anywhere, and a spec that
/// mounts no libcuda. Both checks fail, naming what is missing; with libcuda they pass.
#[test]
fn a_node_without_libcuda_is_not_ready() {
    let dir = tempfile::tempdir().unwrap();
    let host = dir.path();
    std::fs::create_dir_all(host.join("dev")).unwrap();
    std::fs::write(host.join("dev/nvidiactl"), b"").unwrap();
    let lib = host.join("usr/lib/x86_64-linux-gnu");
    std::fs::create_dir_all(&lib).unwrap();
    std::fs::write(lib.join("libnvidia-ml.so.580.95.05"), b"x").unwrap();
    std::os::unix::fs::symlink("libnvidia-ml.so.580.95.05", host.join("usr/lib/libnvidia-ml.so.1")).unwrap();
    let cdi = host.join("cdi");
    std::fs::create_dir_all(&cdi).unwrap();
    let spec = serde_json::json!({
        "cdiVersion": "0.5.0", "kind": CDI_KIND,
        "devices": [{"name": "all", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0}]}}],
        "containerEdits": {"mounts": [{"hostPath": "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.580.95.05",
            "containerPath": "/usr/local/nvidia/lib64/libnvidia-ml.so.1", "options": ["ro", "bind"]}]}
    });
    std::fs::write(cdi.join("tessera.io-gpu.json"), spec.to_string()).unwrap();
    let opts = CheckOptions {
        socket: host.join("nri.sock"),
        containerd_config: host.join("none"),
        crio_config: host.join("none"),
        cdi_dirs: vec![cdi.clone()],
        keys_dir: host.join("keys"),
        host_root: host.to_path_buf(),
        driver_root: None,
        dev_root: host.to_path_buf(),
        enforcement: ShareEnforcement::None,
        mps: MpsLayout::new(host.join("mps")),
        hook: HookLayout::default(),
        cgroup_root: host.join("no-cgroup"),
        nvml_library: None,
    };
    let f = run(&opts);
    let get = |f: &[Finding], what: &str| f.iter().find(|x| x.what == what).cloned().unwrap();
    let (c, d) = (get(&f, "CDI spec"), get(&f, "NVIDIA driver"));
    assert_eq!((c.level, d.level), (Level::Fail, Level::Fail), "{c}\n{d}");
    assert!(c.detail.contains("mounts no libcuda.so.1"), "{c}");
    assert!(d.detail.contains("no libcuda found under driver root /"), "{d}");

    // Install libcuda: the driver check passes (the stale spec still fails).
    std::fs::write(lib.join("libcuda.so.580.95.05"), b"x").unwrap();
    let f = run(&opts);
    let d = get(&f, "NVIDIA driver");
    assert_eq!(d.level, Level::Ok, "{d}");
    assert!(d.detail.contains("version 580.95.05"), "{d}");
    assert_eq!(get(&f, "CDI spec").level, Level::Fail);
}

/// A spec naming driver files the node does not have (a fixture's list, a driver removed
/// since): runc would refuse every GPU container ("error mounting ... no such file").
#[test]
fn a_spec_whose_mounted_files_do_not_exist_fails() {
    let dir = tempfile::tempdir().unwrap();
    let host = dir.path();
    let cdi = host.join("cdi");
    std::fs::create_dir_all(&cdi).unwrap();
    let lib = "/usr/local/nvidia/lib64/libcuda.so.550.54.15";
    let spec = serde_json::json!({
        "cdiVersion": "0.5.0", "kind": CDI_KIND,
        "devices": [{"name": "all", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0}]}}],
        "containerEdits": {"mounts": [{"hostPath": lib, "containerPath": "/usr/local/nvidia/lib64/libcuda.so.1", "options": ["ro", "bind"]}]}
    });
    std::fs::write(cdi.join("tessera.io-gpu.json"), spec.to_string()).unwrap();
    let finding = || super::check_cdi(std::slice::from_ref(&cdi), host);
    let f = finding();
    assert_eq!(f.level, Level::Fail, "{f}");
    assert!(
        f.detail.contains("1 host path(s) that do not exist") && f.detail.contains(lib),
        "{f}"
    );
    let local = host.join(lib.trim_start_matches('/'));
    std::fs::create_dir_all(local.parent().unwrap()).unwrap();
    std::fs::write(&local, b"x").unwrap();
    let f = finding();
    assert_eq!(f.level, Level::Ok, "{f}");
}

#[test]
fn mps_nodes_need_a_ready_daemon_per_shared_card() {
    use tessera_core::inventory::{FixtureSource, InventorySource};
    let dir = tempfile::tempdir().unwrap();
    let cdi = dir.path().join("cdi");
    std::fs::create_dir_all(&cdi).unwrap();
    let inv = FixtureSource::new("t4x2").discover().unwrap();
    let layout = MpsLayout::new(dir.path().join("mps"));
    let hook = HookLayout::new(dir.path().join("hook"));
    let opts = tessera_cdi_generator::spec::SpecOptions {
        enforcement: ShareEnforcement::Mps,
        mps: layout.clone(),
        hook: hook.clone(),
        ..Default::default()
    };
    let (_, text) = tessera_cdi_generator::spec::render(&inv, &opts).unwrap();
    std::fs::write(cdi.join("tessera.io-gpu.json"), text).unwrap();
    let check = || {
        check_enforcement(&CheckOptions {
            mps: layout.clone(),
            hook: hook.clone(),
            ..node_under(dir.path(), &cdi, ShareEnforcement::Mps)
        })
    };
    // The CUDA hook holds a share's processes to its memory together: not installed, refused.
    let f = check();
    assert_eq!(f.level, Level::Fail, "{f}");
    assert!(f.detail.contains("the CUDA hook is not installed"), "{f}");
    let library = dir.path().join("libtessera-cuda-hook.so");
    std::fs::write(&library, b"the hook").unwrap();
    hook.install(&library).unwrap();
    let f = check();
    assert_eq!(f.level, Level::Fail, "{f}");
    assert!(f.detail.contains("2 of 2 card daemon(s) not ready"), "{f}");
    tessera_tests::mps::hold_wanted_ceilings(&layout, inv.gpus.iter().map(|g| g.uuid.as_str())).unwrap();
    // Ready, but whether a process that goes around MPS could take a card whole is not known.
    let f = check();
    assert_eq!(f.level, Level::Warn, "{f}");
    assert!(f.detail.contains("mps: 2 card daemon(s) ready"), "{f}");
    assert!(f.detail.contains("2 whose compute mode could not be read"), "{f}");
    // The supervisor read one card in the default mode: named, with what closes it.
    let (open, closed) = (&inv.gpus[0].uuid, &inv.gpus[1].uuid);
    for (uuid, exclusive) in [(open, false), (closed, true)] {
        let mut state = layout.read_state(uuid).unwrap();
        state.exclusive_process = Some(exclusive);
        layout.write_state(uuid, &state).unwrap();
    }
    let f = check();
    assert_eq!(f.level, Level::Warn, "{f}");
    assert!(
        f.detail.contains(&format!("1 not in exclusive-process mode ({open})"))
            && f.detail.contains("--exclusive-process")
            && !f.detail.contains(closed.as_str()),
        "{f}"
    );
    let mut state = layout.read_state(open).unwrap();
    state.exclusive_process = Some(true);
    layout.write_state(open, &state).unwrap();
    let f = check();
    assert_eq!(f.level, Level::Ok, "{f}");
    assert!(f.detail.contains("each card in exclusive-process mode"), "{f}");
}

/// The nodes' key check tells an Ed25519 public key (ok) from the extender's private key (a
/// failure: any node holding it can sign), a shared HMAC secret (a warning: the older kind, which
/// signs too) and a key pasted without its PEM lines (a failure naming it). Before, all four
/// passed as `[ok]`.
#[test]
fn the_key_check_refuses_a_private_key_on_a_node_and_names_the_kind() {
    // As `openssl genpkey -algorithm ed25519` and `openssl pkey -pubout` write them.
    const PRIVATE: &str = "-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEIFOp+9r1vMK0O26nlPQZlcwHt0NeIp86Z8YsUicBqsCW\n-----END PRIVATE KEY-----\n";
    const PUBLIC: &str = "-----BEGIN PUBLIC KEY-----\nMCowBQYDK2VwAyEA08aWN5LIdbKCx0D+TD4GJ9t0rC0XafHceh6LUkdbq3M=\n-----END PUBLIC KEY-----\n";
    let check = |files: &[(&str, &[u8])]| {
        let d = tempfile::tempdir().unwrap();
        for (name, bytes) in files {
            std::fs::write(d.path().join(name), bytes).unwrap();
        }
        check_keys(d.path())
    };
    let f = check(&[("k1", PUBLIC.as_bytes())]);
    assert_eq!(f.level, Level::Ok, "{f}");
    let f = check(&[("k1", PRIVATE.as_bytes())]);
    assert_eq!(f.level, Level::Fail, "{f}");
    assert!(f.detail.contains("k1") && f.detail.contains("private key"), "{f}");
    let f = check(&[("k1", PUBLIC.as_bytes()), ("k0", &[7u8; 32])]);
    assert_eq!(f.level, Level::Warn, "{f}");
    assert!(f.detail.contains("k0") && f.detail.contains("HMAC"), "{f}");
    // The key's body alone, without its PEM lines (a Secret made from a copied middle line).
    let f = check(&[("k1", b"MCowBQYDK2VwAyEA08aWN5LIdbKCx0D+TD4GJ9t0rC0XafHceh6LUkdbq3M=\n")]);
    assert_eq!(f.level, Level::Fail, "{f}");
    assert!(f.detail.contains("without its PEM lines"), "{f}");
}

/// `check` says how the share cards' memory is held: per cgroup where the driver (here the
/// hook tests' fake r615 NVML) and a cgroup v2 hierarchy have it, else by the hook (and MPS),
/// naming what goes around it.
#[test]
fn share_memory_is_said_per_cgroup_or_by_the_hook() {
    use tessera_core::inventory::{FixtureSource, InventorySource};
    let dir = tempfile::tempdir().unwrap();
    let cdi = dir.path().join("cdi");
    std::fs::create_dir_all(&cdi).unwrap();
    let inv = FixtureSource::new("t4x2").discover().unwrap();
    let spec = tessera_cdi_generator::spec::SpecOptions {
        enforcement: ShareEnforcement::Mps,
        ..Default::default()
    };
    let (_, text) = tessera_cdi_generator::spec::render(&inv, &spec).unwrap();
    std::fs::write(cdi.join("tessera.io-gpu.json"), text).unwrap();
    let src = root().join("hook/tests/c");
    let nvml = dir.path().join("libnvidia-ml.so.1");
    let cc = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-O2"])
        .arg(format!("-I{}", src.display()))
        .arg("-o")
        .arg(&nvml)
        .arg(src.join("fake_nvml.c"))
        .status()
        .unwrap();
    assert!(cc.success());
    let cgroup = dir.path().join("cgroup");
    std::fs::create_dir_all(&cgroup).unwrap();
    std::fs::write(cgroup.join("cgroup.controllers"), "cpu memory dmem\n").unwrap();
    let opts = |enforcement, cgroup_root: &Path| CheckOptions {
        cgroup_root: cgroup_root.to_path_buf(),
        nvml_library: Some(nvml.clone()),
        ..node_under(dir.path(), &cdi, enforcement)
    };
    let f = check_share_memory(&opts(ShareEnforcement::Mps, &cgroup));
    assert!(
        f.detail.contains(&inv.gpus[0].uuid) && f.detail.contains(&inv.gpus[1].uuid),
        "{f}"
    );
    assert!(
        f.detail
            .contains("per cgroup (driver 615.29.01, the kernel's dmem controller)")
            && f.detail.contains("one budget the driver holds on its cgroup"),
        "{f}"
    );
    let v1 = dir.path().join("v1");
    std::fs::create_dir_all(&v1).unwrap();
    let f = check_share_memory(&opts(ShareEnforcement::Mps, &v1));
    assert!(
        f.detail.contains("not a cgroup v2 hierarchy") && f.detail.contains("held by MPS alone"),
        "{f}"
    );
    let f = check_share_memory(&opts(ShareEnforcement::Hook, &v1));
    assert!(f.detail.contains("by the CUDA hook alone"), "{f}");
}

/// A node's check options with everything under `dir` (nothing there but what a test puts),
/// its CDI specs in `cdi`.
fn node_under(dir: &Path, cdi: &Path, enforcement: ShareEnforcement) -> CheckOptions {
    CheckOptions {
        socket: dir.join("nri.sock"),
        containerd_config: dir.join("none"),
        crio_config: dir.join("none"),
        cdi_dirs: vec![cdi.to_path_buf()],
        keys_dir: dir.join("keys"),
        host_root: dir.to_path_buf(),
        driver_root: None,
        dev_root: dir.to_path_buf(),
        enforcement,
        mps: MpsLayout::new(dir.join("mps")),
        hook: HookLayout::default(),
        cgroup_root: dir.join("no-cgroup"),
        nvml_library: None,
    }
}
