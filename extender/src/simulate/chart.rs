//! An SVG line chart of GPU allocation ratio against arrived workload, one line per policy.

use std::fmt::Write as _;

use super::report::PolicySeries;

const COLORS: [&str; 8] = [
    "#7f7f7f", "#17becf", "#ff7f0e", "#2ca02c", "#1f77b4", "#d62728", "#9467bd", "#8c564b",
];

/// Renders the chart (x: arrived 50..130%, y: allocated % from 50 to 100).
pub fn svg(title: &str, series: &[PolicySeries]) -> String {
    let (w, h) = (760.0, 480.0);
    let (left, right, top, bottom) = (64.0, 150.0, 40.0, 56.0);
    let (x0, x1, y0, y1) = (50.0, 130.0, 50.0, 100.0);
    let px = |x: f64| left + (x - x0) / (x1 - x0) * (w - left - right);
    let py = |y: f64| top + (1.0 - (y.clamp(y0, y1) - y0) / (y1 - y0)) * (h - top - bottom);
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
    for x in (50..=130).step_by(10) {
        let xp = px(f64::from(x));
        let _ = writeln!(
            s,
            r##"<line x1="{xp:.1}" y1="{top}" x2="{xp:.1}" y2="{:.1}" stroke="#e0e0e0"/>"##,
            h - bottom
        );
        let _ = writeln!(
            s,
            r#"<text x="{xp:.1}" y="{:.1}" text-anchor="middle">{x}%</text>"#,
            h - bottom + 18.0
        );
    }
    for y in (50..=100).step_by(10) {
        let yp = py(f64::from(y));
        let _ = writeln!(
            s,
            r##"<line x1="{left}" y1="{yp:.1}" x2="{:.1}" y2="{yp:.1}" stroke="#e0e0e0"/>"##,
            w - right
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{y}%</text>"#,
            left - 6.0,
            yp + 4.0
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">arrived workload (% of GPU capacity)</text>"#,
        left + (w - left - right) / 2.0,
        h - 14.0
    );
    let _ = writeln!(
        s,
        r#"<text transform="translate(16 {:.1}) rotate(-90)" text-anchor="middle">GPU allocation ratio</text>"#,
        top + (h - top - bottom) / 2.0
    );
    for (i, ser) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let pts: Vec<String> = ser
            .points
            .iter()
            .enumerate()
            .filter(|(k, _)| *k + 1 >= 50)
            .map(|(k, p)| format!("{:.1},{:.1}", px((k + 1) as f64), py(p.allocation_pct)))
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/>"#,
            pts.join(" ")
        );
        let ly = top + 16.0 + 20.0 * i as f64;
        let lx = w - right + 14.0;
        let _ = writeln!(
            s,
            r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="3"/>"#,
            lx + 22.0
        );
        let _ = writeln!(s, r#"<text x="{}" y="{}">{}</text>"#, lx + 28.0, ly + 4.0, ser.policy);
    }
    s.push_str("</svg>\n");
    s
}

fn escape(t: &str) -> String {
    t.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}
