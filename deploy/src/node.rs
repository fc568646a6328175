//! The node DaemonSet: the CDI generator, device plugin and NRI plugin, with the DRA plugin
//! and the MPS supervisor when asked.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{DaemonSet, DaemonSetSpec};
use k8s_openapi::api::core::v1::{
    Container, ContainerPort, EnvVar, ExecAction, PodSpec, PodTemplateSpec, Probe, SecurityContext, Toleration, Volume,
    VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use tessera_core::driver::DEFAULT_BUNDLE_ROOT;
use tessera_core::enforcement::{DEFAULT_HOOK_ROOT, DEFAULT_MPS_ROOT, ShareEnforcement};
use tessera_core::{dra, granted};

use crate::build::{env_field, host_path, keys_volume, meta, mount, resources, selector};
use crate::{ManifestOptions, NODE, NODE_METRICS_PORT, PUBLIC_KEYS_SECRET};

/// What every agent container of the node shares: the image, one enforcement setting, root on
/// the host, the host under /host and the flags that find the driver.
struct Agents<'a> {
    opts: &'a ManifestOptions,
    env: Vec<EnvVar>,
    /// Hook mode, and MPS nodes (the hook holds a share's processes to its memory together).
    hook_mode: bool,
    /// The node agents read the host (driver files wherever the node keeps them, the ld
    /// cache, runtime configs) under /host and write host paths into the CDI spec.
    /// HostToContainer: a driver container's /run/nvidia/driver mounted later is seen too.
    host_root: VolumeMount,
    /// `--host-root`, and `--driver-root` when one is forced.
    args: Vec<String>,
}

impl<'a> Agents<'a> {
    fn new(opts: &'a ManifestOptions) -> Self {
        let value = |name: &str, value: String| EnvVar {
            name: name.into(),
            value: Some(value),
            ..Default::default()
        };
        let mut args = vec!["--host-root=/host".to_string()];
        if let Some(root) = &opts.driver_root {
            args.push(format!("--driver-root={root}"));
        }
        Self {
            opts,
            env: vec![
                env_field("NODE_NAME", "spec.nodeName"),
                value("TESSERA_SHARE_ENFORCEMENT", opts.share_enforcement.to_string()),
                value("TESSERA_MPS_ROOT", DEFAULT_MPS_ROOT.into()),
                value("TESSERA_HOOK_ROOT", DEFAULT_HOOK_ROOT.into()),
            ],
            hook_mode: opts.share_enforcement.preloads_hook(),
            host_root: VolumeMount {
                mount_propagation: Some("HostToContainer".into()),
                ..mount("host-root", "/host", true)
            },
            args,
        }
    }

    /// An agent's container: `cmd` with `args`, the node's environment, root on the host (NVML,
    /// /dev and the kubelet's device-plugin directory need it).
    fn container(&self, name: &str, cmd: &str, args: Vec<String>, mounts: Vec<VolumeMount>) -> Container {
        Container {
            name: name.into(),
            image: Some(self.opts.image.clone()),
            command: Some(vec![cmd.into()]),
            args: Some(args),
            env: Some(self.env.clone()),
            resources: Some(resources("20m", "32Mi", "256Mi")),
            security_context: Some(SecurityContext {
                privileged: Some(true),
                run_as_user: Some(0),
                ..Default::default()
            }),
            volume_mounts: Some(mounts),
            ..Default::default()
        }
    }

    fn cdi_generator(&self) -> Container {
        let mut mounts = vec![
            mount("cdi", "/var/run/cdi", false),
            mount("dev", "/dev", false),
            self.host_root.clone(),
            // Per-version driver bundles, mounted once by share devices.
            mount("driver-bundles", DEFAULT_BUNDLE_ROOT, false),
        ];
        // Hook and MPS modes: installs the CUDA hook on the host.
        if self.hook_mode {
            mounts.push(mount("hook", DEFAULT_HOOK_ROOT, false));
        }
        let args = [vec!["run".into(), "--cdi-dir=/var/run/cdi".into()], self.args.clone()].concat();
        self.container("cdi-generator", "tessera-cdi-generator", args, mounts)
    }

    fn device_plugin(&self) -> Container {
        let mounts = vec![
            mount("device-plugins", "/var/lib/kubelet/device-plugins", false),
            mount("dev", "/dev", false),
            self.host_root.clone(),
        ];
        self.container("device-plugin", "tessera-device-plugin", self.args.clone(), mounts)
    }

    fn nri_plugin(&self) -> Container {
        let args = vec![
            "run".into(),
            format!("--socket=/var/run/nri/{}", nri_socket(self.opts).1),
            "--keys-dir=/etc/tessera/keys".into(),
            "--cdi-dir=/var/run/cdi".into(),
            // The node's GPU metrics: NVML from the host's driver, GPU processes mapped to
            // containers through the host's /proc.
            format!("--metrics-listen=0.0.0.0:{NODE_METRICS_PORT}"),
            "--host-root=/host".into(),
            "--proc-root=/host/proc".into(),
            // Where the driver holds memory per cgroup (r615+), a share's limit is set on its
            // container's cgroup, found in the host's hierarchy (this container's own cgroup
            // namespace shows only its own).
            "--cgroup-root=/host/sys/fs/cgroup".into(),
        ];
        let mut mounts = vec![
            // The directory, not the socket: a runtime restart recreates it.
            mount("nri", "/var/run/nri", false),
            mount("cdi", "/var/run/cdi", true),
            mount("handoff-keys", "/etc/tessera/keys", true),
            // Each card's MPS daemon state, read before a share is admitted, and the card's
            // wanted ceiling, written.
            mount("mps", DEFAULT_MPS_ROOT, false),
            // What each container was granted (the DRA plugin reads it).
            mount("grants", granted::DEFAULT_GRANTS_DIR, false),
            // Hook and MPS modes: each share container's limits are written here.
            mount("hook", DEFAULT_HOOK_ROOT, !self.hook_mode),
        ];
        // DRA: the claims the node prepared, as the DRA plugin records them.
        if self.opts.dra {
            mounts.push(mount("dra-state", dra::DEFAULT_STATE_DIR, true));
        }
        // For `tessera-nri-plugin check` (runtime configs, driver, /dev) and the metrics (NVML,
        // /proc).
        mounts.extend([self.host_root.clone(), mount("dev", "/dev", true)]);
        Container {
            ports: Some(vec![ContainerPort {
                name: Some("metrics".into()),
                container_port: NODE_METRICS_PORT,
                ..Default::default()
            }]),
            ..self.container("nri-plugin", "tessera-nri-plugin", args, mounts)
        }
    }

    fn dra_plugin(&self) -> Container {
        let args = [
            vec![
                "--cdi-dir=/var/run/cdi".into(),
                format!("--state-dir={}", dra::DEFAULT_STATE_DIR),
            ],
            self.args.clone(),
        ]
        .concat();
        let mounts = vec![
            mount("plugins-registry", dra::REGISTRY_DIR, false),
            mount("dra-plugin", dra::PLUGIN_DIR, false),
            mount("cdi", "/var/run/cdi", false),
            mount("dra-state", dra::DEFAULT_STATE_DIR, false),
            // Which cards live containers use (the NRI plugin's records).
            mount("grants", granted::DEFAULT_GRANTS_DIR, true),
            mount("dev", "/dev", true),
            self.host_root.clone(),
        ];
        self.container("dra-plugin", "tessera-dra-plugin", args, mounts)
    }

    /// One MPS control daemon per shareable card, from the node's driver; the GPU's compute
    /// mode is left as it is unless asked.
    fn mps_supervisor(&self) -> Container {
        let mut args = [vec!["run".into()], self.args.clone()].concat();
        if self.opts.exclusive_process {
            args.push("--exclusive-process".into());
        }
        let mounts = vec![
            mount("dev", "/dev", false),
            self.host_root.clone(),
            // Bidirectional: each card's shm tmpfs, mounted here, is what the runtime binds into
            // the card's share containers.
            VolumeMount {
                mount_propagation: Some("Bidirectional".into()),
                ..mount("mps", DEFAULT_MPS_ROOT, false)
            },
        ];
        Container {
            readiness_probe: Some(Probe {
                exec: Some(ExecAction {
                    command: Some(vec!["tessera-mps-supervisor".into(), "status".into()]),
                }),
                period_seconds: Some(10),
                ..Default::default()
            }),
            ..self.container("mps-supervisor", "tessera-mps-supervisor", args, mounts)
        }
    }
}

/// The runtime's NRI socket as (directory, name): the directory is mounted at /var/run/nri (a
/// runtime restart recreates the socket).
fn nri_socket(opts: &ManifestOptions) -> (String, String) {
    opts.nri_socket
        .rsplit_once('/')
        .map_or(("/var/run/nri".to_string(), opts.nri_socket.clone()), |(d, n)| {
            (if d.is_empty() { "/".into() } else { d.to_string() }, n.to_string())
        })
}

/// The host directories the agents mount, and the nodes' public keys.
fn volumes(opts: &ManifestOptions) -> Vec<Volume> {
    let mut volumes = vec![
        host_path("cdi", &opts.cdi_dir, "DirectoryOrCreate"),
        host_path("device-plugins", "/var/lib/kubelet/device-plugins", "Directory"),
        host_path("nri", &nri_socket(opts).0, "DirectoryOrCreate"),
        host_path("dev", "/dev", "Directory"),
        host_path("host-root", "/", "Directory"),
        host_path("mps", DEFAULT_MPS_ROOT, "DirectoryOrCreate"),
        host_path("hook", DEFAULT_HOOK_ROOT, "DirectoryOrCreate"),
        host_path("grants", granted::DEFAULT_GRANTS_DIR, "DirectoryOrCreate"),
        host_path("driver-bundles", DEFAULT_BUNDLE_ROOT, "DirectoryOrCreate"),
        keys_volume(PUBLIC_KEYS_SECRET),
    ];
    if opts.dra {
        volumes.extend([
            host_path("plugins-registry", dra::REGISTRY_DIR, "Directory"),
            host_path("dra-plugin", dra::PLUGIN_DIR, "DirectoryOrCreate"),
            host_path("dra-state", dra::DEFAULT_STATE_DIR, "DirectoryOrCreate"),
        ]);
    }
    volumes
}

/// The node agents' DaemonSet.
pub(crate) fn daemon_set(opts: &ManifestOptions) -> DaemonSet {
    let agents = Agents::new(opts);
    let mut containers = vec![agents.cdi_generator(), agents.device_plugin(), agents.nri_plugin()];
    if opts.dra {
        containers.push(agents.dra_plugin());
    }
    if opts.share_enforcement == ShareEnforcement::Mps {
        containers.push(agents.mps_supervisor());
    }
    DaemonSet {
        metadata: meta(NODE, Some(&opts.namespace)),
        spec: Some(DaemonSetSpec {
            selector: LabelSelector {
                match_labels: Some(selector(NODE)),
                ..Default::default()
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    // Prometheus' usual pod discovery scrapes the NRI plugin's GPU metrics.
                    annotations: Some(BTreeMap::from([
                        ("prometheus.io/scrape".to_string(), "true".to_string()),
                        ("prometheus.io/port".to_string(), NODE_METRICS_PORT.to_string()),
                        ("prometheus.io/path".to_string(), "/metrics".to_string()),
                    ])),
                    ..meta(NODE, None)
                }),
                spec: Some(PodSpec {
                    service_account_name: Some(NODE.into()),
                    priority_class_name: Some("system-node-critical".into()),
                    // The MPS server finds itself through /proc in the driver's (the host's) PID
                    // namespace, as NVIDIA's own MPS daemon set runs it; in hook mode the NRI
                    // plugin tells each hooked process its host pid (the peer of its socket, as
                    // the host's PID namespace sees it).
                    host_pid: matches!(opts.share_enforcement, ShareEnforcement::Mps | ShareEnforcement::Hook)
                        .then_some(true),
                    node_selector: Some(BTreeMap::from([opts.node_selector.clone()])),
                    tolerations: Some(vec![Toleration {
                        key: Some("nvidia.com/gpu".into()),
                        operator: Some("Exists".into()),
                        effect: Some("NoSchedule".into()),
                        ..Default::default()
                    }]),
                    containers,
                    volumes: Some(volumes(opts)),
                    ..Default::default()
                }),
            },
            ..Default::default()
        }),
        ..Default::default()
    }
}
