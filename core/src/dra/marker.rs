//! Claim markers: what the kubelet hands a container for each request of a prepared claim.
//!
//! Preparing a claim gives each of its requests a CDI device of kind [`CLAIM_CDI_KIND`] that
//! sets one environment variable, `TESSERA_DRA_CLAIM_<uid>_R_<request>`, to a random token
//! kept in the node's root-only record. The kubelet hands a container the markers of the
//! requests it names (all of them when it names the claim), so the NRI plugin grants a
//! container exactly those requests' devices, and only to a pod the claim is reserved for.

use std::collections::BTreeMap;

use super::{ClaimStore, DraError, MARKER_ENV_PREFIX, PreparedClaim};
use crate::cdi::{CdiDevice, CdiEdits, CdiSpec};
use crate::handoff::AllocatedDevice;

/// CDI kind of the claim markers the DRA plugin hands the kubelet.
pub const CLAIM_CDI_KIND: &str = "tessera.io/claim";

/// Between a claim's uid and a request in a marker's variable: uids are lowercase, so an
/// uppercase word cannot be part of one.
const REQUEST_SEP: &str = "_R_";
/// A subrequest's `/` in a marker's variable (request names are lowercase DNS labels).
const SUBREQUEST_SEP: &str = "_S_";

/// Whether `s` can be an object uid (letters, digits and `-`, at most 64): what makes it safe
/// as a file name.
pub fn is_uid(s: &str) -> bool {
    !s.is_empty() && s.len() <= 64 && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// Whether `s` can be a request name as a claim's allocation names it: a DNS label, or
/// `request/subrequest` (a prioritized list's choice).
pub fn is_request(s: &str) -> bool {
    let label = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    match s.split_once('/') {
        Some((r, sub)) => label(r) && label(sub),
        None => label(s),
    }
}

/// The environment variable of the marker of request `request` of claim `uid`.
pub fn marker_env(uid: &str, request: &str) -> String {
    format!(
        "{MARKER_ENV_PREFIX}{}{REQUEST_SEP}{}",
        uid.replace('-', "_"),
        request.replace('/', SUBREQUEST_SEP).replace('-', "_")
    )
}

/// The environment variable of a claim-wide marker, as plugins before per-request markers
/// wrote them (still honoured for claims they prepared).
pub fn legacy_marker_env(uid: &str) -> String {
    format!("{MARKER_ENV_PREFIX}{}", uid.replace('-', "_"))
}

/// The CDI device name of request `request`'s marker of claim `uid` (unqualified).
pub fn marker_name(uid: &str, request: &str) -> String {
    format!("{uid}_{}", request.replace('/', "."))
}

/// The qualified CDI device name of request `request`'s marker of claim `uid`
/// (`tessera.io/claim=<uid>_<request>`).
pub fn marker_device(uid: &str, request: &str) -> String {
    format!("{CLAIM_CDI_KIND}={}", marker_name(uid, request))
}

/// The CDI spec file name of claim `uid`'s markers.
pub fn marker_file(uid: &str) -> String {
    format!("tessera.io-claim-{uid}.json")
}

/// A fresh marker token: 128 random bits, hex.
pub fn new_token() -> String {
    use ring::rand::SecureRandom as _;
    let mut bytes = [0u8; 16];
    ring::rand::SystemRandom::new()
        .fill(&mut bytes)
        .expect("the system's random source works");
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A fresh token for each request of `claim`'s devices.
pub fn new_markers(claim: &PreparedClaim) -> BTreeMap<String, String> {
    claim
        .devices
        .iter()
        .flat_map(|d| d.requests.iter())
        .map(|r| (r.clone(), new_token()))
        .collect()
}

/// The CDI spec of claim `claim`'s markers: one device per request, each setting only its own
/// variable to its token (a claim recorded before per-request markers: one claim-wide device).
pub fn marker_spec(claim: &PreparedClaim) -> CdiSpec {
    let device = |name: String, env: String| CdiDevice {
        name,
        annotations: BTreeMap::new(),
        container_edits: CdiEdits {
            env: vec![env],
            ..Default::default()
        },
    };
    let devices = if claim.markers.is_empty() {
        vec![device(
            claim.uid.clone(),
            format!("{}={}", legacy_marker_env(&claim.uid), claim.token),
        )]
    } else {
        claim
            .markers
            .iter()
            .map(|(request, token)| {
                device(
                    marker_name(&claim.uid, request),
                    format!("{}={token}", marker_env(&claim.uid, request)),
                )
            })
            .collect()
    };
    let mut spec = CdiSpec {
        cdi_version: String::new(),
        kind: CLAIM_CDI_KIND.into(),
        devices,
        container_edits: CdiEdits::default(),
    };
    spec.cdi_version = spec.minimum_version().into();
    spec
}

/// The qualified CDI names the kubelet hands a container for a device serving `requests` of
/// claim `claim`.
pub fn marker_devices(claim: &PreparedClaim, requests: &[String]) -> Vec<String> {
    if claim.markers.is_empty() {
        return vec![format!("{CLAIM_CDI_KIND}={}", claim.uid)];
    }
    requests.iter().map(|r| marker_device(&claim.uid, r)).collect()
}

/// One marker a container carries: the claim, the request (`None` for a claim-wide marker of
/// an older plugin) and the token.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Mark {
    /// The claim's uid.
    pub claim: String,
    /// The request.
    pub request: Option<String>,
    /// The token the marker carries.
    pub token: String,
}

/// The markers a container's environment carries (`KEY=value` entries).
pub fn marked_claims(env: &[String]) -> Vec<Mark> {
    let mut marks: Vec<Mark> = env
        .iter()
        .filter_map(|e| e.split_once('='))
        .filter_map(|(k, v)| {
            let rest = k.strip_prefix(MARKER_ENV_PREFIX)?;
            let (uid, request) = match rest.split_once(REQUEST_SEP) {
                Some((u, r)) => (u, Some(r.replace(SUBREQUEST_SEP, "/").replace('_', "-"))),
                None => (rest, None),
            };
            let claim = uid.replace('_', "-");
            (is_uid(&claim) && request.as_deref().is_none_or(is_request)).then(|| Mark {
                claim,
                request,
                token: v.to_string(),
            })
        })
        .collect();
    marks.sort();
    marks.dedup();
    marks
}

/// The claims a container's markers name.
pub fn claims_of(marks: &[Mark]) -> Vec<String> {
    let mut claims: Vec<String> = marks.iter().map(|m| m.claim.clone()).collect();
    claims.dedup();
    claims
}

/// What a container's markers give it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ClaimedDevices {
    /// The devices, each once.
    pub devices: Vec<AllocatedDevice>,
    /// Each claim's uid with the UUIDs of the devices it gives the container.
    pub claims: BTreeMap<String, Vec<String>>,
}

/// Whether marker `mark` carries the token the node gave its request of `claim` (a claim-wide
/// marker only for a claim recorded before per-request markers).
pub fn marker_token_matches(claim: &PreparedClaim, mark: &Mark) -> bool {
    let expected = match &mark.request {
        Some(r) => claim.markers.get(r).map(String::as_str).unwrap_or(""),
        None if claim.markers.is_empty() => claim.token.as_str(),
        None => "",
    };
    token_matches(expected, &mark.token)
}

fn token_matches(expected: &str, given: &str) -> bool {
    use subtle::ConstantTimeEq as _;
    !expected.is_empty() && bool::from(expected.as_bytes().ct_eq(given.as_bytes()))
}

/// The devices the markers `marks` give a container of pod `pod_uid` in `namespace`, from the
/// node's records. Every claim must be prepared here, be of the pod's namespace (Kubernetes
/// lets a pod use only its own namespace's claims), be reserved for the pod now (`reserved`:
/// the record's pods, or the claim's `status.reservedFor` as the API server has it), and each
/// marker must carry the token the node gave it (only the kubelet hands that to a container).
/// A marker gives its request's devices; a share comes alone.
pub fn devices_for(
    store: &ClaimStore,
    namespace: &str,
    marks: &[Mark],
    reserved: &dyn Fn(&PreparedClaim) -> bool,
) -> Result<ClaimedDevices, DraError> {
    let mut out = ClaimedDevices::default();
    let (mut keys, mut given, mut shares) = (Vec::new(), 0usize, 0usize);
    let mut records: BTreeMap<String, PreparedClaim> = BTreeMap::new();
    for mark in marks {
        let uid = &mark.claim;
        if !records.contains_key(uid) {
            let claim = store
                .get(uid)
                .map_err(|e| DraError::Unreadable {
                    uid: uid.clone(),
                    error: e.to_string(),
                })?
                .ok_or_else(|| DraError::NotPrepared { uid: uid.clone() })?;
            if claim.namespace != namespace {
                return Err(DraError::OtherNamespace {
                    claim: claim.key(),
                    uid: uid.clone(),
                    namespace: namespace.into(),
                });
            }
            keys.push(claim.key());
            records.insert(uid.clone(), claim);
        }
        let claim = &records[uid];
        if !marker_token_matches(claim, mark) {
            return Err(DraError::WrongToken {
                claim: claim.key(),
                uid: uid.clone(),
            });
        }
        // A token is readable by every process of the container it was handed to: it names
        // the claim, and the claim's reservation says whose it is.
        if !reserved(claim) {
            return Err(DraError::NotReserved {
                claim: claim.key(),
                uid: uid.clone(),
            });
        }
        let serves = |d: &&super::PreparedDevice| mark.request.as_ref().is_none_or(|r| d.requests.contains(r));
        for d in claim.devices.iter().filter(serves) {
            let uuids = out.claims.entry(uid.clone()).or_default();
            if uuids.iter().any(|u| u == d.allocated.uuid()) && out.devices.contains(&d.allocated) {
                continue;
            }
            given += 1;
            shares += usize::from(matches!(d.allocated, AllocatedDevice::Gpu { exclusive: false, .. }));
            uuids.push(d.allocated.uuid().to_string());
            if !out.devices.contains(&d.allocated) {
                out.devices.push(d.allocated.clone());
            }
        }
    }
    if shares > 0 && given > 1 {
        return Err(DraError::SeveralShares {
            claims: keys,
            devices: out
                .devices
                .iter()
                .map(|d| d.uuid().to_string())
                .collect::<Vec<_>>()
                .join(", "),
        });
    }
    Ok(out)
}
