//! `ElasticGPUClass`: how the GPUs of a class are provisioned and reclaimed. Cluster-scoped, with
//! its fields at the top level as a StorageClass has them.

use std::collections::BTreeMap;

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// What happens to a claim's [`ElasticGpu`](crate::egpu::ElasticGpu) when the pod using it goes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ReclaimPolicy {
    /// The GPU is freed; the next pod using the claim is placed afresh.
    #[default]
    Delete,
    /// The GPU stays booked for the claim; the next pod using it gets the same node and card.
    Retain,
}

/// When a claim is given its GPU.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum BindingMode {
    /// Accepted for elastic-gpu compatibility; Tessera binds when the first pod using the claim
    /// is placed, as with `WaitForFirstConsumer` (a GPU is chosen with its pod's node).
    Immediate,
    /// When the first pod using the claim is placed.
    #[default]
    WaitForFirstConsumer,
}

/// The class's fields (on the object's top level).
#[derive(CustomResource, Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "tessera.io",
    version = "v1alpha1",
    kind = "ElasticGPUClass",
    root = "ElasticGpuClass",
    plural = "elasticgpuclasses",
    singular = "elasticgpuclass",
    shortname = "egpuclass",
    doc = "How the GPUs of a class are provisioned and reclaimed.",
    no_spec,
    printcolumn = r#"{"name":"Provisioner","type":"string","jsonPath":".provisioner"}"#,
    printcolumn = r#"{"name":"Reclaim","type":"string","jsonPath":".reclaimPolicy"}"#,
    printcolumn = r#"{"name":"Binding","type":"string","jsonPath":".egpuBindingMode"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct ElasticGpuClassFields {
    /// Who provisions the class's GPUs (for example `tessera.io/gpu`, or elastic-gpu's
    /// `gpushare.provisioner.elasticgpu.io`). Tessera provisions every class of its group.
    #[schemars(length(min = 1))]
    pub provisioner: String,
    /// `Delete` (the default) or `Retain`.
    #[serde(default)]
    pub reclaim_policy: ReclaimPolicy,
    /// `WaitForFirstConsumer` (the default) or `Immediate`.
    #[serde(default)]
    pub egpu_binding_mode: BindingMode,
    /// Provisioner parameters (kept, not interpreted).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub parameters: BTreeMap<String, String>,
}
