//! One started daemon: brought to its ceiling, health-checked, stopped.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tessera_core::enforcement::{DaemonPhase, MpsCeiling, MpsState, unix_secs};
use tokio::process::Child;
use tokio::sync::watch;
use tracing::{info, warn};

use super::ceiling::{Lowering, sync_ceiling};
use super::output::{LastWords, with_last_words};
use super::{Ended, SupervisorConfig, write};
use crate::held::{self, Held, Outcome};
use crate::tamper::Tally;

/// The command the health check sends.
const HEALTH_QUERY: &str = "get_default_active_thread_percentage";

/// Runs one started daemon until it fails or the supervisor stops.
pub(super) async fn run(
    config: &SupervisorConfig,
    uuid: &str,
    (mut child, tally): (Child, Arc<Tally>),
    state: &mut MpsState,
    stop: &mut watch::Receiver<bool>,
    last: &LastWords,
) -> Ended {
    if let Some(ended) = start(config, uuid, (&mut child, &tally), state, stop, last).await {
        return ended;
    }
    let ready_since = Instant::now();
    state.phase = DaemonPhase::Ready;
    state.checked_at = unix_secs(SystemTime::now());
    write(config, uuid, state);
    info!(uuid, pid = state.pid, ceiling = ?state.ceiling, "MPS daemon ready");
    let mut misses = Misses::default();
    let mut stops_reported = None;
    let mut lowering = Lowering::default();
    // Intervals, not sleeps in the select: a sleep made anew each turn would never end while
    // the other branch keeps firing.
    let mut ceiling_tick = tokio::time::interval(CEILING_EVERY);
    let mut check_tick = tokio::time::interval_at(tokio::time::Instant::now() + config.check_every, config.check_every);
    for t in [&mut ceiling_tick, &mut check_tick] {
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    }
    loop {
        tokio::select! {
            _ = stop.changed() => return stop_daemon(config, uuid, &mut child, state).await,
            status = child.wait() => return Ended::Failed {
                reason: format!("exited ({})", describe(status)),
                ready_for: ready_since.elapsed(),
            },
            _ = ceiling_tick.tick() => {
                if lowering.due(config, uuid, state) {
                    sync_ceiling(config, uuid, state, &tally).await;
                }
                report_stops(uuid, &tally, &mut stops_reported);
            }
            () = tally.changed() => {
                // However many commands came since the last look: one re-apply, one line.
                let changes = tally.take_changes();
                if changes.count > 0 {
                    warn!(
                        uuid,
                        commands = changes.count,
                        last = changes.last.as_str(),
                        "the MPS daemon's limits may have been changed by a client: setting them again"
                    );
                    // Not held (a client's change raced this one): the ceiling tick tries
                    // again, and the health check restarts a daemon that keeps refusing it.
                    state.ceiling = None;
                    sync_ceiling(config, uuid, state, &tally).await;
                }
            }
            _ = check_tick.tick() => {
                if let Some(reason) = check(config, uuid, state, &tally, &mut misses).await {
                    let _ = child.kill().await;
                    return Ended::Failed { reason, ready_for: ready_since.elapsed() };
                }
            }
        }
    }
}

/// Waits for a started daemon to answer, sets its ceiling and links its socket for clients;
/// how it ended when it did not get that far.
async fn start(
    config: &SupervisorConfig,
    uuid: &str,
    (child, tally): (&mut Child, &Tally),
    state: &mut MpsState,
    stop: &mut watch::Receiver<bool>,
    last: &LastWords,
) -> Option<Ended> {
    let deadline = Instant::now() + config.start_timeout;
    let mut last_err = String::from("no answer yet");
    loop {
        if Instant::now() > deadline {
            let _ = child.kill().await;
            return Some(Ended::Failed {
                reason: format!("did not answer within {}s: {last_err}", config.start_timeout.as_secs()),
                ready_for: Duration::ZERO,
            });
        }
        tokio::select! {
            _ = stop.changed() => return Some(stop_daemon(config, uuid, child, state).await),
            status = child.wait() => {
                let reason = format!("exited while starting ({})", describe(status));
                // Its output may still be on the way.
                tokio::time::sleep(Duration::from_millis(50)).await;
                return Some(Ended::Failed {
                    reason: with_last_words(reason, last),
                    ready_for: Duration::ZERO,
                });
            }
            _ = tokio::time::sleep(Duration::from_millis(200)) => {
                match config.binaries.command(&config.layout, uuid, HEALTH_QUERY, config.command_timeout).await {
                    Ok(_) => break,
                    Err(e) => last_err = e.to_string(),
                }
            }
        }
    }
    // The ceiling first: a client of a card's shares never meets a daemon without one, and a
    // daemon that does not take it is not used.
    state.ceiling = None;
    sync_ceiling(config, uuid, state, tally).await;
    if state.ceiling.is_none() {
        let _ = child.kill().await;
        return Some(Ended::Failed {
            reason: "the daemon did not take the card's MPS ceiling (see the log)".into(),
            ready_for: Duration::ZERO,
        });
    }
    // Only now do share containers see the daemon's socket.
    if let Err(e) = crate::card_dirs::publish(&config.layout, uuid) {
        let _ = child.kill().await;
        return Some(Ended::Failed {
            reason: format!("cannot link the daemon's control socket for its clients: {e}"),
            ready_for: Duration::ZERO,
        });
    }
    None
}

/// How often each card's wanted ceiling is looked at (a share waits for it at creation).
const CEILING_EVERY: Duration = Duration::from_millis(100);

/// How often stops made through the control socket are reported at most (counted between).
const STOPS_REPORTED_EVERY: Duration = Duration::from_secs(1);

/// Reports the stops heard since the last report, unless that was under
/// [`STOPS_REPORTED_EVERY`] ago.
fn report_stops(uuid: &str, tally: &Tally, reported: &mut Option<Instant>) {
    if reported.is_some_and(|at| at.elapsed() < STOPS_REPORTED_EVERY) {
        return;
    }
    let stops = tally.take_stops();
    if stops.count > 0 {
        warn!(
            uuid,
            commands = stops.count,
            last = stops.last.as_str(),
            "a client of the card stopped MPS work through the control socket (MPS cannot refuse it)"
        );
        *reported = Some(Instant::now());
    }
}

/// The checks missed in a row, and the control connections the daemon held as the last of
/// them went unanswered (none when it failed otherwise).
#[derive(Debug, Default)]
struct Misses {
    count: u32,
    held: Vec<Held>,
}

/// One health check: the daemon answers, and holds the ceiling on its defaults and on every
/// running server (the backstop to the log reader: a client may have changed them through the
/// control socket). Why the daemon must be restarted, when it must.
async fn check(
    config: &SupervisorConfig,
    uuid: &str,
    state: &mut MpsState,
    tally: &Tally,
    misses: &mut Misses,
) -> Option<String> {
    let mut read = read_limits(config, uuid).await;
    // Unanswered: the connections the daemon holds now. One it held as the last check went
    // unanswered too has held it up through this whole check and the interval before it,
    // where a command takes milliseconds. (Listed only then: a daemon that answers costs no
    // reading of /proc.)
    let mut listed = Vec::new();
    if let (Err(e), Some(pid)) = (&read, state.pid)
        && e.unanswered()
    {
        listed = held::connections(pid).unwrap_or_else(|e| {
            warn!(uuid, pid, error = %e, "cannot list the MPS daemon's control connections");
            Vec::new()
        });
        let suspects = listed.iter().filter(|h| misses.held.contains(h)).copied().collect();
        if cut_held(uuid, pid, suspects) > 0 {
            // Free again: asked once more, it answers, and the misses end.
            read = read_limits(config, uuid).await;
        }
    }
    let (defaults, servers) = match read {
        Ok(held) => held,
        Err(e) => {
            misses.count += 1;
            misses.held = listed;
            warn!(uuid, missed = misses.count, error = %e, "MPS daemon check failed");
            return (misses.count >= config.max_missed).then(|| format!("stopped answering: {e}"));
        }
    };
    *misses = Misses::default();
    state.checked_at = unix_secs(SystemTime::now());
    // Memory is compared at the resolution the daemon prints; the log reader sees the rest.
    let off = if state.ceiling.as_ref().is_none_or(|c| defaults.hold(c)) {
        servers
            .into_iter()
            .find(|(_, p, m)| !holds(&state.ceiling, p, m))
            .map(|(pid, p, m)| format!("server {pid}: {p:?} and {m:?}"))
    } else {
        Some(format!(
            "defaults: {}% and {:?}, client priority {:?}",
            defaults.percentage, defaults.memory, defaults.priority
        ))
    };
    if let Some(held) = off {
        warn!(uuid, held, ceiling = ?state.ceiling, "the MPS daemon's limits were changed by a client: setting them again");
        state.ceiling = None;
        sync_ceiling(config, uuid, state, tally).await;
        if state.ceiling.is_none() {
            return Some("the daemon's limits were changed and could not be set again".into());
        }
    }
    write(config, uuid, state);
    None
}

/// The daemon's defaults and each running server's limits.
async fn read_limits(
    config: &SupervisorConfig,
    uuid: &str,
) -> Result<(crate::control::Defaults, Vec<(String, String, String)>), crate::control::ControlError> {
    let (layout, timeout) = (&config.layout, config.command_timeout);
    let defaults = config.binaries.defaults(layout, uuid, timeout).await?;
    let servers = config.binaries.server_limits(layout, uuid, timeout).await?;
    Ok((defaults, servers))
}

/// Shuts down `suspects`, connections daemon `pid` has held through two unanswered checks, if
/// it still holds them. Each is named in a warning; how many were cut.
fn cut_held(uuid: &str, pid: u32, suspects: Vec<Held>) -> usize {
    let mut cut = 0;
    for h in suspects {
        match held::cut(pid, h) {
            Ok(Outcome::Cut(peer)) => {
                cut += 1;
                warn!(
                    uuid,
                    client_pid = peer.pid,
                    client_uid = peer.uid,
                    client_cgroup = peer.cgroup.as_deref().unwrap_or("unknown"),
                    "a client held the MPS daemon's control connection without a command through two \
                     checks: cut it (the daemon serves one connection at a time)"
                );
            }
            Ok(Outcome::Kept(peer)) => warn!(
                uuid,
                client_pid = peer.pid,
                "the MPS daemon is held by a connection of a process it started: left"
            ),
            Ok(Outcome::Gone) => {}
            Err(e) => warn!(uuid, fd = h.fd, error = %e, "cannot cut the MPS daemon's control connection"),
        }
    }
    cut
}

/// Whether the daemon's answers are the ceiling set (true when none is: nothing to compare).
fn holds(set: &Option<MpsCeiling>, pct: &str, mem: &str) -> bool {
    set.as_ref().is_none_or(|c| crate::control::holds(c, pct, mem))
}

async fn stop_daemon(config: &SupervisorConfig, uuid: &str, child: &mut Child, state: &mut MpsState) -> Ended {
    let _ = crate::card_dirs::withdraw(&config.layout, uuid);
    // The real client exits 1 after a `quit` that follows a server failure although the daemon
    // quits: what counts is whether the daemon exits.
    let quit = config
        .binaries
        .command(&config.layout, uuid, "quit", config.command_timeout)
        .await;
    match tokio::time::timeout(config.stop_timeout, child.wait()).await {
        Ok(status) => info!(uuid, status = describe(status), "MPS daemon stopped"),
        Err(_) => {
            warn!(uuid, quit = ?quit.err(), "MPS daemon did not quit in time: killing it");
            let _ = child.kill().await;
        }
    }
    state.phase = DaemonPhase::Stopped;
    state.ceiling = None;
    state.pid = None;
    state.reason = None;
    state.checked_at = unix_secs(SystemTime::now());
    write(config, uuid, state);
    Ended::Stop
}

fn describe(status: std::io::Result<std::process::ExitStatus>) -> String {
    match status {
        Ok(s) => s.to_string(),
        Err(e) => format!("wait failed: {e}"),
    }
}
