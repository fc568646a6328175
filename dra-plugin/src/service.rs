//! Runs the plugin: the DRA service and the registration service on their sockets, the node's
//! cards read every poll, the slice republished when they change.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tessera_core::dra::{self, ClaimStore};
use tessera_core::inventory::{InventorySource, NodeInventory};
use tessera_proto::dra::dra_plugin_server::DraPluginServer;
use tessera_proto::drahealth::dra_resource_health_server::DraResourceHealthServer;
use tessera_proto::pluginregistration::registration_server::RegistrationServer;
use tokio::sync::watch;
use tracing::{info, warn};

use crate::authority;
use crate::driver::{ClaimSource, DraService, Preparer};
use crate::health::HealthService;
use crate::registration::{self, Registrar};
use crate::slices::{SlicePublisher, Synced};

/// The DRA socket's file name.
pub const DRA_SOCKET: &str = "dra.sock";

/// Settings.
#[derive(Clone)]
pub struct Config {
    /// This node's name (the pool's name).
    pub node: String,
    /// The kubelet's registry directory.
    pub registry_dir: PathBuf,
    /// The directory of the DRA socket.
    pub plugin_dir: PathBuf,
    /// Where claim markers are written (a CDI directory the runtime reads).
    pub cdi_dir: PathBuf,
    /// Where prepared claims are recorded.
    pub state_dir: PathBuf,
    /// MiB per step of a share's memory.
    pub memory_unit_mib: u64,
    /// How often the node's cards are read.
    pub poll: Duration,
    /// Creates and destroys MIG instances (dynamic MIG); `None`: the node creates none.
    pub partitioner: Option<Arc<dyn tessera_core::inventory::MigPartitioner>>,
    /// How long a prepare waits for the node's CDI spec to list an instance it created
    /// ([`crate::driver::CDI_WAIT`]).
    pub cdi_wait: Duration,
    /// The NRI plugin's records of what live containers were granted
    /// ([`tessera_core::granted::DEFAULT_GRANTS_DIR`]).
    pub grants_dir: PathBuf,
}

fn bind(path: &Path) -> std::io::Result<tokio::net::UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    tokio::net::UnixListener::bind(path)
}

/// Serves until `shutdown` resolves; the sockets are removed on the way out. `slices` is
/// `None` where no API server is reachable (tests of the kubelet side only).
pub async fn run(
    config: Config,
    source: Arc<dyn InventorySource + Send + Sync>,
    claims: Arc<dyn ClaimSource>,
    mut slices: Option<SlicePublisher>,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let (inventory_tx, inventory) = watch::channel::<Option<Arc<NodeInventory>>>(None);
    let (stop_tx, stop_rx) = watch::channel(false);
    let health = HealthService {
        node: config.node.clone(),
        inventory: inventory.clone(),
        stop: stop_rx.clone(),
    };
    let mut preparer = Preparer::new(
        &config.node,
        inventory,
        ClaimStore::new(&config.state_dir),
        config.cdi_dir.clone(),
        claims,
    )
    .reading_grants_from(tessera_core::granted::GrantStore::new(&config.grants_dir));
    if let Some(p) = config.partitioner.clone() {
        preparer = preparer
            .creating_instances(p, config.cdi_wait)
            .discovering_with(source.clone());
    }
    let preparer = Arc::new(preparer);
    preparer.set_aside_unreadable_records();
    preparer.clean_orphan_markers();
    // The DRA socket is served before the kubelet hears of it.
    let dra_socket = config.plugin_dir.join(DRA_SOCKET);
    let dra_listener = bind(&dra_socket).map_err(|e| anyhow::anyhow!("{}: {e}", dra_socket.display()))?;
    let reg_socket = config.registry_dir.join(registration::socket_name());
    let reg_listener = bind(&reg_socket).map_err(|e| anyhow::anyhow!("{}: {e}", reg_socket.display()))?;
    let (registrar, _status) = Registrar::new(&dra_socket);
    let serve = |stop: watch::Receiver<bool>| async move {
        let mut stop = stop;
        let _ = stop.wait_for(|s| *s).await;
    };
    let dra_task = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(DraPluginServer::new(DraService(preparer.clone())))
            .add_service(DraResourceHealthServer::new(health))
            .serve_with_incoming_shutdown(authority::front(dra_listener), serve(stop_rx.clone())),
    );
    let reg_task = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RegistrationServer::new(registrar))
            .serve_with_incoming_shutdown(authority::front(reg_listener), serve(stop_rx)),
    );
    info!(node = config.node, dra = %dra_socket.display(), registration = %reg_socket.display(), "serving");

    let mut tick = tokio::time::interval(config.poll);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    let (mut dra_task, mut reg_task) = (dra_task, reg_task);
    loop {
        tokio::select! {
            // A server that ends on its own leaves the kubelet nobody to talk to: stop, so that
            // the DaemonSet starts the plugin again.
            ended = &mut dra_task => anyhow::bail!("the DRA service stopped: {ended:?}"),
            ended = &mut reg_task => anyhow::bail!("the registration service stopped: {ended:?}"),
            _ = tick.tick() => {
                match source.discover() {
                    Ok(inv) => {
                        if inventory_tx.borrow().as_deref() != Some(&inv) {
                            inventory_tx.send_replace(Some(Arc::new(inv)));
                        }
                    }
                    Err(e) => warn!(error = %e, "the node's GPUs are unreadable; keeping the last reading"),
                }
                preparer.set_aside_unreadable_records();
                let inv = inventory_tx.borrow().clone();
                let Some(inv) = inv else { continue };
                preparer.clean_unfinished_carving(source.as_ref()).await;
                if let Some(publisher) = slices.as_mut() {
                    let ours = preparer.carved();
                    let mut count = 0;
                    let published = |dynamic_mig| {
                        let p = dra::publish(&inv, config.memory_unit_mib, dynamic_mig, &ours);
                        count = p.devices.len();
                        p
                    };
                    match publisher.sync(published).await {
                        Ok(Synced::Published(generation)) => info!(devices = count, generation, "ResourceSlices published"),
                        Ok(Synced::Unchanged | Synced::Withdrawn) => {}
                        Err(e) => warn!(error = %e, "cannot publish the ResourceSlice; tried again at the next poll"),
                    }
                }
            }
            () = &mut shutdown => break,
        }
    }
    let _ = stop_tx.send(true);
    for task in [dra_task, reg_task] {
        match tokio::time::timeout(Duration::from_secs(5), task).await {
            Ok(Ok(Err(e))) => warn!(error = %e, "a server stopped with an error"),
            Err(_) => warn!("a server did not stop within 5 s"),
            _ => {}
        }
    }
    for s in [&reg_socket, &dra_socket] {
        let _ = std::fs::remove_file(s);
    }
    info!("stopped; sockets removed");
    Ok(())
}
