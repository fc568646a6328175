//! The supervisor running NVIDIA's real `nvidia-cuda-mps-control` (Debian's 535 and 550
//! packages, `tests/nvidia/fetch.sh`; the control daemon runs without a GPU): a daemon per card
//! that can host shares, each with its own /dev/shm; a killed daemon restarted; a hung one
//! replaced; a start refused by a foreign lock retried with backoff; a clean stop on SIGTERM;
//! no daemon outliving a supervisor killed with SIGKILL, nor blocking the next one; and a
//! client's limit changes put back, however they are worded and however many come.

use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tessera_core::enforcement::{DaemonPhase, MpsLayout, MpsState};
use tessera_core::inventory::{FixtureSource, InventorySource};
use tessera_mps::leftover::lock_holder;
use tessera_tests::nvidia::{Branch, Userspace};

const BIN: &str = env!("CARGO_BIN_EXE_tessera-mps-supervisor");

fn control(b: Branch) -> PathBuf {
    Userspace::get().unwrap().mps_control(b)
}

struct Running {
    child: Child,
    layout: MpsLayout,
    log: PathBuf,
}

impl Running {
    fn start(root: &Path, fixture: &str, b: Branch) -> Self {
        Self::start_checking(root, fixture, b, 1)
    }

    /// With health checks every `check_secs`.
    fn start_checking(root: &Path, fixture: &str, b: Branch, check_secs: u32) -> Self {
        let mut args: Vec<std::ffi::OsString> = vec!["--control-binary".into(), control(b).into()];
        args.extend(["--check-secs".into(), check_secs.to_string().into()]);
        Self::start_with(root, fixture, &args)
    }

    /// With `args` added to the fixture, backoff, shm size and MPS root.
    fn start_with(root: &Path, fixture: &str, args: &[std::ffi::OsString]) -> Self {
        Self::start_env(root, fixture, args, &[])
    }

    /// With `args`, and `env` set for the supervisor (`RUST_LOG`).
    /// On the t4x2 fixture with `control`, health checks a minute apart, and the daemon's
    /// output at debug (the commands it took, in order), with `env` added.
    fn start_logging(root: &Path, control: &Path, env: &[(&str, &str)]) -> Self {
        let args: Vec<std::ffi::OsString> = vec![
            "--control-binary".into(),
            control.into(),
            "--check-secs".into(),
            "60".into(),
        ];
        let mut env = env.to_vec();
        env.push(("RUST_LOG", "info,tessera_mps::supervisor=debug"));
        Self::start_env(root, "t4x2", &args, &env)
    }

    fn start_env(root: &Path, fixture: &str, args: &[std::ffi::OsString], env: &[(&str, &str)]) -> Self {
        let log = root.join(format!(
            "supervisor-{}.log",
            std::time::UNIX_EPOCH.elapsed().unwrap().as_nanos()
        ));
        let layout = MpsLayout::new(root.join("mps"));
        let child = Command::new(BIN)
            .args(["run", "--fixture", fixture, "--backoff-ms", "200", "--shm-mib", "64"])
            .args(args)
            .arg("--mps-root")
            .arg(&layout.root)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Self { child, layout, log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn state(&self, uuid: &str) -> Option<MpsState> {
        self.layout.read_state(uuid).ok()
    }

    fn wait(&self, what: &str, within: Duration, mut f: impl FnMut(&Self) -> bool) -> Duration {
        let start = Instant::now();
        while !f(self) {
            assert!(
                start.elapsed() < within,
                "timed out waiting for {what}; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        start.elapsed()
    }

    /// Writes `c` as `card`'s wanted ceiling and waits until its daemon holds it.
    fn hold(&self, card: &str, c: tessera_core::enforcement::MpsCeiling) {
        self.layout.write_ceiling(card, &c).unwrap();
        self.wait("the ceiling held", Duration::from_secs(5), |s| {
            s.state(card).unwrap().ceiling == Some(c)
        });
    }

    fn ready(&self, uuid: &str) -> bool {
        self.state(uuid).is_some_and(|s| s.phase == DaemonPhase::Ready)
    }

    fn pid(&self, uuid: &str) -> i32 {
        self.state(uuid).and_then(|s| s.pid).expect("a daemon pid") as i32
    }

    fn status(&self) -> (i32, String) {
        let out = Command::new(BIN)
            .arg("status")
            .arg("--mps-root")
            .arg(&self.layout.root)
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    }

    fn signal(&self, sig: Signal) {
        kill(Pid::from_raw(self.child.id() as i32), sig).unwrap();
    }

    fn terminate(mut self) -> (std::process::ExitStatus, String) {
        self.signal(Signal::SIGTERM);
        let status = self.child.wait().unwrap();
        (status, self.log())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        // SIGTERM first: the supervisor stops its daemons.
        let _ = kill(Pid::from_raw(self.child.id() as i32), Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn alive(pid: i32) -> bool {
    kill(Pid::from_raw(pid), None).is_ok()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.contains(") Z"))
}

fn wait_gone(pid: i32, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while alive(pid) {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

fn uuids(fixture: &str) -> Vec<String> {
    FixtureSource::new(fixture)
        .discover()
        .unwrap()
        .gpus
        .iter()
        .map(|g| g.uuid.clone())
        .collect()
}

/// The size of the tmpfs mounted at the card's shm directory, if one is.
fn shm_size(layout: &MpsLayout, uuid: &str) -> Option<u64> {
    let dir = layout.shm_dir(uuid);
    if tessera_mps::card_dirs::mounted_type(&dir).as_deref() != Some("tmpfs") {
        return None;
    }
    let st = nix::sys::statvfs::statvfs(&dir).unwrap();
    Some(st.blocks() * st.fragment_size())
}

/// The names in the card's client directory.
fn client_dir(layout: &MpsLayout, uuid: &str) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(layout.client_dir(uuid))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn dev_ino(p: &Path) -> (u64, u64) {
    let m = std::fs::metadata(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    (m.dev(), m.ino())
}

fn daemon_per_card(b: Branch) {
    let dir = tempfile::tempdir().unwrap();
    let s = Running::start(dir.path(), "t4x2", b);
    let cards = uuids("t4x2");
    s.wait("both daemons ready", Duration::from_secs(20), |s| {
        cards.iter().all(|u| s.ready(u))
    });
    let (code, text) = s.status();
    assert_eq!(code, 0, "{text}");
    assert_eq!(text.lines().count(), 2, "{text}");

    for u in &cards {
        let st = s.state(u).unwrap();
        assert_eq!((st.restarts, &st.reason), (0, &None), "{st:?}");
        // The real daemon's pipe directory: its control socket open to every user, the
        // privileged one, the lock it holds, the log FIFO.
        let pipe = s.layout.pipe_dir(u);
        let meta = |n: &str| std::fs::metadata(pipe.join(n)).unwrap_or_else(|e| panic!("{n}: {e}"));
        assert!(meta("control").file_type().is_socket());
        assert_eq!(meta("control").permissions().mode() & 0o777, 0o666);
        assert!(meta("control_privileged").file_type().is_socket());
        assert!(meta("log").file_type().is_fifo());
        let pid = s.pid(u);
        assert_eq!(
            lock_holder(&pipe).map(|h| h.pid),
            Some(pid),
            "the daemon holds its lock"
        );
        // Its /dev/shm is its card's shm directory, in its own mount namespace.
        assert_eq!(
            dev_ino(&PathBuf::from(format!("/proc/{pid}/root/dev/shm"))),
            dev_ino(&s.layout.shm_dir(u)),
            "{u}: /dev/shm"
        );
        assert_ne!(dev_ino(Path::new("/dev/shm")), dev_ino(&s.layout.shm_dir(u)));
        // A tmpfs of its own, of the size configured.
        assert_eq!(shm_size(&s.layout, u), Some(64 << 20), "{u}");
        // What share containers get: a link to the control socket, nothing else.
        assert_eq!(client_dir(&s.layout, u), ["control"]);
        assert_eq!(
            dev_ino(&s.layout.client_dir(u).join("control")),
            dev_ino(&pipe.join("control"))
        );
    }
    // Health checks run every second; their chatter is not logged at INFO, the daemon's start is.
    std::thread::sleep(Duration::from_millis(2500));
    let log = s.log();
    assert!(log.contains("Starting control daemon"), "{log}");
    assert!(!log.contains("NEW UI") && !log.contains("Cmd:get_default"), "{log}");

    // Kill card 0's daemon: restarted, ready again with a new pid.
    let pid = s.pid(&cards[0]);
    kill(Pid::from_raw(pid), Signal::SIGKILL).unwrap();
    s.wait("a restarted daemon", Duration::from_secs(20), |s| {
        s.state(&cards[0])
            .is_some_and(|st| st.phase == DaemonPhase::Ready && st.restarts == 1 && st.pid != Some(pid as u32))
    });
    assert!(s.log().contains("MPS daemon failed: restarting"), "{}", s.log());
    // The restarted daemon's new socket is linked for its clients.
    let u = &cards[0];
    assert_eq!(
        dev_ino(&s.layout.client_dir(u).join("control")),
        dev_ino(&s.layout.pipe_dir(u).join("control"))
    );
    assert_eq!(s.state(&cards[1]).unwrap().restarts, 0, "the other card is untouched");

    // Hang card 1's daemon (SIGSTOP): the real client then blocks; the check times out, and
    // after three misses the daemon is replaced.
    let hung = s.pid(&cards[1]);
    kill(Pid::from_raw(hung), Signal::SIGSTOP).unwrap();
    s.wait("the hung daemon replaced", Duration::from_secs(40), |s| {
        s.state(&cards[1])
            .is_some_and(|st| st.phase == DaemonPhase::Ready && st.restarts == 1 && st.pid != Some(hung as u32))
    });
    assert!(wait_gone(hung, Duration::from_secs(5)), "the hung daemon was killed");
    assert!(s.log().contains("stopped answering"), "{}", s.log());

    // SIGTERM: every daemon quits and is recorded as stopped; none is left.
    let pids: Vec<i32> = cards.iter().map(|u| s.pid(u)).collect();
    let layout = s.layout.clone();
    let (status, log) = s.terminate();
    assert!(status.success(), "{log}");
    for (u, pid) in cards.iter().zip(pids) {
        assert_eq!(layout.read_state(u).unwrap().phase, DaemonPhase::Stopped, "{log}");
        assert!(!alive(pid), "{u}: daemon {pid} still runs");
        assert_eq!(lock_holder(&layout.pipe_dir(u)), None);
        assert!(
            client_dir(&layout, u).is_empty(),
            "{u}: a stopped daemon is not offered"
        );
        assert_eq!(shm_size(&layout, u), None, "{u}: the shm tmpfs is unmounted");
    }
    assert!(!log.contains("did not quit in time"), "{log}");
    let out = Command::new(BIN)
        .arg("status")
        .arg("--mps-root")
        .arg(&layout.root)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("NOT READY"));
}

#[test]
fn real_535_daemon_per_card_restarted_replaced_and_stopped() {
    daemon_per_card(Branch::R535);
}

#[test]
fn real_550_daemon_per_card_restarted_replaced_and_stopped() {
    daemon_per_card(Branch::R550);
}

#[test]
fn a_supervisor_killed_with_sigkill_leaves_no_daemon_and_a_leftover_is_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let cards = uuids("t4x2");
    let s = Running::start(dir.path(), "t4x2", Branch::R535);
    s.wait("ready", Duration::from_secs(20), |s| cards.iter().all(|u| s.ready(u)));
    let pids: Vec<i32> = cards.iter().map(|u| s.pid(u)).collect();
    // SIGKILL: the supervisor cannot quit its daemons; the kernel kills them with it.
    s.signal(Signal::SIGKILL);
    for pid in &pids {
        assert!(
            wait_gone(*pid, Duration::from_secs(5)),
            "daemon {pid} outlived its supervisor"
        );
    }
    drop(s);

    // A daemon started by hand on card 0's pipe directory (`-d`: it forks into the background,
    // as one left by an older supervisor would be): the next supervisor stops it and is ready.
    let layout = MpsLayout::new(dir.path().join("mps"));
    let st = Command::new(control(Branch::R535))
        .arg("-d")
        .env("CUDA_MPS_PIPE_DIRECTORY", layout.pipe_dir(&cards[0]))
        .env("CUDA_MPS_LOG_DIRECTORY", layout.log_dir(&cards[0]))
        .status()
        .unwrap();
    assert!(st.success());
    let leftover = {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(h) = lock_holder(&layout.pipe_dir(&cards[0])) {
                break h;
            }
            assert!(Instant::now() < deadline, "the hand-started daemon never took its lock");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    assert!(leftover.is_mps(), "{leftover:?}");
    // Whatever happens below, the hand-started daemon does not outlive the test.
    struct KillOnDrop(i32);
    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            if alive(self.0) {
                let _ = kill(Pid::from_raw(self.0), Signal::SIGKILL);
            }
        }
    }
    let _guard = KillOnDrop(leftover.pid);
    let s = Running::start(dir.path(), "t4x2", Branch::R535);
    // The killed supervisor's state files still say ready: wait for daemons of this one.
    let took = s.wait("ready beside the leftover", Duration::from_secs(15), |s| {
        cards.iter().all(|u| {
            s.ready(u)
                && s.state(u)
                    .and_then(|st| st.pid)
                    .is_some_and(|p| !pids.contains(&(p as i32)) && p as i32 != leftover.pid)
        })
    });
    assert!(
        !alive(leftover.pid),
        "the leftover daemon {leftover:?} still runs: {:?}\n{}",
        std::fs::read_to_string(format!("/proc/{}/stat", leftover.pid)),
        s.log()
    );
    assert!(s.log().contains("left by an earlier supervisor"), "{}", s.log());
    assert_eq!(s.state(&cards[0]).unwrap().restarts, 0, "{}", s.log());
    println!("ready {took:?} after starting beside a leftover daemon");
}

#[test]
fn a_start_refused_by_a_foreign_lock_is_retried_with_backoff_and_mig_cards_get_none() {
    let dir = tempfile::tempdir().unwrap();
    let inv = FixtureSource::new("a100-mig").discover().unwrap();
    let (mig, whole): (Vec<_>, Vec<_>) = inv.gpus.iter().partition(|g| g.mig_enabled);
    assert!(!mig.is_empty() && whole.len() == 1);
    let card = &whole[0].uuid;
    let layout = MpsLayout::new(dir.path().join("mps"));
    let pipe = layout.pipe_dir(card);
    std::fs::create_dir_all(&pipe).unwrap();
    // Something that is no MPS daemon holds the lock: the real daemon refuses to start, and the
    // supervisor must not kill a process it does not own.
    let script = format!(
        "import fcntl,os,time; fd=os.open('{}',os.O_RDWR|os.O_CREAT); fcntl.lockf(fd,fcntl.LOCK_EX); print('locked',flush=True); time.sleep(60)",
        pipe.join("control_lock").display()
    );
    let mut holder = Command::new("python3")
        .args(["-c", &script])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(holder.stdout.as_mut().unwrap()), &mut line).unwrap();
    let s = Running::start(dir.path(), "a100-mig", Branch::R550);
    // The state file is written before the failure is logged: wait for both.
    let delays = |s: &Running| -> Vec<u64> {
        s.log()
            .lines()
            .filter_map(|l| l.split("delay_ms=").nth(1))
            .filter_map(|v| v.split_whitespace().next()?.parse().ok())
            .collect()
    };
    s.wait("three failed starts", Duration::from_secs(20), |s| {
        s.state(card).is_some_and(|st| st.restarts >= 3) && delays(s).len() >= 3
    });
    let st = s.state(card).unwrap();
    assert_eq!(st.phase, DaemonPhase::Restarting);
    let reason = st.reason.as_deref().unwrap();
    assert!(
        reason.contains("exited while starting") && reason.contains("An instance of this daemon is already running"),
        "{st:?}"
    );
    assert!(
        layout
            .ready(card, std::time::SystemTime::now())
            .unwrap_err()
            .contains("restarting")
    );
    assert!(
        s.log().contains("no MPS daemon holds the card's MPS pipe directory")
            || s.log().contains("that is no MPS daemon"),
        "{}",
        s.log()
    );
    // The delays grew: 200 ms, 400 ms, 800 ms...
    let delays = delays(&s);
    assert!(delays[..3] == [200, 400, 800], "{delays:?}");
    assert!(alive(holder.id() as i32), "the foreign holder was killed");
    // The holder goes: the daemon comes up. MIG cards never got a daemon.
    holder.kill().unwrap();
    holder.wait().unwrap();
    s.wait("the daemon up once the lock is free", Duration::from_secs(20), |s| {
        s.ready(card)
    });
    for g in mig {
        assert!(s.state(&g.uuid).is_none(), "MIG card {} got a daemon", g.uuid);
    }
}

/// What the real daemon answers to `cmd`, as the user `uid` (root when `None`), through the
/// pipe directory (the supervisor's way) or, for a tenant, the client directory (what share
/// containers get).
fn ask(layout: &MpsLayout, uuid: &str, cmd: &str, uid: Option<u32>) -> String {
    ask_in(&layout.pipe_dir(uuid), cmd, uid)
}

fn ask_in(dir: &Path, cmd: &str, uid: Option<u32>) -> String {
    ask_raw(Branch::R535, dir, cmd.as_bytes(), uid)
}

/// [`ask_in`] with the client of `b`, and a command of any bytes.
fn ask_raw(b: Branch, dir: &Path, cmd: &[u8], uid: Option<u32>) -> String {
    use std::io::Write as _;
    use std::os::unix::process::CommandExt as _;
    // The daemon serves one control connection at a time: a client that meets it busy (the
    // supervisor putting a ceiling back) is told "Cannot send command", or exits 0 having said
    // nothing and done nothing, and tries again. Every command this file sends prints an answer
    // but the sets of the memory limit and of the client priority.
    let silent =
        cmd.starts_with(b"set_default_device_pinned_mem_limit") || cmd.starts_with(b"set_default_client_priority");
    for _ in 0..200 {
        let mut c = Command::new(control(b));
        c.env("CUDA_MPS_PIPE_DIRECTORY", dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(uid) = uid {
            c.uid(uid).gid(uid);
        }
        let mut child = c.spawn().unwrap();
        // The client exits at once when it finds no daemon: its stdin may be closed by then.
        let mut stdin = child.stdin.take().unwrap();
        let _ = stdin.write_all(cmd).and_then(|()| stdin.write_all(b"\n"));
        drop(stdin);
        let out = child.wait_with_output().unwrap();
        let said = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if String::from_utf8_lossy(&out.stderr).contains("Cannot send command") || (said.is_empty() && !silent) {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        }
        return said;
    }
    panic!("{}: the daemon stayed busy", String::from_utf8_lossy(cmd))
}

#[test]
fn the_daemon_holds_the_cards_ceiling_and_a_client_cannot_lift_it() {
    use tessera_core::enforcement::MpsCeiling;
    let dir = tempfile::tempdir().unwrap();
    let cards = uuids("t4x2");
    // Health checks a minute apart: what puts a client's change back is the daemon's own log.
    let s = Running::start_checking(dir.path(), "t4x2", Branch::R535, 60);
    s.wait("ready", Duration::from_secs(20), |s| cards.iter().all(|u| s.ready(u)));
    // No share placed: the daemon is closed to clients (the least MPS takes), not 100%.
    let defaults = |u: &str| {
        (
            ask(&s.layout, u, "get_default_active_thread_percentage", None),
            ask(&s.layout, u, "get_default_device_pinned_mem_limit 0", None),
        )
    };
    assert_eq!(defaults(&cards[0]), ("1.0".into(), "1M".into()));
    assert_eq!(s.state(&cards[0]).unwrap().ceiling, Some(MpsCeiling::CLOSED));
    // Shares placed (the NRI plugin writes this): the daemon takes the ceiling at once.
    let c = MpsCeiling {
        active_thread_percentage: 30,
        pinned_memory_mib: 8192,
    };
    s.layout.write_ceiling(&cards[0], &c).unwrap();
    s.wait("the ceiling held", Duration::from_secs(2), |s| {
        s.state(&cards[0]).unwrap().ceiling == Some(c)
    });
    assert_eq!(defaults(&cards[0]), ("30.0".into(), "8G".into()));
    assert_eq!(
        defaults(&cards[1]),
        ("1.0".into(), "1M".into()),
        "the other card is untouched"
    );
    // A tenant (any uid reaches the control socket) lifts the default: the supervisor reads
    // the command off the daemon's log and puts the ceiling back at once, not at the next check.
    let tenant = s.layout.client_dir(&cards[0]);
    assert_eq!(
        ask_in(&tenant, "set_default_active_thread_percentage 100", Some(65534)),
        "100.0"
    );
    ask_in(&tenant, "set_default_device_pinned_mem_limit 0 0", Some(65534));
    // Root in a share container cannot stop the daemon: `quit` needs control_privileged.
    assert_eq!(
        ask_in(&tenant, "quit", None),
        "Not enough privilege to execute quit command"
    );
    s.wait("the ceiling restored", Duration::from_secs(2), |_| {
        defaults(&cards[0]) == ("30.0".into(), "8G".into())
    });
    assert!(s.log().contains("changed by a client"), "{}", s.log());
    // Lowered, too (a tenant starving the card's other shares): put back.
    ask_in(&tenant, "set_default_active_thread_percentage 1", Some(65534));
    s.wait("the ceiling restored", Duration::from_secs(2), |_| {
        defaults(&cards[0]).0 == "30.0"
    });
    // A server stopped through the socket cannot be refused; it is reported.
    ask_in(&tenant, "shutdown_server 4242", Some(65534));
    s.wait("the stop reported", Duration::from_secs(2), |s| {
        s.log().contains("stopped MPS work through the control socket")
    });
    // A restarted daemon gets the ceiling before it is ready.
    let pid = s.pid(&cards[0]);
    kill(Pid::from_raw(pid), Signal::SIGKILL).unwrap();
    s.wait("restarted", Duration::from_secs(20), |s| {
        s.ready(&cards[0]) && s.state(&cards[0]).and_then(|st| st.pid) != Some(pid as u32)
    });
    assert_eq!(defaults(&cards[0]), ("30.0".into(), "8G".into()));
    // Memory that is no whole GiB: the daemon prints it rounded down, and is still held.
    let odd = MpsCeiling {
        active_thread_percentage: 40,
        pinned_memory_mib: 1536,
    };
    s.layout.write_ceiling(&cards[0], &odd).unwrap();
    s.wait("an odd ceiling held", Duration::from_secs(2), |s| {
        s.state(&cards[0]).unwrap().ceiling == Some(odd)
    });
    assert_eq!(defaults(&cards[0]), ("40.0".into(), "1G".into()));
}

/// A field of a process's `/proc/<pid>/status`, in kB.
fn proc_kb(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| {
            l.strip_prefix(field)?
                .strip_prefix(':')?
                .trim()
                .strip_suffix(" kB")?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no {field} for {pid}"))
}

/// The warnings about card `uuid` in the supervisor's log that say `what`, and how many
/// commands they say they count.
fn warned(log: &str, uuid: &str, what: &str) -> (usize, u64) {
    let lines: Vec<&str> = log.lines().filter(|l| l.contains(what) && l.contains(uuid)).collect();
    let commands = lines
        .iter()
        .filter_map(|l| {
            l.split("commands=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum();
    (lines.len(), commands)
}

/// The ceiling's re-applies after clients' commands on card `uuid`, and how many commands
/// they answered.
fn reapplies(log: &str, uuid: &str) -> (usize, u64) {
    warned(log, uuid, "changed by a client")
}

/// A tenant's control client of `b` on `card`, as uid 65534 through the link share containers
/// get, its commands to come on its standard input.
fn tenant_client(b: Branch, s: &Running, card: &str) -> Child {
    use std::os::unix::process::CommandExt as _;
    Command::new(control(b))
        .env("CUDA_MPS_PIPE_DIRECTORY", s.layout.client_dir(card))
        .uid(65534)
        .gid(65534)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// A tenant floods its card's daemon with limit changes and server stops through one control
/// client (the real daemon takes tens of thousands a second on one connection). The supervisor
/// counts them and puts the ceiling back once per wake-up, not once per command, and reports
/// stops at most once a second: its memory stays bounded, and within 2 s of the flood's end the
/// daemon holds the ceiling and the supervisor is quiet.
fn a_flood_of_limit_changes_is_answered_once(b: Branch) {
    use std::io::Write as _;
    use tessera_core::enforcement::MpsCeiling;
    const N: u64 = 80_000;
    // One in ten a stop of a server that does not run.
    const STOPS: u64 = N / 10;
    let dir = tempfile::tempdir().unwrap();
    let cards = uuids("t4x2");
    let card = &cards[0];
    let s = Running::start_checking(dir.path(), "t4x2", b, 60);
    s.wait("ready", Duration::from_secs(20), |s| cards.iter().all(|u| s.ready(u)));
    let c = MpsCeiling {
        active_thread_percentage: 30,
        pinned_memory_mib: 8192,
    };
    s.hold(card, c);
    let pipe = s.layout.pipe_dir(card);
    let defaults = || {
        (
            ask_raw(b, &pipe, b"get_default_active_thread_percentage", None),
            ask_raw(b, &pipe, b"get_default_device_pinned_mem_limit 0", None),
        )
    };
    let held = ("30.0".to_string(), "8G".to_string());
    let supervisor = s.child.id();
    let rss_before = proc_kb(supervisor, "VmRSS");
    // 535 takes a default set from any uid; 550 refuses it to one that is not the daemon's, but
    // logs it all the same.
    let started = Instant::now();
    let mut flood = tenant_client(b, &s, card);
    let lines: String = (0..N)
        .map(|i| match i % 10 {
            0 => "shutdown_server 4242\n",
            _ => "set_default_active_thread_percentage 100\n",
        })
        .collect();
    flood.stdin.take().unwrap().write_all(lines.as_bytes()).unwrap();
    assert!(flood.wait().unwrap().success());
    let ended = Instant::now();
    let took = ended - started;
    println!(
        "{b:?}: {N} commands through one client in {took:.2?} ({:.0}/s)",
        N as f64 / took.as_secs_f64()
    );
    // Each command queued would have grown it by tens of bytes (5 MB for these, 23 MB for 10 s
    // of a flood): counted, they cost nothing.
    let grown = || proc_kb(supervisor, "VmHWM").saturating_sub(rss_before);
    let most = 4 << 10;
    assert!(
        grown() < most,
        "the supervisor grew by {} kB over {rss_before} kB",
        grown()
    );
    // Every command counted, the ceiling held, and no re-apply for the last 500 ms: all within
    // 2 s of the flood's end (and the 500 ms to see the quiet).
    let (mut seen, mut since) = ((usize::MAX, 0), Instant::now());
    let stops = loop {
        let log = s.log();
        let (now, stops) = (reapplies(&log, card), warned(&log, card, "stopped MPS work"));
        if now != seen {
            (seen, since) = (now, Instant::now());
        }
        let holds = defaults();
        if seen.1 == N - STOPS && stops.1 == STOPS && holds == held && since.elapsed() >= Duration::from_millis(500) {
            break stops;
        }
        assert!(
            ended.elapsed() < Duration::from_millis(2500),
            "{:.2?} after the flood: {} re-applies so far, for {} of the {} changes; {} of the {STOPS} stops reported; the daemon holds {holds:?}; the log's end:\n{}",
            ended.elapsed(),
            seen.0,
            seen.1,
            N - STOPS,
            stops.1,
            log.lines().rev().take(10).collect::<Vec<_>>().join("\n")
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    println!(
        "{b:?}: {} re-applies and {} reports of stops for {N} commands; peak memory {} kB over the {rss_before} kB before; quiet and held {:.2?} after the flood",
        seen.0,
        stops.0,
        grown(),
        ended.elapsed() - Duration::from_millis(500)
    );
    assert!(seen.0 <= 20, "{} re-applies for one client's flood", seen.0);
    // At most one report a second, from the flood's first stop to the last report.
    assert!(
        stops.0 as f64 <= started.elapsed().as_secs_f64() + 1.0,
        "{} reports of stops in {:.2?}",
        stops.0,
        started.elapsed()
    );
    assert!(
        grown() < most,
        "the supervisor grew by {} kB over {rss_before} kB",
        grown()
    );
    // The other card's daemon never heard of it.
    assert_eq!(reapplies(&s.log(), &cards[1]).0, 0);
}

#[test]
fn a_flood_of_limit_changes_is_answered_once_535() {
    a_flood_of_limit_changes_is_answered_once(Branch::R535);
}

#[test]
fn a_flood_of_limit_changes_is_answered_once_550() {
    a_flood_of_limit_changes_is_answered_once(Branch::R550);
}

/// Whether the supervisor's log shows the daemon taking `own` after the last `theirs` (each a
/// whole command, as the daemon logged it).
fn sent_after(log: &str, theirs: &str, own: &str) -> bool {
    let commands: Vec<&str> = log
        .lines()
        .filter_map(|l| l.split_once("] Cmd:")?.1.rsplit_once(" uuid=").map(|(c, _)| c))
        .collect();
    commands
        .iter()
        .rposition(|c| *c == theirs)
        .is_some_and(|at| commands[at..].contains(&own))
}

/// The daemon reads a command's first word and the numbers after it, ignoring further words,
/// and prints memory limits back in whole GiB. A client's limit change hidden in its words
/// (a trailing word, a forged log prefix, bytes that are no UTF-8) is put back within 2 s,
/// health checks a minute apart; a memory limit that reads back as the ceiling (9215M reads
/// 8G) too, where no read-back could see it: the daemon logs the supervisor's command after it.
/// So is the default client priority set below normal (the card's later clients, other
/// shares' among them, behind the tenant's own), plain or with a trailing word.
#[test]
fn a_limit_change_hidden_in_its_words_is_put_back() {
    use tessera_core::enforcement::MpsCeiling;
    let dir = tempfile::tempdir().unwrap();
    let cards = uuids("t4x2");
    let card = &cards[0];
    let s = Running::start_logging(dir.path(), &control(Branch::R535), &[]);
    s.wait("ready", Duration::from_secs(20), |s| cards.iter().all(|u| s.ready(u)));
    let c = MpsCeiling {
        active_thread_percentage: 30,
        pinned_memory_mib: 8192,
    };
    s.hold(card, c);
    let tenant = s.layout.client_dir(card);
    let pct = || ask(&s.layout, card, "get_default_active_thread_percentage", None);
    // Each re-apply is waited for to its end: the daemon is then free for the next command (a
    // memory limit's set, which answers nothing, could not tell a busy daemon's refusal).
    let applied = |s: &Running| {
        s.log()
            .lines()
            .filter(|l| l.contains("MPS ceiling set") && l.contains(card.as_str()))
            .count()
    };
    let lifts: [&[u8]; 3] = [
        b"set_default_active_thread_percentage 100 x",
        b"set_default_active_thread_percentage 100 ] Cmd:set_default_active_thread_percentage 30",
        b"set_default_active_thread_percentage 100 \xff",
    ];
    for theirs in lifts {
        let shown = String::from_utf8_lossy(theirs);
        let before = applied(&s);
        assert_eq!(ask_raw(Branch::R535, &tenant, theirs, Some(65534)), "100.0", "{shown}");
        s.wait(
            &format!("the ceiling restored after {shown:?}"),
            Duration::from_secs(2),
            |s| pct() == "30.0" && applied(s) > before,
        );
    }
    // Sets that answer nothing: each with the supervisor's command that must follow it, and
    // the read-back after.
    let memory = (
        "set_default_device_pinned_mem_limit 0 8192M",
        "get_default_device_pinned_mem_limit 0",
        "8G",
    );
    let priority = ("set_default_client_priority 0", "get_default_client_priority", "0");
    for (theirs, (own, read, held)) in [
        ("set_default_device_pinned_mem_limit 0 9215M x", memory),
        ("set_default_device_pinned_mem_limit 0 9215M", memory),
        ("set_default_client_priority 1", priority),
        ("set_default_client_priority 1 x", priority),
    ] {
        let before = applied(&s);
        ask_in(&tenant, theirs, Some(65534));
        // Read only once the re-apply is done: the daemon serves one control connection, and
        // a command that meets another in progress may be dropped unanswered (a set's too).
        s.wait(&format!("{own:?} after {theirs:?}"), Duration::from_secs(2), |s| {
            sent_after(&s.log(), theirs, own) && applied(s) > before
        });
        assert_eq!(ask(&s.layout, card, read, None), held, "after {theirs:?}");
    }
    // Each was reported.
    assert_eq!(reapplies(&s.log(), card).1, 7, "{}", s.log());
}

/// A memory limit's set answers nothing and reads back only to the GiB, and the daemon drops a
/// command that meets another client's held connection. A tenant that sets 9215M (which reads
/// as the 8G of an 8192M ceiling) and then keeps the daemon busy has the supervisor's re-apply
/// dropped unseen: the supervisor sets the limit again until the daemon logs the set. (The fake
/// daemon drops the supervisor's next memory set after the tenant's, as the real one sometimes
/// drops a command meeting a held connection; without the check the 9215M stays and no set is
/// logged after it.)
#[test]
fn a_memory_limit_set_the_daemon_dropped_is_set_again() {
    use std::io::Write as _;
    use tessera_core::enforcement::MpsCeiling;
    let dir = tempfile::tempdir().unwrap();
    let cards = uuids("t4x2");
    let card = &cards[0];
    let fake = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/fake-mps-control");
    let theirs = "set_default_device_pinned_mem_limit 0 9215M";
    let s = Running::start_logging(
        dir.path(),
        &fake,
        &[
            ("FAKE_MPS_DROP_AFTER", theirs),
            ("FAKE_MPS_DROP", "set_default_device_pinned_mem_limit 0 8192M"),
        ],
    );
    s.wait("ready", Duration::from_secs(20), |s| cards.iter().all(|u| s.ready(u)));
    let c = MpsCeiling {
        active_thread_percentage: 30,
        pinned_memory_mib: 8192,
    };
    s.hold(card, c);
    let mut tenant = Command::new(&fake)
        .env("CUDA_MPS_PIPE_DIRECTORY", s.layout.client_dir(card))
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    writeln!(tenant.stdin.take().unwrap(), "{theirs}").unwrap();
    assert!(tenant.wait().unwrap().success());
    s.wait(
        "the memory limit set again after the dropped re-apply",
        Duration::from_secs(10),
        |s| sent_after(&s.log(), theirs, "set_default_device_pinned_mem_limit 0 8192M"),
    );
    assert!(
        s.log().contains("did not take the memory limit"),
        "the dropped set was seen: {}",
        s.log()
    );
}

/// The real daemon, while another client holds its one control connection, sometimes lets a
/// second client exit 0 having said and done nothing. A read the supervisor makes then (a
/// health check, a ceiling's read-back) is tried again, not taken as an empty answer.
#[test]
fn a_read_meeting_a_held_control_connection_waits_for_the_answer() {
    use std::io::Write as _;
    let dir = tempfile::tempdir().unwrap();
    let cards = uuids("t4x2");
    let s = Running::start_checking(dir.path(), "t4x2", Branch::R535, 60);
    s.wait("ready", Duration::from_secs(20), |s| cards.iter().all(|u| s.ready(u)));
    let binaries = tessera_mps::control::MpsBinaries {
        control: control(Branch::R535),
        path_dirs: vec![],
        library_dirs: vec![],
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let read = |cmd: &str| rt.block_on(binaries.command(&s.layout, &cards[0], cmd, Duration::from_secs(10)));
    let reads = [
        ("get_default_active_thread_percentage", "1.0"),
        ("get_default_client_priority", "0"),
    ];
    for (round, (cmd, answer)) in reads.iter().cycle().take(6).enumerate() {
        // A tenant's client connects and sends nothing for a while.
        let mut holder = Command::new(control(Branch::R535))
            .env("CUDA_MPS_PIPE_DIRECTORY", s.layout.client_dir(&cards[0]))
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut stdin = holder.stdin.take().unwrap();
        std::thread::sleep(Duration::from_millis(300));
        let release = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(700));
            let _ = writeln!(stdin, "get_default_active_thread_percentage");
        });
        let started = Instant::now();
        assert_eq!(
            read(cmd).map_err(|e| e.to_string()),
            Ok(answer.to_string()),
            "round {round}: {cmd}"
        );
        assert!(
            started.elapsed() >= Duration::from_millis(300),
            "round {round}: answered while the connection was held"
        );
        release.join().unwrap();
        holder.wait().unwrap();
    }
}

/// A tenant's client that connects to the card's control socket and says nothing holds the
/// daemon (it serves one connection at a time): the supervisor's checks went unanswered, and
/// after three it restarted the daemon, stopping the card's MPS servers with it. Now a
/// connection the daemon held through two unanswered checks is shut down from the daemon's
/// side, named in a warning (the client's pid and uid): the same daemon answers again.
fn a_client_holding_the_control_connection_is_cut(b: Branch) {
    let dir = tempfile::tempdir().unwrap();
    let cards = uuids("t4x2");
    let s = Running::start_checking(dir.path(), "t4x2", b, 1);
    s.wait("ready", Duration::from_secs(20), |s| cards.iter().all(|u| s.ready(u)));
    let (card, pid) = (&cards[0], s.pid(&cards[0]));
    let read = || {
        ask_raw(
            b,
            &s.layout.pipe_dir(card),
            b"get_default_active_thread_percentage",
            Some(65534),
        )
    };
    let answer = read();
    // The tenant's client, as uid 65534 through the link share containers get: it connects
    // and waits for a command on its standard input, which never comes.
    let mut holder = tenant_client(b, &s, card);
    let held_at = Instant::now();
    let named = format!("client_pid={}", holder.id());
    s.wait("the held connection cut", Duration::from_secs(30), |s| {
        s.log().lines().any(|l| l.contains("cut it") && l.contains(&named))
    });
    let log = s.log();
    let warning = log.lines().find(|l| l.contains(&named)).unwrap();
    assert!(warning.contains("client_uid=65534"), "{warning}");
    assert_eq!(read(), answer);
    // Past the time three missed checks took to restart it (5 s each), the same daemon.
    while held_at.elapsed() < Duration::from_secs(25) {
        let st = s.state(card).unwrap();
        assert_eq!((st.restarts, st.pid), (0, Some(pid as u32)), "{}", s.log());
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(!s.log().contains("stopped answering"), "{}", s.log());
    drop(holder.stdin.take());
    holder.wait().unwrap();
}

#[test]
fn a_client_holding_the_control_connection_is_cut_and_the_535_daemon_kept() {
    a_client_holding_the_control_connection_is_cut(Branch::R535);
}

#[test]
fn a_client_holding_the_control_connection_is_cut_and_the_550_daemon_kept() {
    a_client_holding_the_control_connection_is_cut(Branch::R550);
}

/// A fixture that cannot be read is a typo that no later read will fix: the supervisor says so
/// at start, naming it and the built-in names, and exits, instead of supervising no card.
#[test]
fn an_unreadable_fixture_is_refused_at_start() {
    let root = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .args([
            "run",
            "--fixture",
            "h100x9",
            "--control-binary",
            "/bin/true",
            "--mps-root",
        ])
        .arg(root.path())
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("--fixture h100x9: cannot read fixture h100x9") && stderr.contains("h100x8"),
        "{stderr}"
    );
}

/// A fake `nvidia-smi` (the real one needs a GPU to set a mode) that logs each call with
/// whether the card's daemon was running then, and fails while `fail` exists in `dir`.
fn fake_nvidia_smi(dir: &Path, layout: &MpsLayout, cards: &[String]) -> PathBuf {
    let mut cases = String::new();
    for u in cards {
        cases.push_str(&format!(
            "  {u}) [ -S '{}' ] && state=daemon-running || state=no-daemon ;;\n",
            layout.pipe_dir(u).join("control").display()
        ));
    }
    // Each card's mode is kept in a file, for the supervisor's query of it.
    let script = format!(
        "#!/bin/sh\nstate=unknown\ncase \"$2\" in\n{cases}esac\n\
         if [ -e '{d}/fail' ]; then echo 'Insufficient Permissions'; exit 4; fi\n\
         echo \"$* $state\" >> '{d}/calls'\n\
         case \"$3\" in\n\
           -c) echo \"$4\" > '{d}/mode-'\"$2\" ;;\n\
           --query-gpu=compute_mode) if [ \"$(cat '{d}/mode-'\"$2\" 2>/dev/null)\" = EXCLUSIVE_PROCESS ]; \
             then echo Exclusive_Process; else echo Default; fi ;;\n\
         esac\n",
        d = dir.display()
    );
    let path = dir.join("nvidia-smi");
    std::fs::write(&path, script).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// With `--exclusive-process`, each card MPS serves is put in exclusive-process mode before
/// its daemon starts, and set back to default when it stops hosting shares or the supervisor
/// stops; a card whose mode cannot be set gets no daemon (and says why) until it can; a card
/// an earlier supervisor left exclusive is set back when the next one starts.
#[test]
fn exclusive_process_mode_holds_while_a_card_serves_mps() {
    let dir = tempfile::tempdir().unwrap();
    let cards = uuids("t4x2");
    let fixture = dir.path().join("node.yaml");
    let whole =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../core/fixtures/t4x2.yaml")).unwrap();
    // The node without its second card (everything from that card's entry to the driver files).
    let (head, rest) = whole.split_at(whole.find("  - index: 1").unwrap());
    let one_card = format!("{head}{}", &rest[rest.find("driver_files:").unwrap()..]);
    std::fs::write(&fixture, &whole).unwrap();
    let layout = MpsLayout::new(dir.path().join("mps"));
    let smi = fake_nvidia_smi(dir.path(), &layout, &cards);
    let calls = || std::fs::read_to_string(dir.path().join("calls")).unwrap_or_default();
    let args: Vec<std::ffi::OsString> = vec![
        "--control-binary".into(),
        control(Branch::R535).into(),
        "--inventory-secs".into(),
        "1".into(),
        "--exclusive-process".into(),
        "--nvidia-smi".into(),
        smi.clone().into(),
    ];
    let s = Running::start_with(dir.path(), fixture.to_str().unwrap(), &args);
    s.wait("both daemons ready", Duration::from_secs(20), |s| {
        cards.iter().all(|u| s.ready(u))
    });
    for u in &cards {
        assert!(
            calls().contains(&format!("-i {u} -c EXCLUSIVE_PROCESS no-daemon")),
            "{}",
            calls()
        );
        assert!(tessera_mps::compute_mode::marker(&layout, u).exists());
        // Read back and recorded for `check`.
        assert_eq!(
            s.state(u).and_then(|st| st.exclusive_process),
            Some(true),
            "{}",
            calls()
        );
    }
    // The second card leaves: its daemon stops and the card is set back; the first is kept.
    std::fs::write(&fixture, &one_card).unwrap();
    // Its marker goes once nvidia-smi has set it back (the fake logs the call as it starts).
    s.wait("the second card set back", Duration::from_secs(20), |_| {
        calls().contains(&format!("-i {} -c DEFAULT", cards[1]))
            && !tessera_mps::compute_mode::marker(&layout, &cards[1]).exists()
    });
    assert!(!calls().contains(&format!("-i {} -c DEFAULT", cards[0])), "{}", calls());
    assert!(s.ready(&cards[0]));
    // It comes back while its mode cannot be set: no daemon, the reason in its state.
    std::fs::write(dir.path().join("fail"), "").unwrap();
    std::fs::write(&fixture, &whole).unwrap();
    s.wait("the failure recorded", Duration::from_secs(20), |s| {
        s.state(&cards[1])
            .and_then(|st| st.reason)
            .is_some_and(|r| r.contains("exclusive-process mode") && r.contains("Insufficient Permissions"))
    });
    assert!(!s.ready(&cards[1]));
    assert_eq!(
        lock_holder(&layout.pipe_dir(&cards[1])),
        None,
        "a daemon started on a card not exclusive; calls:
{}
log:
{}",
        calls(),
        s.log()
    );
    let (code, text) = s.status();
    assert_ne!(code, 0, "{text}");
    // Once it can, the card serves again.
    std::fs::remove_file(dir.path().join("fail")).unwrap();
    s.wait("the second daemon ready", Duration::from_secs(20), |s| {
        s.ready(&cards[1])
    });
    // A clean stop sets every card back.
    let (status, log) = s.terminate();
    assert!(status.success(), "{log}");
    for u in &cards {
        assert_eq!(
            calls().matches(&format!("-i {u} -c DEFAULT")).count(),
            if *u == cards[1] { 2 } else { 1 },
            "{}",
            calls()
        );
        assert!(!tessera_mps::compute_mode::marker(&layout, u).exists());
    }
    // A card left exclusive by a supervisor that died (its marker still there) and hosting
    // no shares now is set back at the next start.
    std::fs::write(&fixture, &one_card).unwrap();
    std::fs::write(tessera_mps::compute_mode::marker(&layout, &cards[1]), "").unwrap();
    let before = calls().matches(&format!("-i {} -c DEFAULT", cards[1])).count();
    let s = Running::start_with(dir.path(), fixture.to_str().unwrap(), &args);
    s.wait("the leftover set back", Duration::from_secs(20), |_| {
        calls().matches(&format!("-i {} -c DEFAULT", cards[1])).count() > before
            && !tessera_mps::compute_mode::marker(&layout, &cards[1]).exists()
    });
    drop(s);
    // Exclusive-process mode no longer asked for: a card it left exclusive (its marker, after
    // a supervisor that died) is set back though it still hosts shares, and none is set
    // exclusive.
    std::fs::write(tessera_mps::compute_mode::marker(&layout, &cards[0]), "").unwrap();
    let (before, exclusive_before) = (
        calls().matches(&format!("-i {} -c DEFAULT", cards[0])).count(),
        calls().matches("EXCLUSIVE_PROCESS").count(),
    );
    let plain: Vec<std::ffi::OsString> = args.iter().filter(|a| *a != "--exclusive-process").cloned().collect();
    let s = Running::start_with(dir.path(), fixture.to_str().unwrap(), &plain);
    s.wait("the card set back", Duration::from_secs(20), |s| {
        s.ready(&cards[0])
            && calls().matches(&format!("-i {} -c DEFAULT", cards[0])).count() > before
            && !tessera_mps::compute_mode::marker(&layout, &cards[0]).exists()
    });
    // Its daemon runs on a card open to processes that go around MPS, and its state says so.
    assert_eq!(
        s.state(&cards[0]).and_then(|st| st.exclusive_process),
        Some(false),
        "{}",
        calls()
    );
    assert_eq!(
        calls().matches("EXCLUSIVE_PROCESS").count(),
        exclusive_before,
        "{}",
        calls()
    );
}

/// With the real 535 `nvidia-smi` and no GPU: the supervisor finds it among the driver's files
/// (as it finds the MPS programs), runs it with the driver's libraries, and when it fails, as it
/// must without a driver, starts no daemon on the card and records the driver's words. The
/// real binary documents the call the fake above takes (`-i`, `-c DEFAULT|EXCLUSIVE_PROCESS`).
#[test]
fn the_real_nvidia_smi_is_found_and_its_failure_keeps_the_daemon_down() {
    let us = Userspace::get().unwrap();
    for b in [Branch::R535, Branch::R550] {
        let help = Command::new(us.packages(b).join("usr/lib/nvidia/current/nvidia-smi"))
            .arg("-h")
            .env("LD_LIBRARY_PATH", us.library_dir(b))
            .output()
            .unwrap();
        let help = String::from_utf8_lossy(&help.stdout);
        for want in [
            "-i,   --id=",
            "-c,   --compute-mode=",
            "0/DEFAULT",
            "3/EXCLUSIVE_PROCESS",
        ] {
            assert!(help.contains(want), "{b:?} nvidia-smi -h lacks {want:?}:\n{help}");
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let root = us.root(Branch::R535, tessera_tests::nvidia::Layout::Distro);
    let args: Vec<std::ffi::OsString> = vec!["--host-root".into(), root.into(), "--exclusive-process".into()];
    let s = Running::start_with(dir.path(), "t4x2", &args);
    let card = &uuids("t4x2")[0];
    s.wait("the refusal recorded", Duration::from_secs(30), |s| {
        s.state(card).and_then(|st| st.reason).is_some_and(|r| {
            r.contains("nvidia-smi -i")
                && r.contains("-c EXCLUSIVE_PROCESS")
                && r.contains("couldn't communicate with the NVIDIA driver")
        })
    });
    assert!(!s.ready(card));
    assert_eq!(
        lock_holder(&s.layout.pipe_dir(card)),
        None,
        "a daemon started on a card not exclusive"
    );
}
