//! What the store keeps of records it read never hides a change on disk.

use std::time::Duration;

use super::*;
use crate::dra::tests::{claim as allocated, result};
use crate::dra::{PreparedClaim, prepare};
use crate::inventory::{FixtureSource, InventorySource};

/// Claim `u-1` as prepared, reserved for `pods`.
fn claim(pods: &[&str]) -> PreparedClaim {
    let inv = FixtureSource::new("t4x2").discover().unwrap();
    prepare(&inv, "node-a", "u-1", &allocated(vec![result("gpu-0", &[])], pods)).unwrap()
}

fn pods(store: &ClaimStore) -> Option<Vec<String>> {
    store.get("u-1").unwrap().map(|c| c.pods)
}

#[test]
fn a_record_changed_on_disk_is_read_again() {
    let dir = tempfile::tempdir().unwrap();
    let store = ClaimStore::new(dir.path());
    store.put(&claim(&["p1"])).unwrap();
    assert_eq!(pods(&store), Some(vec!["p1".to_string()]));
    // Another handle (another process) replaces it: the first sees the new record.
    ClaimStore::new(dir.path()).put(&claim(&["p2"])).unwrap();
    assert_eq!(pods(&store), Some(vec!["p2".to_string()]));
    // Rewritten in place (same file, same size, later): read again.
    let path = dir.path().join("claims/u-1.json");
    std::thread::sleep(Duration::from_millis(30));
    let text = std::fs::read_to_string(&path).unwrap().replace("\"p2\"", "\"p3\"");
    std::fs::write(&path, text).unwrap();
    assert_eq!(pods(&store), Some(vec!["p3".to_string()]));
    // Spoiled in place: an error, not the record read before.
    std::thread::sleep(Duration::from_millis(30));
    std::fs::write(&path, b"{ not json").unwrap();
    assert_eq!(store.get("u-1").unwrap_err().kind(), std::io::ErrorKind::InvalidData);
    // Gone: gone, for every handle.
    std::fs::remove_file(&path).unwrap();
    assert_eq!(pods(&store), None);
    assert!(store.list().0.is_empty());
}
