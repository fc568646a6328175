//! How one card's MPS control daemon is started and spoken to: the driver's
//! `nvidia-cuda-mps-control`, its environment (the card, its pipe and log directories, where the
//! driver's libraries and the MPS server are), and one-line control commands.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tessera_core::enforcement::MpsLayout;
use tokio::io::AsyncWriteExt as _;
use tokio::process::Command;

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
    pub fn from_driver(driver: &tessera_core::driver::Driver, host_root: &Path) -> Result<Self, String> {
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
        let control = find("nvidia-cuda-mps-control").ok_or_else(|| {
            format!(
                "nvidia-cuda-mps-control not found under driver root {} (tessera-cdi-generator driver lists what was found)",
                driver.root.display()
            )
        })?;
        let server = find("nvidia-cuda-mps-server").ok_or_else(|| {
            format!(
                "nvidia-cuda-mps-server not found under driver root {}",
                driver.root.display()
            )
        })?;
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
    pub async fn command(
        &self,
        layout: &MpsLayout,
        uuid: &str,
        cmd: &str,
        timeout: Duration,
    ) -> Result<String, String> {
        let mut child = Command::new(&self.control)
            .envs(self.env(layout, uuid))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("running {}: {e}", self.control.display()))?;
        let mut stdin = child.stdin.take().expect("piped");
        stdin
            .write_all(format!("{cmd}\n").as_bytes())
            .await
            .map_err(|e| format!("writing {cmd:?} to the control client: {e}"))?;
        drop(stdin);
        let out = tokio::time::timeout(timeout, child.wait_with_output())
            .await
            .map_err(|_| format!("{cmd:?} got no answer within {}s", timeout.as_secs()))?
            .map_err(|e| format!("waiting for the control client: {e}"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
        } else {
            let err = String::from_utf8_lossy(&out.stderr);
            let err = if err.trim().is_empty() {
                String::from_utf8_lossy(&out.stdout).into_owned()
            } else {
                err.into_owned()
            };
            Err(format!("{cmd:?} failed ({}): {}", out.status, err.trim()))
        }
    }
}
