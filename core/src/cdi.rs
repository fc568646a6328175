//! Tessera's CDI spec (`tessera.io-gpu.json`, kind `tessera.io/gpu`): the typed form the CDI
//! generator writes and the NRI plugin resolves, and the CDI rules it must follow (names, the
//! lowest `cdiVersion` its content needs; CDI 1.1.0, see `../shared/reference`). The tests
//! check the generator's output against the `container-device-interface` crate as well, and the
//! runtimes' own CDI code reads it in the end-to-end tests.

use std::collections::BTreeMap;

/// Where the driver appears in GPU containers (`lib64/`, `bin/`), as on GKE; CUDA base images
/// already search it.
pub const DRIVER_DIR: &str = "/usr/local/nvidia";
/// Where driver libraries appear in GPU containers.
pub const LIBRARY_DIR: &str = "/usr/local/nvidia/lib64";
/// Where the driver's programs appear when the driver is mounted as one bundle.
pub const BIN_DIR: &str = "/usr/local/nvidia/bin";

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// A device node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CdiDeviceNode {
    /// Path in the container.
    pub path: String,
    /// Path on the host, when it differs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_path: Option<String>,
    /// `c` for character devices (CDI: optional).
    #[serde(rename = "type", default)]
    pub kind: String,
    /// Major number.
    #[serde(default)]
    pub major: i64,
    /// Minor number.
    #[serde(default)]
    pub minor: i64,
    /// Cgroup access (`rw`, `rwm`; CDI: empty means `rwm`).
    #[serde(default)]
    pub permissions: String,
}

/// A mount.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CdiMount {
    /// Host path.
    pub host_path: String,
    /// Container path.
    pub container_path: String,
    /// Mount options.
    pub options: Vec<String>,
}

/// Container edits.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CdiEdits {
    /// `KEY=value` pairs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    /// Device nodes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<CdiDeviceNode>,
    /// Mounts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<CdiMount>,
}

impl CdiEdits {
    /// True when there is nothing to apply.
    pub fn is_empty(&self) -> bool {
        self.env.is_empty() && self.device_nodes.is_empty() && self.mounts.is_empty()
    }
}

/// A device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CdiDevice {
    /// Name within the kind (`0`, `GPU-...`, `0:1`, `share-0`, `all`).
    pub name: String,
    /// Annotations.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// Edits.
    pub container_edits: CdiEdits,
}

/// A whole spec file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CdiSpec {
    /// The lowest version the content needs.
    pub cdi_version: String,
    /// `vendor/class`.
    pub kind: String,
    /// Devices.
    pub devices: Vec<CdiDevice>,
    /// Edits for every device of the spec.
    #[serde(default)]
    pub container_edits: CdiEdits,
}

/// Why a spec breaks CDI's rules.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CdiError {
    /// A malformed kind.
    #[error(
        "kind {0:?} is not vendor/class (vendor starting with a letter; letters, digits, _ . - inside; ending alphanumeric)"
    )]
    Kind(String),
    /// A malformed device name.
    #[error("device name {0:?} is invalid (letters, digits, _ . : - inside, alphanumeric at both ends)")]
    DeviceName(String),
    /// The same name twice.
    #[error("device {0:?} is defined twice")]
    Duplicate(String),
    /// A device with no edits.
    #[error("device {0:?} has no container edits")]
    EmptyDevice(String),
    /// No device at all.
    #[error("the spec has no device")]
    NoDevice,
    /// An edit CDI refuses.
    #[error("{what} {value:?} is invalid: {reason}")]
    Edit {
        /// Which edit.
        what: &'static str,
        /// Its value.
        value: String,
        /// Why.
        reason: &'static str,
    },
    /// A qualified name that is not `vendor/class=name`.
    #[error("{0:?} is not a qualified CDI device name (vendor/class=name)")]
    Qualified(String),
}

fn is_alnum(b: u8) -> bool {
    b.is_ascii_alphanumeric()
}

fn name_part_ok(s: &str, extra: &[u8]) -> bool {
    let b = s.as_bytes();
    !b.is_empty() && is_alnum(b[0]) && is_alnum(b[b.len() - 1]) && b.iter().all(|&c| is_alnum(c) || extra.contains(&c))
}

/// Checks a `vendor/class` kind.
pub fn check_kind(kind: &str) -> Result<(), CdiError> {
    let bad = || CdiError::Kind(kind.into());
    let (vendor, class) = kind.split_once('/').ok_or_else(bad)?;
    let vendor_ok = vendor.as_bytes().first().is_some_and(u8::is_ascii_alphabetic) && name_part_ok(vendor, b"_.-");
    if vendor_ok && name_part_ok(class, b"_.-") {
        Ok(())
    } else {
        Err(bad())
    }
}

/// Checks a device name (`0:1`, `GPU-...`).
pub fn check_device_name(name: &str) -> Result<(), CdiError> {
    if name_part_ok(name, b"_.:-") {
        Ok(())
    } else {
        Err(CdiError::DeviceName(name.into()))
    }
}

/// Splits `vendor/class=name`.
pub fn parse_qualified(qualified: &str) -> Result<(&str, &str), CdiError> {
    let bad = || CdiError::Qualified(qualified.into());
    let (kind, name) = qualified.split_once('=').ok_or_else(bad)?;
    check_kind(kind).map_err(|_| bad())?;
    check_device_name(name).map_err(|_| bad())?;
    Ok((kind, name))
}

fn check_edits(e: &CdiEdits) -> Result<(), CdiError> {
    let edit = |what, value: &str, reason| CdiError::Edit {
        what,
        value: value.into(),
        reason,
    };
    for v in &e.env {
        if !v.contains('=') || v.starts_with('=') {
            return Err(edit("env", v, "not KEY=value"));
        }
    }
    for d in &e.device_nodes {
        if !d.path.starts_with('/') {
            return Err(edit("device node path", &d.path, "not absolute"));
        }
        if !matches!(d.kind.as_str(), "" | "b" | "c" | "u" | "p") {
            return Err(edit("device node type", &d.kind, "not one of b, c, u, p"));
        }
        if !d.permissions.bytes().all(|c| b"rwm".contains(&c)) {
            return Err(edit("device node permissions", &d.permissions, "not a subset of rwm"));
        }
    }
    for m in &e.mounts {
        if m.host_path.is_empty() {
            return Err(edit("mount host path", &m.host_path, "empty"));
        }
        if !m.container_path.starts_with('/') {
            return Err(edit("mount container path", &m.container_path, "not absolute"));
        }
    }
    Ok(())
}

impl CdiSpec {
    /// The lowest `cdiVersion` the content needs, by CDI's rules for what Tessera writes:
    /// device names starting with a digit and device-node host paths need 0.5.0, annotations
    /// 0.6.0.
    pub fn minimum_version(&self) -> &'static str {
        let annotations = self.devices.iter().any(|d| !d.annotations.is_empty());
        if annotations {
            return "0.6.0";
        }
        let digit = self
            .devices
            .iter()
            .any(|d| d.name.as_bytes().first().is_some_and(u8::is_ascii_digit));
        let host_path = std::iter::once(&self.container_edits)
            .chain(self.devices.iter().map(|d| &d.container_edits))
            .flat_map(|e| &e.device_nodes)
            .any(|n| n.host_path.is_some());
        if digit || host_path { "0.5.0" } else { "0.3.0" }
    }

    /// Checks the spec against CDI's rules; the error names the offending part.
    pub fn validate(&self) -> Result<(), CdiError> {
        check_kind(&self.kind)?;
        if self.devices.is_empty() {
            return Err(CdiError::NoDevice);
        }
        check_edits(&self.container_edits)?;
        let mut seen = std::collections::BTreeSet::new();
        for d in &self.devices {
            check_device_name(&d.name)?;
            if !seen.insert(d.name.as_str()) {
                return Err(CdiError::Duplicate(d.name.clone()));
            }
            if d.container_edits.is_empty() {
                return Err(CdiError::EmptyDevice(d.name.clone()));
            }
            check_edits(&d.container_edits)?;
        }
        Ok(())
    }

    /// The device named `name`.
    pub fn device(&self, name: &str) -> Option<&CdiDevice> {
        self.devices.iter().find(|d| d.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_cdi() {
        for k in ["tessera.io/gpu", "nvidia.com/gpu", "a/b", "vendor.com/class_1"] {
            check_kind(k).unwrap();
        }
        for k in ["gpu", "1vendor/gpu", "vendor/gpu-", "vendor/", "/gpu", "a b/c"] {
            assert!(check_kind(k).is_err(), "{k}");
        }
        for n in ["0", "0:1", "GPU-3a84", "share-0", "all", "MIG-a.b_c"] {
            check_device_name(n).unwrap();
        }
        for n in ["", "-0", "0-", "a b", "x/y", "gpu="] {
            assert!(check_device_name(n).is_err(), "{n}");
        }
        assert_eq!(parse_qualified("tessera.io/gpu=0:1"), Ok(("tessera.io/gpu", "0:1")));
        assert!(parse_qualified("tessera.io/gpu").is_err());
        assert!(parse_qualified("gpu=0").is_err());
    }

    fn spec(name: &str, annotations: bool, host_path: bool) -> CdiSpec {
        CdiSpec {
            cdi_version: String::new(),
            kind: "tessera.io/gpu".into(),
            devices: vec![CdiDevice {
                name: name.into(),
                annotations: if annotations {
                    BTreeMap::from([("a".into(), "b".into())])
                } else {
                    BTreeMap::new()
                },
                container_edits: CdiEdits {
                    device_nodes: vec![CdiDeviceNode {
                        path: "/dev/nvidia0".into(),
                        host_path: host_path.then(|| "/host/dev/nvidia0".into()),
                        kind: "c".into(),
                        major: 195,
                        minor: 0,
                        permissions: "rw".into(),
                    }],
                    ..Default::default()
                },
            }],
            container_edits: CdiEdits::default(),
        }
    }

    #[test]
    fn versions_and_validation() {
        assert_eq!(spec("all", false, false).minimum_version(), "0.3.0");
        assert_eq!(spec("0", false, false).minimum_version(), "0.5.0");
        assert_eq!(spec("all", false, true).minimum_version(), "0.5.0");
        assert_eq!(spec("all", true, false).minimum_version(), "0.6.0");
        spec("0", true, true).validate().unwrap();
        let mut s = spec("0", false, false);
        s.devices.push(s.devices[0].clone());
        assert_eq!(s.validate(), Err(CdiError::Duplicate("0".into())));
        let mut s = spec("0", false, false);
        s.devices[0].container_edits = CdiEdits::default();
        assert_eq!(s.validate(), Err(CdiError::EmptyDevice("0".into())));
        let mut s = spec("0", false, false);
        s.container_edits.env.push("NOEQUALS".into());
        assert!(s.validate().unwrap_err().to_string().contains("\"NOEQUALS\""));
    }
}
