//! The books of live containers the plugin gave GPUs to, their grant records and MPS ceilings.
//!
//! Each admitted container is booked in memory and, when the plugin keeps grant records, in
//! the node's [`GrantStore`] too. A card's MPS ceiling is the largest of its live shares; the
//! supervisor sets it on the card's daemon. After a restart the books are rebuilt from the
//! grant records of the containers still there, or from their verified sources: never from
//! what a container carries in its environment, which its tenant writes.

use std::collections::HashMap;
use std::sync::Mutex;

use tessera_core::enforcement::{MpsCeiling, ShareEnforcement, ShareLimits};
use tessera_core::granted::{GrantStore, double_grant};
use tessera_core::injection::NodeContext;
use tessera_core::windows::Window;
use tessera_proto::nri::api;
use tracing::{info, warn};

use super::{CeilingNotHeld, Refusal, TesseraPlugin, Tracked};

/// How long a share's creation waits for its card's MPS daemon to take its limits.
/// Under containerd's `plugin_request_timeout` (2 s in deploy/runtime/): the refusal must reach
/// the runtime. The supervisor looks at the wanted ceiling every 100 ms.
pub(super) const CEILING_WAIT: std::time::Duration = std::time::Duration::from_millis(1500);

/// Container id -> what it was granted, and where that is recorded.
#[derive(Default)]
pub(super) struct Books {
    live: Mutex<HashMap<String, Tracked>>,
    store: Option<GrantStore>,
}

impl Books {
    /// Books whose grants are recorded in `store`.
    pub(super) fn recorded(store: GrantStore) -> Self {
        Self {
            live: Mutex::default(),
            store: Some(store),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Tracked>> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn record(&self, id: &str, t: &Tracked) {
        if let Some(store) = &self.store
            && let Err(e) = store.put(id, t)
        {
            warn!(container = id, error = %e, "cannot record the container's grant");
        }
    }

    fn unrecord(&self, id: &str) {
        if let Some(store) = &self.store
            && let Err(e) = store.remove(id)
        {
            warn!(container = id, error = %e, "cannot remove the container's grant record");
        }
    }

    /// Books container `id`, unless a live container of another pod holds one of its devices
    /// in a way that excludes it ([`double_grant`]): the error says which.
    /// A share that asks for a window of its card's time ([`Tracked::window`], empty) gets one
    /// here, beside the windows of the card's other live shares.
    pub(super) fn admit(&self, id: &str, mut t: Tracked) -> Result<Tracked, Refusal> {
        let mut live = self.lock();
        if let Some(e) = double_grant(
            live.iter()
                .filter(|(held, _)| *held != id)
                .map(|(k, v)| (k.as_str(), v)),
            &t.pod_uid,
            &t.container,
            &t.devices,
            &t.claims,
        ) {
            return Err(Refusal::DoubleGrant(e));
        }
        if let Some(w) = t.window.as_mut().filter(|w| w.window.is_empty()) {
            let taken = live
                .iter()
                .filter(|(held, other)| *held != id && !other.stopped)
                .filter_map(|(_, other)| other.window.as_ref())
                .filter(|o| o.uuid == w.uuid)
                .map(|o| &o.window);
            w.window = Window::allocate(taken, w.percent);
        }
        // The record is how a restarted plugin, and the DRA plugin, know the container holds its
        // devices: a grant that cannot be recorded is not made.
        if let Some(store) = &self.store {
            store.put(id, &t).map_err(|source| Refusal::Record {
                container: t.container.clone(),
                dir: store.dir().to_path_buf(),
                source,
            })?;
        }
        live.insert(id.to_string(), t.clone());
        Ok(t)
    }

    /// What container `id` was granted.
    pub(super) fn get(&self, id: &str) -> Option<Tracked> {
        self.lock().get(id).cloned()
    }

    /// Every booked container.
    pub(super) fn snapshot(&self) -> HashMap<String, Tracked> {
        self.lock().clone()
    }

    /// Changes container `id`'s booking with `change`; returns it after.
    pub(super) fn update(&self, id: &str, change: impl FnOnce(&mut Tracked)) -> Option<Tracked> {
        let mut live = self.lock();
        let t = live.get_mut(id)?;
        change(t);
        let t = t.clone();
        self.record(id, &t);
        Some(t)
    }

    /// Notes that container `id`, a share of card `card`, runs as `uid`, unless another live
    /// share of the card runs as another user: then that one (`container of pod`) and its uid.
    pub(super) fn claim_user(&self, id: &str, card: &str, uid: u32) -> Result<(), (String, u32)> {
        let mut live = self.lock();
        let other = live.iter().find_map(|(other, t)| {
            let same_card = t.mps_share.as_ref().is_some_and(|s| s.uuid == card);
            match t.user {
                Some(u) if other != id && !t.stopped && same_card && u != uid => {
                    Some((format!("container {} of pod {}", t.container, t.pod_key()), u))
                }
                _ => None,
            }
        });
        if let Some(o) = other {
            return Err(o);
        }
        if let Some(t) = live.get_mut(id) {
            t.user = Some(uid);
            let t = t.clone();
            self.record(id, &t);
        }
        Ok(())
    }

    /// Forgets container `id`; returns what it had.
    pub(super) fn remove(&self, id: &str) -> Option<Tracked> {
        let gone = self.lock().remove(id);
        self.unrecord(id);
        gone
    }

    /// Replaces every booking with `rebuilt` (after a sync), recording each and dropping the
    /// records of containers gone.
    pub(super) fn replace(&self, rebuilt: HashMap<String, Tracked>) {
        let mut live = self.lock();
        if let Some(store) = &self.store {
            store.retain(&rebuilt.keys().cloned().collect());
        }
        for (id, t) in &rebuilt {
            self.record(id, t);
        }
        *live = rebuilt;
    }

    /// The recorded grant of container `id`, if the books keep records.
    fn recorded_grant(&self, id: &str) -> Option<Tracked> {
        let store = self.store.as_ref()?;
        match store.get(id) {
            Ok(t) => t,
            Err(e) => {
                warn!(container = id, error = %e, "the container's grant record is unreadable");
                None
            }
        }
    }
}

impl TesseraPlugin {
    /// Marks a container stopped: the node's metrics no longer count it, and its card's MPS
    /// ceiling no longer covers it.
    pub fn stopped(&self, id: &str) {
        let Some(t) = self.books.update(id, |t| t.stopped = true) else {
            return;
        };
        if let Some(s) = t.mps_share {
            self.set_ceiling(&s.uuid);
        }
        self.unlimit_memory(id, t.cgroup_memory);
    }

    pub(super) fn forget(&self, container: Option<&api::Container>) {
        if let Some(c) = container {
            let gone = self.books.remove(&c.id);
            if let Some(s) = gone.as_ref().and_then(|t| t.mps_share.as_ref()) {
                self.set_ceiling(&s.uuid);
            }
            self.unlimit_memory(&c.id, gone.and_then(|t| t.cgroup_memory));
            if self.config.enforcement.preloads_hook() {
                self.pids.stop(&c.id);
                let _ = std::fs::remove_dir_all(self.config.hook.container_dir(&c.id));
            }
        }
    }

    /// The ceiling card `uuid`'s MPS daemon should hold: the largest of its live shares.
    pub fn ceiling(&self, uuid: &str) -> MpsCeiling {
        let books = self.books.snapshot();
        MpsCeiling::of(
            books
                .values()
                .filter(|t| !t.stopped)
                .filter_map(|t| t.mps_share.as_ref())
                .filter(|s| s.uuid == uuid),
        )
    }

    /// Writes card `uuid`'s ceiling for the supervisor to set on its daemon.
    pub(super) fn set_ceiling(&self, uuid: &str) {
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
    pub async fn ceiling_held(&self, limits: &ShareLimits, within: std::time::Duration) -> Result<(), CeilingNotHeld> {
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
                return Err(CeilingNotHeld {
                    uuid: limits.uuid.clone(),
                    core: limits.core_limit,
                    memory_mib: limits.memory_mib,
                    ms: within.as_millis(),
                    held,
                });
            }
            tokio::time::sleep(std::time::Duration::from_millis(25)).await;
        }
    }

    /// What a container found running at a sync was granted: its grant record, else what its
    /// pod's verified allocation or its DRA records give it (as at its creation). `None` for a
    /// container Tessera gave nothing.
    fn regrant(&self, c: &api::Container, pod: Option<&api::PodSandbox>) -> Option<Tracked> {
        if let Some(t) = self.books.recorded_grant(&c.id) {
            return Some(t);
        }
        let pod = pod?;
        let keys = self.keys.current();
        let ctx = NodeContext {
            node: &self.config.node,
            keys: &keys,
            enforcement: self.config.enforcement,
            share_ready: &|_| Ok(()),
        };
        let annotations = pod.annotations.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        let marks = tessera_core::dra::marked_claims(&c.env);
        let tessera_core::injection::Regrant { devices, share, claims } = tessera_core::injection::regrant(
            &ctx,
            (&self.config.claims, &|claim| self.reservations.holds(claim, &pod.uid)),
            (&pod.uid, &pod.namespace),
            &annotations,
            &c.name,
            &marks,
        )?;
        let mps = self.config.enforcement == ShareEnforcement::Mps;
        Some(Tracked {
            uuids: devices.iter().map(|d| d.uuid()).collect::<Vec<_>>().join(","),
            namespace: pod.namespace.clone(),
            pod: pod.name.clone(),
            pod_uid: pod.uid.clone(),
            container: c.name.clone(),
            devices,
            stopped: false,
            mps_share: share.filter(|_| mps),
            claims,
            user: None,
            // Granted again to a container already running: its limit, if one was set, stays
            // on its cgroup until that goes.
            cgroup_memory: None,
            // Its window, as its hook configuration still says (no other share is given it).
            window: self.config.hook.window_of(&c.id),
        })
    }

    /// Rebuilds the books from the containers the runtime reports (a sync after the plugin or
    /// the runtime restarted): each container's grant as recorded or verified again, every
    /// card's MPS ceiling from the live shares, the hook files of containers gone removed.
    pub(super) fn rebuild(&self, pods: &[api::PodSandbox], containers: &[api::Container]) {
        let pods: HashMap<&str, &api::PodSandbox> = pods.iter().map(|p| (p.id.as_str(), p)).collect();
        let rebuilt: HashMap<String, Tracked> = containers
            .iter()
            .filter_map(|c| {
                let mut t = self.regrant(c, pods.get(c.pod_sandbox_id.as_str()).copied())?;
                t.stopped = c.state.value() == api::ContainerState::CONTAINER_STOPPED as i32;
                Some((c.id.clone(), t))
            })
            .collect();
        info!(containers = containers.len(), with_gpus = rebuilt.len(), "synchronized");
        let live: std::collections::HashSet<String> = containers.iter().map(|c| c.id.clone()).collect();
        if self.config.enforcement.preloads_hook() {
            // Removals missed while disconnected: drop the hook files of containers gone.
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
        // A pod granted a claim's devices is reserved for it while it lives (its reservation
        // was checked at the grant): a restart during an API outage keeps it so.
        for t in rebuilt.values() {
            for claim in t.claims.keys() {
                self.reservations.learn(claim, &t.pod_uid);
            }
        }
        let live_pods = pods.values().map(|p| p.uid.clone()).collect();
        self.reservations.retain(&self.config.claims, &live_pods);
        self.books.replace(rebuilt);
        if self.config.enforcement == ShareEnforcement::Mps {
            // Shares that ended while disconnected: every card's ceiling from the live ones.
            for uuid in self.config.mps.cards() {
                self.set_ceiling(&uuid);
            }
        }
    }
}
