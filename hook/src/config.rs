//! The container's limits, from the file the NRI plugin writes (`key=value` lines, mounted
//! read-only at [`DEFAULT_CONFIG`]). No file means pass-through (a container without a share);
//! a file that cannot be read or parsed means no GPU memory ([`Config::closed`]).

use std::path::{Path, PathBuf};

/// Where the NRI plugin mounts the container's hook configuration.
pub const DEFAULT_CONFIG: &str = "/run/tessera/hook/config";
/// Where the shared accounting lives when the configuration does not say.
pub const DEFAULT_STATE_DIR: &str = "/run/tessera/hook/state";
/// Overrides [`DEFAULT_CONFIG`], but only where that file does not exist (so a container's
/// user cannot point its processes at limits of their own).
pub const CONFIG_ENV: &str = "TESSERA_HOOK_CONFIG";

/// What the hook enforces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// The card (`GPU-<uuid>`).
    pub uuid: String,
    /// Memory the container's processes may hold together, bytes.
    pub memory_limit: Option<u64>,
    /// Compute ceiling in percent (`None` or 100: launches are not throttled).
    pub core_limit: Option<u32>,
    /// The shared accounting directory (writable by every process of the container).
    pub state_dir: PathBuf,
    /// The container's own host-pid socket (the node agent answers each process its host pid).
    pub pid_socket: Option<PathBuf>,
}

impl Config {
    /// What a container whose configuration exists but cannot be read is held to: no memory.
    pub fn closed() -> Self {
        Self {
            uuid: String::new(),
            memory_limit: Some(0),
            core_limit: None,
            state_dir: PathBuf::from(DEFAULT_STATE_DIR),
            pid_socket: None,
        }
    }

    /// Parses the file's text; the error names the key and value.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut uuid = None;
        let mut memory_limit = None;
        let mut core_limit = None;
        let mut state_dir = None;
        let mut pid_socket = None;
        for line in text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
        {
            let (k, v) = line
                .split_once('=')
                .ok_or_else(|| format!("line {line:?} is not key=value"))?;
            let (k, v) = (k.trim(), v.trim());
            match k {
                "uuid" => uuid = Some(v.to_string()),
                "memory_limit_mib" => {
                    let mib: u64 = v
                        .parse()
                        .ok()
                        .filter(|m| *m > 0)
                        .ok_or_else(|| format!("memory_limit_mib={v:?} is not a positive number"))?;
                    memory_limit = Some(mib.saturating_mul(1 << 20));
                }
                "core_limit" => {
                    core_limit = Some(
                        v.parse()
                            .ok()
                            .filter(|c| (1..=100).contains(c))
                            .ok_or_else(|| format!("core_limit={v:?} is not a percent in 1..=100"))?,
                    )
                }
                "state_dir" => state_dir = Some(PathBuf::from(v)),
                "pid_socket" => pid_socket = Some(PathBuf::from(v)),
                // Informational keys (pod, container) and keys of newer plugins.
                _ => {}
            }
        }
        let uuid = uuid.ok_or("no uuid")?;
        if !uuid.starts_with("GPU-") {
            return Err(format!("uuid={uuid:?} is not a GPU-<uuid>"));
        }
        Ok(Self {
            uuid,
            memory_limit,
            core_limit,
            state_dir: state_dir.unwrap_or_else(|| DEFAULT_STATE_DIR.into()),
            pid_socket,
        })
    }

    /// The configuration in force for this process: [`DEFAULT_CONFIG`] when it exists, else
    /// the file named by [`CONFIG_ENV`]; `Ok(None)` when there is none (pass-through).
    pub fn load() -> Result<Option<Self>, String> {
        let path = if Path::new(DEFAULT_CONFIG).exists() {
            PathBuf::from(DEFAULT_CONFIG)
        } else {
            match std::env::var_os(CONFIG_ENV) {
                Some(p) => PathBuf::from(p),
                None => return Ok(None),
            }
        };
        let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        Self::parse(&text)
            .map(Some)
            .map_err(|e| format!("{}: {e}", path.display()))
    }

    /// The compute ceiling when launches must be throttled.
    pub fn throttle(&self) -> Option<u32> {
        self.core_limit.filter(|c| *c < 100)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_names_bad_values() {
        let c = Config::parse(
            "# written by tessera-nri-plugin\nuuid=GPU-1\nmemory_limit_mib=8192\ncore_limit=30\npod=ns/p\n",
        )
        .unwrap();
        assert_eq!(c.memory_limit, Some(8 << 30));
        assert_eq!(c.throttle(), Some(30));
        assert_eq!(c.state_dir, Path::new(DEFAULT_STATE_DIR));
        assert_eq!(c.pid_socket, None);
        assert_eq!(
            Config::parse("uuid=GPU-1\npid_socket=/run/tessera/hook/agent/pid.sock")
                .unwrap()
                .pid_socket
                .as_deref(),
            Some(Path::new("/run/tessera/hook/agent/pid.sock"))
        );
        assert_eq!(
            Config::parse("uuid=GPU-1\ncore_limit=0").unwrap_err(),
            "core_limit=\"0\" is not a percent in 1..=100"
        );
        assert!(
            Config::parse("uuid=GPU-1\nmemory_limit_mib=lots")
                .unwrap_err()
                .contains("lots")
        );
        assert_eq!(Config::parse("core_limit=30").unwrap_err(), "no uuid");
        assert!(Config::parse("garbage").unwrap_err().contains("not key=value"));
        assert_eq!(Config::parse("uuid=GPU-1\ncore_limit=100").unwrap().throttle(), None);
    }
}
