//! The supervisor with a fake `nvidia-cuda-mps-control` (no GPU): a daemon per card that can
//! host shares, each with its own /dev/shm; a killed daemon restarted; a daemon that cannot
//! start retried with backoff; a clean stop on SIGTERM; `status` as the readiness probe.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tessera_core::enforcement::{DaemonPhase, MpsLayout, MpsState};
use tessera_core::inventory::{FixtureSource, InventorySource};

const BIN: &str = env!("CARGO_BIN_EXE_tessera-mps-supervisor");

fn fake() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/fake-mps-control")
}

struct Running {
    child: Child,
    layout: MpsLayout,
    log: PathBuf,
}

impl Running {
    fn start(root: &Path, fixture: &str) -> Self {
        let log = root.join("supervisor.log");
        let layout = MpsLayout::new(root.join("mps"));
        let child = Command::new(BIN)
            .args([
                "run",
                "--fixture",
                fixture,
                "--check-secs",
                "1",
                "--backoff-ms",
                "200",
                "--control-binary",
            ])
            .arg(fake())
            .arg("--mps-root")
            .arg(&layout.root)
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

    fn wait(&self, what: &str, mut f: impl FnMut(&Self) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !f(self) {
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn ready(&self, uuid: &str) -> bool {
        self.state(uuid).is_some_and(|s| s.phase == DaemonPhase::Ready)
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

    fn terminate(mut self) -> (std::process::ExitStatus, String) {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        let status = self.child.wait().unwrap();
        (status, self.log())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        // SIGTERM first: the supervisor stops its daemons (a SIGKILL would orphan them).
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while self.child.try_wait().ok().flatten().is_none() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
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

#[test]
fn a_daemon_per_card_restarted_when_it_dies_and_stopped_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let s = Running::start(dir.path(), "t4x2");
    let cards = uuids("t4x2");
    s.wait("both daemons ready", |s| cards.iter().all(|u| s.ready(u)));
    let (code, text) = s.status();
    assert_eq!(code, 0, "{text}");
    assert_eq!(text.lines().count(), 2, "{text}");

    // Each daemon had its card's shm directory as /dev/shm, and only that.
    for u in &cards {
        let seen = std::fs::read_to_string(s.layout.shm_dir(u).join("tessera-fake-mps")).unwrap();
        assert_eq!(seen.trim(), u);
        let st = s.state(u).unwrap();
        assert_eq!((st.restarts, st.reason), (0, None));
    }
    assert!(
        !Path::new("/dev/shm/tessera-fake-mps").exists(),
        "the host's /dev/shm was used"
    );

    // Kill card 0's daemon: it is restarted, and ready again with a new pid.
    let before = s.state(&cards[0]).unwrap();
    let pid = before.pid.unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    s.wait("a restarted daemon", |s| {
        s.state(&cards[0])
            .is_some_and(|st| st.phase == DaemonPhase::Ready && st.restarts == 1 && st.pid != Some(pid))
    });
    assert!(s.log().contains("MPS daemon failed: restarting"), "{}", s.log());
    assert_eq!(s.state(&cards[1]).unwrap().restarts, 0, "the other card is untouched");

    // SIGTERM: every daemon is told to quit and recorded as stopped.
    let layout = s.layout.clone();
    let (status, log) = s.terminate();
    assert!(status.success(), "{log}");
    for u in &cards {
        let st = layout.read_state(u).unwrap();
        assert_eq!(st.phase, DaemonPhase::Stopped, "{log}");
        let quits = std::fs::read_to_string(layout.card_dir(u).join("quits")).unwrap();
        assert_eq!(quits.lines().count(), 1, "{u}: {log}");
    }
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
fn a_daemon_that_cannot_start_is_retried_with_backoff_and_mig_cards_get_none() {
    let dir = tempfile::tempdir().unwrap();
    let inv = FixtureSource::new("a100-mig").discover().unwrap();
    let (mig, whole): (Vec<_>, Vec<_>) = inv.gpus.iter().partition(|g| g.mig_enabled);
    assert!(!mig.is_empty() && whole.len() == 1);
    let card = &whole[0].uuid;
    let layout = MpsLayout::new(dir.path().join("mps"));
    std::fs::create_dir_all(layout.card_dir(card)).unwrap();
    std::fs::write(layout.card_dir(card).join("fail-start"), b"").unwrap();
    let s = Running::start(dir.path(), "a100-mig");
    s.wait("three failed starts", |s| {
        s.state(card).is_some_and(|st| st.restarts >= 3)
    });
    let st = s.state(card).unwrap();
    assert_eq!(st.phase, DaemonPhase::Restarting);
    assert!(
        st.reason.as_deref().unwrap().contains("exited while starting"),
        "{st:?}"
    );
    assert!(
        layout
            .ready(card, std::time::SystemTime::now())
            .unwrap_err()
            .contains("restarting")
    );
    // The delays grew: 200 ms, 400 ms, 800 ms...
    let delays: Vec<u64> = s
        .log()
        .lines()
        .filter_map(|l| l.split("delay_ms=").nth(1))
        .filter_map(|v| v.split_whitespace().next()?.parse().ok())
        .collect();
    assert!(delays.len() >= 3 && delays[..3] == [200, 400, 800], "{delays:?}");
    // Fixed: it comes up. MIG cards never got a daemon.
    std::fs::remove_file(layout.card_dir(card).join("fail-start")).unwrap();
    s.wait("the daemon up after the fix", |s| s.ready(card));
    for g in mig {
        assert!(s.state(&g.uuid).is_none(), "MIG card {} got a daemon", g.uuid);
    }
}

#[test]
fn a_daemon_that_stops_answering_is_restarted() {
    let dir = tempfile::tempdir().unwrap();
    let s = Running::start(dir.path(), "t4x2");
    let cards = uuids("t4x2");
    s.wait("ready", |s| cards.iter().all(|u| s.ready(u)));
    // The daemon lives on but no longer answers: after three missed checks it is replaced.
    std::fs::write(s.layout.card_dir(&cards[1]).join("hang"), b"").unwrap();
    s.wait("a restart", |s| s.state(&cards[1]).is_some_and(|st| st.restarts >= 1));
    let st = s.state(&cards[1]).unwrap();
    assert!(
        st.reason
            .as_deref()
            .is_some_and(|r| r.contains("did not answer") || r.contains("stopped answering")),
        "{st:?}"
    );
    std::fs::remove_file(s.layout.card_dir(&cards[1]).join("hang")).unwrap();
    s.wait("ready again", |s| s.ready(&cards[1]));
}
