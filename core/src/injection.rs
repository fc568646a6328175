//! What a container gets at creation: the decision the NRI plugin applies, made from the
//! verified hand-off, the kubelet's Allocate annotations and the inventory. Deny by default.

use std::collections::BTreeMap;

use thiserror::Error;

use crate::dra::{ClaimStore, DraError, Mark, PreparedClaim};
use crate::enforcement::{ShareEnforcement, ShareLimits};
use crate::handoff::{AllocatedDevice, Allocation, HandoffError, VerifyingKeys};
use crate::names::{ANNOTATION_ALLOCATION, ANNOTATION_ALLOCATION_SIGNATURE, CDI_KIND};

/// Prefix of the device plugin's Allocate annotations (`tessera.io/allocated.gpu-core`).
pub const ALLOCATED_PREFIX: &str = "tessera.io/allocated.";
/// Container annotation recording what was injected.
pub const ANNOTATION_INJECTED: &str = "tessera.io/injected";
/// Environment variables that could expose GPUs through other mechanisms, and the value that
/// neutralises each in a container without an allocation. Values, not removals: containerd 1.7
/// and 2.x both keep a variable whose NRI removal (`-KEY`) was asked for. `void` makes an
/// nvidia runtime, if one is installed, add no device (and makes its
/// `NVIDIA_DRIVER_CAPABILITIES` moot); an empty `CUDA_VISIBLE_DEVICES` makes CUDA see none.
pub const GPU_EXPOSING_ENV: [(&str, &str); 2] = [("NVIDIA_VISIBLE_DEVICES", "void"), ("CUDA_VISIBLE_DEVICES", "")];

/// What to do with one container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Injection {
    /// No GPU: strip GPU device nodes and neutralise GPU env.
    Deny,
    /// Inject these CDI devices and set this env.
    Grant(Grant),
}

/// A container's GPUs.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Grant {
    /// Fully qualified CDI names (`tessera.io/gpu=GPU-...`).
    pub cdi_devices: Vec<String>,
    /// Environment to set.
    pub env: BTreeMap<String, String>,
    /// UUIDs injected (for the `tessera.io/injected` annotation).
    pub uuids: Vec<String>,
    /// For a container with a share: what holds it to its limits (`None` on nodes that run
    /// shares unenforced).
    pub enforced_by: Option<ShareEnforcement>,
    /// For a container with a share: its limits.
    pub share: Option<ShareLimits>,
    /// The container's devices, as the allocation gives them.
    pub devices: Vec<AllocatedDevice>,
    /// The DRA claims (uids) the devices come from, each with the UUIDs it gives (empty for a
    /// signed allocation).
    pub claims: BTreeMap<String, Vec<String>>,
}

/// Why a container that asked for Tessera resources must not be created.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum InjectionError {
    /// The hand-off is missing, forged, for another node or pod, or unreadable.
    #[error("container {container:?} asked for Tessera GPUs but the pod's allocation is refused: {source}")]
    Handoff {
        container: String,
        #[source]
        source: HandoffError,
    },
    /// The allocation does not name this container.
    #[error("container {container:?} asked for Tessera GPUs but the pod's allocation gives it none")]
    NotAllocated { container: String },
    /// The allocation gives GPUs to a container the kubelet allocated no Tessera resource to.
    #[error(
        "the pod's allocation gives container {container:?} GPUs, but the kubelet allocated it no Tessera resource"
    )]
    NotRequested { container: String },
    /// The node enforces shares but the card's enforcement is not running (fail closed).
    #[error("container {container:?}: its share of {uuid} cannot be enforced: {reason}; refusing the share")]
    Unenforceable {
        container: String,
        uuid: String,
        reason: String,
    },
    /// A container names DRA claims it cannot have.
    #[error("container {container:?}: {source}")]
    Claim {
        container: String,
        #[source]
        source: Box<DraError>,
    },
    /// A container names DRA claims and asks for Tessera's extended resources too.
    #[error(
        "container {container:?} names DRA claims and asks for Tessera's extended resources: ask through one or the other"
    )]
    ClaimsAndResources { container: String },
    /// Amounts differ between the kubelet and the hand-off.
    #[error("container {container:?}: the kubelet allocated {resource}={kubelet} but the allocation gives {handoff}")]
    Mismatch {
        container: String,
        resource: String,
        kubelet: String,
        handoff: String,
    },
}

/// Inputs about the node.
pub struct NodeContext<'a> {
    /// This node's name.
    pub node: &'a str,
    /// Verification keys.
    pub keys: &'a VerifyingKeys,
    /// How the node holds shares to their limits.
    pub enforcement: ShareEnforcement,
    /// Whether the enforcement of a card (by UUID) is up now; the error says why not.
    pub share_ready: &'a dyn Fn(&str) -> Result<(), String>,
}

fn kubelet_amounts(container_annotations: &BTreeMap<String, String>) -> BTreeMap<&str, &str> {
    container_annotations
        .iter()
        .filter_map(|(k, v)| k.strip_prefix(ALLOCATED_PREFIX).map(|s| (s, v.as_str())))
        .collect()
}

/// Decides what the container `container` of pod `pod_uid` gets.
pub fn decide(
    ctx: &NodeContext<'_>,
    pod_uid: &str,
    pod_annotations: &BTreeMap<String, String>,
    container: &str,
    container_annotations: &BTreeMap<String, String>,
) -> Result<Injection, InjectionError> {
    let asked = kubelet_amounts(container_annotations);
    let alloc = ctx.keys.verify(
        pod_annotations.get(ANNOTATION_ALLOCATION).map(String::as_str),
        pod_annotations.get(ANNOTATION_ALLOCATION_SIGNATURE).map(String::as_str),
        ctx.node,
        pod_uid,
    );
    let allocation: Allocation = match alloc {
        Ok(a) => a,
        Err(_) if asked.is_empty() => return Ok(Injection::Deny),
        Err(source) => {
            return Err(InjectionError::Handoff {
                container: container.into(),
                source,
            });
        }
    };
    let Some(mine) = allocation.container(container) else {
        return if asked.is_empty() {
            Ok(Injection::Deny)
        } else {
            Err(InjectionError::NotAllocated {
                container: container.into(),
            })
        };
    };
    if asked.is_empty() {
        return Err(InjectionError::NotRequested {
            container: container.into(),
        });
    }
    cross_check(container, &asked, &mine.devices)?;
    grant(ctx, container, &mine.devices, allocation.core_limit).map(Injection::Grant)
}

/// Decides what a container that names DRA claims gets (the markers the DRA plugin hands the
/// kubelet, found in its environment): the devices of the requests it was handed, from the
/// node's records, of claims of the pod's namespace reserved for the pod (`reserved`, see
/// [`crate::dra::devices_for`]), held as any share is. A container that also asks for
/// Tessera's extended resources is refused: one way to get GPUs per container.
pub fn decide_claims(
    ctx: &NodeContext<'_>,
    store: &ClaimStore,
    namespace: &str,
    container: &str,
    container_annotations: &BTreeMap<String, String>,
    marks: &[Mark],
    reserved: &dyn Fn(&PreparedClaim) -> bool,
) -> Result<Injection, InjectionError> {
    if !kubelet_amounts(container_annotations).is_empty() {
        return Err(InjectionError::ClaimsAndResources {
            container: container.into(),
        });
    }
    let claimed =
        crate::dra::devices_for(store, namespace, marks, reserved).map_err(|source| InjectionError::Claim {
            container: container.into(),
            source: Box::new(source),
        })?;
    let mut g = grant(ctx, container, &claimed.devices, None)?;
    g.claims = claimed.claims;
    Ok(Injection::Grant(g))
}

/// The share `devices` hold, with its compute limit raised to `core_limit` (the pod's
/// `tessera.io/core-limit`) when above the guarantee: what its enforcement holds it to.
pub fn share_limits(devices: &[AllocatedDevice], core_limit: Option<u32>) -> Option<ShareLimits> {
    devices.iter().find_map(|d| match d {
        AllocatedDevice::Gpu {
            uuid,
            core_percent,
            memory_mib,
            exclusive: false,
            ..
        } => Some(ShareLimits {
            uuid: uuid.clone(),
            core_limit: core_limit.unwrap_or(*core_percent).max(*core_percent),
            memory_mib: *memory_mib,
        }),
        _ => None,
    })
}

/// What a live container holds: its devices, its share's limits, and each DRA claim's UUIDs.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Regrant {
    /// The devices.
    pub devices: Vec<AllocatedDevice>,
    /// The share's limits, when it holds a share.
    pub share: Option<ShareLimits>,
    /// Each DRA claim it holds devices through, with their UUIDs.
    pub claims: BTreeMap<String, Vec<String>>,
}

/// What a live container was granted, from the same sources as at its creation and never from
/// its environment: its pod's verified allocation (`pod_annotations`), or the node's DRA
/// records for the markers `marks` it carries, of claims reserved for its pod (`reserved`, as
/// at creation). `None` when neither gives it devices. For a container found running after a
/// restart, whose grant record is gone.
pub fn regrant(
    ctx: &NodeContext<'_>,
    (store, reserved): (&ClaimStore, &dyn Fn(&PreparedClaim) -> bool),
    pod: (&str, &str),
    pod_annotations: &BTreeMap<String, String>,
    container: &str,
    marks: &[Mark],
) -> Option<Regrant> {
    let (pod_uid, namespace) = pod;
    if !marks.is_empty() {
        let claimed = crate::dra::devices_for(store, namespace, marks, reserved).ok()?;
        return Some(Regrant {
            share: share_limits(&claimed.devices, None),
            devices: claimed.devices,
            claims: claimed.claims,
        });
    }
    let allocation = ctx
        .keys
        .verify(
            pod_annotations.get(ANNOTATION_ALLOCATION).map(String::as_str),
            pod_annotations.get(ANNOTATION_ALLOCATION_SIGNATURE).map(String::as_str),
            ctx.node,
            pod_uid,
        )
        .ok()?;
    let devices = allocation.container(container)?.devices.clone();
    Some(Regrant {
        share: share_limits(&devices, allocation.core_limit),
        devices,
        claims: BTreeMap::new(),
    })
}

/// What `devices` give container `container`: CDI devices, the environment that names them,
/// and for a share its limits, refused when the node cannot hold them now. `core_limit`
/// raises a share's compute limit above its guarantee (the pod's `tessera.io/core-limit`).
fn grant(
    ctx: &NodeContext<'_>,
    container: &str,
    devices: &[AllocatedDevice],
    core_limit: Option<u32>,
) -> Result<Grant, InjectionError> {
    let mut grant = Grant::default();
    let mut visible = Vec::new();
    for d in devices {
        match d {
            AllocatedDevice::Gpu {
                uuid,
                core_percent,
                memory_mib,
                exclusive,
                ..
            } => {
                if *exclusive {
                    grant.cdi_devices.push(format!("{CDI_KIND}={uuid}"));
                } else {
                    grant.cdi_devices.push(format!("{CDI_KIND}=share-{uuid}"));
                    let limit = core_limit.unwrap_or(*core_percent).max(*core_percent);
                    grant.env.insert("TESSERA_GPU_CORE_LIMIT".into(), limit.to_string());
                    grant
                        .env
                        .insert("TESSERA_GPU_MEMORY_LIMIT_MIB".into(), memory_mib.to_string());
                    grant.share = Some(ShareLimits {
                        uuid: uuid.clone(),
                        core_limit: limit,
                        memory_mib: *memory_mib,
                    });
                    match ctx.enforcement {
                        ShareEnforcement::Hook => {
                            (ctx.share_ready)(uuid).map_err(|reason| InjectionError::Unenforceable {
                                container: container.into(),
                                uuid: uuid.clone(),
                                reason,
                            })?;
                            grant.enforced_by = Some(ShareEnforcement::Hook);
                        }
                        ShareEnforcement::Mps => {
                            (ctx.share_ready)(uuid).map_err(|reason| InjectionError::Unenforceable {
                                container: container.into(),
                                uuid: uuid.clone(),
                                reason,
                            })?;
                            // The card's daemon (the share device's CDI edits connect the
                            // container to it) holds each client process to these.
                            grant
                                .env
                                .insert("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".into(), limit.to_string());
                            grant.env.insert(
                                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT".into(),
                                format!("{uuid}={memory_mib}M"),
                            );
                            grant.enforced_by = Some(ShareEnforcement::Mps);
                        }
                        ShareEnforcement::None | ShareEnforcement::Unknown => {
                            grant.enforced_by = Some(ShareEnforcement::None);
                        }
                    }
                }
                visible.push(uuid.clone());
            }
            AllocatedDevice::Mig { uuid, .. } => {
                grant.cdi_devices.push(format!("{CDI_KIND}={uuid}"));
                visible.push(uuid.clone());
            }
        }
    }
    grant.env.insert("CUDA_VISIBLE_DEVICES".into(), visible.join(","));
    grant.env.insert("NVIDIA_VISIBLE_DEVICES".into(), "void".into());
    grant.uuids = visible;
    grant.devices = devices.to_vec();
    Ok(grant)
}

/// The `PATH` a container has when its image sets none (runc's and containerd's default).
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The environment a granted container ends with, from what its image and pod set
/// (`container_env`), the CDI edits' env and the grant's. The grant's wins over CDI's; the
/// driver's library directory is put before the image's own `LD_LIBRARY_PATH` (not in its
/// place); when the driver's programs are mounted at `driver_bin`, that directory is added to
/// the end of the image's `PATH`. Only the variables to set are returned.
pub fn final_env(
    container_env: &[String],
    cdi_env: &[String],
    grant_env: &BTreeMap<String, String>,
    driver_bin: Option<&str>,
) -> BTreeMap<String, String> {
    let own = |key: &str| {
        container_env
            .iter()
            .filter_map(|e| e.split_once('='))
            .filter(|(k, _)| *k == key)
            .map(|(_, v)| v)
            .next_back()
    };
    let mut env: BTreeMap<String, String> = cdi_env
        .iter()
        .filter_map(|e| e.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    env.extend(grant_env.clone());
    let join = |first: &str, then: &str| {
        let mut parts: Vec<&str> = first.split(':').filter(|p| !p.is_empty()).collect();
        for p in then.split(':').filter(|p| !p.is_empty()) {
            if !parts.contains(&p) {
                parts.push(p);
            }
        }
        parts.join(":")
    };
    if let (Some(ours), Some(theirs)) = (env.get("LD_LIBRARY_PATH").cloned(), own("LD_LIBRARY_PATH")) {
        env.insert("LD_LIBRARY_PATH".into(), join(&ours, theirs));
    }
    if let Some(bin) = driver_bin {
        env.insert("PATH".into(), join(own("PATH").unwrap_or(DEFAULT_PATH), bin));
    }
    env
}

/// The kubelet's amounts (from the device plugin's Allocate annotations) must match the
/// hand-off's: compute in percent, memory in MiB when memory was asked for, MIG counts per
/// profile (the kubelet's MIG IDs are accounting only; the extender picks the devices).
fn cross_check(
    container: &str,
    asked: &BTreeMap<&str, &str>,
    devices: &[AllocatedDevice],
) -> Result<(), InjectionError> {
    let mismatch = |resource: &str, kubelet: &str, handoff: String| InjectionError::Mismatch {
        container: container.into(),
        resource: format!("tessera.io/{resource}"),
        kubelet: kubelet.into(),
        handoff,
    };
    let core: u64 = devices
        .iter()
        .filter_map(|d| match d {
            AllocatedDevice::Gpu { core_percent, .. } => Some(u64::from(*core_percent)),
            AllocatedDevice::Mig { .. } => None,
        })
        .sum();
    let memory: u64 = devices
        .iter()
        .filter_map(|d| match d {
            AllocatedDevice::Gpu {
                memory_mib,
                exclusive: false,
                ..
            } => Some(*memory_mib),
            _ => None,
        })
        .sum();
    let mut mig: BTreeMap<String, u64> = BTreeMap::new();
    for d in devices {
        if let AllocatedDevice::Mig { profile, .. } = d {
            *mig.entry(format!(
                "mig-{}",
                profile.resource_name().trim_start_matches("tessera.io/mig-")
            ))
            .or_default() += 1;
        }
    }
    let asked_core = asked.get("gpu-core").copied().unwrap_or("0");
    if asked_core.parse::<u64>().ok() != Some(core) {
        return Err(mismatch("gpu-core", asked_core, core.to_string()));
    }
    if let Some(mib) = asked.get("gpu-memory-mib") {
        let has_share = devices
            .iter()
            .any(|d| matches!(d, AllocatedDevice::Gpu { exclusive: false, .. }));
        if has_share && mib.parse::<u64>().ok() != Some(memory) {
            return Err(mismatch("gpu-memory", &format!("{mib} MiB"), format!("{memory} MiB")));
        }
    }
    for (resource, count) in asked
        .iter()
        .filter(|(k, _)| k.starts_with("mig-") && !k.ends_with(".ids"))
    {
        let have = mig.get(*resource).copied().unwrap_or(0);
        if count.parse::<u64>().ok() != Some(have) {
            return Err(mismatch(resource, count, have.to_string()));
        }
    }
    for (resource, have) in &mig {
        if !asked.contains_key(resource.as_str()) {
            return Err(mismatch(resource, "0", have.to_string()));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
