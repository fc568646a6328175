//! The Helm chart installed against a real API server (`helm install --dry-run=server`, so the
//! server checks every object and the chart's lookups see the cluster): it refuses to install
//! while the hand-off key Secrets are missing or wrong, naming the Secret and what to do, and
//! says what comes next once they are right.

use std::path::{Path, PathBuf};
use std::process::Command;

use tessera_deploy::{KEYS_SECRET, PUBLIC_KEYS_SECRET};
use tessera_tests::cluster::Cluster;

const NS: &str = "tessera-system";

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap()
}

/// Helm's binary: `TESSERA_HELM`, or where scripts/fetch-helm.sh puts it.
fn helm() -> PathBuf {
    let helm = std::env::var_os("TESSERA_HELM")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(".cache/helm/v4.2.3/helm"));
    assert!(
        helm.is_file(),
        "no Helm at {}: run scripts/fetch-helm.sh (scripts/test.sh does)",
        helm.display()
    );
    helm
}

/// `helm install --dry-run=server` of the checked-in chart: its stdout, or its stderr as the
/// error.
fn install(c: &Cluster) -> Result<String, String> {
    let state = c.dir().join("helm");
    let out = c
        .command(helm())
        .env("KUBECONFIG", c.kubeconfig())
        .env("HELM_CACHE_HOME", state.join("cache"))
        .env("HELM_CONFIG_HOME", state.join("config"))
        .env("HELM_DATA_HOME", state.join("data"))
        .args(["install", "tessera"])
        .arg(root().join("deploy/chart/tessera"))
        .args(["--namespace", NS, "--dry-run=server"])
        .output()
        .expect("helm runs");
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// The install's error: the test fails, showing Helm's notes, when it installs instead.
fn refused(c: &Cluster, what: &str) -> String {
    match install(c) {
        Ok(out) => panic!("installed {what}:{}", out.rsplit("NOTES:").next().unwrap_or_default()),
        Err(e) => e,
    }
}

/// An Ed25519 key pair made as the README makes it: (private PEM file, public PEM file).
fn key_pair(dir: &Path, id: &str) -> (PathBuf, PathBuf) {
    let (private, public) = (dir.join(format!("{id}.pem")), dir.join(format!("{id}.pub")));
    for args in [
        vec!["genpkey", "-algorithm", "ed25519", "-out", private.to_str().unwrap()],
        vec![
            "pkey",
            "-in",
            private.to_str().unwrap(),
            "-pubout",
            "-out",
            public.to_str().unwrap(),
        ],
    ] {
        let out = Command::new("openssl").args(&args).output().expect("openssl runs");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    (private, public)
}

/// Puts Secret `name` in the namespace with `entries`, replacing it if there.
fn secret(c: &Cluster, name: &str, entries: &[String]) -> anyhow::Result<()> {
    let _ = c.kubectl(&["-n", NS, "delete", "secret", name, "--ignore-not-found"])?;
    let mut args = vec!["-n", NS, "create", "secret", "generic", name];
    args.extend(entries.iter().map(String::as_str));
    c.kubectl_ok(&args)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_installs_only_with_keys_the_nodes_can_verify_and_cannot_sign_with() -> anyhow::Result<()> {
    let c = Cluster::start().await?;
    c.kubectl_ok(&["create", "namespace", NS])?;
    let (private, public) = key_pair(c.dir(), "k1");
    let from = |id: &str, file: &Path| format!("--from-file={id}={}", file.display());

    // No Secrets: the install stops at the first, naming it and where the steps are.
    let e = refused(&c, "without the key Secrets");
    assert!(
        e.contains(&format!("Secret {NS}/{KEYS_SECRET}"))
            && e.contains("does not exist")
            && e.contains("docs/operations.md"),
        "{e}"
    );

    // `active` names a key the Secret does not hold.
    secret(
        &c,
        KEYS_SECRET,
        &["--from-literal=active=k2".into(), from("k1", &private)],
    )?;
    let e = refused(&c, "with active naming no key");
    assert!(
        e.contains(r#"active names key "k2", which it does not hold (it holds k1)"#),
        "{e}"
    );

    // The extender's Secret right, the nodes' missing.
    secret(
        &c,
        KEYS_SECRET,
        &["--from-literal=active=k1".into(), from("k1", &private)],
    )?;
    let e = refused(&c, "without the nodes' Secret");
    assert!(
        e.contains(&format!("Secret {NS}/{PUBLIC_KEYS_SECRET}")) && e.contains("does not exist"),
        "{e}"
    );

    // The attack-shaped mistake: the private key copied to the nodes, so any node could sign.
    secret(&c, PUBLIC_KEYS_SECRET, &[from("k1", &private)])?;
    let e = refused(&c, "with a private key on the nodes");
    assert!(
        e.contains(r#"key "k1" is a private key, with which any node could sign"#),
        "{e}"
    );

    // The nodes hold another key's public half, not the active one's.
    let (_, other) = key_pair(c.dir(), "k0");
    secret(&c, PUBLIC_KEYS_SECRET, &[from("k0", &other)])?;
    let e = refused(&c, "with no public half of the active key");
    assert!(e.contains(r#"no key "k1", the active key's public half"#), "{e}");

    // As the README makes them: it installs (the API server takes every object) and says what
    // comes next.
    secret(&c, PUBLIC_KEYS_SECRET, &[from("k0", &other), from("k1", &public)])?;
    let out = install(&c).map_err(anyhow::Error::msg)?;
    for next in [
        "The hand-off key Secrets tessera-handoff-keys and tessera-handoff-public-keys were checked",
        "rollout status daemonset/tessera-node",
        "tessera-nri-plugin check",
        "kubectl tessera inspect",
    ] {
        assert!(out.contains(next), "the notes lack {next:?}:\n{out}");
    }
    Ok(())
}
