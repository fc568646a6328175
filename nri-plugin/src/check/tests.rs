use super::*;

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
        driver_root: dir.path().to_path_buf(),
        dev_root: dir.path().to_path_buf(),
    });
    assert_eq!(
        levels(&f),
        [
            ("NRI socket", Level::Fail),
            ("runtime config", Level::Warn),
            ("CDI spec", Level::Fail),
            ("NVIDIA driver", Level::Fail),
            ("hand-off keys", Level::Fail),
        ]
    );
    assert!(f[0].detail.contains("absent"), "{}", f[0]);
    assert!(f[3].detail.contains("nvidiactl"), "{}", f[3]);
}
