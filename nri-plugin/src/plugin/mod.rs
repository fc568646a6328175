//! The NRI plugin service: Configure, Synchronize (split syncs included), CreateContainer and
//! the bookkeeping events. Every generated method is overridden: unhandled ones answer
//! UNIMPLEMENTED, which lets newer runtimes fall back to StateChange.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Mutex;

use async_trait::async_trait;
use tessera_core::enforcement::{
    HOOK_AGENT_IN_CONTAINER, HOOK_CONFIG_IN_CONTAINER, HOOK_STATE_IN_CONTAINER, HookLayout, MpsCeiling, MpsLayout,
    ShareEnforcement, ShareLimits,
};
use tessera_core::handoff::{AllocatedDevice, HandoffError, KeyDirStamp, VerifyingKeys};
use tessera_core::injection::{self, ANNOTATION_INJECTED, Injection, NodeContext};
use tessera_proto::nri::api;
use tessera_proto::nri::api_ttrpc::Plugin;
use tracing::{info, warn};
use ttrpc::r#async::TtrpcContext;

use crate::adjust;
use crate::cdi::CdiResolver;

/// NRI event numbers.
pub mod events {
    /// CreateContainer.
    pub const CREATE_CONTAINER: u32 = 4;
    /// StopContainer.
    pub const STOP_CONTAINER: u32 = 10;
    /// RemoveContainer.
    pub const REMOVE_CONTAINER: u32 = 11;
}

/// The subscription: only events 1..=11 (older runtimes reject higher bits).
pub fn event_mask() -> i32 {
    [
        events::CREATE_CONTAINER,
        events::STOP_CONTAINER,
        events::REMOVE_CONTAINER,
    ]
    .iter()
    .fold(0, |m, e| m | (1 << (e - 1)))
}

/// Plugin settings.
#[derive(Debug, Clone)]
pub struct PluginConfig {
    /// This node's name (allocations for other nodes are refused).
    pub node: String,
    /// Hand-off verification keys.
    pub keys: VerifyingKeys,
    /// CDI spec directories.
    pub cdi_dirs: Vec<PathBuf>,
    /// How this node holds shares to their limits.
    pub enforcement: ShareEnforcement,
    /// Where the MPS daemons keep their state (with [`ShareEnforcement::Mps`]).
    pub mps: MpsLayout,
    /// Where the CUDA hook and each container's limits live (with [`ShareEnforcement::Hook`]).
    pub hook: HookLayout,
    /// The DRA claims the node prepared (Tessera's DRA plugin records them).
    pub claims: tessera_core::dra::ClaimStore,
}

/// A container Tessera gave GPUs to: whose it is and what it has (for the node's metrics).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Tracked {
    /// Injected UUIDs, comma-separated (as in the `tessera.io/injected` annotation).
    pub uuids: String,
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub pod: String,
    /// Container name.
    pub container: String,
    /// Its devices, from the pod's allocation (empty when a runtime reported the container
    /// without its pod's allocation).
    pub devices: Vec<tessera_core::handoff::AllocatedDevice>,
    /// Stopped (exited or killed) but not removed yet: it holds no GPU any more (an init
    /// container that finished, a completed Job's container).
    pub stopped: bool,
    /// An MPS share: its limits, which its card's daemon ceiling must cover.
    pub mps_share: Option<ShareLimits>,
    /// The DRA claims (uids) its devices come from: containers of one claim share them.
    pub claims: Vec<String>,
}

/// The plugin's state, shared by all sessions (it survives reconnects).
pub struct TesseraPlugin {
    config: PluginConfig,
    /// The verification keys in use (starts as `config.keys`).
    keys: std::sync::RwLock<VerifyingKeys>,
    /// Where the keys come from, re-read when an allocation names a key we lack (rotation).
    keys_dir: Option<PathBuf>,
    /// What the key directory looked like when its keys were last read.
    keys_seen: Mutex<Option<KeyDirStamp>>,
    cdi: Mutex<CdiResolver>,
    /// Container id -> what it was given and whose it is.
    injected: Mutex<HashMap<String, Tracked>>,
    sync: Mutex<(Vec<api::PodSandbox>, Vec<api::Container>)>,
    syncs: tokio::sync::watch::Sender<u64>,
    /// Hook mode: each hooked container's host-pid socket.
    pids: crate::pid_service::PidServices,
}

fn status(code: ttrpc::Code, msg: String) -> ttrpc::Error {
    ttrpc::Error::RpcStatus(ttrpc::get_status(code, msg))
}

fn unimplemented<T>(method: &str) -> ttrpc::Result<T> {
    Err(status(
        ttrpc::Code::UNIMPLEMENTED,
        format!("{method} is not handled by tessera"),
    ))
}

impl TesseraPlugin {
    /// A plugin with `config`.
    pub fn new(config: PluginConfig) -> Self {
        let cdi = Mutex::new(CdiResolver::new(config.cdi_dirs.clone()));
        let (syncs, _) = tokio::sync::watch::channel(0);
        Self {
            keys: std::sync::RwLock::new(config.keys.clone()),
            keys_dir: None,
            keys_seen: Mutex::new(None),
            config,
            cdi,
            injected: Mutex::new(HashMap::new()),
            sync: Mutex::new((Vec::new(), Vec::new())),
            syncs,
            pids: Default::default(),
        }
    }

    /// Re-reads the keys from `dir` when it changed, and when an allocation is signed with a key
    /// not loaded yet, so that a key added to the mounted Secret (rotation) is picked up, and a
    /// key removed stops verifying, without a restart.
    pub fn reloading_keys_from(mut self, dir: PathBuf) -> Self {
        *self.keys_seen.lock().expect("not poisoned") = Some(KeyDirStamp::of(&dir));
        self.keys_dir = Some(dir);
        self
    }

    /// Reads the keys again, when the directory changed since they were read: a key removed
    /// from the Secret stops verifying at the next container created after the kubelet
    /// updated the volume, a key added starts.
    fn refresh_keys(&self) {
        let Some(dir) = &self.keys_dir else { return };
        let now = KeyDirStamp::of(dir);
        let mut seen = self.keys_seen.lock().expect("not poisoned");
        if seen.as_ref() == Some(&now) {
            return;
        }
        match VerifyingKeys::from_dir(dir) {
            Ok(fresh) => {
                info!(dir = %dir.display(), keys = ?fresh.key_ids().collect::<Vec<_>>(), "the hand-off keys changed: reloaded");
                *self.keys.write().unwrap_or_else(|p| p.into_inner()) = fresh;
                *seen = Some(now);
            }
            Err(e) => {
                warn!(dir = %dir.display(), error = %e, "cannot reload the hand-off keys; keeping the loaded ones")
            }
        }
    }

    fn decide(
        &self,
        pod: &api::PodSandbox,
        pod_annotations: &BTreeMap<String, String>,
        container: &str,
        ctr_annotations: &BTreeMap<String, String>,
        env: &[String],
    ) -> Result<Injection, injection::InjectionError> {
        let ready = |uuid: &str| match self.config.enforcement {
            ShareEnforcement::Mps => self.config.mps.ready(uuid, std::time::SystemTime::now()),
            ShareEnforcement::Hook => self.config.hook.ready(),
            ShareEnforcement::None | ShareEnforcement::Unknown => Ok(()),
        };
        let claims = tessera_core::dra::marked_claims(env);
        if !claims.is_empty() {
            // DRA: the claims the kubelet prepared through Tessera's DRA plugin, as recorded.
            let keys = self.keys.read().unwrap_or_else(|p| p.into_inner());
            let ctx = NodeContext {
                node: &self.config.node,
                keys: &keys,
                enforcement: self.config.enforcement,
                share_ready: &ready,
            };
            return injection::decide_claims(
                &ctx,
                &self.config.claims,
                &pod.namespace,
                container,
                ctr_annotations,
                &claims,
            );
        }
        self.refresh_keys();
        let attempt = || {
            let keys = self.keys.read().unwrap_or_else(|p| p.into_inner());
            let ctx = NodeContext {
                node: &self.config.node,
                keys: &keys,
                enforcement: self.config.enforcement,
                share_ready: &ready,
            };
            injection::decide(&ctx, &pod.uid, pod_annotations, container, ctr_annotations)
        };
        match attempt() {
            Err(injection::InjectionError::Handoff {
                source: HandoffError::UnknownKey { key_id },
                ..
            }) if self.keys_dir.is_some() => {
                let dir = self.keys_dir.as_ref().expect("checked");
                match VerifyingKeys::from_dir(dir) {
                    Ok(fresh) => {
                        info!(key_id, dir = %dir.display(), "reloaded the hand-off keys");
                        *self.keys.write().unwrap_or_else(|p| p.into_inner()) = fresh;
                    }
                    Err(e) => warn!(dir = %dir.display(), error = %e, "cannot reload the hand-off keys"),
                }
                attempt()
            }
            r => r,
        }
    }

    /// Counts completed Synchronize calls (one per connection to a runtime).
    pub fn synchronized(&self) -> tokio::sync::watch::Receiver<u64> {
        self.syncs.subscribe()
    }

    /// Container id -> injected UUIDs, as the plugin knows it.
    pub fn injected(&self) -> HashMap<String, String> {
        self.injected
            .lock()
            .expect("not poisoned")
            .iter()
            .map(|(id, t)| (id.clone(), t.uuids.clone()))
            .collect()
    }

    /// Container id -> the containers Tessera gave GPUs to.
    pub fn tracked(&self) -> HashMap<String, Tracked> {
        self.injected.lock().expect("not poisoned").clone()
    }

    /// The CreateContainer decision and adjustment.
    pub fn adjust(
        &self,
        pod: &api::PodSandbox,
        container: &api::Container,
    ) -> Result<api::ContainerAdjustment, String> {
        let pod_annotations: BTreeMap<String, String> =
            pod.annotations.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        let ctr_annotations: BTreeMap<String, String> = container
            .annotations
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        match self
            .decide(pod, &pod_annotations, &container.name, &ctr_annotations, &container.env)
            .map_err(|e| e.to_string())?
        {
            Injection::Deny => Ok(adjust::deny(container)),
            Injection::Grant(grant) => {
                if grant.enforced_by == Some(ShareEnforcement::None) {
                    warn!(
                        pod = pod.name,
                        container = container.name,
                        "this node runs shares unenforced: the container's compute and memory limits are not held"
                    );
                }
                let edits = self
                    .cdi
                    .lock()
                    .map_err(|_| "CDI resolver poisoned".to_string())?
                    .resolve(&grant.cdi_devices)
                    .map_err(|e| {
                        format!(
                            "container {:?}: cannot resolve {:?}: {e}",
                            container.name, grant.cdi_devices
                        )
                    })?;
                let mut injected = self.injected.lock().expect("not poisoned");
                if let Some(e) = double_grant(&injected, pod, &container.name, &grant.devices, &grant.claims) {
                    return Err(e);
                }
                injected.insert(
                    container.id.clone(),
                    Tracked {
                        uuids: grant.uuids.join(","),
                        namespace: pod.namespace.clone(),
                        pod: pod.name.clone(),
                        container: container.name.clone(),
                        devices: grant.devices.clone(),
                        stopped: false,
                        mps_share: grant
                            .share
                            .clone()
                            .filter(|_| grant.enforced_by == Some(ShareEnforcement::Mps)),
                        claims: grant.claims.clone(),
                    },
                );
                drop(injected);
                if grant.enforced_by == Some(ShareEnforcement::Mps)
                    && let Some(limits) = &grant.share
                {
                    self.set_ceiling(&limits.uuid);
                }
                let mut adj = adjust::grant(&grant, &edits, &container.env);
                if grant.enforced_by == Some(ShareEnforcement::Hook)
                    && let Some(limits) = &grant.share
                {
                    // The container's limits, read-only, and the accounting its processes share.
                    let files = self.config.hook.prepare(&container.id, limits).map_err(|e| {
                        format!(
                            "container {:?}: cannot write its CUDA hook configuration under {}: {e}",
                            container.name,
                            self.config.hook.root.display()
                        )
                    })?;
                    adj.mounts
                        .push(adjust::bind(&files.config, HOOK_CONFIG_IN_CONTAINER, true));
                    adj.mounts
                        .push(adjust::bind(&files.state, HOOK_STATE_IN_CONTAINER, false));
                    self.pids.serve(&container.id, &files.agent).map_err(|e| {
                        format!(
                            "container {:?}: cannot serve its host-pid socket in {}: {e}",
                            container.name,
                            files.agent.display()
                        )
                    })?;
                    adj.mounts
                        .push(adjust::bind(&files.agent, HOOK_AGENT_IN_CONTAINER, true));
                }
                Ok(adj)
            }
        }
    }

    /// Marks a container stopped: the node's metrics no longer count it, and its card's MPS
    /// ceiling no longer covers it.
    pub fn stopped(&self, id: &str) {
        let share = self.injected.lock().expect("not poisoned").get_mut(id).and_then(|t| {
            t.stopped = true;
            t.mps_share.clone()
        });
        if let Some(s) = share {
            self.set_ceiling(&s.uuid);
        }
    }

    fn forget(&self, container: Option<&api::Container>) {
        if let Some(c) = container {
            let gone = self.injected.lock().expect("not poisoned").remove(&c.id);
            if let Some(s) = gone.and_then(|t| t.mps_share) {
                self.set_ceiling(&s.uuid);
            }
            if self.config.enforcement == ShareEnforcement::Hook {
                self.pids.stop(&c.id);
                let _ = std::fs::remove_dir_all(self.config.hook.container_dir(&c.id));
            }
        }
    }

    /// The ceiling card `uuid`'s MPS daemon should hold: the largest of its live shares.
    pub fn ceiling(&self, uuid: &str) -> MpsCeiling {
        let tracked = self.injected.lock().expect("not poisoned");
        MpsCeiling::of(
            tracked
                .values()
                .filter(|t| !t.stopped)
                .filter_map(|t| t.mps_share.as_ref())
                .filter(|s| s.uuid == uuid),
        )
    }

    /// Writes card `uuid`'s ceiling for the supervisor to set on its daemon.
    fn set_ceiling(&self, uuid: &str) {
        let c = self.ceiling(uuid);
        if self.config.mps.read_ceiling(uuid).ok().flatten() == Some(c) {
            return;
        }
        match self.config.mps.write_ceiling(uuid, &c) {
            Ok(()) => info!(
                uuid,
                percentage = c.active_thread_percentage,
                memory_mib = c.pinned_memory_mib,
                "MPS ceiling wanted"
            ),
            Err(e) => warn!(uuid, error = %e, "cannot write the MPS ceiling"),
        }
    }

    /// Waits until card `uuid`'s daemon holds a ceiling that covers `limits` (the supervisor sets
    /// it within a fraction of a second); the error says why the share cannot be held.
    pub async fn ceiling_held(&self, limits: &ShareLimits, within: std::time::Duration) -> Result<(), String> {
        let deadline = std::time::Instant::now() + within;
        loop {
            let held = self
                .config
                .mps
                .read_state(&limits.uuid)
                .ok()
                .filter(|s| s.phase == tessera_core::enforcement::DaemonPhase::Ready)
                .and_then(|s| s.ceiling);
            if held.is_some_and(|c| c.covers(limits)) {
                return Ok(());
            }
            if std::time::Instant::now() > deadline {
                return Err(format!(
                    "its share of {} cannot be enforced: the card's MPS daemon did not take the share's limits \
                     ({}%, {} MiB) within {} ms (it holds {held:?}; see tessera-mps-supervisor's log)",
                    limits.uuid,
                    limits.core_limit,
                    limits.memory_mib,
                    within.as_millis()
                ));
            }
            tokio::time::sleep(std::time::Duration::from_millis(25)).await;
        }
    }
}

/// How long a share's creation waits for its card's MPS daemon to take its limits.
/// Under containerd's `plugin_request_timeout` (2 s in deploy/runtime/): the refusal must reach
/// the runtime. The supervisor looks at the wanted ceiling every 100 ms.
const CEILING_WAIT: std::time::Duration = std::time::Duration::from_millis(1500);

/// An MPS share's limits, from the environment Tessera gave the container.
fn mps_share_of(c: &api::Container) -> Option<ShareLimits> {
    let var = |k: &str| c.env.iter().find_map(|e| e.strip_prefix(k)?.strip_prefix('='));
    let core_limit = var("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")?.parse().ok()?;
    let (uuid, mem) = var("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")?.split_once('=')?;
    Some(ShareLimits {
        uuid: uuid.to_string(),
        core_limit,
        memory_mib: mem.strip_suffix('M')?.parse().ok()?,
    })
}

/// What a running container was given, from its annotations or, as runtimes report them in
/// Synchronize, from the env Tessera set (`CUDA_VISIBLE_DEVICES` with device UUIDs).
/// Why a grant of `devices` to a container of `pod` would hand out a device that a live
/// container of another pod holds on this node: a whole card held by anyone, a card held whole,
/// or the same MIG device. The extender never books that; a node that sees it (books gone
/// wrong, a replayed or forged record) refuses rather than share an exclusive device. A pod's
/// own containers may reuse its cards (an init container's card, once it has finished).
fn double_grant(
    live: &HashMap<String, Tracked>,
    pod: &api::PodSandbox,
    container: &str,
    devices: &[AllocatedDevice],
    claims: &[String],
) -> Option<String> {
    for (held, t) in live.iter().filter(|(_, t)| !t.stopped) {
        if t.namespace == pod.namespace && t.pod == pod.name && !t.pod.is_empty() {
            continue;
        }
        // One DRA claim reserved for several pods: they share its devices by design.
        if t.claims.iter().any(|c| claims.contains(c)) {
            continue;
        }
        let held_uuids: Vec<&str> = t.uuids.split(',').filter(|u| !u.is_empty()).collect();
        for d in devices {
            let (uuid, exclusive) = match d {
                AllocatedDevice::Gpu { uuid, exclusive, .. } => (uuid.as_str(), *exclusive),
                AllocatedDevice::Mig { uuid, .. } => (uuid.as_str(), true),
            };
            let held_whole = t
                .devices
                .iter()
                .any(|h| matches!(h, AllocatedDevice::Gpu { uuid: u, exclusive: true, .. } if u == uuid));
            if held_uuids.contains(&uuid) && (exclusive || held_whole) {
                return Some(format!(
                    "container {container:?}: {uuid} is held by container {} of pod {}/{} ({held}) on this node{}; \
                     refusing a second grant of it (the extender's books and this node disagree)",
                    t.container,
                    t.namespace,
                    t.pod,
                    if held_whole { " as a whole card" } else { "" },
                ));
            }
        }
    }
    None
}

fn injected_of(c: &api::Container) -> Option<String> {
    if let Some(v) = c.annotations.get(ANNOTATION_INJECTED) {
        return Some(v.clone());
    }
    let visible = c.env.iter().find_map(|e| e.strip_prefix("CUDA_VISIBLE_DEVICES="))?;
    let tessera = c.env.iter().any(|e| e == "NVIDIA_VISIBLE_DEVICES=void")
        && !visible.is_empty()
        && visible
            .split(',')
            .all(|u| u.starts_with("GPU-") || u.starts_with("MIG-"));
    tessera.then(|| visible.to_string())
}

#[async_trait]
impl Plugin for TesseraPlugin {
    async fn configure(&self, _: &TtrpcContext, req: api::ConfigureRequest) -> ttrpc::Result<api::ConfigureResponse> {
        info!(
            runtime = req.runtime_name,
            version = req.runtime_version,
            nri = req.NRI_version,
            "configured by the runtime"
        );
        let mut resp = api::ConfigureResponse::new();
        resp.events = event_mask();
        Ok(resp)
    }

    async fn synchronize(
        &self,
        _: &TtrpcContext,
        req: api::SynchronizeRequest,
    ) -> ttrpc::Result<api::SynchronizeResponse> {
        let mut buffered = self.sync.lock().expect("not poisoned");
        buffered.0.extend(req.pods);
        buffered.1.extend(req.containers);
        let mut resp = api::SynchronizeResponse::new();
        if req.more {
            // A split sync: acknowledge and wait for the rest.
            resp.more = true;
            return Ok(resp);
        }
        let (pods, containers) = std::mem::take(&mut *buffered);
        let pods: HashMap<&str, &api::PodSandbox> = pods.iter().map(|p| (p.id.as_str(), p)).collect();
        let rebuilt: HashMap<String, Tracked> = containers
            .iter()
            .filter_map(|c| {
                let uuids = injected_of(c)?;
                let pod = pods.get(c.pod_sandbox_id.as_str());
                // The container was admitted when it was created: its devices, for the metrics
                // and the double-grant check, from its pod's allocation or its DRA claims.
                let marks = tessera_core::dra::marked_claims(&c.env);
                let claimed = pod
                    .filter(|_| !marks.is_empty())
                    .and_then(|p| tessera_core::dra::devices_for(&self.config.claims, &p.namespace, &marks).ok())
                    .unwrap_or_default();
                let devices = if marks.is_empty() {
                    pod.and_then(|p| p.annotations.get(tessera_core::names::ANNOTATION_ALLOCATION))
                        .and_then(|a| tessera_core::handoff::Allocation::decode(a).ok())
                        .and_then(|a| a.container(&c.name).map(|m| m.devices.clone()))
                        .unwrap_or_default()
                } else {
                    claimed.devices
                };
                Some((
                    c.id.clone(),
                    Tracked {
                        uuids,
                        namespace: pod.map(|p| p.namespace.clone()).unwrap_or_default(),
                        pod: pod.map(|p| p.name.clone()).unwrap_or_default(),
                        container: c.name.clone(),
                        devices,
                        stopped: c.state.value() == api::ContainerState::CONTAINER_STOPPED as i32,
                        mps_share: mps_share_of(c),
                        claims: claimed.claims,
                    },
                ))
            })
            .collect();
        info!(containers = containers.len(), with_gpus = rebuilt.len(), "synchronized");
        if self.config.enforcement == ShareEnforcement::Hook {
            // Removals missed while disconnected: drop the hook files of containers gone.
            let live: std::collections::HashSet<String> = containers.iter().map(|c| c.id.clone()).collect();
            self.config.hook.forget_except(&live);
            // And a restarted plugin answers again on the sockets of those that remain.
            self.pids.retain(&live);
            for id in &live {
                let agent = self.config.hook.agent_dir(id);
                if !self.pids.serves(id)
                    && agent.is_dir()
                    && let Err(e) = self.pids.serve(id, &agent)
                {
                    warn!(container = id, error = %e, "cannot serve the container's host-pid socket");
                }
            }
        }
        *self.injected.lock().expect("not poisoned") = rebuilt;
        if self.config.enforcement == ShareEnforcement::Mps {
            // Shares that ended while disconnected: every card's ceiling from the live ones.
            for uuid in self.config.mps.cards() {
                self.set_ceiling(&uuid);
            }
        }
        self.syncs.send_modify(|n| *n += 1);
        Ok(resp)
    }

    async fn shutdown(&self, _: &TtrpcContext, _: api::Empty) -> ttrpc::Result<api::Empty> {
        info!("runtime asked us to shut down");
        Ok(api::Empty::new())
    }

    async fn create_container(
        &self,
        _: &TtrpcContext,
        req: api::CreateContainerRequest,
    ) -> ttrpc::Result<api::CreateContainerResponse> {
        let (pod, container) = (req.pod.unwrap_or_default(), req.container.unwrap_or_default());
        let adjusted = match self.adjust(&pod, &container) {
            Ok(adj) => {
                // An MPS share starts only once its card's daemon holds a ceiling that covers it.
                let share = self
                    .injected
                    .lock()
                    .expect("not poisoned")
                    .get(&container.id)
                    .and_then(|t| t.mps_share.clone());
                match share {
                    Some(limits) => match self.ceiling_held(&limits, CEILING_WAIT).await {
                        Ok(()) => Ok(adj),
                        Err(e) => {
                            self.forget(Some(&container));
                            Err(format!("container {:?}: {e}", container.name))
                        }
                    },
                    None => Ok(adj),
                }
            }
            Err(e) => Err(e),
        };
        match adjusted {
            Ok(adj) => {
                let mut resp = api::CreateContainerResponse::new();
                resp.adjust = Some(adj).into();
                Ok(resp)
            }
            Err(msg) => {
                warn!(
                    pod = pod.name,
                    container = container.name,
                    error = msg,
                    "refusing container"
                );
                Err(status(ttrpc::Code::PERMISSION_DENIED, msg))
            }
        }
    }

    async fn update_container(
        &self,
        _: &TtrpcContext,
        _: api::UpdateContainerRequest,
    ) -> ttrpc::Result<api::UpdateContainerResponse> {
        Ok(api::UpdateContainerResponse::new())
    }

    async fn stop_container(
        &self,
        _: &TtrpcContext,
        req: api::StopContainerRequest,
    ) -> ttrpc::Result<api::StopContainerResponse> {
        // A stopped container still exists (its files go at removal) but uses no GPU.
        if let Some(c) = req.container.as_ref() {
            self.stopped(&c.id);
        }
        Ok(api::StopContainerResponse::new())
    }

    async fn state_change(&self, _: &TtrpcContext, req: api::StateChangeEvent) -> ttrpc::Result<api::Empty> {
        if req.event.value() == events::REMOVE_CONTAINER as i32 {
            self.forget(req.container.as_ref());
        }
        Ok(api::Empty::new())
    }

    async fn remove_container(&self, _: &TtrpcContext, req: api::ContainerEvent) -> ttrpc::Result<api::Empty> {
        self.forget(req.container.as_ref());
        Ok(api::Empty::new())
    }

    async fn update_pod_sandbox(
        &self,
        _: &TtrpcContext,
        _: api::UpdatePodSandboxRequest,
    ) -> ttrpc::Result<api::UpdatePodSandboxResponse> {
        unimplemented("UpdatePodSandbox")
    }

    async fn run_pod_sandbox(&self, _: &TtrpcContext, _: api::PodSandboxEvent) -> ttrpc::Result<api::Empty> {
        unimplemented("RunPodSandbox")
    }

    async fn post_update_pod_sandbox(&self, _: &TtrpcContext, _: api::PodSandboxEvent) -> ttrpc::Result<api::Empty> {
        unimplemented("PostUpdatePodSandbox")
    }

    async fn stop_pod_sandbox(&self, _: &TtrpcContext, _: api::PodSandboxEvent) -> ttrpc::Result<api::Empty> {
        unimplemented("StopPodSandbox")
    }

    async fn remove_pod_sandbox(&self, _: &TtrpcContext, _: api::PodSandboxEvent) -> ttrpc::Result<api::Empty> {
        unimplemented("RemovePodSandbox")
    }

    async fn post_create_container(&self, _: &TtrpcContext, _: api::ContainerEvent) -> ttrpc::Result<api::Empty> {
        unimplemented("PostCreateContainer")
    }

    async fn start_container(&self, _: &TtrpcContext, _: api::ContainerEvent) -> ttrpc::Result<api::Empty> {
        unimplemented("StartContainer")
    }

    async fn post_start_container(&self, _: &TtrpcContext, _: api::ContainerEvent) -> ttrpc::Result<api::Empty> {
        unimplemented("PostStartContainer")
    }

    async fn post_update_container(&self, _: &TtrpcContext, _: api::ContainerEvent) -> ttrpc::Result<api::Empty> {
        unimplemented("PostUpdateContainer")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_added_to_the_secret_is_picked_up_without_a_restart() {
        use tessera_cdi_generator::spec::{self, SpecOptions};
        use tessera_core::handoff::{AllocatedDevice, Allocation, ContainerAllocation};
        use tessera_core::inventory::{FixtureSource, InventorySource};
        use tessera_core::names::{ANNOTATION_ALLOCATION, ANNOTATION_ALLOCATION_SIGNATURE};

        let dir = tempfile::tempdir().unwrap();
        let (keys_dir, cdi_dir) = (dir.path().join("keys"), dir.path().join("cdi"));
        std::fs::create_dir_all(&keys_dir).unwrap();
        std::fs::create_dir_all(&cdi_dir).unwrap();
        std::fs::write(keys_dir.join("active"), "k1").unwrap();
        std::fs::write(keys_dir.join("k1"), [1u8; 32]).unwrap();
        let inv = FixtureSource {
            fixture: "h100x8".into(),
            driver_root: None,
        }
        .discover()
        .unwrap();
        let (_, text) = spec::render(&inv, &SpecOptions::default()).unwrap();
        std::fs::write(cdi_dir.join("tessera.io-gpu.json"), text).unwrap();
        let plugin = TesseraPlugin::new(PluginConfig {
            node: "n".into(),
            keys: VerifyingKeys::from_dir(&keys_dir).unwrap(),
            cdi_dirs: vec![cdi_dir],
            enforcement: ShareEnforcement::None,
            mps: MpsLayout::default(),
            hook: HookLayout::default(),
            claims: Default::default(),
        })
        .reloading_keys_from(keys_dir.clone());

        // The extender starts signing with k2 (rotation step 2).
        let k2 =
            tessera_core::handoff::SigningKeys::new("k2", [("k1".into(), vec![1u8; 32]), ("k2".into(), vec![2u8; 32])])
                .unwrap();
        let g = &inv.gpus[0];
        let mut a = Allocation::new("n", "uid");
        a.containers.push(ContainerAllocation {
            name: "c".into(),
            role: tessera_core::request::ContainerRole::App,
            devices: vec![AllocatedDevice::whole(g)],
        });
        let signed = k2.sign(&a);
        let mut pod = api::PodSandbox::new();
        pod.uid = "uid".into();
        pod.annotations.insert(ANNOTATION_ALLOCATION.into(), signed.allocation);
        pod.annotations
            .insert(ANNOTATION_ALLOCATION_SIGNATURE.into(), signed.signature);
        let mut ctr = api::Container::new();
        ctr.name = "c".into();
        ctr.annotations
            .insert("tessera.io/allocated.gpu-core".into(), "100".into());

        // The node has not seen k2 yet: refused, naming the key.
        let err = plugin.adjust(&pod, &ctr).unwrap_err();
        assert!(err.contains("unknown key \"k2\""), "{err}");
        // The Secret gains k2 (step 1 reaches the node): the next container verifies.
        std::fs::write(keys_dir.join("k2"), [2u8; 32]).unwrap();
        let adj = plugin.adjust(&pod, &ctr).unwrap();
        assert!(
            adj.linux
                .devices
                .iter()
                .any(|d| d.path == format!("/dev/nvidia{}", g.minor))
        );
    }

    /// A container created from a DRA claim (the marker the DRA plugin handed the kubelet, in
    /// its environment) gets the claim's devices and limits from the node's record, as a
    /// signed allocation's; a marker naming a claim the node did not prepare, another
    /// namespace's claim, or a claim next to Tessera's extended resources is refused.
    #[test]
    fn a_dra_claims_container_gets_what_the_node_recorded_and_nothing_else() {
        use tessera_cdi_generator::spec::{self, SpecOptions};
        use tessera_core::dra::{self, ClaimStore, PreparedClaim, PreparedDevice};
        use tessera_core::inventory::{FixtureSource, InventorySource};

        let dir = tempfile::tempdir().unwrap();
        let inv = FixtureSource::new("h100x8").discover().unwrap();
        let (_, text) = spec::render(&inv, &SpecOptions::default()).unwrap();
        std::fs::write(dir.path().join("tessera.io-gpu.json"), text).unwrap();
        let store = ClaimStore::new(&dir.path().join("dra"));
        let plugin = TesseraPlugin::new(PluginConfig {
            node: "n".into(),
            keys: tessera_core::handoff::SigningKeys::new("k", [("k".into(), vec![5u8; 32])])
                .unwrap()
                .verifying(),
            cdi_dirs: vec![dir.path().to_path_buf()],
            enforcement: ShareEnforcement::None,
            mps: MpsLayout::default(),
            hook: HookLayout::default(),
            claims: store.clone(),
        });
        let g = &inv.gpus[2];
        let token = dra::new_token();
        store
            .put(&PreparedClaim {
                uid: "u-1".into(),
                namespace: "team-a".into(),
                name: "share".into(),
                pods: vec!["p".into()],
                token: token.clone(),
                devices: vec![PreparedDevice {
                    requests: vec!["gpu".into()],
                    pool: "n".into(),
                    device: "gpu-2".into(),
                    share_id: Some("s".into()),
                    allocated: AllocatedDevice::Gpu {
                        uuid: g.uuid.clone(),
                        index: g.index,
                        minor: g.minor,
                        core_percent: 30,
                        memory_mib: 4096,
                        exclusive: false,
                    },
                    carved: None,
                }],
            })
            .unwrap();
        let pod = |ns: &str| {
            let mut p = api::PodSandbox::new();
            p.uid = "p".into();
            p.name = "trainer".into();
            p.namespace = ns.into();
            p
        };
        let ctr = |id: &str, uid: &str, token: &str| {
            let mut c = api::Container::new();
            c.id = id.into();
            c.name = "main".into();
            c.env = vec![format!("{}={token}", dra::marker_env(uid)), "PATH=/bin".into()];
            c
        };
        let adj = plugin.adjust(&pod("team-a"), &ctr("c1", "u-1", &token)).unwrap();
        let env: BTreeMap<String, String> = adj.env.iter().map(|kv| (kv.key.clone(), kv.value.clone())).collect();
        assert_eq!(env["CUDA_VISIBLE_DEVICES"], g.uuid);
        assert_eq!(
            (
                env["TESSERA_GPU_CORE_LIMIT"].as_str(),
                env["TESSERA_GPU_MEMORY_LIMIT_MIB"].as_str()
            ),
            ("30", "4096")
        );
        assert!(
            adj.linux
                .devices
                .iter()
                .any(|d| d.path == format!("/dev/nvidia{}", g.minor))
        );
        assert_eq!(plugin.tracked()["c1"].uuids, g.uuid);

        let refused = |p: &api::PodSandbox, c: &api::Container| plugin.adjust(p, c).unwrap_err();
        assert!(
            refused(&pod("team-b"), &ctr("c2", "u-1", &token))
                .contains("claim team-a/share (u-1) is not a claim of namespace team-b")
        );
        assert!(refused(&pod("team-a"), &ctr("c3", "u-9", &token)).contains("claim u-9 is not prepared on this node"));
        // A pod of the namespace that writes the marker itself has no token.
        assert!(refused(&pod("team-a"), &ctr("c5", "u-1", "u-1")).contains("does not carry the claim's token"));
        let mut both = ctr("c4", "u-1", &token);
        both.annotations
            .insert("tessera.io/allocated.gpu-core".into(), "30".into());
        assert!(refused(&pod("team-a"), &both).contains("ask through one or the other"));

        // A whole card's claim reserved for two pods: both get the card (a shared claim is
        // not a double grant).
        let w = &inv.gpus[3];
        let whole_token = dra::new_token();
        store
            .put(&PreparedClaim {
                uid: "u-w".into(),
                namespace: "team-a".into(),
                name: "whole".into(),
                pods: vec![],
                token: whole_token.clone(),
                devices: vec![PreparedDevice {
                    requests: vec!["gpu".into()],
                    pool: "n".into(),
                    device: "gpu-3".into(),
                    share_id: None,
                    allocated: AllocatedDevice::whole(w),
                    carved: None,
                }],
            })
            .unwrap();
        let mut other = pod("team-a");
        other.name = "evaluator".into();
        other.uid = "q".into();
        plugin.adjust(&pod("team-a"), &ctr("c6", "u-w", &whole_token)).unwrap();
        plugin.adjust(&other, &ctr("c7", "u-w", &whole_token)).unwrap();
        assert_eq!(plugin.tracked()["c7"].uuids, w.uuid);
    }

    /// A card a live container of one pod holds whole is granted to no other pod, even on a
    /// validly signed record (books gone wrong, a replayed signature): refused, naming the
    /// holder; a share is not put on it either; two shares may share a card; once the holder
    /// has stopped, the card is granted again.
    #[test]
    fn a_card_held_whole_is_granted_to_no_other_pod() {
        use tessera_cdi_generator::spec::{self, SpecOptions};
        use tessera_core::handoff::{Allocation, ContainerAllocation, SigningKeys};
        use tessera_core::inventory::{FixtureSource, InventorySource};
        use tessera_core::names::{ANNOTATION_ALLOCATION, ANNOTATION_ALLOCATION_SIGNATURE};

        let dir = tempfile::tempdir().unwrap();
        let inv = FixtureSource::new("h100x8").discover().unwrap();
        let (_, text) = spec::render(&inv, &SpecOptions::default()).unwrap();
        std::fs::write(dir.path().join("tessera.io-gpu.json"), text).unwrap();
        let keys = SigningKeys::new("k", [("k".into(), vec![5u8; 32])]).unwrap();
        let plugin = TesseraPlugin::new(PluginConfig {
            node: "n".into(),
            keys: keys.verifying(),
            cdi_dirs: vec![dir.path().to_path_buf()],
            enforcement: ShareEnforcement::None,
            mps: MpsLayout::default(),
            hook: HookLayout::default(),
            claims: Default::default(),
        });
        let g = &inv.gpus[0];
        let create = |name: &str, device: AllocatedDevice, core: &str| {
            let uid = format!("uid-{name}");
            let mut a = Allocation::new("n", &uid);
            a.containers.push(ContainerAllocation {
                name: "c".into(),
                role: tessera_core::request::ContainerRole::App,
                devices: vec![device],
            });
            let signed = keys.sign(&a);
            let mut pod = api::PodSandbox::new();
            pod.uid = uid;
            pod.name = name.into();
            pod.namespace = format!("team-{name}");
            pod.annotations.insert(ANNOTATION_ALLOCATION.into(), signed.allocation);
            pod.annotations
                .insert(ANNOTATION_ALLOCATION_SIGNATURE.into(), signed.signature);
            let mut ctr = api::Container::new();
            ctr.name = "c".into();
            ctr.id = format!("ctr-{name}");
            ctr.annotations
                .insert("tessera.io/allocated.gpu-core".into(), core.into());
            if core != "100" {
                ctr.annotations
                    .insert("tessera.io/allocated.gpu-memory".into(), "4".into());
            }
            plugin.adjust(&pod, &ctr)
        };
        create("first", AllocatedDevice::whole(g), "100").unwrap();
        let err = create("second", AllocatedDevice::whole(g), "100").unwrap_err();
        assert!(
            err.contains(&g.uuid) && err.contains("team-first/first") && err.contains("refusing a second grant"),
            "{err}"
        );
        let err = create("third", AllocatedDevice::share(g, 30, 4096), "30").unwrap_err();
        assert!(err.contains("as a whole card"), "{err}");
        // Shares side by side on another card.
        let other = &inv.gpus[1];
        create("s1", AllocatedDevice::share(other, 30, 4096), "30").unwrap();
        create("s2", AllocatedDevice::share(other, 30, 4096), "30").unwrap();
        // A whole card over live shares: refused too.
        assert!(create("w", AllocatedDevice::whole(other), "100").is_err());
        // The holder stops: its card is free on this node.
        plugin.stopped("ctr-first");
        create("second", AllocatedDevice::whole(g), "100").unwrap();
    }

    /// A key removed from the mounted Secret stops verifying at the next container, without a
    /// restart: the kubelet's atomic update (a new `..data` directory, the link swapped) is
    /// noticed, as is a plain directory losing the file.
    #[test]
    fn a_key_removed_from_the_secret_stops_verifying() {
        use std::os::unix::fs::symlink;
        use tessera_cdi_generator::spec::{self, SpecOptions};
        use tessera_core::handoff::{Allocation, ContainerAllocation, SigningKeys};
        use tessera_core::inventory::{FixtureSource, InventorySource};
        use tessera_core::names::{ANNOTATION_ALLOCATION, ANNOTATION_ALLOCATION_SIGNATURE};

        let inv = FixtureSource::new("h100x8").discover().unwrap();
        let (_, text) = spec::render(&inv, &SpecOptions::default()).unwrap();
        let old = SigningKeys::new("k1", [("k1".into(), vec![1u8; 32])]).unwrap();
        for kubelet_layout in [true, false] {
            let dir = tempfile::tempdir().unwrap();
            let (keys_dir, cdi_dir) = (dir.path().join("keys"), dir.path().join("cdi"));
            std::fs::create_dir_all(&keys_dir).unwrap();
            std::fs::create_dir_all(&cdi_dir).unwrap();
            std::fs::write(cdi_dir.join("tessera.io-gpu.json"), &text).unwrap();
            // As the kubelet writes a Secret volume: files in a timestamped directory, `..data`
            // linking to it, and each key a link through `..data`.
            let write = |generation: &str, keys: &[(&str, u8)]| {
                if kubelet_layout {
                    let data = keys_dir.join(generation);
                    std::fs::create_dir_all(&data).unwrap();
                    for (k, b) in keys {
                        std::fs::write(data.join(k), [*b; 32]).unwrap();
                    }
                    let tmp = keys_dir.join("..data_tmp");
                    symlink(generation, &tmp).unwrap();
                    std::fs::rename(&tmp, keys_dir.join("..data")).unwrap();
                    for e in std::fs::read_dir(&keys_dir).unwrap().flatten() {
                        let name = e.file_name().to_string_lossy().into_owned();
                        if !name.starts_with('.') && !keys.iter().any(|(k, _)| *k == name) {
                            std::fs::remove_file(e.path()).unwrap();
                        }
                    }
                    for (k, _) in keys {
                        let _ = symlink(format!("..data/{k}"), keys_dir.join(k));
                    }
                } else {
                    for e in std::fs::read_dir(&keys_dir).unwrap().flatten() {
                        std::fs::remove_file(e.path()).unwrap();
                    }
                    for (k, b) in keys {
                        std::fs::write(keys_dir.join(k), [*b; 32]).unwrap();
                    }
                }
            };
            write("..2026_11_24_01", &[("k1", 1), ("k2", 2)]);
            let plugin = TesseraPlugin::new(PluginConfig {
                node: "n".into(),
                keys: VerifyingKeys::from_dir(&keys_dir).unwrap(),
                cdi_dirs: vec![cdi_dir],
                enforcement: ShareEnforcement::None,
                mps: MpsLayout::default(),
                hook: HookLayout::default(),
                claims: Default::default(),
            })
            .reloading_keys_from(keys_dir.clone());
            let create = |n: usize| {
                let mut a = Allocation::new("n", format!("uid-{n}"));
                a.containers.push(ContainerAllocation {
                    name: "c".into(),
                    role: tessera_core::request::ContainerRole::App,
                    devices: vec![AllocatedDevice::whole(&inv.gpus[n])],
                });
                let signed = old.sign(&a);
                let mut pod = api::PodSandbox::new();
                pod.uid = format!("uid-{n}");
                pod.name = format!("p{n}");
                pod.annotations.insert(ANNOTATION_ALLOCATION.into(), signed.allocation);
                pod.annotations
                    .insert(ANNOTATION_ALLOCATION_SIGNATURE.into(), signed.signature);
                let mut ctr = api::Container::new();
                ctr.name = "c".into();
                ctr.id = format!("ctr-{n}");
                ctr.annotations
                    .insert("tessera.io/allocated.gpu-core".into(), "100".into());
                plugin.adjust(&pod, &ctr)
            };
            create(0).unwrap();
            // The Secret loses k1 (rotation's last step).
            std::thread::sleep(std::time::Duration::from_millis(20));
            write("..2026_11_24_02", &[("k2", 2)]);
            let err = create(1).unwrap_err();
            assert!(
                err.contains("unknown key \"k1\""),
                "kubelet layout {kubelet_layout}: {err}"
            );
        }
    }

    #[test]
    fn subscribes_only_to_old_events() {
        assert_eq!(event_mask(), 0x8 | 0x200 | 0x400);
        assert!(event_mask() <= 0x7FF);
    }
}
