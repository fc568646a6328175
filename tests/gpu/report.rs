//! The table both GPU harnesses print (`tessera-gpu-e2e`, `tessera-gpu-cluster`): one row per
//! case, and what the CUDA probe reports (`key=value` lines), judged against the whole card.
#![allow(dead_code, reason = "shared by the two GPU harnesses, each of which uses part of it")]

use std::collections::BTreeMap;
use std::fmt::Write as _;

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    Pass,
    Fail,
    /// Not run on this machine (the row says why).
    Skip,
}

/// One row of the table.
pub(crate) struct Row {
    pub(crate) runtime: String,
    pub(crate) case: &'static str,
    pub(crate) expected: String,
    pub(crate) observed: String,
    pub(crate) verdict: Verdict,
}

/// The probe's `key=value` lines.
pub(crate) fn parse(out: &str) -> BTreeMap<String, String> {
    out.lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect()
}

pub(crate) fn num(kv: &BTreeMap<String, String>, k: &str) -> Option<f64> {
    kv.get(k).and_then(|v| v.parse().ok())
}

pub(crate) fn summary(kv: &BTreeMap<String, String>) -> String {
    let get = |k: &str| kv.get(k).map(String::as_str).unwrap_or("-");
    let mut s = format!("devices={}", get("devices"));
    for k in [
        "name",
        "sms",
        "mem_total_mib",
        "alloc",
        "kernels_per_s",
        "mps_threads",
        "mps_shm",
        "hook_memory",
        "filled_mib",
        "pool_alloc",
        "pool_reserved_mib",
        "pool_then_alloc",
        "vmm_map",
        "vmm_then_alloc",
        "error",
    ] {
        if let Some(v) = kv.get(k) {
            let _ = write!(s, " {k}={v}");
        }
    }
    s
}

/// What the whole card showed (the baseline for shares).
#[derive(Clone, Copy, Default)]
pub(crate) struct Baseline {
    pub(crate) sms: Option<f64>,
    pub(crate) rate: Option<f64>,
}

/// A share's probe output judged against the baseline: about `percent`% of the SMs, at most
/// `mib` of memory allocatable (`--fill`; under MPS `cudaMemGetInfo` still reports the whole
/// card, seen on an H100 with driver 580), a 20 GiB allocation refused. Dry: connected to the
/// card's (fake) daemon (`uuid`'s, where the caller knows which card it was given).
pub(crate) fn judge_share(
    dry: bool,
    kv: &BTreeMap<String, String>,
    base: Baseline,
    uuid: Option<&str>,
    percent: f64,
    mib: f64,
) -> (bool, String) {
    let mut observed = summary(kv);
    if let (Some(r), Some(w)) = (num(kv, "kernels_per_s"), base.rate) {
        let _ = write!(observed, " throughput {:.2}x whole", r / w);
    }
    if let (Some(s), Some(w)) = (num(kv, "sms"), base.sms) {
        let _ = write!(observed, " ({:.0}% of the SMs)", 100.0 * s / w);
    }
    let pass = if dry {
        let card = kv.get("mps_shm").map(String::as_str);
        kv.get("mps_threads") == Some(&format!("{percent}"))
            && card.is_some_and(|c| uuid.map_or(c.starts_with("GPU-"), |u| c == u))
    } else {
        let sms_ok = match (num(kv, "sms"), base.sms) {
            (Some(s), Some(w)) => (s / w) > (percent - 10.0) / 100.0 && (s / w) < (percent + 15.0) / 100.0,
            _ => false,
        };
        kv.get("devices").map(String::as_str) == Some("1")
            && sms_ok
            && num(kv, "filled_mib").is_some_and(|m| m <= mib && m >= mib / 2.0)
            && kv.get("alloc").is_some_and(|a| a != "ok")
    };
    (pass, observed)
}

/// A hook-mode share's probe output judged against the baseline: the card's memory seen as the
/// share's `mib`, a 20 GiB allocation refused, and a kernel rate of about `percent`% of the
/// whole card's (within 15 points). Dry: the hook preloaded with the share's memory.
pub(crate) fn judge_hook(
    dry: bool,
    kv: &BTreeMap<String, String>,
    base: Baseline,
    percent: f64,
    mib: f64,
) -> (bool, String) {
    let mut observed = summary(kv);
    let ratio = num(kv, "kernels_per_s").zip(base.rate).map(|(r, w)| r / w);
    if let Some(r) = ratio {
        let _ = write!(observed, " throughput {r:.2}x whole");
    }
    let pass = if dry {
        kv.get("hook_preload")
            .is_some_and(|p| p.ends_with("libtessera-cuda-hook.so"))
            && num(kv, "hook_memory") == Some(mib)
    } else {
        let want = percent / 100.0;
        num(kv, "mem_total_mib") == Some(mib)
            && kv.get("alloc").is_some_and(|a| a != "ok")
            && ratio.is_some_and(|r| (r - want).abs() < 0.15)
    };
    (pass, observed)
}

pub(crate) fn pass(ok: bool) -> Verdict {
    if ok { Verdict::Pass } else { Verdict::Fail }
}

pub(crate) fn table(rows: &[Row]) -> String {
    let w = |f: &dyn Fn(&Row) -> usize| rows.iter().map(f).max().unwrap_or(0);
    let (w0, w1, w2) = (w(&|r| r.runtime.len()), w(&|r| r.case.len()), w(&|r| r.expected.len()));
    let mut s = String::new();
    for r in rows {
        let v = match r.verdict {
            Verdict::Pass => "PASS",
            Verdict::Fail => "FAIL",
            Verdict::Skip => "SKIP",
        };
        let _ = writeln!(
            s,
            "{:<w0$} | {:<w1$} | {:<w2$} | {v} | {}",
            r.runtime, r.case, r.expected, r.observed
        );
    }
    s
}
