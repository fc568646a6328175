//! Windows of a card's time for the shares on `hook` nodes: each share container gets its own
//! part of a repeating period, and its processes launch work only in it.
//!
//! Under time-slicing NVML counts the time a process waits for another's slice as its own use,
//! so a throttle that holds each container at its measured figure gives busy co-tenants less
//! than they were sold. Windows divide the card's time outside the tenants instead: the node
//! agent gives each share container spans of the period that no other share of the card has
//! (while the card's shares fit in it), and the hook in the container holds its launches
//! outside them, its queued work drained at each span's end. Every process clocks the period
//! from `CLOCK_MONOTONIC`, which all containers of a node read alike.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::enforcement::{ShareEnforcement, ShareLimits};

/// The period the spans repeat in, milliseconds.
pub const PERIOD_MS: u32 = 50;

/// A share's spans of the period, in hundredths of it: `[start, end)`, sorted, disjoint.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Window {
    /// The spans, in hundredths of the period.
    pub spans: Vec<(u8, u8)>,
}

impl Window {
    /// Hundredths of the period the window covers.
    pub fn len(&self) -> u32 {
        self.spans.iter().map(|&(a, b)| u32::from(b - a)).sum()
    }

    /// Whether the window covers nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A window of `percent` hundredths beside the windows `taken` by the card's other shares:
    /// the first free span long enough, else the free spans in order; what does not fit in free
    /// time (shares whose compute limits add up to more than the card) overlaps the spans used
    /// by the fewest windows, earliest first.
    pub fn allocate<'a>(taken: impl IntoIterator<Item = &'a Window>, percent: u32) -> Window {
        let want = percent.clamp(1, 100) as usize;
        let mut uses = [0u32; 100];
        for w in taken {
            for &(a, b) in &w.spans {
                for u in &mut uses[usize::from(a)..usize::from(b).min(100)] {
                    *u += 1;
                }
            }
        }
        let mut pick = [false; 100];
        // The fewest overlaps first; at each level, one run long enough, else runs in order.
        let mut left = want;
        let mut levels: Vec<u32> = uses.to_vec();
        levels.sort_unstable();
        levels.dedup();
        for level in levels {
            if left == 0 {
                break;
            }
            let runs = runs_where(|i| uses[i] == level && !pick[i]);
            if let Some(&(a, _)) = runs.iter().find(|&&(a, b)| b - a >= left) {
                pick[a..a + left].iter_mut().for_each(|p| *p = true);
                break;
            }
            for (a, b) in runs {
                let n = (b - a).min(left);
                pick[a..a + n].iter_mut().for_each(|p| *p = true);
                left -= n;
                if left == 0 {
                    break;
                }
            }
        }
        Window {
            spans: runs_where(|i| pick[i])
                .into_iter()
                .map(|(a, b)| (a as u8, b as u8))
                .collect(),
        }
    }

    /// Parses `START-END[,START-END]...` (hundredths of the period); the error names the span.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut spans: Vec<(u8, u8)> = Vec::new();
        for part in text.split(',').map(str::trim) {
            let bad = || format!("window span {part:?} is not START-END with 0 <= START < END <= 100");
            let (a, b) = part.split_once('-').ok_or_else(bad)?;
            let (a, b): (u8, u8) = (
                a.trim().parse().map_err(|_| bad())?,
                b.trim().parse().map_err(|_| bad())?,
            );
            if a >= b || b > 100 {
                return Err(bad());
            }
            if spans.last().is_some_and(|&(_, end)| a < end) {
                return Err(format!("window span {part:?} overlaps or precedes the one before it"));
            }
            spans.push((a, b));
        }
        Ok(Self { spans })
    }
}

impl fmt::Display for Window {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (k, (a, b)) in self.spans.iter().enumerate() {
            if k > 0 {
                f.write_str(",")?;
            }
            write!(f, "{a}-{b}")?;
        }
        Ok(())
    }
}

/// The runs `[a, b)` of hundredths where `yes` holds, in order.
fn runs_where(yes: impl Fn(usize) -> bool) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut start = None;
    for i in 0..=100 {
        match (i < 100 && yes(i), start) {
            (true, None) => start = Some(i),
            (false, Some(a)) => {
                out.push((a, i));
                start = None;
            }
            _ => {}
        }
    }
    out
}

/// A share container's window on one card, as its grant records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CardWindow {
    /// The card.
    pub uuid: String,
    /// How much of the period the share may use: its compute limit, percent.
    pub percent: u32,
    /// The window (empty until the books give it one).
    pub window: Window,
}

impl CardWindow {
    /// The window a share container with `limits` asks for on a node whose enforcement is
    /// `mode`: on `hook` nodes, a compute limit under the whole card (MPS nodes divide the card
    /// with the daemon's SM caps and turns; a limit of 100 needs no window).
    pub fn for_share(mode: Option<ShareEnforcement>, limits: &ShareLimits) -> Option<Self> {
        (mode == Some(ShareEnforcement::Hook) && limits.core_limit < 100)
            .then(|| Self::wanted(&limits.uuid, limits.core_limit))
    }

    /// A share of `percent` on card `uuid` that has no window yet.
    pub fn wanted(uuid: &str, percent: u32) -> Self {
        Self {
            uuid: uuid.to_string(),
            percent,
            window: Window::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(text: &str) -> Window {
        Window::parse(text).unwrap()
    }

    #[test]
    fn shares_that_fit_get_disjoint_windows() {
        let a = Window::allocate([], 30);
        assert_eq!(a, w("0-30"));
        let b = Window::allocate([&a], 50);
        assert_eq!(b, w("30-80"));
        let c = Window::allocate([&a, &b], 20);
        assert_eq!(c, w("80-100"));
        // The first share leaves: its time goes to the next that fits in it.
        assert_eq!(Window::allocate([&b, &c], 25), w("0-25"));
        // Free time in pieces: the first run long enough, else the runs in order.
        let gaps = [w("10-40"), w("50-90")];
        assert_eq!(Window::allocate(&gaps, 10), w("0-10"));
        assert_eq!(Window::allocate(&gaps, 20), w("0-10,40-50"));
        assert_eq!(Window::allocate(&gaps, 25), w("0-10,40-50,90-95"));
    }

    #[test]
    fn limits_past_the_card_overlap_the_least_used_time() {
        let full = [w("0-60"), w("60-100")];
        let x = Window::allocate(&full, 20);
        assert_eq!(x.len(), 20);
        // Everything is used once: the earliest run takes it.
        assert_eq!(x, w("0-20"));
        let y = Window::allocate([&full[0], &full[1], &x], 30);
        assert_eq!(y, w("20-50"), "time used once comes before time used twice");
        assert_eq!(Window::allocate([], 100), w("0-100"));
    }

    #[test]
    fn only_hook_nodes_shares_under_the_whole_card_ask_for_a_window() {
        let limits = |core_limit| ShareLimits {
            uuid: "GPU-1".into(),
            core_limit,
            memory_mib: 8192,
        };
        let hook = Some(ShareEnforcement::Hook);
        assert_eq!(
            CardWindow::for_share(hook, &limits(30)),
            Some(CardWindow::wanted("GPU-1", 30))
        );
        assert_eq!(CardWindow::for_share(hook, &limits(100)), None);
        for mode in [Some(ShareEnforcement::Mps), Some(ShareEnforcement::None), None] {
            assert_eq!(CardWindow::for_share(mode, &limits(30)), None, "{mode:?}");
        }
    }

    #[test]
    fn parses_what_it_prints_and_names_bad_spans() {
        for text in ["0-30", "0-10,40-50,90-100"] {
            assert_eq!(w(text).to_string(), text);
        }
        assert!(Window::parse("30-10").unwrap_err().contains("\"30-10\""));
        assert!(Window::parse("0-101").unwrap_err().contains("0-101"));
        assert!(Window::parse("0-30,20-40").unwrap_err().contains("overlaps"));
        assert!(Window::parse("x").is_err());
    }
}
