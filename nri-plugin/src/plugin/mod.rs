//! The NRI plugin service: what each container gets at creation, and the node's books after.
//!
//! CreateContainer verifies a container's grant (the pod's signed allocation, or the DRA
//! claims the kubelet handed it) and answers with the adjustment; StartContainer holds MPS's
//! one user per card and sets a share's memory limit on its cgroup where the driver has them;
//! Stop and Remove free what a container held; Synchronize (split syncs
//! included) rebuilds the books after a restart. Every generated method is overridden:
//! unhandled ones answer UNIMPLEMENTED, which lets newer runtimes fall back to StateChange.
//!
//! The parts: the hand-off keys ([`keys`]), the books of live containers with their grant
//! records and each card's MPS ceiling (`books`), the claims' reservations (`claims`), the MPS
//! user rule (`users`), the per-cgroup memory limits (`memory`).

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Mutex;

use async_trait::async_trait;
use tessera_core::enforcement::{
    HOOK_AGENT_IN_CONTAINER, HOOK_CONFIG_IN_CONTAINER, HOOK_STATE_IN_CONTAINER, HookLayout, MpsLayout, ShareEnforcement,
};
use tessera_core::handoff::VerifyingKeys;
use tessera_core::injection::{self, Injection, NodeContext};
use tessera_core::windows::CardWindow;
use tessera_proto::nri::api;
use tessera_proto::nri::api_ttrpc::Plugin;
use tracing::{info, warn};
use ttrpc::r#async::TtrpcContext;

use crate::adjust;
use crate::cdi::CdiResolver;

mod books;
mod claims;
pub mod keys;
mod memory;
mod refusal;
mod users;

pub use claims::{ApiReservations, Reservations};
pub use refusal::{CeilingNotHeld, MemoryNotHeld, Refusal};

/// A container Tessera gave GPUs to: whose it is and what it has (the node's grant record).
pub use tessera_core::granted::Granted as Tracked;

/// NRI event numbers.
pub mod events {
    /// CreateContainer.
    pub const CREATE_CONTAINER: u32 = 4;
    /// StartContainer.
    pub const START_CONTAINER: u32 = 6;
    /// StopContainer.
    pub const STOP_CONTAINER: u32 = 10;
    /// RemoveContainer.
    pub const REMOVE_CONTAINER: u32 = 11;
}

/// The subscription: only events 1..=11 (older runtimes reject higher bits).
pub fn event_mask() -> i32 {
    [
        events::CREATE_CONTAINER,
        events::START_CONTAINER,
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

/// The plugin's state, shared by all sessions (it survives reconnects).
pub struct TesseraPlugin {
    config: PluginConfig,
    keys: keys::Keys,
    cdi: Mutex<CdiResolver>,
    books: books::Books,
    sync: Mutex<(Vec<api::PodSandbox>, Vec<api::Container>)>,
    syncs: tokio::sync::watch::Sender<u64>,
    /// Hook mode: each hooked container's host-pid socket.
    pids: crate::pid_service::PidServices,
    reservations: claims::Reserved,
    /// The host's /proc (a starting share's user is read there).
    proc_root: PathBuf,
    /// Where the driver holds memory per cgroup: its limits, set on each share's container.
    per_cgroup: Option<memory::PerCgroup>,
}

/// How long a container's creation may take to decide, under containerd's 2 s
/// `plugin_request_timeout` (see `deploy/runtime/`): a claims lookup (300 ms) and an MPS
/// share's ceiling wait (1.5 s) fit in it.
const CREATE_DEADLINE: std::time::Duration = std::time::Duration::from_millis(1900);

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
    /// A plugin with `config`; its books live in memory only, no claim's reservation is looked
    /// up beyond the record's pods, and users are read under `/proc`.
    pub fn new(config: PluginConfig) -> Self {
        let cdi = Mutex::new(CdiResolver::new(config.cdi_dirs.clone()));
        let (syncs, _) = tokio::sync::watch::channel(0);
        Self {
            keys: keys::Keys::new(config.keys.clone()),
            config,
            cdi,
            books: books::Books::default(),
            sync: Mutex::new((Vec::new(), Vec::new())),
            syncs,
            pids: Default::default(),
            reservations: claims::Reserved::default(),
            proc_root: PathBuf::from("/proc"),
            per_cgroup: None,
        }
    }

    /// Keeps each container's grant in `store`, so that a restarted plugin rebuilds its books
    /// (and every card's MPS ceiling) from what it granted, and the DRA plugin sees which cards
    /// live containers use.
    pub fn recording_grants_in(mut self, store: tessera_core::granted::GrantStore) -> Self {
        self.books = books::Books::recorded(store);
        self
    }

    /// Asks `source` whether a claim is reserved for a pod the node's record does not list
    /// (a claim shared by pods scheduled after it was prepared).
    pub fn looking_up_reservations(mut self, source: std::sync::Arc<dyn Reservations>) -> Self {
        self.reservations = claims::Reserved::with(source);
        self
    }

    /// Holds each share's memory on its container's cgroup through `limits` (the driver's,
    /// r615+), the host's cgroup v2 hierarchy being at `cgroup_root`.
    pub fn holding_memory_per_cgroup(
        mut self,
        limits: std::sync::Arc<dyn tessera_node::memory_limits::CgroupMemoryLimits>,
        cgroup_root: PathBuf,
    ) -> Self {
        self.per_cgroup = Some(memory::PerCgroup { limits, cgroup_root });
        self
    }

    /// Reads a starting share's user under `proc_root` (the host's /proc).
    pub fn reading_users_under(mut self, proc_root: PathBuf) -> Self {
        self.proc_root = proc_root;
        self
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
            // The daemon holds each process; the hook holds the processes together.
            ShareEnforcement::Mps => self
                .config
                .mps
                .ready(uuid, std::time::SystemTime::now())
                .and_then(|()| self.config.hook.ready()),
            ShareEnforcement::Hook => self.config.hook.ready(),
            ShareEnforcement::None | ShareEnforcement::Unknown => Ok(()),
        };
        let marks = tessera_core::dra::marked_claims(env);
        if !marks.is_empty() {
            // DRA: the requests the kubelet handed the container, as the node recorded them.
            let keys = self.keys.current();
            let ctx = NodeContext {
                node: &self.config.node,
                keys: &keys,
                enforcement: self.config.enforcement,
                share_ready: &ready,
            };
            let reserved = |claim: &tessera_core::dra::PreparedClaim| self.reservations.holds(claim, &pod.uid);
            return injection::decide_claims(
                &ctx,
                &self.config.claims,
                &pod.namespace,
                container,
                ctr_annotations,
                &marks,
                &reserved,
            );
        }
        self.keys.verifying(|keys| {
            let ctx = NodeContext {
                node: &self.config.node,
                keys,
                enforcement: self.config.enforcement,
                share_ready: &ready,
            };
            injection::decide(&ctx, &pod.uid, pod_annotations, container, ctr_annotations)
        })
    }

    /// Counts completed Synchronize calls (one per connection to a runtime).
    pub fn synchronized(&self) -> tokio::sync::watch::Receiver<u64> {
        self.syncs.subscribe()
    }

    /// Container id -> injected UUIDs, as the plugin knows it.
    pub fn injected(&self) -> HashMap<String, String> {
        self.books.snapshot().into_iter().map(|(id, t)| (id, t.uuids)).collect()
    }

    /// Container id -> the containers Tessera gave GPUs to.
    pub fn tracked(&self) -> HashMap<String, Tracked> {
        self.books.snapshot()
    }

    /// The CreateContainer decision and adjustment.
    pub fn adjust(
        &self,
        pod: &api::PodSandbox,
        container: &api::Container,
    ) -> Result<api::ContainerAdjustment, Refusal> {
        let pod_annotations: BTreeMap<String, String> =
            pod.annotations.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        let ctr_annotations: BTreeMap<String, String> = container
            .annotations
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let grant = match self.decide(pod, &pod_annotations, &container.name, &ctr_annotations, &container.env)? {
            Injection::Deny => return Ok(adjust::deny(container)),
            Injection::Grant(grant) => grant,
        };
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
            .map_err(|_| Refusal::CdiPoisoned)?
            .resolve(&grant.cdi_devices)
            .map_err(|source| Refusal::Resolve {
                container: container.name.clone(),
                devices: grant.cdi_devices.clone(),
                source: Box::new(source),
            })?;
        let mps = grant.enforced_by == Some(ShareEnforcement::Mps);
        let tracked = Tracked {
            uuids: grant.uuids.join(","),
            namespace: pod.namespace.clone(),
            pod: pod.name.clone(),
            pod_uid: pod.uid.clone(),
            container: container.name.clone(),
            devices: grant.devices.clone(),
            stopped: false,
            mps_share: grant.share.clone().filter(|_| mps),
            claims: grant.claims.clone(),
            user: None,
            // Held on the cgroup only where the node enforces shares (not `none`, which runs
            // them unenforced and says so).
            cgroup_memory: self.cgroup_memory_of(
                grant
                    .share
                    .as_ref()
                    .filter(|_| grant.enforced_by.is_some_and(ShareEnforcement::enforces)),
            ),
            // On hook nodes a share's compute is a window of its card's time, given beside
            // the card's other shares' windows as the books admit it.
            window: grant
                .share
                .as_ref()
                .and_then(|l| CardWindow::for_share(grant.enforced_by, l)),
        };
        let tracked = self.books.admit(&container.id, tracked)?;
        if mps && let Some(limits) = &grant.share {
            self.set_ceiling(&limits.uuid);
        }
        let mut adj = adjust::grant(&grant, &edits, &container.env);
        if let Some(mode) = grant.enforced_by.filter(|m| m.preloads_hook())
            && let Some(limits) = &grant.share
        {
            // The container's limits, read-only; the accounting its processes share, in a
            // small tmpfs of its own; the socket that tells each process its host pid. On hook
            // nodes its processes launch in the window the books gave it; on MPS nodes the
            // daemon caps each process's SMs and the hook has the container's processes take
            // turns on the card (NVML gives MPS clients' SM use to the server, so no throttle
            // could measure them).
            let files = self
                .config
                .hook
                .prepare(&container.id, limits, mode, tracked.window.as_ref().map(|w| &w.window))
                .map_err(|source| Refusal::HookConfig {
                    container: container.name.clone(),
                    dir: self.config.hook.root.clone(),
                    source,
                })?;
            adj.mounts
                .push(adjust::bind(&files.config, HOOK_CONFIG_IN_CONTAINER, true));
            adj.mounts.push(adjust::tmpfs(
                HOOK_STATE_IN_CONTAINER,
                tessera_core::enforcement::HOOK_STATE_TMPFS_KIB,
            ));
            self.pids
                .serve(&container.id, &files.agent)
                .map_err(|source| Refusal::PidSocket {
                    container: container.name.clone(),
                    dir: files.agent.clone(),
                    source,
                })?;
            adj.mounts
                .push(adjust::bind(&files.agent, HOOK_AGENT_IN_CONTAINER, true));
        }
        Ok(adj)
    }

    /// CreateContainer: the claims' reservations looked up first (they may need the API
    /// server), then the decision, then, for an MPS share, the wait until its card's daemon
    /// holds a ceiling that covers it.
    async fn create(
        &self,
        pod: &api::PodSandbox,
        container: &api::Container,
    ) -> Result<api::ContainerAdjustment, Refusal> {
        let marks = tessera_core::dra::marked_claims(&container.env);
        if !marks.is_empty() {
            self.reservations
                .look_up(&self.config.claims, (&pod.uid, &pod.namespace), &marks)
                .await;
        }
        let adj = self.adjust(pod, container)?;
        let share = self.books.get(&container.id).and_then(|t| t.mps_share);
        if let Some(limits) = share
            && let Err(source) = self.ceiling_held(&limits, books::CEILING_WAIT).await
        {
            self.forget(Some(container));
            return Err(Refusal::Ceiling {
                container: container.name.clone(),
                source: Box::new(source),
            });
        }
        Ok(adj)
    }
}

impl TesseraPlugin {
    /// StartContainer, however the runtime sends it.
    fn start(&self, pod: &api::PodSandbox, container: &api::Container) -> ttrpc::Result<()> {
        let started = self.starting(container).and_then(|()| self.limit_memory(container));
        started.map_err(|refusal| {
            let msg = refusal.to_string();
            warn!(
                pod = pod.name,
                container = container.name,
                error = msg,
                "refusing to start container"
            );
            status(ttrpc::Code::PERMISSION_DENIED, msg)
        })
    }
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
        drop(buffered);
        self.rebuild(&pods, &containers);
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
        // Decided within the runtime's patience or refused: a plugin that answers late is
        // dropped by the runtime, which then creates containers without it.
        let decided = tokio::time::timeout(CREATE_DEADLINE, self.create(&pod, &container))
            .await
            .unwrap_or_else(|_| {
                self.forget(Some(&container));
                Err(Refusal::Late {
                    container: container.name.clone(),
                    ms: CREATE_DEADLINE.as_millis(),
                })
            });
        match decided {
            Ok(adj) => {
                let mut resp = api::CreateContainerResponse::new();
                resp.adjust = Some(adj).into();
                Ok(resp)
            }
            Err(refusal) => {
                let msg = refusal.to_string();
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
        // Runtimes before NRI 0.12 send StartContainer and RemoveContainer here.
        match req.event.value() {
            e if e == events::REMOVE_CONTAINER as i32 => self.forget(req.container.as_ref()),
            e if e == events::START_CONTAINER as i32 => {
                let (pod, container) = (req.pod.unwrap_or_default(), req.container.unwrap_or_default());
                self.start(&pod, &container)?;
            }
            _ => {}
        }
        Ok(api::Empty::new())
    }

    async fn remove_container(&self, _: &TtrpcContext, req: api::ContainerEvent) -> ttrpc::Result<api::Empty> {
        self.forget(req.container.as_ref());
        Ok(api::Empty::new())
    }

    async fn start_container(&self, _: &TtrpcContext, req: api::ContainerEvent) -> ttrpc::Result<api::Empty> {
        let (pod, container) = (req.pod.unwrap_or_default(), req.container.unwrap_or_default());
        self.start(&pod, &container)?;
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

    async fn post_start_container(&self, _: &TtrpcContext, _: api::ContainerEvent) -> ttrpc::Result<api::Empty> {
        unimplemented("PostStartContainer")
    }

    async fn post_update_container(&self, _: &TtrpcContext, _: api::ContainerEvent) -> ttrpc::Result<api::Empty> {
        unimplemented("PostUpdateContainer")
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod window_tests;
