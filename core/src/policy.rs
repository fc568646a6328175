//! Placement policy names, as users write them in annotations and flags.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A placement policy, for the node tier or the card tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PolicyKind {
    /// Fill the most-used node/card first.
    Binpack,
    /// Prefer the least-used node/card.
    Spread,
    /// Uniformly random among feasible choices (seeded).
    Random,
    /// Leave the least free GPU capacity behind.
    Bestfit,
    /// Fragmentation gradient descent (Weng et al., ATC'23).
    Fgd,
    /// Tessera's own policy: FGD with memory-aware, whole-card-preserving card choice.
    Mosaic,
}

impl PolicyKind {
    /// Every policy, in the order tables list them.
    pub const ALL: [PolicyKind; 6] = [
        PolicyKind::Random,
        PolicyKind::Spread,
        PolicyKind::Binpack,
        PolicyKind::Bestfit,
        PolicyKind::Fgd,
        PolicyKind::Mosaic,
    ];

    /// The name used in annotations, flags and tables.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::Binpack => "binpack",
            PolicyKind::Spread => "spread",
            PolicyKind::Random => "random",
            PolicyKind::Bestfit => "bestfit",
            PolicyKind::Fgd => "fgd",
            PolicyKind::Mosaic => "mosaic",
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An unknown policy name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown placement policy {0:?} (expected one of binpack, spread, random, bestfit, fgd, mosaic)")]
pub struct UnknownPolicy(pub String);

impl FromStr for PolicyKind {
    type Err = UnknownPolicy;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        PolicyKind::ALL
            .into_iter()
            .find(|p| p.as_str().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| UnknownPolicy(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for p in PolicyKind::ALL {
            assert_eq!(p.as_str().parse::<PolicyKind>().unwrap(), p);
        }
        assert_eq!(" FGD ".parse::<PolicyKind>().unwrap(), PolicyKind::Fgd);
        assert!("packing".parse::<PolicyKind>().is_err());
    }
}
