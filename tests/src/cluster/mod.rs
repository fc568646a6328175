//! A real single-node Kubernetes for end-to-end tests: etcd, kube-apiserver,
//! kube-controller-manager, kube-scheduler, containerd 2.x (CRI, NRI and CDI on, runc, bridge
//! CNI) and a kubelet, all in a network namespace of the cluster's own (its only addresses are
//! loopback and a veth pair with both ends inside, node IP 10.254.0.1), state in a temporary
//! folder. Binaries from `tests/cluster/fetch.sh` (Kubernetes, etcd, CNI) and
//! `tests/runtimes/fetch.sh` (containerd, runc, the busybox image).
//!
//! Dropping the [`Cluster`] stops everything it started, by PID (containers through containerd,
//! shims that outlive it, then the control plane), unmounts what is mounted under its folder,
//! deletes its network namespace (and with it the CNI bridge and veths), the kubelet's pod
//! cgroups and libcni's cached results of its network: a test that fails leaves nothing behind.
//! One cluster runs at a time on a machine (the kubelet's device-plugin socket has a fixed
//! path): [`Cluster::start`] waits for another to end.

pub mod pki;
pub mod tessera;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

use crate::containerd::Runtimes;
use crate::fetched;

/// The node's name.
pub const NODE: &str = "tessera-node";
/// The node's address (inside the cluster's network namespace).
pub const NODE_IP: &str = "10.254.0.1";
/// The CNI network's name (libcni caches results under it).
const NETWORK: &str = "tk8s";
/// Where the kubelet always serves device plugins, whatever its root directory.
pub const DEVICE_PLUGIN_DIR: &str = "/var/lib/kubelet/device-plugins";

/// Kubernetes, etcd and the CNI plugins (fetched once per process).
struct Binaries {
    kube: PathBuf,
    etcd: PathBuf,
    cni: PathBuf,
    version: String,
}

fn binaries() -> anyhow::Result<&'static Binaries> {
    static B: std::sync::OnceLock<Result<Binaries, String>> = std::sync::OnceLock::new();
    B.get_or_init(|| {
        let items = fetched::fetch(
            "cluster/fetch.sh",
            "TESSERA_CLUSTER_CACHE",
            "ready-v1",
            &["kube", "etcd", "cni"],
        )
        .map_err(|e| format!("{e:#}"))?;
        Ok(Binaries {
            kube: items["kube"].1.clone(),
            etcd: items["etcd"].1.clone(),
            cni: items["cni"].1.clone(),
            version: items["kube"].0.clone(),
        })
    })
    .as_ref()
    .map_err(|e| anyhow::anyhow!("{e}"))
}

/// A process the cluster started, and how (to start it again).
struct Proc {
    name: String,
    child: Child,
    program: std::ffi::OsString,
    args: Vec<std::ffi::OsString>,
    envs: Vec<(std::ffi::OsString, Option<std::ffi::OsString>)>,
}

/// A running single-node cluster; stopped and cleaned up on drop.
pub struct Cluster {
    tmp: tempfile::TempDir,
    netns: String,
    procs: Vec<Proc>,
    kube_bin: PathBuf,
    ctr: PathBuf,
    version: String,
    /// Held while the cluster lives (one per machine); released when dropped, last.
    _lock: nix::fcntl::Flock<File>,
    started_in: Duration,
    /// Whether the kubelet's device-plugin folder was made for this cluster.
    made_device_plugin_dir: bool,
}

impl Cluster {
    /// Brings the cluster up to a Ready node (about 15 s).
    pub async fn start() -> anyhow::Result<Self> {
        let b = binaries()?;
        let runtimes = Runtimes::get()?;
        let lock = File::create("/tmp/tessera-test-cluster.lock")?;
        let lock =
            tokio::task::spawn_blocking(move || nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive))
                .await?
                .map_err(|(_, e)| anyhow::anyhow!("locking the cluster: {e}"))?;
        let begun = Instant::now();
        let tmp = tempfile::Builder::new().prefix("tk8s-").tempdir()?;
        let netns = format!(
            "tessera-{}-{}",
            std::process::id(),
            tmp.path().file_name().unwrap().to_string_lossy()
        );
        let mut c = Self {
            ctr: runtimes.bin_dir(crate::containerd::Version::V2).join("ctr"),
            tmp,
            netns,
            procs: Vec::new(),
            kube_bin: b.kube.clone(),
            version: b.version.clone(),
            _lock: lock,
            started_in: Duration::ZERO,
            made_device_plugin_dir: false,
        };
        c.make_netns()?;
        c.up(b, runtimes).await?;
        c.started_in = begun.elapsed();
        Ok(c)
    }

    /// How long [`Cluster::start`] took.
    pub fn started_in(&self) -> Duration {
        self.started_in
    }

    /// The Kubernetes version.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The Kubernetes binaries' folder.
    pub fn kube_bin(&self) -> &Path {
        &self.kube_bin
    }

    /// The cluster's folder.
    pub fn dir(&self) -> &Path {
        self.tmp.path()
    }

    /// The admin kubeconfig.
    pub fn kubeconfig(&self) -> PathBuf {
        self.dir().join("admin.kubeconfig")
    }

    /// The PKI (to make more kubeconfigs, or trust the API server).
    pub fn pki(&self) -> pki::Pki {
        pki::Pki {
            dir: self.dir().join("pki"),
        }
    }

    /// containerd's socket.
    pub fn containerd_socket(&self) -> PathBuf {
        self.dir().join("containerd/containerd.sock")
    }

    /// containerd's NRI socket.
    pub fn nri_socket(&self) -> PathBuf {
        self.dir().join("containerd/nri.sock")
    }

    /// A CDI spec directory containerd reads.
    pub fn cdi_dir(&self) -> PathBuf {
        self.dir().join("containerd/cdi")
    }

    /// The kubelet's root directory.
    pub fn kubelet_root(&self) -> PathBuf {
        self.dir().join("kubelet")
    }

    /// A command run inside the cluster's network namespace.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("nsenter");
        c.arg(format!("--net=/run/netns/{}", self.netns)).arg("--").arg(program);
        c
    }

    /// `kubectl` as the admin, inside the namespace.
    pub fn kubectl(&self, args: &[&str]) -> anyhow::Result<Output> {
        Ok(self
            .command(self.kube_bin.join("kubectl"))
            .env("KUBECONFIG", self.kubeconfig())
            .args(args)
            .output()?)
    }

    /// `kubectl`, its stdout when it succeeds, else an error with its stderr.
    pub fn kubectl_ok(&self, args: &[&str]) -> anyhow::Result<String> {
        let out = self.kubectl(args)?;
        if !out.status.success() {
            bail!("kubectl {args:?}: {}", String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `kubectl apply -f -` of `yaml`.
    pub fn apply(&self, yaml: &str) -> anyhow::Result<String> {
        self.apply_with(yaml, &[])
    }

    /// `kubectl apply -f -` with `extra` arguments (`--dry-run=server`: through admission,
    /// stored nowhere).
    pub fn apply_with(&self, yaml: &str, extra: &[&str]) -> anyhow::Result<String> {
        use std::io::Write as _;
        let mut child = self
            .command(self.kube_bin.join("kubectl"))
            .env("KUBECONFIG", self.kubeconfig())
            .args(["apply", "-f", "-"])
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        child.stdin.take().expect("piped").write_all(yaml.as_bytes())?;
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!("kubectl apply: {}", String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }

    /// Waits up to `within` for `jsonpath` of `object` (`pod/x -n ns` style args) to read `want`.
    pub async fn wait_for(&self, args: &[&str], jsonpath: &str, want: &str, within: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + within;
        let mut last: String;
        loop {
            let mut a: Vec<&str> = vec!["get"];
            a.extend_from_slice(args);
            let jp = format!("jsonpath={jsonpath}");
            a.extend_from_slice(&["-o", &jp]);
            match self.kubectl(&a) {
                Ok(o) if o.status.success() => {
                    last = String::from_utf8_lossy(&o.stdout).into_owned();
                    if last == want {
                        return Ok(());
                    }
                }
                Ok(o) => last = String::from_utf8_lossy(&o.stderr).into_owned(),
                Err(e) => last = e.to_string(),
            }
            if Instant::now() > deadline {
                bail!(
                    "{args:?} {jsonpath} is {last:?}, not {want:?}, after {within:?} (node: {})",
                    self.node_state()
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// The node's taints and conditions, for a wait's error: a pod left Pending by the
    /// scheduler says only "untolerated taint(s)".
    fn node_state(&self) -> String {
        let jp = "jsonpath=taints {.spec.taints[*].key}; conditions{range .status.conditions[*]} \
                  {.type}={.status}{end}";
        match self.kubectl(&["get", &format!("node/{NODE}"), "-o", jp]) {
            Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).into_owned(),
            Ok(o) => String::from_utf8_lossy(&o.stderr).trim().to_owned(),
            Err(e) => e.to_string(),
        }
    }

    /// Starts `cmd` inside the namespace as a process the cluster stops on drop (before its own
    /// components), its output in `logs/<name>.log`.
    pub fn spawn(&mut self, name: &str, mut cmd: Command) -> anyhow::Result<()> {
        let log = File::options().create(true).append(true).open(self.log_path(name))?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        self.procs.push(Proc {
            name: name.into(),
            child,
            program: cmd.get_program().to_owned(),
            args: cmd.get_args().map(ToOwned::to_owned).collect(),
            envs: cmd
                .get_envs()
                .map(|(k, v)| (k.to_owned(), v.map(ToOwned::to_owned)))
                .collect(),
        });
        Ok(())
    }

    /// Stops process `name` (SIGTERM) and starts it again as it was started: a component's
    /// restart (containers keep running through a containerd restart, their shims do not
    /// depend on it).
    pub fn restart(&mut self, name: &str) -> anyhow::Result<()> {
        let i = self
            .procs
            .iter()
            .position(|p| p.name == name)
            .with_context(|| format!("no process {name}"))?;
        let mut p = self.procs.remove(i);
        end(&mut p);
        let mut cmd = Command::new(&p.program);
        cmd.args(&p.args);
        for (k, v) in &p.envs {
            match v {
                Some(v) => cmd.env(k, v),
                None => cmd.env_remove(k),
            };
        }
        self.spawn(name, cmd)?;
        // Keep the start order (teardown goes by name for the cluster's own parts).
        let last = self.procs.pop().expect("just spawned");
        self.procs.insert(i, last);
        Ok(())
    }

    /// Stops the process started as `name` (SIGTERM, then SIGKILL after 10 s).
    pub fn stop(&mut self, name: &str) {
        if let Some(i) = self.procs.iter().position(|p| p.name == name) {
            let mut p = self.procs.remove(i);
            end(&mut p);
        }
    }

    /// The end of process `name`'s log.
    pub fn log_tail(&self, name: &str, lines: usize) -> String {
        let text = std::fs::read_to_string(self.log_path(name)).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    fn log_path(&self, name: &str) -> PathBuf {
        self.dir().join("logs").join(format!("{name}.log"))
    }

    /// Imports an OCI image tarball into containerd's Kubernetes namespace.
    pub fn import_image(&self, tar: &Path) -> anyhow::Result<()> {
        let out = Command::new(&self.ctr)
            .arg("-a")
            .arg(self.containerd_socket())
            .args(["-n", "k8s.io", "images", "import"])
            .arg(tar)
            .output()?;
        if !out.status.success() {
            bail!("importing {}: {}", tar.display(), String::from_utf8_lossy(&out.stderr));
        }
        Ok(())
    }

    fn make_netns(&self) -> anyhow::Result<()> {
        let ip = |args: &[&str]| -> anyhow::Result<()> {
            let out = Command::new("ip").args(args).output()?;
            if !out.status.success() {
                bail!("ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
            }
            Ok(())
        };
        let n = self.netns.as_str();
        ip(&["netns", "add", n])?;
        ip(&["-n", n, "link", "set", "lo", "up"])?;
        ip(&[
            "-n",
            n,
            "link",
            "add",
            "tk8s-node",
            "type",
            "veth",
            "peer",
            "name",
            "tk8s-peer",
        ])?;
        ip(&["-n", n, "link", "set", "tk8s-peer", "up"])?;
        ip(&["-n", n, "addr", "add", &format!("{NODE_IP}/24"), "dev", "tk8s-node"])?;
        ip(&["-n", n, "link", "set", "tk8s-node", "up"])?;
        ip(&["-n", n, "route", "add", "default", "dev", "tk8s-node"])
    }

    async fn ready(&self, what: &str, within: Duration, mut check: impl FnMut() -> bool) -> anyhow::Result<()> {
        let deadline = Instant::now() + within;
        while !check() {
            if Instant::now() > deadline {
                bail!("{what} not ready after {within:?}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(())
    }

    fn http_ok(&self, url: &str) -> bool {
        self.command("curl")
            .args(["-sfk", "-o", "/dev/null", url])
            .status()
            .is_ok_and(|s| s.success())
    }

    async fn up(&mut self, b: &Binaries, runtimes: &Runtimes) -> anyhow::Result<()> {
        let d = self.dir().to_path_buf();
        for sub in [
            "logs",
            "etcd",
            "containerd/cdi",
            "containerd/nri-plugins",
            "containerd/nri-conf",
            "cni/net.d",
            "kubelet",
            "etc",
        ] {
            std::fs::create_dir_all(d.join(sub))?;
        }
        let pki = pki::Pki::make(&d.join("pki"), NODE, NODE_IP)?;
        for (name, cert) in [
            ("admin", "admin"),
            ("controller-manager", "controller-manager"),
            ("scheduler", "scheduler"),
            ("kubelet", "kubelet-client"),
        ] {
            pki.kubeconfig(cert, &d.join(format!("{name}.kubeconfig")))?;
        }
        let p = |f: &str| pki.file(f).display().to_string();
        let kube = |name: &str| b.kube.join(name);

        let mut etcd = self.command(&b.etcd);
        etcd.args(["--name", "default", "--data-dir"])
            .arg(d.join("etcd"))
            .args([
                "--listen-client-urls=http://127.0.0.1:2379",
                "--advertise-client-urls=http://127.0.0.1:2379",
                "--listen-peer-urls=http://127.0.0.1:2380",
                "--initial-advertise-peer-urls=http://127.0.0.1:2380",
                "--initial-cluster=default=http://127.0.0.1:2380",
                "--listen-metrics-urls=http://127.0.0.1:2381",
                "--quota-backend-bytes=2147483648",
                "--log-level=warn",
            ]);
        self.spawn("etcd", etcd)?;
        self.ready("etcd", Duration::from_secs(60), || {
            self.http_ok("http://127.0.0.1:2381/health")
        })
        .await?;

        let mut api = self.command(kube("kube-apiserver"));
        api.args([
            "--etcd-servers=http://127.0.0.1:2379",
            "--bind-address=127.0.0.1",
            "--secure-port=6443",
            &format!("--advertise-address={NODE_IP}"),
            &format!("--tls-cert-file={}", p("apiserver.crt")),
            &format!("--tls-private-key-file={}", p("apiserver.key")),
            &format!("--client-ca-file={}", p("ca.crt")),
            &format!("--service-account-key-file={}", p("sa.pub")),
            &format!("--service-account-signing-key-file={}", p("sa.key")),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            "--service-cluster-ip-range=127.96.0.0/24",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            "--allow-privileged=true",
            &format!("--kubelet-client-certificate={}", p("apiserver-kubelet-client.crt")),
            &format!("--kubelet-client-key={}", p("apiserver-kubelet-client.key")),
            &format!("--kubelet-certificate-authority={}", p("ca.crt")),
            "--kubelet-preferred-address-types=InternalIP,Hostname",
            &format!("--requestheader-client-ca-file={}", p("front-proxy-ca.crt")),
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            &format!("--proxy-client-cert-file={}", p("front-proxy-client.crt")),
            &format!("--proxy-client-key-file={}", p("front-proxy-client.key")),
            "--profiling=false",
            // Services are reached at their endpoints (there is no kube-proxy): webhooks too.
            "--enable-aggregator-routing=true",
            "-v=1",
        ]);
        self.spawn("kube-apiserver", api)?;
        self.ready("kube-apiserver", Duration::from_secs(180), || {
            self.kubectl(&["get", "--raw", "/readyz"])
                .is_ok_and(|o| o.status.success())
        })
        .await?;

        let common = [
            "--bind-address=127.0.0.1",
            "--leader-elect=false",
            "--profiling=false",
            "-v=1",
        ];
        let cm_kc = d.join("controller-manager.kubeconfig").display().to_string();
        let mut cm = self.command(kube("kube-controller-manager"));
        cm.args(common).args([
            &format!("--kubeconfig={cm_kc}"),
            &format!("--authentication-kubeconfig={cm_kc}"),
            &format!("--authorization-kubeconfig={cm_kc}"),
            &format!("--service-account-private-key-file={}", p("sa.key")),
            &format!("--root-ca-file={}", p("ca.crt")),
            &format!("--cluster-signing-cert-file={}", p("ca.crt")),
            &format!("--cluster-signing-key-file={}", p("ca.key")),
            "--use-service-account-credentials=true",
        ]);
        self.spawn("kube-controller-manager", cm)?;
        let sch_kc = d.join("scheduler.kubeconfig").display().to_string();
        let mut sch = self.command(kube("kube-scheduler"));
        sch.args(common).args([
            &format!("--kubeconfig={sch_kc}"),
            &format!("--authentication-kubeconfig={sch_kc}"),
            &format!("--authorization-kubeconfig={sch_kc}"),
        ]);
        self.spawn("kube-scheduler", sch)?;
        self.ready("kube-controller-manager", Duration::from_secs(60), || {
            self.http_ok("https://127.0.0.1:10257/healthz")
        })
        .await?;
        self.ready("kube-scheduler", Duration::from_secs(60), || {
            self.http_ok("https://127.0.0.1:10259/healthz")
        })
        .await?;
        self.ready("the default service account", Duration::from_secs(60), || {
            self.kubectl(&["-n", "default", "get", "serviceaccount", "default"])
                .is_ok_and(|o| o.status.success())
        })
        .await?;

        // containerd 2.x: private root, state and sockets; CRI, NRI and CDI on; bridge CNI.
        let c = d.join("containerd");
        std::fs::write(
            d.join("cni/net.d/10-tk8s.conflist"),
            format!(
                r#"{{"cniVersion":"1.0.0","name":"{NETWORK}","plugins":[
 {{"type":"bridge","bridge":"tk8s0","isGateway":true,"isDefaultGateway":false,"ipMasq":false,"hairpinMode":true,
  "ipam":{{"type":"host-local","ranges":[[{{"subnet":"10.244.0.0/24"}}]],"dataDir":"{}"}}}}]}}"#,
                d.join("cni/networks").display()
            ),
        )?;
        let (image, image_tar) = runtimes.image();
        let runc = runtimes.runc();
        std::fs::write(
            d.join("etc/containerd.toml"),
            format!(
                r#"version = 3
root = "{c}/root"
state = "{c}/state"
[grpc]
  address = "{c}/containerd.sock"
[ttrpc]
  address = "{c}/containerd.sock.ttrpc"
[plugins."io.containerd.nri.v1.nri"]
  disable = false
  socket_path = "{c}/nri.sock"
  plugin_path = "{c}/nri-plugins"
  plugin_config_path = "{c}/nri-conf"
[plugins."io.containerd.cri.v1.runtime"]
  enable_cdi = true
  cdi_spec_dirs = ["{c}/cdi"]
  netns_mounts_under_state_dir = true
  restrict_oom_score_adj = true
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "{runc}"
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["{cni}"]
    conf_dir = "{d}/cni/net.d"
[plugins."io.containerd.cri.v1.images".pinned_images]
  sandbox = "{image}"
[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"
[plugins."io.containerd.internal.v1.opt"]
  path = "{c}/opt"
"#,
                c = c.display(),
                d = d.display(),
                runc = runc.display(),
                cni = b.cni.display(),
            ),
        )?;
        let ctrd_bin = runtimes.bin_dir(crate::containerd::Version::V2);
        let mut ctrd = self.command(ctrd_bin.join("containerd"));
        ctrd.env("PATH", format!("{}:/usr/sbin:/usr/bin:/sbin:/bin", ctrd_bin.display()))
            .arg("--config")
            .arg(d.join("etc/containerd.toml"));
        self.spawn("containerd", ctrd)?;
        let socket = self.containerd_socket();
        self.ready("containerd", Duration::from_secs(60), || {
            Command::new(&self.ctr)
                .arg("-a")
                .arg(&socket)
                .arg("version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .await?;
        self.import_image(image_tar)?;
        let out = Command::new(&self.ctr)
            .arg("-a")
            .arg(&socket)
            .args([
                "-n",
                "k8s.io",
                "images",
                "label",
                image,
                "io.cri-containerd.pinned=pinned",
            ])
            .output()?;
        if !out.status.success() {
            bail!("pinning {image}: {}", String::from_utf8_lossy(&out.stderr));
        }

        // The kubelet: cgroupfs, cgroup v1 allowed, swap allowed, no disk eviction signals ("0%"
        // turns one off): the host's disk is the test machine's, often nearly full with build
        // output, and its pressure would taint the node NoSchedule (a CI run saw every later pod
        // Pending on "untolerated taint(s)").
        self.made_device_plugin_dir = !Path::new(DEVICE_PLUGIN_DIR).exists();
        std::fs::create_dir_all(DEVICE_PLUGIN_DIR)?;
        std::fs::write(
            d.join("etc/kubelet.yaml"),
            format!(
                r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: "{NODE_IP}"
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: true}}
  x509: {{clientCAFile: "{ca}"}}
authorization: {{mode: Webhook}}
tlsCertFile: "{crt}"
tlsPrivateKeyFile: "{key}"
cgroupDriver: cgroupfs
failCgroupV1: false
failSwapOn: false
containerRuntimeEndpoint: "unix://{socket}"
clusterDomain: cluster.local
resolvConf: /etc/resolv.conf
imageGCHighThresholdPercent: 99
imageGCLowThresholdPercent: 98
evictionHard: {{memory.available: "100Mi", nodefs.available: "0%", imagefs.available: "0%", nodefs.inodesFree: "0%"}}
"#,
                ca = p("ca.crt"),
                crt = p("kubelet-serving.crt"),
                key = p("kubelet-serving.key"),
                socket = socket.display(),
            ),
        )?;
        let mut kubelet = self.command(kube("kubelet"));
        kubelet
            .arg(format!("--config={}", d.join("etc/kubelet.yaml").display()))
            .arg(format!("--kubeconfig={}", d.join("kubelet.kubeconfig").display()))
            .arg(format!("--root-dir={}", self.kubelet_root().display()))
            .args([
                &format!("--hostname-override={NODE}"),
                &format!("--node-ip={NODE_IP}"),
                "-v=1",
            ]);
        self.spawn("kubelet", kubelet)?;
        let node_ready = format!("node/{NODE}");
        self.wait_for(
            &[&node_ready],
            "{.status.conditions[?(@.type==\"Ready\")].status}",
            "True",
            Duration::from_secs(180),
        )
        .await
        .with_context(|| format!("kubelet log:\n{}", self.log_tail("kubelet", 30)))?;
        Ok(())
    }

    /// Kills every container through containerd (before containerd stops).
    fn kill_containers(&self) {
        let socket = self.containerd_socket();
        let ctr = |args: &[&str]| {
            Command::new(&self.ctr)
                .arg("-a")
                .arg(&socket)
                .args(["-n", "k8s.io"])
                .args(args)
                .output()
                .ok()
                .filter(|o| o.status.success())
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default()
        };
        for id in ctr(&["tasks", "ls", "-q"]).lines() {
            ctr(&["tasks", "kill", "-s", "SIGKILL", id]);
        }
        std::thread::sleep(Duration::from_millis(500));
        for id in ctr(&["tasks", "ls", "-q"]).lines() {
            ctr(&["tasks", "delete", "-f", id]);
        }
    }

    /// Processes started by this cluster that outlived their parents: containerd shims (their
    /// `-address` is this cluster's socket) and containers' first processes (their pid files
    /// under containerd's state).
    fn strays(&self) -> Vec<i32> {
        let socket = self.containerd_socket().display().to_string();
        let mut pids = Vec::new();
        for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            let args: Vec<String> = cmdline
                .split(|b| *b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            if args.first().is_some_and(|a| a.ends_with("containerd-shim-runc-v2"))
                && args.windows(2).any(|w| w[0] == "-address" && w[1] == socket)
            {
                pids.push(pid);
            }
        }
        let state = self.dir().join("containerd/state");
        let mut stack = vec![state];
        while let Some(dir) = stack.pop() {
            for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                let path = e.path();
                if path.is_dir() && !path.is_symlink() {
                    stack.push(path);
                } else if e.file_name() == "init.pid"
                    && let Some(pid) = std::fs::read_to_string(&path).ok().and_then(|s| s.trim().parse().ok())
                    && let Some(id) = path
                        .parent()
                        .and_then(|p| p.file_name())
                        .map(|n| n.to_string_lossy().into_owned())
                    && std::fs::read_to_string(format!("/proc/{pid}/cgroup")).is_ok_and(|cg| cg.contains(&id))
                {
                    pids.push(pid);
                }
            }
        }
        pids
    }

    /// Mount points under this cluster's folder, deepest first.
    pub fn mounts(&self) -> Vec<PathBuf> {
        let dir = self.dir().display().to_string();
        let mut v: Vec<PathBuf> = std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .filter(|m| m.starts_with(&format!("{dir}/")))
            .map(PathBuf::from)
            .collect();
        v.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        v
    }

    /// The cluster's network namespace's name.
    pub fn netns(&self) -> &str {
        &self.netns
    }
}

/// Ends a process: SIGTERM, then SIGKILL after 10 s.
fn end(p: &mut Proc) {
    use nix::sys::signal::{Signal, kill};
    let pid = nix::unistd::Pid::from_raw(p.child.id() as i32);
    if p.child.try_wait().ok().flatten().is_some() {
        return;
    }
    let _ = kill(pid, Signal::SIGTERM);
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if p.child.try_wait().ok().flatten().is_some() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = p.child.kill();
    let _ = p.child.wait();
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Tests' own processes first, then the node, then the control plane.
        let order = [
            "kubelet",
            "containerd",
            "kube-scheduler",
            "kube-controller-manager",
            "kube-apiserver",
            "etcd",
        ];
        let mut procs = std::mem::take(&mut self.procs);
        let (mut cluster, mut others): (Vec<Proc>, Vec<Proc>) =
            procs.drain(..).partition(|p| order.contains(&p.name.as_str()));
        for p in others.iter_mut().rev() {
            end(p);
        }
        cluster.sort_by_key(|p| order.iter().position(|n| *n == p.name));
        for mut p in cluster {
            if p.name == "containerd" {
                self.kill_containers();
            }
            end(&mut p);
            if p.name == "containerd" {
                for pid in self.strays() {
                    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
                }
            }
        }
        for m in self.mounts() {
            if nix::mount::umount(&m).is_err() {
                let _ = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH);
            }
        }
        let _ = Command::new("ip").args(["netns", "del", &self.netns]).output();
        // libcni's result cache (a fixed path): this network's entries.
        for e in std::fs::read_dir("/var/lib/cni/results")
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with(&format!("{NETWORK}-")) {
                let _ = std::fs::remove_file(e.path());
                if let Some(id) = name
                    .strip_prefix(&format!("{NETWORK}-"))
                    .and_then(|r| r.strip_suffix("-eth0"))
                {
                    let _ = std::fs::remove_file(format!("/var/lib/cni/results/cni-loopback-{id}-lo"));
                }
            }
        }
        // The kubelet's fixed device-plugin folder: its socket and checkpoint, the plugins'
        // sockets; the folders too when the cluster made them.
        let dp = Path::new(DEVICE_PLUGIN_DIR);
        for e in std::fs::read_dir(dp).into_iter().flatten().flatten() {
            use std::os::unix::fs::FileTypeExt as _;
            if e.file_type().is_ok_and(|t| t.is_socket()) || e.file_name() == "kubelet_internal_checkpoint" {
                let _ = std::fs::remove_file(e.path());
            }
        }
        if self.made_device_plugin_dir {
            let _ = std::fs::remove_dir(dp);
            let _ = std::fs::remove_dir(dp.parent().expect("/var/lib/kubelet"));
        }
        // The kubelet's pod cgroups (cgroupfs driver), emptied above; deepest first.
        let mut roots: Vec<PathBuf> = vec![PathBuf::from("/sys/fs/cgroup/kubepods")];
        for e in std::fs::read_dir("/sys/fs/cgroup").into_iter().flatten().flatten() {
            roots.push(e.path().join("kubepods"));
        }
        for root in roots.into_iter().filter(|r| r.is_dir()) {
            remove_empty_dirs(&root);
        }
    }
}

/// Removes `dir` and the directories under it, deepest first (cgroups: only empty ones go).
fn remove_empty_dirs(dir: &Path) {
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            remove_empty_dirs(&e.path());
        }
    }
    let _ = std::fs::remove_dir(dir);
}
