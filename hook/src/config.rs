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
    /// How the compute ceiling is held.
    pub compute: Compute,
    /// The container's window of the card's time (`compute=windows`).
    pub window: Option<Schedule>,
}

/// A window of the card's time: spans of a repeating period, clocked from `CLOCK_MONOTONIC`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    /// The period, nanoseconds.
    pub period_ns: u64,
    /// `[start, end)` within the period, nanoseconds, sorted and disjoint.
    pub spans: Vec<(u64, u64)>,
}

impl Schedule {
    /// `window` (`START-END[,START-END]...`, hundredths of the period) of a `period_ms` period.
    pub fn parse(window: &str, period_ms: u64) -> Result<Self, String> {
        let period_ns = period_ms * 1_000_000;
        let mut spans: Vec<(u64, u64)> = Vec::new();
        for part in window.split(',').map(str::trim) {
            let bad = || format!("window span {part:?} is not START-END with 0 <= START < END <= 100");
            let (a, b) = part.split_once('-').ok_or_else(bad)?;
            let (a, b): (u64, u64) = (
                a.trim().parse().map_err(|_| bad())?,
                b.trim().parse().map_err(|_| bad())?,
            );
            if a >= b || b > 100 || spans.last().is_some_and(|&(_, end)| a * period_ns / 100 < end) {
                return Err(bad());
            }
            spans.push((a * period_ns / 100, b * period_ns / 100));
        }
        Ok(Self { period_ns, spans })
    }

    /// At `now_ns`: `Ok(end)` when it is in a span (which ends at `end`), else `Err(start)`,
    /// when the next span starts.
    pub fn at(&self, now_ns: u64) -> Result<u64, u64> {
        let base = now_ns - now_ns % self.period_ns;
        let offset = now_ns - base;
        for &(a, b) in &self.spans {
            if offset < a {
                return Err(base + a);
            }
            if offset < b {
                return Ok(base + b);
            }
        }
        Err(base + self.period_ns + self.spans.first().map_or(0, |s| s.0))
    }

    /// The longest span, nanoseconds.
    pub fn longest(&self) -> u64 {
        self.spans.iter().map(|(a, b)| b - a).max().unwrap_or(0)
    }
}

/// How a share's compute ceiling is held for the container's processes together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compute {
    /// Launches are throttled to the ceiling by the container's measured utilization (`hook`
    /// nodes).
    #[default]
    Throttle,
    /// MPS holds each process to the ceiling's SMs; the processes take turns on the card
    /// (`mps` nodes, where NVML cannot measure MPS clients).
    Turns,
    /// The container's processes launch only in its window of the card's time, given by the
    /// node agent beside its co-tenants' windows (`hook` nodes).
    Windows,
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
            compute: Compute::Throttle,
            window: None,
        }
    }

    /// Parses the file's text; the error names the key and value.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut uuid = None;
        let mut memory_limit = None;
        let mut core_limit = None;
        let mut state_dir = None;
        let mut pid_socket = None;
        let mut compute = Compute::Throttle;
        let (mut window, mut period_ms) = (None, None);
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
                "compute" => {
                    compute = match v {
                        "throttle" => Compute::Throttle,
                        "turns" => Compute::Turns,
                        "windows" => Compute::Windows,
                        _ => {
                            return Err(format!(
                                "compute={v:?} is none of \"throttle\", \"turns\" and \"windows\""
                            ));
                        }
                    }
                }
                "window" => window = Some(v.to_string()),
                "period_ms" => {
                    period_ms = Some(
                        v.parse()
                            .ok()
                            .filter(|p| (1..=10_000).contains(p))
                            .ok_or_else(|| format!("period_ms={v:?} is not a number of milliseconds in 1..=10000"))?,
                    )
                }
                // Informational keys (pod, container) and keys of newer plugins.
                _ => {}
            }
        }
        let window = match (compute, window) {
            (Compute::Windows, Some(w)) => Some(Schedule::parse(
                &w,
                period_ms.ok_or("compute=windows without period_ms")?,
            )?),
            (Compute::Windows, None) => return Err("compute=windows without a window".into()),
            _ => None,
        };
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
            compute,
            window,
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
        self.core_limit
            .filter(|c| *c < 100)
            .filter(|_| self.compute == Compute::Throttle)
    }

    /// Whether the container's processes take turns on the card.
    pub fn turns(&self) -> bool {
        self.compute == Compute::Turns && self.core_limit.is_some_and(|c| c < 100)
    }

    /// The container's window of the card's time, when its processes launch only in it.
    pub fn windows(&self) -> Option<&Schedule> {
        self.window.as_ref().filter(|_| self.compute == Compute::Windows)
    }

    /// Whether a gate (turns or windows) drains the process's queued work: its contexts are
    /// then noted as they are made.
    pub fn drains(&self) -> bool {
        self.turns() || self.windows().is_some()
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
        let mps = Config::parse("uuid=GPU-1\ncore_limit=30\ncompute=turns").unwrap();
        assert_eq!((mps.throttle(), mps.turns()), (None, true));
        assert!(!Config::parse("uuid=GPU-1\ncompute=turns").unwrap().turns());
        assert_eq!(
            Config::parse("uuid=GPU-1\ncompute=mps").unwrap_err(),
            "compute=\"mps\" is none of \"throttle\", \"turns\" and \"windows\""
        );
        let w = Config::parse("uuid=GPU-1\ncore_limit=30\ncompute=windows\nwindow=0-20,60-70\nperiod_ms=50").unwrap();
        let s = w.windows().unwrap();
        assert_eq!(s.spans, [(0, 10_000_000), (30_000_000, 35_000_000)]);
        assert_eq!((w.throttle(), w.turns(), w.drains()), (None, false, true));
        for (bad, says) in [
            ("compute=windows\nperiod_ms=50", "without a window"),
            ("compute=windows\nwindow=0-20", "without period_ms"),
            ("compute=windows\nwindow=20-10\nperiod_ms=50", "\"20-10\""),
            ("compute=windows\nwindow=0-20,10-30\nperiod_ms=50", "\"10-30\""),
            ("compute=windows\nwindow=0-20\nperiod_ms=0", "period_ms=\"0\""),
        ] {
            let e = Config::parse(&format!("uuid=GPU-1\n{bad}")).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn a_schedule_says_when_its_spans_are() {
        let s = Schedule::parse("10-30,60-70", 100).unwrap();
        let ms = 1_000_000;
        assert_eq!(s.at(0), Err(10 * ms));
        assert_eq!(s.at(10 * ms), Ok(30 * ms));
        assert_eq!(s.at(29 * ms), Ok(30 * ms));
        assert_eq!(s.at(30 * ms), Err(60 * ms));
        assert_eq!(s.at(65 * ms), Ok(70 * ms));
        assert_eq!(s.at(75 * ms), Err(110 * ms));
        assert_eq!(s.at(1_015 * ms), Ok(1_030 * ms));
        assert_eq!(s.longest(), 20 * ms);
    }
}
