//! How a node holds GPU shares to their compute and memory: the node's mode, where its MPS
//! daemons live, and whether a card's daemon is up. One model for the MPS supervisor (which
//! writes the state), the CDI generator (which mounts the daemon into share containers), the
//! NRI plugin (which refuses a share whose daemon is down) and the extender (which can keep a
//! pod off nodes that do not enforce).

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::windows::{CardWindow, PERIOD_MS, Window};

/// Where the MPS supervisor keeps each card's pipe, log and shm directories (a host path on a
/// tmpfs).
pub const DEFAULT_MPS_ROOT: &str = "/run/tessera/mps";
/// A daemon state older than this is not trusted (the supervisor re-checks every few seconds).
pub const STATE_MAX_AGE: Duration = Duration::from_secs(30);
/// Container annotation set by the NRI plugin: what holds a share container to its limits
/// (`mps`, or `none` on nodes that run shares unenforced).
pub const ANNOTATION_ENFORCED_BY: &str = "tessera.io/enforced-by";

/// A node's setting for shares (whole cards and MIG devices are never shared).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ShareEnforcement {
    /// Not published (nodes from before enforcement): treated as `none`.
    #[default]
    Unknown,
    /// Shares run unenforced: the limits are labels; containers are annotated so.
    None,
    /// One MPS control daemon per card, run by Tessera: compute by active-thread percentage,
    /// memory by the pinned device memory limit. A share whose daemon is down is refused.
    Mps,
    /// Tessera's CUDA driver hook preloaded into share containers: memory past the share fails,
    /// launches run in the container's window of the card's time, its compute share. Refused
    /// when the library is not installed.
    Hook,
}

impl ShareEnforcement {
    /// Whether share containers get Tessera's CUDA hook preloaded: in hook mode it holds them
    /// to their whole share; on MPS nodes to their memory, all their processes together (MPS
    /// limits each process alone).
    pub fn preloads_hook(self) -> bool {
        matches!(self, Self::Hook | Self::Mps)
    }

    /// Whether this mode holds shares to their limits.
    pub fn enforces(self) -> bool {
        matches!(self, ShareEnforcement::Mps | ShareEnforcement::Hook)
    }
}

impl fmt::Display for ShareEnforcement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ShareEnforcement::Unknown => "unknown",
            ShareEnforcement::None => "none",
            ShareEnforcement::Mps => "mps",
            ShareEnforcement::Hook => "hook",
        })
    }
}

impl FromStr for ShareEnforcement {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "none" => Ok(ShareEnforcement::None),
            "mps" => Ok(ShareEnforcement::Mps),
            "hook" => Ok(ShareEnforcement::Hook),
            other => Err(format!("share enforcement {other:?}: expected mps, hook or none")),
        }
    }
}

/// What a pod asks of a node's enforcement ([`crate::names::ANNOTATION_SHARE_ENFORCEMENT`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EnforcementRequirement {
    /// Any mode that enforces (`required`).
    Any,
    /// Exactly this mode (`mps`).
    Mode(ShareEnforcement),
}

impl FromStr for EnforcementRequirement {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "required" => Ok(EnforcementRequirement::Any),
            "mps" => Ok(EnforcementRequirement::Mode(ShareEnforcement::Mps)),
            "hook" => Ok(EnforcementRequirement::Mode(ShareEnforcement::Hook)),
            other => Err(format!("{other:?}: expected required, mps or hook")),
        }
    }
}

impl EnforcementRequirement {
    /// Whether a node in `mode` satisfies this; the error is the filter's reason.
    pub fn check(self, mode: ShareEnforcement) -> Result<(), String> {
        let ok = match self {
            EnforcementRequirement::Any => mode.enforces(),
            EnforcementRequirement::Mode(m) => mode == m,
        };
        if ok {
            Ok(())
        } else {
            let want = match self {
                EnforcementRequirement::Any => "enforced shares".to_string(),
                EnforcementRequirement::Mode(m) => format!("share enforcement {m}"),
            };
            Err(format!(
                "the pod requires {want}; this node's share enforcement is {mode}"
            ))
        }
    }
}

/// Where a share container finds its card's MPS daemon: NVIDIA's default pipe directory, so a
/// client that unsets `CUDA_MPS_PIPE_DIRECTORY` still reaches the daemon (and its ceiling).
pub const MPS_PIPE_IN_CONTAINER: &str = "/tmp/nvidia-mps";

/// The MPS directories of each card, under one root. Paths are the same on the host and in the
/// supervisor; share containers get only the card's client directory (at
/// [`MPS_PIPE_IN_CONTAINER`]) and its shm directory (at `/dev/shm`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsLayout {
    /// The root (`/run/tessera/mps`).
    pub root: PathBuf,
}

impl Default for MpsLayout {
    fn default() -> Self {
        Self {
            root: DEFAULT_MPS_ROOT.into(),
        }
    }
}

impl MpsLayout {
    /// A layout under `root`.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// A card's directory.
    pub fn card_dir(&self, uuid: &str) -> PathBuf {
        self.root.join(uuid)
    }

    /// `CUDA_MPS_PIPE_DIRECTORY` of the card's daemon (its sockets, lock and log FIFO), which
    /// no share container sees.
    pub fn pipe_dir(&self, uuid: &str) -> PathBuf {
        self.card_dir(uuid).join("pipe")
    }

    /// What share containers get of the pipe directory, read-only: a link to the daemon's
    /// `control` socket, made by the supervisor once the daemon holds its ceiling, and nothing
    /// else (no `control_privileged`, through which root may `quit` the daemon; no
    /// `control_lock`, whose holder keeps a restarting daemon down; no log FIFO).
    pub fn client_dir(&self, uuid: &str) -> PathBuf {
        self.card_dir(uuid).join("client")
    }

    /// `CUDA_MPS_LOG_DIRECTORY` (control.log, server.log).
    pub fn log_dir(&self, uuid: &str) -> PathBuf {
        self.card_dir(uuid).join("log")
    }

    /// The directory the daemon and its clients see as `/dev/shm` (a size-limited tmpfs the
    /// supervisor mounts).
    pub fn shm_dir(&self, uuid: &str) -> PathBuf {
        self.card_dir(uuid).join("shm")
    }

    /// The supervisor's record of the daemon.
    pub fn state_file(&self, uuid: &str) -> PathBuf {
        self.card_dir(uuid).join("state.json")
    }

    /// The cards with a directory here (UUIDs).
    pub fn cards(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(&self.root)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.path().is_dir())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    /// The ceiling the card's daemon should hold its clients to (written by the NRI plugin,
    /// applied by the supervisor).
    pub fn ceiling_file(&self, uuid: &str) -> PathBuf {
        self.card_dir(uuid).join("ceiling.json")
    }

    /// Reads a card's wanted ceiling; `None` when none is written (no share placed yet).
    pub fn read_ceiling(&self, uuid: &str) -> Result<Option<MpsCeiling>, String> {
        let path = self.ceiling_file(uuid);
        match std::fs::read_to_string(&path) {
            Ok(text) => serde_json::from_str(&text)
                .map(Some)
                .map_err(|e| format!("{}: {e}", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(format!("{}: {e}", path.display())),
        }
    }

    /// Writes a card's wanted ceiling atomically.
    pub fn write_ceiling(&self, uuid: &str, ceiling: &MpsCeiling) -> std::io::Result<()> {
        let text = serde_json::to_vec(ceiling).expect("ceiling serializes");
        crate::files::write_atomic(&self.card_dir(uuid), &self.ceiling_file(uuid), &text, 0o755, 0o644)
    }

    /// Reads a card's daemon state.
    pub fn read_state(&self, uuid: &str) -> Result<MpsState, String> {
        let path = self.state_file(uuid);
        let text = std::fs::read_to_string(&path)
            .map_err(|e| format!("no MPS daemon state for {uuid} ({}: {e})", path.display()))?;
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Writes a card's daemon state atomically.
    pub fn write_state(&self, uuid: &str, state: &MpsState) -> std::io::Result<()> {
        let text = serde_json::to_vec(state).expect("state serializes");
        crate::files::write_atomic(&self.card_dir(uuid), &self.state_file(uuid), &text, 0o755, 0o644)
    }

    /// Whether the card's daemon can take a share now: ready, and checked within
    /// [`STATE_MAX_AGE`] (a dead supervisor leaves a stale state). The error says why not.
    pub fn ready(&self, uuid: &str, now: SystemTime) -> Result<(), String> {
        let s = self.read_state(uuid)?;
        let age = now
            .duration_since(UNIX_EPOCH + Duration::from_secs(s.checked_at))
            .unwrap_or_default();
        if age > STATE_MAX_AGE {
            return Err(format!(
                "the MPS daemon of {uuid} was last checked {}s ago (is tessera-mps-supervisor running?)",
                age.as_secs()
            ));
        }
        match s.phase {
            DaemonPhase::Ready => Ok(()),
            other => Err(format!(
                "the MPS daemon of {uuid} is {other}{}",
                s.reason.map(|r| format!(": {r}")).unwrap_or_default()
            )),
        }
    }
}

/// Where hook mode keeps its files on the host (a tmpfs), and where containers see them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HookLayout {
    /// The root (`/run/tessera/hook`).
    pub root: PathBuf,
}

/// Where Tessera's hook mode files live on the host by default.
pub const DEFAULT_HOOK_ROOT: &str = "/run/tessera/hook";
/// The hook library's path inside share containers.
pub const HOOK_LIBRARY_IN_CONTAINER: &str = "/usr/local/tessera/lib/libtessera-cuda-hook.so";
/// The container's hook configuration (read-only), where the library looks for it.
pub const HOOK_CONFIG_IN_CONTAINER: &str = "/run/tessera/hook/config";
/// The container's shared accounting directory (a tmpfs of its own, writable by every user).
pub const HOOK_STATE_IN_CONTAINER: &str = "/run/tessera/hook/state";
/// The container's own agent directory (read-only): the socket through which the node agent
/// tells each of the container's processes its host pid (NVML names processes by host pid).
pub const HOOK_AGENT_IN_CONTAINER: &str = "/run/tessera/hook/agent";
/// The host-pid socket's name in the agent directory.
pub const HOOK_PID_SOCKET: &str = "pid.sock";
/// The hook's memory accounting file in a container's state directory.
pub const HOOK_ACCOUNTING_FILE: &str = "memory";

impl Default for HookLayout {
    fn default() -> Self {
        Self {
            root: DEFAULT_HOOK_ROOT.into(),
        }
    }
}

impl HookLayout {
    /// A layout under `root`.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// The installed library.
    pub fn library(&self) -> PathBuf {
        self.root.join("lib/libtessera-cuda-hook.so")
    }

    /// The `ld.so.preload` file mounted over containers' `/etc/ld.so.preload`.
    pub fn preload(&self) -> PathBuf {
        self.root.join("lib/ld.so.preload")
    }

    /// A container's directory.
    pub fn container_dir(&self, container_id: &str) -> PathBuf {
        self.root.join("containers").join(container_id)
    }

    /// A container's agent directory (its host-pid socket), mounted read-only into it alone.
    pub fn agent_dir(&self, container_id: &str) -> PathBuf {
        self.container_dir(container_id).join("agent")
    }

    /// Whether the library is installed; the error says what is missing.
    pub fn ready(&self) -> Result<(), String> {
        for p in [self.library(), self.preload()] {
            if !p.is_file() {
                return Err(format!(
                    "the CUDA hook is not installed ({} is missing: is tessera-cdi-generator running in hook or mps mode?)",
                    p.display()
                ));
            }
        }
        Ok(())
    }

    /// Installs `library` (the node agent's own copy) and the preload file naming it, replacing
    /// them atomically when they differ; returns whether anything changed.
    pub fn install(&self, library: &std::path::Path) -> std::io::Result<bool> {
        let lib_dir = self.root.join("lib");
        std::fs::create_dir_all(&lib_dir)?;
        let mut changed = false;
        let new = std::fs::read(library)?;
        if std::fs::read(self.library()).ok().as_deref() != Some(new.as_slice()) {
            let tmp = lib_dir.join(".libtessera-cuda-hook.so.tmp");
            std::fs::write(&tmp, &new)?;
            std::fs::rename(&tmp, self.library())?;
            changed = true;
        }
        let preload = format!("{HOOK_LIBRARY_IN_CONTAINER}\n");
        if std::fs::read_to_string(self.preload()).ok().as_deref() != Some(preload.as_str()) {
            let tmp = lib_dir.join(".ld.so.preload.tmp");
            std::fs::write(&tmp, preload)?;
            std::fs::rename(&tmp, self.preload())?;
            changed = true;
        }
        Ok(changed)
    }

    /// The window of the card's time container `container_id`'s configuration gives it, if any
    /// (how a restarted plugin without the container's grant record keeps it).
    pub fn window_of(&self, container_id: &str) -> Option<CardWindow> {
        let text = std::fs::read_to_string(self.container_dir(container_id).join("config")).ok()?;
        let value = |key: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
                .map(str::trim)
        };
        Some(CardWindow {
            uuid: value("uuid")?.to_string(),
            percent: value("core_limit")?.parse().ok()?,
            window: Window::parse(value("window")?).ok()?,
        })
    }

    /// Removes the directories of containers not in `live` (after a plugin restart).
    pub fn forget_except(&self, live: &std::collections::HashSet<String>) {
        let Ok(rd) = std::fs::read_dir(self.root.join("containers")) else {
            return;
        };
        for e in rd.flatten() {
            if !live.contains(e.file_name().to_string_lossy().as_ref()) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }

    /// Writes a container's configuration (what the library enforces) and creates its agent
    /// directory; returns their host paths. Nothing is shared with another container. The
    /// accounting its processes share is no host file: the container gets a small tmpfs of its
    /// own at [`HOOK_STATE_IN_CONTAINER`] ([`HOOK_STATE_TMPFS_KIB`]), which a tenant can fill
    /// without touching the host's `/run`.
    ///
    /// How the compute share is held depends on the node's `mode`: on `hook` nodes the
    /// container's processes launch only in its `window` of the card's time
    /// (`compute=windows`, [`crate::windows`]), or, given none, are throttled to the share by
    /// their measured utilization (`compute=throttle`); on `mps` nodes, where MPS caps each
    /// process's SMs and NVML cannot measure MPS clients, the container's processes take turns
    /// on the card (`compute=turns`).
    pub fn prepare(
        &self,
        container_id: &str,
        limits: &ShareLimits,
        mode: ShareEnforcement,
        window: Option<&Window>,
    ) -> std::io::Result<HookFiles> {
        let dir = self.container_dir(container_id);
        let agent = self.agent_dir(container_id);
        std::fs::create_dir_all(&agent)?;
        let config = dir.join("config");
        let compute = match (mode, window.filter(|w| !w.is_empty())) {
            (ShareEnforcement::Mps, _) => "turns".to_string(),
            (_, Some(w)) => format!("windows\nwindow={w}\nperiod_ms={PERIOD_MS}"),
            _ => "throttle".to_string(),
        };
        let text = format!(
            "# written by tessera-nri-plugin for this container\nuuid={}\nmemory_limit_mib={}\ncore_limit={}\ncompute={compute}\nstate_dir={HOOK_STATE_IN_CONTAINER}\npid_socket={HOOK_AGENT_IN_CONTAINER}/{HOOK_PID_SOCKET}\n",
            limits.uuid, limits.memory_mib, limits.core_limit
        );
        crate::files::write_atomic(&dir, &config, text.as_bytes(), 0o755, 0o644)?;
        Ok(HookFiles { config, agent })
    }
}

/// The host files of one hooked container, each mounted at its `HOOK_*_IN_CONTAINER` path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HookFiles {
    /// The configuration (read-only).
    pub config: PathBuf,
    /// The container's agent directory (read-only; the node agent serves its socket).
    pub agent: PathBuf,
}

/// Size of a hooked container's accounting tmpfs: the accounting file is 4 KiB.
pub const HOOK_STATE_TMPFS_KIB: u64 = 256;

/// What a share container is held to.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ShareLimits {
    /// The card.
    pub uuid: String,
    /// Compute ceiling in percent (the share, or `tessera.io/core-limit` above it).
    pub core_limit: u32,
    /// Memory, MiB.
    pub memory_mib: u64,
}

/// The most a card's MPS daemon lets any of its clients have: the largest compute limit and the
/// largest memory of the shares placed on the card. Set on the daemon (for the servers it will
/// start and those running), it bounds a client that drops its own `CUDA_MPS_*` variables, which
/// NVIDIA's MPS lets only *lower* the daemon's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MpsCeiling {
    /// Active thread percentage, 1..=100.
    pub active_thread_percentage: u32,
    /// Pinned device memory per client, MiB (at least 1: MPS reads 0 as "no limit").
    pub pinned_memory_mib: u64,
}

impl MpsCeiling {
    /// What a card with no share gets: the least MPS accepts (no client should connect).
    pub const CLOSED: MpsCeiling = MpsCeiling {
        active_thread_percentage: 1,
        pinned_memory_mib: 1,
    };

    /// The ceiling that lets each of `shares` have its limits, and no more; [`Self::CLOSED`]
    /// when there are none.
    pub fn of<'a>(shares: impl IntoIterator<Item = &'a ShareLimits>) -> Self {
        shares.into_iter().fold(Self::CLOSED, |c, s| MpsCeiling {
            active_thread_percentage: c.active_thread_percentage.max(s.core_limit.clamp(1, 100)),
            pinned_memory_mib: c.pinned_memory_mib.max(s.memory_mib.max(1)),
        })
    }

    /// Whether a share with `limits` gets all of them under this ceiling.
    pub fn covers(&self, limits: &ShareLimits) -> bool {
        self.active_thread_percentage >= limits.core_limit.min(100) && self.pinned_memory_mib >= limits.memory_mib
    }
}

/// Where a card's daemon is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DaemonPhase {
    /// Started, not answering yet.
    Starting,
    /// Answering control commands.
    Ready,
    /// Died; restarting after a backoff.
    Restarting,
    /// Stopped by the supervisor.
    Stopped,
}

impl fmt::Display for DaemonPhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DaemonPhase::Starting => "starting",
            DaemonPhase::Ready => "ready",
            DaemonPhase::Restarting => "restarting",
            DaemonPhase::Stopped => "stopped",
        })
    }
}

/// The supervisor's record of one card's daemon (`state.json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MpsState {
    /// Phase.
    pub phase: DaemonPhase,
    /// The control daemon's pid, while it runs.
    pub pid: Option<u32>,
    /// Restarts since the supervisor started.
    pub restarts: u32,
    /// When the daemon last started (Unix seconds).
    pub started_at: u64,
    /// When the supervisor last checked it (Unix seconds).
    pub checked_at: u64,
    /// Why it is not ready, when it is not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The ceiling the daemon was last seen holding (set and read back).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ceiling: Option<MpsCeiling>,
    /// Whether the card was in exclusive-process compute mode when its daemon started, as
    /// `nvidia-smi` read it back (`None`: not known). In any other mode a CUDA process that goes
    /// around MPS (its `CUDA_MPS_PIPE_DIRECTORY` pointed elsewhere) gets the whole card.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exclusive_process: Option<bool>,
}

/// Unix seconds of `t`.
pub fn unix_secs(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ceiling_is_the_largest_share_and_closed_without_one() {
        let share = |core_limit, memory_mib| ShareLimits {
            uuid: "GPU-1".into(),
            core_limit,
            memory_mib,
        };
        assert_eq!(MpsCeiling::of([]), MpsCeiling::CLOSED);
        let (a, b) = (share(30, 8192), share(50, 4096));
        let c = MpsCeiling::of([&a, &b]);
        assert_eq!((c.active_thread_percentage, c.pinned_memory_mib), (50, 8192));
        assert!(c.covers(&a) && c.covers(&b));
        assert!(!MpsCeiling::of([&a]).covers(&b));
        let d = tempfile::tempdir().unwrap();
        let l = MpsLayout::new(d.path());
        assert_eq!(l.read_ceiling("GPU-1"), Ok(None));
        l.write_ceiling("GPU-1", &c).unwrap();
        assert_eq!(l.read_ceiling("GPU-1"), Ok(Some(c)));
    }

    #[test]
    fn readiness_needs_a_fresh_ready_state() {
        let d = tempfile::tempdir().unwrap();
        let l = MpsLayout::new(d.path());
        let uuid = "GPU-1";
        let now = SystemTime::now();
        assert!(
            l.ready(uuid, now)
                .unwrap_err()
                .contains("no MPS daemon state for GPU-1")
        );
        std::fs::create_dir_all(l.card_dir(uuid)).unwrap();
        let mut s = MpsState {
            phase: DaemonPhase::Ready,
            pid: Some(42),
            restarts: 0,
            started_at: unix_secs(now),
            checked_at: unix_secs(now),
            reason: None,
            ceiling: None,
            exclusive_process: None,
        };
        l.write_state(uuid, &s).unwrap();
        l.ready(uuid, now).unwrap();
        // Stale: the supervisor stopped checking.
        let later = now + STATE_MAX_AGE + Duration::from_secs(5);
        assert!(l.ready(uuid, later).unwrap_err().contains("last checked"));
        s.phase = DaemonPhase::Restarting;
        s.reason = Some("exited with status 1".into());
        l.write_state(uuid, &s).unwrap();
        assert_eq!(
            l.ready(uuid, now).unwrap_err(),
            "the MPS daemon of GPU-1 is restarting: exited with status 1"
        );
    }

    #[test]
    fn modes_and_requirements() {
        assert_eq!("mps".parse::<ShareEnforcement>(), Ok(ShareEnforcement::Mps));
        assert_eq!("hook".parse::<ShareEnforcement>(), Ok(ShareEnforcement::Hook));
        assert!("lax".parse::<ShareEnforcement>().unwrap_err().contains("\"lax\""));
        assert!(ShareEnforcement::Hook.enforces() && !ShareEnforcement::None.enforces());
        let any: EnforcementRequirement = "required".parse().unwrap();
        assert!(any.check(ShareEnforcement::Mps).is_ok());
        assert_eq!(
            any.check(ShareEnforcement::None).unwrap_err(),
            "the pod requires enforced shares; this node's share enforcement is none"
        );
        assert!(any.check(ShareEnforcement::Unknown).is_err());
        assert!("sometimes".parse::<EnforcementRequirement>().is_err());
        // Published as lowercase; an old node publishes nothing (unknown).
        assert_eq!(serde_json::to_string(&ShareEnforcement::Mps).unwrap(), "\"mps\"");
    }

    #[test]
    fn hooked_containers_on_one_card_share_nothing() {
        let d = tempfile::tempdir().unwrap();
        let l = HookLayout::new(d.path());
        let limits = |uuid: &str, core_limit| ShareLimits {
            uuid: uuid.into(),
            core_limit,
            memory_mib: 8192,
        };
        let hook = ShareEnforcement::Hook;
        let a = l.prepare("a", &limits("GPU-1", 30), hook, None).unwrap();
        let b = l.prepare("b", &limits("GPU-1", 50), hook, None).unwrap();
        let c = l
            .prepare("c", &limits("GPU-2", 30), ShareEnforcement::Mps, None)
            .unwrap();
        for (x, y) in [(&a, &b), (&a, &c)] {
            assert!(x.config != y.config && x.agent != y.agent);
        }
        assert!(a.agent.is_dir() && a.agent.starts_with(l.container_dir("a")));
        let text = std::fs::read_to_string(&b.config).unwrap();
        for line in [
            "uuid=GPU-1",
            "core_limit=50",
            "compute=throttle",
            "memory_limit_mib=8192",
            "state_dir=/run/tessera/hook/state",
            "pid_socket=/run/tessera/hook/agent/pid.sock",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in {text}");
        }
        // An MPS node's share: its processes take turns at the share.
        let text = std::fs::read_to_string(&c.config).unwrap();
        assert!(
            text.lines().any(|l| l == "compute=turns") && text.contains("core_limit=30"),
            "{text}"
        );
        // Preparing again (a retried CreateContainer) is fine.
        assert_eq!(l.prepare("a", &limits("GPU-1", 30), hook, None).unwrap(), a);
        // A hook node's share with a window of the card's time launches in it, and a restarted
        // plugin reads the window back.
        let w = Window::parse("30-80").unwrap();
        let d = l.prepare("d", &limits("GPU-1", 50), hook, Some(&w)).unwrap();
        let text = std::fs::read_to_string(&d.config).unwrap();
        for line in ["compute=windows", "window=30-80", "period_ms=50", "core_limit=50"] {
            assert!(text.lines().any(|l| l == line), "{line} in {text}");
        }
        assert_eq!(
            l.window_of("d"),
            Some(CardWindow {
                uuid: "GPU-1".into(),
                percent: 50,
                window: w
            })
        );
        assert_eq!(l.window_of("b"), None);
    }
}
