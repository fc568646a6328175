//! A GPU node on disk for end-to-end tests: a built-in fixture's inventory with its driver
//! files written under `<root>/driver` and its device nodes created under `<root>/host`.

use std::path::{Path, PathBuf};

use tessera_core::inventory::{FixtureSource, InventorySource, NodeInventory};
use tessera_node::inventory::create_device_nodes;

/// Where [`fake_node`] puts things.
pub struct FakeNodePaths {
    /// Host directory of the (fake) driver files.
    pub driver_root: PathBuf,
    /// Host directory holding `dev/` with the device nodes.
    pub dev_root: PathBuf,
}

impl FakeNodePaths {
    /// The layout under `root`.
    pub fn under(root: &Path) -> Self {
        Self {
            driver_root: root.join("driver"),
            dev_root: root.join("host"),
        }
    }
}

/// Discovers `fixture` with its driver files under `root`, writes them (placeholder content)
/// and creates its device nodes.
pub fn fake_node(fixture: &str, root: &Path) -> anyhow::Result<NodeInventory> {
    let paths = FakeNodePaths::under(root);
    let inv = FixtureSource {
        fixture: fixture.into(),
        driver_root: Some(paths.driver_root),
    }
    .discover()?;
    for f in &inv.driver_files {
        let p = inv.host_path(f);
        std::fs::create_dir_all(p.parent().expect("driver files have a directory"))?;
        std::fs::write(&p, b"fake")?;
    }
    create_device_nodes(&inv, &paths.dev_root)?;
    Ok(inv)
}
