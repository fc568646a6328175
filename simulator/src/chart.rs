//! An SVG chart of the simulation, two panels over the arrived workload (50..130% of GPU
//! capacity): the GPU allocation ratio and the fragmentation rate, one line per policy. Policies
//! close to each other must stay distinguishable: lines are drawn widest first, each narrower
//! and in its own dash pattern, so a line lying on another shows as a band inside it; each
//! panel's y range is taken from the data (a range fixed at 50..100% drew spread's first
//! points flat on the floor and hid policies under each other).

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
    }
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">arrived workload (% of GPU capacity)</text>"#,
        left + (w - left - right) / 2.0,
        h - 14.0
    );
    for (i, ser) in series.iter().enumerate() {
        let ly = 60.0 + 22.0 * i as f64;
        let lx = w - right + 14.0;
        let _ = writeln!(
            s,
            r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{}" stroke-width="{:.1}" stroke-dasharray="{}"/>"#,
            lx + 26.0,
            COLORS[i % COLORS.len()],
            width(i, series.len()).min(5.0),
            DASHES[i % DASHES.len()]
        );
        let _ = writeln!(s, r#"<text x="{}" y="{}">{}</text>"#, lx + 32.0, ly + 4.0, ser.policy);
    }
    s.push_str("</svg>\n");
    s
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
