//! How a pod names its claims: one annotation per container, `<prefix><container>: <claim>`,
//! with elastic-gpu's prefix (`egpuc.elasticgpu.io/`) or Tessera's (`claim.tessera.io/`). The
//! claim is in the pod's namespace.

use k8s_openapi::api::core::v1::Pod;
use thiserror::Error;

/// The path of the admission webhook that mutates pods naming claims (the extender serves it,
/// the install manifests' webhook configuration calls it).
pub const MUTATE_PODS_PATH: &str = "/mutate-pods";

/// elastic-gpu's claim annotation prefix.
pub const ELASTIC_GPU_CLAIM_PREFIX: &str = "egpuc.elasticgpu.io/";
/// Tessera's claim annotation prefix.
pub const TESSERA_CLAIM_PREFIX: &str = "claim.tessera.io/";

/// One container's claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimUse {
    /// The container (app or init).
    pub container: String,
    /// The claim's name (in the pod's namespace).
    pub claim: String,
    /// The annotation that says so.
    pub annotation: String,
}

/// Claim annotations that cannot be followed; each names the annotation and its value.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PodClaimError {
    /// The annotation names a container the pod does not have.
    #[error(
        "annotation {annotation}={claim:?} names container {container:?}, which the pod does not have (its containers: {containers})"
    )]
    UnknownContainer {
        /// The annotation key.
        annotation: String,
        /// Its value.
        claim: String,
        /// The container named.
        container: String,
        /// The pod's containers, comma-separated.
        containers: String,
    },
    /// Two annotations name claims for one container.
    #[error("annotations {first} and {second} both give container {container:?} a claim; a container uses one claim")]
    TwoClaims {
        /// The container.
        container: String,
        /// One annotation.
        first: String,
        /// The other.
        second: String,
    },
    /// One claim named for two containers.
    #[error("claim {claim:?} is named for containers {first:?} and {second:?}; a claim serves one container")]
    SharedClaim {
        /// The claim.
        claim: String,
        /// One container.
        first: String,
        /// The other.
        second: String,
    },
    /// The value is not a valid object name.
    #[error("annotation {annotation}={value:?}: {reason}")]
    BadName {
        /// The annotation key.
        annotation: String,
        /// Its value.
        value: String,
        /// Why.
        reason: &'static str,
    },
}

/// True when the pod has any claim annotation (cheap: no checks).
pub fn names_claims(pod: &Pod) -> bool {
    pod.metadata.annotations.as_ref().is_some_and(|a| {
        a.keys()
            .any(|k| k.starts_with(ELASTIC_GPU_CLAIM_PREFIX) || k.starts_with(TESSERA_CLAIM_PREFIX))
    })
}

fn valid_name(v: &str) -> Result<(), &'static str> {
    if v.is_empty() || v.len() > 253 {
        return Err("a claim name is 1 to 253 characters");
    }
    let ok = v
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.');
    let ends = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    if !ok || !ends(v.as_bytes()[0]) || !ends(v.as_bytes()[v.len() - 1]) {
        return Err(
            "a claim name is lower-case letters, digits, '-' and '.', starting and ending with a letter or digit",
        );
    }
    Ok(())
}

/// The pod's claims, one per container that names one, in annotation order.
pub fn claim_refs(pod: &Pod) -> Result<Vec<ClaimUse>, PodClaimError> {
    let Some(annotations) = pod.metadata.annotations.as_ref() else {
        return Ok(Vec::new());
    };
    let containers: Vec<&str> = pod
        .spec
        .iter()
        .flat_map(|s| s.init_containers.iter().flatten().chain(&s.containers))
        .map(|c| c.name.as_str())
        .collect();
    let mut uses: Vec<ClaimUse> = Vec::new();
    for (key, value) in annotations {
        let Some(container) = [ELASTIC_GPU_CLAIM_PREFIX, TESSERA_CLAIM_PREFIX]
            .iter()
            .find_map(|p| key.strip_prefix(p))
        else {
            continue;
        };
        let claim = value.trim();
        valid_name(claim).map_err(|reason| PodClaimError::BadName {
            annotation: key.clone(),
            value: value.clone(),
            reason,
        })?;
        if !containers.contains(&container) {
            return Err(PodClaimError::UnknownContainer {
                annotation: key.clone(),
                claim: claim.to_string(),
                container: container.to_string(),
                containers: containers.join(", "),
            });
        }
        for u in &uses {
            if u.container == container {
                // The same claim under both prefixes is one use, said twice.
                if u.claim == claim {
                    continue;
                }
                return Err(PodClaimError::TwoClaims {
                    container: container.to_string(),
                    first: u.annotation.clone(),
                    second: key.clone(),
                });
            }
            if u.claim == claim {
                return Err(PodClaimError::SharedClaim {
                    claim: claim.to_string(),
                    first: u.container.clone(),
                    second: container.to_string(),
                });
            }
        }
        if !uses.iter().any(|u| u.container == container) {
            uses.push(ClaimUse {
                container: container.to_string(),
                claim: claim.to_string(),
                annotation: key.clone(),
            });
        }
    }
    Ok(uses)
}
