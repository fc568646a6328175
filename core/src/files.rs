//! Small files the node agents share, written whole.
//!
//! A reader never sees half a file: the bytes go to a temporary file of a name no other writer
//! uses (this process's id and a counter), are synced, and the file is renamed over the old
//! one; the directory is synced after, so a crash or power loss leaves the old file or the new
//! one, never neither.

use std::io::Write as _;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

/// Temporary names in use by this process: each write takes its own.
static NEXT_TMP: AtomicU64 = AtomicU64::new(0);

/// Writes `bytes` to `path` in `dir` through a temporary file and a rename; the directory is
/// created with mode `dir_mode` when missing, the file gets `file_mode`. Writers racing on one
/// path each finish with a whole file (the last rename wins).
pub fn write_atomic(dir: &Path, path: &Path, bytes: &[u8], dir_mode: u32, file_mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
    std::fs::DirBuilder::new().recursive(true).mode(dir_mode).create(dir)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let n = NEXT_TMP.fetch_add(1, Ordering::Relaxed);
    let tmp = dir.join(format!(".{name}.tmp-{}-{n}", std::process::id()));
    let result = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(file_mode)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        sync_dir(dir)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Syncs directory `dir`, so that a rename or removal in it survives a crash.
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Several writers of one file, as the NRI plugin's concurrent container creations write a
    /// card's ceiling: every write succeeds and every read is one whole write. With one fixed
    /// temporary name, a writer's rename finds its file taken by another's (`ENOENT`), or a
    /// reader sees a file another writer truncated.
    #[test]
    fn writers_racing_on_one_file_each_write_it_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ceiling.json");
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            let reader = s.spawn(|| {
                let mut reads = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    if let Ok(text) = std::fs::read_to_string(&path) {
                        let v: serde_json::Value =
                            serde_json::from_str(&text).unwrap_or_else(|e| panic!("a torn file {text:?}: {e}"));
                        assert_eq!(v["pad"].as_str().map(str::len), Some(4096), "{text}");
                        reads += 1;
                    }
                }
                reads
            });
            let writers: Vec<_> = (0..4)
                .map(|w| {
                    let (dir, path) = (dir.path(), &path);
                    s.spawn(move || -> Result<(), String> {
                        for i in 0..200 {
                            let text = serde_json::json!({"writer": w, "i": i, "pad": "x".repeat(4096)}).to_string();
                            write_atomic(dir, path, text.as_bytes(), 0o755, 0o644)
                                .map_err(|e| format!("writer {w}, write {i}: {e}"))?;
                        }
                        Ok(())
                    })
                })
                .collect();
            let written: Vec<Result<(), String>> = writers.into_iter().map(|w| w.join().unwrap()).collect();
            stop.store(true, Ordering::Relaxed);
            let reads = reader.join();
            for w in written {
                w.unwrap();
            }
            assert!(reads.unwrap() > 0);
        });
        // No temporary file is left behind.
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(left, vec![std::ffi::OsString::from("ceiling.json")]);
    }
}
