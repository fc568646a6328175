//! One real containerd on private paths, driven through CRI as the kubelet drives it.
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! use tessera_tests::containerd::{Containerd, ContainerSpec, Version};
//! let mut c = Containerd::start(Version::V2).await?;
//! let pod = c.run_pod("demo", &[]).await?;
//! let id = c.create_container(&pod, ContainerSpec::new("main", &["true"])).await?;
//! let spec = c.oci_spec(&id).await?;           // the final OCI spec, after CDI and NRI
//! let (code, logs) = c.run_to_exit(&id).await?;
//! # Ok(()) }
//! ```
//!
//! Every instance has its own root, state, sockets, CDI and NRI directories under a temporary
//! directory; dropping it stops its pods, the daemon and its shims, unmounts what is left and
//! removes the directory. A panicking test prints the tail of the daemon's log.

mod config;
mod install;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tessera_proto::cri;
use tessera_proto::cri::runtime_service_client::RuntimeServiceClient;
use tonic::transport::Channel;

pub use install::{Runtimes, Version};

/// A pod sandbox created by [`Containerd::run_pod`].
#[derive(Debug, Clone)]
pub struct Pod {
    /// Sandbox id.
    pub id: String,
    /// The config it was created with (CreateContainer needs it again).
    pub config: cri::PodSandboxConfig,
}

/// What to create a container with.
#[derive(Debug, Clone, Default)]
pub struct ContainerSpec {
    /// Container name.
    pub name: String,
    /// Command.
    pub command: Vec<String>,
    /// Environment.
    pub env: Vec<(String, String)>,
    /// CRI container annotations (the device plugin's Allocate annotations arrive here).
    pub annotations: Vec<(String, String)>,
    /// Fully qualified CDI device names (CRI field 17).
    pub cdi_devices: Vec<String>,
    /// Image (default: the harness's busybox image); see [`Containerd::import_image`].
    pub image: Option<String>,
    /// The user the process runs as (CRI `run_as_user`).
    pub run_as_user: Option<i64>,
    /// Read-only bind mounts: (host path, container path).
    pub ro_mounts: Vec<(String, String)>,
}

impl ContainerSpec {
    /// A container running `command`.
    pub fn new(name: &str, command: &[&str]) -> Self {
        Self {
            name: name.into(),
            command: command.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    /// Binds host path `host` read-only at `container`.
    pub fn ro_mount(mut self, host: &str, container: &str) -> Self {
        self.ro_mounts.push((host.into(), container.into()));
        self
    }

    /// Adds an environment variable.
    pub fn env(mut self, k: &str, v: &str) -> Self {
        self.env.push((k.into(), v.into()));
        self
    }

    /// Adds a CRI annotation.
    pub fn annotation(mut self, k: &str, v: &str) -> Self {
        self.annotations.push((k.into(), v.into()));
        self
    }

    /// Runs in another image, imported with [`Containerd::import_image`].
    pub fn image(mut self, name: &str) -> Self {
        self.image = Some(name.into());
        self
    }

    /// Runs the process as `uid`.
    pub fn user(mut self, uid: i64) -> Self {
        self.run_as_user = Some(uid);
        self
    }

    /// Adds a CDI device by qualified name.
    pub fn cdi(mut self, name: &str) -> Self {
        self.cdi_devices.push(name.into());
        self
    }
}

/// A running containerd.
pub struct Containerd {
    version: Version,
    dir: tempfile::TempDir,
    daemon: Option<Child>,
    client: Option<RuntimeServiceClient<Channel>>,
    pods: Vec<String>,
    runtimes: &'static Runtimes,
}

impl Containerd {
    /// Fetches the runtimes if needed, writes the config, starts the daemon, imports the test
    /// image and connects a CRI client.
    pub async fn start(version: Version) -> anyhow::Result<Self> {
        let runtimes = Runtimes::get()?;
        // Unix socket paths are limited to 107 bytes: keep the directory short.
        let dir = tempfile::Builder::new()
            .prefix("tsr-")
            .tempdir_in("/tmp")
            .context("creating instance dir")?;
        for sub in ["cdi", "nri-plugins", "nri-conf", "cni/bin", "cni/conf", "logs"] {
            std::fs::create_dir_all(dir.path().join(sub))?;
        }
        let (image, _) = runtimes.image();
        let cfg = config::render(
            version,
            &config::Paths {
                dir: dir.path(),
                runc: runtimes.runc(),
                image,
            },
        );
        std::fs::write(dir.path().join("config.toml"), cfg)?;
        let mut c = Self {
            version,
            dir,
            daemon: None,
            client: None,
            pods: Vec::new(),
            runtimes,
        };
        c.start_daemon().await?;
        let (name, tar) = runtimes.image();
        let out = c.ctr(&["images", "import", &tar.display().to_string()])?;
        // ctr usually names what it unpacked, but has been seen (containerd 2, a loaded
        // machine) to succeed saying nothing: what counts is that the image is there.
        let listed = c.ctr(&["images", "ls", "-q"])?;
        if !listed.lines().any(|l| l.trim() == name) {
            bail!("importing {} said: {out:?}; images now: {listed:?}", tar.display());
        }
        Ok(c)
    }

    /// The containerd flavour.
    pub fn version(&self) -> Version {
        self.version
    }

    /// The Debian package version running.
    pub fn package_version(&self) -> &str {
        self.runtimes.version(self.version)
    }

    /// The instance directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The CDI spec directory this containerd reads.
    pub fn cdi_dir(&self) -> PathBuf {
        self.dir.path().join("cdi")
    }

    /// The NRI socket external plugins connect to.
    pub fn nri_socket(&self) -> PathBuf {
        self.dir.path().join("nri.sock")
    }

    /// The CRI socket.
    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("containerd.sock")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("containerd.log")
    }

    /// The last `n` lines of the daemon's log.
    pub fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(self.log_path()).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    fn ctr(&self, args: &[&str]) -> anyhow::Result<String> {
        let bin = self.runtimes.bin_dir(self.version).join("ctr");
        let out = Command::new(&bin)
            .args(["-a", &self.socket().display().to_string(), "-n", "k8s.io"])
            .args(args)
            .output()
            .with_context(|| format!("running {}", bin.display()))?;
        if !out.status.success() {
            bail!("ctr {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Imports an OCI image-layout tarball ([`pack_image`] makes them).
    pub fn import_image(&self, tar: &Path) -> anyhow::Result<()> {
        self.ctr(&["images", "import", &tar.display().to_string()])?;
        Ok(())
    }

    /// Starts the daemon (again, after [`Containerd::stop_daemon`]) and waits for CRI.
    pub async fn start_daemon(&mut self) -> anyhow::Result<()> {
        let bin_dir = self.runtimes.bin_dir(self.version);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())?;
        let path = format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap_or_default());
        let child = Command::new(bin_dir.join("containerd"))
            .arg("--config")
            .arg(self.dir.path().join("config.toml"))
            .env("PATH", path)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting containerd")?;
        self.daemon = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.daemon.as_mut().and_then(|d| d.try_wait().ok().flatten()) {
                bail!("containerd exited with {status}:\n{}", self.log_tail(30));
            }
            if self.socket().exists()
                && let Ok(mut client) = connect(&self.socket()).await
                && client
                    .version(cri::VersionRequest { version: "v1".into() })
                    .await
                    .is_ok()
            {
                self.client = Some(client);
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("containerd did not answer CRI within 30 s:\n{}", self.log_tail(30));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stops the daemon (SIGTERM, then SIGKILL after 10 s), leaving pods and shims running, as
    /// a runtime restart does.
    pub fn stop_daemon(&mut self) {
        self.client = None;
        if let Some(mut child) = self.daemon.take() {
            let pid = nix::unistd::Pid::from_raw(child.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if child.try_wait().ok().flatten().is_some() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The CRI client.
    pub fn cri(&mut self) -> anyhow::Result<&mut RuntimeServiceClient<Channel>> {
        self.client.as_mut().context("containerd is not running")
    }

    /// The runtime's CRI Version answer.
    pub async fn cri_version(&mut self) -> anyhow::Result<cri::VersionResponse> {
        Ok(self
            .cri()?
            .version(cri::VersionRequest { version: "v1".into() })
            .await?
            .into_inner())
    }

    /// Runs a pod sandbox with host networking and the given annotations.
    pub async fn run_pod(&mut self, name: &str, annotations: &[(&str, &str)]) -> anyhow::Result<Pod> {
        self.run_pod_with_uid(name, &format!("uid-{name}-{}", self.pods.len()), annotations)
            .await
    }

    /// Runs a pod sandbox with a given pod UID.
    /// Runs pod `name` (uid `uid-<name>`) whose allocation, signed with `keys` for node `node`,
    /// gives its container `main` the device `device`: a pod as Tessera's extender binds it.
    pub async fn run_signed_pod(
        &mut self,
        keys: &tessera_core::handoff::SigningKeys,
        node: &str,
        name: &str,
        device: tessera_core::handoff::AllocatedDevice,
    ) -> anyhow::Result<Pod> {
        use tessera_core::handoff::{Allocation, ContainerAllocation};
        use tessera_core::names::{ANNOTATION_ALLOCATION, ANNOTATION_ALLOCATION_SIGNATURE};
        let uid = format!("uid-{name}");
        let mut a = Allocation::new(node, &uid);
        a.containers.push(ContainerAllocation {
            name: "main".into(),
            role: tessera_core::request::ContainerRole::App,
            devices: vec![device],
        });
        let s = keys.sign(&a);
        self.run_pod_with_uid(
            name,
            &uid,
            &[
                (ANNOTATION_ALLOCATION, &s.allocation),
                (ANNOTATION_ALLOCATION_SIGNATURE, &s.signature),
            ],
        )
        .await
    }

    pub async fn run_pod_with_uid(
        &mut self,
        name: &str,
        uid: &str,
        annotations: &[(&str, &str)],
    ) -> anyhow::Result<Pod> {
        let config = cri::PodSandboxConfig {
            metadata: Some(cri::PodSandboxMetadata {
                name: name.into(),
                uid: uid.into(),
                namespace: "default".into(),
                attempt: 0,
            }),
            log_directory: self.dir.path().join("logs").join(name).display().to_string(),
            annotations: annotations
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            linux: Some(cri::LinuxPodSandboxConfig {
                security_context: Some(cri::LinuxSandboxSecurityContext {
                    namespace_options: Some(cri::NamespaceOption {
                        network: cri::NamespaceMode::Node as i32,
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        std::fs::create_dir_all(&config.log_directory)?;
        let resp = self
            .cri()?
            .run_pod_sandbox(cri::RunPodSandboxRequest {
                config: Some(config.clone()),
                runtime_handler: String::new(),
            })
            .await
            .with_context(|| format!("RunPodSandbox {name}"))?;
        let id = resp.into_inner().pod_sandbox_id;
        self.pods.push(id.clone());
        Ok(Pod { id, config })
    }

    /// Creates a container in `pod`; returns its id or the runtime's error.
    pub async fn create_container(&mut self, pod: &Pod, spec: ContainerSpec) -> anyhow::Result<String> {
        let (default_image, _) = self.runtimes.image();
        let image = spec.image.as_deref().unwrap_or(default_image);
        let config = cri::ContainerConfig {
            metadata: Some(cri::ContainerMetadata {
                name: spec.name.clone(),
                attempt: 0,
            }),
            image: Some(cri::ImageSpec {
                image: image.into(),
                annotations: HashMap::new(),
            }),
            command: spec.command,
            envs: spec
                .env
                .into_iter()
                .map(|(key, value)| cri::KeyValue { key, value })
                .collect(),
            annotations: spec.annotations.into_iter().collect(),
            mounts: spec
                .ro_mounts
                .into_iter()
                .map(|(host_path, container_path)| cri::Mount {
                    container_path,
                    host_path,
                    readonly: true,
                })
                .collect(),
            log_path: format!("{}.log", spec.name),
            cdi_devices: spec
                .cdi_devices
                .into_iter()
                .map(|name| cri::CdiDevice { name })
                .collect(),
            linux: spec.run_as_user.map(|uid| cri::LinuxContainerConfig {
                security_context: Some(cri::LinuxContainerSecurityContext {
                    run_as_user: Some(cri::Int64Value { value: uid }),
                    ..Default::default()
                }),
            }),
            ..Default::default()
        };
        let resp = self
            .cri()?
            .create_container(cri::CreateContainerRequest {
                pod_sandbox_id: pod.id.clone(),
                config: Some(config),
                sandbox_config: Some(pod.config.clone()),
            })
            .await
            .map_err(|s| anyhow::anyhow!("CreateContainer {}: {}", spec.name, s.message()))?;
        Ok(resp.into_inner().container_id)
    }

    /// containerd's verbose ContainerStatus `info` (the runtime spec, the task's pid, ...).
    async fn verbose_info(&mut self, id: &str) -> anyhow::Result<serde_json::Value> {
        let resp = self
            .cri()?
            .container_status(cri::ContainerStatusRequest {
                container_id: id.into(),
                verbose: true,
            })
            .await?
            .into_inner();
        let info = resp.info.get("info").context("ContainerStatus has no info[\"info\"]")?;
        serde_json::from_str(info).context("info is not JSON")
    }

    /// The container's final OCI spec (after CDI and NRI), from verbose ContainerStatus.
    pub async fn oci_spec(&mut self, id: &str) -> anyhow::Result<oci_spec::runtime::Spec> {
        let mut v = self.verbose_info(id).await?;
        let spec = v.get_mut("runtimeSpec").context("info has no runtimeSpec")?.take();
        serde_json::from_value(spec).context("runtimeSpec is not an OCI spec")
    }

    /// The host pid of the running container's first process, from verbose ContainerStatus.
    pub async fn task_pid(&mut self, id: &str) -> anyhow::Result<u32> {
        let v = self.verbose_info(id).await?;
        v.get("pid")
            .and_then(serde_json::Value::as_u64)
            .and_then(|p| u32::try_from(p).ok())
            .filter(|p| *p > 0)
            .with_context(|| format!("info has no pid: {v}"))
    }

    /// The container's CRI status.
    pub async fn status(&mut self, id: &str) -> anyhow::Result<cri::ContainerStatus> {
        self.cri()?
            .container_status(cri::ContainerStatusRequest {
                container_id: id.into(),
                verbose: false,
            })
            .await?
            .into_inner()
            .status
            .context("no status")
    }

    /// Starts the container and waits (up to 30 s) for it to exit; returns the exit code and
    /// what it wrote to stdout and stderr.
    pub async fn run_to_exit(&mut self, id: &str) -> anyhow::Result<(i32, String)> {
        self.start_container(id).await?;
        self.wait_for_exit(id).await
    }

    /// Starts a created container.
    pub async fn start_container(&mut self, id: &str) -> anyhow::Result<()> {
        self.cri()?
            .start_container(cri::StartContainerRequest {
                container_id: id.into(),
            })
            .await?;
        Ok(())
    }

    /// Waits (up to 30 s) for a started container to exit; returns the exit code and what it
    /// wrote to stdout and stderr.
    pub async fn wait_for_exit(&mut self, id: &str) -> anyhow::Result<(i32, String)> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let st = self.status(id).await?;
            if st.state == cri::ContainerState::ContainerExited as i32 {
                let log = std::fs::read_to_string(&st.log_path).unwrap_or_default();
                return Ok((st.exit_code, cri_log_text(&log)));
            }
            if Instant::now() > deadline {
                bail!("container {id} did not exit within 30 s");
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Stops and removes a pod.
    pub async fn remove_pod(&mut self, pod: &Pod) -> anyhow::Result<()> {
        let c = self.cri()?;
        c.stop_pod_sandbox(cri::StopPodSandboxRequest {
            pod_sandbox_id: pod.id.clone(),
        })
        .await?;
        c.remove_pod_sandbox(cri::RemovePodSandboxRequest {
            pod_sandbox_id: pod.id.clone(),
        })
        .await?;
        self.pods.retain(|p| p != &pod.id);
        Ok(())
    }

    fn cleanup(&mut self) {
        // Stop and remove pods through CRI while the daemon still runs.
        if self.client.is_some() && !self.pods.is_empty() {
            let pods = std::mem::take(&mut self.pods);
            let socket = self.socket();
            let _ = std::thread::scope(|s| {
                s.spawn(|| {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .ok()?;
                    rt.block_on(async {
                        let mut c = connect(&socket).await.ok()?;
                        for id in pods {
                            let _ = c
                                .stop_pod_sandbox(cri::StopPodSandboxRequest {
                                    pod_sandbox_id: id.clone(),
                                })
                                .await;
                            let _ = c
                                .remove_pod_sandbox(cri::RemovePodSandboxRequest { pod_sandbox_id: id })
                                .await;
                        }
                        Some(())
                    })
                })
                .join()
            });
        }
        self.stop_daemon();
        kill_shims(self.dir.path());
        unmount_below(self.dir.path());
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "--- containerd {} ({}) log tail ---\n{}\n---",
                self.package_version(),
                self.dir.path().display(),
                self.log_tail(40)
            );
        }
        self.cleanup();
    }
}

async fn connect(socket: &Path) -> anyhow::Result<RuntimeServiceClient<Channel>> {
    Ok(RuntimeServiceClient::new(crate::uds::channel(socket).await?))
}

/// Where a container's OCI spec mounts things (destinations, in order).
pub fn mount_destinations(spec: &oci_spec::runtime::Spec) -> Vec<String> {
    spec.mounts()
        .iter()
        .flatten()
        .map(|m| m.destination().display().to_string())
        .collect()
}

/// Packs a root filesystem directory as a one-layer OCI image named `name` into `tar`
/// (`tests/runtimes/oci-image.sh`), for [`Containerd::import_image`].
pub fn pack_image(rootfs: &Path, name: &str, tar: &Path) -> anyhow::Result<()> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("runtimes/oci-image.sh");
    let st = std::process::Command::new("bash")
        .arg(&script)
        .arg(rootfs)
        .arg(name)
        .arg(tar)
        .status()?;
    anyhow::ensure!(st.success(), "{} failed", script.display());
    Ok(())
}

/// The text of a CRI log file (`<time> <stream> <P|F> <text>` lines).
pub fn cri_log_text(log: &str) -> String {
    let mut out = String::new();
    for line in log.lines() {
        let mut parts = line.splitn(4, ' ');
        let (_, _, tag, text) = (parts.next(), parts.next(), parts.next(), parts.next().unwrap_or(""));
        out.push_str(text);
        if tag != Some("P") {
            out.push('\n');
        }
    }
    out
}

/// Kills shim processes serving this instance (their command line names its socket).
fn kill_shims(dir: &Path) {
    let needle = dir.display().to_string();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return;
    };
    for e in entries.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains("containerd-shim") && cmdline.contains(&needle) {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
        }
    }
}

/// Lazily unmounts everything mounted below `dir`, deepest first.
fn unmount_below(dir: &Path) {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return;
    };
    let prefix = dir.display().to_string();
    let mut points: Vec<&str> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|p| p.starts_with(&prefix))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.len()));
    for p in points {
        let _ = nix::mount::umount2(p, nix::mount::MntFlags::MNT_DETACH);
    }
}
