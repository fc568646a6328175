//! How one card's MPS control daemon is started and spoken to: the driver's
//! `nvidia-cuda-mps-control`, its environment (the card, its pipe and log directories, where the
//! driver's libraries and the MPS server are), and one-line control commands.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tessera_core::enforcement::{MpsCeiling, MpsLayout};
use tokio::io::AsyncWriteExt as _;
use tokio::process::Command;

/// Why a control command, or finding the MPS programs, failed.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// An MPS program is not among the driver's files.
    #[error("{program} not found under driver root {} (tessera-cdi-generator driver lists what was found)", root.display())]
    NotFound {
        /// The program.
        program: &'static str,
        /// The driver root searched.
        root: PathBuf,
    },
    /// The control client could not be run.
    #[error("running {}", program.display())]
    Spawn {
        /// The control client.
        program: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The command could not be given to the control client, or its end not awaited.
    #[error("{what} {cmd:?} and the control client")]
    Pipe {
        /// What failed (`writing`, `waiting for`).
        what: &'static str,
        /// The command.
        cmd: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The daemon did not answer in time.
    #[error("{cmd:?} got no answer within {}s", within.as_secs())]
    NoAnswer {
        /// The command.
        cmd: String,
        /// How long it was given.
        within: Duration,
    },
    /// The control client said the command failed.
    #[error("{cmd:?} failed ({status}): {said}")]
    Failed {
        /// The command.
        cmd: String,
        /// The client's exit status.
        status: std::process::ExitStatus,
        /// What it said.
        said: String,
    },
    /// The daemon turned the command away (busy with another client) until the time ran out.
    #[error("{cmd:?} was turned away until {}s passed ({status}: {said})", within.as_secs())]
    TurnedAway {
        /// The command.
        cmd: String,
        /// How long it was tried.
        within: Duration,
        /// The last try's exit status.
        status: std::process::ExitStatus,
        /// What the last try said.
        said: String,
    },
    /// An answer that is not what the command answers.
    #[error("unexpected answer {answer:?} to {cmd:?}")]
    Unexpected {
        /// The command.
        cmd: String,
        /// The answer.
        answer: String,
    },
    /// The daemon does not hold a ceiling just set.
    #[error(
        "the daemon holds {held_percentage}% and {held_memory:?} (client priority {held_priority:?}) after being set to {percentage}% and {memory_mib} MiB (client priority {NORMAL_PRIORITY})"
    )]
    NotHeld {
        /// The percentage it holds.
        held_percentage: f64,
        /// The memory limit it prints.
        held_memory: String,
        /// The default client priority it prints.
        held_priority: String,
        /// The percentage set.
        percentage: u32,
        /// The memory set, MiB.
        memory_mib: u64,
    },
}

impl ControlError {
    /// Whether the daemon let the command wait (no answer in time, or turned away as busy
    /// until the time ran out), as against a client that failed or an answer not understood.
    pub fn unanswered(&self) -> bool {
        matches!(self, Self::NoAnswer { .. } | Self::TurnedAway { .. })
    }
}

/// The driver's MPS programs and what they need to run (as this process sees them).
#[derive(Debug, Clone)]
pub struct MpsBinaries {
    /// `nvidia-cuda-mps-control`.
    pub control: PathBuf,
    /// Directories searched for `nvidia-cuda-mps-server` (prepended to `PATH`).
    pub path_dirs: Vec<PathBuf>,
    /// Directories of the driver's libraries (prepended to `LD_LIBRARY_PATH`): the server
    /// loads libcuda.
    pub library_dirs: Vec<PathBuf>,
}

impl MpsBinaries {
    /// Finds the MPS programs among the driver's files (the same search the CDI generator
    /// makes), under `host_root`.
    pub fn from_driver(driver: &tessera_node::driver::Driver, host_root: &Path) -> Result<Self, ControlError> {
        use tessera_core::driver::DriverFileKind;
        let local = |f: &tessera_core::driver::DriverFile| {
            let h = driver.host_path(f);
            host_root.join(h.strip_prefix("/").unwrap_or(&h))
        };
        let find = |name: &str| {
            driver
                .files
                .iter()
                .find(|f| f.kind == DriverFileKind::Binary && f.name() == name)
                .map(local)
        };
        let missing = |program| ControlError::NotFound {
            program,
            root: driver.root.clone(),
        };
        let control = find("nvidia-cuda-mps-control").ok_or_else(|| missing("nvidia-cuda-mps-control"))?;
        let server = find("nvidia-cuda-mps-server").ok_or_else(|| missing("nvidia-cuda-mps-server"))?;
        let mut library_dirs: Vec<PathBuf> = driver
            .files
            .iter()
            .filter(|f| f.kind == DriverFileKind::Library)
            .filter_map(|f| local(f).parent().map(Path::to_path_buf))
            .collect();
        library_dirs.dedup();
        Ok(Self {
            control,
            path_dirs: server.parent().map(Path::to_path_buf).into_iter().collect(),
            library_dirs,
        })
    }

    /// The environment of a card's daemon and of every control command sent to it.
    pub fn env(&self, layout: &MpsLayout, uuid: &str) -> Vec<(String, OsString)> {
        let join = |dirs: &[PathBuf], var: &str| {
            let mut parts: Vec<PathBuf> = dirs.to_vec();
            if let Some(old) = std::env::var_os(var) {
                parts.extend(std::env::split_paths(&old));
            }
            std::env::join_paths(parts).unwrap_or_default()
        };
        vec![
            ("CUDA_VISIBLE_DEVICES".into(), uuid.into()),
            ("CUDA_MPS_PIPE_DIRECTORY".into(), layout.pipe_dir(uuid).into()),
            ("CUDA_MPS_LOG_DIRECTORY".into(), layout.log_dir(uuid).into()),
            ("PATH".into(), join(&self.path_dirs, "PATH")),
            ("LD_LIBRARY_PATH".into(), join(&self.library_dirs, "LD_LIBRARY_PATH")),
        ]
    }

    /// Sends one control command (`get_default_active_thread_percentage`, `quit`) to a card's
    /// daemon and returns its answer; an error when the daemon does not answer in `timeout`.
    /// The daemon serves one control connection at a time. A client meeting it busy (seen on
    /// the real 535 daemon while another client held its connection) is told "Cannot send
    /// command", or exits before it reads its command, or exits 0 or 1 having said nothing and
    /// done nothing. Such a turned-away command is sent again until `timeout` (a silent exit
    /// only for commands that always answer, see [`answers`]), so a client keeping the daemon
    /// busy does not make a health check or a ceiling fail. Commands that answer nothing are
    /// checked by reading back, as `apply_ceiling` does.
    pub async fn command(
        &self,
        layout: &MpsLayout,
        uuid: &str,
        cmd: &str,
        timeout: Duration,
    ) -> Result<String, ControlError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let reply = self.command_once(layout, uuid, cmd, left).await?;
            let said = reply.said();
            let turned_away = reply.unread || said.contains(BUSY) || (said.is_empty() && answers(cmd));
            if !turned_away {
                let why = if said.is_empty() { "nothing said" } else { said };
                return if reply.status.success() {
                    Ok(reply.stdout.trim().to_string())
                } else {
                    Err(ControlError::Failed {
                        cmd: cmd.to_string(),
                        status: reply.status,
                        said: why.to_string(),
                    })
                };
            }
            if tokio::time::Instant::now() + BUSY_RETRY >= deadline {
                let why = if said.is_empty() { "nothing said" } else { said };
                return Err(ControlError::TurnedAway {
                    cmd: cmd.to_string(),
                    within: timeout,
                    status: reply.status,
                    said: why.to_string(),
                });
            }
            tokio::time::sleep(BUSY_RETRY).await;
        }
    }

    /// Runs the control client once with `cmd` on its standard input.
    async fn command_once(
        &self,
        layout: &MpsLayout,
        uuid: &str,
        cmd: &str,
        timeout: Duration,
    ) -> Result<ClientReply, ControlError> {
        let mut child = Command::new(&self.control)
            .envs(self.env(layout, uuid))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| ControlError::Spawn {
                program: self.control.clone(),
                source,
            })?;
        let mut stdin = child.stdin.take().expect("piped");
        let unread = match stdin.write_all(format!("{cmd}\n").as_bytes()).await {
            // The client gave up before reading its command: turned away, whatever it printed.
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => true,
            Err(source) => {
                return Err(ControlError::Pipe {
                    what: "writing",
                    cmd: cmd.to_string(),
                    source,
                });
            }
            Ok(()) => false,
        };
        drop(stdin);
        let out = tokio::time::timeout(timeout, child.wait_with_output())
            .await
            .map_err(|_| ControlError::NoAnswer {
                cmd: cmd.to_string(),
                within: timeout,
            })?
            .map_err(|source| ControlError::Pipe {
                what: "waiting for",
                cmd: cmd.to_string(),
                source,
            })?;
        Ok(ClientReply {
            unread,
            status: out.status,
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        })
    }
}

/// What one run of the control client printed, and how it exited.
struct ClientReply {
    /// The client exited before it read the command.
    unread: bool,
    status: std::process::ExitStatus,
    stdout: String,
    stderr: String,
}

impl ClientReply {
    /// What the client said: its error output, else its answer, trimmed.
    fn said(&self) -> &str {
        let err = self.stderr.trim();
        if err.is_empty() { self.stdout.trim() } else { err }
    }
}

/// Whether the daemon always prints something for `cmd`, so that an empty answer means the
/// command was not carried out. Seen on the real 535 daemon: the default percentage, read or
/// set, and the default client priority read are always printed; `get_server_list` with no
/// servers, the default memory limit when none is set, its set, the priority's set and a
/// privileged `quit` print nothing.
pub fn answers(cmd: &str) -> bool {
    matches!(
        cmd.split_whitespace().next(),
        Some(
            "get_default_active_thread_percentage"
                | "set_default_active_thread_percentage"
                | "get_default_client_priority"
        )
    )
}

/// What the control client says when the daemon turned its connection away (busy with another).
const BUSY: &str = "Cannot send command";
/// How long a turned-away command waits before it is sent again.
const BUSY_RETRY: Duration = Duration::from_millis(20);

/// A memory limit as the control daemon prints it back: whole GiB, rounded down, from 1 GiB
/// on (`1536M` reads back `1G`), else MiB. Read-backs are compared at that resolution.
pub fn shown(mib: u64) -> String {
    if mib >= 1024 {
        format!("{}G", mib / 1024)
    } else {
        format!("{mib}M")
    }
}

/// The daemon's defaults for the servers and clients it starts, as it answers them.
#[derive(Debug, Clone, PartialEq)]
pub struct Defaults {
    /// The active thread percentage.
    pub percentage: f64,
    /// The memory limit as printed (empty when none is set).
    pub memory: String,
    /// The client priority as printed (`0` normal, `1` below normal).
    pub priority: String,
}

impl Defaults {
    /// Whether these are `ceiling`'s, memory at the resolution the daemon prints, with the
    /// normal client priority.
    pub fn hold(&self, ceiling: &MpsCeiling) -> bool {
        holds(ceiling, &self.percentage.to_string(), &self.memory) && self.priority.trim() == NORMAL_PRIORITY
    }
}

impl MpsBinaries {
    /// The daemon's defaults for the servers and clients it starts, as it answers them
    /// (device 0: the daemon sees only its card).
    pub async fn defaults(&self, layout: &MpsLayout, uuid: &str, timeout: Duration) -> Result<Defaults, ControlError> {
        let pct = self
            .command(layout, uuid, "get_default_active_thread_percentage", timeout)
            .await?;
        let percentage: f64 = pct.trim().parse().map_err(|_| ControlError::Unexpected {
            cmd: "get_default_active_thread_percentage".into(),
            answer: pct.clone(),
        })?;
        let memory = self
            .command(layout, uuid, "get_default_device_pinned_mem_limit 0", timeout)
            .await?;
        let priority = self
            .command(layout, uuid, "get_default_client_priority", timeout)
            .await?;
        Ok(Defaults {
            percentage,
            memory,
            priority,
        })
    }

    /// Sets the ceiling on the daemon (its defaults for new servers, and every running server)
    /// and reads the defaults back; an error when the daemon does not hold them after.
    pub async fn apply_ceiling(
        &self,
        layout: &MpsLayout,
        uuid: &str,
        ceiling: &MpsCeiling,
        timeout: Duration,
    ) -> Result<(), ControlError> {
        for cmd in default_commands(ceiling) {
            self.command(layout, uuid, &cmd, timeout).await?;
        }
        // Servers already running keep the limits they started with unless told.
        let servers = self.command(layout, uuid, "get_server_list", timeout).await?;
        for pid in server_pids(&servers) {
            for cmd in server_commands(ceiling, pid) {
                self.command(layout, uuid, &cmd, timeout).await?;
            }
        }
        let (pct, mib) = limits(ceiling);
        match self.defaults(layout, uuid, timeout).await? {
            d if d.hold(ceiling) => Ok(()),
            d => Err(ControlError::NotHeld {
                held_percentage: d.percentage,
                held_memory: d.memory,
                held_priority: d.priority,
                percentage: pct,
                memory_mib: mib,
            }),
        }
    }

    /// The limits of each server the daemon runs, as it answers them: `(pid, percentage,
    /// memory limit)` (device 0). A server gone between the list and the questions ("Server
    /// 4242 not found") is left out.
    pub async fn server_limits(
        &self,
        layout: &MpsLayout,
        uuid: &str,
        timeout: Duration,
    ) -> Result<Vec<(String, String, String)>, ControlError> {
        let servers = self.command(layout, uuid, "get_server_list", timeout).await?;
        let mut held = Vec::new();
        for pid in server_pids(&servers) {
            let pct = self
                .command(layout, uuid, &format!("get_active_thread_percentage {pid}"), timeout)
                .await?;
            let mem = self
                .command(layout, uuid, &format!("get_device_pinned_mem_limit {pid} 0"), timeout)
                .await?;
            if !gone(&pct) && !gone(&mem) {
                held.push((pid.to_string(), pct, mem));
            }
        }
        Ok(held)
    }
}

/// The pids in the daemon's answer to `get_server_list`.
fn server_pids(list: &str) -> impl Iterator<Item = &str> {
    list.split_whitespace()
        .filter(|p| p.bytes().all(|b| b.is_ascii_digit()))
}

/// Whether the daemon's answer about a server says it runs no longer.
fn gone(answer: &str) -> bool {
    answer.starts_with("Server ") && answer.contains("not found")
}

/// The ceiling's limits as the supervisor sets them: the percentage (1 to 100) and the memory
/// limit in MiB (at least 1: MPS reads 0 as no limit).
fn limits(ceiling: &MpsCeiling) -> (u32, u64) {
    (
        ceiling.active_thread_percentage.clamp(1, 100),
        ceiling.pinned_memory_mib.max(1),
    )
}

/// The default client priority the supervisor holds every card's daemon to: normal (`1` is
/// below normal). A client that sets `1` through the control socket puts the card's later
/// clients, other shares' among them, behind its own; the priority is put back with the
/// ceiling.
pub const NORMAL_PRIORITY: &str = "0";

/// The commands that set `ceiling` as the daemon's defaults, word for word as
/// [`MpsBinaries::apply_ceiling`] sends them: the percentage, the memory limit (index 1) and
/// the normal client priority.
pub fn default_commands(ceiling: &MpsCeiling) -> [String; 3] {
    let (pct, mib) = limits(ceiling);
    [
        format!("set_default_active_thread_percentage {pct}"),
        format!("set_default_device_pinned_mem_limit 0 {mib}M"),
        format!("set_default_client_priority {NORMAL_PRIORITY}"),
    ]
}

/// The commands that set `ceiling` on the running server `pid`, word for word as
/// [`MpsBinaries::apply_ceiling`] sends them.
pub fn server_commands(ceiling: &MpsCeiling, pid: &str) -> [String; 2] {
    let (pct, mib) = limits(ceiling);
    [
        format!("set_active_thread_percentage {pid} {pct}"),
        format!("set_device_pinned_mem_limit {pid} 0 {mib}M"),
    ]
}

/// Whether the daemon's answers for a percentage and a memory limit (of its defaults or of a
/// server) are `ceiling`, memory at the resolution the daemon prints ([`shown`]).
pub fn holds(ceiling: &MpsCeiling, pct: &str, mem: &str) -> bool {
    let (want_pct, mib) = limits(ceiling);
    pct.trim()
        .parse::<f64>()
        .is_ok_and(|p| (p - f64::from(want_pct)).abs() < 0.05)
        && mem.trim() == shown(mib)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_servers_limits_are_read_as_the_defaults_are() {
        let c = MpsCeiling {
            active_thread_percentage: 30,
            pinned_memory_mib: 8192,
        };
        // As the real 535 daemon prints a percentage and a memory limit (`%.1f`, `%lldG`).
        assert!(holds(&c, "30.0", "8G"));
        assert!(holds(&c, "30.0\n", "8G\n"));
        for (pct, mem) in [
            ("100.0", "8G"),
            ("1.0", "8G"),
            ("30.0", "7G"),
            ("30.0", "80G"),
            ("30.0", ""),
            ("", "8G"),
            ("Server 4242 not found", "8G"),
        ] {
            assert!(!holds(&c, pct, mem), "{pct} {mem}");
        }
        assert!(holds(&MpsCeiling::CLOSED, "1.0", "1M"));
        // `get_server_list`: one pid a line; the daemon's answer for a server that exited.
        assert_eq!(server_pids("4242\n4243\n").collect::<Vec<_>>(), ["4242", "4243"]);
        assert_eq!(server_pids("").count(), 0);
        assert!(gone("Server 4242 not found"));
        assert!(!gone("30.0"));
        // The commands the supervisor sends, which the log reader knows word for word.
        assert_eq!(
            default_commands(&c),
            [
                "set_default_active_thread_percentage 30",
                "set_default_device_pinned_mem_limit 0 8192M",
                "set_default_client_priority 0"
            ]
        );
        // The daemon's defaults, priority included.
        let d = |pct: f64, mem: &str, priority: &str| Defaults {
            percentage: pct,
            memory: mem.into(),
            priority: priority.into(),
        };
        assert!(d(30.0, "8G", "0").hold(&c));
        assert!(d(30.0, "8G\n", "0\n").hold(&c));
        for off in [
            d(30.0, "8G", "1"),
            d(30.0, "8G", ""),
            d(100.0, "8G", "0"),
            d(30.0, "9G", "0"),
        ] {
            assert!(!off.hold(&c), "{off:?}");
        }
        assert_eq!(
            server_commands(&c, "4242"),
            [
                "set_active_thread_percentage 4242 30",
                "set_device_pinned_mem_limit 4242 0 8192M"
            ]
        );
    }

    #[test]
    fn memory_as_the_daemon_prints_it() {
        // Read off the real 535 daemon: 1536M -> 1G, 1025M -> 1G, 8192M -> 8G, 1M -> 1M.
        assert_eq!(
            [shown(1536), shown(1025), shown(8192), shown(1)],
            ["1G", "1G", "8G", "1M"]
        );
    }
}
