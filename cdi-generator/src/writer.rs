//! Writes the spec file atomically (temp file + rename in the same directory) and only when
//! its content changed.

use std::io::Write as _;
use std::path::{Path, PathBuf};

/// Default CDI spec directory (the runtime-generated one; it wins over `/etc/cdi`).
pub const DEFAULT_CDI_DIR: &str = "/var/run/cdi";
/// Tessera's spec file name (`vendor-class`, as CDI suggests).
pub const SPEC_FILE: &str = "tessera.io-gpu.json";

/// What [`write_spec`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteOutcome {
    /// The file did not exist or differed, and was replaced.
    Written,
    /// The file already had this content; it was not touched.
    Unchanged,
    /// The node has no device to offer (a dynamic-MIG node whose instances are all gone): the
    /// file was removed.
    Removed,
}

/// A write that failed; the previous file is left as it was.
#[derive(Debug, thiserror::Error)]
#[error("cannot {op} {path}")]
pub struct WriteError {
    op: &'static str,
    path: PathBuf,
    #[source]
    source: std::io::Error,
}

fn err(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> WriteError {
    let path = path.to_path_buf();
    move |source| WriteError { op, path, source }
}

/// Writes `text` to `dir/file` atomically unless the file already holds exactly `text`.
pub fn write_spec(dir: &Path, file: &str, text: &str) -> Result<WriteOutcome, WriteError> {
    let path = dir.join(file);
    if std::fs::read(&path).is_ok_and(|old| old == text.as_bytes()) {
        return Ok(WriteOutcome::Unchanged);
    }
    std::fs::create_dir_all(dir).map_err(err("create directory", dir))?;
    // A dot-file without the .json suffix: CDI loaders never pick it up half-written.
    let tmp = dir.join(format!(".{file}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp).map_err(err("create", &tmp))?;
        f.write_all(text.as_bytes()).map_err(err("write", &tmp))?;
        f.sync_all().map_err(err("sync", &tmp))?;
        std::fs::rename(&tmp, &path).map_err(err("rename into place", &path))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map(|()| WriteOutcome::Written)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    #[test]
    fn writes_once_and_replaces_atomically() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(write_spec(dir.path(), SPEC_FILE, "a").unwrap(), WriteOutcome::Written);
        let ino = std::fs::metadata(dir.path().join(SPEC_FILE)).unwrap().ino();
        assert_eq!(write_spec(dir.path(), SPEC_FILE, "a").unwrap(), WriteOutcome::Unchanged);
        assert_eq!(
            std::fs::metadata(dir.path().join(SPEC_FILE)).unwrap().ino(),
            ino,
            "untouched"
        );
        assert_eq!(write_spec(dir.path(), SPEC_FILE, "b").unwrap(), WriteOutcome::Written);
        assert_ne!(
            std::fs::metadata(dir.path().join(SPEC_FILE)).unwrap().ino(),
            ino,
            "replaced by rename"
        );
        assert_eq!(std::fs::read_to_string(dir.path().join(SPEC_FILE)).unwrap(), "b");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "no temp files left: {names:?}");
    }

    #[test]
    fn a_failed_write_leaves_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        write_spec(dir.path(), SPEC_FILE, "old").unwrap();
        // The target is a directory now: rename fails, the temp file is removed.
        let blocked = dir.path().join("blocked");
        std::fs::create_dir_all(blocked.join(SPEC_FILE).join("x")).unwrap();
        assert!(write_spec(&blocked, SPEC_FILE, "new").is_err());
        assert_eq!(std::fs::read_dir(&blocked).unwrap().count(), 1);
        assert_eq!(std::fs::read_to_string(dir.path().join(SPEC_FILE)).unwrap(), "old");
    }
}
