//! Why a claim was not prepared or unprepared: the kubelet shows the message, the source stays.

use std::path::PathBuf;

use tessera_core::dra::DraError;
use tessera_core::inventory::MigError;

/// Why the cluster could not be read.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The API server did not answer for `what` (`claim ns/name`, `namespace ns`, `node n`).
    #[error("reading {what}: {source}")]
    Api {
        what: String,
        #[source]
        source: kube::Error,
    },
    /// `what` is not there.
    #[error("{what} not found")]
    NotFound { what: String },
}

/// Why a MIG instance could not be created for a claim.
#[derive(Debug, thiserror::Error)]
pub enum CarveError {
    /// The node has no partitioner.
    #[error("this node's DRA plugin creates no MIG instances (it has neither NVML nor a fixture file)")]
    NoPartitioner,
    /// The card is not in the node's inventory any more.
    #[error("the card is gone")]
    CardGone,
    /// An instance made since the allocation holds the placement's slices.
    #[error(
        "memory slices {start}..{end} of card {card} are taken by MIG instance {instance} (gi {gi}); the claim waits until it goes"
    )]
    SlicesTaken {
        start: u32,
        end: u32,
        card: String,
        instance: String,
        gi: u32,
    },
    /// The carving ledger could not note the instance before it was made.
    #[error("recording it before creating it: {0}")]
    Ledger(#[source] std::io::Error),
    /// The driver refused to make it.
    #[error("{0}")]
    Create(#[source] MigError),
}

/// Why claim was not prepared or unprepared.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    /// The kubelet asked to prepare a uid that is none.
    #[error("claim {key}: uid {uid:?} is not a uid")]
    BadUid { key: String, uid: String },
    /// The kubelet asked to unprepare a uid that is none.
    #[error("claim uid {0:?} is not a uid")]
    BadUnprepareUid(String),
    /// The claim's record exists but cannot be read.
    #[error("claim {key}: its record cannot be read: {source}")]
    RecordUnreadable {
        key: String,
        #[source]
        source: std::io::Error,
    },
    /// The node's cards could not be read.
    #[error("claim {key}: the node's GPUs are unreadable: {source}")]
    CardsUnreadable {
        key: String,
        #[source]
        source: tessera_core::inventory::InventoryError,
    },
    /// The node's inventory has not been read since the plugin started.
    #[error("claim {key}: the node's GPUs are not read yet")]
    NoCards { key: String },
    /// The claim, its namespace or the node could not be read.
    #[error("{0}")]
    Source(#[from] SourceError),
    /// The claim's allocation cannot be prepared here.
    #[error("{0}")]
    Plan(#[from] DraError),
    /// A MIG instance another claim of this node holds is where the allocation points; it goes
    /// when the kubelet unprepares `holder` (a pod just deleted, whose claim the scheduler has
    /// already given away).
    #[error("{message}")]
    HeldByClaim { holder: String, message: String },
    /// A device it would get is in use in a way that excludes it (core's reason).
    #[error("{0}")]
    CardInUse(String),
    /// Its marker (a CDI spec) could not be encoded.
    #[error("encoding its marker: {0}")]
    MarkerEncode(#[source] serde_json::Error),
    /// Its marker could not be written.
    #[error("writing {path}: {source}")]
    Marker {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Its record could not be written.
    #[error("claim {key}: recording it under {dir}: {source}")]
    Record {
        key: String,
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A MIG instance its record holds is gone from its card and could not be made again.
    #[error("claim {key}: its MIG instance {uuid} is gone from card {card} and cannot be made again: {source}")]
    Remake {
        key: String,
        uuid: String,
        card: String,
        #[source]
        source: Box<CarveError>,
    },
    /// Its record could not be rewritten with a MIG instance made again.
    #[error("claim {key}: recording its new MIG instance: {source}")]
    RecordRemade {
        key: String,
        #[source]
        source: std::io::Error,
    },
    /// Unprepare: the record cannot be read, so the instances it names are kept.
    #[error("claim {uid}: its record cannot be read, so its MIG instances are kept: {source}")]
    KeepInstances {
        uid: String,
        #[source]
        source: std::io::Error,
    },
    /// Unprepare: an instance to destroy on a node that makes none.
    #[error("claim {uid}: cannot destroy MIG instance {uuid}: this node creates none")]
    NoPartitioner { uid: String, uuid: String },
    /// Unprepare: the driver did not destroy an instance.
    #[error("claim {uid}: destroying MIG instance {uuid}: {source}")]
    Destroy {
        uid: String,
        uuid: String,
        #[source]
        source: MigError,
    },
    /// Unprepare: its marker could not be removed.
    #[error("removing {path}: {source}")]
    RemoveMarker {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Unprepare: its record could not be removed.
    #[error("removing claim {uid}'s record: {source}")]
    RemoveRecord {
        uid: String,
        #[source]
        source: std::io::Error,
    },
}
