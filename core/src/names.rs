//! Names shared by every component: resource names, annotation keys, the CDI kind.

/// Tessera's resource and annotation domain.
pub const DOMAIN: &str = "tessera.io";
/// CDI kind (`vendor/class`) of every device in Tessera's CDI spec.
pub const CDI_KIND: &str = "tessera.io/gpu";

/// Compute, in percent of one GPU (1..=100 share, multiples of 100 = whole cards).
pub const RESOURCE_GPU_CORE: &str = "tessera.io/gpu-core";
/// GPU memory, in the cluster's memory unit (default 1 GiB).
pub const RESOURCE_GPU_MEMORY: &str = "tessera.io/gpu-memory";
/// Prefix of the MIG resources, followed by the profile (`tessera.io/mig-1g.10gb`).
pub const RESOURCE_MIG_PREFIX: &str = "tessera.io/mig-";

/// Pod annotation: the signed allocation written by the extender at bind time.
pub const ANNOTATION_ALLOCATION: &str = "tessera.io/allocation";
/// Pod annotation: the HMAC signature over [`ANNOTATION_ALLOCATION`]'s exact bytes.
pub const ANNOTATION_ALLOCATION_SIGNATURE: &str = "tessera.io/allocation-signature";
/// Node annotation: the node's GPU inventory, published by the cdi-generator.
pub const ANNOTATION_INVENTORY: &str = "tessera.io/inventory";
/// Node label: `"true"` lets one card's shares go to pods of different tenants (by default a
/// card's shares all belong to one tenant).
pub const LABEL_CROSS_TENANT_SHARING: &str = "tessera.io/cross-tenant-sharing";
/// Node label: `"true"` gives the node's GPUs to DRA claims (the DRA plugin publishes them);
/// otherwise they go to the device-plugin path (the extender places pods on them). A node
/// serves one path, so no card is booked by both.
pub const LABEL_DRA: &str = "tessera.io/dra";
/// Whether a node's labels give its GPUs to DRA ([`LABEL_DRA`]).
pub fn offers_dra(labels: Option<&std::collections::BTreeMap<String, String>>) -> bool {
    labels.and_then(|l| l.get(LABEL_DRA)).is_some_and(|v| v == "true")
}
/// Node label: `"true"` lets the DRA plugin create and destroy MIG instances per claim on the
/// node's cards in MIG mode (dynamic MIG); otherwise it offers the instances the cards have.
pub const LABEL_DYNAMIC_MIG: &str = "tessera.io/dynamic-mig";
/// Whether a node's labels ask for dynamic MIG ([`LABEL_DYNAMIC_MIG`]).
pub fn dynamic_mig(labels: Option<&std::collections::BTreeMap<String, String>>) -> bool {
    labels
        .and_then(|l| l.get(LABEL_DYNAMIC_MIG))
        .is_some_and(|v| v == "true")
}
/// Namespace label, set by the operator: the tenant its pods belong to (namespaces with the
/// same value are one tenant); without it a namespace is a tenant of its own.
pub const LABEL_TENANT: &str = "tessera.io/tenant";
/// The scheduler name pods use to be placed by Tessera (the second scheduler's profile); the
/// extender binds no other pod.
pub const SCHEDULER_NAME: &str = "tessera";
/// Pod label an extender replica sets on its own pod: `leader` or `follower`, so that the
/// webhook Service selects the leader.
pub const LABEL_EXTENDER_ROLE: &str = "tessera.io/extender-role";
/// Pod annotation: allowed GPU models, `|`-separated.
pub const ANNOTATION_GPU_MODEL: &str = "tessera.io/gpu-model";
/// Pod annotation: how well each container's whole cards must be connected (`nvlink`,
/// `pcie-switch` or `numa`); without it the best-connected set is preferred, not required.
pub const ANNOTATION_GPU_LINK: &str = "tessera.io/gpu-link";
/// Pod annotation: hard compute ceiling in percent for shares.
pub const ANNOTATION_CORE_LIMIT: &str = "tessera.io/core-limit";
/// Pod annotation: the share enforcement the pod requires of its node (`required`, `mps`).
pub const ANNOTATION_SHARE_ENFORCEMENT: &str = "tessera.io/share-enforcement";
/// Pod annotation: node-tier placement policy override.
pub const ANNOTATION_NODE_POLICY: &str = "tessera.io/node-policy";
/// Pod annotation: card-tier placement policy override.
pub const ANNOTATION_GPU_POLICY: &str = "tessera.io/gpu-policy";

/// True for any resource name in Tessera's domain.
pub fn is_tessera_resource(name: &str) -> bool {
    name.strip_prefix(DOMAIN).is_some_and(|rest| rest.starts_with('/'))
}
