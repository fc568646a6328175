use tessera_core::placement::PodDemand;
use tessera_core::policy::PolicyKind;

use super::*;

fn small() -> Scenario {
    let nodes: Vec<_> = embedded::nodes().into_iter().step_by(8).collect();
    let tasks: Vec<PodDemand> = embedded::tasks()
        .iter()
        .take(300)
        .map(trace::TraceTask::demand)
        .collect();
    Scenario::new("small", trace::cluster_of(&nodes), tasks)
}

#[test]
fn runs_are_reproducible_and_well_formed() {
    let s = small();
    let a = run(&s, PolicyKind::Fgd, 42, &|| {});
    let b = run(&s, PolicyKind::Fgd, 42, &|| {});
    assert_eq!(serde_json::to_string(&a).unwrap(), serde_json::to_string(&b).unwrap());
    let c = run(&s, PolicyKind::Fgd, 43, &|| {});
    assert_ne!(
        serde_json::to_string(&a).unwrap(),
        serde_json::to_string(&c).unwrap(),
        "seeds shuffle differently"
    );
    assert_eq!(a.samples.len(), 130, "one sample per point up to 130%");
    for w in a.samples.windows(2) {
        assert!(w[1].arrived_pct >= w[0].arrived_pct);
        assert!(w[1].allocation_pct >= w[0].allocation_pct, "never deletes");
    }
    for (i, smp) in a.samples.iter().enumerate() {
        assert!(smp.arrived_pct >= (i + 1) as f64);
        assert!(smp.allocation_pct <= smp.arrived_pct + 1e-9);
        assert!((0.0..=100.0).contains(&smp.frag_rate_pct));
    }
    assert!(a.placed < a.submitted, "130% cannot all fit");
}

#[test]
fn fragmentation_aware_policies_beat_random() {
    let s = small();
    let results = run_all(
        &s,
        &[
            PolicyKind::Random.into(),
            PolicyKind::Fgd.into(),
            PolicyKind::Mosaic.into(),
        ],
        &[1, 2],
        2,
        &|| {},
    );
    let series = report::summarize(&results);
    let at100 = |p: PolicyKind| {
        series
            .iter()
            .find(|x| x.policy == p.into())
            .unwrap()
            .at(100)
            .unwrap()
            .allocation_pct
    };
    assert!(at100(PolicyKind::Fgd) > at100(PolicyKind::Random));
    assert!(at100(PolicyKind::Mosaic) > at100(PolicyKind::Random));
    let text = report::text(&series);
    for p in ["random", "fgd", "mosaic", "unalloc@100%", "Fragmentation rate"] {
        assert!(text.contains(p), "{text}");
    }
    let csv = report::csv(&series);
    assert_eq!(csv.lines().count(), 1 + 3 * 130);
    let svg = chart::svg("t <&>", &series);
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    // Two panels (allocation, fragmentation), a line per policy in each, each line its own
    // width (widest first, so lines on top of each other stay visible).
    assert_eq!(svg.matches("<polyline").count(), 2 * 3);
    let widths: Vec<&str> = svg
        .lines()
        .filter(|l| l.starts_with("<polyline"))
        .filter_map(|l| l.split("stroke-width=\"").nth(1)?.split('"').next())
        .collect();
    assert_eq!(widths[..3], ["8.0", "4.8", "1.5"], "{widths:?}");
    assert!(svg.contains("t &lt;&amp;&gt;") && svg.contains("fragmentation rate"));
    // The y axis spans the data: its lowest label is at or below the lowest point shown.
    let lowest = series
        .iter()
        .flat_map(|s| s.points.iter().skip(49))
        .map(|p| p.allocation_pct)
        .fold(f64::INFINITY, f64::min);
    let first_label: f64 = svg
        .lines()
        .find(|l| l.contains("text-anchor=\"end\""))
        .and_then(|l| l.split('>').nth(1)?.split('%').next()?.parse().ok())
        .unwrap();
    assert!(
        first_label <= lowest && lowest - first_label < 5.0,
        "axis from {first_label}, data from {lowest}"
    );
}

/// A workload asking for no GPU never reaches the replay's target: the run does not inflate it
/// (it looped, growing without end).
#[test]
fn a_run_without_gpu_tasks_ends() {
    let mut s = small();
    s.tasks.retain(|t| t.gpu_milli() == 0);
    assert!(!s.tasks.is_empty());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(run(&s, PolicyKind::Fgd, 42, &|| {}).submitted));
    let submitted = rx.recv_timeout(std::time::Duration::from_secs(20)).expect("run ended");
    assert!(submitted < 300, "{submitted}");
}
