//! Tessera on a real single-node Kubernetes (`tessera_tests::cluster`): the harness itself
//! first, a pod running and nothing left behind once the cluster is dropped.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use tessera_core::inventory::{FixtureSource, InventorySource as _};
use tessera_tests::cluster::{Cluster, NODE};

/// Pod `hello` of the tests' busybox: it says hello from its cgroups, then sleeps `secs`.
fn hello_pod(secs: u32) -> String {
    format!(
        r#"apiVersion: v1
kind: Pod
metadata: {{name: hello, namespace: default}}
spec:
  restartPolicy: Never
  containers:
  - name: main
    image: docker.io/tessera/busybox:test
    imagePullPolicy: Never
    command: ["sh", "-c", "echo hello from $(cat /proc/self/cgroup | wc -l) cgroups; sleep {secs}"]
"#
    )
}

/// The cluster comes up, runs a pod, and once dropped with the pod still running leaves no
/// process, mount, network namespace or cgroup of its own behind. What it asserts it waits
/// for: the pod runs until the cluster goes (a pod that ended had its cgroup removed by the
/// kubelet's clean-up before the test looked, on a loaded machine).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_cluster_runs_a_pod_and_leaves_nothing_behind() -> anyhow::Result<()> {
    let begun = Instant::now();
    let c = Cluster::start().await?;
    println!("Kubernetes {} up in {:.1}s", c.version(), c.started_in().as_secs_f64());
    c.apply(&hello_pod(3600))?; // what the kubelet made for it stays to be seen
    c.wait_for(&["pod/hello"], "{.status.phase}", "Running", Duration::from_secs(90))
        .await?;
    let mut logs = String::new();
    for _ in 0..300 {
        logs = c.kubectl_ok(&["logs", "hello"]).unwrap_or_default();
        if logs.starts_with("hello from") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(logs.starts_with("hello from"), "{logs}");
    let (dir, netns) = (c.dir().to_path_buf(), c.netns().to_string());
    let uid = c.kubectl_ok(&["get", "pod", "hello", "-o", "jsonpath={.metadata.uid}"])?;
    let pod_cgroup = format!("pod{uid}");
    assert!(!cgroups_named(&pod_cgroup).is_empty(), "the kubelet made {pod_cgroup}");
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
    assert_eq!(cgroups_named(&pod_cgroup), Vec::<std::path::PathBuf>::new());
    Ok(())
}

/// The pod cgroup folders named `name`, in every hierarchy (the kubelet's cgroupfs layout:
/// `kubepods/[besteffort|burstable]/pod<uid>`).
fn cgroups_named(name: &str) -> Vec<std::path::PathBuf> {
    let mut roots = vec![std::path::PathBuf::from("/sys/fs/cgroup/kubepods")];
    for e in std::fs::read_dir("/sys/fs/cgroup").into_iter().flatten().flatten() {
        roots.push(e.path().join("kubepods"));
    }
    let mut out = Vec::new();
    for root in roots {
        for sub in ["", "besteffort", "burstable"] {
            let p = root.join(sub).join(name);
            if p.is_dir() {
                out.push(p);
            }
        }
    }
    out
}

use tessera_tests::cluster::tessera;

/// A pod of the `tessera` scheduler whose one container prints what it was given.
/// Waits up to 30 s for `read` to give something other than `old` (the extender's log on
/// failure, with `what`).
async fn changed(c: &Cluster, read: impl Fn() -> anyhow::Result<String>, old: &str, what: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while read()? == old {
        anyhow::ensure!(Instant::now() < deadline, "{what}\n{}", c.log_tail("extender", 20));
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Ok(())
}

fn gpu_pod(name: &str, resources: &[(&str, &str)]) -> String {
    let limits: String = resources.iter().map(|(k, v)| format!("{k}: \"{v}\", ")).collect();
    format!(
        r#"apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: default}}
spec:
  schedulerName: tessera
  restartPolicy: Never
  containers:
  - name: main
    image: docker.io/tessera/busybox:test
    imagePullPolicy: Never
    command: ["sh", "-c", "echo CVD=$CUDA_VISIBLE_DEVICES; echo CORE=$TESSERA_GPU_CORE_LIMIT; echo MIB=$TESSERA_GPU_MEMORY_LIMIT_MIB; echo DEV=$(ls /dev | grep -c '^nvidia[0-9]')"]
    resources: {{limits: {{{limits}}}}}
"#
    )
}

fn said(logs: &str) -> std::collections::BTreeMap<String, String> {
    logs.lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The real kube-scheduler asks the extender (filter, prioritize, bind) for `tessera` pods, the
/// real kubelet gets the device plugin's units, and the NRI plugin gives each container exactly
/// what the signed allocation names: a whole card, a 30% + 4 GiB share; a pod that fits nowhere
/// is left Pending with the cause in its FailedScheduling event; a pod without GPUs sees none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_scheduler_kubelet_and_runtime_give_pods_what_tessera_signed() -> anyhow::Result<()> {
    let begun = Instant::now();
    let mut c = Cluster::start().await?;
    let t = tessera::install(&mut c, "t4x2", 200, false).await?;
    println!("Tessera installed {:.1}s after start", begun.elapsed().as_secs_f64());
    c.apply(&gpu_pod("whole", &[("tessera.io/gpu-core", "100")]))?;
    c.apply(&gpu_pod(
        "share",
        &[("tessera.io/gpu-core", "30"), ("tessera.io/gpu-memory", "4")],
    ))?;
    c.apply(&hello_pod(1))?;
    for pod in ["whole", "share", "hello"] {
        c.wait_for(
            &[&format!("pod/{pod}")],
            "{.status.phase}",
            "Succeeded",
            Duration::from_secs(90),
        )
        .await
        .with_context(|| {
            format!(
                "{pod}: {}\nextender:\n{}\nscheduler:\n{}\nnri-plugin:\n{}",
                c.kubectl_ok(&["describe", "pod", pod]).unwrap_or_default(),
                c.log_tail("extender", 15),
                c.log_tail("tessera-scheduler", 15),
                c.log_tail("nri-plugin", 15)
            )
        })?;
    }
    // Whole: one card, the one signed.
    let whole = said(&c.kubectl_ok(&["logs", "whole"])?);
    let a = tessera::allocation(&c, &t.keys_dir, "whole")?;
    let card = a.containers[0].devices[0].card_uuid().to_string();
    assert_eq!(whole["CVD"], card, "{whole:?}");
    assert_eq!(whole["DEV"], "1", "{whole:?}");
    // The share: its card, its limits.
    let share = said(&c.kubectl_ok(&["logs", "share"])?);
    let a = tessera::allocation(&c, &t.keys_dir, "share")?;
    assert_eq!(share["CVD"], a.containers[0].devices[0].card_uuid(), "{share:?}");
    assert_eq!(
        (share["CORE"].as_str(), share["MIB"].as_str()),
        ("30", "4096"),
        "{share:?}"
    );
    assert_ne!(share["CVD"], card, "the share is not on the whole card");
    // The signed allocation is the extender's alone: a tenant allowed to update its pods (and
    // the cluster's admin) cannot change or drop it; other annotations stay theirs to change.
    c.kubectl_ok(&["create", "serviceaccount", "tenant"])?;
    c.kubectl_ok(&[
        "create",
        "role",
        "tenant-pods",
        "--verb=get,patch,update",
        "--resource=pods",
    ])?;
    c.kubectl_ok(&[
        "create",
        "rolebinding",
        "tenant-pods",
        "--role=tenant-pods",
        "--serviceaccount=default:tenant",
    ])?;
    let tenant = "--as=system:serviceaccount:default:tenant";
    for args in [
        &[
            tenant,
            "annotate",
            "pod",
            "share",
            "--overwrite",
            "tessera.io/allocation-signature=x",
        ][..],
        &[tenant, "annotate", "pod", "share", "tessera.io/allocation-"],
        &[
            "annotate",
            "pod",
            "share",
            "--overwrite",
            "tessera.io/allocation-signature=x",
        ],
    ] {
        let out = c.kubectl(args)?;
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success()
                && err.contains("tessera-allocation-annotations")
                && err.contains("only Tessera's extender"),
            "{args:?}: {err}"
        );
    }
    c.kubectl_ok(&[tenant, "annotate", "pod", "share", "team=vision"])?;
    // A node agent changes only its own Node: another node's published GPUs are not its to
    // rewrite (its token names its node).
    c.apply(r#"{"apiVersion": "v1", "kind": "Node", "metadata": {"name": "other-node"}}"#)?;
    let agent = format!("--kubeconfig={}", c.dir().join("tessera-node.kubeconfig").display());
    let out = c.kubectl(&[
        &agent,
        "annotate",
        "node",
        "other-node",
        "--overwrite",
        "tessera.io/inventory=forged",
    ])?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("tessera-node-own-node"),
        "another node's annotation: {err}"
    );
    c.kubectl_ok(&[
        &agent,
        "annotate",
        "node",
        NODE,
        "--overwrite",
        "tessera.io/checked=yes",
    ])?;
    c.kubectl_ok(&["delete", "node", "other-node"])?;
    assert_eq!(
        tessera::allocation(&c, &t.keys_dir, "share")?.containers[0].devices[0].card_uuid(),
        share["CVD"].as_str()
    );
    // No GPU asked (the default scheduler, no tessera.io resource), none seen, even with
    // NVIDIA's variable in its environment.
    let plain = gpu_pod("plain", &[]).replace("  schedulerName: tessera\n", "").replace(
        "    command:",
        "    env: [{name: NVIDIA_VISIBLE_DEVICES, value: all}]\n    command:",
    );
    c.apply(&plain)?;
    c.wait_for(&["pod/plain"], "{.status.phase}", "Succeeded", Duration::from_secs(60))
        .await?;
    let got = said(&c.kubectl_ok(&["logs", "plain"])?);
    assert_eq!((got["CVD"].as_str(), got["DEV"].as_str()), ("", "0"), "{got:?}");
    let logs = c.kubectl_ok(&["logs", "hello"])?;
    assert!(logs.starts_with("hello from"), "{logs}");
    // Two share containers of one pod, one card left with room: they share it (the pod's
    // other card is held by a whole-card pod).
    c.apply(&gpu_pod("holder", &[("tessera.io/gpu-core", "100")]).replace(
        "echo CVD=$CUDA_VISIBLE_DEVICES;",
        "echo CVD=$CUDA_VISIBLE_DEVICES; sleep 600;",
    ))?;
    c.wait_for(&["pod/holder"], "{.status.phase}", "Running", Duration::from_secs(60))
        .await?;
    let second = gpu_pod("duo", &[("tessera.io/gpu-core", "20"), ("tessera.io/gpu-memory", "3")]);
    let container = second
        .split_once("  - name: main")
        .expect("one container")
        .1
        .to_string();
    let duo = format!("{second}  - name: second{container}");
    c.apply(&duo)?;
    c.wait_for(&["pod/duo"], "{.status.phase}", "Succeeded", Duration::from_secs(90))
        .await
        .with_context(|| c.kubectl_ok(&["describe", "pod", "duo"]).unwrap_or_default())?;
    let a = tessera::allocation(&c, &t.keys_dir, "duo")?;
    let held = tessera::allocation(&c, &t.keys_dir, "holder")?.containers[0].devices[0]
        .card_uuid()
        .to_string();
    let cards: Vec<String> = a
        .containers
        .iter()
        .map(|c| c.devices[0].card_uuid().to_string())
        .collect();
    assert_eq!(cards.len(), 2);
    assert!(cards[0] == cards[1] && cards[0] != held, "{cards:?}, held {held}");
    for name in ["main", "second"] {
        let got = said(&c.kubectl_ok(&["logs", "duo", "-c", name])?);
        assert_eq!(
            (got["CVD"].as_str(), got["CORE"].as_str()),
            (cards[0].as_str(), "20"),
            "{name}: {got:?}"
        );
    }

    // Two share pods at once, one card with room: both on it, side by side.
    let pair = |name: &str| {
        gpu_pod(name, &[("tessera.io/gpu-core", "30"), ("tessera.io/gpu-memory", "4")]).replace(
            "echo CVD=$CUDA_VISIBLE_DEVICES;",
            "echo CVD=$CUDA_VISIBLE_DEVICES; sleep 3;",
        )
    };
    c.apply(&format!("{}---\n{}", pair("pair-a"), pair("pair-b")))?;
    let mut pair_cards = Vec::new();
    for name in ["pair-a", "pair-b"] {
        c.wait_for(
            &[&format!("pod/{name}")],
            "{.status.phase}",
            "Succeeded",
            Duration::from_secs(90),
        )
        .await?;
        let got = said(&c.kubectl_ok(&["logs", name])?);
        pair_cards.push(got["CVD"].clone());
    }
    assert!(
        pair_cards[0] == pair_cards[1] && pair_cards[0] != held,
        "{pair_cards:?}, held {held}"
    );
    let overlap = c.kubectl_ok(&[
        "get",
        "pods",
        "pair-a",
        "pair-b",
        "-o",
        "jsonpath={.items[*].status.containerStatuses[0].state.terminated.startedAt}",
    ])?;
    println!("pair started at: {overlap}");

    // Restarts of the extender, containerd and the kubelet, with `holder` running through
    // them: after each a new pod is placed and injected as before, never on the held card,
    // and the holder's container is the same one.
    let holder_state = |c: &Cluster| {
        c.kubectl_ok(&[
            "get",
            "pod",
            "holder",
            "-o",
            "jsonpath={.status.phase} {.status.containerStatuses[0].restartCount} \
             {.status.containerStatuses[0].state.running.startedAt}",
        ])
    };
    let before = holder_state(&c)?;
    for (component, pod) in [
        ("extender", "after-extender"),
        ("containerd", "after-containerd"),
        ("kubelet", "after-kubelet"),
    ] {
        let registered = |c: &Cluster| {
            c.log_tail("device-plugin", 100_000)
                .matches("registered with the kubelet")
                .count()
        };
        let registrations = registered(&c);
        c.restart(component)?;
        if component == "kubelet" {
            // A kubelet admits a pod bound to it before the device plugin has registered its
            // resources again as "no healthy devices" (UnexpectedAdmissionError): wait for both
            // resources to be registered again, as an operator would.
            for _ in 0..600 {
                if registered(&c) >= registrations + 2 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        c.apply(&gpu_pod(
            pod,
            &[("tessera.io/gpu-core", "30"), ("tessera.io/gpu-memory", "4")],
        ))?;
        c.wait_for(
            &[&format!("pod/{pod}")],
            "{.status.phase}",
            "Succeeded",
            Duration::from_secs(120),
        )
        .await
        .with_context(|| {
            format!(
                "after restarting {component}: {}\n{component}:\n{}\nnri-plugin:\n{}\ndevice-plugin:\n{}",
                c.kubectl_ok(&["describe", "pod", pod]).unwrap_or_default(),
                c.log_tail(component, 20),
                c.log_tail("nri-plugin", 10),
                c.log_tail("device-plugin", 10)
            )
        })?;
        let got = said(&c.kubectl_ok(&["logs", pod])?);
        let a = tessera::allocation(&c, &t.keys_dir, pod)?;
        let card = a.containers[0].devices[0].card_uuid();
        assert_eq!(
            (got["CVD"].as_str(), got["CORE"].as_str(), got["MIB"].as_str()),
            (card, "30", "4096"),
            "after restarting {component}: {got:?}"
        );
        assert_ne!(card, held, "after restarting {component}: placed on the held card");
        assert_eq!(holder_state(&c)?, before, "after restarting {component}");
    }
    assert!(before.starts_with("Running 0 "), "{before}");

    // `kubectl tessera` against the real API server: the held card, and the holder on it.
    let plugin = |args: &[&str]| -> anyhow::Result<String> {
        let out = c
            .command(tessera::bin("kubectl-tessera"))
            .arg("--kubeconfig")
            .arg(c.kubeconfig())
            .args(args)
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "kubectl tessera {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let inspect = plugin(&["inspect"])?;
    use tessera_core::inventory::InventorySource as _;
    let index = tessera_core::inventory::FixtureSource::new("t4x2")
        .discover()?
        .gpus
        .iter()
        .find(|g| g.uuid == held)
        .map(|g| g.index.to_string())
        .context("the held card in the fixture")?;
    let row: Vec<&str> = inspect
        .lines()
        .find(|l| l.contains("default/holder"))
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert!(
        row.first() == Some(&tessera_tests::cluster::NODE)
            && row.get(1) == Some(&index.as_str())
            && row.contains(&"100/100%"),
        "{inspect}"
    );
    let pod = plugin(&["pod", "holder"])?;
    assert!(pod.contains(held.as_str()), "{pod}");

    // ElasticGPU claims: the real API server calls the extender's admission webhook (TLS
    // with the CA the extender put in the webhook configuration) for a pod naming a claim, the
    // pod gets the claim's resources, runs on them, and the claims controller records an
    // ElasticGPU. (The webhook Service's endpoint is the extender's process: no pod here.)
    tessera::route_webhook_to_the_extender(&c)?;
    c.apply(
        r#"apiVersion: tessera.io/v1alpha1
kind: ElasticGPUClass
metadata: {name: share}
provisioner: gpushare.provisioner.elasticgpu.io
reclaimPolicy: Retain
---
apiVersion: tessera.io/v1alpha1
kind: ElasticGPUClaim
metadata: {name: tenth, namespace: default}
spec:
  egpuClassName: share
  resources: {requests: {tessera.io/gpu-core: 10, tessera.io/gpu-memory: 4}}
"#,
    )?;
    let claimed = gpu_pod("claimed", &[]).replace(
        "metadata: {name: claimed, namespace: default}",
        "metadata: {name: claimed, namespace: default, annotations: {claim.tessera.io/main: tenth}}",
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        // Until the extender has put its CA in the webhook configuration.
        match c.apply(&claimed) {
            Ok(_) => break,
            Err(e) if Instant::now() < deadline && e.to_string().contains("failed calling webhook") => {
                println!("claimed pod not admitted yet: {e:#}");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => return Err(e.context(c.log_tail("extender", 20))),
        }
    }
    c.wait_for(
        &["pod/claimed"],
        "{.status.phase}",
        "Succeeded",
        Duration::from_secs(90),
    )
    .await
    .with_context(|| c.kubectl_ok(&["describe", "pod", "claimed"]).unwrap_or_default())?;
    let got = said(&c.kubectl_ok(&["logs", "claimed"])?);
    assert_eq!((got["CORE"].as_str(), got["MIB"].as_str()), ("10", "4096"), "{got:?}");
    // Retained: the claim's GPU stays recorded (and booked) after its pod ends.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let egpus = c.kubectl_ok(&["get", "elasticgpus", "-o", "jsonpath={.items[*].spec.claimRef.name}"])?;
        if egpus.split_whitespace().any(|n| n == "tenth") {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "no ElasticGPU for claim tenth: {egpus:?}\n{}",
            c.log_tail("extender", 20)
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    // A rotation on the real API server: the webhook's Secret deleted, the extender (with its
    // Role's rights: the Secret watched by name) makes a new one, puts its CA in the
    // configuration and serves it, and a claim pod is admitted again, with no restart.
    let ca_bundle = || {
        c.kubectl_ok(&[
            "get",
            "mutatingwebhookconfiguration",
            "tessera-extender",
            "-o",
            "jsonpath={.webhooks[0].clientConfig.caBundle}",
        ])
    };
    let old_ca = ca_bundle()?;
    c.kubectl_ok(&["-n", tessera::NS, "delete", "secret", "tessera-webhook-tls"])?;
    changed(
        &c,
        ca_bundle,
        &old_ca,
        "the caBundle kept the old CA after the Secret went",
    )
    .await?;
    let again = claimed.replace("name: claimed,", "name: claimed-again,");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match c.apply_with(&again, &["--dry-run=server"]) {
            Ok(_) => break,
            Err(e) if Instant::now() < deadline && e.to_string().contains("failed calling webhook") => {
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(e) => return Err(e.context(c.log_tail("extender", 20))),
        }
    }
    let log = c.log_tail("extender", 200);
    assert!(!log.contains("forbidden"), "{log}");

    // The verbs' certificates on the real API server: the extender (its Role) may write the
    // scheduler's Secret but not read it; deleting its own Secret makes a new pair while it
    // runs, and the real kube-scheduler, restarted on the new files (it reads its CA file
    // once), drives the verbs again.
    let extender_sa = format!("--as=system:serviceaccount:{}:tessera-extender", tessera::NS);
    for (verb, want) in [("get", "no"), ("list", "no"), ("watch", "no"), ("update", "yes")] {
        let out = c.kubectl(&[
            "-n",
            tessera::NS,
            "auth",
            "can-i",
            verb,
            "secret/tessera-scheduler-tls",
            &extender_sa,
        ])?;
        let said = String::from_utf8_lossy(&out.stdout);
        assert_eq!(said.trim(), want, "may the extender {verb} the scheduler's Secret?");
    }
    // Its token may create Secrets (RBAC cannot name what does not exist yet), but only its
    // certificates: not a generic Secret, nor a service-account token under a name it reads.
    let sa_token = format!(
        "apiVersion: v1\nkind: Secret\nmetadata: {{name: tessera-webhook-tls, namespace: {}, annotations: {{kubernetes.io/service-account.name: tessera-scheduler}}}}\ntype: kubernetes.io/service-account-token\n",
        tessera::NS
    );
    let token_file = c.dir().join("sa-token-secret.yaml");
    std::fs::write(&token_file, sa_token)?;
    for args in [
        vec![
            "-n",
            tessera::NS,
            "create",
            "secret",
            "generic",
            "evil",
            "--from-literal=a=b",
            &extender_sa,
        ],
        vec!["create", "-f", token_file.to_str().unwrap_or_default(), &extender_sa],
    ] {
        let out = c.kubectl(&args)?;
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("tessera-extender-secrets"),
            "{args:?}: {err}"
        );
    }
    let scheduler_ca = || {
        c.kubectl_ok(&[
            "-n",
            tessera::NS,
            "get",
            "secret",
            "tessera-scheduler-tls",
            "-o",
            "jsonpath={.data.ca\\.crt}",
        ])
    };
    let old_ca = scheduler_ca()?;
    c.kubectl_ok(&["-n", tessera::NS, "delete", "secret", "tessera-extender-tls"])?;
    changed(
        &c,
        scheduler_ca,
        &old_ca,
        "no new pair after the extender's Secret went",
    )
    .await?;
    tessera::scheduler_files(&c, &c.dir().join("extender-client")).await?;
    c.restart("tessera-scheduler")?;
    c.apply(&gpu_pod("after-rotation", &[]))?;
    c.wait_for(
        &["pod/after-rotation"],
        "{.status.conditions[?(@.type==\"PodScheduled\")].status}",
        "True",
        Duration::from_secs(60),
    )
    .await
    .with_context(|| c.log_tail("tessera-scheduler", 20))?;

    // The CRDs' schemas, enforced by the real API server: a claim without resources, or with
    // resources of the wrong type, is refused naming the field; a good one is stored.
    let claim = |name: &str, spec: &str| {
        format!(
            "apiVersion: tessera.io/v1alpha1\nkind: ElasticGPUClaim\nmetadata: {{name: {name}, namespace: default}}\nspec: {spec}\n"
        )
    };
    for (name, spec, field) in [
        ("no-resources", "{egpuClassName: share}", "spec.resources"),
        ("bad-resources", "{resources: lots}", "spec.resources"),
    ] {
        let err = c.apply(&claim(name, spec)).unwrap_err().to_string();
        assert!(err.contains(field) && err.contains(name), "{name}: {err}");
    }
    c.apply(&claim(
        "good",
        "{resources: {limits: {tessera.io/gpu-core: 30, tessera.io/gpu-memory: 4}}}",
    ))?;
    c.kubectl_ok(&["get", "elasticgpuclaim", "good"])?;

    // More memory than any one card has (the node has it in all): the extender refuses it,
    // and its reason reaches the pod's event intact.
    c.apply(&gpu_pod(
        "huge",
        &[("tessera.io/gpu-core", "50"), ("tessera.io/gpu-memory", "20")],
    ))?;
    c.wait_for(
        &["pod/huge"],
        "{.status.conditions[?(@.type==\"PodScheduled\")].reason}",
        "Unschedulable",
        Duration::from_secs(60),
    )
    .await?;
    let events = c.kubectl_ok(&[
        "get",
        "events",
        "--field-selector",
        "involvedObject.name=huge,reason=FailedScheduling",
        "-o",
        "jsonpath={.items[*].message}",
    ])?;
    assert!(
        events.contains("needs 50 percent") && !events.contains("%!"),
        "{events}"
    );
    println!("events of huge: {events}");
    println!("whole e2e {:.1}s", begun.elapsed().as_secs_f64());
    Ok(())
}

/// A MIG slice through the real scheduler, kubelet and runtime: the container sees the MIG
/// device the signed allocation names, on a node whose other cards are in MIG mode too; and one
/// through DRA, chosen by profile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mig_slice_on_a_real_cluster() -> anyhow::Result<()> {
    let mut c = Cluster::start().await?;
    let t = tessera::install(&mut c, "a100-mig", 100, true).await?;
    c.apply(&gpu_pod("slice", &[("tessera.io/mig-1g.5gb", "1")]))?;
    c.wait_for(&["pod/slice"], "{.status.phase}", "Succeeded", Duration::from_secs(90))
        .await
        .with_context(|| c.kubectl_ok(&["describe", "pod", "slice"]).unwrap_or_default())?;
    let got = said(&c.kubectl_ok(&["logs", "slice"])?);
    let a = tessera::allocation(&c, &t.keys_dir, "slice")?;
    let tessera_core::handoff::AllocatedDevice::Mig { uuid, profile, .. } = &a.containers[0].devices[0] else {
        panic!("not a MIG device: {a:?}");
    };
    assert_eq!(profile.to_string(), "1g.5gb");
    assert_eq!(got["CVD"], *uuid, "{got:?}");
    // The node then goes to DRA (its device-plugin pod has ended): the extender offers its
    // GPUs to no pod, saying why, and the DRA plugin publishes them.
    c.kubectl_ok(&[
        "label",
        "node",
        NODE,
        &format!("{}=true", tessera_core::names::LABEL_DRA),
    ])?;
    c.apply(&gpu_pod("slice-after", &[("tessera.io/mig-1g.5gb", "1")]))?;
    c.wait_for(
        &["pod/slice-after"],
        "{.status.conditions[?(@.type==\"PodScheduled\")].reason}",
        "Unschedulable",
        Duration::from_secs(60),
    )
    .await?;
    let why = c.kubectl_ok(&[
        "get",
        "pod",
        "slice-after",
        "-o",
        "jsonpath={.status.conditions[0].message}",
    ])?;
    assert!(why.contains("the node's GPUs go to DRA claims"), "{why}");
    c.kubectl_ok(&["delete", "pod", "slice-after", "--wait=false"])?;
    // Through DRA on the same node: a MIG device chosen by profile with a CEL selector (the
    // node's one 2g.10gb, which the extender's pod above did not hold).
    c.apply(
        r#"apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: mig-2g, namespace: default}
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly:
          deviceClassName: mig.gpu.tessera.io
          selectors:
          - cel: {expression: 'device.attributes["gpu.tessera.io"].profile == "2g.10gb"'}
"#,
    )?;
    c.apply(&dra_pod("dmig", "mig-2g", true))?;
    let dra = running(&c, "dmig").await?;
    assert_eq!(dra["CVD"], "MIG-a7f72a5e-c1f5-bacf-2f86-e5c7963131e0", "{dra:?}");
    assert_eq!(dra["CORE"], "", "a MIG device has no share limits: {dra:?}");
    Ok(())
}

/// A ResourceClaim for one MIG instance of profile `profile` on card 0.
fn mig_claim(name: &str, profile: &str) -> String {
    resource_claim(
        name,
        "mig.gpu.tessera.io",
        &format!(
            r#"        selectors:
        - cel: {{expression: 'device.attributes["gpu.tessera.io"].profile == "{profile}" && device.attributes["gpu.tessera.io"].index == 0'}}
"#
        ),
    )
}

/// Dynamic MIG on the real cluster: on a node labelled for it, the plugin publishes every
/// instance the A100s could create over each card's shared counters; the real scheduler
/// allocates claims only where they fit beside each other (a 3g.20gb goes beside a 4g.20gb, a
/// 1g.5gb fits nowhere until the 4g.20gb's claim goes); the kubelet's prepare creates each
/// instance (in the fixture, the fake node's hardware), the CDI generator lists it, the
/// container gets it, and the unprepare destroys it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamic_mig_on_a_real_cluster() -> anyhow::Result<()> {
    let begun = Instant::now();
    let mut c = Cluster::start().await?;
    tessera::install(&mut c, "a100-dynamic-mig", 0, true).await?;
    for label in [tessera_core::names::LABEL_DRA, tessera_core::names::LABEL_DYNAMIC_MIG] {
        c.kubectl_ok(&["label", "node", NODE, &format!("{label}=true")])?;
    }
    let slice = format!("resourceslice/{NODE}-{}", tessera_core::dra::DRIVER);
    c.wait_for(
        &[&format!("{slice}-counters-0")],
        "{.spec.sharedCounters[*].name}",
        "gpu-0-counters gpu-1-counters",
        Duration::from_secs(60),
    )
    .await
    .with_context(|| c.log_tail("dra-plugin", 20))?;
    let devices = c.kubectl_ok(&["get", &slice, "-o", "jsonpath={.spec.devices[*].name}"])?;
    assert_eq!(devices.split_whitespace().count(), 50, "{devices}");

    let fixture = tessera::fixture_file(&c);
    let instances = || -> anyhow::Result<Vec<(String, u32)>> {
        let inv = FixtureSource::new(&fixture).discover()?;
        Ok(inv.gpus[0]
            .mig_devices
            .iter()
            .map(|m| (m.uuid.clone(), m.placement.map_or(99, |p| p.start)))
            .collect())
    };
    let allocated = |claim: &str| -> anyhow::Result<String> {
        c.kubectl_ok(&[
            "get",
            "resourceclaim",
            claim,
            "-o",
            "jsonpath={.status.allocation.devices.results[0].device}",
        ])
        .map(|s| s.trim().to_string())
    };
    c.apply(&mig_claim("big", "4g.20gb"))?;
    c.apply(&dra_pod("dbig", "big", false))?;
    let big = running(&c, "dbig").await?;
    c.apply(&mig_claim("mid", "3g.20gb"))?;
    c.apply(&dra_pod("dmid", "mid", false))?;
    let mid = running(&c, "dmid").await?;
    println!(
        "dynamic MIG pods running {:.1}s after start",
        begun.elapsed().as_secs_f64()
    );
    // The 3g.20gb could sit at memory slice 0 or 4; the 4g.20gb's counters leave it 4.
    assert_eq!(allocated("big")?, "gpu-0-mig-4g-20gb-at-0");
    assert_eq!(allocated("mid")?, "gpu-0-mig-3g-20gb-at-4");
    let made = instances()?;
    assert_eq!(made.len(), 2, "{made:?}");
    for (pod, start) in [(&big, 0), (&mid, 4)] {
        assert!(made.contains(&(pod["CVD"].clone(), start)), "{pod:?} {made:?}");
        assert_eq!(pod["DEV"], "1", "the parent card's node only: {pod:?}");
        assert_eq!(pod["CORE"], "", "a MIG instance has no share limits: {pod:?}");
    }

    // The card is full (7 of 7 compute slices): a 1g.5gb waits, whatever the memory left.
    c.apply(&mig_claim("small", "1g.5gb"))?;
    c.apply(&dra_pod("dsmall", "small", false))?;
    c.wait_for(
        &["pod/dsmall"],
        "{.status.conditions[?(@.type==\"PodScheduled\")].reason}",
        "Unschedulable",
        Duration::from_secs(60),
    )
    .await?;
    assert_eq!(allocated("small")?, "");

    // The 4g.20gb's pod and claim go: its instance is destroyed, and the 1g.5gb gets a place
    // among the slices it freed.
    c.kubectl_ok(&["delete", "pod", "dbig", "--grace-period=0", "--force"])?;
    c.kubectl_ok(&["delete", "resourceclaim", "big", "--wait=false"])?;
    let small = running(&c, "dsmall").await?;
    let at = allocated("small")?;
    let start: u32 = at.rsplit('-').next().unwrap_or_default().parse()?;
    assert!(at.starts_with("gpu-0-mig-1g-5gb-at-") && start < 4, "{at}");
    let made = instances()?;
    assert_eq!(made.len(), 2, "{made:?}");
    assert!(made.contains(&(mid["CVD"].clone(), 4)), "{made:?}");
    assert!(made.contains(&(small["CVD"].clone(), start)), "{made:?}");
    assert!(
        !made.iter().any(|(u, _)| *u == big["CVD"]),
        "the 4g.20gb's instance is destroyed: {made:?}"
    );
    println!("dynamic MIG e2e {:.1}s", begun.elapsed().as_secs_f64());
    Ok(())
}

/// A pod of the default scheduler whose one container uses claim `claim` (a ResourceClaim, or
/// with `template` a ResourceClaimTemplate), prints what it was given and stays up.
fn dra_pod(name: &str, claim: &str, template: bool) -> String {
    let source = if template {
        "resourceClaimTemplateName"
    } else {
        "resourceClaimName"
    };
    format!(
        r#"apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: default}}
spec:
  restartPolicy: Never
  resourceClaims:
  - {{name: gpu, {source}: {claim}}}
  containers:
  - name: main
    image: docker.io/tessera/busybox:test
    imagePullPolicy: Never
    command: ["sh", "-c", "echo CVD=$CUDA_VISIBLE_DEVICES; echo CORE=$TESSERA_GPU_CORE_LIMIT; echo MIB=$TESSERA_GPU_MEMORY_LIMIT_MIB; echo DEV=$(ls /dev | grep -c '^nvidia[0-9]'); sleep 600"]
    resources: {{claims: [{{name: gpu}}]}}
"#
    )
}

/// Waits for `pod` to run and returns what its container printed first.
async fn running(c: &Cluster, pod: &str) -> anyhow::Result<std::collections::BTreeMap<String, String>> {
    c.wait_for(
        &[&format!("pod/{pod}")],
        "{.status.phase}",
        "Running",
        Duration::from_secs(90),
    )
    .await
    .with_context(|| {
        format!(
            "{pod}: {}\ndra-plugin:\n{}\nnri-plugin:\n{}\nkubelet:\n{}",
            c.kubectl_ok(&["describe", "pod", pod]).unwrap_or_default(),
            c.log_tail("dra-plugin", 15),
            c.log_tail("nri-plugin", 15),
            c.log_tail("kubelet", 15)
        )
    })?;
    for _ in 0..100 {
        let logs = c.kubectl_ok(&["logs", pod]).unwrap_or_default();
        if logs.contains("DEV=") {
            return Ok(said(&logs));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    anyhow::bail!("{pod} printed nothing")
}

/// A pod in `namespace` that names claim `uid`'s request `gpu` through a marker it writes into
/// its own environment, with `token` where the kubelet would put the request's token.
fn marker_pod(namespace: &str, name: &str, uid: &str, token: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {namespace}}}
spec:
  restartPolicy: Never
  containers:
  - name: main
    image: docker.io/tessera/busybox:test
    imagePullPolicy: Never
    env: [{{name: {}, value: "{token}"}}]
    command: ["sh", "-c", "echo CVD=$CUDA_VISIBLE_DEVICES"]
"#,
        tessera_core::dra::marker_env(uid, "gpu")
    )
}

/// Waits until `pod` (in `default`) is refused at container creation; returns why.
async fn refused(c: &Cluster, pod: &str) -> anyhow::Result<String> {
    c.wait_for(
        &[&format!("pod/{pod}")],
        "{.status.containerStatuses[0].state.waiting.reason}",
        "CreateContainerError",
        Duration::from_secs(60),
    )
    .await
    .with_context(|| c.log_tail("nri-plugin", 15))?;
    c.kubectl_ok(&[
        "get",
        "pod",
        pod,
        "-o",
        "jsonpath={.status.containerStatuses[0].state.waiting.message}",
    ])
}

/// A ResourceClaim of `gpu.tessera.io` asking `cores` percent and `memory` of one card.
fn share_claim(name: &str, cores: u32, memory: &str) -> String {
    resource_claim(
        name,
        "gpu.tessera.io",
        &format!("        capacity:\n          requests: {{cores: \"{cores}\", memory: \"{memory}\"}}\n"),
    )
}

/// A ResourceClaim in `default` with one request of class `class`, `exactly` ending with
/// `more` (lines indented under it).
fn resource_claim(name: &str, class: &str, more: &str) -> String {
    format!(
        r#"apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {{name: {name}, namespace: default}}
spec:
  devices:
    requests:
    - name: gpu
      exactly:
        deviceClassName: {class}
{more}"#
    )
}

/// Tessera as a DRA driver on the real cluster: the real kubelet registers the plugin, the
/// plugin publishes the node's cards, the real scheduler allocates claims from them (a whole
/// card from a template, two shares of one card by consumable capacity), the kubelet prepares
/// them (again after a plugin restart) and unprepares them, and each container has exactly
/// its card and its share's limits, put there by the NRI plugin from the node's record. A pod
/// of another namespace naming a claim through its environment is refused at creation, and a
/// node agent cannot write another node's slice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dra_claims_get_their_cards_and_shares_on_a_real_cluster() -> anyhow::Result<()> {
    let begun = Instant::now();
    let mut c = Cluster::start().await?;
    tessera::install(&mut c, "t4x2", 200, true).await?;
    let slice = format!("resourceslice/{NODE}-{}", tessera_core::dra::DRIVER);
    // A node serves one path: until it is labelled for DRA its GPUs stay with the device
    // plugin, and the DRA plugin (polling every second here) publishes nothing.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let out = c.kubectl(&["get", &slice])?;
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("NotFound"),
        "a slice of a node not labelled for DRA: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    c.kubectl_ok(&[
        "label",
        "node",
        NODE,
        &format!("{}=true", tessera_core::names::LABEL_DRA),
    ])?;
    c.wait_for(
        &[&slice],
        "{.spec.devices[*].name}",
        "gpu-0 gpu-1",
        Duration::from_secs(60),
    )
    .await
    .with_context(|| c.log_tail("dra-plugin", 20))?;
    let cards: BTreeMap<String, String> = ["gpu-0", "gpu-1"]
        .iter()
        .map(|d| {
            let uuid = c.kubectl_ok(&[
                "get",
                &slice,
                "-o",
                &format!("jsonpath={{.spec.devices[?(@.name==\"{d}\")].attributes.uuid.string}}"),
            ])?;
            Ok((d.to_string(), uuid.trim().to_string()))
        })
        .collect::<anyhow::Result<_>>()?;

    // A whole card first, from a template; then two shares, which only the other card holds.
    c.apply(
        r#"apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: whole-gpu, namespace: default}
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly: {deviceClassName: gpu.tessera.io}
"#,
    )?;
    c.apply(&dra_pod("dwhole", "whole-gpu", true))?;
    let whole = running(&c, "dwhole").await?;
    c.apply(&share_claim("share-a", 30, "4Gi"))?;
    c.apply(&share_claim("share-b", 20, "3Gi"))?;
    c.apply(&dra_pod("dshare-a", "share-a", false))?;
    c.apply(&dra_pod("dshare-b", "share-b", false))?;
    let (a, b) = (running(&c, "dshare-a").await?, running(&c, "dshare-b").await?);
    println!("DRA pods running {:.1}s after start", begun.elapsed().as_secs_f64());

    // The whole card: one device node, the card the scheduler allocated, no limits.
    let allocated = |claim: &str| -> anyhow::Result<(String, String)> {
        let out = c.kubectl_ok(&[
            "get",
            "resourceclaim",
            claim,
            "-o",
            "jsonpath={.status.allocation.devices.results[0].device} {.status.allocation.devices.results[0].consumedCapacity.cores}",
        ])?;
        let (device, cores) = out.trim().split_once(' ').unwrap_or((out.trim(), ""));
        Ok((device.to_string(), cores.to_string()))
    };
    let whole_claim = c.kubectl_ok(&[
        "get",
        "pod",
        "dwhole",
        "-o",
        "jsonpath={.status.resourceClaimStatuses[0].resourceClaimName}",
    ])?;
    let (whole_device, _) = allocated(whole_claim.trim())?;
    assert_eq!(whole["CVD"], cards[&whole_device], "{whole:?}");
    assert_eq!((whole["DEV"].as_str(), whole["CORE"].as_str()), ("1", ""), "{whole:?}");
    // The shares: the other card, each its own consumed capacity as its limits.
    let (share_device, cores) = allocated("share-a")?;
    assert_ne!(share_device, whole_device);
    assert_eq!(cores, "30");
    assert_eq!(allocated("share-b")?.0, share_device, "two shares of one card");
    for (got, core, mib) in [(&a, "30", "4096"), (&b, "20", "3072")] {
        assert_eq!(got["CVD"], cards[&share_device], "{got:?}");
        assert_eq!(
            (got["CORE"].as_str(), got["MIB"].as_str(), got["DEV"].as_str()),
            (core, mib, "1"),
            "{got:?}"
        );
    }

    // `kubectl tessera inspect` shows the DRA claims on their cards.
    let out = c
        .command(tessera::bin("kubectl-tessera"))
        .args(["inspect", "-o", "json", "--kubeconfig"])
        .arg(c.kubeconfig())
        .output()?;
    anyhow::ensure!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let view: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let share_uuid = cards[&share_device].clone();
    let shared = view["nodes"][0]["cards"]
        .as_array()
        .and_then(|all| all.iter().find(|c| c["uuid"] == share_uuid.as_str()))
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        (
            shared["core_allocated"].as_u64(),
            shared["memory_allocated_mib"].as_u64()
        ),
        (Some(50), Some(7168)),
        "{shared}"
    );
    let holds: Vec<String> = shared["pods"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| {
            format!(
                "{} {}",
                p["pod"].as_str().unwrap_or_default(),
                p["holds"].as_str().unwrap_or_default()
            )
        })
        .collect();
    assert_eq!(
        holds,
        [
            "default/dshare-a 30% + 4096 MiB (DRA claim default/share-a)",
            "default/dshare-b 20% + 3072 MiB (DRA claim default/share-b)"
        ]
    );

    // The kubelet watches the plugin's device health stream without errors.
    let kubelet_log = c.log_tail("kubelet", 100_000);
    assert!(
        !kubelet_log.contains("Error receiving from WatchResources stream"),
        "{}",
        kubelet_log
            .lines()
            .filter(|l| l.contains("WatchResources"))
            .take(3)
            .collect::<Vec<_>>()
            .join("\n")
    );

    // A plugin restart (a rolling update): registered again, the next claim is prepared.
    let registrations = |c: &Cluster| {
        c.log_tail("dra-plugin", 100_000)
            .matches("registered with the kubelet")
            .count()
    };
    let before = registrations(&c);
    c.restart("dra-plugin")?;
    // The kubelet sees the plugin go and come back: the next claim is prepared once it has
    // registered again (a pod that comes first waits for the kubelet's retry).
    for _ in 0..300 {
        if registrations(&c) > before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    c.apply(&share_claim("share-c", 40, "2Gi"))?;
    c.apply(&dra_pod("dshare-c", "share-c", false))?;
    let third = running(&c, "dshare-c").await?;
    assert_eq!(
        (third["CVD"].as_str(), third["CORE"].as_str(), third["MIB"].as_str()),
        (cards[&share_device].as_str(), "40", "2048")
    );

    // Another namespace's pod names share-a through its environment: refused at creation.
    let uid = c.kubectl_ok(&["get", "resourceclaim", "share-a", "-o", "jsonpath={.metadata.uid}"])?;
    let uid = uid.trim();
    c.kubectl_ok(&["create", "namespace", "intruder"])?;
    c.apply(&marker_pod("intruder", "thief", uid, uid))?;
    c.wait_for(
        &["-n", "intruder", "pod/thief"],
        "{.status.containerStatuses[0].state.waiting.reason}",
        "CreateContainerError",
        Duration::from_secs(60),
    )
    .await
    .with_context(|| c.log_tail("nri-plugin", 15))?;
    let why = c.kubectl_ok(&[
        "-n",
        "intruder",
        "get",
        "pod",
        "thief",
        "-o",
        "jsonpath={.status.containerStatuses[0].state.waiting.message}",
    ])?;
    assert!(why.contains("is not a claim of namespace intruder"), "{why}");
    // A pod of the claim's own namespace that writes the marker itself has no token.
    c.apply(&marker_pod("default", "copier", uid, uid))?;
    assert!(
        refused(&c, "copier")
            .await?
            .contains("does not carry the claim's token"),
        "a forged token"
    );
    // Nor does one that copies the real marker, token and all, out of share-a's own pod (any
    // process there can read it): the claim is reserved for dshare-a, not for it.
    let env = c.kubectl_ok(&["exec", "dshare-a", "--", "env"])?;
    let var = tessera_core::dra::marker_env(uid, "gpu");
    let token = env
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{var}=")))
        .with_context(|| format!("dshare-a's environment has no {var}: {env}"))?;
    c.apply(&marker_pod("default", "bearer", uid, token))?;
    let why = refused(&c, "bearer").await?;
    assert!(why.contains("is not reserved for this pod"), "{why}");

    // A node agent writes only its own node's slice.
    let agent = format!("--kubeconfig={}", c.dir().join("tessera-node.kubeconfig").display());
    let forged = c.dir().join("forged-slice.yaml");
    std::fs::write(
        &forged,
        format!(
            r#"apiVersion: resource.k8s.io/v1
kind: ResourceSlice
metadata: {{name: other-node-{driver}}}
spec:
  driver: {driver}
  nodeName: other-node
  pool: {{name: other-node, generation: 1, resourceSliceCount: 1}}
  devices: [{{name: gpu-0}}]
"#,
            driver = tessera_core::dra::DRIVER
        ),
    )?;
    let out = c.kubectl(&[&agent, "create", "-f", forged.to_str().unwrap_or_default()])?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("tessera-node-own-slice"),
        "another node's slice: {err}"
    );

    // Another namespace's share: the scheduler's allocator knows no tenants and gives it the
    // shared card (the only one with room), the node refuses to prepare it, and the pod's
    // events say why; nothing of it is recorded.
    c.kubectl_ok(&["create", "namespace", "team-b"])?;
    let ns_b = |text: String| text.replace("namespace: default", "namespace: team-b");
    c.apply(&ns_b(share_claim("share-b2", 10, "1Gi")))?;
    c.apply(&ns_b(dra_pod("dforeign", "share-b2", false)))?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let events = c.kubectl_ok(&[
            "-n",
            "team-b",
            "get",
            "events",
            "--field-selector",
            "involvedObject.name=dforeign",
            "-o",
            "jsonpath={.items[*].message}",
        ])?;
        if events.contains("already serves shares of tenant \"default\"") {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "no refusal for another tenant's share: {events}\n{}",
            c.log_tail("dra-plugin", 15)
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let phase = c.kubectl_ok(&[
        "-n",
        "team-b",
        "get",
        "pod",
        "dforeign",
        "-o",
        "jsonpath={.status.phase}",
    ])?;
    assert_eq!(phase.trim(), "Pending");
    c.kubectl_ok(&[
        "-n",
        "team-b",
        "delete",
        "pod",
        "dforeign",
        "--grace-period=0",
        "--force",
    ])?;
    c.kubectl_ok(&["-n", "team-b", "delete", "resourceclaim", "share-b2"])?;

    // The pods go: the kubelet unprepares their claims, the node's records go with them.
    c.kubectl_ok(&[
        "delete",
        "pod",
        "dwhole",
        "dshare-a",
        "dshare-b",
        "dshare-c",
        "--grace-period=0",
        "--force",
    ])?;
    let records = tessera::dra_state_dir(&c).join("claims");
    let mut left = usize::MAX;
    for _ in 0..300 {
        left = std::fs::read_dir(&records)?.count();
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(left, 0, "records left: {}", c.log_tail("dra-plugin", 15));

    // A whole card asked as an extended resource (`tessera.io/gpu: 1`, the class's
    // extendedResourceName): the default scheduler makes the claim, the card is the pod's.
    c.apply(
        &dra_pod("dext", "unused", false)
            .replace("  resourceClaims:\n  - {name: gpu, resourceClaimName: unused}\n", "")
            .replace(
                "resources: {claims: [{name: gpu}]}",
                "resources: {limits: {tessera.io/gpu: \"1\"}}",
            ),
    )?;
    let ext = running(&c, "dext").await?;
    assert!(cards.values().any(|u| *u == ext["CVD"]), "{ext:?}");
    assert_eq!((ext["DEV"].as_str(), ext["CORE"].as_str()), ("1", ""), "{ext:?}");

    // A card going unhealthy stays in the slice, tainted NoSchedule (device taints, on by
    // default in 1.36), so the scheduler gives it to no new claim.
    let file = tessera::fixture_file(&c);
    let text = std::fs::read_to_string(&file)?;
    let marked = text.replacen(
        "    pci_bus_id: \"0000:d8:00.0\"\n",
        "    pci_bus_id: \"0000:d8:00.0\"\n    health: {state: unhealthy, reason: XID 79}\n",
        1,
    );
    anyhow::ensure!(marked != text, "the fixture's second card was not found");
    std::fs::write(&file, marked)?;
    c.wait_for(
        &[&slice],
        "{.spec.devices[?(@.name==\"gpu-1\")].taints[0].key}",
        tessera_core::dra::UNHEALTHY_TAINT,
        Duration::from_secs(30),
    )
    .await
    .with_context(|| c.log_tail("dra-plugin", 20))?;
    let effect = c.kubectl_ok(&[
        "get",
        &slice,
        "-o",
        "jsonpath={.spec.devices[?(@.name==\"gpu-1\")].taints[0].effect}",
    ])?;
    assert_eq!(effect.trim(), "NoSchedule");
    let untainted = c.kubectl_ok(&[
        "get",
        &slice,
        "-o",
        "jsonpath={.spec.devices[?(@.name==\"gpu-0\")].taints}",
    ])?;
    assert_eq!(untainted.trim(), "", "the healthy card is tainted");
    println!("DRA e2e {:.1}s", begun.elapsed().as_secs_f64());
    Ok(())
}

/// The try-it command (`scripts/try.sh`, `tessera-try`) as a new user runs it: the user guide's
/// examples on the real Kubernetes with fixture GPUs (through the extender, through DRA, a MIG
/// slice), each container given exactly what its example asks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_try_it_command_runs_every_example() -> anyhow::Result<()> {
    let begun = Instant::now();
    let seen = tessera_tests::try_it::run(&mut |line| println!("{line}")).await?;
    tessera_tests::try_it::check(&seen).map_err(anyhow::Error::msg)?;
    println!("tried in {:.0}s", begun.elapsed().as_secs_f64());
    Ok(())
}
