//! The `run` loop: regenerate when the inventory changes (poll at an interval, and at once
//! when a watched path changes), write atomically, publish, log what changed.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use tessera_core::inventory::{InventorySource, NodeInventory};
use tessera_node::dirwatch::DirWatch;
use tracing::{error, info, warn};

use crate::spec::{self, CdiSpec, SpecOptions};
use crate::writer::{self, WriteOutcome};

/// Daemon settings.
#[derive(Debug, Clone)]
pub struct DaemonConfig {
    /// CDI spec directory.
    pub cdi_dir: PathBuf,
    /// Spec options.
    pub spec: SpecOptions,
    /// Poll interval.
    pub interval: Duration,
    /// Node name to publish the inventory on (`None`: do not publish).
    pub node_name: Option<String>,
    /// Mount the driver as one bundle (see [`crate::bundle`]).
    pub bundle: Option<BundleConfig>,
    /// Where this process sees the host's `/`: a spec is written only when every path it
    /// mounts exists there. `None` skips that check (fixture specs in tests, which name files
    /// of no machine).
    pub check_host_paths: Option<PathBuf>,
    /// How the driver holds share memory, published with the inventory (`None`: not said).
    pub share_memory: Option<tessera_core::inventory::ShareMemory>,
}

/// Where driver bundles are made.
#[derive(Debug, Clone)]
pub struct BundleConfig {
    /// The bundles' directory (a host path, writable here at the same path).
    pub root: PathBuf,
    /// Where this process sees the host's `/` (to read the driver files).
    pub host_root: PathBuf,
}

/// One regeneration step's result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Generation {
    /// Whether the file was written.
    pub outcome: WriteOutcome,
    /// Device names added since the previous spec.
    pub added: Vec<String>,
    /// Device names removed since the previous spec.
    pub removed: Vec<String>,
}

/// Keeps the last spec to report changes.
#[derive(Debug, Default)]
pub struct Generator {
    last: Option<CdiSpec>,
    last_inventory: Option<NodeInventory>,
}

/// One pass: the inventory read, and what became of the spec.
pub struct Refresh {
    /// The inventory (published even when the spec is refused: it says why).
    pub inventory: NodeInventory,
    /// The spec written (or unchanged), or why not; the previous file stays on error.
    pub spec: anyhow::Result<Generation>,
}

impl Generator {
    /// Discovers, renders and writes once. On any error the previous spec file is untouched.
    pub fn step(
        &mut self,
        source: &dyn InventorySource,
        config: &DaemonConfig,
    ) -> anyhow::Result<(Generation, NodeInventory)> {
        let r = self.refresh(source, config)?;
        Ok((r.spec?, r.inventory))
    }

    /// Discovers the inventory, then renders and writes the spec from it.
    pub fn refresh(&mut self, source: &dyn InventorySource, config: &DaemonConfig) -> anyhow::Result<Refresh> {
        let inventory = source.discover()?;
        let spec = self.write(&inventory, config);
        Ok(Refresh { inventory, spec })
    }

    fn write(&mut self, inventory: &NodeInventory, config: &DaemonConfig) -> anyhow::Result<Generation> {
        let mut opts = config.spec.clone();
        if let Some(b) = &config.bundle
            && inventory.driver_check().is_ok()
        {
            opts.driver_bundle = Some(crate::bundle::prepare(inventory, &b.host_root, &b.root)?);
        }
        let (spec, text) = match spec::render(inventory, &opts) {
            // A node whose cards are in MIG mode with no instance left (dynamic MIG makes them
            // per claim): no spec, since a CDI spec holds at least one device, rather than one
            // naming instances that are gone.
            Err(spec::SpecError::Empty) if inventory.gpus.iter().any(tessera_core::dra::carvable) => {
                let path = config.cdi_dir.join(writer::SPEC_FILE);
                let outcome = match std::fs::remove_file(&path) {
                    Ok(()) => WriteOutcome::Removed,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => WriteOutcome::Unchanged,
                    Err(e) => return Err(anyhow::anyhow!("cannot remove {}: {e}", path.display())),
                };
                let removed = self
                    .last
                    .take()
                    .map(|s| s.devices.into_iter().map(|d| d.name).collect())
                    .unwrap_or_default();
                self.last_inventory = Some(inventory.clone());
                return Ok(Generation {
                    outcome,
                    added: vec![],
                    removed,
                });
            }
            r => r?,
        };
        if let Some(root) = &config.check_host_paths {
            let missing = spec::missing_host_paths(&spec, &opts, root);
            if !missing.is_empty() {
                return Err(spec::SpecError::MissingHostPaths(missing).into());
            }
        }
        let outcome = writer::write_spec(&config.cdi_dir, writer::SPEC_FILE, &text)?;
        let names = |s: &CdiSpec| s.devices.iter().map(|d| d.name.clone()).collect::<BTreeSet<_>>();
        let before = self.last.as_ref().map(names).unwrap_or_default();
        let after = names(&spec);
        let generation = Generation {
            outcome,
            added: after.difference(&before).cloned().collect(),
            removed: before.difference(&after).cloned().collect(),
        };
        self.last = Some(spec);
        self.last_inventory = Some(inventory.clone());
        Ok(generation)
    }
}

/// Logs where the driver was found when that changes (root, version, file count).
fn log_driver(inventory: &NodeInventory, last: &mut Option<(PathBuf, String, usize)>) {
    let now = (
        inventory.driver_root.clone(),
        inventory.driver_version.clone(),
        inventory.driver_files.len(),
    );
    if last.as_ref() != Some(&now) {
        info!(
            root = %now.0.display(),
            version = now.1,
            files = now.2,
            libraries = inventory.driver_files.iter().filter(|f| f.kind == tessera_core::inventory::DriverFileKind::Library).count(),
            "driver files found"
        );
        *last = Some(now);
    }
}

/// How often watched paths' modification times are compared where the kernel cannot tell
/// of their changes.
const MTIME_CHECK: Duration = Duration::from_millis(500);

/// What wakes the loop between polls: a change of a watched path (other than the spec this
/// generator writes), told by the kernel, or seen in the paths' modification times every
/// [`MTIME_CHECK`] where it cannot be told (no inotify instance left to the user).
enum Changes {
    Nothing,
    Told {
        watch: DirWatch,
        own: PathBuf,
    },
    Polled {
        paths: Vec<PathBuf>,
        last: Option<Vec<Option<SystemTime>>>,
    },
}

impl Changes {
    fn new(paths: Vec<PathBuf>, own: PathBuf) -> Self {
        if paths.is_empty() {
            return Self::Nothing;
        }
        match DirWatch::new(&paths) {
            Ok(watch) => Self::Told { watch, own },
            Err(e) => {
                warn!(error = %e, "watched paths are checked every 0.5 s instead");
                Self::Polled { paths, last: None }
            }
        }
    }

    /// Waits for a change; forever where nothing is watched. Cancel safe.
    async fn next(&mut self) {
        if let Self::Told { watch, own } = self {
            loop {
                match watch.changed().await {
                    Ok(paths) if paths.iter().any(|p| p != own) => return,
                    Ok(_) => {}
                    Err(e) => {
                        warn!(error = %e, "watched paths are checked every 0.5 s instead");
                        let paths = watch.paths();
                        *self = Self::Polled { paths, last: None };
                        return;
                    }
                }
            }
        }
        let Self::Polled { paths, last } = self else {
            return std::future::pending().await;
        };
        loop {
            tokio::time::sleep(MTIME_CHECK).await;
            let now: Vec<_> = paths
                .iter()
                .map(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok())
                .collect();
            if last.as_ref() != Some(&now) {
                *last = Some(now);
                return;
            }
        }
    }
}

/// Runs until SIGTERM/SIGINT.
pub async fn run(
    source: Box<dyn InventorySource + Send + Sync>,
    watch: Vec<PathBuf>,
    config: DaemonConfig,
) -> anyhow::Result<()> {
    let mut generator = Generator::default();
    let client = if config.node_name.is_some() {
        crate::publish::cluster_client().await
    } else {
        None
    };
    if config.node_name.is_some() && client.is_none() {
        info!("no cluster to publish to (neither in a pod nor a kubeconfig): the inventory is not published");
    }
    let mut published: Option<NodeInventory> = None;
    let mut ticker = tokio::time::interval(config.interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The DRA plugin writes a claim's marker into the CDI directory right after it made the
    // claim's MIG instance: the cards are read again at once rather than at the next poll.
    if let Err(e) = std::fs::create_dir_all(&config.cdi_dir) {
        warn!(dir = %config.cdi_dir.display(), error = %e, "cannot create the CDI directory");
    }
    let mut changes = Changes::new(watch, config.cdi_dir.join(writer::SPEC_FILE));
    let mut driver_seen = None;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            () = changes.next() => {}
            _ = term.recv() => { info!("SIGTERM: exiting"); return Ok(()); }
            _ = tokio::signal::ctrl_c() => { info!("interrupted: exiting"); return Ok(()); }
        }
        match generator.refresh(source.as_ref(), &config) {
            Ok(Refresh { inventory, spec }) => {
                log_driver(&inventory, &mut driver_seen);
                match spec {
                    Ok(g) if g.outcome == WriteOutcome::Written => {
                        info!(added = ?g.added, removed = ?g.removed, dir = %config.cdi_dir.display(), "CDI spec written");
                    }
                    Ok(g) if g.outcome == WriteOutcome::Removed => info!(
                        removed = ?g.removed,
                        "the cards in MIG mode have no instance left (dynamic MIG makes them per claim): CDI spec removed until one exists"
                    ),
                    Ok(_) => {}
                    Err(e) => error!(
                        error = format!("{e:#}"),
                        "no CDI spec written; GPU containers cannot start on this node until this is fixed"
                    ),
                }
                if let (Some(client), Some(node)) = (&client, &config.node_name)
                    && published.as_ref() != Some(&inventory)
                {
                    match crate::publish::publish(
                        client.clone(),
                        node,
                        &inventory,
                        config.spec.enforcement,
                        config.share_memory.as_ref(),
                    )
                    .await
                    {
                        Ok(()) => {
                            info!(node, "inventory published");
                            published = Some(inventory);
                        }
                        Err(e) => warn!(node, error = %e, "publishing the inventory failed; retrying next poll"),
                    }
                }
            }
            Err(e) => warn!(
                error = format!("{e:#}"),
                "regeneration failed; the previous spec is left in place"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `changes` wakes within half a second.
    async fn wakes(changes: &mut Changes) -> bool {
        tokio::time::timeout(Duration::from_millis(500), changes.next())
            .await
            .is_ok()
    }

    /// A claim's marker wakes the generator at once (not at the next check), and the spec the
    /// generator writes itself does not wake it again.
    #[tokio::test]
    async fn a_marker_wakes_the_loop_and_its_own_spec_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let own = dir.path().join(writer::SPEC_FILE);
        let mut changes = Changes::new(vec![dir.path().to_path_buf()], own.clone());
        assert!(matches!(changes, Changes::Told { .. }), "inotify is not available here");
        writer::write_spec(dir.path(), writer::SPEC_FILE, "{}").unwrap();
        assert!(!wakes(&mut changes).await, "woken by its own spec");
        let marker = dir.path().join("tessera.io-claim-u.json");
        tessera_core::files::write_atomic(dir.path(), &marker, b"{}", 0o755, 0o644).unwrap();
        let t = std::time::Instant::now();
        assert!(wakes(&mut changes).await, "not woken by a claim's marker");
        // Checked every MTIME_CHECK, a change is seen a quarter of a second late on average.
        assert!(t.elapsed() < Duration::from_millis(200), "{:?}", t.elapsed());
        std::fs::remove_file(&marker).unwrap();
        assert!(wakes(&mut changes).await, "not woken by a marker's removal");
    }
}
