//! `tessera-nri-plugin check`: tells a user on a node what is missing for Tessera to work —
//! the runtime's NRI socket, NRI and CDI in the runtime's configuration, Tessera's CDI spec, the
//! NVIDIA driver, the hand-off keys.

use std::fmt;
use std::path::{Path, PathBuf};

use tessera_core::enforcement::{HookLayout, MpsLayout, ShareEnforcement};
use tessera_core::handoff::VerifyingKeys;
use tessera_core::names::CDI_KIND;

use crate::cdi::CdiResolver;

/// How bad a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Fine.
    Ok,
    /// Works, but worth a look.
    Warn,
    /// Tessera cannot work until this is fixed.
    Fail,
}

/// One thing checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// Verdict.
    pub level: Level,
    /// What was checked.
    pub what: &'static str,
    /// What was found and, when not OK, what to do.
    pub detail: String,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tag = match self.level {
            Level::Ok => "ok  ",
            Level::Warn => "WARN",
            Level::Fail => "FAIL",
        };
        write!(f, "[{tag}] {:<16} {}", self.what, self.detail)
    }
}

/// What to check.
#[derive(Debug, Clone)]
pub struct CheckOptions {
    /// The runtime's NRI socket.
    pub socket: PathBuf,
    /// containerd's config file (checked when it exists).
    pub containerd_config: PathBuf,
    /// CRI-O's config file and drop-in directory (checked when they exist).
    pub crio_config: PathBuf,
    /// CDI spec directories.
    pub cdi_dirs: Vec<PathBuf>,
    /// Hand-off keys.
    pub keys_dir: PathBuf,
    /// Where this process sees the host's `/`.
    pub host_root: PathBuf,
    /// The driver root as a host path; `None` detects it as the CDI generator does.
    pub driver_root: Option<PathBuf>,
    /// Host directory holding `/dev`.
    pub dev_root: PathBuf,
    /// How the node holds shares to their limits.
    pub enforcement: ShareEnforcement,
    /// Where the MPS daemons keep their state.
    pub mps: MpsLayout,
    /// Where the CUDA hook is installed.
    pub hook: HookLayout,
    /// Where the host's cgroup v2 hierarchy is.
    pub cgroup_root: PathBuf,
    /// The libnvidia-ml to ask about per-cgroup memory limits (default: the driver's).
    pub nvml_library: Option<PathBuf>,
}

fn finding(level: Level, what: &'static str, detail: impl Into<String>) -> Finding {
    Finding {
        level,
        what,
        detail: detail.into(),
    }
}

/// Runs every check.
pub fn run(opts: &CheckOptions) -> Vec<Finding> {
    let mut out = vec![check_socket(&opts.socket)];
    out.extend(check_runtime_config(opts));
    out.push(check_cdi(&opts.cdi_dirs, &opts.host_root));
    out.push(check_driver(opts));
    out.push(check_enforcement(opts));
    out.push(check_share_memory(opts));
    out.push(check_keys(&opts.keys_dir));
    out
}

/// The node's share enforcement: with MPS, every card that hosts shares in Tessera's spec
/// must have a ready daemon.
fn check_enforcement(opts: &CheckOptions) -> Finding {
    let what = "share limits";
    match opts.enforcement {
        ShareEnforcement::None | ShareEnforcement::Unknown => finding(
            Level::Warn,
            what,
            "share enforcement none: shares run unenforced (their compute and memory limits are labels)",
        ),
        ShareEnforcement::Hook => match opts.hook.ready() {
            Ok(()) => finding(
                Level::Ok,
                what,
                format!("hook: the CUDA hook is installed at {}", opts.hook.library().display()),
            ),
            Err(e) => finding(Level::Fail, what, format!("hook: {e}; shares are refused until it is")),
        },
        ShareEnforcement::Mps => {
            let cards = share_cards(&opts.cdi_dirs);
            if cards.is_empty() {
                return finding(
                    Level::Warn,
                    what,
                    "mps: no share device in the CDI spec, so no daemon is needed yet",
                );
            }
            if let Err(e) = opts.hook.ready() {
                return finding(
                    Level::Fail,
                    what,
                    format!(
                        "mps: {e} (it holds a share's processes to its memory together); shares are refused until it is"
                    ),
                );
            }
            let now = std::time::SystemTime::now();
            let down: Vec<String> = cards.iter().filter_map(|u| opts.mps.ready(u, now).err()).collect();
            if down.is_empty() {
                let ready = format!(
                    "mps: {} card daemon(s) ready under {}",
                    cards.len(),
                    opts.mps.root.display()
                );
                match open_to_bypass(&opts.mps, &cards) {
                    None => finding(Level::Ok, what, format!("{ready}, each card in exclusive-process mode")),
                    Some(open) => finding(Level::Warn, what, format!("{ready}; {open}")),
                }
            } else {
                finding(
                    Level::Fail,
                    what,
                    format!(
                        "mps: {} of {} card daemon(s) not ready, so shares there are refused: {} \
                         (is tessera-mps-supervisor running? `tessera-mps-supervisor status`)",
                        down.len(),
                        cards.len(),
                        down.join("; ")
                    ),
                )
            }
        }
    }
}

/// How the share cards' memory is held: per cgroup by the driver (r615+), else by the CUDA
/// hook per container (and MPS per process), with what that leaves open.
fn check_share_memory(opts: &CheckOptions) -> Finding {
    use tessera_node::memory_limits::{Support, probe};
    let what = "share memory";
    let cards = share_cards(&opts.cdi_dirs);
    if opts.enforcement == ShareEnforcement::None || cards.is_empty() {
        return finding(Level::Ok, what, "no share device in the CDI spec, or shares unenforced");
    }
    let library = opts.nvml_library.clone().or_else(|| {
        tessera_node::inventory::NvmlSource {
            host_root: opts.host_root.clone(),
            driver_root: opts.driver_root.clone(),
            ..Default::default()
        }
        .library_path()
        .ok()
    });
    let (support, _) = probe(library.as_deref(), &opts.cgroup_root);
    let held = match (&support, opts.enforcement) {
        (Support::PerCgroup { .. }, _) => {
            "each share container's processes allocate from one budget the driver holds on its cgroup \
             (set at its start; tessera-nri-plugin run --cgroup-memory-limits auto or on)"
        }
        (_, ShareEnforcement::Mps) => {
            "held per container by the CUDA hook and per process by MPS: a process that goes around \
             the hook (dlmopen, a static binary) is held by MPS alone (docs/threat-model.md)"
        }
        _ => {
            "held per container by the CUDA hook alone: a process that goes around it (dlmopen, a \
             static binary) is not held (docs/threat-model.md)"
        }
    };
    finding(
        Level::Ok,
        what,
        format!("card(s) {}: {support}; {held}", cards.join(", ")),
    )
}

/// What the supervisor read of the share cards' compute modes, when any card is not known to
/// be in exclusive-process mode: in another mode a CUDA process that points
/// `CUDA_MPS_PIPE_DIRECTORY` elsewhere goes around MPS and gets the whole card.
fn open_to_bypass(mps: &MpsLayout, cards: &[String]) -> Option<String> {
    let (mut open, mut unknown) = (Vec::new(), Vec::new());
    for uuid in cards {
        match mps.read_state(uuid).ok().and_then(|s| s.exclusive_process) {
            Some(true) => {}
            Some(false) => open.push(uuid.as_str()),
            None => unknown.push(uuid.as_str()),
        }
    }
    let mut said = Vec::new();
    if !open.is_empty() {
        said.push(format!(
            "{} not in exclusive-process mode ({}): a process that goes around MPS gets the whole card",
            open.len(),
            open.join(", ")
        ));
    }
    if !unknown.is_empty() {
        said.push(format!(
            "{} whose compute mode could not be read ({}; no nvidia-smi?)",
            unknown.len(),
            unknown.join(", ")
        ));
    }
    (!said.is_empty()).then(|| {
        format!(
            "card(s) {} (tessera-mps-supervisor --exclusive-process closes this; docs/threat-model.md)",
            said.join("; ")
        )
    })
}

/// The cards Tessera's spec offers shares of (the `tessera.io/share` annotation of share devices).
fn share_cards(dirs: &[PathBuf]) -> Vec<String> {
    let mut out: Vec<String> = dirs
        .iter()
        .filter_map(|d| std::fs::read_to_string(d.join("tessera.io-gpu.json")).ok())
        .filter_map(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .flat_map(|v| {
            v["devices"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .filter_map(|d| d["annotations"]["tessera.io/share"].as_str().map(str::to_string))
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

fn check_socket(socket: &Path) -> Finding {
    use std::os::unix::fs::FileTypeExt as _;
    let what = "NRI socket";
    match std::fs::metadata(socket) {
        Err(_) => finding(
            Level::Fail,
            what,
            format!(
                "{} is absent: the runtime has NRI disabled or is not running (see deploy/runtime/)",
                socket.display()
            ),
        ),
        Ok(m) if !m.file_type().is_socket() => {
            finding(Level::Fail, what, format!("{} is not a socket", socket.display()))
        }
        Ok(_) => match std::os::unix::net::UnixStream::connect(socket) {
            Ok(_) => finding(Level::Ok, what, format!("{} accepts connections", socket.display())),
            Err(e) => finding(
                Level::Fail,
                what,
                format!(
                    "{} exists but refuses connections ({e}): is the runtime running?",
                    socket.display()
                ),
            ),
        },
    }
}

/// A TOML value at a dotted path of table keys.
fn lookup<'a>(v: &'a toml::Value, path: &[&str]) -> Option<&'a toml::Value> {
    path.iter().try_fold(v, |v, k| v.get(*k))
}

/// Checks a containerd config file's NRI and CDI settings.
pub fn check_containerd_config(path: &Path) -> Vec<Finding> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) => {
            return vec![finding(
                Level::Fail,
                "containerd config",
                format!("{}: {e}", path.display()),
            )];
        }
    };
    let cfg: toml::Value = match toml::from_str(&text) {
        Ok(v) => v,
        Err(e) => {
            return vec![finding(
                Level::Fail,
                "containerd config",
                format!("{} is not valid TOML: {e}", path.display()),
            )];
        }
    };
    let version = cfg.get("version").and_then(toml::Value::as_integer).unwrap_or(1);
    let mut out = Vec::new();
    let nri_disabled = lookup(&cfg, &["plugins", "io.containerd.nri.v1.nri", "disable"]).and_then(toml::Value::as_bool);
    // containerd 1.7 (config version 2) ships NRI disabled; 2.x (version 3) enabled.
    let nri_on = nri_disabled.map_or(version >= 3, |d| !d);
    out.push(if nri_on {
        finding(
            Level::Ok,
            "containerd NRI",
            format!("enabled (config version {version})"),
        )
    } else {
        finding(
            Level::Fail,
            "containerd NRI",
            format!(
                "disabled in {}: set `disable = false` under [plugins.\"io.containerd.nri.v1.nri\"] \
                 (see deploy/runtime/containerd-1.7.toml) and restart containerd",
                path.display()
            ),
        )
    });
    let cri = if version >= 3 {
        ["plugins", "io.containerd.cri.v1.runtime"]
    } else {
        ["plugins", "io.containerd.grpc.v1.cri"]
    };
    let enable_cdi = lookup(&cfg, &[cri[0], cri[1], "enable_cdi"]).and_then(toml::Value::as_bool);
    // CDI is on by default from containerd 2.0, off in 1.7.
    let cdi_on = enable_cdi.unwrap_or(version >= 3);
    out.push(if cdi_on {
        finding(Level::Ok, "containerd CDI", "enabled")
    } else {
        finding(
            Level::Warn,
            "containerd CDI",
            format!(
                "disabled: Tessera injects devices itself, but set `enable_cdi = true` under [{}.\"{}\"] \
                 so CDI annotations work too",
                cri[0], cri[1]
            ),
        )
    });
    out
}

/// Checks CRI-O's `[crio.nri]` settings in its config and drop-ins (later files win).
pub fn check_crio_config(main: &Path) -> Option<Finding> {
    let mut files: Vec<PathBuf> = Vec::new();
    if main.is_file() {
        files.push(main.to_path_buf());
    }
    let dropins = main.with_extension("conf.d");
    if let Ok(rd) = std::fs::read_dir(&dropins) {
        let mut d: Vec<PathBuf> = rd.flatten().map(|e| e.path()).filter(|p| p.is_file()).collect();
        d.sort();
        files.extend(d);
    }
    if files.is_empty() {
        return None;
    }
    let mut enabled = None;
    for f in &files {
        let Ok(text) = std::fs::read_to_string(f) else { continue };
        match toml::from_str::<toml::Value>(&text) {
            Ok(v) => {
                if let Some(b) = lookup(&v, &["crio", "nri", "enable_nri"]).and_then(toml::Value::as_bool) {
                    enabled = Some(b);
                }
            }
            Err(e) => {
                return Some(finding(
                    Level::Fail,
                    "CRI-O config",
                    format!("{} is not valid TOML: {e}", f.display()),
                ));
            }
        }
    }
    Some(match enabled {
        Some(true) => finding(Level::Ok, "CRI-O NRI", "enable_nri = true"),
        Some(false) => finding(
            Level::Fail,
            "CRI-O NRI",
            "enable_nri = false: set it to true under [crio.nri] (deploy/runtime/crio-nri.conf)",
        ),
        None => finding(
            Level::Warn,
            "CRI-O NRI",
            "enable_nri not set: the default depends on the CRI-O version; set it (deploy/runtime/crio-nri.conf)",
        ),
    })
}

fn check_runtime_config(opts: &CheckOptions) -> Vec<Finding> {
    let mut out = Vec::new();
    if opts.containerd_config.exists() {
        out.extend(check_containerd_config(&opts.containerd_config));
    }
    out.extend(check_crio_config(&opts.crio_config));
    if out.is_empty() {
        out.push(finding(
            Level::Warn,
            "runtime config",
            format!(
                "neither {} nor {} found: cannot tell whether NRI is enabled",
                opts.containerd_config.display(),
                opts.crio_config.display()
            ),
        ));
    }
    out
}

fn check_cdi(dirs: &[PathBuf], host_root: &Path) -> Finding {
    let what = "CDI spec";
    let all = format!("{CDI_KIND}=all");
    let resolved = CdiResolver::new(dirs.to_vec()).resolve(std::slice::from_ref(&all));
    // The runtime refuses every container whose mount source is missing.
    let missing: Vec<&str> = resolved.as_ref().map_or(Vec::new(), |e| {
        e.mounts
            .iter()
            .map(|m| m.source.as_str())
            .filter(|s| {
                let p = Path::new(s);
                std::fs::metadata(host_root.join(p.strip_prefix("/").unwrap_or(p))).is_err()
            })
            .collect()
    });
    if !missing.is_empty() {
        return finding(
            Level::Fail,
            what,
            format!(
                "{all} mounts {} host path(s) that do not exist, so the runtime would refuse GPU containers: {}{}; \
                 see `tessera-cdi-generator driver` on this node",
                missing.len(),
                missing.iter().take(5).copied().collect::<Vec<_>>().join(", "),
                if missing.len() > 5 { ", ..." } else { "" }
            ),
        );
    }
    match resolved {
        Ok(e) if !e.mounts.iter().any(|m| m.destination.ends_with("/libcuda.so.1")) => finding(
            Level::Fail,
            what,
            format!(
                "{all} mounts no libcuda.so.1 ({} mount(s)): GPU containers could not run CUDA; \
                 see `tessera-cdi-generator driver` on this node",
                e.mounts.len()
            ),
        ),
        Ok(e) => finding(
            Level::Ok,
            what,
            format!(
                "{all} resolves to {} device node(s), {} mount(s)",
                e.devices.len(),
                e.mounts.len()
            ),
        ),
        Err(e) => finding(
            Level::Fail,
            what,
            format!(
                "no usable {CDI_KIND} spec in {}: {e} (is tessera-cdi-generator running? A node whose cards are in \
                 MIG mode with no instance yet, dynamic MIG, has none until one is made)",
                dirs.iter()
                    .map(|d| d.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ),
    }
}

fn check_driver(opts: &CheckOptions) -> Finding {
    use tessera_node::driver::{self, DriverSearch};
    let what = "NVIDIA driver";
    let ctl = opts.dev_root.join("dev/nvidiactl");
    if !ctl.exists() {
        return finding(
            Level::Fail,
            what,
            format!("{} is absent: the kernel driver is not loaded", ctl.display()),
        );
    }
    // The same search the CDI generator makes (ld cache, then directories), with links
    // followed to the versioned files: a link alone proves nothing.
    let d = driver::discover(&DriverSearch {
        host_root: opts.host_root.clone(),
        driver_root: opts.driver_root.clone(),
        ..Default::default()
    });
    match d.check() {
        Ok(()) => finding(
            Level::Ok,
            what,
            format!(
                "{}; driver root {} (version {}, {} file(s); `tessera-cdi-generator driver` lists them)",
                ctl.display(),
                d.root.display(),
                d.version.as_deref().unwrap_or("unknown"),
                d.files.len()
            ),
        ),
        Err(e) => finding(Level::Fail, what, e.to_string()),
    }
}

fn check_keys(dir: &Path) -> Finding {
    use tessera_core::handoff::KeyKind;
    let what = "hand-off keys";
    let mount = "mount the tessera-handoff-public-keys Secret; docs/operations.md";
    let kinds = match VerifyingKeys::kinds_in(dir) {
        Ok(k) => k,
        Err(e) => return finding(Level::Fail, what, format!("{e} ({mount})")),
    };
    if kinds.is_empty() {
        return finding(Level::Fail, what, format!("no key in {} ({mount})", dir.display()));
    }
    let of = |kind| {
        kinds
            .iter()
            .filter(|(_, k)| *k == kind)
            .map(|(id, _)| id.as_str())
            .collect::<Vec<_>>()
    };
    let private = of(KeyKind::Ed25519Private);
    if !private.is_empty() {
        return finding(
            Level::Fail,
            what,
            format!(
                "{} in {} is the extender's private key: whoever holds it can sign allocations, so no node may; \
                 put only the public half on nodes (`openssl pkey -in k1.pem -pubout`, {mount})",
                private.join(", "),
                dir.display()
            ),
        );
    }
    let hmac = of(KeyKind::HmacSecret);
    if !hmac.is_empty() {
        return finding(
            Level::Warn,
            what,
            format!(
                "{} read as shared HMAC secret(s) (not PEM): a node holding one can sign v1 allocations; \
                 move to Ed25519 keys (docs/operations.md, \"From an HMAC key\"). Verifying with {}",
                hmac.join(", "),
                kinds.iter().map(|(id, _)| id.as_str()).collect::<Vec<_>>().join(", ")
            ),
        );
    }
    finding(
        Level::Ok,
        what,
        format!(
            "verifying with Ed25519 public key(s) {}",
            kinds.iter().map(|(id, _)| id.as_str()).collect::<Vec<_>>().join(", ")
        ),
    )
}

#[cfg(test)]
mod tests;
