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

/// How often the watched paths' modification times are compared.
const MTIME_CHECK: Duration = Duration::from_millis(500);

/// What wakes the loop between polls: a change the kernel tells of at once (a claim's marker
/// in the CDI directory only where a card can have instances made: no other marker changes the
/// cards; the spec this generator writes not at all), and a change of the paths' modification
/// times, compared every [`MTIME_CHECK`] beside it (what the kernel does not tell of: a watch
/// that could not be made or went, which is made again once the paths are back; a fixture
/// swapped by a link; the spec removed by someone else).
struct Changes {
    paths: Vec<PathBuf>,
    /// `None` where the kernel does not tell.
    watch: Option<DirWatch>,
    /// The paths' modification times at the last check, or as a refresh left them.
    last: Option<Vec<Option<SystemTime>>>,
    cdi_dir: PathBuf,
}

/// The modification times of `paths` (`None` for one that cannot be read).
fn mtimes(paths: &[PathBuf]) -> Vec<Option<SystemTime>> {
    paths
        .iter()
        .map(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok())
        .collect()
}

impl Changes {
    fn new(paths: Vec<PathBuf>, cdi_dir: PathBuf) -> Self {
        let watch = if paths.is_empty() {
            None
        } else {
            DirWatch::new(&paths)
                .map_err(|e| warn!(error = %e, "changes are seen every 0.5 s, not at once"))
                .ok()
        };
        Self {
            paths,
            watch,
            last: None,
            cdi_dir,
        }
    }

    /// Waits for a change (where a card is `carvable`, claims' markers count); forever where
    /// nothing is watched. Cancel safe.
    async fn next(&mut self, carvable: bool) {
        if self.paths.is_empty() {
            return std::future::pending().await;
        }
        let Self {
            paths,
            watch,
            last,
            cdi_dir,
        } = self;
        let own = cdi_dir.join(writer::SPEC_FILE);
        let counts = |p: &PathBuf| {
            if *p == own {
                false
            } else if p == cdi_dir || p.parent() == Some(cdi_dir.as_path()) {
                carvable
            } else {
                true
            }
        };
        let told = async {
            let Some(w) = watch.as_mut() else {
                return std::future::pending().await;
            };
            loop {
                if w.changed().await?.iter().any(counts) {
                    return Ok::<_, std::io::Error>(());
                }
            }
        };
        let checked = async {
            loop {
                tokio::time::sleep(MTIME_CHECK).await;
                let now = mtimes(paths);
                if last.as_ref() != Some(&now) {
                    *last = Some(now);
                    return;
                }
            }
        };
        let lost = tokio::select! {
            r = told => r.err(),
            () = checked => None,
        };
        if let Some(e) = lost {
            warn!(error = %e, "changes are seen every 0.5 s, not at once");
            self.watch = None;
        } else if self.watch.is_none()
            && let Ok(w) = DirWatch::new(&self.paths)
        {
            info!("changes are seen at once again");
            self.watch = Some(w);
        }
    }

    /// Takes the paths as a refresh left them (its own spec written or removed is no change),
    /// where the kernel tells of what counts: a change it tells of during the refresh is still
    /// told.
    fn settle(&mut self) {
        if self.watch.is_some() {
            self.last = Some(mtimes(&self.paths));
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
    let mut changes = Changes::new(watch, config.cdi_dir.clone());
    // Until the cards are read, any marker may matter.
    let mut carvable = true;
    let mut driver_seen = None;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            () = changes.next(carvable) => {}
            _ = term.recv() => { info!("SIGTERM: exiting"); return Ok(()); }
            _ = tokio::signal::ctrl_c() => { info!("interrupted: exiting"); return Ok(()); }
        }
        let refreshed = generator.refresh(source.as_ref(), &config);
        changes.settle();
        match refreshed {
            Ok(Refresh { inventory, spec }) => {
                log_driver(&inventory, &mut driver_seen);
                carvable = inventory.gpus.iter().any(tessera_core::dra::carvable);
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

    /// Whether `changes` wakes within `ms` milliseconds.
    async fn wakes_within(changes: &mut Changes, carvable: bool, ms: u64) -> bool {
        tokio::time::timeout(Duration::from_millis(ms), changes.next(carvable))
            .await
            .is_ok()
    }

    /// Whether `changes` wakes at once: well before its modification-time check.
    async fn wakes(changes: &mut Changes, carvable: bool) -> bool {
        wakes_within(changes, carvable, 250).await
    }

    /// A claim's marker wakes the generator at once where a card is carvable; the spec the
    /// generator writes itself wakes it neither at once nor at the check after the refresh
    /// that wrote it, and someone else's removal of it is seen at the check.
    #[tokio::test]
    async fn a_marker_wakes_the_loop_at_once_and_its_own_spec_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let mut changes = Changes::new(vec![dir.path().to_path_buf()], dir.path().to_path_buf());
        assert!(changes.watch.is_some(), "inotify is not available here");
        // The first check of the modification times sees them as new.
        assert!(!wakes(&mut changes, true).await);
        changes.next(true).await;
        // A refresh writes the spec, and the loop settles.
        writer::write_spec(dir.path(), writer::SPEC_FILE, "{}").unwrap();
        changes.settle();
        assert!(!wakes_within(&mut changes, true, 1200).await, "woken by its own spec");
        let marker = dir.path().join("tessera.io-claim-u.json");
        tessera_core::files::write_atomic(dir.path(), &marker, b"{}", 0o755, 0o644).unwrap();
        assert!(wakes(&mut changes, true).await, "not woken at once by a claim's marker");
        changes.settle();
        std::fs::remove_file(dir.path().join(writer::SPEC_FILE)).unwrap();
        assert!(
            !wakes(&mut changes, true).await,
            "woken at once by its own spec's removal"
        );
        assert!(
            wakes_within(&mut changes, true, 2000).await,
            "its spec's removal not seen at the check"
        );
    }

    /// Where no card can have instances made, markers do not wake the generator at once (they
    /// cannot change the cards); the modification times are still compared.
    #[tokio::test]
    async fn markers_wait_for_the_check_where_no_card_is_carvable() {
        let dir = tempfile::tempdir().unwrap();
        let mut changes = Changes::new(vec![dir.path().to_path_buf()], dir.path().to_path_buf());
        changes.next(false).await;
        let marker = dir.path().join("tessera.io-claim-u.json");
        tessera_core::files::write_atomic(dir.path(), &marker, b"{}", 0o755, 0o644).unwrap();
        assert!(!wakes(&mut changes, false).await, "woken at once by a marker");
        changes.next(false).await;
    }

    /// A watched directory that goes leaves the modification-time check, which sees it back;
    /// the watch is then made again, and a marker wakes the loop at once as before.
    #[tokio::test]
    async fn a_cdi_directory_made_again_is_watched_again() {
        let dir = tempfile::tempdir().unwrap();
        let cdi = dir.path().join("cdi");
        std::fs::create_dir(&cdi).unwrap();
        let mut changes = Changes::new(vec![cdi.clone()], cdi.clone());
        changes.next(true).await;
        std::fs::remove_dir(&cdi).unwrap();
        changes.next(true).await;
        assert!(changes.watch.is_none(), "still waiting on a watch that went");
        std::fs::create_dir(&cdi).unwrap();
        tokio::time::timeout(Duration::from_secs(5), changes.next(true))
            .await
            .expect("the directory made again is not seen");
        assert!(changes.watch.is_some(), "not watched again");
        let marker = cdi.join("tessera.io-claim-u.json");
        tessera_core::files::write_atomic(&cdi, &marker, b"{}", 0o755, 0o644).unwrap();
        assert!(wakes(&mut changes, true).await, "not woken at once by a claim's marker");
    }
}
