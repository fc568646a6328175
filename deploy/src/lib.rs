//! Tessera's install manifests for every component, as typed Kubernetes objects rendered to
//! YAML (`tessera-manifests`). `deploy/tessera.yaml` and `deploy/scheduler-config.yaml`, next
//! to this crate, are the default rendering; a test fails when they drift from this code.

// Production functions stay under clippy.toml's length (tests may run long; CONTRIBUTING.md).
#![cfg_attr(not(test), deny(clippy::too_many_lines))]

use serde::Serialize;
use tessera_core::enforcement::ShareEnforcement;

use build::Objects;

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
    /// The share of a cluster's nodes the `tessera` scheduler looks at for each pod (its
    /// profile's `percentageOfNodesToScore`): 100, every node, so that the extender weighs
    /// every node that could take the pod; 0, kube-scheduler's adaptive default (50% less a
    /// point per 125 nodes, at least 5%, and at least 100 nodes: a tenth of 5,000).
    pub percentage_of_nodes_to_score: u32,
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
            percentage_of_nodes_to_score: 100,
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
pub(crate) const SCHEDULER: &str = "tessera-scheduler";
pub(crate) const NODE: &str = "tessera-node";
pub(crate) const EXTENDER_PORT: i32 = 8888;
/// Where the node DaemonSet serves its GPU metrics (the NRI plugin's `--metrics-listen`).
pub(crate) const NODE_METRICS_PORT: i32 = 9403;

pub use extender::extender_network_policy;
pub use scheduler::scheduler_config;

/// The Secret of the extender's side of the verbs' certificates: its serving certificate and
/// key, and the CA of the client it answers (made by the extender).
pub const EXTENDER_TLS_SECRET: &str = "tessera-extender-tls";
/// The Secret of the scheduler's side: its client certificate and key (which alone may call
/// the verbs) and the CA it verifies the extender with (written by the extender, which cannot
/// read it).
pub const SCHEDULER_TLS_SECRET: &str = "tessera-scheduler-tls";

/// Every object, in apply order.
pub fn objects(opts: &ManifestOptions) -> Vec<serde_json::Value> {
    let mut out = Objects::default();
    // Tessera's custom resources first, so that objects of theirs can follow.
    for crd in tessera_api::crds() {
        out.push(&crd);
    }
    rbac::objects(opts, &mut out);
    extender::objects(opts, &mut out);
    scheduler::objects(opts, &mut out);
    out.push(&node::daemon_set(opts));
    out.push(&claims::webhook_configuration(opts));
    out.0
}

/// Every object as one multi-document YAML stream.
pub fn render(opts: &ManifestOptions) -> String {
    let mut s = String::from(
        "# Tessera install manifests, rendered by `tessera-manifests`. Do not edit: change the\n\
         # renderer (deploy/src/) and re-render.\n\
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

mod build;
pub mod chart;
pub mod claims;
pub mod dra;
mod extender;
pub mod guards;
pub mod image;
mod node;
mod rbac;
mod scheduler;
#[cfg(test)]
mod tests;
