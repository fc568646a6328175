//! Why no card of a node takes a share, and one text per reason for each evaluating thread.
//!
//! A filter of a busy cluster refuses thousands of nodes for a few dozen reasons ("best card
//! has 20% core, 16 GiB free; needs 30%, 8 GiB"): each refused node used to format and
//! allocate its own copy of its reason, which cost more than the evaluation that found it.
//! [`Refusals`], in each thread's scratch, keeps one shared text per reason.

use std::sync::Arc;

use rustc_hash::FxHashMap;

use super::ShareRefusal;
use super::fit::{gib, pct, share_refusal_text};

/// Why no card of a node takes a one-container share ([`super::share`]), in the terms the
/// text names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum CardRefusal {
    NoGpu,
    NoAllowedModel,
    NoHealthyCard,
    /// The first card with room refuses the share's owner (the owner's uid where the text
    /// names it: [`CardRefusal::owner`]).
    Owner(ShareRefusal, Option<u32>),
    /// The usable card with the most free compute (then memory), and the share asked.
    TooSmall {
        best: (u32, u64),
        core: u32,
        memory_mib: Option<u64>,
    },
    AllMig,
}

impl CardRefusal {
    /// The first card with room refuses a share run as `uid`.
    pub(super) fn owner(refusal: ShareRefusal, uid: Option<u32>) -> Self {
        // Another tenant's card refuses every user alike: one reason, whoever asks.
        let uid = uid.filter(|_| matches!(refusal, ShareRefusal::OtherUser(_)));
        Self::Owner(refusal, uid)
    }

    fn text(self) -> String {
        match self {
            Self::NoGpu => "node has no GPU".into(),
            Self::NoAllowedModel => "no card of an allowed model".into(),
            Self::NoHealthyCard => "no healthy card available".into(),
            Self::Owner(refusal, uid) => share_refusal_text(refusal, uid),
            Self::TooSmall {
                best: (core_free, memory_free),
                core,
                memory_mib,
            } => format!(
                "best card has {} core, {} free; needs {}, {}",
                pct(core_free),
                gib(memory_free),
                pct(core),
                memory_mib.map_or_else(|| "memory in proportion".to_string(), gib)
            ),
            Self::AllMig => "every usable card is in MIG mode".into(),
        }
    }
}

/// The texts of the refusals given so far, one per reason.
#[derive(Debug, Clone, Default)]
pub(super) struct Refusals {
    texts: FxHashMap<CardRefusal, Arc<str>>,
}

impl Refusals {
    /// Reasons kept at most; past that they are forgotten and kept afresh.
    const MAX: usize = 1024;

    /// The text of `refusal`, shared with every earlier node refused for the same reason.
    pub(super) fn text(&mut self, refusal: CardRefusal) -> Arc<str> {
        if let Some(text) = self.texts.get(&refusal) {
            return text.clone();
        }
        if self.texts.len() >= Self::MAX {
            self.texts.clear();
        }
        let text: Arc<str> = refusal.text().into();
        self.texts.insert(refusal, text.clone());
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reason_given_again_is_the_same_text_and_a_full_store_starts_over() {
        let mut r = Refusals::default();
        let small = |core_free| CardRefusal::TooSmall {
            best: (core_free, 8 * 1024),
            core: 300,
            memory_mib: Some(8 * 1024),
        };
        let first = r.text(small(200));
        assert_eq!(&*first, "best card has 20% core, 8 GiB free; needs 30%, 8 GiB");
        assert!(Arc::ptr_eq(&first, &r.text(small(200))), "one text per reason");
        assert_eq!(
            &*r.text(small(100)),
            "best card has 10% core, 8 GiB free; needs 30%, 8 GiB"
        );
        for f in 0..Refusals::MAX as u32 {
            r.text(small(1000 + f));
        }
        assert!(r.texts.len() <= Refusals::MAX, "the store is bounded");
        assert_eq!(&*r.text(small(200)), &*first, "a forgotten reason reads the same");
    }
}
