//! Fragmentation (Weng et al., "Beware of Fragmentation", USENIX ATC'23).
//!
//! A node's fragmentation with respect to one task class is the free GPU compute on it that
//! the class cannot use: all of it when the class cannot run on the node at all (wrong model,
//! too little CPU, not enough cards with room), otherwise the free compute of the cards that
//! each have less room than the class needs per card. A node's fragmentation with respect to a
//! *workload* is the popularity-weighted mean over its classes. FGD places each task where
//! this grows least.

use std::collections::HashMap;

use rustc_hash::FxHashMap;

use super::demand::PodDemand;
use super::state::{CARD_MILLI, ClusterState, NodeState};

mod change;

use change::Group;
pub(super) use change::{ChangeTable, Runs};

/// Popularity weights are counted in units of 2^-32 of a weight (each weight at most 1), and
/// fragmentation sums them times whole milli: every sum is an exact integer, the same whatever
/// the order its terms are added in, so a node's fragmentation worked out class by class, by
/// level, or from another node's terms with one card changed is one value to the bit. (A sum
/// is at most the node's idle milli times 2^32 per class: far from overflowing for any node
/// and workload.)
const UNITS_PER_WEIGHT: f64 = 4_294_967_296.0;

/// A popularity weight in units.
fn units(weight: f64) -> i64 {
    (weight.clamp(0.0, 1.0) * UNITS_PER_WEIGHT).round() as i64
}

/// Fragmentation in milli-GPU from its sum in units (exact: far below 2^53; a power of two's
/// reciprocal is exact, so the product is the quotient, without a division's wait).
fn milli(units: i64) -> f64 {
    units as f64 * (1.0 / UNITS_PER_WEIGHT)
}

/// One class of tasks in the target workload.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkloadClass {
    /// CPU per task, millicores.
    pub cpu_milli: u64,
    /// Compute per card, milli (1000 for whole cards; 0 for CPU-only tasks).
    pub gpu_milli: u32,
    /// Cards per task.
    pub cards: u32,
    /// Allowed GPU models (`None` = any).
    pub models: Option<Vec<String>>,
    /// Popularity (the weights sum to 1).
    pub weight: f64,
}

type ClassKey = (u64, u32, u32, Option<Vec<String>>);

fn class_key(pod: &PodDemand) -> ClassKey {
    let (milli, cards) = pod.shape();
    (pod.cpu_milli, milli, cards, pod.gpu_models.clone())
}

/// The task mix that fragmentation is measured against.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TargetWorkload {
    /// Classes, most popular first.
    pub classes: Vec<WorkloadClass>,
}

impl TargetWorkload {
    /// FGD's "typical pods": count pods per class, keep the most popular classes (taken
    /// `step` at a time) until they cover `coverage` (0..=1) of all pods, renormalise.
    pub fn typical(pods: &[PodDemand], coverage: f64, step: usize) -> Self {
        let mut counts: HashMap<ClassKey, f64> = HashMap::new();
        for p in pods {
            *counts.entry(class_key(p)).or_default() += 1.0;
        }
        Self::from_counts(counts, coverage, step)
    }

    fn from_counts(counts: HashMap<ClassKey, f64>, coverage: f64, step: usize) -> Self {
        let total: f64 = counts.values().sum();
        let mut list: Vec<(ClassKey, f64)> = counts.into_iter().collect();
        // Most popular first; ties in a fixed order so the result never depends on hashing.
        list.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| b.0.cmp(&a.0)));
        let mut kept = 0;
        let mut covered = 0.0;
        while covered < coverage * total && kept < list.len() {
            let upto = (kept + step.max(1)).min(list.len());
            covered += list[kept..upto].iter().map(|(_, c)| c).sum::<f64>();
            kept = upto;
        }
        let classes = list
            .into_iter()
            .take(kept)
            .map(|((cpu_milli, gpu_milli, cards, models), c)| WorkloadClass {
                cpu_milli,
                gpu_milli,
                cards,
                models,
                weight: c / covered.max(f64::MIN_POSITIVE),
            })
            .collect();
        Self { classes }
    }
}

/// Learns the target workload from the pods seen, older pods counting less (exponential decay).
#[derive(Debug, Clone)]
pub struct WorkloadLearner {
    counts: HashMap<ClassKey, f64>,
    decay: f64,
    scale: f64,
}

impl WorkloadLearner {
    /// `half_life` pods after a pod is seen, it counts half.
    pub fn new(half_life: f64) -> Self {
        Self {
            counts: HashMap::new(),
            decay: 0.5f64.powf(1.0 / half_life.max(1.0)),
            scale: 1.0,
        }
    }

    /// Records one pod.
    pub fn observe(&mut self, pod: &PodDemand) {
        // Instead of decaying every count, grow the weight of new observations.
        self.scale /= self.decay;
        if self.scale > 1e12 {
            for v in self.counts.values_mut() {
                *v /= self.scale;
            }
            self.scale = 1.0;
        }
        *self.counts.entry(class_key(pod)).or_default() += self.scale;
    }

    /// The current target workload.
    pub fn target(&self, coverage: f64, step: usize) -> TargetWorkload {
        TargetWorkload::from_counts(self.counts.clone(), coverage, step)
    }
}

#[derive(Debug, Clone)]
struct Compiled {
    cpu_milli: u64,
    gpu_milli: u32,
    /// Position of `gpu_milli` in the distinct per-card demands (`None` for CPU-only classes).
    level: Option<usize>,
    /// Its (per-card demand, cards) group in [`Fragmentation::groups`] (`None` for CPU-only).
    group: Option<usize>,
    cards: usize,
    allowed: Vec<bool>,
    weight: f64,
    /// The weight in units ([`units`]).
    units: i64,
}

impl Compiled {
    /// Whether a task of this class could run on a node of `model` with `cpu_free` and `cards`
    /// cards offering compute, room on them aside.
    fn could_run(&self, model: u16, cpu_free: u64, cards: usize) -> bool {
        self.allowed.get(usize::from(model)).copied().unwrap_or(false)
            && cpu_free >= self.cpu_milli
            && self.cards >= 1
            && self.cards <= cards
    }
}

/// For each level (ascending), the cards with room for it and the free compute of the others,
/// in one pass over `sorted` (free compute, descending).
fn level_walk(levels: &[u32], sorted: &[u32], mut each: impl FnMut(u32, u64)) {
    let (mut below, mut fragments) = (sorted.len(), 0u64);
    for &g in levels {
        while below > 0 && sorted[below - 1] < g {
            below -= 1;
            fragments += u64::from(sorted[below]);
        }
        each(below as u32, fragments);
    }
}

/// A node's fragmentation by class ([`Fragmentation::sums`]): per distinct per-card demand of
/// the workload, how many cards have room for it and the free compute of those that do not;
/// the classes that could run there at all (model, CPU, number of cards), summed by level.
#[derive(Debug, Clone, Default)]
pub struct ClassSums {
    base: ChangeBase,
    table: ChangeTable,
}

/// A node's terms for [`Fragmentation::after_one_change`]: its idle compute and, per level of
/// the workload, the cards with room for it and the free compute of the others; the classes
/// that could run on the node at all (model, CPU, number of cards).
#[derive(Debug, Clone, Default)]
pub struct ChangeBase {
    idle: u64,
    per_level: Vec<(u32, u64)>,
    runs: Runs,
}

impl ChangeBase {
    /// The node's terms that no pod changes.
    pub(super) fn terms(&self) -> LevelTerms<'_> {
        LevelTerms {
            idle: self.idle,
            per_level: &self.per_level,
        }
    }
}

/// A node's terms that no pod changes: its idle compute and, per level of the workload (the
/// distinct per-card demands, ascending), the cards with room for it and the free compute of
/// the others.
#[derive(Debug, Clone, Copy)]
pub struct LevelTerms<'a> {
    pub(super) idle: u64,
    pub(super) per_level: &'a [(u32, u64)],
}

/// A node's state as fragmentation sees it.
#[derive(Debug, Clone, Default)]
pub struct NodeShape {
    /// Model of the node's cards.
    pub model: u16,
    /// Free CPU.
    pub cpu_free: u64,
    /// Free compute per card that offers compute, milli (any order).
    pub frees: Vec<u32>,
}

impl NodeShape {
    /// The shape of a node as it is.
    pub fn of(node: &NodeState) -> Self {
        let mut s = Self::default();
        s.fill(node);
        s
    }

    /// Refills from a node, reusing the allocation.
    pub fn fill(&mut self, node: &NodeState) {
        self.model = node.model().unwrap_or(0);
        self.cpu_free = node.cpu_free();
        self.frees.clear();
        self.frees
            .extend(node.cards.iter().filter(|c| c.offers_compute()).map(|c| c.core_free()));
    }
}

/// Fragmentation against a target workload, memoised by node shape.
#[derive(Debug, Clone)]
pub struct Fragmentation {
    classes: Vec<Compiled>,
    /// The distinct per-card demands of the classes that want GPU, ascending.
    levels: Vec<u32>,
    /// The distinct (level, cards) of the classes that want GPU, ascending.
    groups: Vec<Group>,
    /// At each free compute up to a card's, the number of levels at most that.
    levels_upto: Vec<u32>,
    waste: Vec<f64>,
    cpu_thresholds: Vec<u64>,
    memo: FxHashMap<(u128, u32), f64>,
    sorted: Vec<u32>,
    /// Per level, the free compute of the cards with less room than it (scratch).
    level_fragments: Vec<u64>,
}

/// Workloads with at most this many classes are computed directly: that is cheaper than a
/// lookup in a large memo, which misses the CPU cache.
const MEMO_MIN_CLASSES: usize = 32;

/// Memo entries kept before the memo is cleared (bounds memory).
const MEMO_LIMIT: usize = 1 << 21;

impl Fragmentation {
    /// Compiles `workload` against the cluster's models.
    pub fn new(workload: &TargetWorkload, cluster: &ClusterState) -> Self {
        let classes: Vec<Compiled> = workload
            .classes
            .iter()
            .map(|c| Compiled {
                cpu_milli: c.cpu_milli,
                gpu_milli: c.gpu_milli,
                level: None,
                group: None,
                cards: c.cards as usize,
                allowed: cluster.allowed_models(c.models.as_deref()),
                weight: c.weight,
                units: units(c.weight),
            })
            .collect();
        let mut levels: Vec<u32> = classes.iter().map(|c| c.gpu_milli).filter(|&g| g > 0).collect();
        levels.sort_unstable();
        levels.dedup();
        let mut classes = classes;
        for c in &mut classes {
            c.level = levels.binary_search(&c.gpu_milli).ok();
        }
        let mut groups: Vec<Group> = classes
            .iter()
            .filter_map(|c| {
                Some(Group {
                    level: c.level?,
                    cards: c.cards,
                })
            })
            .collect();
        groups.sort_unstable();
        groups.dedup();
        for c in &mut classes {
            c.group = c
                .level
                .and_then(|level| groups.binary_search(&Group { level, cards: c.cards }).ok());
        }
        let levels_upto = (0..=CARD_MILLI)
            .map(|free| levels.partition_point(|&g| g <= free) as u32)
            .collect();
        let mut cpu_thresholds: Vec<u64> = classes.iter().map(|c| c.cpu_milli).collect();
        cpu_thresholds.sort_unstable();
        cpu_thresholds.dedup();
        let waste = expected_waste(&classes);
        Self {
            classes,
            levels,
            groups,
            levels_upto,
            waste,
            cpu_thresholds,
            memo: FxHashMap::default(),
            sorted: Vec::new(),
            level_fragments: Vec::new(),
        }
    }

    /// Expected compute a card with `free` milli left will never give out, if tasks keep
    /// arriving from the target workload and each lands on it when it fits.
    pub fn card_waste(&self, free: u32) -> f64 {
        self.waste[free.min(CARD_MILLI) as usize]
    }

    /// Fragmentation of a node shape, in milli-GPU.
    pub fn of_shape(&mut self, shape: &NodeShape) -> f64 {
        self.eval(shape.model, shape.cpu_free, &shape.frees)
    }

    /// The same model with an empty memo (for another thread: the memo only saves work).
    pub fn without_memo(&self) -> Self {
        Self {
            classes: self.classes.clone(),
            levels: self.levels.clone(),
            groups: self.groups.clone(),
            levels_upto: self.levels_upto.clone(),
            waste: self.waste.clone(),
            cpu_thresholds: self.cpu_thresholds.clone(),
            memo: FxHashMap::default(),
            sorted: Vec::new(),
            level_fragments: Vec::new(),
        }
    }

    /// Fragmentation of a node as it is.
    pub fn of_node(&mut self, node: &NodeState) -> f64 {
        let shape = NodeShape::of(node);
        self.of_shape(&shape)
    }

    /// Fragmentation of a node with `model`, `cpu_free` and per-card free compute `frees`.
    pub fn eval(&mut self, model: u16, cpu_free: u64, frees: &[u32]) -> f64 {
        if frees.is_empty() {
            return 0.0;
        }
        self.sorted.clear();
        self.sorted.extend_from_slice(frees);
        self.sorted.sort_unstable_by(|a, b| b.cmp(a));
        // Only the number of class CPU thresholds met matters, not the CPU itself.
        let cpu_rank = self.cpu_thresholds.partition_point(|&t| t <= cpu_free) as u32;
        // A lookup in a large memo is a cache miss; computing a few classes is cheaper.
        let key = if self.sorted.len() <= 12 && self.classes.len() > MEMO_MIN_CLASSES {
            let mut k: u128 = self.sorted.len() as u128;
            for &f in &self.sorted {
                k = (k << 10) | u128::from(f.min(1023));
            }
            Some((k, (u32::from(model) << 16) | cpu_rank.min(0xFFFF)))
        } else {
            None
        };
        if let Some(k) = key
            && let Some(&v) = self.memo.get(&k)
        {
            return v;
        }
        let v = self.compute(model, cpu_free);
        if let Some(k) = key {
            if self.memo.len() >= MEMO_LIMIT {
                self.memo.clear();
            }
            self.memo.insert(k, v);
        }
        v
    }

    fn compute(&mut self, model: u16, cpu_free: u64) -> f64 {
        let frees = &self.sorted;
        let idle: u64 = frees.iter().map(|&f| u64::from(f)).sum();
        self.level_fragments.clear();
        level_walk(&self.levels, frees, |_, fragments| self.level_fragments.push(fragments));
        let mut total = 0i64;
        for c in &self.classes {
            let usable =
                c.gpu_milli > 0 && c.could_run(model, cpu_free, frees.len()) && frees[c.cards - 1] >= c.gpu_milli;
            // Cards with less room than the class needs per card are fragments.
            let frag = match c.level {
                Some(level) if usable => self.level_fragments[level],
                _ => idle,
            };
            total += c.units * frag as i64;
        }
        milli(total)
    }

    /// A node's fragmentation by class (model, free CPU after the placement, free compute per
    /// card), written into `out` (its buffers reused), so that the node with one card changed is
    /// evaluated by [`Fragmentation::after_change`] without sorting or scanning the cards again.
    pub fn sums(&self, out: &mut ClassSums, model: u16, cpu_free: u64, frees: &[u32]) {
        self.change_base(&mut out.base, model, cpu_free, frees);
        out.table.fill(&self.groups, out.base.terms(), &out.base.runs);
    }

    /// The fragmentation of the node `sums` describes once one card's free compute goes from
    /// `from` to `to` (`to <= from`): what [`Fragmentation::eval`] gives for the changed node.
    pub fn after_change(&self, sums: &ClassSums, from: u32, to: u32) -> f64 {
        self.change_after(&sums.table, from, to)
    }

    /// The terms of the node with `model`, `cpu_free` and per-card free compute `frees`, for
    /// [`Fragmentation::after_one_change`].
    pub fn change_base(&self, out: &mut ChangeBase, model: u16, cpu_free: u64, frees: &[u32]) {
        out.per_level.clear();
        out.per_level.resize(self.levels.len(), (0, 0));
        out.idle = self.level_terms(frees, &mut out.per_level);
        self.runs(&mut out.runs, model, cpu_free, frees.len());
    }

    /// Number of levels (distinct per-card demands) of the workload.
    pub(super) fn levels(&self) -> usize {
        self.levels.len()
    }

    /// Writes a node's [`LevelTerms`] per level into `per_level` (one slot per level) and
    /// returns its idle compute, for per-card free compute `frees`.
    pub(super) fn level_terms(&self, frees: &[u32], per_level: &mut [(u32, u64)]) -> u64 {
        for (slot, &g) in per_level.iter_mut().zip(&self.levels) {
            let (mut room, mut fragments) = (0u32, 0u64);
            for &f in frees {
                let fits = f >= g;
                room += u32::from(fits);
                fragments += if fits { 0 } else { u64::from(f) };
            }
            *slot = (room, fragments);
        }
        frees.iter().map(|&f| u64::from(f)).sum()
    }

    /// Only the number of class CPU thresholds `cpu_free` meets matters to which classes run.
    pub(super) fn cpu_rank(&self, cpu_free: u64) -> usize {
        self.cpu_thresholds.partition_point(|&t| t <= cpu_free)
    }

    /// Which classes could run on a node of `model` with `cpu_free` and `cards` cards offering
    /// compute (room on them aside), summed by group, written into `out`.
    pub(super) fn runs(&self, out: &mut Runs, model: u16, cpu_free: u64, cards: usize) {
        out.units.clear();
        out.units.resize(self.groups.len(), 0);
        out.idle_units = 0;
        for c in &self.classes {
            match c.group {
                Some(g) if c.could_run(model, cpu_free, cards) => out.units[g] += c.units,
                _ => out.idle_units += c.units,
            }
        }
    }

    /// The table of one card's changes on the node of `terms`, with the classes that `runs`
    /// there, written into `out`.
    pub(super) fn change_table(&self, out: &mut ChangeTable, terms: LevelTerms<'_>, runs: &Runs) {
        out.fill(&self.groups, terms, runs);
    }

    /// The levels at most `free`.
    #[inline]
    fn levels_upto(&self, free: u32) -> usize {
        match self.levels_upto.get(free as usize) {
            Some(&n) => n as usize,
            None => self.levels.partition_point(|&g| g <= free),
        }
    }

    /// The fragmentation of the node of `table` once one card's free compute goes from `from`
    /// to `to` (`to <= from`).
    #[inline]
    pub(super) fn change_after(&self, table: &ChangeTable, from: u32, to: u32) -> f64 {
        milli(table.after((from, to), (self.levels_upto(to), self.levels_upto(from))))
    }

    /// The fragmentation of the node of `table` as it is.
    #[inline]
    pub(super) fn change_now(table: &ChangeTable) -> f64 {
        milli(table.now())
    }

    /// The fragmentation of the node `base` describes once one card's free compute goes from
    /// `from` to `to` (`to <= from`; equal: the node as it is): what [`Fragmentation::eval`]
    /// gives for the changed node, without sorting.
    pub fn after_one_change(&self, base: &ChangeBase, from: u32, to: u32) -> f64 {
        let mut table = ChangeTable::default();
        self.change_table(&mut table, base.terms(), &base.runs);
        self.change_after(&table, from, to)
    }

    /// Number of memoised node shapes.
    pub fn memo_len(&self) -> usize {
        self.memo.len()
    }
}

/// `V(r)`: a card with `r` free is filled by the next class that fits (drawn by popularity)
/// until none fits; what is left is wasted.
fn expected_waste(classes: &[Compiled]) -> Vec<f64> {
    let mut per_milli: Vec<(u32, f64)> = Vec::new();
    for c in classes.iter().filter(|c| c.gpu_milli > 0) {
        match per_milli.iter_mut().find(|(m, _)| *m == c.gpu_milli) {
            Some(e) => e.1 += c.weight,
            None => per_milli.push((c.gpu_milli, c.weight)),
        }
    }
    let mut v = vec![0.0; CARD_MILLI as usize + 1];
    for r in 1..=CARD_MILLI as usize {
        let (mut num, mut den) = (0.0, 0.0);
        for &(m, p) in &per_milli {
            if m as usize <= r {
                num += p * v[r - m as usize];
                den += p;
            }
        }
        v[r] = if den > 0.0 { num / den } else { r as f64 };
    }
    v
}

/// FGD's node score: `floor(100 * sigmoid(-Δfragmentation / 1000))`, as the published
/// simulator computes it (higher is better; many nodes tie, ties are broken at random).
pub fn fgd_score(before: f64, after: f64) -> f64 {
    let x = (before - after) / f64::from(CARD_MILLI);
    (100.0 / (1.0 + (-x).exp())).floor()
}

#[cfg(test)]
mod tests;
