//! One MPS control daemon per card that can host shares, each watched by its own task.
//!
//! A daemon is started in its own mount namespace, killed by the kernel if the supervisor dies
//! ([`crate::namespace`]), checked every few seconds through a control command, restarted with
//! exponential backoff when it dies or stops answering (a silent client connection that held it
//! through two unanswered checks is cut first: [`crate::held`]), and stopped with `quit` on
//! shutdown. A daemon left on the card's pipe directory by an earlier supervisor is stopped
//! first ([`crate::leftover`]). The daemon's own output becomes log lines naming its card, without
//! the chatter of control connections (`output`); the commands clients send it are read off
//! that output ([`crate::tamper`]), and any that may have changed a limit make the card's
//! ceiling be set again, once however many came (`daemon`, `ceiling`). Every change is logged
//! and written to the card's `state.json` ([`MpsLayout`]), which the NRI plugin reads before it
//! admits a share.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tessera_core::enforcement::{DaemonPhase, MpsLayout, MpsState, unix_secs};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{error, info, warn};

use crate::compute_mode::{self, ComputeModes};
use crate::control::MpsBinaries;

mod ceiling;
mod daemon;
mod output;

use daemon::run;
use output::{LastWords, spawn};

/// Delays between restarts: `base * 2^failures`, at most `max`; the count starts over once a
/// daemon has stayed ready for `healthy_after`.
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    /// First delay.
    pub base: Duration,
    /// Largest delay.
    pub max: Duration,
    /// Ready this long: the next failure is a first one again.
    pub healthy_after: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            base: Duration::from_secs(1),
            max: Duration::from_secs(60),
            healthy_after: Duration::from_secs(300),
        }
    }
}

impl Backoff {
    /// The delay after `failures` consecutive failures (1 for the first).
    pub fn delay(&self, failures: u32) -> Duration {
        let factor = 1u32.checked_shl(failures.saturating_sub(1).min(16)).unwrap_or(u32::MAX);
        self.base.saturating_mul(factor).min(self.max)
    }
}

/// Supervision settings.
#[derive(Debug, Clone)]
pub struct SupervisorConfig {
    /// Where each card's directories and state are.
    pub layout: MpsLayout,
    /// The driver's MPS programs.
    pub binaries: MpsBinaries,
    /// This program (re-executed as `exec-daemon` to give each daemon its own `/dev/shm`).
    pub exec_self: PathBuf,
    /// Health-check interval.
    pub check_every: Duration,
    /// How long a new daemon may take to answer.
    pub start_timeout: Duration,
    /// How long one control command may take.
    pub command_timeout: Duration,
    /// Missed checks in a row before a running daemon is restarted.
    pub max_missed: u32,
    /// How long a stopping daemon may take before it is killed.
    pub stop_timeout: Duration,
    /// Restart delays.
    pub backoff: Backoff,
    /// Size of each card's shm tmpfs, MiB.
    pub shm_mib: u64,
    /// Sets cards' compute modes (`None`: no `nvidia-smi`, modes are left as they are).
    pub compute_modes: Option<ComputeModes>,
    /// Put each card in exclusive-process compute mode while its daemon runs; either way a
    /// card an earlier supervisor left exclusive is set back when this one is not to keep it.
    pub exclusive_process: bool,
}

/// Default size of each card's shm tmpfs: what the card's clients and server share in all.
pub const DEFAULT_SHM_MIB: u64 = 2048;

impl SupervisorConfig {
    /// Defaults around a layout and the MPS programs.
    pub fn new(layout: MpsLayout, binaries: MpsBinaries, exec_self: PathBuf) -> Self {
        Self {
            layout,
            binaries,
            exec_self,
            check_every: Duration::from_secs(5),
            start_timeout: Duration::from_secs(30),
            command_timeout: Duration::from_secs(5),
            max_missed: 3,
            stop_timeout: Duration::from_secs(10),
            backoff: Backoff::default(),
            shm_mib: DEFAULT_SHM_MIB,
            compute_modes: None,
            exclusive_process: false,
        }
    }
}

struct Card {
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

/// The daemons of a node's cards.
pub struct Supervisor {
    config: Arc<SupervisorConfig>,
    cards: BTreeMap<String, Card>,
}

impl Supervisor {
    /// A supervisor running nothing yet.
    pub fn new(config: SupervisorConfig) -> Self {
        Self {
            config: Arc::new(config),
            cards: BTreeMap::new(),
        }
    }

    /// Runs a daemon for each of `uuids` and stops those of cards no longer listed (a card
    /// put in MIG mode, a card gone).
    pub async fn reconcile(&mut self, uuids: &[String]) {
        let gone: Vec<String> = self.cards.keys().filter(|u| !uuids.contains(u)).cloned().collect();
        for uuid in gone {
            if let Some(card) = self.cards.remove(&uuid) {
                info!(uuid, "card no longer hosts shares: stopping its MPS daemon");
                stop_card(card).await;
            }
        }
        // A card an earlier supervisor left exclusive that this one is not to keep so: it
        // hosts no shares now, or exclusive-process mode is no longer asked for.
        if let Some(modes) = &self.config.compute_modes {
            for uuid in self.config.layout.cards() {
                let leftover = compute_mode::marker(&self.config.layout, &uuid).exists();
                let kept = self.config.exclusive_process && (uuids.contains(&uuid) || self.cards.contains_key(&uuid));
                if leftover && !kept {
                    match modes.release(&self.config.layout, &uuid).await {
                        Ok(()) => info!(uuid, "card left in exclusive-process mode: set back to default"),
                        Err(e) => warn!(uuid, error = %e, "cannot set the card back to default compute mode"),
                    }
                }
            }
        }
        for uuid in uuids {
            if !self.cards.contains_key(uuid) {
                let (stop, rx) = watch::channel(false);
                let task = tokio::spawn(supervise(self.config.clone(), uuid.clone(), rx));
                self.cards.insert(uuid.clone(), Card { stop, task });
            }
        }
    }

    /// The cards supervised.
    pub fn cards(&self) -> Vec<String> {
        self.cards.keys().cloned().collect()
    }

    /// Stops every daemon (`quit`, then a kill after the stop timeout).
    pub async fn shutdown(self) {
        // Every card told first, then waited for: the daemons stop side by side.
        let cards: Vec<Card> = self.cards.into_values().collect();
        for card in &cards {
            let _ = card.stop.send(true);
        }
        for card in cards {
            let _ = card.task.await;
        }
    }
}

async fn stop_card(card: Card) {
    let _ = card.stop.send(true);
    let _ = card.task.await;
}

fn write(config: &SupervisorConfig, uuid: &str, state: &MpsState) {
    if let Err(e) = config.layout.write_state(uuid, state) {
        error!(uuid, error = %e, "cannot write the MPS daemon state");
    }
}

fn prepare_dirs(config: &SupervisorConfig, uuid: &str) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    let layout = &config.layout;
    // Servers run under their clients' uids and open the pipe directory's log FIFO and socket.
    for dir in [layout.pipe_dir(uuid), layout.log_dir(uuid), layout.client_dir(uuid)] {
        std::fs::create_dir_all(&dir)?;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))?;
    }
    // No client reaches the daemon before it holds its ceiling.
    crate::card_dirs::withdraw(layout, uuid)?;
    let shm = layout.shm_dir(uuid);
    std::fs::create_dir_all(&shm)?;
    crate::card_dirs::mount_shm(&shm, config.shm_mib)
}

/// How one run of a daemon ended.
enum Ended {
    /// The supervisor is stopping.
    Stop,
    /// It failed, with why; `ready_for` is how long it had been ready.
    Failed { reason: String, ready_for: Duration },
}

async fn supervise(config: Arc<SupervisorConfig>, uuid: String, mut stop: watch::Receiver<bool>) {
    let mut restarts = 0u32;
    let mut failures = 0u32;
    loop {
        let now = SystemTime::now();
        let mut state = MpsState {
            phase: DaemonPhase::Starting,
            pid: None,
            restarts,
            started_at: unix_secs(now),
            checked_at: unix_secs(now),
            reason: None,
            ceiling: None,
            exclusive_process: None,
        };
        let last: LastWords = Arc::default();
        let prepared = prepare_dirs(&config, &uuid);
        if prepared.is_ok() {
            stop_leftover(&config, &uuid).await;
        }
        // Exclusive before the daemon starts, or no daemon: a share's limits must not hold
        // only for processes that choose MPS.
        let exclusive = match &config.compute_modes {
            Some(modes) if config.exclusive_process && prepared.is_ok() => {
                modes.make_exclusive(&config.layout, &uuid).await
            }
            _ => Ok(()),
        };
        let ended = match exclusive {
            Err(e) => Ended::Failed {
                reason: format!("cannot put the card in exclusive-process mode: {e}"),
                ready_for: Duration::ZERO,
            },
            Ok(()) => match prepared.and_then(|()| spawn(&config, &uuid, &last)) {
                Ok((child, tally)) => {
                    state.pid = child.id();
                    state.exclusive_process = compute_mode_now(&config, &uuid).await;
                    write(&config, &uuid, &state);
                    info!(uuid, pid = state.pid, restarts, "MPS daemon started");
                    run(&config, &uuid, (child, tally), &mut state, &mut stop, &last).await
                }
                Err(e) => Ended::Failed {
                    reason: format!("cannot start: {e}"),
                    ready_for: Duration::ZERO,
                },
            },
        };
        if let Err(e) = crate::card_dirs::withdraw(&config.layout, &uuid) {
            warn!(uuid, error = %e, "cannot remove the link to the daemon's control socket");
        }
        let (reason, ready_for) = match ended {
            Ended::Stop => {
                if let Err(e) = crate::card_dirs::unmount_shm(&config.layout.shm_dir(&uuid)) {
                    warn!(uuid, error = %e, "cannot unmount the card's shm");
                }
                release(&config, &uuid).await;
                return;
            }
            Ended::Failed { reason, ready_for } => (reason, ready_for),
        };
        if ready_for >= config.backoff.healthy_after {
            failures = 0;
        }
        failures += 1;
        restarts += 1;
        let delay = config.backoff.delay(failures);
        state.phase = DaemonPhase::Restarting;
        state.ceiling = None;
        state.pid = None;
        state.restarts = restarts;
        state.checked_at = unix_secs(SystemTime::now());
        state.reason = Some(reason.clone());
        write(&config, &uuid, &state);
        warn!(
            uuid,
            reason,
            restarts,
            delay_ms = delay.as_millis() as u64,
            "MPS daemon failed: restarting"
        );
        tokio::select! {
            _ = stop.changed() => {
                state.phase = DaemonPhase::Stopped;
                state.ceiling = None;
                state.reason = None;
                write(&config, &uuid, &state);
                if let Err(e) = crate::card_dirs::unmount_shm(&config.layout.shm_dir(&uuid)) {
                    warn!(uuid, error = %e, "cannot unmount the card's shm");
                }
                release(&config, &uuid).await;
                return;
            }
            _ = tokio::time::sleep(delay) => {}
        }
    }
}

/// Whether the card is in exclusive-process mode, as `nvidia-smi` reads it back (`None` without
/// `nvidia-smi`, or when it cannot say): `check` tells which cards a process that goes around
/// MPS could take whole.
async fn compute_mode_now(config: &SupervisorConfig, uuid: &str) -> Option<bool> {
    let modes = config.compute_modes.as_ref()?;
    match modes.is_exclusive(uuid).await {
        Ok(exclusive) => Some(exclusive),
        Err(e) => {
            warn!(uuid, error = %e, "cannot read the card's compute mode");
            None
        }
    }
}

/// Sets a card whose daemon is stopped for good back to default compute mode, when Tessera
/// made it exclusive.
async fn release(config: &SupervisorConfig, uuid: &str) {
    if let Some(modes) = &config.compute_modes
        && let Err(e) = modes.release(&config.layout, uuid).await
    {
        warn!(uuid, error = %e, "cannot set the card back to default compute mode");
    }
}

/// Stops a daemon an earlier supervisor left on the card's pipe directory: `quit`, then
/// SIGTERM, then SIGKILL. A lock held by anything but an MPS program is left alone (the start
/// then fails, saying so, and is retried).
async fn stop_leftover(config: &SupervisorConfig, uuid: &str) {
    use nix::sys::signal::{Signal, kill};
    let Some(holder) = crate::leftover::lock_holder(&config.layout.pipe_dir(uuid)) else {
        return;
    };
    if !holder.is_mps() {
        warn!(
            uuid,
            pid = holder.pid,
            comm = holder.comm,
            "a process that is no MPS daemon holds the card's MPS pipe directory: not stopping it"
        );
        return;
    }
    warn!(
        uuid,
        pid = holder.pid,
        "an MPS daemon left by an earlier supervisor holds the card's pipe directory: stopping it"
    );
    let holder = &holder;
    let gone = |wait: Duration| async move {
        let deadline = Instant::now() + wait;
        while holder.alive() {
            if Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        true
    };
    // A hung daemon never answers: the client is given a short time.
    let quit = config
        .binaries
        .command(&config.layout, uuid, "quit", Duration::from_secs(2))
        .await;
    if quit.is_ok() && gone(config.stop_timeout).await {
        info!(uuid, pid = holder.pid, "leftover MPS daemon quit");
        return;
    }
    let pid = nix::unistd::Pid::from_raw(holder.pid);
    // Only while it still holds the lock: its pid may have gone to another process.
    let still_holds = || crate::leftover::lock_holder(&config.layout.pipe_dir(uuid)).as_ref() == Some(holder);
    if !still_holds() {
        return;
    }
    let _ = kill(pid, Signal::SIGTERM);
    if gone(Duration::from_secs(2)).await {
        info!(uuid, pid = holder.pid, "leftover MPS daemon stopped (SIGTERM)");
        return;
    }
    if !still_holds() {
        return;
    }
    let _ = kill(pid, Signal::SIGKILL);
    if gone(Duration::from_secs(2)).await {
        info!(uuid, pid = holder.pid, "leftover MPS daemon killed");
    } else {
        error!(uuid, pid = holder.pid, "leftover MPS daemon survived SIGKILL");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_its_cap() {
        let b = Backoff {
            base: Duration::from_millis(500),
            max: Duration::from_secs(5),
            healthy_after: Duration::from_secs(60),
        };
        let d: Vec<u128> = (1..=6).map(|f| b.delay(f).as_millis()).collect();
        assert_eq!(d, [500, 1000, 2000, 4000, 5000, 5000]);
        assert_eq!(b.delay(1000), Duration::from_secs(5));
    }
}
