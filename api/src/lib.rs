//! Tessera's Kubernetes API: GPUs asked for the way storage is, with three custom resources
//! shaped as elastic-gpu's (which mirror StorageClass, PersistentVolumeClaim and
//! PersistentVolume):
//!
//! - [`ElasticGpuClass`](class::ElasticGpuClass): how GPUs of a class are reclaimed;
//! - [`ElasticGpuClaim`](claim::ElasticGpuClaim): a namespaced request for a share, whole cards
//!   or MIG slices;
//! - [`ElasticGpu`](egpu::ElasticGpu): what a claim was given (node, cards, amounts), bound to it.
//!
//! Pods name a claim per container by annotation ([`pod::claim_refs`]); the extender's admission
//! webhook turns each into the container's `tessera.io/*` resources, so everything downstream
//! (kubelet accounting, device plugin, hand-off) is unchanged.

pub mod claim;
pub mod class;
pub mod egpu;
pub mod pod;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt as _;

/// The API group of Tessera's custom resources.
pub const GROUP: &str = "tessera.io";
/// Their version.
pub const VERSION: &str = "v1alpha1";

/// The three CustomResourceDefinitions, for the install manifests.
pub fn crds() -> Vec<CustomResourceDefinition> {
    vec![
        class::ElasticGpuClass::crd(),
        claim::ElasticGpuClaim::crd(),
        egpu::ElasticGpu::crd(),
    ]
}

/// The schema of a map of quantities (`10`, `4`, `8Gi`): integers or strings.
fn quantity_map(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "additionalProperties": {
            "x-kubernetes-int-or-string": true,
            "description": "A quantity: 10, 4, 8Gi."
        }
    })
}

#[cfg(test)]
mod tests;
