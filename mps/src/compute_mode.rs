//! Exclusive-process compute mode for the cards MPS serves (`--exclusive-process`, off by
//! default). Set with the driver's own `nvidia-smi -i <uuid> -c EXCLUSIVE_PROCESS` (as NVIDIA's
//! MPS documentation and its device plugin do) before a card's daemon starts: the card then
//! takes one process's context, the MPS server's, so a CUDA process that goes around MPS (its
//! `CUDA_MPS_PIPE_DIRECTORY` pointed elsewhere) is refused instead of getting the whole card.
//! Set back to `DEFAULT` when the card stops hosting shares. A marker in the card's directory
//! records that Tessera set it, so a card left exclusive by a supervisor that died is set back
//! when the next one starts; the mode is the driver's, lost at reboot (as is the marker, on
//! `/run`).

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use tessera_core::enforcement::MpsLayout;

/// A compute mode, as `nvidia-smi --compute-mode` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Any number of contexts (the driver's default).
    Default,
    /// One process's contexts.
    ExclusiveProcess,
}

impl Mode {
    /// The `-c` argument.
    pub fn as_arg(self) -> &'static str {
        match self {
            Mode::Default => "DEFAULT",
            Mode::ExclusiveProcess => "EXCLUSIVE_PROCESS",
        }
    }
}

/// Why a card's compute mode could not be set, naming the command or the marker file.
#[derive(Debug, thiserror::Error)]
pub enum ComputeModeError {
    /// `nvidia-smi` did not answer in time.
    #[error("{command}: no answer in {timeout:?}")]
    Timeout {
        /// The command line.
        command: String,
        /// How long it was given.
        timeout: Duration,
    },
    /// `nvidia-smi` could not be run.
    #[error("{command}: {source}")]
    Run {
        /// The command line.
        command: String,
        /// Why it could not be run.
        #[source]
        source: std::io::Error,
    },
    /// `nvidia-smi` refused (its exit status and what it said).
    #[error("{command}: {status} ({said})")]
    Refused {
        /// The command line.
        command: String,
        /// Its exit status.
        status: std::process::ExitStatus,
        /// Its standard output and error.
        said: String,
    },
    /// `nvidia-smi` answered a compute mode query with something that is none.
    #[error("{command}: no compute mode in its answer {said:?}")]
    Unreadable {
        /// The command line.
        command: String,
        /// What it said.
        said: String,
    },
    /// The marker that Tessera set the card exclusive could not be written.
    #[error("marking {uuid}: {source}")]
    Mark {
        /// The card.
        uuid: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The marker could not be removed after the card was set back.
    #[error("removing {}: {source}", path.display())]
    Unmark {
        /// The marker file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Sets cards' compute modes with `nvidia-smi`.
#[derive(Debug, Clone)]
pub struct ComputeModes {
    /// The driver's `nvidia-smi`.
    pub nvidia_smi: PathBuf,
    /// The driver's library directories (`nvidia-smi` loads libnvidia-ml).
    pub library_dirs: Vec<PathBuf>,
    /// How long one call may take.
    pub timeout: Duration,
}

/// The marker file: Tessera put this card in exclusive-process mode.
pub fn marker(layout: &MpsLayout, uuid: &str) -> PathBuf {
    layout.card_dir(uuid).join("exclusive-process")
}

impl ComputeModes {
    /// Sets `uuid`'s compute mode; the error names the command and what it said.
    pub async fn set(&self, uuid: &str, mode: Mode) -> Result<(), ComputeModeError> {
        self.smi(&["-i", uuid, "-c", mode.as_arg()]).await.map(drop)
    }

    /// Whether `uuid` is in exclusive-process mode now, as `nvidia-smi` reads it.
    pub async fn is_exclusive(&self, uuid: &str) -> Result<bool, ComputeModeError> {
        let args = ["-i", uuid, "--query-gpu=compute_mode", "--format=csv,noheader"];
        let said = self.smi(&args).await?;
        match said.trim() {
            "Exclusive_Process" => Ok(true),
            "Default" | "Prohibited" | "Exclusive_Thread" => Ok(false),
            _ => Err(ComputeModeError::Unreadable {
                command: self.shown(&args),
                said: said.trim().to_string(),
            }),
        }
    }

    fn shown(&self, args: &[&str]) -> String {
        format!("{} {}", self.nvidia_smi.display(), args.join(" "))
    }

    /// Runs `nvidia-smi args...` with the driver's libraries; its standard output.
    async fn smi(&self, args: &[&str]) -> Result<String, ComputeModeError> {
        let mut library_path: Vec<PathBuf> = self.library_dirs.clone();
        if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
            library_path.extend(std::env::split_paths(&old));
        }
        let mut cmd = tokio::process::Command::new(&self.nvidia_smi);
        cmd.args(args)
            .env(
                "LD_LIBRARY_PATH",
                std::env::join_paths(library_path).unwrap_or_else(|_| OsString::new()),
            )
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true);
        let command = self.shown(args);
        let out = match tokio::time::timeout(self.timeout, cmd.output()).await {
            Err(_) => {
                return Err(ComputeModeError::Timeout {
                    command,
                    timeout: self.timeout,
                });
            }
            Ok(Err(source)) => return Err(ComputeModeError::Run { command, source }),
            Ok(Ok(out)) => out,
        };
        if out.status.success() {
            return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
        }
        let said =
            String::from_utf8_lossy(&out.stdout).trim().to_string() + String::from_utf8_lossy(&out.stderr).trim();
        Err(ComputeModeError::Refused {
            command,
            status: out.status,
            said,
        })
    }

    /// Puts `uuid` in exclusive-process mode and marks it so.
    pub async fn make_exclusive(&self, layout: &MpsLayout, uuid: &str) -> Result<(), ComputeModeError> {
        // Marked first: a supervisor dying between the two leaves a marker for a card that
        // may be exclusive, which the next one sets back to default (harmless when it was not).
        std::fs::write(marker(layout, uuid), b"").map_err(|source| ComputeModeError::Mark {
            uuid: uuid.to_string(),
            source,
        })?;
        self.set(uuid, Mode::ExclusiveProcess).await
    }

    /// Sets `uuid` back to default mode when Tessera set it exclusive (its marker is there).
    pub async fn release(&self, layout: &MpsLayout, uuid: &str) -> Result<(), ComputeModeError> {
        let m = marker(layout, uuid);
        if !m.exists() {
            return Ok(());
        }
        self.set(uuid, Mode::Default).await?;
        std::fs::remove_file(&m).map_err(|source| ComputeModeError::Unmark { path: m, source })
    }
}
