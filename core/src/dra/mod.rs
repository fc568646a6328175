//! Dynamic Resource Allocation (Kubernetes 1.34+): what a node publishes, prepares and grants.
//!
//! A card is one device with consumable capacity (`cores` in percent, `memory`): the scheduler
//! hands out a whole card (a request that names no capacity consumes all of it) or shares of
//! it, each recorded in the claim's allocation as `consumedCapacity`. A carved MIG device is a
//! device of its own. Preparing a claim records what it was given on the node (a file only
//! root writes) and gives the container a CDI marker per request ([`marker`]); Tessera's NRI
//! plugin turns the record into devices and limits exactly as it does for a signed allocation,
//! so a DRA share is held by the same enforcement (MPS or the hook) as any other share.
//!
//! The parts, as NVIDIA's DRA driver splits its kubelet plugin: what is offered
//! ([`publish`]), what a claim gives when prepared (`prepare`), the markers the kubelet hands
//! containers ([`marker`]), the node's records ([`ClaimStore`]) and dynamic MIG's carving.

use thiserror::Error;

mod carve;
pub mod marker;
mod prepare;
mod publish;
mod store;

pub use carve::{
    Carve, CarveLedger, Carving, carvable, carve_of, counter_set, counter_set_name, foreign, placement_device_name,
};
pub use marker::{
    CLAIM_CDI_KIND, ClaimedDevices, Mark, claims_of, devices_for, is_request, is_uid, legacy_marker_env, marked_claims,
    marker_device, marker_devices, marker_env, marker_file, marker_spec, marker_token_matches, new_markers, new_token,
};
pub use prepare::{PreparedClaim, PreparedDevice, prepare, prepare_with};
pub use publish::{
    COUNTER_SETS_PER_SLICE, DEVICES_PER_SLICE, Published, UNHEALTHY_TAINT, device_health, device_name, publish,
    slice_devices, slice_name, slices, untainted,
};
pub use store::ClaimStore;

/// Writes a file whole (kept here for the DRA plugin's markers; see [`crate::files`]).
pub use crate::files::write_atomic;

/// The DRA driver name: DeviceClasses select `device.driver == "gpu.tessera.io"`.
pub const DRIVER: &str = "gpu.tessera.io";
/// Consumable capacity of a card: guaranteed compute, in percent of the card.
pub const CAPACITY_CORES: &str = "cores";
/// Consumable capacity of a card: memory.
pub const CAPACITY_MEMORY: &str = "memory";
/// Prefix of the environment variable a claim marker sets
/// (`TESSERA_DRA_CLAIM_<uid>_R_<request>`).
pub const MARKER_ENV_PREFIX: &str = "TESSERA_DRA_CLAIM_";
/// The kubelet's plugin registry directory (where the registration socket goes).
pub const REGISTRY_DIR: &str = "/var/lib/kubelet/plugins_registry";
/// The DRA plugin's own directory (its DRA socket), as the kubelet sees it.
pub const PLUGIN_DIR: &str = "/var/lib/kubelet/plugins/gpu.tessera.io";
/// Default directory of the node's prepared-claim records.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/tessera/dra";

/// Why a claim cannot be prepared, or a container cannot have it.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DraError {
    /// The claim has no allocation (the scheduler has not allocated it).
    #[error("claim {claim}: not allocated")]
    NotAllocated {
        /// `namespace/name`.
        claim: String,
    },
    /// The API server's claim is another object than the kubelet asked for.
    #[error("claim {claim}: the kubelet asked for uid {asked}, the API server has uid {found}")]
    Replaced {
        /// `namespace/name`.
        claim: String,
        /// The uid the kubelet named.
        asked: String,
        /// The uid found.
        found: String,
    },
    /// A result names a device this node does not have (or one not allocatable now).
    #[error("claim {claim}: device {device:?} of pool {pool:?} is not a device of node {node}")]
    UnknownDevice {
        /// `namespace/name`.
        claim: String,
        /// The pool named.
        pool: String,
        /// The device named.
        device: String,
        /// This node.
        node: String,
    },
    /// A consumed capacity that is no quantity, or not in the card's units.
    #[error("claim {claim}: device {device:?}: consumedCapacity {name}={value:?} is invalid: {reason}")]
    Capacity {
        /// `namespace/name`.
        claim: String,
        /// The device.
        device: String,
        /// The capacity's name.
        name: String,
        /// Its value.
        value: String,
        /// Why.
        reason: String,
    },
    /// A MIG instance the claim was allocated could not be created.
    #[error("claim {claim}: device {device:?}: cannot create its MIG instance: {reason}")]
    Carve {
        /// `namespace/name`.
        claim: String,
        /// The device.
        device: String,
        /// Why.
        reason: String,
    },
    /// The node's record of a claim cannot be read.
    #[error("claim {uid}: its record on this node cannot be read: {error}")]
    Unreadable {
        /// The claim's uid.
        uid: String,
        /// Why.
        error: String,
    },
    /// A container's marker for a claim does not carry the token the node gave the claim's
    /// marker (the container wrote it into its own environment).
    #[error(
        "claim {claim} ({uid}): the container's marker does not carry the claim's token; a container gets a claim only through the kubelet"
    )]
    WrongToken {
        /// `namespace/name`.
        claim: String,
        /// The claim's uid.
        uid: String,
    },
    /// A container would get a share and another device (two shares, or a share and a whole
    /// card): one container's limits are one share's.
    #[error(
        "claims {claims:?} give one container a share of a card and other devices ({devices}); a container may hold one share, alone"
    )]
    SeveralShares {
        /// The claims' `namespace/name`s.
        claims: Vec<String>,
        /// The devices, for people.
        devices: String,
    },
    /// A container names a claim that was not prepared on this node.
    #[error("claim {uid} is not prepared on this node")]
    NotPrepared {
        /// The claim's uid.
        uid: String,
    },
    /// A container's pod is not among the pods the claim is reserved for (it copied another
    /// pod's marker into its own environment).
    #[error(
        "claim {claim} ({uid}) is not reserved for this pod (status.reservedFor); a pod gets a claim only when it names it"
    )]
    NotReserved {
        /// `namespace/name`.
        claim: String,
        /// The claim's uid.
        uid: String,
    },
    /// Two results of a claim are shares of one card.
    #[error(
        "claim {claim}: two of its requests are shares of one card ({device}); a claim may hold one share of a card (ask one request with the sum, or two claims)"
    )]
    TwoSharesOfOneCard {
        /// `namespace/name`.
        claim: String,
        /// The device.
        device: String,
    },
    /// A result asks admin access to a device.
    #[error(
        "claim {claim}: device {device:?} is allocated with adminAccess, which gpu.tessera.io does not serve (it would put a container beside a card's users without their limits)"
    )]
    AdminAccess {
        /// `namespace/name`.
        claim: String,
        /// The device.
        device: String,
    },
    /// A container names a claim of another namespace (a pod can only use its own
    /// namespace's claims).
    #[error("claim {claim} ({uid}) is not a claim of namespace {namespace}")]
    OtherNamespace {
        /// `namespace/name`.
        claim: String,
        /// The claim's uid.
        uid: String,
        /// The pod's namespace.
        namespace: String,
    },
}

#[cfg(test)]
mod tests;
