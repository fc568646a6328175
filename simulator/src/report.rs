//! Tables, CSV and JSON of simulation results (means over seeds).

use std::fmt::Write as _;

use serde::Serialize;

use super::{RunResult, Sample};

/// Points shown in the text table (percent of capacity arrived).
pub const TABLE_POINTS: [u32; 10] = [50, 60, 70, 80, 90, 95, 100, 110, 120, 130];

/// The mean over seeds of one policy's samples.
#[derive(Debug, Clone, Serialize)]
pub struct PolicySeries {
    /// Policy.
    pub policy: super::Policies,
    /// Seeds averaged.
    pub seeds: usize,
    /// Mean sample per point (index 0 = 1% arrived).
    pub points: Vec<Sample>,
}

impl PolicySeries {
    /// The mean sample at `pct` arrived, when every seed reached it.
    pub fn at(&self, pct: u32) -> Option<&Sample> {
        self.points.get(pct.checked_sub(1)? as usize)
    }
}

/// Means over seeds, per policy, in the order policies first appear.
pub fn summarize(results: &[RunResult]) -> Vec<PolicySeries> {
    let mut policies: Vec<super::Policies> = Vec::new();
    for r in results {
        if !policies.contains(&r.policy) {
            policies.push(r.policy);
        }
    }
    policies
        .into_iter()
        .map(|policy| {
            let runs: Vec<&RunResult> = results.iter().filter(|r| r.policy == policy).collect();
            let len = runs.iter().map(|r| r.samples.len()).min().unwrap_or(0);
            let n = runs.len() as f64;
            let points = (0..len)
                .map(|i| {
                    let mut m = Sample::default();
                    for r in &runs {
                        let s = r.samples[i];
                        m.arrived_pct += s.arrived_pct / n;
                        m.allocation_pct += s.allocation_pct / n;
                        m.frag_rate_pct += s.frag_rate_pct / n;
                        m.frag_gpus += s.frag_gpus / n;
                    }
                    m
                })
                .collect();
            PolicySeries {
                policy,
                seeds: runs.len(),
                points,
            }
        })
        .collect()
}

/// An extra last column: header and the value per policy.
type ExtraColumn<'a> = (&'a str, &'a dyn Fn(&PolicySeries) -> String);

fn table(
    out: &mut String,
    title: &str,
    series: &[PolicySeries],
    value: impl Fn(&Sample) -> f64,
    extra: Option<ExtraColumn<'_>>,
) {
    let _ = writeln!(out, "\n{title}");
    let _ = write!(out, "{:<14}", "policy");
    for p in TABLE_POINTS {
        let _ = write!(out, "{:>8}", format!("{p}%"));
    }
    if let Some((h, _)) = extra {
        let _ = write!(out, "{h:>16}");
    }
    let _ = writeln!(out);
    for s in series {
        let _ = write!(out, "{:<14}", s.policy.to_string());
        for p in TABLE_POINTS {
            match s.at(p) {
                Some(x) => {
                    let _ = write!(out, "{:>8.2}", value(x));
                }
                None => {
                    let _ = write!(out, "{:>8}", "-");
                }
            }
        }
        if let Some((_, f)) = extra {
            let _ = write!(out, "{:>16}", f(s));
        }
        let _ = writeln!(out);
    }
}

/// The three text tables: allocation ratio, fragmentation rate, fragmentation amount.
pub fn text(series: &[PolicySeries]) -> String {
    let mut out = String::new();
    let unallocated = |s: &PolicySeries| {
        s.at(100)
            .map_or("-".into(), |x| format!("{:.2}", 100.0 - x.allocation_pct))
    };
    table(
        &mut out,
        "GPU allocation ratio (% of GPU capacity) by arrived workload (% of capacity), mean over seeds",
        series,
        |s| s.allocation_pct,
        Some(("unalloc@100%", &unallocated)),
    );
    table(
        &mut out,
        "Fragmentation rate (% of idle GPU compute that is fragmented)",
        series,
        |s| s.frag_rate_pct,
        None,
    );
    table(&mut out, "Fragmentation amount (GPUs)", series, |s| s.frag_gpus, None);
    out
}

/// CSV: one row per policy and point.
pub fn csv(series: &[PolicySeries]) -> String {
    let mut out = String::from("policy,seeds,point_pct,arrived_pct,allocation_pct,frag_rate_pct,frag_gpus\n");
    for s in series {
        for (i, p) in s.points.iter().enumerate() {
            let _ = writeln!(
                out,
                "{},{},{},{:.4},{:.4},{:.4},{:.4}",
                s.policy,
                s.seeds,
                i + 1,
                p.arrived_pct,
                p.allocation_pct,
                p.frag_rate_pct,
                p.frag_gpus
            );
        }
    }
    out
}
