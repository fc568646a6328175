//! `kubectl tessera`: the cluster's Tessera GPUs per node and card (`inspect`), and what one pod
//! asked for and was given (`pod`). Reads what the node agents publish (`tessera.io/inventory`)
//! and what the extender decided (`tessera.io/allocation`), with the caller's kubeconfig.

// Production functions stay under clippy.toml's length (tests may run long; CONTRIBUTING.md).
#![cfg_attr(not(test), deny(clippy::too_many_lines))]

pub mod pod;
pub mod render;
pub mod view;

use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::api::ListParams;
use kube::{Api, Client};
use tessera_core::request::RequestOptions;
use thiserror::Error;

pub use render::Output;
pub use view::ClusterView;

/// Why a command could not answer.
#[derive(Debug, Error)]
pub enum CliError {
    /// No node publishes a Tessera inventory.
    #[error(
        "no Tessera nodes: no node carries the tessera.io/inventory annotation (is the tessera-node DaemonSet running?)"
    )]
    NoTesseraNodes,
    /// Nodes carry the inventory annotation and none of them (or not the one named) can be
    /// read: each with why.
    #[error("no Tessera node can be read:\n  {}", .0.join("\n  "))]
    UnreadableNodes(Vec<String>),
    /// The named node is not a Tessera node.
    #[error("node {0:?} is not a Tessera node (no tessera.io/inventory annotation, or no such node)")]
    NodeNotFound(String),
    /// The named pod does not exist.
    #[error("pod {namespace}/{name} not found")]
    PodNotFound {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
    },
    /// An API call failed.
    #[error("{what}: {source}")]
    Api {
        /// What was being read.
        what: &'static str,
        /// The error.
        source: kube::Error,
    },
}

fn api(what: &'static str) -> impl FnOnce(kube::Error) -> CliError {
    move |source| CliError::Api { what, source }
}

/// `inspect [NODE]`: every Tessera node's GPUs (or one node's).
pub async fn inspect(client: &Client, node: Option<&str>, output: Output) -> Result<String, CliError> {
    let nodes = Api::<Node>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(api("listing nodes"))?
        .items;
    let pods = Api::<Pod>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(api("listing pods"))?
        .items;
    // DRA claims (Kubernetes 1.34+; an older API server has none to list).
    let mut denied = None;
    let claims = match Api::<k8s_openapi::api::resource::v1::ResourceClaim>::all(client.clone())
        .list(&ListParams::default())
        .await
    {
        Ok(list) => list.items,
        Err(kube::Error::Api(e)) if e.code == 404 => Vec::new(),
        // Not allowed to list claims: the rest is still worth showing.
        Err(kube::Error::Api(e)) if e.code == 403 => {
            denied = Some(format!("DRA claims not shown: {}", e.message));
            Vec::new()
        }
        Err(e) => {
            return Err(CliError::Api {
                what: "listing resource claims",
                source: e,
            });
        }
    };
    let mut view = ClusterView::build(&nodes, &pods);
    view.add_claims(&claims);
    view.problems.extend(denied);
    select(&mut view, node)?;
    Ok(render::inspect(&view, output))
}

/// Keeps only node `node` of the view when one is named; an error when there is nothing to
/// show, naming the nodes whose inventory cannot be read when there are some.
pub fn select(view: &mut ClusterView, node: Option<&str>) -> Result<(), CliError> {
    if view.nodes.is_empty() && view.unreadable.is_empty() {
        return Err(CliError::NoTesseraNodes);
    }
    if let Some(name) = node {
        let about = format!("node {name}: ");
        view.nodes.retain(|n| n.name == name);
        view.unreadable.retain(|p| p.starts_with(&about));
        view.problems.retain(|p| p.contains(&format!(" {name}")));
        if view.nodes.is_empty() && view.unreadable.is_empty() {
            return Err(CliError::NodeNotFound(name.to_string()));
        }
    }
    if view.nodes.is_empty() {
        return Err(CliError::UnreadableNodes(view.unreadable.clone()));
    }
    Ok(())
}

/// `pod NAME`: what the pod asked for, was given and why it waits.
pub async fn pod(client: &Client, namespace: &str, name: &str, opts: &RequestOptions) -> Result<String, CliError> {
    let pod = Api::<Pod>::namespaced(client.clone(), namespace)
        .get_opt(name)
        .await
        .map_err(api("reading the pod"))?
        .ok_or_else(|| CliError::PodNotFound {
            namespace: namespace.into(),
            name: name.into(),
        })?;
    let nodes = Api::<Node>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(api("listing nodes"))?
        .items;
    let events = Api::<Event>::namespaced(client.clone(), namespace)
        .list(&ListParams::default())
        .await
        .map_err(api("listing events"))?
        .items;
    Ok(pod::report(&pod, &nodes, &events, opts))
}
