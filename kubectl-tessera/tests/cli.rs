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
