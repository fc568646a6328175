//! An SVG chart of the simulation.
//!
//! Two panels over the arrived workload (50..130% of GPU capacity): the GPU allocation ratio
//! and the fragmentation rate, one line per policy. Policies close to each other must stay
//! distinguishable: lines are drawn widest first, each narrower and in its own dash pattern, so
//! a line lying on another shows as a band inside it; each policy has its own marker shape,
//! drawn on its own data points every 10% of arrived workload, the policies' points staggered
//! so that tied lines still show every marker (no line is moved off its values); the legend
//! says that lines overlap where policies tie. Each panel's y range is taken from the data (a
//! range fixed at 50..100% drew spread's first points flat on the floor and hid policies under
//! each other).

use std::fmt::Write as _;

use super::Sample;
use super::report::PolicySeries;

const COLORS: [&str; 8] = [
    "#7f7f7f", "#17becf", "#ff7f0e", "#2ca02c", "#1f77b4", "#d62728", "#9467bd", "#8c564b",
];
const DASHES: [&str; 4] = ["none", "8 4", "2 3", "10 3 2 3"];

/// The first point shown (percent of capacity arrived) and the last.
const X0: f64 = 50.0;
const X1: f64 = 130.0;

/// One panel: what it plots and where.
struct Panel<'a> {
    label: &'a str,
    value: fn(&Sample) -> f64,
    top: f64,
    height: f64,
}

/// The y range of `value` over the shown points of every series, widened to whole multiples
/// of `step` (and never empty).
fn y_range(series: &[PolicySeries], value: fn(&Sample) -> f64, step: f64) -> (f64, f64) {
    let shown = series.iter().flat_map(|s| {
        s.points
            .iter()
            .enumerate()
            .filter(|(k, _)| (*k + 1) as f64 >= X0)
            .map(move |(_, p)| value(p))
    });
    let (lo, hi) = shown.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if !lo.is_finite() {
        return (0.0, 100.0);
    }
    let lo = (lo / step).floor() * step;
    let hi = ((hi / step).ceil() * step).max(lo + step);
    (lo.max(0.0), hi.min(100.0).max(lo + step))
}

/// Renders the chart.
pub fn svg(title: &str, series: &[PolicySeries]) -> String {
    let (w, h) = (760.0, 760.0);
    let (left, right) = (64.0, 150.0);
    let px = |x: f64| left + (x - X0) / (X1 - X0) * (w - left - right);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="24" text-anchor="middle" font-size="14">{}</text>"#,
        w / 2.0,
        escape(title)
    );
    let panels = [
        Panel {
            label: "GPU allocation ratio (%)",
            value: |p| p.allocation_pct,
            top: 44.0,
            height: 300.0,
        },
        Panel {
            label: "fragmentation rate (% of idle GPU compute)",
            value: |p| p.frag_rate_pct,
            top: 410.0,
            height: 280.0,
        },
    ];
    for panel in &panels {
        let (y0, y1) = y_range(series, panel.value, 5.0);
        let py = |y: f64| panel.top + (1.0 - (y - y0) / (y1 - y0)) * panel.height;
        let bottom = panel.top + panel.height;
        for x in (50..=130).step_by(10) {
            let xp = px(f64::from(x));
            let _ = writeln!(
                s,
                r##"<line x1="{xp:.1}" y1="{}" x2="{xp:.1}" y2="{bottom:.1}" stroke="#e0e0e0"/>"##,
                panel.top
            );
            let _ = writeln!(
                s,
                r#"<text x="{xp:.1}" y="{:.1}" text-anchor="middle">{x}%</text>"#,
                bottom + 16.0
            );
        }
        let step = if y1 - y0 > 40.0 { 10.0 } else { 5.0 };
        let mut y = y0;
        while y <= y1 + 1e-9 {
            let yp = py(y);
            let _ = writeln!(
                s,
                r##"<line x1="{left}" y1="{yp:.1}" x2="{:.1}" y2="{yp:.1}" stroke="#e0e0e0"/>"##,
                w - right
            );
            let _ = writeln!(
                s,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{y:.0}%</text>"#,
                left - 6.0,
                yp + 4.0
            );
            y += step;
        }
        let _ = writeln!(
            s,
            r#"<text transform="translate(16 {:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
            panel.top + panel.height / 2.0,
            escape(panel.label)
        );
        // Widest first: a line lying on an earlier one shows inside it.
        let n = series.len();
        for (i, ser) in series.iter().enumerate() {
            let pts: Vec<String> = ser
                .points
                .iter()
                .enumerate()
                .filter(|(k, _)| (*k + 1) as f64 >= X0)
                .map(|(k, p)| format!("{:.1},{:.1}", px((k + 1) as f64), py((panel.value)(p))))
                .collect();
            let _ = writeln!(
                s,
                r#"<polyline fill="none" stroke="{}" stroke-width="{:.1}" stroke-dasharray="{}" points="{}"/>"#,
                COLORS[i % COLORS.len()],
                width(i, n),
                DASHES[i % DASHES.len()],
                pts.join(" ")
            );
        }
        // Markers over every line, on the policy's own points.
        for (i, ser) in series.iter().enumerate() {
            for point in marker_points(i, n) {
                if let Some(p) = ser.points.get(point as usize - 1) {
                    marker(&mut s, i, px(f64::from(point)), py((panel.value)(p)));
                }
            }
        }
    }
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">arrived workload (% of GPU capacity)</text>"#,
        left + (w - left - right) / 2.0,
        h - 14.0
    );
    legend(&mut s, series, w - right + 14.0);
    s.push_str("</svg>\n");
    s
}

/// The legend at `lx`, right of the panels: each policy's line and marker, then a note.
fn legend(s: &mut String, series: &[PolicySeries], lx: f64) {
    for (i, ser) in series.iter().enumerate() {
        let ly = 60.0 + 22.0 * i as f64;
        let _ = writeln!(
            s,
            r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{}" stroke-width="{:.1}" stroke-dasharray="{}"/>"#,
            lx + 26.0,
            COLORS[i % COLORS.len()],
            width(i, series.len()).min(5.0),
            DASHES[i % DASHES.len()]
        );
        marker(s, i, lx + 13.0, ly);
        let _ = writeln!(s, r#"<text x="{}" y="{}">{}</text>"#, lx + 32.0, ly + 4.0, ser.policy);
    }
    let note_y = 60.0 + 22.0 * series.len() as f64 + 8.0;
    for (k, line) in [
        "Lines overlap where",
        "policies tie; each",
        "policy's markers",
        "sit on its own points.",
    ]
    .iter()
    .enumerate()
    {
        let _ = writeln!(
            s,
            r##"<text x="{:.1}" y="{:.1}" font-size="11" fill="#555">{line}</text>"##,
            lx,
            note_y + 14.0 * k as f64
        );
    }
}

/// Where policy `i` of `n` puts its markers (percent arrived, 50..=130): every 10%, each
/// policy starting a different step past 50 so that tied policies' markers never coincide.
pub fn marker_points(i: usize, n: usize) -> Vec<u32> {
    let phase = (i * 10 / n.max(1)) as u32;
    (0..8).map(|k| 50 + phase + 10 * k).filter(|&p| p <= 130).collect()
}

/// The marker shapes, one per policy (in turn): a circle, then paths relative to the centre:
/// square, triangle, diamond, triangle down, plus, cross, star.
const SHAPES: [&str; 8] = [
    "",
    "m-3.5,-3.5h7v7h-7z",
    "m0,-5l4.5,8.5h-9z",
    "m0,-5l5,5l-5,5l-5,-5z",
    "m0,5l4.5,-8.5h-9z",
    "m-5,0h10m-5,-5v10",
    "m-4,-4l8,8m-8,0l8,-8",
    "m-5,0h10m-5,-5v10m-3.5,-1.5l7,-7m-7,0l7,7",
];
const MARKERS: usize = SHAPES.len();

/// Draws policy `i`'s marker centred on (`x`, `y`): hollow, in the policy's colour.
fn marker(s: &mut String, i: usize, x: f64, y: f64) {
    let color = COLORS[i % COLORS.len()];
    let m = i % MARKERS;
    let style = format!(r#"fill="white" stroke="{color}" stroke-width="1.5" class="marker m{m}""#);
    let _ = if m == 0 {
        writeln!(s, r#"<circle cx="{x:.1}" cy="{y:.1}" r="4" {style}/>"#)
    } else {
        writeln!(s, r#"<path d="M{x:.1},{y:.1}{}" {style}/>"#, SHAPES[m])
    };
}

/// Line `i` of `n`: the first widest (8 px), the last 1.5 px.
fn width(i: usize, n: usize) -> f64 {
    if n <= 1 {
        return 2.0;
    }
    8.0 - 6.5 * i as f64 / (n - 1) as f64
}

fn escape(t: &str) -> String {
    t.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Policies, Sample};
    use tessera_core::policy::PolicyKind;

    /// Four policies with the same values (lines drawn on top of each other) and one apart.
    fn tied() -> Vec<PolicySeries> {
        let kinds = [
            PolicyKind::Binpack,
            PolicyKind::Bestfit,
            PolicyKind::Fgd,
            PolicyKind::Mosaic,
            PolicyKind::Random,
        ];
        kinds
            .iter()
            .map(|&k| PolicySeries {
                policy: Policies::from(k),
                seeds: 1,
                points: (1..=130)
                    .map(|p| Sample {
                        arrived_pct: f64::from(p),
                        allocation_pct: f64::from(p).min(if k == PolicyKind::Random { 90.0 } else { 99.0 }),
                        frag_rate_pct: 10.0 + f64::from(p) / 2.0,
                        frag_gpus: 1.0,
                    })
                    .collect(),
            })
            .collect()
    }

    /// Tied policies stay apart: each has its own marker shape, its markers lie on its own
    /// points (values are not moved) at arrived points no other policy marks, and the legend
    /// says that lines overlap where policies tie.
    #[test]
    fn tied_policies_keep_their_own_markers_on_their_own_points() {
        let series = tied();
        let svg = svg("t", &series);
        let n = series.len();
        let mut taken = std::collections::HashSet::new();
        for i in 0..n {
            let points = marker_points(i, n);
            assert_eq!(points.len(), 8, "{points:?}");
            for p in &points {
                assert!(taken.insert(*p), "point {p} marked twice");
            }
            // Two panels and the legend.
            let count = svg.matches(&format!("class=\"marker m{i}\"")).count();
            assert_eq!(count, 2 * points.len() + 1, "policy {i}");
        }
        // The circles (policy 0) sit on policy 0's line.
        let line0 = svg.lines().find(|l| l.starts_with("<polyline")).unwrap();
        let circles: Vec<&str> = svg.lines().filter(|l| l.starts_with("<circle")).collect();
        assert_eq!(circles.len(), 2 * 8 + 1);
        let attr = |l: &str, a: &str| {
            l.split(&format!(" {a}=\""))
                .nth(1)
                .unwrap()
                .split('"')
                .next()
                .unwrap()
                .to_string()
        };
        for c in &circles[..8] {
            let at = format!("{},{}", attr(c, "cx"), attr(c, "cy"));
            assert!(line0.contains(&at), "{at} not on {line0}");
        }
        // Each policy's marker, drawn at the same place, is a different shape.
        let shapes: std::collections::HashSet<String> = (0..MARKERS)
            .map(|i| {
                let mut m = String::new();
                marker(&mut m, i, 0.0, 0.0);
                m.replace(COLORS[i % COLORS.len()], "").replace(&format!("m{i}"), "")
            })
            .collect();
        assert_eq!(shapes.len(), MARKERS, "{shapes:?}");
        assert!(
            svg.contains(">Lines overlap where<") && svg.contains(">policies tie; each<"),
            "{svg}"
        );
    }
}
