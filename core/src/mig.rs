//! MIG profile names (`1g.10gb`, `1c.2g.20gb`, `1g.10gb+me`) and their resource names.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::names::RESOURCE_MIG_PREFIX;

/// A MIG profile, as NVIDIA names it: `[<C>c.]<G>g.<N>gb[+attr...]`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MigProfile {
    /// GPU (memory + SM) slices of the GPU instance.
    pub gpu_slices: u8,
    /// Compute slices when the compute instance does not cover the whole GPU instance.
    pub compute_slices: Option<u8>,
    /// Memory of the instance in GB, as in the name.
    pub memory_gb: u32,
    /// Extra attributes (`me`, `gfx`, ...), in name order.
    pub attributes: Vec<String>,
}

/// The most GPU slices a GPU instance has (NVML's largest profile is 8 slices; today's cards
/// give at most 7).
pub const MAX_GPU_SLICES: u8 = 8;

/// A string that is not a MIG profile name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a MIG profile (expected e.g. 1g.10gb, 1c.2g.20gb or 1g.10gb+me, at most {MAX_GPU_SLICES}g)")]
pub struct BadMigProfile(pub String);

fn number_with_suffix(token: &str, suffix: &str) -> Option<u32> {
    let n = token.strip_suffix(suffix)?;
    if n.is_empty() || n.len() > 4 || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    n.parse().ok().filter(|v| *v > 0)
}

impl MigProfile {
    fn from_tokens<'a>(original: &str, mut tokens: impl Iterator<Item = &'a str>) -> Result<Self, BadMigProfile> {
        let bad = || BadMigProfile(original.to_string());
        let first = tokens.next().ok_or_else(bad)?;
        let (compute_slices, gpu_token) = match number_with_suffix(first, "c") {
            Some(c) => (Some(c), tokens.next().ok_or_else(bad)?),
            None => (None, first),
        };
        let gpu_slices = number_with_suffix(gpu_token, "g").ok_or_else(bad)?;
        let memory_gb = number_with_suffix(tokens.next().ok_or_else(bad)?, "gb").ok_or_else(bad)?;
        let attributes: Vec<String> = tokens.map(str::to_string).collect();
        let attr_ok = |a: &String| {
            !a.is_empty() && a.len() <= 8 && a.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        };
        if !attributes.iter().all(attr_ok) {
            return Err(bad());
        }
        let gpu_slices = u8::try_from(gpu_slices)
            .ok()
            .filter(|g| *g <= MAX_GPU_SLICES)
            .ok_or_else(bad)?;
        let compute_slices = match compute_slices {
            Some(c) => Some(u8::try_from(c).map_err(|_| bad())?),
            None => None,
        };
        if compute_slices.is_some_and(|c| c >= gpu_slices) {
            return Err(bad());
        }
        Ok(MigProfile {
            gpu_slices,
            compute_slices,
            memory_gb,
            attributes,
        })
    }

    /// The profile named by a resource (`tessera.io/mig-1g.10gb.me` -> `1g.10gb+me`), if it is one.
    pub fn from_resource_name(resource: &str) -> Option<Result<Self, BadMigProfile>> {
        let rest = resource.strip_prefix(RESOURCE_MIG_PREFIX)?;
        Some(Self::from_tokens(rest, rest.split('.')))
    }

    /// The Kubernetes extended resource for this profile. Kubernetes forbids `+` in resource
    /// names, so attributes are joined with `.`: `tessera.io/mig-1g.10gb.me`.
    pub fn resource_name(&self) -> String {
        let mut s = format!("{RESOURCE_MIG_PREFIX}{}", self.base_name());
        for a in &self.attributes {
            s.push('.');
            s.push_str(a);
        }
        s
    }

    fn base_name(&self) -> String {
        match self.compute_slices {
            Some(c) => format!("{c}c.{}g.{}gb", self.gpu_slices, self.memory_gb),
            None => format!("{}g.{}gb", self.gpu_slices, self.memory_gb),
        }
    }
}

impl fmt::Display for MigProfile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.base_name())?;
        for a in &self.attributes {
            write!(f, "+{a}")?;
        }
        Ok(())
    }
}

impl FromStr for MigProfile {
    type Err = BadMigProfile;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut parts = s.split('+');
        let base = parts.next().unwrap_or_default();
        Self::from_tokens(s, base.split('.').chain(parts))
    }
}

impl Serialize for MigProfile {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for MigProfile {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_nvidia_names() {
        let p: MigProfile = "1g.10gb".parse().unwrap();
        assert_eq!((p.gpu_slices, p.compute_slices, p.memory_gb), (1, None, 10));
        assert_eq!(p.resource_name(), "tessera.io/mig-1g.10gb");
        let p: MigProfile = "1c.3g.20gb".parse().unwrap();
        assert_eq!((p.gpu_slices, p.compute_slices, p.memory_gb), (3, Some(1), 20));
        let p: MigProfile = "1g.10gb+me".parse().unwrap();
        assert_eq!(p.attributes, vec!["me"]);
        assert_eq!(p.to_string(), "1g.10gb+me");
        assert_eq!(p.resource_name(), "tessera.io/mig-1g.10gb.me");
        let back = MigProfile::from_resource_name(&p.resource_name()).unwrap().unwrap();
        assert_eq!(back, p);
    }

    #[test]
    fn rejects_non_profiles() {
        for bad in [
            "",
            "1g",
            "g.10gb",
            "1g.10",
            "3c.2g.20gb",
            "1g.10gb+",
            "1g.10gb+ME",
            "0g.5gb",
            "99999g.1gb",
            // No card has more than 8 GPU slices.
            "9g.999gb",
            "9c.10g.20gb",
        ] {
            assert!(bad.parse::<MigProfile>().is_err(), "{bad} accepted");
        }
        assert!(MigProfile::from_resource_name("tessera.io/gpu-core").is_none());
        assert!(MigProfile::from_resource_name("tessera.io/mig-x").unwrap().is_err());
    }
}
