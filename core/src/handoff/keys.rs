//! Cluster signing keys and the HMAC-SHA256 signature over the allocation annotation.
//!
//! Signature annotation: `v1.<key id>.<base64url(HMAC-SHA256(key, "tessera.io/allocation\n" || value))>`.
//! Keys rotate by adding a new key, making it active, and removing the old one once no pod
//! signed with it remains.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;
use thiserror::Error;

use super::{Allocation, HandoffError};

/// Domain separation: a MAC made for anything else never verifies as an allocation.
const CONTEXT: &[u8] = b"tessera.io/allocation\n";
/// Name of the file naming the active key, in a key directory.
pub const ACTIVE_KEY_FILE: &str = "active";
/// Shortest key accepted, in bytes.
pub const MIN_KEY_BYTES: usize = 32;

/// Why a key set could not be built.
#[derive(Debug, Error)]
pub enum KeyError {
    /// A key id outside `[A-Za-z0-9_-]{1,63}` (or the reserved `active`).
    #[error("key id {0:?} is invalid: use 1..=63 of A-Z a-z 0-9 _ -, not \"active\"")]
    BadKeyId(String),
    /// A key shorter than [`MIN_KEY_BYTES`].
    #[error("key {key_id:?} is {len} bytes; at least {MIN_KEY_BYTES} are required")]
    TooShort { key_id: String, len: usize },
    /// The active key id names no key.
    #[error("active key {0:?} is not among the keys")]
    NoActiveKey(String),
    /// Reading a key directory failed.
    #[error("cannot read key file {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The two annotation values that carry a signed allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedAllocation {
    /// `tessera.io/allocation`.
    pub allocation: String,
    /// `tessera.io/allocation-signature`.
    pub signature: String,
}

/// The cluster's signing keys: one active (signs) and any number that still verify.
#[derive(Clone)]
pub struct SigningKeys {
    active: String,
    keys: BTreeMap<String, Vec<u8>>,
}

impl std::fmt::Debug for SigningKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigningKeys")
            .field("active", &self.active)
            .field("key_ids", &self.keys.keys().collect::<Vec<_>>())
            .finish()
    }
}

fn valid_key_id(id: &str) -> bool {
    (1..=63).contains(&id.len())
        && id != ACTIVE_KEY_FILE
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn mac(key: &[u8], value: &[u8]) -> Hmac<Sha256> {
    let mut m = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes any key length");
    m.update(CONTEXT);
    m.update(value);
    m
}

impl SigningKeys {
    /// A key set; `active` must be one of `keys`.
    pub fn new(active: impl Into<String>, keys: impl IntoIterator<Item = (String, Vec<u8>)>) -> Result<Self, KeyError> {
        let active = active.into();
        let mut map = BTreeMap::new();
        for (id, key) in keys {
            if !valid_key_id(&id) {
                return Err(KeyError::BadKeyId(id));
            }
            if key.len() < MIN_KEY_BYTES {
                return Err(KeyError::TooShort {
                    key_id: id,
                    len: key.len(),
                });
            }
            map.insert(id, key);
        }
        if !map.contains_key(&active) {
            return Err(KeyError::NoActiveKey(active));
        }
        Ok(Self { active, keys: map })
    }

    /// Reads a key directory (a mounted Kubernetes Secret): one file per key, named by its id,
    /// holding the key bytes (a trailing newline is ignored); the file `active` holds the
    /// active key id. Hidden entries (the Secret volume's `..data` links) are skipped.
    pub fn from_dir(dir: &Path) -> Result<Self, KeyError> {
        let read = |path: PathBuf| std::fs::read(&path).map_err(|source| KeyError::Read { path, source });
        // A text key (`--from-literal`, `echo ... > k1`) loses its line end; a binary key
        // (`head -c 32 /dev/urandom`) keeps every byte, a final 0x0a or 0x0d included (one
        // random key in 128 ends so). Text: printable ASCII before the line end.
        let trim = |mut v: Vec<u8>| {
            let body = v.iter().rposition(|b| *b != b'\n' && *b != b'\r').map_or(0, |i| i + 1);
            if v[..body].iter().all(|b| b.is_ascii_graphic() || *b == b' ') {
                v.truncate(body);
            }
            v
        };
        let active = String::from_utf8_lossy(&trim(read(dir.join(ACTIVE_KEY_FILE))?))
            .trim()
            .to_string();
        let entries = std::fs::read_dir(dir).map_err(|source| KeyError::Read {
            path: dir.to_path_buf(),
            source,
        })?;
        let mut keys = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|source| KeyError::Read {
                path: dir.to_path_buf(),
                source,
            })?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') || name == ACTIVE_KEY_FILE || entry.path().is_dir() {
                continue;
            }
            keys.push((name, trim(read(entry.path())?)));
        }
        Self::new(active, keys)
    }

    /// The id of the key that signs.
    pub fn active_key_id(&self) -> &str {
        &self.active
    }

    /// Encodes and signs an allocation with the active key.
    pub fn sign(&self, allocation: &Allocation) -> SignedAllocation {
        let value = allocation.encode();
        let tag = mac(&self.keys[&self.active], value.as_bytes()).finalize().into_bytes();
        SignedAllocation {
            signature: format!("v1.{}.{}", self.active, URL_SAFE_NO_PAD.encode(tag)),
            allocation: value,
        }
    }

    /// Verifies the two annotation values and that the allocation is for `node` and `pod_uid`.
    /// The signature is checked over the exact bytes before anything in them is trusted.
    pub fn verify(
        &self,
        allocation: Option<&str>,
        signature: Option<&str>,
        node: &str,
        pod_uid: &str,
    ) -> Result<Allocation, HandoffError> {
        let value = allocation.ok_or(HandoffError::Missing)?;
        let signature = signature.ok_or(HandoffError::MissingSignature)?;
        let malformed = || HandoffError::MalformedSignature {
            value: signature.chars().take(100).collect(),
        };
        let rest = signature.strip_prefix("v1.").ok_or_else(malformed)?;
        let (key_id, tag) = rest.split_once('.').ok_or_else(malformed)?;
        let tag = URL_SAFE_NO_PAD.decode(tag).map_err(|_| malformed())?;
        if tag.len() != 32 || !valid_key_id(key_id) {
            return Err(malformed());
        }
        let key = self.keys.get(key_id).ok_or_else(|| HandoffError::UnknownKey {
            key_id: key_id.to_string(),
        })?;
        let expected = mac(key, value.as_bytes()).finalize().into_bytes();
        if !bool::from(expected.as_slice().ct_eq(&tag)) {
            return Err(HandoffError::BadSignature {
                key_id: key_id.to_string(),
            });
        }
        let a = Allocation::decode(value)?;
        if a.node != node {
            return Err(HandoffError::WrongNode {
                expected: node.to_string(),
                found: a.node,
            });
        }
        if a.pod_uid != pod_uid {
            return Err(HandoffError::WrongPod {
                expected: pod_uid.to_string(),
                found: a.pod_uid,
            });
        }
        Ok(a)
    }
}
