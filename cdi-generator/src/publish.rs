//! Publishes the node's inventory on its own Node object (`tessera.io/inventory`) for the
//! extender. Needs RBAC `patch` on `nodes`.

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use tessera_core::enforcement::ShareEnforcement;
use tessera_core::inventory::{NodeInventory, PublishedInventory};
use tessera_core::names::ANNOTATION_INVENTORY;

/// The merge patch that sets the annotation: the inventory and how the node enforces shares.
pub fn patch_body(inventory: &NodeInventory, enforcement: ShareEnforcement) -> serde_json::Value {
    let published = PublishedInventory::of(inventory).enforced_by(enforcement);
    serde_json::json!({
        "metadata": { "annotations": { ANNOTATION_INVENTORY: published.encode() } }
    })
}

/// Patches `node` with the inventory annotation.
pub async fn publish(
    client: kube::Client,
    node: &str,
    inventory: &NodeInventory,
    enforcement: ShareEnforcement,
) -> Result<(), kube::Error> {
    let nodes: Api<Node> = Api::all(client);
    nodes
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(patch_body(inventory, enforcement)),
        )
        .await?;
    Ok(())
}

/// A client for the cluster: its service account when running in a pod, else the kubeconfig
/// (`KUBECONFIG`, `~/.kube/config`), as kubectl finds it; `None` when there is neither
/// (publishing is then skipped).
pub async fn cluster_client() -> Option<kube::Client> {
    let config = kube::Config::infer().await.ok()?;
    // Two rustls providers are linked (ring for kube, aws-lc-rs via the CDI crate's schema
    // validator): pick one explicitly.
    let _ = rustls::crypto::ring::default_provider().install_default();
    kube::Client::try_from(config).ok()
}
