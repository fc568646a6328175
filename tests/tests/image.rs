//! Tessera's image built without Docker (`scripts/image.sh`) runs: packed twice from the same
//! binaries it is the same archive, and imported into the real containerd (as
//! `ctr images import` does on a node without a registry) its programs run, as the user the
//! image names and as root, with the C library it carries.

use std::path::{Path, PathBuf};
use std::process::Command;

use tessera_tests::containerd::{ContainerSpec, Containerd, Version};

const NAME: &str = "docker.io/tessera/tessera:image-test";

/// Where cargo put this build's binaries (`target/debug`).
fn built() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().and_then(Path::parent).unwrap().to_path_buf()
}

fn pack(out: &Path) -> anyhow::Result<String> {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let run = Command::new("bash")
        .arg(repo.join("scripts/image.sh"))
        .arg("--from")
        .arg(built())
        .args(["--name", NAME, "--out"])
        .arg(out)
        .output()?;
    anyhow::ensure!(
        run.status.success(),
        "scripts/image.sh: {}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    Ok(String::from_utf8_lossy(&run.stdout).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_image_built_without_docker_runs_its_programs() -> anyhow::Result<()> {
    let work = tempfile::tempdir()?;
    let (a, b) = (work.path().join("a.tar"), work.path().join("b.tar"));
    let said = pack(&a)?;
    pack(&b)?;
    assert!(std::fs::read(&a)? == std::fs::read(&b)?, "two packs differ");
    // Only one copy is imported; CI's disk is often nearly full.
    std::fs::remove_file(&b)?;
    assert!(said.contains("sha256:"), "{said}");

    let mut c = Containerd::start(Version::V2).await?;
    c.import_image(&a)?;
    let pod = c.run_pod("image", &[]).await?;
    // As the image says: the extender's user; every program answers.
    let cid = c
        .create_container(
            &pod,
            ContainerSpec::new("main", &["/usr/local/bin/tessera-manifests", "--help"]).image(NAME),
        )
        .await?;
    let (code, out) = c.run_to_exit(&cid).await?;
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("Usage"), "{out}");
    for program in [
        "tessera-extender",
        "tessera-cdi-generator",
        "tessera-device-plugin",
        "tessera-dra-plugin",
        "tessera-nri-plugin",
        "tessera-mps-supervisor",
    ] {
        let cid = c
            .create_container(
                &pod,
                ContainerSpec::new(program, &[&format!("/usr/local/bin/{program}"), "--version"])
                    .image(NAME)
                    .user(0),
            )
            .await?;
        let (code, out) = c.run_to_exit(&cid).await?;
        assert_eq!(code, 0, "{program}: {out}");
        assert!(out.contains(env!("CARGO_PKG_VERSION")), "{program}: {out}");
    }
    Ok(())
}
