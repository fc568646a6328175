//! Tessera's install manifests for every component, as typed Kubernetes objects rendered to
//! YAML (`tessera-manifests`). `deploy/tessera.yaml` and `deploy/scheduler-config.yaml`, next
//! to this crate, are the default rendering; a test fails when they drift from this code.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{DaemonSet, DaemonSetSpec, Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    ConfigMap, ConfigMapVolumeSource, Container, ContainerPort, EnvVar, EnvVarSource, ExecAction, HTTPGetAction,
    HostPathVolumeSource, ObjectFieldSelector, PodSpec, PodTemplateSpec, Probe, ResourceRequirements,
    SecretVolumeSource, SecurityContext, Service, ServiceAccount, ServicePort, ServiceSpec, Toleration, Volume,
    VolumeMount,
};
use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort, NetworkPolicySpec,
};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde::Serialize;
use tessera_core::driver::DEFAULT_BUNDLE_ROOT;
use tessera_core::enforcement::{DEFAULT_HOOK_ROOT, DEFAULT_MPS_ROOT, ShareEnforcement};
use tessera_core::names::{RESOURCE_GPU_CORE, RESOURCE_GPU_MEMORY, RESOURCE_MIG_PREFIX};

/// What the rendering depends on.
#[derive(Debug, Clone)]
pub struct ManifestOptions {
    /// Namespace everything lives in.
    pub namespace: String,
    /// The Tessera image (all binaries).
    pub image: String,
    /// The kube-scheduler image for the second scheduler (match the cluster's version).
    pub scheduler_image: String,
    /// Extender replicas.
    pub replicas: i32,
    /// Label that marks GPU nodes for the node DaemonSet.
    pub node_selector: (String, String),
    /// Host directory of the NVIDIA driver files; `None` lets each node detect it.
    pub driver_root: Option<String>,
    /// How the GPU nodes hold shares to their limits: `Mps` adds the MPS supervisor.
    pub share_enforcement: ShareEnforcement,
    /// The container runtime's NRI socket on the nodes (a host path).
    pub nri_socket: String,
    /// Where the container runtime reads CDI specs on the nodes (a host path).
    pub cdi_dir: String,
    /// Also install Tessera as a DRA driver (Kubernetes 1.34+): DeviceClasses, the node
    /// agents' DRA rights and the DRA kubelet plugin in the node DaemonSet.
    pub dra: bool,
    /// With MPS: put the cards MPS serves in exclusive-process compute mode, so a process that
    /// goes around MPS is refused the card (`tessera-mps-supervisor run --exclusive-process`).
    pub exclusive_process: bool,
}

impl Default for ManifestOptions {
    fn default() -> Self {
        Self {
            namespace: "tessera-system".into(),
            image: "ghcr.io/tessera-gpu/tessera:0.1.0".into(),
            // The version the real-cluster tests run (tests/cluster); match your cluster's.
            scheduler_image: "registry.k8s.io/kube-scheduler:v1.36.2".into(),
            replicas: 2,
            node_selector: ("tessera.io/gpu-node".into(), "true".into()),
            driver_root: None,
            share_enforcement: ShareEnforcement::Mps,
            nri_socket: "/var/run/nri/nri.sock".into(),
            cdi_dir: "/var/run/cdi".into(),
            dra: false,
            exclusive_process: false,
        }
    }
}

pub use tessera_core::names::SCHEDULER_NAME;
/// The Secret holding the hand-off signing keys (Ed25519 private keys and `active`): the
/// extender's alone.
pub const KEYS_SECRET: &str = "tessera-handoff-keys";
/// The Secret holding their public keys: what the nodes verify with (and cannot sign with).
pub const PUBLIC_KEYS_SECRET: &str = "tessera-handoff-public-keys";
pub(crate) const EXTENDER: &str = "tessera-extender";
const SCHEDULER: &str = "tessera-scheduler";
pub(crate) const NODE: &str = "tessera-node";
const EXTENDER_PORT: i32 = 8888;
/// Where the node DaemonSet serves its GPU metrics (the NRI plugin's `--metrics-listen`).
const NODE_METRICS_PORT: i32 = 9403;

/// MIG profiles listed as scheduler-managed resources (A100 and H100 families).
const MIG_PROFILES: &[&str] = &[
    "1g.5gb", "1g.10gb", "1g.12gb", "1g.20gb", "2g.10gb", "2g.20gb", "2g.24gb", "3g.20gb", "3g.40gb", "3g.47gb",
    "4g.20gb", "4g.40gb", "4g.47gb", "7g.40gb", "7g.80gb", "7g.94gb",
];

fn meta(name: &str, ns: Option<&str>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        namespace: ns.map(Into::into),
        labels: Some(BTreeMap::from([
            ("app.kubernetes.io/name".to_string(), name.to_string()),
            ("app.kubernetes.io/part-of".to_string(), "tessera".to_string()),
        ])),
        ..Default::default()
    }
}

fn selector(name: &str) -> BTreeMap<String, String> {
    BTreeMap::from([("app.kubernetes.io/name".to_string(), name.to_string())])
}

fn rule(groups: &[&str], resources: &[&str], verbs: &[&str]) -> PolicyRule {
    let v = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    PolicyRule {
        api_groups: Some(v(groups)),
        resources: Some(v(resources)),
        verbs: v(verbs),
        ..Default::default()
    }
}

fn sa_subject(name: &str, ns: &str) -> Vec<Subject> {
    vec![Subject {
        kind: "ServiceAccount".into(),
        name: name.into(),
        namespace: Some(ns.into()),
        ..Default::default()
    }]
}

fn cluster_binding(name: &str, role: &str, sa: &str, ns: &str) -> ClusterRoleBinding {
    ClusterRoleBinding {
        metadata: meta(name, None),
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".into(),
            kind: "ClusterRole".into(),
            name: role.into(),
        },
        subjects: Some(sa_subject(sa, ns)),
    }
}

fn role_binding(name: &str, ns: &str, kind: &str, role: &str, sa: &str, sa_ns: &str) -> RoleBinding {
    RoleBinding {
        metadata: meta(name, Some(ns)),
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".into(),
            kind: kind.into(),
            name: role.into(),
        },
        subjects: Some(sa_subject(sa, sa_ns)),
    }
}

fn env_field(name: &str, path: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: path.into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn resources(cpu: &str, memory: &str, memory_limit: &str) -> ResourceRequirements {
    ResourceRequirements {
        requests: Some(BTreeMap::from([
            ("cpu".to_string(), Quantity(cpu.into())),
            ("memory".to_string(), Quantity(memory.into())),
        ])),
        limits: Some(BTreeMap::from([("memory".to_string(), Quantity(memory_limit.into()))])),
        ..Default::default()
    }
}

fn host_path(name: &str, path: &str, kind: &str) -> Volume {
    Volume {
        name: name.into(),
        host_path: Some(HostPathVolumeSource {
            path: path.into(),
            type_: Some(kind.into()),
        }),
        ..Default::default()
    }
}

fn mount(name: &str, path: &str, read_only: bool) -> VolumeMount {
    VolumeMount {
        name: name.into(),
        mount_path: path.into(),
        read_only: read_only.then_some(true),
        ..Default::default()
    }
}

/// The Secret of the extender's side of the verbs' certificates: its serving certificate and
/// key, and the CA of the client it answers (made by the extender).
pub const EXTENDER_TLS_SECRET: &str = "tessera-extender-tls";
/// The Secret of the scheduler's side: its client certificate and key (which alone may call
/// the verbs) and the CA it verifies the extender with (written by the extender, which cannot
/// read it).
pub const SCHEDULER_TLS_SECRET: &str = "tessera-scheduler-tls";
/// Where the scheduler mounts its client certificate.
const SCHEDULER_CLIENT_DIR: &str = "/etc/tessera/extender-client";

fn http_probe(path: &str, period: i32) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.into()),
            port: IntOrString::Int(EXTENDER_PORT),
            // The verbs' port is HTTPS; probes need no client certificate.
            scheme: Some("HTTPS".into()),
            ..Default::default()
        }),
        period_seconds: Some(period),
        ..Default::default()
    }
}

fn keys_volume(secret: &str) -> Volume {
    Volume {
        name: "handoff-keys".into(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(secret.into()),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn restricted() -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        read_only_root_filesystem: Some(true),
        run_as_non_root: Some(true),
        run_as_user: Some(65532),
        capabilities: Some(k8s_openapi::api::core::v1::Capabilities {
            drop: Some(vec!["ALL".into()]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Who may reach the extender's pods: its verbs (filter, prioritize, bind) only from the
/// `tessera` scheduler's pods; its admission webhook from anywhere (the API server calls it
/// from outside the pod network). Held where the cluster's network plugin enforces
/// NetworkPolicy; the verbs also require the scheduler's client certificate.
pub fn extender_network_policy(opts: &ManifestOptions) -> NetworkPolicy {
    let tcp = |port: i32| NetworkPolicyPort {
        port: Some(IntOrString::Int(port)),
        protocol: Some("TCP".into()),
        ..Default::default()
    };
    NetworkPolicy {
        metadata: meta(EXTENDER, Some(&opts.namespace)),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(LabelSelector {
                match_labels: Some(selector(EXTENDER)),
                ..Default::default()
            }),
            policy_types: Some(vec!["Ingress".into()]),
            ingress: Some(vec![
                NetworkPolicyIngressRule {
                    from: Some(vec![NetworkPolicyPeer {
                        pod_selector: Some(LabelSelector {
                            match_labels: Some(selector(SCHEDULER)),
                            ..Default::default()
                        }),
                        ..Default::default()
                    }]),
                    ports: Some(vec![tcp(EXTENDER_PORT)]),
                },
                NetworkPolicyIngressRule {
                    from: None,
                    ports: Some(vec![tcp(claims::WEBHOOK_PORT)]),
                },
            ]),
            ..Default::default()
        }),
    }
}

/// The KubeSchedulerConfiguration of the `tessera` scheduler profile.
pub fn scheduler_config(opts: &ManifestOptions) -> String {
    let mut managed = vec![RESOURCE_GPU_CORE.to_string(), RESOURCE_GPU_MEMORY.to_string()];
    managed.extend(MIG_PROFILES.iter().map(|p| format!("{RESOURCE_MIG_PREFIX}{p}")));
    let managed: String = managed
        .iter()
        .map(|m| format!("  - name: {m}\n    ignoredByScheduler: false\n"))
        .collect();
    format!(
        "apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
leaderElection:
  leaderElect: true
  resourceName: {SCHEDULER}
  resourceNamespace: {ns}
profiles:
- schedulerName: {SCHEDULER_NAME}
extenders:
- urlPrefix: https://{EXTENDER}.{ns}.svc:{EXTENDER_PORT}/tessera
  tlsConfig:
    serverName: {EXTENDER}.{ns}.svc
    caFile: {SCHEDULER_CLIENT_DIR}/ca.crt
    certFile: {SCHEDULER_CLIENT_DIR}/tls.crt
    keyFile: {SCHEDULER_CLIENT_DIR}/tls.key
  filterVerb: filter
  prioritizeVerb: prioritize
  weight: 5
  bindVerb: bind
  preemptVerb: preempt
  nodeCacheCapable: true
  httpTimeout: 5s
  ignorable: false
  managedResources:
{managed}",
        ns = opts.namespace
    )
}

/// Every object, in apply order.
pub fn objects(opts: &ManifestOptions) -> Vec<serde_json::Value> {
    let ns = opts.namespace.as_str();
    let mut out: Vec<serde_json::Value> = Vec::new();
    let mut push = |v: &dyn erased::Ser| out.push(v.value());

    // Tessera's custom resources first, so that objects of theirs can follow.
    for crd in tessera_api::crds() {
        push(&crd);
    }
    // No Namespace: it is created before the key Secret (README), and `kubectl delete -f`
    // of these manifests then leaves the namespace and its key in place.
    for sa in [EXTENDER, SCHEDULER, NODE] {
        push(&ServiceAccount {
            metadata: meta(sa, Some(ns)),
            ..Default::default()
        });
    }

    // Extender: read nodes and pods, annotate and bind pods, its own Lease.
    push(&ClusterRole {
        metadata: meta(EXTENDER, None),
        rules: Some(
            vec![
                rule(&[""], &["nodes"], &["get", "list", "watch"]),
                rule(&[""], &["pods"], &["get", "list", "watch", "patch"]),
                // Which tenant each namespace's pods belong to (tessera.io/tenant).
                rule(&[""], &["namespaces"], &["list", "watch"]),
                rule(&[""], &["pods/binding"], &["create"]),
                rule(&[""], &["events"], &["create", "patch"]),
            ]
            .into_iter()
            .chain(claims::extender_rules())
            .collect(),
        ),
        ..Default::default()
    });
    push(&cluster_binding(EXTENDER, EXTENDER, EXTENDER, ns));
    // Only the extender writes the signed allocation.
    let (policy, binding) = guards::allocation_guard(opts);
    push(&policy);
    push(&binding);
    // A node agent changes only its own Node.
    let (policy, binding) = guards::own_node_guard(opts);
    push(&policy);
    push(&binding);
    // The extender writes only its certificates' Secrets.
    let (policy, binding) = guards::extender_secrets_guard(opts);
    push(&policy);
    push(&binding);
    if opts.dra {
        for class in dra::device_classes() {
            push(&class);
        }
        let (role, binding) = dra::node_rbac(opts);
        push(&role);
        push(&binding);
        let (policy, binding) = dra::own_slice_guard(opts);
        push(&policy);
        push(&binding);
    }
    push(&Role {
        metadata: meta(&format!("{EXTENDER}-lease"), Some(ns)),
        rules: Some(
            std::iter::once(rule(
                &["coordination.k8s.io"],
                &["leases"],
                &["get", "create", "update"],
            ))
            .chain(claims::extender_namespace_rules())
            .collect(),
        ),
    });
    push(&role_binding(
        &format!("{EXTENDER}-lease"),
        ns,
        "Role",
        &format!("{EXTENDER}-lease"),
        EXTENDER,
        ns,
    ));

    // The second scheduler: kube-scheduler's own roles, plus its Lease here.
    for role in ["system:kube-scheduler", "system:volume-scheduler"] {
        let name = format!("{SCHEDULER}-{}", role.trim_start_matches("system:"));
        push(&cluster_binding(&name, role, SCHEDULER, ns));
    }
    push(&role_binding(
        &format!("{SCHEDULER}-auth-reader"),
        "kube-system",
        "Role",
        "extension-apiserver-authentication-reader",
        SCHEDULER,
        ns,
    ));
    push(&Role {
        metadata: meta(&format!("{SCHEDULER}-lease"), Some(ns)),
        rules: Some(vec![rule(
            &["coordination.k8s.io"],
            &["leases"],
            &["get", "create", "update"],
        )]),
    });
    push(&role_binding(
        &format!("{SCHEDULER}-lease"),
        ns,
        "Role",
        &format!("{SCHEDULER}-lease"),
        SCHEDULER,
        ns,
    ));

    // Node agents: publish the inventory annotation on their own node.
    push(&ClusterRole {
        metadata: meta(NODE, None),
        rules: Some(vec![rule(&[""], &["nodes"], &["get", "patch"])]),
        ..Default::default()
    });
    push(&cluster_binding(NODE, NODE, NODE, ns));

    // Extender Deployment, Service, PDB.
    push(&Deployment {
        metadata: meta(EXTENDER, Some(ns)),
        spec: Some(DeploymentSpec {
            replicas: Some(opts.replicas),
            selector: LabelSelector {
                match_labels: Some(selector(EXTENDER)),
                ..Default::default()
            },
            template: PodTemplateSpec {
                metadata: Some(meta(EXTENDER, None)),
                spec: Some(PodSpec {
                    service_account_name: Some(EXTENDER.into()),
                    priority_class_name: Some("system-cluster-critical".into()),
                    containers: vec![Container {
                        name: "extender".into(),
                        image: Some(opts.image.clone()),
                        command: Some(vec!["tessera-extender".into()]),
                        args: Some(vec![
                            "serve".into(),
                            format!("--listen=0.0.0.0:{EXTENDER_PORT}"),
                            "--keys-dir=/etc/tessera/keys".into(),
                            format!("--tls-secret={EXTENDER_TLS_SECRET}"),
                            format!("--scheduler-tls-secret={SCHEDULER_TLS_SECRET}"),
                            format!("--tls-service={EXTENDER}"),
                            format!("--webhook-listen=0.0.0.0:{}", claims::WEBHOOK_PORT),
                            format!("--webhook-secret={}", claims::WEBHOOK_SECRET),
                            format!("--webhook-service={}", claims::WEBHOOK_SERVICE),
                            format!("--webhook-configuration={}", claims::WEBHOOK_CONFIGURATION),
                        ]),
                        env: Some(vec![
                            env_field("POD_NAME", "metadata.name"),
                            env_field("POD_NAMESPACE", "metadata.namespace"),
                            EnvVar {
                                name: "RUST_LOG".into(),
                                value: Some("info".into()),
                                ..Default::default()
                            },
                        ]),
                        ports: Some(vec![
                            ContainerPort {
                                name: Some("http".into()),
                                container_port: EXTENDER_PORT,
                                ..Default::default()
                            },
                            ContainerPort {
                                name: Some("webhook".into()),
                                container_port: claims::WEBHOOK_PORT,
                                ..Default::default()
                            },
                        ]),
                        // Ready once synced, leader or not (so rollouts complete); the Service
                        // selects the leader by its role label, and /readyz answers for it.
                        readiness_probe: Some(http_probe("/syncedz", 2)),
                        liveness_probe: Some(http_probe("/healthz", 10)),
                        resources: Some(resources("200m", "256Mi", "2Gi")),
                        security_context: Some(restricted()),
                        volume_mounts: Some(vec![mount("handoff-keys", "/etc/tessera/keys", true)]),
                        ..Default::default()
                    }],
                    volumes: Some(vec![keys_volume(KEYS_SECRET)]),
                    ..Default::default()
                }),
            },
            ..Default::default()
        }),
        ..Default::default()
    });
    let mut leader = selector(EXTENDER);
    leader.insert(
        tessera_core::names::LABEL_EXTENDER_ROLE.to_string(),
        "leader".to_string(),
    );
    push(&Service {
        metadata: meta(EXTENDER, Some(ns)),
        spec: Some(ServiceSpec {
            selector: Some(leader),
            ports: Some(vec![ServicePort {
                name: Some("http".into()),
                port: EXTENDER_PORT,
                target_port: Some(IntOrString::String("http".into())),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    });
    push(&claims::webhook_service(opts));
    push(&extender_network_policy(opts));
    push(&PodDisruptionBudget {
        metadata: meta(EXTENDER, Some(ns)),
        spec: Some(PodDisruptionBudgetSpec {
            min_available: Some(IntOrString::Int(1)),
            selector: Some(LabelSelector {
                match_labels: Some(selector(EXTENDER)),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    });

    // The second scheduler.
    push(&ConfigMap {
        metadata: meta(SCHEDULER, Some(ns)),
        data: Some(BTreeMap::from([(
            "scheduler-config.yaml".to_string(),
            scheduler_config(opts),
        )])),
        ..Default::default()
    });
    push(&Deployment {
        metadata: meta(SCHEDULER, Some(ns)),
        spec: Some(DeploymentSpec {
            replicas: Some(2),
            selector: LabelSelector {
                match_labels: Some(selector(SCHEDULER)),
                ..Default::default()
            },
            template: PodTemplateSpec {
                metadata: Some(meta(SCHEDULER, None)),
                spec: Some(PodSpec {
                    service_account_name: Some(SCHEDULER.into()),
                    priority_class_name: Some("system-cluster-critical".into()),
                    containers: vec![Container {
                        name: "kube-scheduler".into(),
                        image: Some(opts.scheduler_image.clone()),
                        command: Some(vec![
                            "kube-scheduler".into(),
                            "--config=/etc/tessera/scheduler-config.yaml".into(),
                        ]),
                        liveness_probe: Some(Probe {
                            http_get: Some(HTTPGetAction {
                                path: Some("/healthz".into()),
                                port: IntOrString::Int(10259),
                                scheme: Some("HTTPS".into()),
                                ..Default::default()
                            }),
                            ..Default::default()
                        }),
                        resources: Some(resources("100m", "128Mi", "512Mi")),
                        // kube-scheduler may write its self-signed serving certificate.
                        security_context: Some(SecurityContext {
                            read_only_root_filesystem: Some(false),
                            ..restricted()
                        }),
                        volume_mounts: Some(vec![
                            mount("config", "/etc/tessera", true),
                            mount("extender-client", SCHEDULER_CLIENT_DIR, true),
                        ]),
                        ..Default::default()
                    }],
                    volumes: Some(vec![
                        Volume {
                            name: "config".into(),
                            config_map: Some(ConfigMapVolumeSource {
                                name: SCHEDULER.into(),
                                ..Default::default()
                            }),
                            ..Default::default()
                        },
                        // Its own Secret, which the extender writes (the pod waits for it):
                        // the CA and its client certificate.
                        Volume {
                            name: "extender-client".into(),
                            secret: Some(SecretVolumeSource {
                                secret_name: Some(SCHEDULER_TLS_SECRET.into()),
                                ..Default::default()
                            }),
                            ..Default::default()
                        },
                    ]),
                    ..Default::default()
                }),
            },
            ..Default::default()
        }),
        ..Default::default()
    });

    // Node DaemonSet: CDI generator, device plugin, NRI plugin (and the MPS supervisor). One
    // enforcement setting for every agent of the node.
    let node_env = vec![
        env_field("NODE_NAME", "spec.nodeName"),
        EnvVar {
            name: "TESSERA_SHARE_ENFORCEMENT".into(),
            value: Some(opts.share_enforcement.to_string()),
            ..Default::default()
        },
        EnvVar {
            name: "TESSERA_MPS_ROOT".into(),
            value: Some(DEFAULT_MPS_ROOT.into()),
            ..Default::default()
        },
        EnvVar {
            name: "TESSERA_HOOK_ROOT".into(),
            value: Some(DEFAULT_HOOK_ROOT.into()),
            ..Default::default()
        },
    ];
    // Hook mode, and MPS nodes (the hook holds a share's processes to its memory together).
    let hook_mode = opts.share_enforcement.preloads_hook();
    // The runtime's NRI socket: its directory is mounted at /var/run/nri (a runtime restart
    // recreates the socket).
    let (nri_socket_dir, nri_socket_name) = opts
        .nri_socket
        .rsplit_once('/')
        .map_or(("/var/run/nri".to_string(), opts.nri_socket.clone()), |(d, n)| {
            (if d.is_empty() { "/".into() } else { d.to_string() }, n.to_string())
        });
    // NVML, /dev and the kubelet's device-plugin directory need root on the host.
    let privileged = SecurityContext {
        privileged: Some(true),
        run_as_user: Some(0),
        ..Default::default()
    };
    // The node agents read the host (driver files wherever the node keeps them, the ld cache,
    // runtime configs) under /host and write host paths into the CDI spec. HostToContainer:
    // a driver container's /run/nvidia/driver mounted later is seen too.
    let host_root_mount = VolumeMount {
        mount_propagation: Some("HostToContainer".into()),
        ..mount("host-root", "/host", true)
    };
    let mut node_args = vec!["--host-root=/host".to_string()];
    if let Some(root) = &opts.driver_root {
        node_args.push(format!("--driver-root={root}"));
    }
    let container = |name: &str, cmd: &str, args: Vec<String>, mounts: Vec<VolumeMount>| Container {
        name: name.into(),
        image: Some(opts.image.clone()),
        command: Some(vec![cmd.into()]),
        args: Some(args),
        env: Some(node_env.clone()),
        resources: Some(resources("20m", "32Mi", "256Mi")),
        security_context: Some(privileged.clone()),
        volume_mounts: Some(mounts),
        ..Default::default()
    };
    push(&DaemonSet {
        metadata: meta(NODE, Some(ns)),
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
                    containers: vec![
                        container(
                            "cdi-generator",
                            "tessera-cdi-generator",
                            [vec!["run".into(), "--cdi-dir=/var/run/cdi".into()], node_args.clone()].concat(),
                            [
                                vec![
                                    mount("cdi", "/var/run/cdi", false),
                                    mount("dev", "/dev", false),
                                    host_root_mount.clone(),
                                    // Per-version driver bundles, mounted once by share devices.
                                    mount("driver-bundles", DEFAULT_BUNDLE_ROOT, false),
                                ],
                                // Hook and MPS modes: installs the CUDA hook on the host.
                                hook_mode
                                    .then(|| mount("hook", DEFAULT_HOOK_ROOT, false))
                                    .into_iter()
                                    .collect(),
                            ]
                            .concat(),
                        ),
                        container(
                            "device-plugin",
                            "tessera-device-plugin",
                            node_args.clone(),
                            vec![
                                mount("device-plugins", "/var/lib/kubelet/device-plugins", false),
                                mount("dev", "/dev", false),
                                host_root_mount.clone(),
                            ],
                        ),
                        Container {
                            ports: Some(vec![ContainerPort {
                                name: Some("metrics".into()),
                                container_port: NODE_METRICS_PORT,
                                ..Default::default()
                            }]),
                            ..container(
                                "nri-plugin",
                                "tessera-nri-plugin",
                                vec![
                                    "run".into(),
                                    format!("--socket=/var/run/nri/{nri_socket_name}"),
                                    "--keys-dir=/etc/tessera/keys".into(),
                                    "--cdi-dir=/var/run/cdi".into(),
                                    // The node's GPU metrics: NVML from the host's driver, GPU
                                    // processes mapped to containers through the host's /proc.
                                    format!("--metrics-listen=0.0.0.0:{NODE_METRICS_PORT}"),
                                    "--host-root=/host".into(),
                                    "--proc-root=/host/proc".into(),
                                ],
                                vec![
                                    // The directory, not the socket: a runtime restart recreates it.
                                    mount("nri", "/var/run/nri", false),
                                    mount("cdi", "/var/run/cdi", true),
                                    mount("handoff-keys", "/etc/tessera/keys", true),
                                    // Each card's MPS daemon state, read before a share is
                                    // admitted, and the card's wanted ceiling, written.
                                    mount("mps", DEFAULT_MPS_ROOT, false),
                                    // What each container was granted (the DRA plugin reads it).
                                    mount("grants", tessera_core::granted::DEFAULT_GRANTS_DIR, false),
                                    // Hook and MPS modes: each share container's limits are written here.
                                    mount("hook", DEFAULT_HOOK_ROOT, !hook_mode),
                                ]
                                .into_iter()
                                // DRA: the claims the node prepared, as the DRA plugin records them.
                                .chain(
                                    opts.dra
                                        .then(|| mount("dra-state", tessera_core::dra::DEFAULT_STATE_DIR, true)),
                                )
                                .chain([
                                    // For `tessera-nri-plugin check` (runtime configs, driver, /dev)
                                    // and the metrics (NVML, /proc).
                                    host_root_mount.clone(),
                                    mount("dev", "/dev", true),
                                ])
                                .collect(),
                            )
                        },
                    ]
                    .into_iter()
                    .chain(opts.dra.then(|| {
                        container(
                            "dra-plugin",
                            "tessera-dra-plugin",
                            [
                                vec![
                                    "--cdi-dir=/var/run/cdi".into(),
                                    format!("--state-dir={}", tessera_core::dra::DEFAULT_STATE_DIR),
                                ],
                                node_args.clone(),
                            ]
                            .concat(),
                            vec![
                                mount("plugins-registry", tessera_core::dra::REGISTRY_DIR, false),
                                mount("dra-plugin", tessera_core::dra::PLUGIN_DIR, false),
                                mount("cdi", "/var/run/cdi", false),
                                mount("dra-state", tessera_core::dra::DEFAULT_STATE_DIR, false),
                                // Which cards live containers use (the NRI plugin's records).
                                mount("grants", tessera_core::granted::DEFAULT_GRANTS_DIR, true),
                                mount("dev", "/dev", true),
                                host_root_mount.clone(),
                            ],
                        )
                    }))
                    .chain((opts.share_enforcement == ShareEnforcement::Mps).then(|| {
                        Container {
                            // One MPS control daemon per shareable card, from the node's driver;
                            // the GPU's compute mode is left as it is unless asked.
                            readiness_probe: Some(Probe {
                                exec: Some(ExecAction {
                                    command: Some(vec!["tessera-mps-supervisor".into(), "status".into()]),
                                }),
                                period_seconds: Some(10),
                                ..Default::default()
                            }),
                            ..container(
                                "mps-supervisor",
                                "tessera-mps-supervisor",
                                [
                                    vec!["run".into()],
                                    node_args.clone(),
                                    opts.exclusive_process
                                        .then(|| "--exclusive-process".to_string())
                                        .into_iter()
                                        .collect(),
                                ]
                                .concat(),
                                vec![
                                    mount("dev", "/dev", false),
                                    host_root_mount.clone(),
                                    // Bidirectional: each card's shm tmpfs, mounted here, is what
                                    // the runtime binds into the card's share containers.
                                    VolumeMount {
                                        mount_propagation: Some("Bidirectional".into()),
                                        ..mount("mps", DEFAULT_MPS_ROOT, false)
                                    },
                                ],
                            )
                        }
                    }))
                    .collect(),
                    volumes: Some(
                        vec![
                            host_path("cdi", &opts.cdi_dir, "DirectoryOrCreate"),
                            host_path("device-plugins", "/var/lib/kubelet/device-plugins", "Directory"),
                            host_path("nri", &nri_socket_dir, "DirectoryOrCreate"),
                            host_path("dev", "/dev", "Directory"),
                            host_path("host-root", "/", "Directory"),
                            host_path("mps", DEFAULT_MPS_ROOT, "DirectoryOrCreate"),
                            host_path("hook", DEFAULT_HOOK_ROOT, "DirectoryOrCreate"),
                            host_path("grants", tessera_core::granted::DEFAULT_GRANTS_DIR, "DirectoryOrCreate"),
                            host_path("driver-bundles", DEFAULT_BUNDLE_ROOT, "DirectoryOrCreate"),
                            keys_volume(PUBLIC_KEYS_SECRET),
                        ]
                        .into_iter()
                        .chain(
                            opts.dra
                                .then(|| {
                                    [
                                        host_path("plugins-registry", tessera_core::dra::REGISTRY_DIR, "Directory"),
                                        host_path("dra-plugin", tessera_core::dra::PLUGIN_DIR, "DirectoryOrCreate"),
                                        host_path(
                                            "dra-state",
                                            tessera_core::dra::DEFAULT_STATE_DIR,
                                            "DirectoryOrCreate",
                                        ),
                                    ]
                                })
                                .into_iter()
                                .flatten(),
                        )
                        .collect(),
                    ),
                    ..Default::default()
                }),
            },
            ..Default::default()
        }),
        ..Default::default()
    });
    push(&claims::webhook_configuration(opts));
    out
}

mod erased {
    //! Lets differently typed objects go through one closure.
    pub trait Ser {
        fn value(&self) -> serde_json::Value;
    }
    impl<T: serde::Serialize> Ser for T {
        fn value(&self) -> serde_json::Value {
            serde_json::to_value(self).expect("manifests serialize")
        }
    }
}

/// Every object as one multi-document YAML stream.
pub fn render(opts: &ManifestOptions) -> String {
    let mut s = String::from(
        "# Tessera install manifests, rendered by `tessera-manifests`. Do not edit: change the\n\
         # renderer (deploy/src/lib.rs) and re-render.\n\
         # Before applying, create the hand-off key Secret (docs/operations.md).\n",
    );
    for o in objects(opts) {
        s.push_str("---\n");
        s.push_str(&to_yaml(&o));
    }
    s
}

fn to_yaml<T: Serialize>(v: &T) -> String {
    serde_yaml::to_string(v).expect("manifests serialize")
}

pub mod chart;
pub mod claims;
pub mod dra;
pub mod guards;
pub mod image;
#[cfg(test)]
mod tests;
