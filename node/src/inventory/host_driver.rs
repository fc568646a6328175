//! A fixture's GPUs with the driver files found on this machine, as a real node would have
//! them: how Tessera runs on a machine without a GPU against NVIDIA's real user space.

use std::path::PathBuf;

use tessera_core::inventory::{FixtureSource, InventoryError, InventorySource, NodeInventory};

use crate::driver::{DriverSearch, discover};

/// The fixture's cards; the driver (root, version, files, and why it cannot serve containers)
/// found under the fixture's driver root, read below `host_root`, instead of its list.
#[derive(Debug, Clone)]
pub struct FixtureWithHostDriver {
    /// The fixture (its `driver_root`, when set, is the root searched).
    pub fixture: FixtureSource,
    /// The machine's root as this process sees it (`/`, or `/host` in a container).
    pub host_root: PathBuf,
}

impl InventorySource for FixtureWithHostDriver {
    fn discover(&self) -> Result<NodeInventory, InventoryError> {
        let mut inv = self.fixture.discover()?;
        let driver = discover(&DriverSearch {
            host_root: self.host_root.clone(),
            driver_root: self.fixture.driver_root.clone(),
            ..Default::default()
        });
        inv.driver_error = driver.check().err().map(|e| e.to_string());
        if let Some(v) = driver.version {
            inv.driver_version = v;
        }
        inv.driver_root = driver.root;
        inv.driver_files = driver.files;
        Ok(inv)
    }
}
