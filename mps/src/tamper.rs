//! What clients tell a card's daemon, read off its log. The control socket takes limit changes
//! and server stops from any client (MPS has no way to refuse them), and the daemon logs each
//! command as `Cmd:<command>`. The daemon reads a command's first word and takes the numbers
//! after it, ignoring words that follow, so what a client set cannot be read off its words: a
//! command is harmless only when it is a query, or word for word one the supervisor sends for
//! the ceiling it holds the card to. Anything else may have changed a limit and wakes the card's
//! supervision to put the ceiling back; a server stop cannot be undone and is reported. Commands
//! are counted, never queued ([`Tally`]): a flood of them costs a few counters and one re-apply.

use std::sync::Mutex;

use tessera_core::enforcement::MpsCeiling;
use tokio::sync::Notify;

use crate::control::{default_commands, server_commands};

/// What a command sent to the daemon is, for the card's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A query: it changes nothing.
    Query,
    /// Word for word a command the supervisor sends for a ceiling it holds the card to: it can
    /// only set that ceiling.
    Own,
    /// A server or client stopped (`shutdown_server`, `terminate_client`, `quit`).
    Stop,
    /// Anything else (a `set_*` with other words, an unknown command): it may have changed a
    /// limit.
    Change,
}

/// The daemon's queries (535 and 550), by their first word.
const QUERIES: &[&str] = &[
    "get_server_list",
    "get_server_status",
    "get_client_list",
    "get_device_client_list",
    "get_active_thread_percentage",
    "get_device_pinned_mem_limit",
    "get_default_active_thread_percentage",
    "get_default_device_pinned_mem_limit",
    "get_default_client_priority",
];

/// The daemon's stops, by their first word.
const STOPS: &[&str] = &["shutdown_server", "terminate_client", "quit"];

/// The command in a line of the daemon's output (the text after `Cmd:`, as the daemon printed
/// it), when the line logs one. The daemon's own prefix (`[2026-11-24 02:05:10.267 Control
/// 14056] `) ends at its first `] `: a `] ` in a client's command does not move it.
pub fn command_in_log(line: &str) -> Option<&str> {
    let line = line.strip_suffix('\n').unwrap_or(line);
    let text = match line.strip_prefix('[') {
        Some(rest) => rest.split_once("] ").map_or(line, |(_, t)| t),
        None => line,
    };
    text.strip_prefix("Cmd:")
}

/// The command's first word as the daemon reads it (`%s`: after leading white space, up to
/// the next).
fn first_word(cmd: &str) -> &str {
    let c_space = |c: char| matches!(c, ' ' | '\t' | '\n' | '\x0b' | '\x0c' | '\r');
    cmd.trim_start_matches(c_space).split(c_space).next().unwrap_or("")
}

/// Whether `cmd` is, word for word, one the supervisor sends to set `ceiling` (on the defaults,
/// or on a running server, whatever its pid).
pub fn sent_for(cmd: &str, ceiling: &MpsCeiling) -> bool {
    if default_commands(ceiling).iter().any(|own| own == cmd) {
        return true;
    }
    let pid = cmd.split(' ').nth(1).unwrap_or("");
    (1..=10).contains(&pid.len())
        && pid.bytes().all(|b| b.is_ascii_digit())
        && server_commands(ceiling, pid).iter().any(|own| own == cmd)
}

/// What `cmd` (the text after `Cmd:`) is, given the ceilings whose commands are the
/// supervisor's own.
pub fn classify(cmd: &str, own: &[MpsCeiling]) -> Kind {
    let word = first_word(cmd);
    if QUERIES.contains(&word) {
        Kind::Query
    } else if STOPS.contains(&word) {
        Kind::Stop
    } else if own.iter().any(|c| sent_for(cmd, c)) {
        Kind::Own
    } else {
        Kind::Change
    }
}

/// Commands of one kind heard since they were last taken.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Counted {
    /// How many.
    pub count: u64,
    /// The last of them, cut to [`SHOWN_BYTES`].
    pub last: String,
}

/// How much of a client's command is kept for the log.
pub const SHOWN_BYTES: usize = 200;

impl Counted {
    fn add(&mut self, cmd: &str) {
        self.count += 1;
        let mut end = cmd.len().min(SHOWN_BYTES);
        while !cmd.is_char_boundary(end) {
            end -= 1;
        }
        self.last.clear();
        self.last.push_str(&cmd[..end]);
    }
}

/// What a card's log reader has heard, until the card's supervision takes it: commands that
/// may have changed a limit and stops, counted; and the ceilings whose commands are the
/// supervisor's own.
#[derive(Debug, Default)]
pub struct Tally {
    heard: Mutex<Heard>,
    /// Woken by a change: however many come before the supervision looks, it wakes once.
    changed: Notify,
}

#[derive(Debug, Default)]
struct Heard {
    changes: Counted,
    stops: Counted,
    /// The ceiling the supervisor holds the card to.
    current: Option<MpsCeiling>,
    /// The one before, while the log may still show its commands: until a command of the
    /// current one that is not also one of this one's is read (everything the supervisor sent
    /// for this one was logged before).
    previous: Option<MpsCeiling>,
    /// The sets of the current ceiling's default memory limit the daemon logged.
    memory_sets: u64,
}

impl Tally {
    fn heard(&self) -> std::sync::MutexGuard<'_, Heard> {
        self.heard.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes one line of the daemon's output; what it logged, when it logged a command.
    pub fn hear(&self, line: &str) -> Option<Kind> {
        let cmd = command_in_log(line)?;
        let mut heard = self.heard();
        let own: Vec<MpsCeiling> = heard.current.iter().chain(&heard.previous).copied().collect();
        let kind = classify(cmd, &own);
        match kind {
            Kind::Change => {
                heard.changes.add(cmd);
                drop(heard);
                self.changed.notify_one();
            }
            Kind::Stop => heard.stops.add(cmd),
            Kind::Own => {
                if heard.current.is_some_and(|c| default_commands(&c)[1] == cmd) {
                    heard.memory_sets += 1;
                }
                if let (Some(current), Some(previous)) = (heard.current, heard.previous)
                    && sent_for(cmd, &current)
                    && !sent_for(cmd, &previous)
                {
                    heard.previous = None;
                }
            }
            Kind::Query => {}
        }
        Some(kind)
    }

    /// The supervisor is about to set `ceiling`: its commands for it are its own from now on.
    /// Whether it differs from the ceiling set before.
    pub fn expect(&self, ceiling: MpsCeiling) -> bool {
        let mut heard = self.heard();
        if heard.current == Some(ceiling) {
            return false;
        }
        heard.previous = heard.current.replace(ceiling);
        true
    }

    /// How many of the supervisor's own sets of the default memory limit the daemon has logged:
    /// a set answers nothing, and the daemon drops a command that meets another client's
    /// connection, so its log is how a set is known to have been taken.
    pub fn memory_sets(&self) -> u64 {
        self.heard().memory_sets
    }

    /// Resolves once a change was heard since this last resolved (at once if one was).
    pub async fn changed(&self) {
        self.changed.notified().await;
    }

    /// The changes heard since last taken.
    pub fn take_changes(&self) -> Counted {
        std::mem::take(&mut self.heard().changes)
    }

    /// The stops heard since last taken.
    pub fn take_stops(&self) -> Counted {
        std::mem::take(&mut self.heard().stops)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const C: MpsCeiling = MpsCeiling {
        active_thread_percentage: 30,
        pinned_memory_mib: 8192,
    };

    /// A tally whose ceiling was [`C`] and is now [`LOWER`].
    fn lowered() -> Tally {
        let tally = Tally::default();
        tally.expect(C);
        tally.expect(LOWER);
        tally
    }

    const LOWER: MpsCeiling = MpsCeiling {
        active_thread_percentage: 30,
        pinned_memory_mib: 4096,
    };

    fn at(cmd: &str) -> String {
        format!("[2026-11-24 02:05:10.267 Control 14056] Cmd:{cmd}\n")
    }

    fn kind(cmd: &str) -> Kind {
        classify(command_in_log(&at(cmd)).unwrap(), &[C])
    }

    #[test]
    fn only_the_supervisors_own_words_hold() {
        // What the supervisor sends for the ceiling: on the defaults and on any running server.
        for own in [
            "set_default_active_thread_percentage 30",
            "set_default_device_pinned_mem_limit 0 8192M",
            "set_active_thread_percentage 4242 30",
            "set_device_pinned_mem_limit 4242 0 8192M",
        ] {
            assert_eq!(kind(own), Kind::Own, "{own}");
        }
        // Anything else may have set something else: the daemon ignores trailing words, takes
        // other units and number forms, and reads 9215M back as 8G.
        for theirs in [
            "set_default_active_thread_percentage 100",
            "set_default_active_thread_percentage 1",
            "set_default_active_thread_percentage 100 x",
            "set_default_active_thread_percentage 30 x",
            "set_default_active_thread_percentage 30.0",
            "set_default_active_thread_percentage  30",
            " set_default_active_thread_percentage 30",
            "set_default_active_thread_percentage 30 ",
            "set_default_active_thread_percentage\t30",
            "set_default_active_thread_percentage lots",
            "set_default_device_pinned_mem_limit 0 8G",
            "set_default_device_pinned_mem_limit 0 9215M",
            "set_default_device_pinned_mem_limit 0 8192M x",
            "set_default_device_pinned_mem_limit 0 8192",
            "set_default_device_pinned_mem_limit 00 8192M",
            "set_default_device_pinned_mem_limit 0 0",
            "set_active_thread_percentage 4242 100",
            "set_active_thread_percentage 4242 30 x",
            "set_active_thread_percentage -1 30",
            "set_active_thread_percentage  30",
            "set_device_pinned_mem_limit 4242 0 9000M",
            "set_device_pinned_mem_limit 4242 0 8G",
            "set_default_client_priority 1",
            "start_server -uid 65534",
            "lift_all_limits",
            "",
            "set_default_active_thread_percentage 100 \u{fffd}",
        ] {
            assert_eq!(kind(theirs), Kind::Change, "{theirs:?}");
        }
        // A `] ` in the command does not make the daemon's prefix end later.
        let forged = at("set_default_active_thread_percentage 100 ] Cmd:set_default_active_thread_percentage 30");
        assert_eq!(classify(command_in_log(&forged).unwrap(), &[C]), Kind::Change);
        // Queries and stops, by their first word as the daemon reads it.
        for query in [
            "get_default_active_thread_percentage",
            "get_default_device_pinned_mem_limit 0",
            "get_server_list",
            "get_active_thread_percentage 4242",
            "get_device_pinned_mem_limit 4242 0",
            " get_server_list x",
        ] {
            assert_eq!(kind(query), Kind::Query, "{query}");
        }
        assert_eq!(kind("get_default_active_thread_percentagex"), Kind::Change);
        for stop in ["shutdown_server 4242", "terminate_client 4242 17", "quit"] {
            assert_eq!(kind(stop), Kind::Stop, "{stop}");
        }
        assert_eq!(command_in_log("[x] Starting control daemon"), None);
        assert_eq!(command_in_log("[x] 30.0"), None);
        // A closed card's commands.
        assert_eq!(
            classify("set_default_device_pinned_mem_limit 0 1M", &[MpsCeiling::CLOSED]),
            Kind::Own
        );
        assert_eq!(
            classify("set_default_active_thread_percentage 1", &[MpsCeiling::CLOSED]),
            Kind::Own
        );
        // No ceiling set yet: nothing is the supervisor's.
        assert_eq!(classify("set_default_active_thread_percentage 30", &[]), Kind::Change);
    }

    #[test]
    fn commands_are_counted_and_wake_once() {
        let tally = Tally::default();
        assert!(tally.expect(C));
        assert!(!tally.expect(C));
        for _ in 0..10_000 {
            assert_eq!(
                tally.hear(&at("set_default_active_thread_percentage 100")),
                Some(Kind::Change)
            );
        }
        tally.hear(&at("shutdown_server 4242"));
        tally.hear(&at("set_default_active_thread_percentage 30"));
        tally.hear(&at("get_server_list"));
        assert_eq!(tally.hear("[x] UI closed"), None);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        // One wake-up for all of them, and no second one.
        rt.block_on(async {
            tokio::time::timeout(std::time::Duration::from_secs(1), tally.changed())
                .await
                .unwrap();
            assert!(
                tokio::time::timeout(std::time::Duration::from_millis(50), tally.changed())
                    .await
                    .is_err()
            );
        });
        assert_eq!(
            tally.take_changes(),
            Counted {
                count: 10_000,
                last: "set_default_active_thread_percentage 100".into()
            }
        );
        assert_eq!(tally.take_changes().count, 0);
        assert_eq!(tally.take_stops().count, 1);
        // A long command is kept cut short.
        tally.hear(&at(&format!("set_{}", "é".repeat(1000))));
        assert!(tally.take_changes().last.len() <= SHOWN_BYTES);
    }

    #[test]
    fn the_previous_ceilings_commands_hold_until_the_new_ones_are_logged() {
        let tally = lowered();
        // The old ceiling's commands, logged before the new ones were sent, are the supervisor's.
        let old = at("set_default_device_pinned_mem_limit 0 8192M");
        assert_eq!(tally.hear(&old), Some(Kind::Own));
        // A command both ceilings send tells nothing about which was sent.
        assert_eq!(
            tally.hear(&at("set_default_active_thread_percentage 30")),
            Some(Kind::Own)
        );
        assert_eq!(tally.hear(&old), Some(Kind::Own));
        // Once one only the new ceiling sends is logged, the old one's are a client's.
        assert_eq!(
            tally.hear(&at("set_default_device_pinned_mem_limit 0 4096M")),
            Some(Kind::Own)
        );
        assert_eq!(tally.hear(&old), Some(Kind::Change));
        assert_eq!(tally.take_changes().count, 1);
    }

    /// Only the current ceiling's memory set, as the daemon logged it, counts as taken: not the
    /// previous ceiling's logged late, nor another command.
    #[test]
    fn a_memory_set_counts_once_logged() {
        let tally = lowered();
        for cmd in [
            "set_default_device_pinned_mem_limit 0 8192M",
            "set_default_active_thread_percentage 30",
            "get_default_device_pinned_mem_limit 0",
            "set_device_pinned_mem_limit 4242 0 4096M",
        ] {
            tally.hear(&at(cmd));
        }
        assert_eq!(tally.memory_sets(), 0);
        tally.hear(&at("set_default_device_pinned_mem_limit 0 4096M"));
        assert_eq!(tally.memory_sets(), 1);
    }
}
