//! The signing keys read from their directory, with an `active` file that names no key said so.

use std::path::Path;

use tessera_core::handoff::{ACTIVE_KEY_FILE, KeyError, SigningKeys};

/// Reads the signing keys in `dir` (a mounted Secret). When the `active` file is missing, empty
/// or names no key file, the error names the file, what it holds and the keys there are.
pub fn signing_keys(dir: &Path) -> Result<SigningKeys, String> {
    SigningKeys::from_dir(dir).map_err(|e| {
        let id = match e {
            KeyError::NoActiveKey(id) => id,
            KeyError::NoActive { .. } => String::new(),
            e => return e.to_string(),
        };
        let active = dir.join(ACTIVE_KEY_FILE);
        let held = match key_files(dir).as_slice() {
            [] => "there is no key file".to_string(),
            files => format!("the key files are {}", files.join(", ")),
        };
        let what = if id.is_empty() && !active.exists() {
            "is missing".to_string()
        } else if id.is_empty() {
            "is empty".to_string()
        } else {
            format!("names {id:?}, which is no key file there")
        };
        format!(
            "{} {what}: it must hold the id of the key that signs ({held})",
            active.display()
        )
    })
}

/// The key files' names in `dir`, sorted (the Secret volume's hidden entries left out).
fn key_files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.') && n != ACTIVE_KEY_FILE)
        .collect();
    names.sort();
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "0123456789abcdef0123456789abcdef";

    #[test]
    fn an_active_file_that_names_no_key_is_said_so() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("k1"), SECRET).unwrap();
        let active = d.join("active");
        let err = |what: &str| {
            format!(
                "{} {what}: it must hold the id of the key that signs (the key files are k1)",
                active.display()
            )
        };
        assert_eq!(signing_keys(d).unwrap_err(), err("is missing"));
        std::fs::write(&active, "").unwrap();
        assert_eq!(signing_keys(d).unwrap_err(), err("is empty"));
        std::fs::write(&active, "\n").unwrap();
        assert_eq!(signing_keys(d).unwrap_err(), err("is empty"));
        std::fs::write(&active, "k2\n").unwrap();
        assert_eq!(
            signing_keys(d).unwrap_err(),
            err("names \"k2\", which is no key file there")
        );
        std::fs::write(&active, "k1\n").unwrap();
        assert_eq!(signing_keys(d).unwrap().active_key_id(), "k1");
    }
}
