//! `ElasticGPUClaim`: a namespaced request for GPU (a share, whole cards or MIG slices), bound to
//! an [`ElasticGpu`](crate::egpu::ElasticGpu) when the first pod using it is placed.
//!
//! Its resources are written as Tessera's (`tessera.io/gpu-core`, `tessera.io/gpu-memory`,
//! `tessera.io/mig-<profile>`) or as elastic-gpu's (`<provisioner>.elasticgpu.io/gpu-core`,
//! `.../gpu-memory`, `qgpu-core`, `qgpu-memory`, `nvidia.com/gpu`), so that elastic-gpu's claims
//! apply with only their `apiVersion` changed. [`ElasticGpuClaim::container_resources`] turns
//! them into a container's `tessera.io/*` resources, validated by the same rules as a pod's.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use tessera_core::names::{RESOURCE_GPU_CORE, RESOURCE_GPU_MEMORY, is_tessera_resource};
use tessera_core::quantity::Amount;
use tessera_core::request::{ContainerRequest, ContainerRole, RequestError, RequestOptions};
use thiserror::Error;

/// What a claim asks for.
#[derive(CustomResource, Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "tessera.io",
    version = "v1alpha1",
    kind = "ElasticGPUClaim",
    root = "ElasticGpuClaim",
    plural = "elasticgpuclaims",
    singular = "elasticgpuclaim",
    shortname = "egpuc",
    namespaced,
    doc = "A request for GPU (a share, whole cards or MIG slices), bound to an ElasticGPU when its first pod is placed.",
    status = "ElasticGpuClaimStatus",
    printcolumn = r#"{"name":"Status","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"ElasticGPU","type":"string","jsonPath":".status.elasticGPUName"}"#,
    printcolumn = r#"{"name":"Pod","type":"string","jsonPath":".status.pod"}"#,
    printcolumn = r#"{"name":"Class","type":"string","jsonPath":".spec.egpuClassName"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct ElasticGpuClaimSpec {
    /// The claim's ElasticGPUClass.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egpu_class_name: Option<String>,
    /// The same, as elastic-gpu's CRD spells it (either may be used, not both differently).
    #[serde(default, rename = "elasticGPUClassName", skip_serializing_if = "Option::is_none")]
    pub elastic_gpu_class_name: Option<String>,
    /// The GPU asked for, as a container's resources are written.
    pub resources: ClaimResources,
}

/// A claim's resources.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ClaimResources {
    /// Amounts asked for.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(schema_with = "crate::quantity_map")]
    pub requests: BTreeMap<String, Quantity>,
    /// Limits; where both are given they must be equal (GPU resources are not overcommitted).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(schema_with = "crate::quantity_map")]
    pub limits: BTreeMap<String, Quantity>,
}

/// The life of a claim, as a PersistentVolumeClaim's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ClaimPhase {
    /// Not bound to an ElasticGPU yet.
    #[default]
    Pending,
    /// Bound to the ElasticGPU in `elasticGPUName`.
    Bound,
    /// Its ElasticGPU is gone (deleted while bound).
    Lost,
}

/// Where a claim stands.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ElasticGpuClaimStatus {
    /// Pending, Bound or Lost.
    #[serde(default)]
    pub phase: ClaimPhase,
    /// The bound ElasticGPU.
    #[serde(default, rename = "elasticGPUName", skip_serializing_if = "Option::is_none")]
    pub elastic_gpu_name: Option<String>,
    /// The pod using it now (`namespace/name`), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
}

/// A claim Tessera cannot serve; each variant names the claim, the field and the value.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ClaimError {
    /// A resource Tessera does not know, or a bad amount.
    #[error("ElasticGPUClaim {claim}: spec.resources.{list}[{resource:?}]={value:?}: {reason}")]
    Resource {
        /// `namespace/name`.
        claim: String,
        /// `requests` or `limits`.
        list: &'static str,
        /// The resource name.
        resource: String,
        /// Its value.
        value: String,
        /// Why it is refused.
        reason: String,
    },
    /// The claim asks for no GPU.
    #[error("ElasticGPUClaim {claim}: spec.resources asks for no GPU")]
    NoGpu {
        /// `namespace/name`.
        claim: String,
    },
    /// The resources, as Tessera's, are not a valid request.
    #[error("ElasticGPUClaim {claim}: {source}")]
    Request {
        /// `namespace/name`.
        claim: String,
        /// Core's reason.
        source: Box<RequestError>,
    },
    /// No class, or two different ones.
    #[error("ElasticGPUClaim {claim}: {reason}")]
    Class {
        /// `namespace/name`.
        claim: String,
        /// What is wrong.
        reason: String,
    },
}

/// Which of Tessera's resources an elastic-gpu (or Tessera) resource name stands for, and the
/// amount in Tessera's terms; `Err` says why it is refused.
fn to_tessera(resource: &str, q: &Quantity) -> Result<(String, Quantity), String> {
    if is_tessera_resource(resource) {
        return Ok((resource.to_string(), q.clone()));
    }
    let Some((prefix, name)) = resource.split_once('/') else {
        return Err(
            "not a GPU resource (use tessera.io/gpu-core, tessera.io/gpu-memory or tessera.io/mig-<profile>)".into(),
        );
    };
    let elastic = ["elasticgpu.io", "elasticgpu.com"]
        .iter()
        .any(|d| prefix == *d || prefix.ends_with(&format!(".{d}")));
    match name {
        "gpu-core" | "qgpu-core" if elastic => Ok((RESOURCE_GPU_CORE.into(), q.clone())),
        "gpu-memory" | "qgpu-memory" if elastic => Ok((RESOURCE_GPU_MEMORY.into(), q.clone())),
        "gpu" if prefix == "nvidia.com" => {
            let cards = Amount::parse(&q.0)
                .ok()
                .and_then(|a| a.as_integer())
                .filter(|c| *c > 0)
                .ok_or_else(|| "must be a whole number of GPUs".to_string())?;
            let core = cards.checked_mul(100).ok_or_else(|| "is too large".to_string())?;
            Ok((RESOURCE_GPU_CORE.into(), Quantity(core.to_string())))
        }
        _ => Err("not a GPU resource Tessera knows (use tessera.io/gpu-core, tessera.io/gpu-memory, tessera.io/mig-<profile>, or elastic-gpu's <provisioner>.elasticgpu.io/gpu-core and gpu-memory)".into()),
    }
}

impl ElasticGpuClaim {
    /// `namespace/name`.
    pub fn key(&self) -> String {
        format!(
            "{}/{}",
            self.metadata.namespace.as_deref().unwrap_or_default(),
            self.metadata.name.as_deref().unwrap_or_default()
        )
    }

    /// The class named by `egpuClassName` or `elasticGPUClassName`.
    pub fn class_name(&self) -> Result<&str, ClaimError> {
        let err = |reason: String| ClaimError::Class {
            claim: self.key(),
            reason,
        };
        match (
            self.spec.egpu_class_name.as_deref(),
            self.spec.elastic_gpu_class_name.as_deref(),
        ) {
            (Some(a), Some(b)) if a != b => Err(err(format!(
                "spec.egpuClassName={a:?} and spec.elasticGPUClassName={b:?} name different classes"
            ))),
            (Some(a), _) | (None, Some(a)) if !a.is_empty() => Ok(a),
            _ => Err(err("spec.egpuClassName is required".into())),
        }
    }

    /// The container resources (`tessera.io/*`, limits and requests alike) the claim stands
    /// for, checked as a container's request would be.
    pub fn container_resources(&self, opts: &RequestOptions) -> Result<BTreeMap<String, Quantity>, ClaimError> {
        let mut lists = [BTreeMap::new(), BTreeMap::new()];
        for ((list, given), out) in [
            ("requests", &self.spec.resources.requests),
            ("limits", &self.spec.resources.limits),
        ]
        .into_iter()
        .zip(lists.iter_mut())
        {
            for (resource, q) in given {
                let refuse = |reason: String| ClaimError::Resource {
                    claim: self.key(),
                    list,
                    resource: resource.clone(),
                    value: q.0.clone(),
                    reason,
                };
                let (name, amount) = to_tessera(resource, q).map_err(refuse)?;
                if let Some(prev) = out.insert(name.clone(), amount.clone())
                    && prev != amount
                {
                    return Err(refuse(format!(
                        "stands for {name}, which another of its resources sets to {:?}",
                        prev.0
                    )));
                }
            }
        }
        let [requests, limits] = lists;
        // Core reads it as it would a container's (limits and requests must agree).
        let probe = Container {
            name: "claim".into(),
            resources: Some(ResourceRequirements {
                requests: Some(requests.clone()),
                limits: Some(limits.clone()),
                ..Default::default()
            }),
            ..Default::default()
        };
        let read = ContainerRequest::from_container(&probe, ContainerRole::App, opts).map_err(|source| {
            ClaimError::Request {
                claim: self.key(),
                source: Box::new(source),
            }
        })?;
        if !read.gpu.is_some() {
            return Err(ClaimError::NoGpu { claim: self.key() });
        }
        let mut merged = requests;
        merged.extend(limits);
        Ok(merged)
    }
}
