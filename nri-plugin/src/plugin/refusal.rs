//! Why a container was refused at creation or start: the runtime shows the message.

use std::path::PathBuf;

use tessera_core::enforcement::MpsCeiling;
use tessera_core::injection::InjectionError;

use crate::cdi::ResolveError;

/// Why a share's card's MPS daemon does not hold its limits.
#[derive(Debug, thiserror::Error)]
#[error(
    "its share of {uuid} cannot be enforced: the card's MPS daemon did not take the share's limits \
     ({core}%, {memory_mib} MiB) within {ms} ms (it holds {held:?}; see tessera-mps-supervisor's log)"
)]
pub struct CeilingNotHeld {
    pub uuid: String,
    pub core: u32,
    pub memory_mib: u64,
    pub ms: u128,
    pub held: Option<MpsCeiling>,
}

/// Why a share's memory could not be held on its container's cgroup.
#[derive(Debug, thiserror::Error)]
pub enum MemoryNotHeld {
    /// The container's process is not under the host's /proc.
    #[error("its process is not found under the host's /proc")]
    NoProcess,
    /// Its cgroup could not be found.
    #[error("{0}")]
    Cgroup(#[from] tessera_node::memory_limits::CgroupError),
    /// The driver refused the limit, or could not read it back.
    #[error("{0}")]
    Driver(#[from] tessera_node::memory_limits::MemoryLimitError),
    /// The driver reads back another limit than the one set.
    #[error("the driver reads back {got} after it was set to {want} bytes")]
    ReadBack { got: String, want: u64 },
}

/// Why a container is refused.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// Its grant does not verify, or cannot be enforced on this node.
    #[error("{0}")]
    Decision(#[source] Box<InjectionError>),
    /// A thread panicked while it resolved CDI devices.
    #[error("CDI resolver poisoned")]
    CdiPoisoned,
    /// Its devices are not in the node's CDI specs.
    #[error("container {container:?}: cannot resolve {devices:?}: {source}")]
    Resolve {
        container: String,
        devices: Vec<String>,
        #[source]
        source: Box<ResolveError>,
    },
    /// A live container of another pod holds one of its devices in a way that excludes it.
    #[error("{0}")]
    DoubleGrant(String),
    /// Its grant could not be recorded (a grant that cannot be recorded is not made).
    #[error("container {container:?}: cannot record its grant under {dir}: {source}; refused")]
    Record {
        container: String,
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Its CUDA hook configuration could not be written.
    #[error("container {container:?}: cannot write its CUDA hook configuration under {dir}: {source}")]
    HookConfig {
        container: String,
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Its host-pid socket could not be served.
    #[error("container {container:?}: cannot serve its host-pid socket in {dir}: {source}")]
    PidSocket {
        container: String,
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Its card's MPS daemon does not hold its share's limits.
    #[error("container {container:?}: {source}")]
    Ceiling {
        container: String,
        #[source]
        source: Box<CeilingNotHeld>,
    },
    /// Not decided within the runtime's patience.
    #[error("container {container:?}: not decided within {ms} ms (the runtime's NRI timeout is 2 s); refused")]
    Late { container: String, ms: u128 },
    /// Its process runs as another user than its card's MPS daemon serves.
    #[error(
        "container {container:?} runs as uid {uid}, but its card {card}'s MPS daemon serves uid {other_uid} for {other}; \
         MPS serves one user per card, so it would wait, and hold the card's other shares up (set the same \
         runAsUser on the pods sharing a card)"
    )]
    OtherUser {
        container: String,
        uid: u32,
        card: String,
        other_uid: u32,
        other: String,
    },
    /// Its share's memory cannot be held on its cgroup.
    #[error(
        "container {container:?}: its {memory_mib} MiB of card {uuid} cannot be held on its cgroup: {source}; refused"
    )]
    Memory {
        container: String,
        memory_mib: u64,
        uuid: String,
        #[source]
        source: Box<MemoryNotHeld>,
    },
}

impl From<InjectionError> for Refusal {
    fn from(e: InjectionError) -> Self {
        Self::Decision(Box::new(e))
    }
}
