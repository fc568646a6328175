//! Tessera installed on the real cluster as users install it: the rendered manifests
//! applied (CRDs, namespace, RBAC, ServiceAccounts, the scheduler's configuration, the
//! webhook configuration), the hand-off key Secret created as the README says. The
//! workloads (the extender Deployment, the second scheduler, the node DaemonSet) run as
//! processes of the test in the cluster's network namespace, with the flags and
//! environment the manifests give their containers and each one's ServiceAccount token, so
//! that the manifests' RBAC is what they are allowed: no registry here, and the node agents
//! read a fixture node (t4x2) instead of NVML, with NVIDIA's real 535 driver files as the
//! driver. What differs is only where things are: the cluster's containerd sockets and
//! CDI folder instead of /var/run's, `/` as the host root, the extender on loopback (no
//! kube-proxy routes Services here).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::{Cluster, NODE};
use crate::nvidia::{Branch, Layout, Userspace};
use anyhow::Context as _;
use serde_json::Value;
use tessera_core::enforcement::ShareEnforcement;
use tessera_core::inventory::{FixtureSource, InventorySource};
use tessera_deploy::{self as manifests, ManifestOptions};
use tessera_node::inventory::create_device_nodes;

pub const NS: &str = "tessera-system";

pub use crate::workspace_bin as bin;

/// A kubeconfig for ServiceAccount `sa` (a token the API server issues).
fn sa_kubeconfig(c: &Cluster, sa: &str) -> anyhow::Result<PathBuf> {
    let mut args = vec!["-n", NS, "create", "token", sa, "--duration=2h"];
    // The node agents' token is issued on their node, as a DaemonSet pod's is: it carries
    // the node's name, which keeps them to their own Node.
    let (node_name, node_uid);
    if sa == "tessera-node" {
        node_name = format!("--bound-object-name={NODE}");
        node_uid = format!(
            "--bound-object-uid={}",
            c.kubectl_ok(&["get", "node", NODE, "-o", "jsonpath={.metadata.uid}"])?
                .trim()
        );
        args.extend(["--bound-object-kind=Node", &node_name, &node_uid]);
    }
    let token = c.kubectl_ok(&args)?;
    let path = c.dir().join(format!("{sa}.kubeconfig"));
    std::fs::write(
        &path,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: local\n  cluster: {{server: \"{}\", \
             certificate-authority: \"{}\"}}\nusers:\n- name: {sa}\n  user: {{token: \"{}\"}}\ncontexts:\n\
             - name: {sa}\n  context: {{cluster: local, user: {sa}, namespace: {NS}}}\ncurrent-context: {sa}\n",
            crate::cluster::pki::SERVER,
            c.pki().file("ca.crt").display(),
            token.trim()
        ),
    )?;
    Ok(path)
}

/// `args` with the values of the flags in `set` replaced (flags given as `--flag=value`).
fn with_flags(args: &[String], set: &[(&str, String)]) -> Vec<String> {
    args.iter()
        .map(|a| {
            set.iter()
                .find(|(f, _)| a.starts_with(&format!("{f}=")))
                .map_or_else(|| a.clone(), |(f, v)| format!("{f}={v}"))
        })
        .collect()
}

/// The container `name` of workload `kind/object` in the rendered manifests.
fn container<'a>(objects: &'a [Value], kind: &str, object: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == object)
        .and_then(|o| {
            o["spec"]["template"]["spec"]["containers"]
                .as_array()?
                .iter()
                .find(|c| c["name"] == name)
        })
        .unwrap_or_else(|| panic!("no container {name} in {kind}/{object}"))
}

fn args_of(c: &Value) -> Vec<String> {
    c["args"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|a| a.as_str().map(String::from))
        .collect()
}

/// The container's literal environment (fieldRefs are set by the caller).
fn env_of(c: &Value) -> BTreeMap<String, String> {
    c["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| Some((e["name"].as_str()?.to_string(), e["value"].as_str()?.to_string())))
        .collect()
}

/// Where the DRA plugin records prepared claims (and the NRI plugin reads them).
pub fn dra_state_dir(c: &Cluster) -> PathBuf {
    c.dir().join("dra")
}

/// What a started Tessera needs to be looked at.
pub struct Installed {
    /// The hand-off keys, as the extender and the NRI plugin read them.
    pub keys_dir: PathBuf,
}

/// Copies the scheduler's Secret (its client certificate and key, and the CA), once the
/// extender has written it, into `dir`, as the kubelet mounts it for the scheduler's pod.
pub async fn scheduler_files(c: &Cluster, dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    for file in ["ca.crt", "tls.crt", "tls.key"] {
        let key = file.replace('.', "\\.");
        let mut data = String::new();
        for _ in 0..100 {
            data = c
                .kubectl_ok(&[
                    "-n",
                    NS,
                    "get",
                    "secret",
                    "tessera-scheduler-tls",
                    "-o",
                    &format!("jsonpath={{.data.{key}}}"),
                ])
                .unwrap_or_default();
            if !data.is_empty() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
        anyhow::ensure!(
            !data.is_empty(),
            "the extender wrote no tessera-scheduler-tls: {}",
            c.log_tail("extender", 20)
        );
        use base64::Engine as _;
        std::fs::write(
            dir.join(file),
            base64::engine::general_purpose::STANDARD.decode(data.trim())?,
        )?;
    }
    Ok(())
}

/// The node's fixture file, as the node agents read it.
pub fn fixture_file(c: &Cluster) -> PathBuf {
    c.dir().join("node-fixture.yaml")
}

/// Where the node's GPUs come from.
#[derive(Debug, Clone)]
pub enum Gpus {
    /// A built-in fixture (`t4x2`, `h100x8`, ...) on fake device nodes, NVIDIA's real 535 files
    /// as the driver.
    Fixture(String),
    /// The machine's own GPUs through NVML, the driver where the node agents find it.
    Nvml,
}

/// How Tessera is installed on a cluster.
#[derive(Debug, Clone)]
pub struct Setup {
    pub gpus: Gpus,
    /// The `tessera.io/gpu-core` the node publishes once ready (0: no wait).
    pub core: u32,
    /// Installs the DRA driver too (`tessera-manifests --dra`).
    pub dra: bool,
    /// How the node holds shares (`mps` starts the MPS supervisor).
    pub enforcement: ShareEnforcement,
    /// The CUDA hook the cdi-generator installs in hook and MPS modes.
    pub hook_library: Option<PathBuf>,
    /// A stand-in for NVIDIA's MPS control program (MPS mode on a fixture node).
    pub mps_control: Option<PathBuf>,
}

/// Applies the manifests and starts Tessera's components on `c`, the node being `fixture`
/// (whose whole and shareable cards add up to `core` units of `tessera.io/gpu-core`);
/// `dra` installs the DRA driver too (`tessera-manifests --dra`). Shares are not enforced.
pub async fn install(c: &mut Cluster, fixture: &str, core: u32, dra: bool) -> anyhow::Result<Installed> {
    install_with(
        c,
        &Setup {
            gpus: Gpus::Fixture(fixture.into()),
            core,
            dra,
            enforcement: ShareEnforcement::None,
            hook_library: None,
            mps_control: None,
        },
    )
    .await
}

/// Applies the manifests as [`Setup`] renders them and starts Tessera's components on `c`.
pub async fn install_with(c: &mut Cluster, setup: &Setup) -> anyhow::Result<Installed> {
    let opts = ManifestOptions {
        share_enforcement: setup.enforcement,
        dra: setup.dra,
        ..Default::default()
    };
    let objects = manifests::objects(&opts);
    let (keys_dir, public_dir) = apply_manifests(c, &objects)?;
    start_node_agents(c, setup, &objects, &public_dir)?;
    // The extender, with its ServiceAccount's rights.
    let ext = container(&objects, "Deployment", "tessera-extender", "extender");
    let mut cmd = c.command(bin("tessera-extender"));
    cmd.args(with_flags(
        &args_of(ext),
        &[
            ("--keys-dir", keys_dir.display().to_string()),
            ("--listen", "127.0.0.1:8888".to_string()),
        ],
    ))
    .envs(env_of(ext))
    .env("POD_NAME", "tessera-extender-0")
    .env("POD_NAMESPACE", NS)
    .env("KUBECONFIG", sa_kubeconfig(c, "tessera-extender")?);
    c.spawn("extender", cmd)?;

    // The second scheduler: the manifests' configuration, the extender on loopback, its
    // client certificate from the Secret the extender writes (as the Deployment mounts it).
    let client_dir = c.dir().join("extender-client");
    scheduler_files(c, &client_dir).await?;
    let config = objects
        .iter()
        .find(|o| o["kind"] == "ConfigMap" && o["metadata"]["name"] == "tessera-scheduler")
        .and_then(|o| o["data"]["scheduler-config.yaml"].as_str())
        .context("the scheduler's ConfigMap")?
        .replace(
            &format!("https://tessera-extender.{NS}.svc:8888"),
            "https://127.0.0.1:8888",
        )
        .replace("/etc/tessera/extender-client", &client_dir.display().to_string());
    let sched_kc = sa_kubeconfig(c, "tessera-scheduler")?;
    // One filter worker: kube-scheduler then looks at nodes in its list's order, and stops at
    // the same ones each run (with several, which nodes it reaches first is a race); what it
    // decides does not change. tests/tests/scheduler_sampling.rs needs the order.
    let config = format!(
        "{}clientConnection:\n  kubeconfig: {}\nparallelism: 1\n",
        config,
        sched_kc.display()
    );
    let config_path = c.dir().join("tessera-scheduler.yaml");
    std::fs::write(&config_path, config)?;
    let mut cmd = c.command(c.kube_bin().join("kube-scheduler"));
    cmd.arg(format!("--config={}", config_path.display()))
        .args(["--secure-port=10269", "--bind-address=127.0.0.1", "-v=2"])
        .arg(format!("--authentication-kubeconfig={}", sched_kc.display()))
        .arg(format!("--authorization-kubeconfig={}", sched_kc.display()));
    c.spawn("tessera-scheduler", cmd)?;

    // Ready: the node publishes its GPUs (the device plugin's resources on the node; a
    // node whose cards have no MIG instance yet, `core` 0, has none to publish).
    if setup.core == 0 {
        return Ok(Installed { keys_dir });
    }
    c.wait_for(
        &[&format!("node/{NODE}")],
        "{.status.allocatable.tessera\\.io/gpu-core}",
        &setup.core.to_string(),
        std::time::Duration::from_secs(60),
    )
    .await
    .with_context(|| {
        format!(
            "device plugin:\n{}\ncdi-generator:\n{}",
            c.log_tail("device-plugin", 20),
            c.log_tail("cdi-generator", 20)
        )
    })?;
    Ok(Installed { keys_dir })
}

/// The manifests but the workloads (which run as the test's processes), the hand-off keys as
/// the README makes them and the node's label; returns the private and public keys' folders.
fn apply_manifests(c: &Cluster, objects: &[Value]) -> anyhow::Result<(PathBuf, PathBuf)> {
    // As the README: the namespace first, then the key Secret in it, then the manifests.
    c.kubectl_ok(&["create", "namespace", NS])?;
    let applied: Vec<String> = objects
        .iter()
        .filter(|o| !matches!(o["kind"].as_str(), Some("Deployment" | "DaemonSet")))
        .map(|o| serde_json::to_string(o).unwrap())
        .collect();
    let out = c.apply(&applied.join("\n---\n"))?;
    anyhow::ensure!(!out.contains("Warning"), "the manifests draw warnings: {out}");
    // The hand-off keys, as the README makes them: an Ed25519 key with OpenSSL, the
    // private one for the extender, the public one for the nodes.
    let (keys_dir, public_dir) = (c.dir().join("keys"), c.dir().join("public-keys"));
    for d in [&keys_dir, &public_dir] {
        std::fs::create_dir_all(d)?;
    }
    let (private, public) = (keys_dir.join("k1"), public_dir.join("k1"));
    for args in [
        vec![
            "genpkey",
            "-algorithm",
            "ed25519",
            "-out",
            private.to_str().unwrap_or_default(),
        ],
        vec![
            "pkey",
            "-in",
            private.to_str().unwrap_or_default(),
            "-pubout",
            "-out",
            public.to_str().unwrap_or_default(),
        ],
    ] {
        let out = std::process::Command::new("openssl").args(&args).output()?;
        anyhow::ensure!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    std::fs::write(keys_dir.join("active"), "k1")?;
    c.kubectl_ok(&[
        "-n",
        NS,
        "create",
        "secret",
        "generic",
        manifests::KEYS_SECRET,
        "--from-literal=active=k1",
        &format!("--from-file=k1={}", private.display()),
    ])?;
    c.kubectl_ok(&[
        "-n",
        NS,
        "create",
        "secret",
        "generic",
        manifests::PUBLIC_KEYS_SECRET,
        &format!("--from-file=k1={}", public.display()),
    ])?;
    c.kubectl_ok(&["label", "node", NODE, "tessera.io/gpu-node=true"])?;
    Ok((keys_dir, public_dir))
}

/// Where a fixture node's GPUs are: its fixture file (which a test may change: a card going
/// unhealthy), NVIDIA's real 535 files as the driver, fake device nodes of the fixture; the
/// flags that name them (`--fixture`, `--driver-root`, `--dev-root`).
fn fixture_node(c: &Cluster, fixture: &str) -> anyhow::Result<[String; 3]> {
    let inv = FixtureSource::new(fixture).discover()?;
    let dev_root = c.dir().join("devroot");
    create_device_nodes(&inv, &dev_root)?;
    let driver_root = Userspace::get()?.root(Branch::R535, Layout::Distro).to_path_buf();
    let fixture_file = fixture_file(c);
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../core/fixtures/{fixture}.yaml")),
        &fixture_file,
    )?;
    Ok([
        format!("--fixture={}", fixture_file.display()),
        format!("--driver-root={}", driver_root.display()),
        format!("--dev-root={}", dev_root.display()),
    ])
}

/// The node DaemonSet's containers as the test's processes, each with the flags and the
/// environment the manifests give it, but for where things are on this cluster.
fn start_node_agents(c: &mut Cluster, setup: &Setup, objects: &[Value], public_dir: &Path) -> anyhow::Result<()> {
    let (mps_root, hook_root) = (c.dir().join("mps"), c.dir().join("hook"));
    let dra_state = dra_state_dir(c);
    let node_env = |cont: &Value| -> BTreeMap<String, String> {
        let mut e = env_of(cont);
        e.insert("NODE_NAME".into(), NODE.into());
        e.insert("TESSERA_MPS_ROOT".into(), mps_root.display().to_string());
        e.insert("TESSERA_HOOK_ROOT".into(), hook_root.display().to_string());
        e.insert("TESSERA_DRA_STATE_DIR".into(), dra_state.display().to_string());
        e
    };
    let node_kubeconfig = sa_kubeconfig(c, "tessera-node")?;
    let node_sets: Vec<(&str, String)> = vec![
        ("--host-root", "/".to_string()),
        ("--cdi-dir", c.cdi_dir().display().to_string()),
        ("--keys-dir", public_dir.display().to_string()),
        ("--socket", c.nri_socket().display().to_string()),
        ("--proc-root", "/proc".to_string()),
        ("--metrics-listen", "127.0.0.1:9403".to_string()),
        ("--state-dir", dra_state.display().to_string()),
        ("--cgroup-root", "/sys/fs/cgroup".to_string()),
    ];
    // A fixture node names its fixture, driver and device nodes; NVML needs no flag.
    let fixture: Vec<String> = match &setup.gpus {
        Gpus::Fixture(f) => fixture_node(c, f)?.to_vec(),
        Gpus::Nvml => Vec::new(),
    };
    let hook: Vec<String> = setup
        .hook_library
        .iter()
        .map(|l| format!("--hook-library={}", l.display()))
        .collect();
    let mps_control: Vec<String> = match &setup.mps_control {
        // The stand-in daemon's clients are Python processes: health checks 10 s apart, not
        // every 5 s (tests/gpu/e2e.rs says what that costs two cores), yet well within the 30 s
        // after which the NRI plugin takes a card's state for a dead supervisor's.
        Some(fake) => vec![format!("--control-binary={}", fake.display()), "--check-secs=10".into()],
        None => Vec::new(),
    };
    for name in [
        "mps-supervisor",
        "cdi-generator",
        "device-plugin",
        "nri-plugin",
        "dra-plugin",
    ] {
        if (name == "dra-plugin" && !setup.dra)
            || (name == "mps-supervisor" && setup.enforcement != ShareEnforcement::Mps)
        {
            continue;
        }
        let cont = container(objects, "DaemonSet", "tessera-node", name);
        let program = cont["command"][0].as_str().context("a command")?.to_string();
        let mut args = with_flags(&args_of(cont), &node_sets);
        let named = fixture.iter().take(2).cloned();
        match name {
            "mps-supervisor" => args.extend(named.chain(mps_control.iter().cloned())),
            "cdi-generator" => args.extend(
                fixture
                    .iter()
                    .cloned()
                    .chain([format!("--driver-bundle-dir={}", c.dir().join("bundles").display())])
                    .chain(hook.iter().cloned()),
            ),
            "device-plugin" => args.extend(named),
            "dra-plugin" => args.extend(named.chain([
                format!("--registry-dir={}", c.kubelet_root().join("plugins_registry").display()),
                format!(
                    "--plugin-dir={}",
                    c.kubelet_root()
                        .join("plugins")
                        .join(tessera_core::dra::DRIVER)
                        .display()
                ),
                "--poll-secs=1".to_string(),
            ])),
            _ => {}
        }
        let mut cmd = c.command(bin(&program));
        cmd.args(&args)
            .envs(node_env(cont))
            .env("KUBECONFIG", &node_kubeconfig)
            .env("RUST_LOG", "info");
        c.spawn(name, cmd)?;
    }
    Ok(())
}

/// Points the webhook Service at the extender's process (its selector would find no pod):
/// the API server, routing to endpoints, then reaches the extender's webhook listener.
pub fn route_webhook_to_the_extender(c: &Cluster) -> anyhow::Result<()> {
    let svc = manifests::claims::WEBHOOK_SERVICE;
    c.kubectl_ok(&[
        "-n",
        NS,
        "patch",
        "service",
        svc,
        "--type=json",
        "-p",
        r#"[{"op":"remove","path":"/spec/selector"}]"#,
    ])?;
    c.apply(&format!(
        r#"apiVersion: v1
kind: Endpoints
metadata: {{name: {svc}, namespace: {NS}}}
subsets:
- addresses: [{{ip: "{}"}}]
  ports: [{{name: webhook, port: {}}}]
"#,
        crate::cluster::NODE_IP,
        manifests::claims::WEBHOOK_PORT
    ))?;
    Ok(())
}

/// Checks the signed allocation `pod` carries with the hand-off keys.
pub fn allocation(c: &Cluster, keys: &Path, pod: &str) -> anyhow::Result<tessera_core::handoff::Allocation> {
    let json = c.kubectl_ok(&["get", "pod", pod, "-o", "json"])?;
    let v: Value = serde_json::from_str(&json)?;
    let a = &v["metadata"]["annotations"];
    let signed = tessera_core::handoff::SignedAllocation {
        allocation: a[tessera_core::names::ANNOTATION_ALLOCATION]
            .as_str()
            .context("no allocation")?
            .to_string(),
        signature: a[tessera_core::names::ANNOTATION_ALLOCATION_SIGNATURE]
            .as_str()
            .context("no signature")?
            .to_string(),
    };
    let keys = tessera_core::handoff::SigningKeys::from_dir(keys)?;
    let uid = v["metadata"]["uid"].as_str().context("no uid")?;
    Ok(keys.verify(Some(&signed.allocation), Some(&signed.signature), NODE, uid)?)
}
