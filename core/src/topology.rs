//! How a node's GPUs are connected, and which set of cards a multi-GPU container gets.
//!
//! NVML tells, for each pair of GPUs, their closest common ancestor in the PCIe tree and, for
//! each NVLink, what is at its far end. Tessera keeps the pairwise result as
//! `nvidia-smi topo -m` prints it ([`GpuTopology`], one [`Link`] per pair), publishes it with
//! the node's inventory, and chooses whole-card sets with [`choose_set`]: the best-connected
//! set first (NVLink over one PCIe switch over one NUMA node over cross-socket), then the set
//! whose cards are least connected to the idle cards left, so that well-connected groups stay
//! whole for the pods that need them. Nodes that publish no matrix are judged by their cards'
//! NUMA nodes; nodes that publish nothing leave every set equal (lowest indices win).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::names::ANNOTATION_GPU_LINK;

/// Most GPUs a topology may describe (keeps the published annotation small: at most 64 rows of
/// 64 short cells).
pub const MAX_TOPOLOGY_GPUS: usize = 64;
/// Version of the topology's published form; readers ignore topologies of other versions.
pub const TOPOLOGY_VERSION: u32 = 1;
/// Above this many candidate sets, [`choose_set`] grows sets greedily instead of trying all.
const EXHAUSTIVE_SETS: u64 = 2_000;

/// How two GPUs are connected (the legend of `nvidia-smi topo -m`), best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Link {
    /// `NV<n>`: `n` NVLinks, direct or through NVSwitches.
    NvLink(u8),
    /// `PIX`: through at most one PCIe switch.
    Pix,
    /// `PXB`: through several PCIe switches, not a host bridge.
    Pxb,
    /// `PHB`: through a PCIe host bridge (the CPU's root complex).
    Phb,
    /// `NODE`: across host bridges within one NUMA node.
    Node,
    /// `SYS`: across the interconnect between NUMA nodes (another socket).
    Sys,
}

impl Link {
    /// The worst cost a link can have.
    pub const WORST_COST: u8 = 5;

    /// 0 (NVLink) .. [`Link::WORST_COST`] (cross-socket); lower is better.
    pub fn cost(self) -> u8 {
        match self {
            Link::NvLink(_) => 0,
            Link::Pix => 1,
            Link::Pxb => 2,
            Link::Phb => 3,
            Link::Node => 4,
            Link::Sys => 5,
        }
    }

    /// The link implied by two cards' NUMA nodes alone (`None` when either is unknown).
    pub fn from_numa(a: Option<u32>, b: Option<u32>) -> Option<Link> {
        Some(if a? == b? { Link::Node } else { Link::Sys })
    }
}

impl fmt::Display for Link {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Link::NvLink(n) => write!(f, "NV{n}"),
            Link::Pix => f.write_str("PIX"),
            Link::Pxb => f.write_str("PXB"),
            Link::Phb => f.write_str("PHB"),
            Link::Node => f.write_str("NODE"),
            Link::Sys => f.write_str("SYS"),
        }
    }
}

impl FromStr for Link {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let up = s.trim().to_ascii_uppercase();
        Ok(match up.as_str() {
            "PIX" => Link::Pix,
            "PXB" => Link::Pxb,
            "PHB" => Link::Phb,
            "NODE" => Link::Node,
            "SYS" => Link::Sys,
            _ => match up.strip_prefix("NV").map(str::parse::<u8>) {
                Some(Ok(n)) if n > 0 => Link::NvLink(n),
                _ => {
                    return Err(format!("{s:?} is not a link (NV<links>, PIX, PXB, PHB, NODE or SYS)"));
                }
            },
        })
    }
}

/// The link between every pair of a node's GPUs, by position in the inventory's `gpus`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuTopology {
    n: usize,
    /// `links[a * n + b]`; `None` on the diagonal.
    links: Vec<Option<Link>>,
}

impl GpuTopology {
    /// The topology of `n` GPUs where `link(a, b)` (asked for `a < b` only) connects each pair.
    pub fn new(n: usize, mut link: impl FnMut(usize, usize) -> Link) -> Result<Self, String> {
        if n > MAX_TOPOLOGY_GPUS {
            return Err(format!(
                "{n} GPUs, more than the {MAX_TOPOLOGY_GPUS} a topology may describe"
            ));
        }
        let mut links = vec![None; n * n];
        for a in 0..n {
            for b in a + 1..n {
                let l = link(a, b);
                links[a * n + b] = Some(l);
                links[b * n + a] = Some(l);
            }
        }
        Ok(Self { n, links })
    }

    /// Parses the matrix as published: one row per GPU, cells separated by spaces, `X` on the
    /// diagonal, symmetric. The error names the row, the column and the cell.
    pub fn from_rows<S: AsRef<str>>(rows: &[S]) -> Result<Self, String> {
        let n = rows.len();
        if n > MAX_TOPOLOGY_GPUS {
            return Err(format!(
                "{n} rows, more than the {MAX_TOPOLOGY_GPUS} a topology may describe"
            ));
        }
        let mut links = vec![None; n * n];
        for (a, row) in rows.iter().enumerate() {
            let cells: Vec<&str> = row.as_ref().split_whitespace().collect();
            if cells.len() != n {
                return Err(format!(
                    "row {a} {:?} has {} cells, the matrix has {n} GPUs",
                    row.as_ref(),
                    cells.len()
                ));
            }
            for (b, cell) in cells.into_iter().enumerate() {
                if a == b {
                    if cell != "X" {
                        return Err(format!("row {a} column {b}: {cell:?} on the diagonal, expected \"X\""));
                    }
                    continue;
                }
                let l: Link = cell.parse().map_err(|e| format!("row {a} column {b}: {e}"))?;
                links[a * n + b] = Some(l);
            }
        }
        for a in 0..n {
            for b in a + 1..n {
                if links[a * n + b] != links[b * n + a] {
                    return Err(format!(
                        "row {a} column {b} is {} but row {b} column {a} is {}: links are symmetric",
                        links[a * n + b].expect("off the diagonal"),
                        links[b * n + a].expect("off the diagonal")
                    ));
                }
            }
        }
        Ok(Self { n, links })
    }

    /// The matrix as published (see [`GpuTopology::from_rows`]).
    pub fn rows(&self) -> Vec<String> {
        (0..self.n)
            .map(|a| {
                (0..self.n)
                    .map(|b| self.link(a, b).map_or_else(|| "X".to_string(), |l| l.to_string()))
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect()
    }

    /// Number of GPUs.
    pub fn len(&self) -> usize {
        self.n
    }

    /// True when it describes no GPU.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// The link between GPUs `a` and `b` (`None` for `a == b` or out of range).
    pub fn link(&self, a: usize, b: usize) -> Option<Link> {
        if a >= self.n || b >= self.n {
            return None;
        }
        self.links[a * self.n + b]
    }
}

/// The link between GPUs `a` and `b` (positions): from `topology` when given, else from their
/// NUMA nodes (`numa(position)`); `None` when neither says.
pub fn link_between(
    topology: Option<&GpuTopology>,
    numa: impl Fn(usize) -> Option<u32>,
    a: usize,
    b: usize,
) -> Option<Link> {
    topology
        .and_then(|t| t.link(a, b))
        .or_else(|| Link::from_numa(numa(a), numa(b)))
}

#[derive(Serialize, Deserialize)]
struct TopologyWire {
    version: u32,
    matrix: Vec<String>,
}

impl Serialize for GpuTopology {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        TopologyWire {
            version: TOPOLOGY_VERSION,
            matrix: self.rows(),
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for GpuTopology {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let w = TopologyWire::deserialize(d)?;
        if w.version != TOPOLOGY_VERSION {
            return Err(serde::de::Error::custom(format!(
                "unsupported topology version {} (this build reads {TOPOLOGY_VERSION})",
                w.version
            )));
        }
        Self::from_rows(&w.matrix).map_err(serde::de::Error::custom)
    }
}

/// Reads an optional topology, taking one this build cannot read as absent (a newer node
/// agent's topology must not make its whole inventory unreadable).
pub fn deserialize_lenient<'de, D: Deserializer<'de>>(d: D) -> Result<Option<GpuTopology>, D::Error> {
    let v = Option::<serde_json::Value>::deserialize(d)?;
    Ok(v.and_then(|v| serde_json::from_value(v).ok()))
}

/// How well a pod requires the cards of each container to be connected
/// (`tessera.io/gpu-link`); without it any set will do and the best one is preferred.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LinkRequirement {
    /// Every pair connected by NVLink.
    Nvlink,
    /// Every pair under one PCIe switch tree (PIX or PXB) or better.
    PcieSwitch,
    /// Every pair on one NUMA node (not across sockets).
    Numa,
}

impl LinkRequirement {
    /// Whether `link` is good enough.
    pub fn admits(self, link: Link) -> bool {
        match self {
            LinkRequirement::Nvlink => matches!(link, Link::NvLink(_)),
            LinkRequirement::PcieSwitch => link.cost() <= Link::Pxb.cost(),
            LinkRequirement::Numa => link != Link::Sys,
        }
    }
}

impl fmt::Display for LinkRequirement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LinkRequirement::Nvlink => "nvlink",
            LinkRequirement::PcieSwitch => "pcie-switch",
            LinkRequirement::Numa => "numa",
        })
    }
}

impl FromStr for LinkRequirement {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "nvlink" => Ok(LinkRequirement::Nvlink),
            "pcie-switch" => Ok(LinkRequirement::PcieSwitch),
            "numa" => Ok(LinkRequirement::Numa),
            _ => Err(format!("{s:?} is not a link requirement (nvlink, pcie-switch or numa)")),
        }
    }
}

/// A chosen set of cards and how well it is connected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CardSet {
    /// Card positions, ascending.
    pub cards: Vec<usize>,
    /// Its worst link (`None`: a single card, or links unknown).
    pub worst: Option<Link>,
}

/// The cost of an unknown link: between the same NUMA node and cross-socket, so a known good
/// link is preferred to it and a known cross-socket one is not.
const UNKNOWN_COST: u8 = 4;

fn cost(l: Option<Link>) -> u8 {
    l.map_or(UNKNOWN_COST, Link::cost)
}

/// Chooses `want` of the `candidates` (card positions, e.g. the idle cards of a node) by
/// `link(a, b)`: the set whose worst link is best, then whose links are best in sum, then that
/// leaves the best-connected cards to others, then the lowest positions. With `require`, only
/// sets whose every link it admits; the error says what the best set had.
pub fn choose_set(
    link: impl Fn(usize, usize) -> Option<Link>,
    candidates: &[usize],
    want: usize,
    require: Option<LinkRequirement>,
) -> Result<CardSet, String> {
    choose(&link, candidates, want, require)
}

fn choose(
    link: &dyn Fn(usize, usize) -> Option<Link>,
    candidates: &[usize],
    want: usize,
    require: Option<LinkRequirement>,
) -> Result<CardSet, String> {
    let n = candidates.len();
    if want > n {
        return Err(format!("needs {want} idle whole GPU(s), {n} idle"));
    }
    if want == n && require.is_none() {
        // No choice to make (the common case on a busy node).
        let mut cards = candidates.to_vec();
        if !cards.is_sorted() {
            cards.sort_unstable();
        }
        let worst = worst_link(link, &cards);
        return Ok(CardSet { cards, worst });
    }
    let sorted: std::borrow::Cow<'_, [usize]> = if candidates.is_sorted() {
        candidates.into()
    } else {
        let mut v = candidates.to_vec();
        v.sort_unstable();
        v.into()
    };
    let pair = |a: usize, b: usize| link(sorted[a], sorted[b]);
    // Pairwise links once (positions into `sorted`).
    let links: Vec<Option<Link>> = (0..n * n)
        .map(|k| (k / n != k % n).then(|| pair(k / n, k % n)).flatten())
        .collect();
    let at = |a: usize, b: usize| links[a * n + b];
    let admitted = |set: &[usize]| {
        require.is_none_or(|r| {
            set.iter()
                .enumerate()
                .all(|(i, &a)| set[i + 1..].iter().all(|&b| at(a, b).is_some_and(|l| r.admits(l))))
        })
    };
    // How well each card is connected to all the others (for what a set takes from the rest).
    let affinity = |a: usize, b: usize| u32::from(Link::WORST_COST + 1 - cost(at(a, b)));
    let connected: Vec<u32> = (0..n)
        .map(|a| (0..n).filter(|&b| b != a).map(|b| affinity(a, b)).sum())
        .collect();
    let key = |set: &[usize]| -> (u8, u32, u32) {
        let (mut worst, mut sum, mut inside) = (0u8, 0u32, 0u32);
        for (i, &a) in set.iter().enumerate() {
            for &b in &set[i + 1..] {
                let c = cost(at(a, b));
                worst = worst.max(c);
                sum += u32::from(c);
                inside += affinity(a, b);
            }
        }
        // What the set takes from the cards left (its links to them): the better connected
        // to them, the worse.
        let loss = set.iter().map(|&a| connected[a]).sum::<u32>() - 2 * inside;
        (worst, sum, loss)
    };
    let no_info = links.iter().all(Option::is_none);
    let best: Option<Vec<usize>> = if no_info && require.is_none() {
        // Nothing to tell sets apart.
        Some((0..want).collect())
    } else if binomial(n as u64, want as u64) <= EXHAUSTIVE_SETS {
        let mut best: Option<((u8, u32, u32), Vec<usize>)> = None;
        for_each_combination(n, want, |set| {
            if admitted(set) {
                let k = key(set);
                if best.as_ref().is_none_or(|(b, _)| k < *b) {
                    best = Some((k, set.to_vec()));
                }
            }
        });
        best.map(|(_, s)| s)
    } else {
        greedy(n, want, &key, &admitted)
    };
    let Some(set) = best else {
        let r = require.expect("only a requirement rules every set out");
        let best_any = choose(link, candidates, want, None)?;
        return Err(format!(
            "no {want} idle GPU(s) connected as {ANNOTATION_GPU_LINK}={r} requires (the best set's worst link is {})",
            best_any.worst.map_or_else(|| "unknown".to_string(), |l| l.to_string())
        ));
    };
    let worst = worst_link(at, &set);
    Ok(CardSet {
        cards: set.into_iter().map(|i| sorted[i]).collect(),
        worst,
    })
}

/// The worst link among `cards`, when every link between them is known (`None` for one card).
pub fn worst_link(link: impl Fn(usize, usize) -> Option<Link> + Copy, cards: &[usize]) -> Option<Link> {
    let mut worst: Option<Link> = None;
    for (i, &a) in cards.iter().enumerate() {
        for &b in &cards[i + 1..] {
            let l = link(a, b)?;
            if worst.is_none_or(|w| l.cost() > w.cost()) {
                worst = Some(l);
            }
        }
    }
    worst
}

/// Grows a set from each seed, adding the card that keeps the key lowest; the best result.
fn greedy(
    n: usize,
    want: usize,
    key: &impl Fn(&[usize]) -> (u8, u32, u32),
    admitted: &impl Fn(&[usize]) -> bool,
) -> Option<Vec<usize>> {
    let mut best: Option<((u8, u32, u32), Vec<usize>)> = None;
    for seed in 0..n {
        let mut set = vec![seed];
        while set.len() < want {
            let next = (0..n)
                .filter(|c| !set.contains(c))
                .filter_map(|c| {
                    let mut s = set.clone();
                    s.push(c);
                    s.sort_unstable();
                    admitted(&s).then(|| (key(&s), c))
                })
                .min();
            match next {
                Some((_, c)) => {
                    set.push(c);
                    set.sort_unstable();
                }
                None => break,
            }
        }
        if set.len() == want && admitted(&set) {
            let k = key(&set);
            if best.as_ref().is_none_or(|(b, s)| (k, &set) < (*b, s)) {
                best = Some((k, set));
            }
        }
    }
    best.map(|(_, s)| s)
}

/// `n` choose `k` (`k <= n`), saturating.
fn binomial(n: u64, k: u64) -> u64 {
    let k = k.min(n - k);
    (0..k).fold(1u64, |acc, i| acc.saturating_mul(n - i) / (i + 1))
}

/// Calls `f` with every `k`-subset of `0..n`, in lexicographic order.
fn for_each_combination(n: usize, k: usize, mut f: impl FnMut(&[usize])) {
    if k > n {
        return;
    }
    let mut idx: Vec<usize> = (0..k).collect();
    loop {
        f(&idx);
        let Some(i) = (0..k).rev().find(|&i| idx[i] != i + n - k) else {
            return;
        };
        idx[i] += 1;
        for j in i + 1..k {
            idx[j] = idx[j - 1] + 1;
        }
    }
}

#[cfg(test)]
mod tests;
