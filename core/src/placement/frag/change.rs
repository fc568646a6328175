//! One card's change on a node in a few operations: the node's classes summed by level once,
//! then any change read off those sums.
//!
//! A card whose free compute goes from `from` to `to` changes each class of per-card demand
//! `g` in one of three ways: where `g <= to` the card had room and still has; where
//! `to < g <= from` it had room and becomes a fragment of `to`; where `g > from` it was a
//! fragment and stays one, `from - to` smaller. The levels being ascending, each way covers a
//! run of them, so sums over the levels below each point (taken once per node) give any
//! change's fragmentation without visiting the classes again. The sums are integers
//! ([`super::units`]), so they are exactly what the classes one by one add up to.

use super::LevelTerms;

/// Which classes of the workload could run on a node (its model, CPU left and cards offering
/// compute), their weights summed by group of [`super::Fragmentation`]'s.
#[derive(Debug, Clone, Default)]
pub struct Runs {
    /// Per group (ascending level), the units of its classes that could run.
    pub(super) units: Vec<i64>,
    /// The units of the classes that count all the node's idle compute whatever: those that
    /// want no GPU or could not run.
    pub(super) idle_units: i64,
}

/// The sums of [`Sums`], in its order: units of the classes that could run, of those with
/// enough cards with room, those units times the fragments, of those with a card to spare,
/// and those units times the fragments.
const ALL: usize = 0;
const ROOM: usize = 1;
const ROOM_FRAGMENTS: usize = 2;
const SPARE: usize = 3;
const SPARE_FRAGMENTS: usize = 4;

/// What [`ChangeTable`] keeps per level boundary.
type Sums = [i64; 5];

/// One node's classes summed by level, from which any one card's change is read
/// ([`ChangeTable::after`]).
#[derive(Debug, Clone, Default)]
pub struct ChangeTable {
    idle: i64,
    idle_units: i64,
    /// At `b`, the sums over the groups of the levels below `b`.
    below: Vec<Sums>,
}

/// A group's level and the cards its classes need.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Group {
    pub(super) level: usize,
    pub(super) cards: usize,
}

impl ChangeTable {
    /// The table of a node of `terms` whose classes `runs` (groups in ascending level).
    pub(super) fn fill(&mut self, groups: &[Group], terms: LevelTerms<'_>, runs: &Runs) {
        self.idle = terms.idle as i64;
        self.idle_units = runs.idle_units;
        let levels = terms.per_level.len();
        self.below.resize(levels + 1, [0; 5]);
        let below = &mut self.below[..=levels];
        let mut sums: Sums = [0; 5];
        // The rows before `next` are written: each takes the sums of the levels below it.
        let mut next = 0;
        for (g, &units) in groups.iter().zip(&runs.units) {
            while next <= g.level {
                below[next] = sums;
                next += 1;
            }
            let (room, fragments) = terms.per_level[g.level];
            let fragments = fragments as i64;
            let room_units = units * i64::from(room as usize >= g.cards);
            let spare_units = units * i64::from(room as usize > g.cards);
            sums[ALL] += units;
            sums[ROOM] += room_units;
            sums[ROOM_FRAGMENTS] += room_units * fragments;
            sums[SPARE] += spare_units;
            sums[SPARE_FRAGMENTS] += spare_units * fragments;
        }
        for row in &mut below[next..] {
            *row = sums;
        }
    }

    /// The node's fragmentation, in units, once one card goes from `from` to `to` free
    /// (`to <= from`); `to_levels` and `from_levels`: the levels at most `to` and `from`.
    #[inline]
    pub(super) fn after(&self, (from, to): (u32, u32), (to_levels, from_levels): (usize, usize)) -> i64 {
        let (from, to) = (i64::from(from), i64::from(to));
        let idle = self.idle - from + to;
        let (lo, mid, hi) = (
            self.below[to_levels],
            self.below[from_levels],
            self.below[self.below.len() - 1],
        );
        let span = |a: &Sums, b: &Sums, k: usize| b[k] - a[k];
        // Levels up to `to`: the card has room before and after.
        let kept = lo[ROOM_FRAGMENTS] + idle * (lo[ALL] - lo[ROOM]);
        // Levels over `to` up to `from`: the card's room is lost, and it is a fragment of `to`.
        let lost = span(&lo, &mid, SPARE_FRAGMENTS)
            + to * span(&lo, &mid, SPARE)
            + idle * (span(&lo, &mid, ALL) - span(&lo, &mid, SPARE));
        // Levels over `from`: the card was a fragment and stays one, smaller.
        let smaller = span(&mid, &hi, ROOM_FRAGMENTS) - (from - to) * span(&mid, &hi, ROOM)
            + idle * (span(&mid, &hi, ALL) - span(&mid, &hi, ROOM));
        idle * self.idle_units + kept + lost + smaller
    }

    /// The node's fragmentation as it is, in units.
    #[inline]
    pub(super) fn now(&self) -> i64 {
        let all = self.below[self.below.len() - 1];
        self.idle * self.idle_units + all[ROOM_FRAGMENTS] + self.idle * (all[ALL] - all[ROOM])
    }
}
