//! The conclusion printed after the tables: who wins, by how much, and what the figures mean.

use std::fmt::Write as _;

use super::report::PolicySeries;
use super::{Policies, RunResult};

/// The headline point: requests equal to the GPU capacity.
pub const HEADLINE: u32 = 100;

/// What the summary says besides the results.
#[derive(Debug, Clone, Copy)]
pub struct Context<'a> {
    /// The cluster's GPU capacity, in GPUs.
    pub capacity_gpus: f64,
    /// One sentence on the workload (what it is, where it comes from).
    pub workload: &'a str,
    /// What of the workload fits no node, in a sentence (see [`super::check::Plan`]).
    pub never_fit: Option<&'a str>,
}

/// Width the summary is wrapped to.
const WIDTH: usize = 100;

/// The summary, a block of wrapped paragraphs.
pub fn text(series: &[PolicySeries], results: &[RunResult], ctx: &Context<'_>) -> String {
    let mut out = String::from("\nSummary\n");
    let point = headline_point(series);
    let mut ranked: Vec<&PolicySeries> = series.iter().filter(|s| s.at(point).is_some()).collect();
    ranked.sort_by(|a, b| alloc(b, point).total_cmp(&alloc(a, point)));
    if let Some(para) = verdict(&ranked, results, point) {
        wrap(&mut out, &para);
    }
    if let Some(para) = fragmentation(&ranked, point) {
        wrap(&mut out, &para);
    }
    if let Some(never) = ctx.never_fit {
        wrap(&mut out, never);
    }
    out.push_str("\nWhat the figures mean\n");
    for para in meanings(&ranked, ctx) {
        wrap(&mut out, &para);
    }
    wrap(&mut out, &format!("Workload: {}", ctx.workload));
    out
}

/// [`HEADLINE`] when every policy reached it, else the last point they all reached.
fn headline_point(series: &[PolicySeries]) -> u32 {
    let reached = series.iter().map(|s| s.points.len()).min().unwrap_or(0) as u32;
    HEADLINE.min(reached)
}

/// The allocation ratio at `point`, to two decimals as the table prints it (so that the gaps
/// said add up with the table's figures).
fn alloc(s: &PolicySeries, point: u32) -> f64 {
    s.at(point)
        .map_or(f64::NAN, |x| (x.allocation_pct * 100.0).round() / 100.0)
}

/// Who allocates the most at `point`, the others' gaps, and whether the first two differ by
/// more than the seeds do.
fn verdict(ranked: &[&PolicySeries], results: &[RunResult], point: u32) -> Option<String> {
    let first = ranked.first()?;
    let best = alloc(first, point);
    let when = if point == HEADLINE {
        "the GPU requests so far equal the capacity"
    } else {
        "the last point every run reached"
    };
    let mut s = format!(
        "At {point}% arrived workload ({when}), {} allocates the most: {best:.2}% of the GPU capacity (mean of {} seed(s)).",
        first.policy, first.seeds
    );
    if ranked.len() == 1 {
        s.push_str(" One policy only: nothing to compare it with.");
        return Some(s);
    }
    let behind: Vec<String> = ranked[1..]
        .iter()
        .map(|r| format!("{} {:+.2}", r.policy, alloc(r, point) - best))
        .collect();
    let _ = write!(s, " The others, in points: {}.", behind.join(", "));
    let second = ranked[1];
    match paired_noise(results, first.policy, second.policy, point) {
        Some((gap, noise)) if gap == 0.0 && noise == 0.0 => {
            let _ = write!(
                s,
                " {} and {} allocate the same on every seed: a tie on this workload.",
                first.policy, second.policy
            );
        }
        Some((gap, noise)) if gap.abs() <= noise => {
            let _ = write!(
                s,
                " {} and {} differ by {gap:.2}, within the seed-to-seed noise (±{noise:.2}, two standard errors of the per-seed difference): a tie on this workload.",
                first.policy, second.policy
            );
        }
        Some((gap, noise)) => {
            let _ = write!(
                s,
                " Its lead over {} ({gap:.2}) is beyond the seed-to-seed noise (±{noise:.2}, two standard errors of the per-seed difference).",
                second.policy
            );
        }
        None => s.push_str(" With one seed the noise between seeds is unknown: run more (--seeds 42..51)."),
    }
    Some(s)
}

/// The mean per-seed difference of `a` over `b` at `point` and two standard errors of it
/// (`None` with fewer than two seeds both ran).
fn paired_noise(results: &[RunResult], a: Policies, b: Policies, point: u32) -> Option<(f64, f64)> {
    let at = |r: &RunResult| r.samples.get(point as usize - 1).map(|s| s.allocation_pct);
    let diffs: Vec<f64> = results
        .iter()
        .filter(|r| r.policy == a)
        .filter_map(|ra| {
            let rb = results.iter().find(|r| r.policy == b && r.seed == ra.seed)?;
            Some(at(ra)? - at(rb)?)
        })
        .collect();
    if diffs.len() < 2 {
        return None;
    }
    let n = diffs.len() as f64;
    let mean = diffs.iter().sum::<f64>() / n;
    let var = diffs.iter().map(|d| (d - mean).powi(2)).sum::<f64>() / (n - 1.0);
    Some((mean, 2.0 * (var / n).sqrt()))
}

/// The least and the most fragmentation at `point`.
fn fragmentation(ranked: &[&PolicySeries], point: u32) -> Option<String> {
    let amount = |s: &&PolicySeries| s.at(point).map_or(f64::NAN, |x| x.frag_gpus);
    let least = ranked.iter().min_by(|a, b| amount(a).total_cmp(&amount(b)))?;
    let most = ranked.iter().max_by(|a, b| amount(a).total_cmp(&amount(b)))?;
    let (l, m) = (least.at(point)?, most.at(point)?);
    let mut s = format!(
        "Fragmentation at {point}%: least with {}, {:.2} GPUs' worth of idle compute that the typical tasks cannot use ({:.2}% of the idle compute)",
        least.policy, l.frag_gpus, l.frag_rate_pct
    );
    if most.policy != least.policy {
        let _ = write!(
            s,
            "; most with {}, {:.2} GPUs ({:.2}%)",
            most.policy, m.frag_gpus, m.frag_rate_pct
        );
    }
    s.push('.');
    Some(s)
}

/// One paragraph per figure; the winner (first of `ranked`) gives the example of a high rate.
fn meanings(ranked: &[&PolicySeries], ctx: &Context<'_>) -> Vec<String> {
    let mut v = vec![
        "arrived workload: the GPU compute requested so far, as % of the cluster's GPU capacity. Tasks arrive one at a time up to 130%; each is placed at once or dropped (never retried, never removed).".to_string(),
        "GPU allocation ratio: the GPU compute placed, as % of the capacity; higher is better. unalloc@100% is 100 minus it at 100% arrived: the share of the capacity left idle when the requests equal it.".to_string(),
        "Fragmentation amount (GPUs): idle GPU compute that the typical tasks of the workload cannot use, as defined by FGD (Weng et al., USENIX ATC'23): on each node and for each task class, all its idle compute if the class cannot run there at all (model, CPU, too few cards with room), else the idle compute of the cards with less room than the class needs per card; weighted by how common each class is.".to_string(),
    ];
    let mut rate = "Fragmentation rate: that amount as % of all idle GPU compute.".to_string();
    if let Some((policy, end)) = ranked.first().and_then(|b| Some((b.policy, b.points.last()?)))
        && end.frag_rate_pct >= 80.0
    {
        let idle = (100.0 - end.allocation_pct) / 100.0 * ctx.capacity_gpus;
        let _ = write!(
            rate,
            " Near full it approaches 100% for the policies that pack best, and that is normal: what little stays idle is slivers no typical task fits ({policy} at {:.0}% arrived: a rate of {:.2}%, {:.2} of {idle:.2} idle GPUs). A lower rate with more idle GPUs is worse, not better",
            end.arrived_pct, end.frag_rate_pct, end.frag_gpus
        );
        // Those with a lower rate and at least twice the idle compute.
        let lower: Vec<String> = ranked[1..]
            .iter()
            .filter(|s| {
                s.points.last().is_some_and(|p| {
                    p.frag_rate_pct < end.frag_rate_pct
                        && 100.0 - p.allocation_pct >= 2.0 * (100.0 - end.allocation_pct)
                })
            })
            .map(|s| s.policy.to_string())
            .collect();
        if !lower.is_empty() {
            let _ = write!(rate, " (here {})", lower.join(", "));
        }
        rate.push_str(": read the rate with the amount.");
    }
    v.push(rate);
    v
}

/// Appends `text` wrapped to [`WIDTH`], each line indented by two spaces.
fn wrap(out: &mut String, text: &str) {
    let mut line = String::new();
    for word in text.split_whitespace() {
        if !line.is_empty() && 2 + line.len() + 1 + word.len() > WIDTH {
            let _ = writeln!(out, "  {line}");
            line.clear();
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if !line.is_empty() {
        let _ = writeln!(out, "  {line}");
    }
}

#[cfg(test)]
mod tests {
    use tessera_core::policy::PolicyKind;

    use super::*;
    use crate::{Sample, report};

    /// Runs of `policy` whose allocation at every point is `alloc(seed)`, the rate at 130%
    /// `rate_end`.
    fn runs(policy: PolicyKind, seeds: &[u64], alloc: impl Fn(u64) -> f64, rate_end: f64) -> Vec<RunResult> {
        seeds
            .iter()
            .map(|&seed| RunResult {
                policy: policy.into(),
                seed,
                samples: (1..=130)
                    .map(|p| Sample {
                        arrived_pct: f64::from(p),
                        allocation_pct: alloc(seed).min(f64::from(p)),
                        frag_rate_pct: if p == 130 { rate_end } else { 20.0 },
                        frag_gpus: (100.0 - alloc(seed)) / 10.0,
                    })
                    .collect(),
                submitted: 100,
                placed: 90,
            })
            .collect()
    }

    fn summary(results: &[RunResult], never_fit: Option<&str>) -> String {
        let ctx = Context {
            capacity_gpus: 1000.0,
            workload: "a test workload.",
            never_fit,
        };
        text(&report::summarize(results), results, &ctx)
    }

    #[test]
    fn names_the_winner_its_lead_and_what_the_figures_mean() {
        let seeds = [1, 2, 3, 4];
        let mut r = runs(PolicyKind::Random, &seeds, |s| 80.0 + s as f64 * 0.1, 70.0);
        r.extend(runs(PolicyKind::Mosaic, &seeds, |s| 95.0 + s as f64 * 0.1, 97.0));
        r.extend(runs(
            PolicyKind::Fgd,
            &seeds,
            |s| 95.0 + s as f64 * 0.1 - (s % 2) as f64 * 0.02,
            96.0,
        ));
        let t = summary(&r, Some("1 of 9 GPU task(s) fit no node."));
        let flat = t.split_whitespace().collect::<Vec<_>>().join(" ");
        for want in [
            "At 100% arrived workload (the GPU requests so far equal the capacity), mosaic allocates the most: 95.25% of the GPU capacity (mean of 4 seed(s)).",
            "The others, in points: fgd -0.01, random -15.00.",
            "mosaic and fgd differ by 0.01, within the seed-to-seed noise (±0.01,",
            "a tie on this workload.",
            "Fragmentation at 100%: least with mosaic, 0.47 GPUs",
            "most with random, 1.98 GPUs (20.00%).",
            "1 of 9 GPU task(s) fit no node.",
            "unalloc@100% is 100 minus it at 100% arrived",
            "(mosaic at 130% arrived: a rate of 97.00%, 0.47 of 47.50 idle GPUs)",
            "A lower rate with more idle GPUs is worse, not better (here random): read the rate with the amount.",
            "Workload: a test workload.",
        ] {
            assert!(flat.contains(want), "{want}\n{t}");
        }
        assert!(t.lines().all(|l| l.len() <= WIDTH), "{t}");
    }

    #[test]
    fn a_lead_beyond_the_noise_and_one_seed_are_said_as_such() {
        let mut r = runs(PolicyKind::Fgd, &[1, 2, 3], |s| 95.0 + s as f64 * 0.1, 50.0);
        r.extend(runs(PolicyKind::Binpack, &[1, 2, 3], |s| 94.0 + s as f64 * 0.1, 50.0));
        let t = summary(&r, None).split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(
            t.contains("Its lead over binpack (1.00) is beyond the seed-to-seed noise (±0.00"),
            "{t}"
        );
        assert!(!t.contains("Near full"), "{t}");
        let one = runs(PolicyKind::Fgd, &[1], |_| 95.0, 97.0);
        let t = summary(&one, None).split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(t.contains("One policy only: nothing to compare it with."), "{t}");
        let mut r = runs(PolicyKind::Fgd, &[1], |_| 95.0, 97.0);
        r.extend(runs(PolicyKind::Mosaic, &[1], |_| 94.0, 97.0));
        let t = summary(&r, None).split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(t.contains("With one seed the noise between seeds is unknown"), "{t}");
    }
}
