//! The node's prepared-claim records: one JSON file per claim uid, for root only.

use std::collections::HashMap;
use std::io::Read as _;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::{DEFAULT_STATE_DIR, PreparedClaim, is_uid};

/// The node's prepared-claim records: one JSON file per claim uid, written whole (temporary
/// file and rename) in a directory only root can write.
///
/// Records read are kept with the identity of the file they came from (device, inode, size,
/// modification time): every write puts a new file in place, so a record is parsed again only
/// when its file changed, and a prepare that checks every record costs a `stat` per record,
/// not a parse. Clones share what was read. (A file rewritten in place, same size, within
/// the file system's timestamp granularity would not be seen: Tessera never writes so, and
/// only root can write the directory.)
#[derive(Debug, Clone)]
pub struct ClaimStore {
    dir: PathBuf,
    read: Arc<Mutex<HashMap<String, (FileStamp, PreparedClaim)>>>,
}

/// Which file a record was read from, and in what state.
type FileStamp = (u64, u64, u64, i64, i64);

fn stamp(m: &std::fs::Metadata) -> FileStamp {
    (m.dev(), m.ino(), m.size(), m.mtime(), m.mtime_nsec())
}

impl Default for ClaimStore {
    /// The records under [`DEFAULT_STATE_DIR`].
    fn default() -> Self {
        Self::new(Path::new(DEFAULT_STATE_DIR))
    }
}

impl ClaimStore {
    /// The records under `state_dir/claims`.
    pub fn new(state_dir: &Path) -> Self {
        Self {
            dir: state_dir.join("claims"),
            read: Arc::default(),
        }
    }

    /// The records' directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, uid: &str) -> Option<PathBuf> {
        is_uid(uid).then(|| self.dir.join(format!("{uid}.json")))
    }

    /// Claim `uid`'s record, if the node prepared it.
    pub fn get(&self, uid: &str) -> std::io::Result<Option<PreparedClaim>> {
        let Some(path) = self.path(uid) else { return Ok(None) };
        let mut file = match std::fs::File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                self.read.lock().unwrap_or_else(|p| p.into_inner()).remove(uid);
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        // The identity of the file opened, so that what is read and what is kept agree.
        let now = stamp(&file.metadata()?);
        if let Some((seen, claim)) = self.read.lock().unwrap_or_else(|p| p.into_inner()).get(uid)
            && *seen == now
        {
            return Ok(Some(claim.clone()));
        }
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        let claim: PreparedClaim = serde_json::from_slice(&bytes)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{}: {e}", path.display())))?;
        self.read
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(uid.to_string(), (now, claim.clone()));
        Ok(Some(claim))
    }

    /// Records `claim` (replacing an earlier record of it).
    pub fn put(&self, claim: &PreparedClaim) -> std::io::Result<()> {
        let path = self.path(&claim.uid).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("claim uid {:?} is invalid", claim.uid),
            )
        })?;
        let text = serde_json::to_vec_pretty(claim).map_err(std::io::Error::other)?;
        crate::files::write_atomic(&self.dir, &path, &text, 0o700, 0o600)
    }

    /// Forgets claim `uid` (no error when it was not recorded).
    pub fn remove(&self, uid: &str) -> std::io::Result<()> {
        let Some(path) = self.path(uid) else { return Ok(()) };
        match std::fs::remove_file(path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            Err(_) => Ok(()),
            // A removal lost to a crash would bring the claim back, holding its card.
            Ok(()) => crate::files::sync_dir(&self.dir),
        }
    }

    /// Every recorded claim (unreadable records are skipped and named in the error list).
    pub fn list(&self) -> (Vec<PreparedClaim>, Vec<String>) {
        let (mut claims, mut bad) = (Vec::new(), Vec::new());
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return (claims, bad);
        };
        let mut listed = std::collections::HashSet::new();
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(uid) = name.strip_suffix(".json") else {
                continue;
            };
            listed.insert(uid.to_string());
            match self.get(uid) {
                Ok(Some(c)) => claims.push(c),
                Ok(None) => {}
                Err(err) => bad.push(err.to_string()),
            }
        }
        // Records removed behind this store's back are forgotten too.
        self.read
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|uid, _| listed.contains(uid));
        claims.sort_by(|a, b| a.uid.cmp(&b.uid));
        (claims, bad)
    }
}

impl ClaimStore {
    /// Moves claim `uid`'s record, which cannot be read, out of the records into
    /// `unreadable/` beside them (kept for people): one bad file no longer stands in the way
    /// of every other claim's preparation, and the node's live containers still say which
    /// cards are in use. Returns where it went.
    pub fn set_aside(&self, uid: &str) -> std::io::Result<PathBuf> {
        let from = self.path(uid).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("claim uid {uid:?} is invalid"),
            )
        })?;
        let dir = self.dir.join("unreadable");
        {
            use std::os::unix::fs::DirBuilderExt as _;
            std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir)?;
        }
        let to = dir.join(format!("{uid}.json"));
        std::fs::rename(&from, &to)?;
        crate::files::sync_dir(&dir)?;
        crate::files::sync_dir(&self.dir)?;
        Ok(to)
    }

    /// The uids of the records whose content cannot be read (not a file that cannot be opened
    /// for now: too many open files, an I/O error).
    pub fn unreadable(&self) -> Vec<String> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut out: Vec<String> = entries
            .flatten()
            .filter_map(|e| {
                e.file_name()
                    .to_string_lossy()
                    .strip_suffix(".json")
                    .map(str::to_string)
            })
            .filter(|uid| {
                self.get(uid)
                    .is_err_and(|e| e.kind() == std::io::ErrorKind::InvalidData)
            })
            .collect();
        out.sort();
        out
    }
}

#[cfg(test)]
mod tests;
