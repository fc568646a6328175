//! Creates an inventory's device nodes under a root directory, for end-to-end tests on machines
//! without a GPU: real character devices with the inventory's majors and minors.

use std::path::{Path, PathBuf};

use nix::sys::stat::{Mode, SFlag, makedev, mknod};

use tessera_core::inventory::{InventoryError, NodeInventory};

/// Creates every device node of `inventory` under `root` (e.g. `root/dev/nvidia0`), replacing
/// what is there, and returns their paths. Needs `CAP_MKNOD` (root).
pub fn create_device_nodes(inventory: &NodeInventory, root: &Path) -> Result<Vec<PathBuf>, InventoryError> {
    let mut created = Vec::new();
    for node in inventory.all_device_nodes() {
        let rel = node.path.strip_prefix("/").unwrap_or(&node.path);
        let path = root.join(rel);
        let io = |op, source| InventoryError::Io {
            op,
            path: path.clone(),
            source,
        };
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| io("create directory for", e))?;
        }
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io("remove", e)),
        }
        mknod(
            &path,
            SFlag::S_IFCHR,
            Mode::from_bits_truncate(0o666),
            makedev(u64::from(node.major), u64::from(node.minor)),
        )
        .map_err(|errno| io("mknod", std::io::Error::from(errno)))?;
        created.push(path);
    }
    Ok(created)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};

    use tessera_core::inventory::{FixtureSource, InventorySource as _};

    use super::*;

    #[test]
    fn creates_real_character_devices() {
        let inv = FixtureSource::new("a100-mig").discover().unwrap();
        let root = tempfile::tempdir().unwrap();
        let created = create_device_nodes(&inv, root.path()).expect("mknod needs root, as in CI");
        assert_eq!(created.len(), inv.all_device_nodes().len());
        let meta = std::fs::metadata(root.path().join("dev/nvidia-caps/nvidia-cap22")).unwrap();
        assert!(meta.file_type().is_char_device());
        assert_eq!((libc::major(meta.rdev()), libc::minor(meta.rdev())), (509, 22));
        // Idempotent: a second run replaces the nodes.
        create_device_nodes(&inv, root.path()).unwrap();
    }
}
