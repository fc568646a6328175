//! The fake `nvidia-cuda-mps-control` (tests/fixtures, used only where the real one cannot be
//! had: the GPU end-to-end dry run, the agent memory script) checked against NVIDIA's real one
//! (535, `tests/nvidia/fetch.sh`): the same observations of both, point by point.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::os::unix::fs::{FileTypeExt as _, PermissionsExt as _};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tessera_tests::nvidia::{Branch, Userspace};

/// What one control program does, as a client and an operator see it.
#[derive(Debug, PartialEq, Eq)]
struct Observed {
    /// The pipe directory while the daemon runs: name -> (type, mode).
    pipe_dir: BTreeMap<String, (char, u32)>,
    /// And after it quit: names.
    left_behind: Vec<String>,
    /// `-f` writes its log on stdout, with lines like this (timestamps and pids cut).
    logs_start_on_stdout: bool,
    /// Files in the log directory after a run.
    log_dir: Vec<String>,
    /// Command -> (stdout, stderr, exit code), as root unless said.
    answers: BTreeMap<String, (String, String, i32)>,
    /// A second daemon on the same pipe directory: (stdout, exit code).
    second: (String, i32),
    /// A client of a stopped daemon is still waiting after a second.
    client_blocks_on_a_hung_daemon: bool,
    /// `quit`: the daemon's exit code.
    quit_exit: i32,
}

fn client(control: &Path, pipe: &Path, cmd: &str, uid: Option<u32>) -> (String, String, i32) {
    let mut c = Command::new(control);
    c.env("CUDA_MPS_PIPE_DIRECTORY", pipe)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(uid) = uid {
        c.uid(uid).gid(uid);
    }
    let mut child = c.spawn().unwrap();
    writeln!(child.stdin.take().unwrap(), "{cmd}").unwrap();
    let out = child.wait_with_output().unwrap();
    (
        String::from_utf8_lossy(&out.stdout).trim().to_string(),
        String::from_utf8_lossy(&out.stderr).trim().to_string(),
        out.status.code().unwrap_or(-1),
    )
}

fn daemon(control: &Path, pipe: &Path, logs: &Path) -> Child {
    Command::new(control)
        .arg("-f")
        .env("CUDA_MPS_PIPE_DIRECTORY", pipe)
        .env("CUDA_MPS_LOG_DIRECTORY", logs)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

fn wait_for(what: &str, f: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn observe(control: &Path) -> Observed {
    let dir = tempfile::tempdir().unwrap();
    let (pipe, logs) = (dir.path().join("pipe"), dir.path().join("log"));
    for d in [dir.path(), &pipe, &logs] {
        std::fs::create_dir_all(d).unwrap();
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let mut d = daemon(control, &pipe, &logs);
    wait_for("the control socket", || pipe.join("control").exists());
    let mut answers = BTreeMap::new();
    // Root and nobody; the unknown command is answered on stdout with exit 0.
    for (cmd, uid) in [
        ("get_default_active_thread_percentage", None),
        ("get_server_list", None),
        ("bogus", None),
        ("set_default_active_thread_percentage 10", Some(65534)),
        ("get_default_active_thread_percentage", Some(65534)),
        ("quit", Some(65534)),
        ("get_default_device_pinned_mem_limit 0", None),
        ("set_default_device_pinned_mem_limit 0 1536M", None),
        ("get_default_device_pinned_mem_limit 0 (1536M)", None),
        ("set_default_device_pinned_mem_limit 0 8G", None),
        ("get_default_device_pinned_mem_limit 0 (8G)", None),
        ("set_default_device_pinned_mem_limit 0 0", None),
        ("get_default_device_pinned_mem_limit 0 (cleared)", None),
        ("set_active_thread_percentage 4242 20", None),
        ("set_device_pinned_mem_limit 4242 0 2G", None),
        // Any client sets the default client priority (the supervisor puts it back).
        ("get_default_client_priority", None),
        ("set_default_client_priority 1", Some(65534)),
        ("get_default_client_priority (1)", None),
        ("set_default_client_priority 2", None),
        ("get_default_client_priority (after 2)", None),
        ("set_default_client_priority 0x", None),
        ("get_default_client_priority (0)", None),
    ] {
        // Repeated queries are told apart by a note in brackets, not sent.
        let sent = cmd.split(" (").next().unwrap();
        let key = format!("{cmd}{}", uid.map(|u| format!(" (uid {u})")).unwrap_or_default());
        answers.insert(key, client(control, &pipe, sent, uid));
    }
    // Root, given only the control socket (as share containers are): quit is refused.
    let only_control = dir.path().join("client");
    std::fs::create_dir(&only_control).unwrap();
    std::fs::hard_link(pipe.join("control"), only_control.join("control")).unwrap();
    answers.insert(
        "quit (root, control only)".into(),
        client(control, &only_control, "quit", None),
    );
    let pipe_dir = std::fs::read_dir(&pipe)
        .unwrap()
        .flatten()
        .map(|e| {
            let m = e.metadata().unwrap();
            let t = m.file_type();
            let kind = if t.is_socket() {
                's'
            } else if t.is_fifo() {
                'p'
            } else {
                'f'
            };
            (
                e.file_name().to_string_lossy().into_owned(),
                (kind, m.permissions().mode() & 0o777),
            )
        })
        .collect();
    let second = Command::new(control)
        .arg("-f")
        .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
        .env("CUDA_MPS_LOG_DIRECTORY", &logs)
        .stderr(Stdio::null())
        .output()
        .unwrap();
    let second = (
        String::from_utf8_lossy(&second.stdout).trim().to_string(),
        second.status.code().unwrap_or(-1),
    );
    // Hung: stopped, a client waits.
    let pid = Pid::from_raw(d.id() as i32);
    kill(pid, Signal::SIGSTOP).unwrap();
    let mut waiting = Command::new(control)
        .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    writeln!(waiting.stdin.take().unwrap(), "get_server_list").unwrap();
    std::thread::sleep(Duration::from_secs(1));
    let client_blocks_on_a_hung_daemon = waiting.try_wait().unwrap().is_none();
    kill(pid, Signal::SIGCONT).unwrap();
    waiting.wait().unwrap();
    // quit as root.
    answers.insert("quit".into(), client(control, &pipe, "quit", None));
    let quit_exit = d.wait().unwrap().code().unwrap_or(-1);
    let mut out = String::new();
    std::io::Read::read_to_string(d.stdout.as_mut().unwrap(), &mut out).unwrap();
    let logs_start_on_stdout = out.lines().next().is_some_and(|l| {
        l.starts_with('[') && l.contains(" Control ") && l.contains("] Starting control daemon using socket ")
    }) && out.lines().any(|l| l.ends_with("] Cmd:bogus"))
        && out.lines().any(|l| l.ends_with("] Unknown command \"bogus\""));
    Observed {
        pipe_dir,
        left_behind: names(&pipe),
        logs_start_on_stdout,
        log_dir: names(&logs),
        answers,
        second,
        client_blocks_on_a_hung_daemon,
        quit_exit,
    }
}

#[test]
fn the_fake_control_daemon_behaves_as_the_real_one() {
    let real = observe(&Userspace::get().unwrap().mps_control(Branch::R535));
    let fake = observe(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/fake-mps-control"));
    println!("{real:#?}");
    // What the real daemon does, stated here so that a change of either shows.
    assert_eq!(real.second, ("An instance of this daemon is already running".into(), 1));
    assert_eq!(
        real.answers["bogus"],
        ("Unknown command \"bogus\"".into(), String::new(), 0)
    );
    assert_eq!(
        real.answers["quit (uid 65534)"].0,
        "Not enough privilege to execute quit command"
    );
    // The daemon's privilege is the socket: root with `control` alone cannot quit it.
    assert_eq!(
        real.answers["quit (root, control only)"].0,
        "Not enough privilege to execute quit command"
    );
    assert_eq!(real.answers["get_default_client_priority (1)"].0, "1");
    assert_eq!(
        real.answers["set_default_client_priority 2"].0,
        "Invalid priority value - must be 0 or 1!"
    );
    assert!(real.client_blocks_on_a_hung_daemon && real.logs_start_on_stdout);
    assert_eq!(fake, real);
}
