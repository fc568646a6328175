//! Publishes the node's inventory on its own Node object (`tessera.io/inventory`) for the
//! extender. Needs RBAC `patch` on `nodes`.

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use tessera_core::enforcement::ShareEnforcement;
use tessera_core::inventory::{NodeInventory, PublishedInventory, ShareMemory};
use tessera_core::names::ANNOTATION_INVENTORY;

/// The merge patch that sets the annotation: the inventory, how the node enforces shares and
/// how its driver holds share memory.
pub fn patch_body(
    inventory: &NodeInventory,
    enforcement: ShareEnforcement,
    memory: Option<&ShareMemory>,
) -> serde_json::Value {
    let published = PublishedInventory::of(inventory)
        .enforced_by(enforcement)
        .holding_share_memory(memory.cloned());
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
    memory: Option<&ShareMemory>,
) -> Result<(), kube::Error> {
    let nodes: Api<Node> = Api::all(client);
    nodes
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(patch_body(inventory, enforcement, memory)),
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

/// How this node's driver holds share memory: NVML (`library`, else the loader's) and the
/// cgroup v2 hierarchy at `cgroup_root` asked once, at start.
pub fn share_memory(library: Option<&std::path::Path>, cgroup_root: &std::path::Path) -> ShareMemory {
    use tessera_node::memory_limits::{Support, probe};
    let (support, _) = probe(library, cgroup_root);
    ShareMemory {
        per_cgroup: matches!(support, Support::PerCgroup { .. }),
        detail: support.to_string(),
    }
}
