//! Each hooked container's own socket, through which a process learns its host pid: NVML names
//! GPU processes by host pid, and a process in the container's pid namespace cannot see its
//! own. The kernel gives the peer's pid of a Unix socket connection as the listener's
//! namespace sees it, so the plugin (in the host's pid namespace) needs no lookup and the
//! process nothing but to connect: the answer is the connecting process's host pid, one line.
//! One socket per container, in that container's agent directory alone, so nothing is shared
//! between containers (a card-wide lock used to be, which one tenant could hold against the
//! others).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use tessera_core::enforcement::HOOK_PID_SOCKET;
use tokio::io::AsyncWriteExt as _;
use tokio::net::UnixListener;
use tokio::task::JoinHandle;
use tracing::{debug, warn};

/// The host-pid sockets being served, by container id.
#[derive(Default)]
pub struct PidServices {
    served: Mutex<HashMap<String, Served>>,
}

/// One container's socket and the task answering on it.
struct Served {
    path: PathBuf,
    task: JoinHandle<()>,
}

impl Served {
    fn end(self) {
        self.task.abort();
        let _ = std::fs::remove_file(&self.path);
    }
}

impl PidServices {
    /// Serves `dir`'s socket for container `id` (replacing an earlier one for it). Needs a
    /// tokio runtime.
    pub fn serve(&self, id: &str, dir: &Path) -> std::io::Result<()> {
        use std::os::unix::fs::PermissionsExt as _;
        let path = dir.join(HOOK_PID_SOCKET);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        // Bound through the directory's descriptor: a socket's path may not exceed 107 bytes,
        // and a container id alone is 64.
        let dirfd = std::fs::File::open(dir)?;
        let listener = UnixListener::bind(format!(
            "/proc/self/fd/{}/{HOOK_PID_SOCKET}",
            std::os::fd::AsRawFd::as_raw_fd(&dirfd)
        ))?;
        // The container's processes run under any uid.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666))?;
        let task = tokio::spawn(answer(id.to_string(), listener));
        if let Some(old) = self.lock().insert(id.to_string(), Served { path, task }) {
            old.task.abort();
        }
        Ok(())
    }

    /// Stops serving container `id`.
    pub fn stop(&self, id: &str) {
        if let Some(s) = self.lock().remove(id) {
            s.end();
        }
    }

    /// Stops serving every container not in `live`.
    pub fn retain(&self, live: &HashSet<String>) {
        let gone: Vec<String> = self.lock().keys().filter(|id| !live.contains(*id)).cloned().collect();
        for id in gone {
            self.stop(&id);
        }
    }

    /// Whether container `id` is served.
    pub fn serves(&self, id: &str) -> bool {
        self.lock().contains_key(id)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Served>> {
        self.served.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for PidServices {
    fn drop(&mut self) {
        for (_, s) in self.lock().drain() {
            s.end();
        }
    }
}

async fn answer(id: String, listener: UnixListener) {
    loop {
        let mut conn = match listener.accept().await {
            Ok((conn, _)) => conn,
            Err(e) => {
                warn!(container = id, error = %e, "host-pid socket: accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let Some(pid) = conn.peer_cred().ok().and_then(|c| c.pid()) else {
            continue;
        };
        debug!(container = id, pid, "host pid asked");
        // A peer that does not read only loses its own answer.
        let _ = tokio::time::timeout(
            std::time::Duration::from_secs(1),
            conn.write_all(format!("{pid}\n").as_bytes()),
        )
        .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Connects as a container's process would, to a path too long to name directly.
    fn ask(path: &Path) -> std::io::Result<String> {
        use std::io::Read as _;
        let dir = std::fs::File::open(path.parent().unwrap())?;
        let short = format!(
            "/proc/self/fd/{}/{HOOK_PID_SOCKET}",
            std::os::fd::AsRawFd::as_raw_fd(&dir)
        );
        let mut s = String::new();
        std::os::unix::net::UnixStream::connect(short)?.read_to_string(&mut s)?;
        Ok(s)
    }

    #[tokio::test]
    async fn a_process_is_told_its_own_pid_until_its_container_goes() {
        let top = tempfile::tempdir().unwrap();
        // As deep as a container's directory under /run/tessera/hook: past a socket path's
        // 107 bytes.
        let d = top.path().join("containers").join("7".repeat(64)).join("agent");
        std::fs::create_dir_all(&d).unwrap();
        let d = tempfile::TempDir::new_in(&d).unwrap();
        let services = PidServices::default();
        services.serve("c1", d.path()).unwrap();
        let sock = d.path().join(HOOK_PID_SOCKET);
        let answer = tokio::task::spawn_blocking({
            let sock = sock.clone();
            move || ask(&sock)
        })
        .await
        .unwrap()
        .unwrap();
        assert_eq!(answer, format!("{}\n", std::process::id()));
        // Served again (a plugin restart): the stale socket is replaced.
        services.serve("c1", d.path()).unwrap();
        assert!(services.serves("c1"));
        services.retain(&HashSet::new());
        assert!(!services.serves("c1"));
        let gone = tokio::task::spawn_blocking(move || ask(&sock)).await.unwrap();
        assert!(gone.is_err(), "{gone:?}");
    }
}
