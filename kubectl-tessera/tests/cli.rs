//! The `kubectl-tessera` binary as kubectl runs it: the cluster from `KUBECONFIG`, the table on
//! stdout, and exit 1 with a message on stderr when there is nothing to show.

use std::process::Command;

use tessera_tests::apiserver::FakeApiServer;
use tessera_tests::gpu_cluster::{gpu_node, plain_node};

fn kubectl_tessera(kubeconfig: &std::path::Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kubectl-tessera"))
        .args(args)
        .env("KUBECONFIG", kubeconfig)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .output()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_the_kubeconfig_and_says_when_there_is_nothing() -> anyhow::Result<()> {
    let api = FakeApiServer::start().await?;
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("config");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\n\
             contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: me\n\
             current-context: fake\nusers:\n- name: me\n  user: {{}}\n",
            api.url()
        ),
    )?;
    api.create_node(&plain_node("cpu-only"))?;
    let out = kubectl_tessera(&kubeconfig, &["inspect"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.starts_with("error: no Tessera nodes"), "{err}");

    api.create_node(&gpu_node("t1", "t4x2"))?;
    let out = kubectl_tessera(&kubeconfig, &["inspect", "-o", "wide"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("NODE  GPU  MODEL"), "{text}");
    assert_eq!(text.lines().filter(|l| l.starts_with("t1 ")).count(), 2, "{text}");

    let out = kubectl_tessera(&kubeconfig, &["pod", "ghost", "-n", "team"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "error: pod team/ghost not found\n"
    );
    Ok(())
}

/// As kubectl plugins do: `--kubeconfig`, `--context` (before or after the command), `-n`
/// defaulting to the context's namespace; an unreachable server is named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubeconfig_context_and_namespace_as_kubectl_takes_them() -> anyhow::Result<()> {
    let api = FakeApiServer::start().await?;
    api.create_node(&gpu_node("t1", "t4x2"))?;
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("config");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster: {{server: \"{}\"}}\n\
             - name: dead\n  cluster: {{server: \"http://127.0.0.1:9\"}}\n\
             contexts:\n- name: dead\n  context: {{cluster: dead, user: me}}\n\
             - name: fake\n  context: {{cluster: fake, user: me, namespace: team}}\n\
             current-context: dead\nusers:\n- name: me\n  user: {{}}\n",
            api.url()
        ),
    )?;
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_kubectl-tessera"))
            .args(args)
            .env_remove("KUBECONFIG")
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env("HOME", dir.path())
            .output()
            .unwrap()
    };
    let k = kubeconfig.to_str().unwrap();
    // The current context's server is down: named.
    let out = run(&["--kubeconfig", k, "inspect"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.starts_with("error: http://127.0.0.1:9/"), "{err}");
    // Another context, the flag before or after the command.
    for args in [
        &["--kubeconfig", k, "--context", "fake", "inspect"][..],
        &["inspect", "--context", "fake", "--kubeconfig", k][..],
    ] {
        let out = run(args);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(String::from_utf8_lossy(&out.stdout).contains("t1 "));
    }
    // `pod` looks in the context's namespace unless told.
    let out = run(&["--kubeconfig", k, "--context", "fake", "pod", "ghost"]);
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "error: pod team/ghost not found\n"
    );
    let out = run(&["--kubeconfig", k, "--context", "fake", "pod", "ghost", "-n", "other"]);
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "error: pod other/ghost not found\n"
    );
    // A missing file and an unknown context, named.
    let out = run(&["--kubeconfig", "/nonexistent/config", "inspect"]);
    assert!(String::from_utf8_lossy(&out.stderr).starts_with("error: --kubeconfig /nonexistent/config:"));
    let out = run(&["--kubeconfig", k, "--context", "nope", "inspect"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("nope"));
    Ok(())
}

/// A node whose inventory annotation is malformed, or of a format newer than this build reads,
/// is named with why; the nodes that can be read are still shown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_inventories_are_named_and_the_rest_shown() -> anyhow::Result<()> {
    use tessera_core::names::ANNOTATION_INVENTORY;
    let api = FakeApiServer::start().await?;
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("config");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster: {{server: \"{}\"}}\n\
             contexts:\n- name: fake\n  context: {{cluster: fake, user: me}}\n\
             current-context: fake\nusers:\n- name: me\n  user: {{}}\n",
            api.url()
        ),
    )?;
    let annotated = |name: &str, edit: &dyn Fn(&str) -> String| {
        let mut n = gpu_node(name, "t4x2");
        let a = n.metadata.annotations.as_mut().unwrap();
        let v = a.get_mut(ANNOTATION_INVENTORY).unwrap();
        *v = edit(v);
        n
    };
    api.create_node(&annotated("newer", &|v| {
        v.replacen("\"version\":1", "\"version\":2", 1)
    }))?;
    api.create_node(&annotated("broken", &|v| v[..v.len() / 2].to_string()))?;
    let newer = "node newer: its tessera.io/inventory annotation is of format version 2, and this \
                 kubectl-tessera reads version 1: kubectl-tessera is older than the node agents";
    let broken = "node broken: its tessera.io/inventory annotation cannot be read: ";
    // Only unreadable nodes: an error naming each, not "no node carries the annotation".
    let out = kubectl_tessera(&kubeconfig, &["inspect"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.starts_with("error: no Tessera node can be read:") && err.contains(newer) && err.contains(broken),
        "{err}"
    );
    assert!(!err.contains("DaemonSet"), "{err}");
    // One named: its own reason.
    let out = kubectl_tessera(&kubeconfig, &["inspect", "newer"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(newer) && !err.contains(broken), "{err}");
    // With a readable node: it is shown, the others noted.
    api.create_node(&gpu_node("t1", "t4x2"))?;
    let out = kubectl_tessera(&kubeconfig, &["inspect"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(text.lines().filter(|l| l.starts_with("t1 ")).count(), 2, "{text}");
    assert!(
        text.contains(&format!("! {newer}")) && text.contains(&format!("! {broken}")),
        "{text}"
    );
    Ok(())
}

/// A write that fails is an error naming standard output, not a panic; a memory unit of 0 is
/// refused, naming the flag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_and_a_zero_memory_unit_are_errors() -> anyhow::Result<()> {
    let api = FakeApiServer::start().await?;
    api.create_node(&gpu_node("t1", "t4x2"))?;
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("config");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster: {{server: \"{}\"}}\n\
             contexts:\n- name: fake\n  context: {{cluster: fake, user: me}}\n\
             current-context: fake\nusers:\n- name: me\n  user: {{}}\n",
            api.url()
        ),
    )?;
    let out = Command::new(env!("CARGO_BIN_EXE_kubectl-tessera"))
        .arg("inspect")
        .env("KUBECONFIG", &kubeconfig)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .stdout(std::fs::OpenOptions::new().write(true).open("/dev/full")?)
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(
        err,
        "error: writing to standard output: No space left on device (os error 28)\n"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_kubectl-tessera"))
        .args(["pod", "x", "--memory-unit-mib", "0"])
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains(
            "invalid value '0' for '--memory-unit-mib <MEMORY_UNIT_MIB>': the memory unit must be at least 1 MiB"
        ),
        "{err}"
    );
    Ok(())
}
