//! The supervisor: keeps one endpoint per advertised resource, registers them with the
//! kubelet, re-registers when `kubelet.sock` is re-created (and retries a registration the kubelet did not take), follows inventory changes (MIG
//! reconfiguration adds and removes endpoints) and health events, and cleans up on SIGTERM.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use tessera_core::inventory::{FixtureSource, InventorySource, NodeInventory};
use tessera_proto::deviceplugin as api;
use tessera_proto::deviceplugin::registration_client::RegistrationClient;
use tokio::sync::{mpsc, watch};
use tonic::transport::{Endpoint as TonicEndpoint, Uri};
use tracing::{debug, info, warn};

use crate::health::{HealthEvent, HealthState};
use crate::resources::{self, Advertised};
use crate::server::{Endpoint, socket_name};

/// The kubelet's registration socket name.
pub const KUBELET_SOCKET: &str = "kubelet.sock";
/// Default plugin directory.
pub const DEFAULT_PLUGIN_DIR: &str = "/var/lib/kubelet/device-plugins";

/// Where the inventory comes from.
pub enum Source {
    /// A fixture file: re-read every poll; its `health_events` are injected in order.
    Fixture(FixtureSource),
    /// NVML, with XID events from its event set.
    Nvml(Box<dyn InventorySource + Send + Sync>),
}

/// Settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// Plugin directory (`kubelet.sock` and our sockets).
    pub plugin_dir: PathBuf,
    /// MiB per `tessera.io/gpu-memory` unit.
    pub memory_unit_mib: u64,
    /// Inventory poll interval.
    pub poll: Duration,
    /// A GPU quiet this long after its last critical event is healthy again.
    pub recovery: Duration,
}

/// How often a registration the kubelet did not take is tried again.
const REGISTRATION_RETRY: Duration = Duration::from_millis(500);

async fn register(dir: &Path, resource: &str) -> anyhow::Result<()> {
    let kubelet = dir.join(KUBELET_SOCKET);
    let channel = TonicEndpoint::try_from("http://[::]:50051")?
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let kubelet = kubelet.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(kubelet).await?)) }
        }))
        .await?;
    let mut client = RegistrationClient::new(channel);
    client
        .register(api::RegisterRequest {
            version: "v1beta1".into(),
            endpoint: socket_name(resource),
            resource_name: resource.into(),
            options: Some(api::DevicePluginOptions {
                pre_start_required: false,
                get_preferred_allocation_available: !resource.starts_with(tessera_core::names::RESOURCE_MIG_PREFIX),
            }),
        })
        .await?;
    Ok(())
}

/// Watches the plugin directory for `kubelet.sock` being created (a kubelet restart).
fn watch_kubelet(dir: &Path, tx: mpsc::UnboundedSender<()>) -> anyhow::Result<()> {
    use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
    let inotify = Inotify::init(InitFlags::IN_CLOEXEC)?;
    inotify.add_watch(dir, AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO)?;
    std::thread::Builder::new()
        .name("kubelet-watch".into())
        .spawn(move || {
            loop {
                let Ok(events) = inotify.read_events() else { return };
                for e in events {
                    if e.name.as_deref().is_some_and(|n| n == KUBELET_SOCKET) && tx.send(()).is_err() {
                        return;
                    }
                }
            }
        })?;
    Ok(())
}

struct State {
    config: Config,
    inventory: Option<Arc<NodeInventory>>,
    /// The inventory as the endpoints' preferred allocations see it.
    cards: watch::Sender<Option<Arc<NodeInventory>>>,
    health: HealthState,
    endpoints: BTreeMap<String, Endpoint>,
    /// Endpoints serving but not registered: the kubelet refused or was not answering yet
    /// (it creates kubelet.sock a moment before it serves on it). Retried until it takes them.
    unregistered: BTreeSet<String>,
    fixture_events_seen: usize,
}

impl State {
    fn advertised(&self) -> Advertised {
        self.inventory
            .as_ref()
            .map(|inv| resources::advertise(inv, &self.health, self.config.memory_unit_mib))
            .unwrap_or_default()
    }

    /// Brings endpoints in line with what is advertised; `restart` re-creates all of them.
    async fn reconcile(&mut self, restart: bool) {
        let advertised = self.advertised();
        let stale: Vec<String> = self
            .endpoints
            .keys()
            .filter(|r| restart || !advertised.contains_key(*r))
            .cloned()
            .collect();
        for r in stale {
            if let Some(e) = self.endpoints.remove(&r) {
                if !advertised.contains_key(&r) {
                    info!(resource = r, "resource gone: endpoint removed");
                }
                e.stop().await;
            }
        }
        for (resource, units) in advertised {
            if let Some(e) = self.endpoints.get(&resource) {
                if *e.devices.borrow() != units {
                    let unhealthy = units.iter().filter(|u| !u.healthy).count();
                    info!(resource, devices = units.len(), unhealthy, "device list changed");
                    let _ = e.devices.send(units);
                }
                continue;
            }
            let cards = self.cards.subscribe();
            match Endpoint::start(
                &self.config.plugin_dir,
                &resource,
                units,
                cards,
                self.config.memory_unit_mib,
            ) {
                Ok(e) => {
                    match register(&self.config.plugin_dir, &resource).await {
                        Ok(()) => {
                            info!(resource, socket = %e.socket.display(), "registered with the kubelet");
                            self.unregistered.remove(&resource);
                        }
                        Err(err) => {
                            warn!(resource, error = %err, "registration failed; retrying");
                            self.unregistered.insert(resource.clone());
                        }
                    }
                    self.endpoints.insert(resource, e);
                }
                Err(err) => warn!(resource, error = %err, "cannot serve the endpoint"),
            }
        }
    }

    /// Registers again the endpoints the kubelet has not taken yet.
    async fn retry_registrations(&mut self) {
        for resource in std::mem::take(&mut self.unregistered) {
            if !self.endpoints.contains_key(&resource) {
                continue;
            }
            match register(&self.config.plugin_dir, &resource).await {
                Ok(()) => info!(resource, "registered with the kubelet"),
                Err(err) => {
                    debug!(resource, error = %err, "registration failed again; retrying");
                    self.unregistered.insert(resource);
                }
            }
        }
    }

    fn poll(&mut self, source: &Source) {
        let inv = match source {
            Source::Fixture(f) => {
                match f.load() {
                    Ok(fixture) => {
                        let now = Instant::now();
                        for e in fixture.health_events.iter().skip(self.fixture_events_seen) {
                            let ev = if e.xid == 0 {
                                HealthEvent::Reset { uuid: e.uuid.clone() }
                            } else {
                                HealthEvent::Xid {
                                    uuid: e.uuid.clone(),
                                    xid: e.xid,
                                }
                            };
                            if self.health.apply(&ev, now) {
                                info!(uuid = e.uuid, xid = e.xid, "health event");
                            }
                        }
                        self.fixture_events_seen = fixture.health_events.len();
                    }
                    Err(err) => warn!(error = %err, "fixture unreadable"),
                }
                f.discover()
            }
            Source::Nvml(s) => s.discover(),
        };
        match inv {
            Ok(inv) => {
                if self.inventory.as_deref() != Some(&inv) {
                    let inv = Arc::new(inv);
                    self.cards.send_replace(Some(inv.clone()));
                    self.inventory = Some(inv);
                }
            }
            Err(err) => warn!(error = %err, "inventory unreadable; keeping the last one"),
        }
        for uuid in self.health.recover(Instant::now(), self.config.recovery) {
            info!(uuid, "quiet for the recovery period: healthy again");
        }
    }
}

/// Runs until `shutdown` resolves (or SIGTERM in the binary); removes its sockets on exit.
pub async fn run(
    config: Config,
    source: Source,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(&config.plugin_dir)?;
    let (kubelet_tx, mut kubelet_rx) = mpsc::unbounded_channel();
    watch_kubelet(&config.plugin_dir, kubelet_tx)?;
    let (health_tx, mut health_rx) = mpsc::unbounded_channel();
    if let Source::Nvml(_) = &source {
        if let Err(e) = crate::health::watch_nvml(health_tx) {
            warn!(error = %e, "no NVML health events");
        }
    } else {
        drop(health_tx);
    }
    let mut state = State {
        config: config.clone(),
        inventory: None,
        cards: watch::channel(None).0,
        health: HealthState::default(),
        endpoints: BTreeMap::new(),
        unregistered: BTreeSet::new(),
        fixture_events_seen: 0,
    };
    let mut retry = tokio::time::interval(REGISTRATION_RETRY);
    retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut tick = tokio::time::interval(config.poll);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                state.poll(&source);
                state.reconcile(false).await;
            }
            Some(()) = kubelet_rx.recv() => {
                info!("kubelet.sock re-created: re-registering every endpoint");
                state.reconcile(true).await;
            }
            _ = retry.tick(), if !state.unregistered.is_empty() => {
                state.retry_registrations().await;
            }
            Some(ev) = health_rx.recv() => {
                if state.health.apply(&ev, Instant::now()) {
                    info!(event = ?ev, "health event");
                    state.reconcile(false).await;
                }
            }
            () = &mut shutdown => break,
        }
    }
    for (_, e) in std::mem::take(&mut state.endpoints) {
        e.stop().await;
    }
    info!("stopped; sockets removed");
    Ok(())
}
