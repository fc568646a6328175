//! The card's ceiling on its daemon: set when it changes, a lowering only once it stays wanted.

use std::time::{Duration, Instant};

use tessera_core::enforcement::{MpsCeiling, MpsState};
use tracing::{info, warn};

use super::{SupervisorConfig, write};
use crate::tamper::Tally;

/// How long a lower wanted ceiling must stay wanted before the daemon is set to it. A raise is
/// set at once (a share's creation waits for it); a lowering waits: the card's last share
/// stopping and the next one starting (a Job's pods one after another) would otherwise set the
/// daemon down and up again, and a share that came meanwhile could meet the lower ceiling, or
/// time out waiting, while the daemon works through the first change.
const LOWER_AFTER: Duration = Duration::from_secs(1);

/// Since when the card has been wanted at a lower ceiling than its daemon holds (whatever
/// lower value: a tenant that keeps changing it keeps no higher ceiling alive).
#[derive(Default)]
pub(super) struct Lowering(Option<Instant>);

impl Lowering {
    /// Whether the ceiling should be synced now: anything but a lowering at once, a lowering
    /// once the held ceiling has stopped being wanted for [`LOWER_AFTER`].
    pub(super) fn due(&mut self, config: &SupervisorConfig, uuid: &str, state: &MpsState) -> bool {
        let wanted = config
            .layout
            .read_ceiling(uuid)
            .ok()
            .flatten()
            .unwrap_or(MpsCeiling::CLOSED);
        let lower = state.ceiling.is_some_and(|held| {
            held != wanted
                && wanted.active_thread_percentage <= held.active_thread_percentage
                && wanted.pinned_memory_mib <= held.pinned_memory_mib
        });
        if !lower {
            self.0 = None;
            return true;
        }
        let since = *self.0.get_or_insert_with(Instant::now);
        since.elapsed() >= LOWER_AFTER
    }
}

/// Sets the card's wanted ceiling ([`MpsLayout::read_ceiling`], closed when none is written)
/// on its daemon when it differs from what was set, and records it in the state. The log
/// reader takes the commands sent for it as the supervisor's own from now on.
pub(super) async fn sync_ceiling(config: &SupervisorConfig, uuid: &str, state: &mut MpsState, tally: &Tally) {
    let wanted = match config.layout.read_ceiling(uuid) {
        Ok(c) => c.unwrap_or(MpsCeiling::CLOSED),
        Err(e) => {
            warn!(uuid, error = e, "unreadable MPS ceiling: closing the card to clients");
            MpsCeiling::CLOSED
        }
    };
    if state.ceiling == Some(wanted) {
        return;
    }
    tally.expect(wanted);
    let sets = tally.memory_sets();
    match config
        .binaries
        .apply_ceiling(&config.layout, uuid, &wanted, config.command_timeout)
        .await
    {
        // The read-back shows the memory limit only to the GiB (a tenant's 9215M reads as the
        // 8G of an 8192M ceiling): the set counts once the daemon has logged it.
        Ok(()) if !memory_set_logged(tally, sets, config.command_timeout).await => {
            warn!(
                uuid,
                "the MPS daemon did not take the memory limit (another client's connection met it): setting it again"
            );
            state.ceiling = None;
        }
        Ok(()) => {
            info!(
                uuid,
                percentage = wanted.active_thread_percentage,
                memory_mib = wanted.pinned_memory_mib,
                "MPS ceiling set"
            );
            state.ceiling = Some(wanted);
        }
        Err(e) => {
            warn!(uuid, error = %e, "cannot set the MPS ceiling");
            state.ceiling = None;
        }
    }
    write(config, uuid, state);
}

/// Whether the daemon logs one of the supervisor's own memory limit sets past the `sets` it
/// had logged, within `within` (at most a second).
async fn memory_set_logged(tally: &Tally, sets: u64, within: Duration) -> bool {
    let until = Instant::now() + within.min(Duration::from_secs(1));
    loop {
        if tally.memory_sets() > sets {
            return true;
        }
        if Instant::now() >= until {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::MpsBinaries;
    use tessera_core::enforcement::{DaemonPhase, MpsLayout};

    /// A raise of a card's ceiling is set at once, a lowering only once it has been wanted for
    /// a second: a card's share stopping and the next starting does not set the daemon down and
    /// up again (under load each change took the fake daemon over a second, and a share created
    /// meanwhile waited past its 1.5 s).
    #[test]
    fn a_lower_ceiling_waits_a_moment_and_a_raise_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let layout = MpsLayout::new(dir.path());
        let binaries = MpsBinaries {
            control: "/bin/false".into(),
            path_dirs: vec![],
            library_dirs: vec![],
        };
        let config = SupervisorConfig::new(layout.clone(), binaries, "/bin/false".into());
        let share = MpsCeiling {
            active_thread_percentage: 30,
            pinned_memory_mib: 8192,
        };
        let mut state = MpsState {
            phase: DaemonPhase::Ready,
            pid: None,
            restarts: 0,
            started_at: 0,
            checked_at: 0,
            reason: None,
            ceiling: Some(MpsCeiling::CLOSED),
            exclusive_process: None,
        };
        let mut lowering = Lowering::default();
        layout.write_ceiling("GPU-1", &share).unwrap();
        assert!(lowering.due(&config, "GPU-1", &state), "a raise is at once");
        state.ceiling = Some(share);
        layout.write_ceiling("GPU-1", &MpsCeiling::CLOSED).unwrap();
        assert!(!lowering.due(&config, "GPU-1", &state), "a lowering waits");
        // The next share comes: nothing to change, and the lowering is forgotten.
        layout.write_ceiling("GPU-1", &share).unwrap();
        assert!(lowering.due(&config, "GPU-1", &state));
        layout.write_ceiling("GPU-1", &MpsCeiling::CLOSED).unwrap();
        assert!(!lowering.due(&config, "GPU-1", &state));
        // Another lower value meanwhile does not start the wait again.
        std::thread::sleep(LOWER_AFTER / 2);
        let smaller = MpsCeiling {
            active_thread_percentage: 10,
            pinned_memory_mib: 2048,
        };
        layout.write_ceiling("GPU-1", &smaller).unwrap();
        assert!(!lowering.due(&config, "GPU-1", &state));
        std::thread::sleep(LOWER_AFTER / 2 + Duration::from_millis(50));
        assert!(
            lowering.due(&config, "GPU-1", &state),
            "a lowering still wanted after a second"
        );
    }
}
