//! What clients tell a card's daemon, read off its log: the control socket takes limit changes
//! and server stops from any client (MPS has no way to refuse them), and the daemon logs each
//! command as `Cmd:<command>`. A limit set to anything but the card's ceiling (the supervisor
//! only ever sets the ceiling) is put back at once, rather than at the next health check; a
//! server stop cannot be undone and is reported.

use tessera_core::enforcement::MpsCeiling;

/// A command that changes what the card's clients are held to, or stops them.
#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    /// `set_default_active_thread_percentage N` or `set_active_thread_percentage PID N`.
    Percentage(String),
    /// `set_default_device_pinned_mem_limit DEV V` or `set_device_pinned_mem_limit PID DEV V`.
    Memory(String),
    /// `shutdown_server PID` or `terminate_client PID CLIENT`.
    Stop(String),
}

impl Command {
    /// The command in a daemon log line, when it is one of these.
    pub fn in_log(line: &str) -> Option<Self> {
        let text = line.rsplit_once("] ").map_or(line, |(_, t)| t).trim();
        let cmd = text.strip_prefix("Cmd:")?.trim();
        let words: Vec<&str> = cmd.split_whitespace().collect();
        match words.as_slice() {
            ["set_default_active_thread_percentage", n] | ["set_active_thread_percentage", _, n] => {
                Some(Self::Percentage((*n).to_string()))
            }
            ["set_default_device_pinned_mem_limit", _, v] | ["set_device_pinned_mem_limit", _, _, v] => {
                Some(Self::Memory((*v).to_string()))
            }
            ["shutdown_server", ..] | ["terminate_client", ..] => Some(Self::Stop(cmd.to_string())),
            _ => None,
        }
    }

    /// Whether the command set a limit other than `ceiling` (what is unreadable counts as
    /// other).
    pub fn breaks(&self, ceiling: &MpsCeiling) -> bool {
        match self {
            Self::Percentage(n) => n.parse::<f64>().map_or(true, |p| {
                (p - f64::from(ceiling.active_thread_percentage)).abs() >= 0.05
            }),
            Self::Memory(v) => mib(v) != Some(ceiling.pinned_memory_mib.max(1)),
            Self::Stop(_) => false,
        }
    }
}

/// A memory limit as the control client takes it (`8192M`, `8G`, `1T`, `0`), in MiB.
fn mib(v: &str) -> Option<u64> {
    let (num, unit) = v.split_at(v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len()));
    let n: u64 = num.parse().ok()?;
    match unit {
        "M" | "m" => Some(n),
        "G" | "g" => n.checked_mul(1 << 10),
        "T" | "t" => n.checked_mul(1 << 20),
        "" if n == 0 => Some(0),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limit_changes_are_read_off_the_log_and_held_to_the_ceiling() {
        let c = MpsCeiling {
            active_thread_percentage: 30,
            pinned_memory_mib: 8192,
        };
        let at = |cmd: &str| Command::in_log(&format!("[2026-11-24 02:05:10.267 Control 14056] Cmd:{cmd}"));
        // The supervisor's own commands hold.
        for own in [
            "set_default_active_thread_percentage 30",
            "set_default_device_pinned_mem_limit 0 8192M",
        ] {
            assert!(!at(own).unwrap().breaks(&c), "{own}");
        }
        assert!(!at("set_device_pinned_mem_limit 4242 0 8G").unwrap().breaks(&c));
        // A client's do not.
        for theirs in [
            "set_default_active_thread_percentage 100",
            "set_default_active_thread_percentage 1",
            "set_active_thread_percentage 4242 100",
            "set_default_device_pinned_mem_limit 0 0",
            "set_default_device_pinned_mem_limit 0 80G",
            "set_device_pinned_mem_limit 4242 0 9000M",
            "set_default_active_thread_percentage lots",
        ] {
            assert!(at(theirs).unwrap().breaks(&c), "{theirs}");
        }
        assert_eq!(
            at("shutdown_server 4242"),
            Some(Command::Stop("shutdown_server 4242".into()))
        );
        assert_eq!(at("get_default_active_thread_percentage"), None);
        assert_eq!(Command::in_log("[x] Starting control daemon"), None);
        // A closed card's ceiling is 1 MiB.
        assert!(
            !at("set_default_device_pinned_mem_limit 0 1M")
                .unwrap()
                .breaks(&MpsCeiling::CLOSED)
        );
    }
}
