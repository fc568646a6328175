use proptest::prelude::*;

use super::*;
use crate::request::ContainerRole;

fn keys() -> SigningKeys {
    SigningKeys::new(
        "k2",
        [("k1".to_string(), vec![1u8; 32]), ("k2".to_string(), vec![2u8; 40])],
    )
    .unwrap()
}

fn sample() -> Allocation {
    let mut a = Allocation::new("node-a", "uid-1");
    a.core_limit = Some(60);
    a.containers.push(ContainerAllocation {
        name: "train".into(),
        role: ContainerRole::App,
        devices: vec![
            AllocatedDevice::Gpu {
                uuid: "GPU-aaa".into(),
                index: 0,
                minor: 0,
                core_percent: 30,
                memory_mib: 8192,
                exclusive: false,
            },
            AllocatedDevice::Mig {
                uuid: "MIG-bbb".into(),
                profile: "1g.5gb".parse().unwrap(),
                parent_uuid: "GPU-ccc".into(),
                parent_index: 1,
                gi: 9,
                ci: 0,
            },
        ],
    });
    a
}

#[test]
fn sign_then_verify_round_trips() {
    let k = keys();
    let s = k.sign(&sample());
    assert!(s.signature.starts_with("v1.k2."));
    let back = k
        .verify(Some(&s.allocation), Some(&s.signature), "node-a", "uid-1")
        .unwrap();
    assert_eq!(back, sample());
}

#[test]
fn each_failure_has_its_own_error() {
    let k = keys();
    let s = k.sign(&sample());
    let v = |a: Option<&str>, sig: Option<&str>, node: &str, uid: &str| k.verify(a, sig, node, uid).unwrap_err();

    assert_eq!(v(None, Some(&s.signature), "node-a", "uid-1"), HandoffError::Missing);
    assert_eq!(
        v(Some(&s.allocation), None, "node-a", "uid-1"),
        HandoffError::MissingSignature
    );
    assert!(matches!(
        v(Some(&s.allocation), Some("garbage"), "node-a", "uid-1"),
        HandoffError::MalformedSignature { .. }
    ));
    assert!(matches!(
        v(Some(&s.allocation), Some("v1.k2.!!"), "node-a", "uid-1"),
        HandoffError::MalformedSignature { .. }
    ));
    let other_key = s.signature.replacen("v1.k2.", "v1.k9.", 1);
    assert_eq!(
        v(Some(&s.allocation), Some(&other_key), "node-a", "uid-1"),
        HandoffError::UnknownKey { key_id: "k9".into() }
    );
    // A user edits the allocation by hand (more compute) and keeps the old signature.
    let forged = s.allocation.replace("\"core_percent\":30", "\"core_percent\":100");
    assert_ne!(forged, s.allocation);
    assert_eq!(
        v(Some(&forged), Some(&s.signature), "node-a", "uid-1"),
        HandoffError::BadSignature { key_id: "k2".into() }
    );
    // Signed by the same key id but a different secret (another cluster).
    let stranger = SigningKeys::new("k2", [("k2".to_string(), vec![7u8; 32])]).unwrap();
    let foreign = stranger.sign(&sample());
    assert_eq!(
        v(Some(&foreign.allocation), Some(&foreign.signature), "node-a", "uid-1"),
        HandoffError::BadSignature { key_id: "k2".into() }
    );

    assert_eq!(
        v(Some(&s.allocation), Some(&s.signature), "node-b", "uid-1"),
        HandoffError::WrongNode {
            expected: "node-b".into(),
            found: "node-a".into()
        }
    );
    assert_eq!(
        v(Some(&s.allocation), Some(&s.signature), "node-a", "uid-2"),
        HandoffError::WrongPod {
            expected: "uid-2".into(),
            found: "uid-1".into()
        }
    );
    let mut future = sample();
    future.version = 2;
    let f = k.sign(&future);
    assert_eq!(
        v(Some(&f.allocation), Some(&f.signature), "node-a", "uid-1"),
        HandoffError::UnsupportedVersion { found: 2, supported: 1 }
    );
}

#[test]
fn rotated_keys_still_verify_until_removed() {
    let old = SigningKeys::new("k1", [("k1".to_string(), vec![1u8; 32])]).unwrap();
    let s = old.sign(&sample());
    assert!(
        keys()
            .verify(Some(&s.allocation), Some(&s.signature), "node-a", "uid-1")
            .is_ok()
    );
    let only_new = SigningKeys::new("k2", [("k2".to_string(), vec![2u8; 40])]).unwrap();
    assert_eq!(
        only_new
            .verify(Some(&s.allocation), Some(&s.signature), "node-a", "uid-1")
            .unwrap_err(),
        HandoffError::UnknownKey { key_id: "k1".into() }
    );
}

#[test]
fn signed_but_inconsistent_content_is_malformed() {
    let k = keys();
    let mut a = sample();
    a.containers.push(a.containers[0].clone());
    let s = k.sign(&a);
    assert!(matches!(
        k.verify(Some(&s.allocation), Some(&s.signature), "node-a", "uid-1"),
        Err(HandoffError::Malformed { .. })
    ));
}

#[test]
fn key_sets_are_validated() {
    assert!(matches!(
        SigningKeys::new("a", [("a".to_string(), vec![0; 8])]),
        Err(KeyError::TooShort { .. })
    ));
    assert!(matches!(
        SigningKeys::new("a b", [("a b".to_string(), vec![0; 32])]),
        Err(KeyError::BadKeyId(_))
    ));
    assert!(matches!(
        SigningKeys::new("x", [("a".to_string(), vec![0; 32])]),
        Err(KeyError::NoActiveKey(_))
    ));
}

#[test]
fn keys_load_from_a_secret_volume() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("active"), "k2\n").unwrap();
    std::fs::write(dir.path().join("k1"), [b'x'; 32]).unwrap();
    std::fs::write(dir.path().join("k2"), format!("{}\n", "y".repeat(32))).unwrap();
    std::fs::create_dir(dir.path().join("..2026_11_22")).unwrap();
    let k = SigningKeys::from_dir(dir.path()).unwrap();
    assert_eq!(k.active_key_id(), "k2");
    let expected = SigningKeys::new("k2", [("k2".to_string(), vec![b'y'; 32])]).unwrap();
    assert_eq!(k.sign(&sample()), expected.sign(&sample()));
    assert!(format!("{k:?}").contains("k1"), "debug lists key ids");
    assert!(!format!("{k:?}").contains("yyyy"), "debug never prints key bytes");
}

/// `head -c 32 /dev/urandom` ends in 0x0a or 0x0d once in 128 keys: such a key keeps all its
/// bytes (it used to lose them, leaving 31, and every signer and verifier refused to start).
#[test]
fn a_binary_key_ending_in_a_line_end_keeps_every_byte() {
    for last in [b'\n', b'\r'] {
        let dir = tempfile::tempdir().unwrap();
        let mut key: Vec<u8> = (0u8..31).map(|i| i.wrapping_mul(37) ^ 0x80).collect();
        key.push(last);
        std::fs::write(dir.path().join("active"), "k1\n").unwrap();
        std::fs::write(dir.path().join("k1"), &key).unwrap();
        let k = SigningKeys::from_dir(dir.path()).unwrap();
        let expected = SigningKeys::new("k1", [("k1".to_string(), key.clone())]).unwrap();
        assert_eq!(k.sign(&sample()), expected.sign(&sample()));
    }
}

/// An Ed25519 key as `openssl genpkey -algorithm ed25519` writes it, and its public half as
/// `openssl pkey -pubout` does (test data, generated once with OpenSSL 3.0).
const OPENSSL_PRIVATE: &str = "-----BEGIN PRIVATE KEY-----
MC4CAQAwBQYDK2VwBCIEIFOp+9r1vMK0O26nlPQZlcwHt0NeIp86Z8YsUicBqsCW
-----END PRIVATE KEY-----
";
const OPENSSL_PUBLIC: &str = "-----BEGIN PUBLIC KEY-----
MCowBQYDK2VwAyEA08aWN5LIdbKCx0D+TD4GJ9t0rC0XafHceh6LUkdbq3M=
-----END PUBLIC KEY-----
";

fn dir_of(files: &[(&str, &[u8])]) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    for (name, bytes) in files {
        std::fs::write(d.path().join(name), bytes).unwrap();
    }
    d
}

/// The extender signs with OpenSSL's private key; a node holding only the public key verifies
/// it, and cannot sign: no key set that would sign can be made of it, and a MAC made with the
/// public key's bytes as a secret (what a node could try) does not verify.
#[test]
fn ed25519_keys_sign_on_the_extender_and_only_verify_on_nodes() {
    let extender = dir_of(&[("active", b"k2\n"), ("k2", OPENSSL_PRIVATE.as_bytes())]);
    let node = dir_of(&[("k2", OPENSSL_PUBLIC.as_bytes())]);
    let signing = SigningKeys::from_dir(extender.path()).unwrap();
    let verifying = VerifyingKeys::from_dir(node.path()).unwrap();
    let a = sample();
    let s = signing.sign(&a);
    assert!(s.signature.starts_with("v2.k2."), "{}", s.signature);
    let check = |k: &VerifyingKeys, sig: &str| k.verify(Some(&s.allocation), Some(sig), &a.node, &a.pod_uid);
    assert_eq!(check(&verifying, &s.signature).unwrap(), a);
    assert_eq!(check(&signing.verifying(), &s.signature).unwrap(), a);
    // Altered: refused.
    let mut altered = s.signature.clone();
    altered.replace_range(altered.len() - 2.., if altered.ends_with("AA") { "AB" } else { "AA" });
    assert!(matches!(
        check(&verifying, &altered),
        Err(HandoffError::BadSignature { .. })
    ));
    // The node cannot sign: its key set has no signer, even with an `active` file.
    let with_active = dir_of(&[("active", b"k2"), ("k2", OPENSSL_PUBLIC.as_bytes())]);
    assert!(matches!(
        SigningKeys::from_dir(with_active.path()),
        Err(KeyError::CannotSign(id)) if id == "k2"
    ));
    // A v1 MAC keyed with what the node holds (the PEM, or the raw public key) is refused.
    use base64::Engine as _;
    let body: String = OPENSSL_PUBLIC.lines().filter(|l| !l.starts_with("-----")).collect();
    let raw = base64::engine::general_purpose::STANDARD.decode(body).unwrap()[12..].to_vec();
    for secret in [OPENSSL_PUBLIC.as_bytes().to_vec(), raw] {
        use hmac::Mac as _;
        let mut m = hmac::Hmac::<sha2::Sha256>::new_from_slice(&secret).unwrap();
        m.update(b"tessera.io/allocation\n");
        m.update(s.allocation.as_bytes());
        let forged = format!(
            "v1.k2.{}",
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(m.finalize().into_bytes())
        );
        assert!(matches!(
            verifying.verify(Some(&s.allocation), Some(&forged), &a.node, &a.pod_uid),
            Err(HandoffError::BadSignature { .. })
        ));
    }
    // Nor does a v2 signature of the right length from another key.
    let other = SigningKeys::new(
        "k2",
        [(
            "k2".to_string(),
            OPENSSL_PRIVATE.replace("MC4CAQAw", "MC4CAQAx").into_bytes(),
        )],
    );
    assert!(other.is_err(), "a corrupted PKCS#8 is refused: {other:?}");
    // Unknown PEM blocks are refused naming the key.
    let e = VerifyingKeys::new([(
        "k3".to_string(),
        b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n".to_vec(),
    )])
    .unwrap_err();
    assert!(
        e.to_string().contains("\"k3\"") && e.to_string().contains("CERTIFICATE"),
        "{e}"
    );
}

/// Moving an install from HMAC to Ed25519: during the rollout the nodes hold the old secret
/// and the new public key, and verify both kinds; a kind never verifies with the other's key.
#[test]
fn during_the_move_from_hmac_both_kinds_verify() {
    let old = SigningKeys::new("k1", [("k1".to_string(), vec![7u8; 32])]).unwrap();
    let new = SigningKeys::new(
        "k2",
        [
            ("k1".to_string(), vec![7u8; 32]),
            ("k2".to_string(), OPENSSL_PRIVATE.as_bytes().to_vec()),
        ],
    )
    .unwrap();
    let node = VerifyingKeys::new([
        ("k1".to_string(), vec![7u8; 32]),
        ("k2".to_string(), OPENSSL_PUBLIC.as_bytes().to_vec()),
    ])
    .unwrap();
    let a = sample();
    for signed in [old.sign(&a), new.sign(&a)] {
        assert_eq!(
            node.verify(Some(&signed.allocation), Some(&signed.signature), &a.node, &a.pod_uid)
                .unwrap(),
            a
        );
        assert_eq!(
            new.verify(Some(&signed.allocation), Some(&signed.signature), &a.node, &a.pod_uid)
                .unwrap(),
            a
        );
    }
    // A v2 signature naming the HMAC key, a v1 MAC naming the Ed25519 key: refused.
    let s = new.sign(&a);
    let swapped = s.signature.replacen("v2.k2.", "v2.k1.", 1);
    assert!(
        node.verify(Some(&s.allocation), Some(&swapped), &a.node, &a.pod_uid)
            .is_err()
    );
    let m = old.sign(&a);
    let swapped = m.signature.replacen("v1.k1.", "v1.k2.", 1);
    assert!(
        node.verify(Some(&m.allocation), Some(&swapped), &a.node, &a.pod_uid)
            .is_err()
    );
}

fn arb_device() -> impl Strategy<Value = AllocatedDevice> {
    prop_oneof![
        ("[a-f0-9]{8}", 0u32..16, 1u32..=100, 1u64..100_000, any::<bool>()).prop_map(|(u, i, c, m, ex)| {
            AllocatedDevice::Gpu {
                uuid: format!("GPU-{u}"),
                index: i,
                minor: i,
                core_percent: if ex { 100 } else { c },
                memory_mib: m,
                exclusive: ex,
            }
        }),
        ("[a-f0-9]{8}", 0u32..16, 0u32..15).prop_map(|(u, i, gi)| AllocatedDevice::Mig {
            uuid: format!("MIG-{u}"),
            profile: "1g.10gb".parse().unwrap(),
            parent_uuid: "GPU-p".into(),
            parent_index: i,
            gi,
            ci: 0,
        }),
    ]
}

fn arb_allocation() -> impl Strategy<Value = Allocation> {
    (
        "[a-z0-9.-]{1,20}",
        "[a-f0-9-]{1,36}",
        proptest::option::of(1u32..=100),
        proptest::collection::vec(("[a-z0-9-]{1,12}", proptest::collection::vec(arb_device(), 0..4)), 0..4),
    )
        .prop_map(|(node, uid, limit, containers)| {
            let mut a = Allocation::new(node, uid);
            a.core_limit = limit;
            let mut names = std::collections::BTreeSet::new();
            for (name, mut devices) in containers {
                if names.insert(name.clone()) {
                    let mut seen = std::collections::BTreeSet::new();
                    devices.retain(|d| seen.insert(d.uuid().to_string()));
                    a.containers.push(ContainerAllocation {
                        name,
                        role: ContainerRole::App,
                        devices,
                    });
                }
            }
            a
        })
}

proptest! {
    #[test]
    fn codec_round_trips(a in arb_allocation()) {
        let k = keys();
        let s = k.sign(&a);
        prop_assert_eq!(Allocation::decode(&s.allocation).unwrap(), a.clone());
        prop_assert_eq!(k.verify(Some(&s.allocation), Some(&s.signature), &a.node, &a.pod_uid).unwrap(), a);
    }

    #[test]
    fn any_change_to_the_bytes_is_refused(a in arb_allocation(), pos in any::<prop::sample::Index>(), byte in any::<u8>()) {
        let k = keys();
        let s = k.sign(&a);
        let mut bytes = s.allocation.clone().into_bytes();
        let i = pos.index(bytes.len());
        prop_assume!(bytes[i] != byte);
        bytes[i] = byte;
        let tampered = String::from_utf8_lossy(&bytes).into_owned();
        prop_assume!(tampered != s.allocation);
        prop_assert!(k.verify(Some(&tampered), Some(&s.signature), &a.node, &a.pod_uid).is_err());
    }

    #[test]
    fn verify_never_panics(value in ".{0,200}", sig in ".{0,80}") {
        let _ = keys().verify(Some(&value), Some(&sig), "n", "u");
        let _ = Allocation::decode(&value);
    }
}

/// A key directory whose `active` file is missing or empty says so, naming the file (it said
/// `active key "" is not among the keys`); a key's body pasted without its PEM lines is named
/// for what it is instead of being taken as an HMAC secret.
#[test]
fn key_mistakes_are_named() {
    let d = dir_of(&[("k1", OPENSSL_PRIVATE.as_bytes()), ("active", b"\n")]);
    let err = SigningKeys::from_dir(d.path()).err().unwrap().to_string();
    assert!(err.contains("active") && err.contains("missing or empty"), "{err}");
    let body = OPENSSL_PUBLIC.lines().nth(1).unwrap();
    let d = dir_of(&[("k1", body.as_bytes())]);
    let err = VerifyingKeys::from_dir(d.path()).err().unwrap().to_string();
    assert!(
        err.contains("an Ed25519 public key in base64 without its PEM lines"),
        "{err}"
    );
    let private_body: String = OPENSSL_PRIVATE.lines().filter(|l| !l.starts_with("-----")).collect();
    let d = dir_of(&[("k1", private_body.as_bytes())]);
    let err = VerifyingKeys::from_dir(d.path()).err().unwrap().to_string();
    assert!(err.contains("an Ed25519 private key"), "{err}");
    let d = dir_of(&[
        ("k1", OPENSSL_PRIVATE.as_bytes()),
        ("k2", OPENSSL_PUBLIC.as_bytes()),
        ("k0", &[9u8; 32]),
    ]);
    let kinds = VerifyingKeys::kinds_in(d.path()).unwrap();
    assert_eq!(
        kinds,
        [
            ("k0".to_string(), super::KeyKind::HmacSecret),
            ("k1".to_string(), super::KeyKind::Ed25519Private),
            ("k2".to_string(), super::KeyKind::Ed25519Public)
        ]
    );
}
