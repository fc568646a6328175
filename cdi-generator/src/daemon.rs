//! The `run` loop: regenerate when the inventory changes (poll at an interval, and at once
//! when a fixture file changes), write atomically, publish, log what changed.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use tessera_core::inventory::{InventorySource, NodeInventory};
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
    let mut last_mtime = None;
    let mut driver_seen = None;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = tokio::time::sleep(Duration::from_millis(500)), if !watch.is_empty() => {
                // Cheap change check between polls of the fixture file, and of the CDI
                // directory: the DRA plugin writes a claim's marker there right after it made
                // the claim's MIG instance, which is then read at once rather than at the next
                // poll.
                let m: Vec<_> = watch.iter().map(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok()).collect();
                if Some(&m) == last_mtime.as_ref() { continue; }
                last_mtime = Some(m);
            }
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
