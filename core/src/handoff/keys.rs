//! The keys over the allocation annotation and its signature.
//!
//! - `v2.<key id>.<base64url(Ed25519(private key, "tessera.io/allocation\n" || value))>`: the
//!   extender alone holds the private keys (PKCS#8 PEM, `openssl genpkey -algorithm ed25519`);
//!   nodes hold the public keys (SPKI PEM, `openssl pkey -pubout`) and can verify, never sign.
//! - `v1.<key id>.<base64url(HMAC-SHA256(key, ...))>`: the older shared secret, still verified
//!   while an install moves to Ed25519 (every holder of it can sign).
//!
//! Keys rotate by adding a new key, making it active, and removing the old one once no pod
//! signed with it remains. Key files are text (PEM) or, for HMAC, raw bytes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{Hmac, Mac};
use ring::signature::{ED25519, Ed25519KeyPair, KeyPair as _, UnparsedPublicKey};
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
    /// The key directory has no `active` file, or an empty one: no key is named to sign.
    #[error(
        "{}: no active key is named (the file is missing or empty; it holds the id of the key that signs, e.g. `k1`)",
        path.display()
    )]
    NoActive {
        /// The `active` file.
        path: PathBuf,
    },
    /// A PEM key that is not an Ed25519 private (PKCS#8) or public (SPKI) key.
    #[error("key {key_id:?} is not an Ed25519 key in PEM: {reason}")]
    BadPem { key_id: String, reason: String },
    /// The active key can only verify (a public key).
    #[error("active key {0:?} is a public key: signing needs its private key")]
    CannotSign(String),
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

/// What a key file holds, as a node's check reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyKind {
    /// An Ed25519 public key (SPKI PEM): verifies, cannot sign. What nodes hold.
    Ed25519Public,
    /// An Ed25519 private key (PKCS#8 PEM): signs. Only the extender may hold it.
    Ed25519Private,
    /// A shared HMAC secret (raw bytes): signs and verifies; the older kind, being moved from.
    HmacSecret,
}

/// One key: a shared HMAC secret, or an Ed25519 public key with, on the extender, its pair.
#[derive(Clone)]
enum Key {
    Hmac(Vec<u8>),
    Ed25519 {
        public: Vec<u8>,
        pair: Option<std::sync::Arc<Ed25519KeyPair>>,
    },
}

/// The SPKI DER prefix of an Ed25519 public key (RFC 8410): the 32 key bytes follow.
const ED25519_SPKI_PREFIX: [u8; 12] = [0x30, 0x2a, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x03, 0x21, 0x00];

impl Key {
    /// A key file's bytes: a PEM Ed25519 key, else an HMAC secret.
    fn parse(id: &str, bytes: Vec<u8>) -> Result<Self, KeyError> {
        let bad = |reason: &str| KeyError::BadPem {
            key_id: id.to_string(),
            reason: reason.to_string(),
        };
        let Some(text) = std::str::from_utf8(&bytes)
            .ok()
            .filter(|t| t.trim_start().starts_with("-----BEGIN "))
        else {
            if bytes.len() < MIN_KEY_BYTES {
                return Err(KeyError::TooShort {
                    key_id: id.to_string(),
                    len: bytes.len(),
                });
            }
            if let Some(what) = unarmoured_key(&bytes) {
                return Err(bad(&format!(
                    "it is {what} in base64 without its PEM lines (`-----BEGIN ...-----`): write the file \
                     `openssl` made, whole"
                )));
            }
            return Ok(Key::Hmac(bytes));
        };
        let (label, der) = pem_body(text).ok_or_else(|| bad("no PEM block"))?;
        match label.as_str() {
            "PRIVATE KEY" => {
                let pair = Ed25519KeyPair::from_pkcs8_maybe_unchecked(&der).map_err(|e| bad(&e.to_string()))?;
                Ok(Key::Ed25519 {
                    public: pair.public_key().as_ref().to_vec(),
                    pair: Some(std::sync::Arc::new(pair)),
                })
            }
            "PUBLIC KEY" => match der.strip_prefix(&ED25519_SPKI_PREFIX[..]) {
                Some(k) if k.len() == 32 => Ok(Key::Ed25519 {
                    public: k.to_vec(),
                    pair: None,
                }),
                _ => Err(bad("not an Ed25519 public key")),
            },
            other => Err(bad(&format!("a {other:?} block; want PRIVATE KEY or PUBLIC KEY"))),
        }
    }

    /// The same key without anything that signs.
    fn public(&self) -> Self {
        match self {
            Key::Ed25519 { public, .. } => Key::Ed25519 {
                public: public.clone(),
                pair: None,
            },
            hmac => hmac.clone(),
        }
    }
}

/// What an Ed25519 key in base64 DER without its PEM lines is (a Secret made from a key's
/// body alone), if `bytes` is one; random bytes (an HMAC secret) are none.
fn unarmoured_key(bytes: &[u8]) -> Option<&'static str> {
    use base64::engine::general_purpose::STANDARD;
    let text: String = std::str::from_utf8(bytes)
        .ok()?
        .chars()
        .filter(|c| !c.is_whitespace())
        .collect();
    let der = STANDARD.decode(text).ok()?;
    if der.starts_with(&ED25519_SPKI_PREFIX) {
        Some("an Ed25519 public key")
    } else if Ed25519KeyPair::from_pkcs8_maybe_unchecked(&der).is_ok() {
        Some("an Ed25519 private key")
    } else {
        None
    }
}

/// The first PEM block of `text`: its label and its bytes.
fn pem_body(text: &str) -> Option<(String, Vec<u8>)> {
    let start = text.find("-----BEGIN ")?;
    let rest = &text[start + 11..];
    let (label, rest) = rest.split_once("-----")?;
    let end = rest.find(&format!("-----END {label}-----"))?;
    let b64: String = rest[..end].chars().filter(|c| !c.is_whitespace()).collect();
    let der = base64::engine::general_purpose::STANDARD.decode(b64).ok()?;
    Some((label.to_string(), der))
}

/// Keys that verify allocations and cannot sign one: what the nodes hold (Ed25519 public keys,
/// and during a move from HMAC the shared secret, which is the one kind that could sign).
#[derive(Clone)]
pub struct VerifyingKeys {
    keys: BTreeMap<String, Key>,
}

impl std::fmt::Debug for VerifyingKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerifyingKeys")
            .field("key_ids", &self.keys.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// The cluster's signing keys: one active (signs) and any number that still verify.
#[derive(Clone)]
pub struct SigningKeys {
    active: String,
    keys: VerifyingKeys,
    signer: Key,
}

impl std::fmt::Debug for SigningKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigningKeys")
            .field("active", &self.active)
            .field("key_ids", &self.keys.keys.keys().collect::<Vec<_>>())
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

/// Key ids and their files' bytes.
type KeyFiles = Vec<(String, Vec<u8>)>;

/// Reads a key directory (a mounted Kubernetes Secret): one file per key, named by its id;
/// the file `active`, when present, names the key that signs. Hidden entries (the Secret
/// volume's `..data` links) are skipped.
fn read_dir(dir: &Path) -> Result<(Option<String>, KeyFiles), KeyError> {
    let read = |path: PathBuf| std::fs::read(&path).map_err(|source| KeyError::Read { path, source });
    // A text key (`--from-literal`, `echo ... > k1`) loses its line end; a binary key
    // (`head -c 32 /dev/urandom`) keeps every byte, a final 0x0a or 0x0d included (one random
    // key in 128 ends so). Text: printable ASCII before the line end.
    let trim = |mut v: Vec<u8>| {
        let body = v.iter().rposition(|b| *b != b'\n' && *b != b'\r').map_or(0, |i| i + 1);
        if v[..body]
            .iter()
            .all(|b| b.is_ascii_graphic() || *b == b' ' || *b == b'\n' || *b == b'\r')
        {
            v.truncate(body);
        }
        v
    };
    let active = match std::fs::read(dir.join(ACTIVE_KEY_FILE)) {
        Ok(v) => Some(String::from_utf8_lossy(&trim(v)).trim().to_string()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(source) => {
            return Err(KeyError::Read {
                path: dir.join(ACTIVE_KEY_FILE),
                source,
            });
        }
    };
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
    Ok((active, keys))
}

impl VerifyingKeys {
    /// A key set from key ids and key file bytes (PEM Ed25519 keys, else HMAC secrets).
    pub fn new(keys: impl IntoIterator<Item = (String, Vec<u8>)>) -> Result<Self, KeyError> {
        let mut map = BTreeMap::new();
        for (id, bytes) in keys {
            if !valid_key_id(&id) {
                return Err(KeyError::BadKeyId(id));
            }
            let key = Key::parse(&id, bytes)?;
            map.insert(id, key);
        }
        Ok(Self { keys: map })
    }

    /// What each key file of key directory `dir` holds (a node's check tells a public key from a
    /// private one, which no node should hold, and from an HMAC secret).
    pub fn kinds_in(dir: &Path) -> Result<Vec<(String, KeyKind)>, KeyError> {
        let (_, mut keys) = read_dir(dir)?;
        keys.sort();
        keys.into_iter()
            .map(|(id, bytes)| {
                let kind = match Key::parse(&id, bytes)? {
                    Key::Hmac(_) => KeyKind::HmacSecret,
                    Key::Ed25519 { pair: Some(_), .. } => KeyKind::Ed25519Private,
                    Key::Ed25519 { pair: None, .. } => KeyKind::Ed25519Public,
                };
                Ok((id, kind))
            })
            .collect()
    }

    /// Reads a key directory (see [`SigningKeys::from_dir`]); `active` is not needed, and a
    /// private key only lends its public half.
    pub fn from_dir(dir: &Path) -> Result<Self, KeyError> {
        let (_, keys) = read_dir(dir)?;
        let k = Self::new(keys)?;
        Ok(Self {
            keys: k.keys.iter().map(|(id, key)| (id.clone(), key.public())).collect(),
        })
    }

    /// The key ids held.
    pub fn key_ids(&self) -> impl Iterator<Item = &str> {
        self.keys.keys().map(String::as_str)
    }

    /// Verifies the two annotation values and that the allocation is for `node` and `pod_uid`.
    /// The signature is checked over the exact bytes before anything in them is trusted; a
    /// signature of one kind (`v1` HMAC, `v2` Ed25519) verifies only with a key of that kind.
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
        let (scheme, rest) = signature.split_once('.').ok_or_else(malformed)?;
        let (key_id, tag) = rest.split_once('.').ok_or_else(malformed)?;
        let tag = URL_SAFE_NO_PAD.decode(tag).map_err(|_| malformed())?;
        if !valid_key_id(key_id) {
            return Err(malformed());
        }
        let key = self.keys.get(key_id).ok_or_else(|| HandoffError::UnknownKey {
            key_id: key_id.to_string(),
        })?;
        let bad = || HandoffError::BadSignature {
            key_id: key_id.to_string(),
        };
        match (scheme, key) {
            ("v1", Key::Hmac(secret)) if tag.len() == 32 => {
                let expected = mac(secret, value.as_bytes()).finalize().into_bytes();
                if !bool::from(expected.as_slice().ct_eq(&tag)) {
                    return Err(bad());
                }
            }
            ("v2", Key::Ed25519 { public, .. }) if tag.len() == 64 => {
                let mut message = CONTEXT.to_vec();
                message.extend_from_slice(value.as_bytes());
                UnparsedPublicKey::new(&ED25519, public)
                    .verify(&message, &tag)
                    .map_err(|_| bad())?;
            }
            ("v1" | "v2", _) => return Err(bad()),
            _ => return Err(malformed()),
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

impl SigningKeys {
    /// A key set; `active` must be one of `keys` and able to sign (an HMAC secret, or an
    /// Ed25519 private key).
    pub fn new(active: impl Into<String>, keys: impl IntoIterator<Item = (String, Vec<u8>)>) -> Result<Self, KeyError> {
        let active = active.into();
        let keys = VerifyingKeys::new(keys)?;
        let signer = keys
            .keys
            .get(&active)
            .cloned()
            .ok_or_else(|| KeyError::NoActiveKey(active.clone()))?;
        if matches!(signer, Key::Ed25519 { pair: None, .. }) {
            return Err(KeyError::CannotSign(active));
        }
        Ok(Self { active, keys, signer })
    }

    /// Reads a key directory (a mounted Kubernetes Secret): one file per key, named by its id
    /// (PEM Ed25519 keys, or HMAC secrets; a trailing newline of a text key is ignored); the
    /// file `active` holds the active key id. Hidden entries (the Secret volume's `..data`
    /// links) are skipped.
    pub fn from_dir(dir: &Path) -> Result<Self, KeyError> {
        let (active, keys) = read_dir(dir)?;
        let active = active.filter(|a| !a.is_empty()).ok_or_else(|| KeyError::NoActive {
            path: dir.join(ACTIVE_KEY_FILE),
        })?;
        Self::new(active, keys)
    }

    /// The id of the key that signs.
    pub fn active_key_id(&self) -> &str {
        &self.active
    }

    /// The same keys, verifying only.
    pub fn verifying(&self) -> VerifyingKeys {
        VerifyingKeys {
            keys: self.keys.keys.iter().map(|(id, k)| (id.clone(), k.public())).collect(),
        }
    }

    /// Encodes and signs an allocation with the active key.
    pub fn sign(&self, allocation: &Allocation) -> SignedAllocation {
        let value = allocation.encode();
        let signature = match &self.signer {
            Key::Hmac(secret) => {
                let tag = mac(secret, value.as_bytes()).finalize().into_bytes();
                format!("v1.{}.{}", self.active, URL_SAFE_NO_PAD.encode(tag))
            }
            Key::Ed25519 { pair: Some(pair), .. } => {
                let mut message = CONTEXT.to_vec();
                message.extend_from_slice(value.as_bytes());
                format!("v2.{}.{}", self.active, URL_SAFE_NO_PAD.encode(pair.sign(&message)))
            }
            Key::Ed25519 { pair: None, .. } => unreachable!("SigningKeys::new refuses a public active key"),
        };
        SignedAllocation {
            signature,
            allocation: value,
        }
    }

    /// Verifies as [`VerifyingKeys::verify`] does.
    pub fn verify(
        &self,
        allocation: Option<&str>,
        signature: Option<&str>,
        node: &str,
        pod_uid: &str,
    ) -> Result<Allocation, HandoffError> {
        self.keys.verify(allocation, signature, node, pod_uid)
    }
}

/// A key directory's state, cheap to read at each use: a mounted Secret's `..data` link (the
/// kubelet swaps it when the Secret changes), else the directory's and its entries' names and
/// modification times (a plain directory). Holders re-read their keys when it changes, so a
/// key removed from the Secret stops verifying, and one added starts, without a restart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyDirStamp(
    Vec<(std::ffi::OsString, Option<std::time::SystemTime>)>,
    Option<PathBuf>,
);

impl KeyDirStamp {
    /// The directory's state now.
    pub fn of(dir: &Path) -> Self {
        if let Ok(target) = std::fs::read_link(dir.join("..data")) {
            return Self(Vec::new(), Some(target));
        }
        let mtime = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| (e.file_name(), mtime(&e.path())))
            .collect();
        entries.sort();
        entries.push((".".into(), mtime(dir)));
        Self(entries, None)
    }
}
