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

// Production functions stay under clippy.toml's length (tests may run long; CONTRIBUTING.md).
#![cfg_attr(not(test), deny(clippy::too_many_lines))]

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
    let mut crds = vec![
        class::ElasticGpuClass::crd(),
        claim::ElasticGpuClaim::crd(),
        egpu::ElasticGpu::crd(),
    ];
    for crd in &mut crds {
        for version in &mut crd.spec.versions {
            if let Some(schema) = version.schema.as_mut().and_then(|s| s.open_api_v3_schema.as_mut()) {
                let mut v = serde_json::to_value(&*schema).expect("a schema serializes");
                drop_unknown_formats(&mut v);
                *schema = serde_json::from_value(v).expect("still a schema");
            }
        }
    }
    crds
}

/// Removes the integer formats schemars writes for unsigned types (`uint32`, `uint64`, ...),
/// which the API server does not know and warns about on every apply; their `minimum: 0` stays.
fn drop_unknown_formats(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(m) => {
            if m.get("format")
                .and_then(|f| f.as_str())
                .is_some_and(|f| f.starts_with("uint") || f == "int8" || f == "int16")
            {
                m.remove("format");
            }
            m.values_mut().for_each(drop_unknown_formats);
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(drop_unknown_formats),
        _ => {}
    }
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
