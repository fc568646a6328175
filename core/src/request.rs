//! What a pod asks of Tessera, parsed from a Kubernetes `Pod` into typed per-container requests.
//!
//! # Init containers
//! Kubernetes runs init containers one at a time, before the app containers, and restartable
//! init containers ("sidecars") keep running beside everything that starts after them. Its
//! effective request is therefore the maximum over the *phases* of the pod's life of what runs at
//! once. Tessera applies the same rule at card granularity: [`PodRequest::phases`] lists which
//! containers run together, CPU and memory follow Kubernetes exactly, and the placement engine
//! charges each card the maximum over phases of what the pod uses on it.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, Pod};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::enforcement::EnforcementRequirement;
use crate::mig::MigProfile;
use crate::names::{
    ANNOTATION_CORE_LIMIT, ANNOTATION_GPU_LINK, ANNOTATION_GPU_MODEL, ANNOTATION_GPU_POLICY, ANNOTATION_NODE_POLICY,
    ANNOTATION_SHARE_ENFORCEMENT, RESOURCE_GPU_CORE, RESOURCE_GPU_MEMORY, is_tessera_resource,
};
use crate::policy::PolicyKind;
use crate::quantity::{Amount, QuantityError};
use crate::topology::LinkRequirement;

/// The most GPUs or MIG devices of one profile a container may ask for: more than any node has
/// (16 cards of 7 MIG devices). Larger counts are refused as they are parsed, before placement
/// or a claim's bookkeeping would count to them.
pub const MAX_DEVICES_PER_CONTAINER: u32 = 128;

/// MiB in one GiB, the default `tessera.io/gpu-memory` unit.
pub const DEFAULT_MEMORY_UNIT_MIB: u64 = 1024;

/// Cluster settings that change how requests read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestOptions {
    /// MiB in one unit of `tessera.io/gpu-memory`.
    pub memory_unit_mib: u64,
}

impl Default for RequestOptions {
    fn default() -> Self {
        Self {
            memory_unit_mib: DEFAULT_MEMORY_UNIT_MIB,
        }
    }
}

/// A share of one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuShare {
    /// Guaranteed compute in percent (0 = memory only, no guaranteed compute).
    pub core_percent: u32,
    /// GPU memory in MiB; `None` = proportional to `core_percent` of the chosen card.
    pub memory_mib: Option<u64>,
}

impl GpuShare {
    /// The memory this share takes on a card with `card_memory_mib`.
    pub fn memory_on(&self, card_memory_mib: u64) -> u64 {
        self.memory_mib
            .unwrap_or_else(|| card_memory_mib * u64::from(self.core_percent) / 100)
    }
}

/// N MIG instances of one profile.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigDemand {
    /// The profile wanted.
    pub profile: MigProfile,
    /// How many instances.
    pub count: u32,
}

/// What one container asks of the GPUs.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum GpuDemand {
    /// No GPU.
    #[default]
    None,
    /// A share of one card.
    Share(GpuShare),
    /// Whole, exclusive cards.
    Whole {
        /// Number of cards.
        cards: u32,
        /// Each card must have at least this much memory (from `tessera.io/gpu-memory`).
        min_memory_mib: Option<u64>,
    },
    /// MIG instances, one entry per profile.
    Mig(Vec<MigDemand>),
}

impl GpuDemand {
    /// True unless [`GpuDemand::None`].
    pub fn is_some(&self) -> bool {
        !matches!(self, GpuDemand::None)
    }
}

/// When a container runs relative to the others.
#[derive(Debug, Clone, Copy, PartialEq, Hash, Eq, Serialize, Deserialize)]
pub enum ContainerRole {
    /// A regular init container: runs alone (beside earlier sidecars), then exits.
    Init,
    /// A restartable init container (`restartPolicy: Always`): runs from its start on.
    Sidecar,
    /// An app container.
    App,
}

/// One container's request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerRequest {
    /// The container's name.
    pub name: String,
    /// Init, sidecar or app.
    pub role: ContainerRole,
    /// CPU request in millicores.
    pub cpu_milli: u64,
    /// Memory request in bytes.
    pub memory_bytes: u64,
    /// GPU demand.
    pub gpu: GpuDemand,
    /// The user it runs as (`runAsUser` of the container, else of the pod), when the pod says.
    /// MPS serves one user per card at a time, so MPS nodes keep one user per shared card.
    #[serde(default)]
    pub run_as_user: Option<u32>,
}

/// A whole pod's request, with the pod-level options from its annotations.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PodRequest {
    /// Init containers first (in order), then app containers.
    pub containers: Vec<ContainerRequest>,
    /// Allowed GPU models; `None` = any.
    pub gpu_models: Option<Vec<String>>,
    /// Hard compute ceiling in percent for shares.
    pub core_limit: Option<u32>,
    /// Node-tier policy override.
    pub node_policy: Option<PolicyKind>,
    /// Card-tier policy override.
    pub gpu_policy: Option<PolicyKind>,
    /// The share enforcement the pod requires of its node.
    #[serde(skip)]
    pub share_enforcement: Option<EnforcementRequirement>,
    /// How well each container's whole cards must be connected.
    #[serde(skip)]
    pub gpu_link: Option<LinkRequirement>,
    /// Pod overhead CPU (RuntimeClass), millicores.
    pub overhead_cpu_milli: u64,
    /// Pod overhead memory, bytes.
    pub overhead_memory_bytes: u64,
}

/// An invalid request. Every variant names where the bad value is and the value itself.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RequestError {
    /// A quantity that does not parse.
    #[error("container {container:?}: {resource}={value:?} is not a valid quantity: {reason}")]
    Quantity {
        container: String,
        resource: String,
        value: String,
        reason: QuantityError,
    },
    /// A Tessera resource with a fractional amount.
    #[error("container {container:?}: {resource}={value:?} must be a whole number")]
    NotWhole {
        container: String,
        resource: String,
        value: String,
    },
    /// gpu-core outside 1..=100 and not a multiple of 100 (or more whole GPUs than
    /// [`MAX_DEVICES_PER_CONTAINER`]).
    #[error(
        "container {container:?}: {RESOURCE_GPU_CORE}={value} is invalid: use 1..=100 for a share of one GPU or a multiple of 100 for whole GPUs (at most {MAX_DEVICES_PER_CONTAINER} GPUs)"
    )]
    CoreOutOfRange { container: String, value: u64 },
    /// requests and limits disagree for a Tessera resource.
    #[error(
        "container {container:?}: {resource} request {request:?} differs from limit {limit:?}; extended resources need equal requests and limits"
    )]
    RequestLimitMismatch {
        container: String,
        resource: String,
        request: String,
        limit: String,
    },
    /// Two resources that cannot be combined in one container.
    #[error("container {container:?}: {resource}={value:?} cannot be combined with {other}")]
    Conflict {
        container: String,
        resource: String,
        value: String,
        other: String,
    },
    /// A `tessera.io/...` resource Tessera does not know.
    #[error("container {container:?}: unknown resource {resource}={value:?}")]
    UnknownResource {
        container: String,
        resource: String,
        value: String,
    },
    /// A `tessera.io/mig-...` resource with a malformed profile.
    #[error("container {container:?}: {resource}={value:?}: {reason}")]
    BadMigProfile {
        container: String,
        resource: String,
        value: String,
        reason: crate::mig::BadMigProfile,
    },
    /// An amount that overflows, or more devices than [`MAX_DEVICES_PER_CONTAINER`].
    #[error("container {container:?}: {resource}={value:?} is too large")]
    TooLarge {
        container: String,
        resource: String,
        value: String,
    },
    /// A bad pod annotation.
    #[error("annotation {annotation}={value:?} is invalid: {reason}")]
    Annotation {
        annotation: &'static str,
        value: String,
        reason: String,
    },
}

type Resources = BTreeMap<String, Quantity>;

/// Reads a resource from a container: limits win, requests fill in, disagreement is an error
/// for Tessera's (extended) resources.
fn read_amount(
    container: &str,
    name: &str,
    requests: Option<&Resources>,
    limits: Option<&Resources>,
    extended: bool,
) -> Result<Option<(Amount, String)>, RequestError> {
    let parse = |q: &Quantity| {
        Amount::parse(&q.0)
            .map(|a| (a, q.0.clone()))
            .map_err(|reason| RequestError::Quantity {
                container: container.to_string(),
                resource: name.to_string(),
                value: q.0.clone(),
                reason,
            })
    };
    let request = requests.and_then(|r| r.get(name)).map(parse).transpose()?;
    let limit = limits.and_then(|l| l.get(name)).map(parse).transpose()?;
    Ok(match (request, limit) {
        (Some(r), Some(l)) if extended && r.0 != l.0 => {
            return Err(RequestError::RequestLimitMismatch {
                container: container.to_string(),
                resource: name.to_string(),
                request: r.1,
                limit: l.1,
            });
        }
        // CPU and memory: the request is what the scheduler reserves.
        (Some(r), _) if !extended => Some(r),
        (r, l) => l.or(r),
    })
}

fn whole(container: &str, resource: &str, (amount, raw): (Amount, String)) -> Result<u64, RequestError> {
    amount.as_integer().ok_or_else(|| RequestError::NotWhole {
        container: container.to_string(),
        resource: resource.to_string(),
        value: raw,
    })
}

impl ContainerRequest {
    /// Parses one container's resources.
    pub fn from_container(c: &Container, role: ContainerRole, opts: &RequestOptions) -> Result<Self, RequestError> {
        let name = c.name.as_str();
        let res = c.resources.as_ref();
        let requests = res.and_then(|r| r.requests.as_ref());
        let limits = res.and_then(|r| r.limits.as_ref());
        let cpu_milli = read_amount(name, "cpu", requests, limits, false)?.map_or(0, |(a, _)| a.milli_ceil());
        let memory_bytes = read_amount(name, "memory", requests, limits, false)?.map_or(0, |(a, _)| a.ceil());

        let mut core: Option<(u64, String)> = None;
        let mut memory: Option<(u64, String)> = None;
        let mut mig: Vec<(MigDemand, String, String)> = Vec::new();
        let names: std::collections::BTreeSet<&String> = requests
            .into_iter()
            .flatten()
            .chain(limits.into_iter().flatten())
            .map(|(k, _)| k)
            .filter(|k| is_tessera_resource(k))
            .collect();
        for resource in names {
            let Some(read) = read_amount(name, resource, requests, limits, true)? else {
                continue;
            };
            let raw = read.1.clone();
            let value = whole(name, resource, read)?;
            if value == 0 {
                continue;
            }
            if resource == RESOURCE_GPU_CORE {
                core = Some((value, raw));
            } else if resource == RESOURCE_GPU_MEMORY {
                memory = Some((value, raw));
            } else if let Some(profile) = MigProfile::from_resource_name(resource) {
                let profile = profile.map_err(|reason| RequestError::BadMigProfile {
                    container: name.to_string(),
                    resource: resource.clone(),
                    value: raw.clone(),
                    reason,
                })?;
                // More than any node has: refused here, before anything counts to it.
                let count = u32::try_from(value)
                    .ok()
                    .filter(|c| *c <= MAX_DEVICES_PER_CONTAINER)
                    .ok_or_else(|| RequestError::TooLarge {
                        container: name.to_string(),
                        resource: resource.clone(),
                        value: raw.clone(),
                    })?;
                mig.push((MigDemand { profile, count }, resource.clone(), raw));
            } else {
                return Err(RequestError::UnknownResource {
                    container: name.to_string(),
                    resource: resource.clone(),
                    value: raw,
                });
            }
        }

        let memory_mib = match &memory {
            Some((units, raw)) => {
                Some(
                    units
                        .checked_mul(opts.memory_unit_mib)
                        .ok_or_else(|| RequestError::TooLarge {
                            container: name.to_string(),
                            resource: RESOURCE_GPU_MEMORY.to_string(),
                            value: raw.clone(),
                        })?,
                )
            }
            None => None,
        };
        let gpu = if let Some((_, resource, raw)) = mig.first() {
            if let Some((other, _)) = core
                .as_ref()
                .map(|c| (RESOURCE_GPU_CORE, c))
                .or(memory.as_ref().map(|m| (RESOURCE_GPU_MEMORY, m)))
            {
                return Err(RequestError::Conflict {
                    container: name.to_string(),
                    resource: resource.clone(),
                    value: raw.clone(),
                    other: other.to_string(),
                });
            }
            GpuDemand::Mig(mig.into_iter().map(|(d, _, _)| d).collect())
        } else {
            card_demand(name, core.map(|(value, _)| value), memory_mib)?
        };
        Ok(ContainerRequest {
            name: name.to_string(),
            role,
            cpu_milli,
            memory_bytes,
            gpu,
            run_as_user: c
                .security_context
                .as_ref()
                .and_then(|s| s.run_as_user)
                .and_then(|u| u32::try_from(u).ok()),
        })
    }
}

/// What a container's `tessera.io/gpu-core` (`core`, in percent of a card) and memory amount
/// ask for without MIG: a share, whole cards, or nothing.
fn card_demand(name: &str, core: Option<u64>, memory_mib: Option<u64>) -> Result<GpuDemand, RequestError> {
    Ok(match core {
        // 100 with no memory amount is what users write for "one GPU": a whole card.
        Some(100) if memory_mib.is_none() => GpuDemand::Whole {
            cards: 1,
            min_memory_mib: None,
        },
        Some(value) if value <= 100 => GpuDemand::Share(GpuShare {
            core_percent: value as u32,
            memory_mib,
        }),
        Some(value) if value % 100 == 0 => GpuDemand::Whole {
            cards: u32::try_from(value / 100)
                .ok()
                .filter(|c| *c <= MAX_DEVICES_PER_CONTAINER)
                .ok_or_else(|| RequestError::CoreOutOfRange {
                    container: name.to_string(),
                    value,
                })?,
            min_memory_mib: memory_mib,
        },
        Some(value) => {
            return Err(RequestError::CoreOutOfRange {
                container: name.to_string(),
                value,
            });
        }
        None => match memory_mib {
            Some(m) => GpuDemand::Share(GpuShare {
                core_percent: 0,
                memory_mib: Some(m),
            }),
            None => GpuDemand::None,
        },
    })
}

/// Whether Tessera has anything to do with `pod`: a container asks for a `tessera.io/`
/// resource, or the pod carries an allocation. (Cheap: no parsing.)
pub fn is_tessera_pod(pod: &Pod) -> bool {
    let asks = |c: &Container| {
        c.resources.as_ref().is_some_and(|r| {
            r.limits
                .iter()
                .chain(r.requests.iter())
                .flat_map(|m| m.keys())
                .any(|k| is_tessera_resource(k))
        })
    };
    pod.metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(crate::names::ANNOTATION_ALLOCATION))
        || pod
            .spec
            .as_ref()
            .is_some_and(|s| s.containers.iter().chain(s.init_containers.iter().flatten()).any(asks))
}

fn annotation_error(annotation: &'static str, value: &str, reason: impl Into<String>) -> RequestError {
    RequestError::Annotation {
        annotation,
        value: value.to_string(),
        reason: reason.into(),
    }
}

impl PodRequest {
    /// Parses a pod: every container's resources and the pod's Tessera annotations.
    pub fn from_pod(pod: &Pod, opts: &RequestOptions) -> Result<Self, RequestError> {
        let mut req = PodRequest::default();
        if let Some(spec) = &pod.spec {
            for c in spec.init_containers.iter().flatten() {
                let role = if c.restart_policy.as_deref() == Some("Always") {
                    ContainerRole::Sidecar
                } else {
                    ContainerRole::Init
                };
                req.containers.push(ContainerRequest::from_container(c, role, opts)?);
            }
            for c in &spec.containers {
                req.containers
                    .push(ContainerRequest::from_container(c, ContainerRole::App, opts)?);
            }
            let pod_user = spec
                .security_context
                .as_ref()
                .and_then(|s| s.run_as_user)
                .and_then(|u| u32::try_from(u).ok());
            for c in &mut req.containers {
                c.run_as_user = c.run_as_user.or(pod_user);
            }
            if let Some(overhead) = &spec.overhead {
                let read = |k: &str| overhead.get(k).and_then(|q| Amount::parse(&q.0).ok());
                req.overhead_cpu_milli = read("cpu").map_or(0, Amount::milli_ceil);
                req.overhead_memory_bytes = read("memory").map_or(0, Amount::ceil);
            }
        }
        let annotations = pod.metadata.annotations.as_ref();
        let get = |k: &str| annotations.and_then(|a| a.get(k)).map(String::as_str);
        if let Some(v) = get(ANNOTATION_GPU_MODEL) {
            let models: Vec<String> = v
                .split('|')
                .map(str::trim)
                .filter(|m| !m.is_empty())
                .map(str::to_string)
                .collect();
            if models.is_empty() {
                return Err(annotation_error(ANNOTATION_GPU_MODEL, v, "lists no GPU model"));
            }
            req.gpu_models = Some(models);
        }
        if let Some(v) = get(ANNOTATION_CORE_LIMIT) {
            let limit: u32 = v
                .trim()
                .parse()
                .ok()
                .filter(|l| (1..=100).contains(l))
                .ok_or_else(|| annotation_error(ANNOTATION_CORE_LIMIT, v, "must be a whole percent in 1..=100"))?;
            for c in &req.containers {
                if let GpuDemand::Share(s) = &c.gpu
                    && s.core_percent > limit
                {
                    return Err(annotation_error(
                        ANNOTATION_CORE_LIMIT,
                        v,
                        format!("below container {:?}'s {RESOURCE_GPU_CORE}={}", c.name, s.core_percent),
                    ));
                }
            }
            req.core_limit = Some(limit);
        }
        if let Some(v) = get(ANNOTATION_GPU_LINK) {
            req.gpu_link = Some(
                v.parse()
                    .map_err(|e: String| annotation_error(ANNOTATION_GPU_LINK, v, e))?,
            );
        }
        if let Some(v) = get(ANNOTATION_SHARE_ENFORCEMENT) {
            req.share_enforcement = Some(
                v.trim()
                    .parse()
                    .map_err(|e: String| annotation_error(ANNOTATION_SHARE_ENFORCEMENT, v, e))?,
            );
        }
        for (key, slot) in [
            (ANNOTATION_NODE_POLICY, &mut req.node_policy),
            (ANNOTATION_GPU_POLICY, &mut req.gpu_policy),
        ] {
            if let Some(v) = get(key) {
                *slot = Some(
                    v.parse()
                        .map_err(|e: crate::policy::UnknownPolicy| annotation_error(key, v, e.to_string()))?,
                );
            }
        }
        Ok(req)
    }

    /// True when any container asks for a GPU.
    pub fn wants_gpu(&self) -> bool {
        self.containers.iter().any(|c| c.gpu.is_some())
    }

    /// The sets of containers (indices into `containers`) that run at the same time: one per
    /// regular init container (with the sidecars started before it), then the app phase (all
    /// sidecars and app containers).
    pub fn phases(&self) -> Vec<Vec<usize>> {
        let mut phases = Vec::new();
        let mut sidecars = Vec::new();
        let mut app = Vec::new();
        for (i, c) in self.containers.iter().enumerate() {
            match c.role {
                ContainerRole::Init => {
                    let mut phase = sidecars.clone();
                    phase.push(i);
                    phases.push(phase);
                }
                ContainerRole::Sidecar => sidecars.push(i),
                ContainerRole::App => app.push(i),
            }
        }
        sidecars.extend(app);
        phases.push(sidecars);
        phases
    }

    fn effective(&self, per_container: impl Fn(&ContainerRequest) -> u64) -> u64 {
        self.phases()
            .iter()
            .map(|p| p.iter().map(|&i| per_container(&self.containers[i])).sum::<u64>())
            .max()
            .unwrap_or(0)
    }

    /// Kubernetes' effective CPU request (millicores), overhead included.
    pub fn effective_cpu_milli(&self) -> u64 {
        self.effective(|c| c.cpu_milli) + self.overhead_cpu_milli
    }

    /// Kubernetes' effective memory request (bytes), overhead included.
    pub fn effective_memory_bytes(&self) -> u64 {
        self.effective(|c| c.memory_bytes) + self.overhead_memory_bytes
    }
}

#[cfg(test)]
mod tests;
