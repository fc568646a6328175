//! Tessera on a real single-node Kubernetes (`tessera_tests::cluster`): the harness itself
//! first, a pod running and nothing left behind once the cluster is dropped.

use std::time::{Duration, Instant};

use tessera_tests::cluster::Cluster;

const BUSYBOX_POD: &str = r#"apiVersion: v1
kind: Pod
metadata: {name: hello, namespace: default}
spec:
  restartPolicy: Never
  containers:
  - name: main
    image: docker.io/tessera/busybox:test
    imagePullPolicy: Never
    command: ["sh", "-c", "echo hello from $(cat /proc/self/cgroup | wc -l) cgroups; sleep 1"]
"#;

/// The cluster comes up, runs a pod to completion, and once dropped leaves no process, mount,
/// network namespace or cgroup of its own behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_cluster_runs_a_pod_and_leaves_nothing_behind() -> anyhow::Result<()> {
    let begun = Instant::now();
    let c = Cluster::start().await?;
    println!("Kubernetes {} up in {:.1}s", c.version(), c.started_in().as_secs_f64());
    c.apply(BUSYBOX_POD)?;
    c.wait_for(&["pod/hello"], "{.status.phase}", "Succeeded", Duration::from_secs(90))
        .await?;
    let logs = c.kubectl_ok(&["logs", "hello"])?;
    assert!(logs.starts_with("hello from"), "{logs}");
    let (dir, netns) = (c.dir().to_path_buf(), c.netns().to_string());
    assert!(
        !c.mounts().is_empty(),
        "a running pod has mounts under the cluster's folder"
    );
    drop(c);
    println!("whole run {:.1}s", begun.elapsed().as_secs_f64());
    // Nothing of it is left.
    let dir_text = dir.display().to_string();
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")?;
    assert!(!mountinfo.contains(&dir_text), "mounts left under {dir_text}");
    assert!(!dir.exists(), "{dir_text} left");
    let netns_list = std::process::Command::new("ip").args(["netns", "list"]).output()?;
    assert!(!String::from_utf8_lossy(&netns_list.stdout).contains(&netns));
    for e in std::fs::read_dir("/proc")?.flatten() {
        let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        assert!(
            !String::from_utf8_lossy(&cmdline).contains(&dir_text),
            "process {:?} left: {}",
            e.file_name(),
            String::from_utf8_lossy(&cmdline).replace('\0', " ")
        );
    }
    assert!(
        !std::path::Path::new("/sys/fs/cgroup/kubepods").exists()
            || std::fs::read_dir("/sys/fs/cgroup/kubepods")?.next().is_none()
    );
    Ok(())
}
