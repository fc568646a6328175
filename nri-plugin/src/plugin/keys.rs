//! The hand-off keys the plugin verifies with, read again when their Secret changes.
//!
//! A key added to the mounted Secret (rotation) starts verifying, and a key removed stops, at
//! the next container created after the kubelet updated the volume, without a restart; an
//! allocation signed with a key not loaded yet makes the plugin read the directory at once.

use std::path::PathBuf;
use std::sync::{Mutex, RwLock, RwLockReadGuard};

use tessera_core::handoff::{HandoffError, KeyDirStamp, VerifyingKeys};
use tessera_core::injection::InjectionError;
use tracing::{info, warn};

use super::TesseraPlugin;

/// The keys in use and where they come from.
pub(super) struct Keys {
    current: RwLock<VerifyingKeys>,
    /// Where the keys come from (a mounted Secret), when they are followed.
    dir: Option<PathBuf>,
    /// What the key directory looked like when its keys were last read.
    seen: Mutex<Option<KeyDirStamp>>,
}

impl Keys {
    pub(super) fn new(keys: VerifyingKeys) -> Self {
        Self {
            current: RwLock::new(keys),
            dir: None,
            seen: Mutex::new(None),
        }
    }

    /// The keys in use now.
    pub(super) fn current(&self) -> RwLockReadGuard<'_, VerifyingKeys> {
        self.current.read().unwrap_or_else(|p| p.into_inner())
    }

    fn replace(&self, fresh: VerifyingKeys) {
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = fresh;
    }

    /// Reads the keys again when the directory changed since they were read.
    fn refresh(&self) {
        let Some(dir) = &self.dir else { return };
        let now = KeyDirStamp::of(dir);
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        if seen.as_ref() == Some(&now) {
            return;
        }
        match VerifyingKeys::from_dir(dir) {
            Ok(fresh) => {
                info!(dir = %dir.display(), keys = ?fresh.key_ids().collect::<Vec<_>>(), "the hand-off keys changed: reloaded");
                self.replace(fresh);
                *seen = Some(now);
            }
            Err(e) => {
                warn!(dir = %dir.display(), error = %e, "cannot reload the hand-off keys; keeping the loaded ones")
            }
        }
    }

    /// Runs `verify` with the keys, fresh from their directory; once more after reading the
    /// directory again when it names a key not loaded yet (rotation).
    pub(super) fn verifying<T>(
        &self,
        verify: impl Fn(&VerifyingKeys) -> Result<T, InjectionError>,
    ) -> Result<T, InjectionError> {
        self.refresh();
        let attempt = || verify(&self.current());
        match attempt() {
            Err(InjectionError::Handoff {
                source: HandoffError::UnknownKey { key_id },
                ..
            }) if self.dir.is_some() => {
                let dir = self.dir.as_ref().expect("checked");
                match VerifyingKeys::from_dir(dir) {
                    Ok(fresh) => {
                        info!(key_id, dir = %dir.display(), "reloaded the hand-off keys");
                        self.replace(fresh);
                    }
                    Err(e) => warn!(dir = %dir.display(), error = %e, "cannot reload the hand-off keys"),
                }
                attempt()
            }
            r => r,
        }
    }
}

impl TesseraPlugin {
    /// Re-reads the keys from `dir` when it changed, and when an allocation is signed with a key
    /// not loaded yet, so that a key added to the mounted Secret (rotation) is picked up, and a
    /// key removed stops verifying, without a restart.
    pub fn reloading_keys_from(mut self, dir: PathBuf) -> Self {
        *self.keys.seen.lock().unwrap_or_else(|p| p.into_inner()) = Some(KeyDirStamp::of(&dir));
        self.keys.dir = Some(dir);
        self
    }
}
