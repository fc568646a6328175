//! One MPS control daemon per card that can host shares, each watched by its own task: started
//! (in its own mount namespace, killed by the kernel if the supervisor dies, see
//! [`crate::namespace`]), checked every few seconds through a control command, restarted with
//! exponential backoff when it dies or stops answering, and stopped with `quit` on shutdown. A
//! daemon left on the card's pipe directory by an earlier supervisor is stopped first
//! ([`crate::leftover`]). The daemon's own output becomes log lines naming its card, without
//! the chatter of control connections; the commands clients send it are read off that output
//! ([`crate::tamper`]), and any that may have changed a limit make the card's ceiling be set
//! again, once however many came. Every change is logged and written to the card's
//! `state.json` ([`MpsLayout`]), which the NRI plugin reads before it admits a share.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use tessera_core::enforcement::{DaemonPhase, MpsCeiling, MpsLayout, MpsState, unix_secs};

use crate::compute_mode::{self, ComputeModes};
use tokio::io::{AsyncBufRead, AsyncBufReadExt as _, AsyncReadExt as _, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{debug, error, info, warn};

use crate::control::MpsBinaries;
use crate::tamper::Tally;

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
                        Err(e) => warn!(uuid, error = e, "cannot set the card back to default compute mode"),
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

/// The last thing a daemon said that was not health-check chatter (why it would not start).
type LastWords = Arc<Mutex<Option<String>>>;

/// Where the daemon's output stands in a control connection's lines.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Ui {
    /// No connection open.
    #[default]
    Idle,
    /// A connection open, waiting for its command (a client that holds one open and says
    /// nothing stays here: the daemon's other lines must still be seen).
    Open,
    /// A command logged: the next line is its answer (or the next command).
    Command,
    /// The answer read.
    Answered,
}

/// The control daemon logs five lines per control connection (`-f`): its accepting, `NEW UI`,
/// the command, the answer and `UI closed`. They are noise: the supervisor's own checks and
/// ceilings, and clients' commands, which the card's [`Tally`] counts and its supervision
/// reports (a flood of commands is not a flood of log lines). Returns whether `line` is such,
/// tracking where in a connection the daemon is: only a connection's own lines are noise, so a
/// server's exit said while a client holds a connection open is still logged.
fn chatter(line: &str, ui: &mut Ui) -> bool {
    let text = line
        .strip_prefix('[')
        .and_then(|rest| rest.split_once("] "))
        .map_or(line, |(_, t)| t)
        .trim();
    match text {
        "Accepting connection..." => true,
        "NEW UI" => {
            *ui = Ui::Open;
            true
        }
        "UI closed" => {
            *ui = Ui::Idle;
            true
        }
        t if t.starts_with("Cmd:") && *ui != Ui::Idle => {
            *ui = Ui::Command;
            true
        }
        _ if *ui == Ui::Command => {
            *ui = Ui::Answered;
            true
        }
        _ => false,
    }
}

/// The command the health check sends.
const HEALTH_QUERY: &str = "get_default_active_thread_percentage";

/// The longest line of the daemon's output read: the rest of a longer one (a client's long
/// command) is dropped.
const MAX_LINE: u64 = 8192;

/// Reads the next line of `reader` into `buf`, without its newline and cut to [`MAX_LINE`]
/// bytes, whatever bytes it holds; false at the end.
async fn next_line<R: AsyncBufRead + Unpin>(reader: &mut R, buf: &mut Vec<u8>) -> std::io::Result<bool> {
    buf.clear();
    if (&mut *reader).take(MAX_LINE).read_until(b'\n', buf).await? == 0 {
        return Ok(false);
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
        return Ok(true);
    }
    // Cut short (or the last line): the rest of it is dropped.
    loop {
        let chunk = reader.fill_buf().await?;
        match chunk.iter().position(|&b| b == b'\n') {
            _ if chunk.is_empty() => return Ok(true),
            Some(at) => {
                reader.consume(at + 1);
                return Ok(true);
            }
            None => {
                let all = chunk.len();
                reader.consume(all);
            }
        }
    }
}

fn spawn(config: &SupervisorConfig, uuid: &str, last: &LastWords) -> std::io::Result<(Child, Arc<Tally>)> {
    let tally = Arc::new(Tally::default());
    let mut child = Command::new(&config.exec_self)
        .arg("exec-daemon")
        .arg("--shm")
        .arg(config.layout.shm_dir(uuid))
        .arg("--parent")
        .arg(std::process::id().to_string())
        .arg("--")
        .arg(&config.binaries.control)
        .arg("-f")
        .envs(config.binaries.env(&config.layout, uuid))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    // The daemon's own output, as log lines naming its card; the commands in it, told.
    for stream in [
        child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn tokio::io::AsyncRead + Unpin + Send>),
        child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn tokio::io::AsyncRead + Unpin + Send>),
    ]
    .into_iter()
    .flatten()
    {
        let uuid = uuid.to_string();
        let last = last.clone();
        let tally = tally.clone();
        tokio::spawn(async move {
            let mut reader = BufReader::new(stream);
            let mut buf = Vec::new();
            let mut ui = Ui::Idle;
            // Any bytes a client sends are logged back: a line that is no UTF-8 is read too.
            while let Ok(true) = next_line(&mut reader, &mut buf).await {
                let line = String::from_utf8_lossy(&buf);
                let command = tally.hear(&line);
                if chatter(&line, &mut ui) || command.is_some() {
                    debug!(uuid, "mps-control: {line}");
                } else {
                    info!(uuid, "mps-control: {line}");
                    *last.lock().unwrap_or_else(|e| e.into_inner()) = Some(line.into_owned());
                }
            }
        });
    }
    Ok((child, tally))
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

/// Sets a card whose daemon is stopped for good back to default compute mode, when Tessera
/// made it exclusive.
async fn release(config: &SupervisorConfig, uuid: &str) {
    if let Some(modes) = &config.compute_modes
        && let Err(e) = modes.release(&config.layout, uuid).await
    {
        warn!(uuid, error = e, "cannot set the card back to default compute mode");
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

/// Why the daemon ended, with the last thing it said.
fn with_last_words(reason: String, last: &LastWords) -> String {
    match last.lock().unwrap_or_else(|e| e.into_inner()).take() {
        Some(words) => format!(
            "{reason}: {}",
            words.rsplit_once("] ").map_or(words.as_str(), |(_, t)| t).trim()
        ),
        None => reason,
    }
}

/// Runs one started daemon until it fails or the supervisor stops.
async fn run(
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
    let mut missed = 0;
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
                if let Some(reason) = check(config, uuid, state, &tally, &mut missed).await {
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

/// How long a lower wanted ceiling must stay wanted before the daemon is set to it. A raise is
/// set at once (a share's creation waits for it); a lowering waits: the card's last share
/// stopping and the next one starting (a Job's pods one after another) would otherwise set the
/// daemon down and up again, and a share that came meanwhile could meet the lower ceiling, or
/// time out waiting, while the daemon works through the first change.
const LOWER_AFTER: Duration = Duration::from_secs(1);

/// Since when the card has been wanted at a lower ceiling than its daemon holds (whatever
/// lower value: a tenant that keeps changing it keeps no higher ceiling alive).
#[derive(Default)]
struct Lowering(Option<Instant>);

impl Lowering {
    /// Whether the ceiling should be synced now: anything but a lowering at once, a lowering
    /// once the held ceiling has stopped being wanted for [`LOWER_AFTER`].
    fn due(&mut self, config: &SupervisorConfig, uuid: &str, state: &MpsState) -> bool {
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

/// One health check: the daemon answers, and holds the ceiling on its defaults and on every
/// running server (the backstop to the log reader: a client may have changed them through the
/// control socket). Why the daemon must be restarted, when it must.
async fn check(
    config: &SupervisorConfig,
    uuid: &str,
    state: &mut MpsState,
    tally: &Tally,
    missed: &mut u32,
) -> Option<String> {
    let (layout, timeout) = (&config.layout, config.command_timeout);
    let read = async {
        let defaults = config.binaries.defaults(layout, uuid, timeout).await?;
        let servers = config.binaries.server_limits(layout, uuid, timeout).await?;
        Ok::<_, crate::control::ControlError>((defaults, servers))
    };
    let ((pct, mem), servers) = match read.await {
        Ok(held) => held,
        Err(e) => {
            *missed += 1;
            warn!(uuid, missed = *missed, error = %e, "MPS daemon check failed");
            return (*missed >= config.max_missed).then(|| format!("stopped answering: {e}"));
        }
    };
    *missed = 0;
    state.checked_at = unix_secs(SystemTime::now());
    // Memory is compared at the resolution the daemon prints; the log reader sees the rest.
    let off = if holds(&state.ceiling, &pct.to_string(), &mem) {
        servers
            .into_iter()
            .find(|(_, p, m)| !holds(&state.ceiling, p, m))
            .map(|(pid, p, m)| format!("server {pid}: {p:?} and {m:?}"))
    } else {
        Some(format!("defaults: {pct}% and {mem:?}"))
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

/// Whether the daemon's answers are the ceiling set (true when none is: nothing to compare).
fn holds(set: &Option<MpsCeiling>, pct: &str, mem: &str) -> bool {
    set.as_ref().is_none_or(|c| crate::control::holds(c, pct, mem))
}

/// Sets the card's wanted ceiling ([`MpsLayout::read_ceiling`], closed when none is written)
/// on its daemon when it differs from what was set, and records it in the state. The log
/// reader takes the commands sent for it as the supervisor's own from now on.
async fn sync_ceiling(config: &SupervisorConfig, uuid: &str, state: &mut MpsState, tally: &Tally) {
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
    match config
        .binaries
        .apply_ceiling(&config.layout, uuid, &wanted, config.command_timeout)
        .await
    {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_daemons_output_is_read_whatever_its_bytes() {
        // A client's command comes back in the daemon's log as it was sent: bytes that are no
        // UTF-8, a line longer than any the daemon writes of its own.
        let mut out = b"[t Control 1] Cmd:set_default_active_thread_percentage 100 \xff\n".to_vec();
        out.extend(vec![b'y'; 3 * MAX_LINE as usize]);
        out.extend(b"\n[t Control 1] UI closed\nno newline");
        let mut reader = BufReader::with_capacity(64, &out[..]);
        let (mut buf, mut lines) = (Vec::new(), Vec::new());
        while next_line(&mut reader, &mut buf).await.unwrap() {
            lines.push(buf.clone());
        }
        assert_eq!(
            lines,
            [
                b"[t Control 1] Cmd:set_default_active_thread_percentage 100 \xff".to_vec(),
                vec![b'y'; MAX_LINE as usize],
                b"[t Control 1] UI closed".to_vec(),
                b"no newline".to_vec(),
            ]
        );
    }

    #[test]
    fn a_control_connections_lines_are_chatter() {
        let mut ui = Ui::Idle;
        let chatty: Vec<bool> = [
            "Starting control daemon using socket /x/control",
            "Accepting connection...",
            "NEW UI",
            "Cmd:set_default_active_thread_percentage 100",
            "100.0",
            "UI closed",
            "Server 12400 exited with status 1",
            // A client that holds a connection open and says nothing hides nothing.
            "Accepting connection...",
            "NEW UI",
            "Server 12401 exited with status 1",
            "Cmd:get_default_active_thread_percentage",
            "30.0",
            "Cannot start server: out of memory",
        ]
        .iter()
        .map(|l| chatter(&format!("[2026-11-24 02:05:10.267 Control 14056] {l}"), &mut ui))
        .collect();
        assert_eq!(
            chatty,
            [
                false, true, true, true, true, true, false, true, true, false, true, true, false
            ]
        );
    }

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
