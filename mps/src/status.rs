//! `tessera-mps-supervisor status`: every card's daemon as the supervisor last recorded it, for
//! operators and for the container's readiness probe.

use std::fmt::Write as _;
use std::time::SystemTime;

use tessera_core::enforcement::{MpsLayout, unix_secs};

/// The cards with a state under the layout's root, sorted.
pub fn cards(layout: &MpsLayout) -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(&layout.root)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().join("state.json").is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    out.sort();
    out
}

/// A table of the cards' daemons and whether all of them can take shares now.
pub fn report(layout: &MpsLayout, now: SystemTime) -> (String, bool) {
    let cards = cards(layout);
    let mut s = String::new();
    if cards.is_empty() {
        let _ = writeln!(s, "no MPS daemon state under {}", layout.root.display());
        return (s, false);
    }
    let mut all = true;
    for uuid in cards {
        let ready = layout.ready(&uuid, now);
        all &= ready.is_ok();
        match layout.read_state(&uuid) {
            Ok(st) => {
                let _ = writeln!(
                    s,
                    "{uuid}  {:<10} pid {:<8} restarts {:<3} checked {}s ago{}",
                    st.phase.to_string(),
                    st.pid.map_or_else(|| "-".to_string(), |p| p.to_string()),
                    st.restarts,
                    unix_secs(now).saturating_sub(st.checked_at),
                    match ready {
                        Ok(()) => String::new(),
                        Err(e) => format!("  NOT READY: {e}"),
                    }
                );
            }
            Err(e) => {
                let _ = writeln!(s, "{uuid}  NOT READY: {e}");
            }
        }
    }
    (s, all)
}
