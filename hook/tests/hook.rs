//! The hook preloaded into real processes that use a fake driver (built here with `cc`:
//! tests/c/fake_cuda.c as libcuda.so.1, tests/c/fake_nvml.c as libnvidia-ml.so.1) the two ways
//! programs reach the driver: linked against it, and dlopen + cuGetProcAddress as the CUDA
//! runtime does (tests/c/cuda_client.c built both ways).

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Output};

use common::{built, hook_lib};

/// The fake GPU's memory.
const GPU_MIB: u64 = 16384;

/// One container: a fake GPU and, when configured, the hook's config and shared state.
struct Container {
    dir: tempfile::TempDir,
    config: Option<String>,
    /// Another container's fake GPU, when both share one card.
    gpu: Option<PathBuf>,
    /// The state directory (default: `<dir>/state`).
    state_dir: Option<PathBuf>,
}

impl Container {
    fn new(config: Option<&str>) -> Self {
        Self {
            dir: tempfile::tempdir().unwrap(),
            config: config.map(str::to_string),
            gpu: None,
            state_dir: None,
        }
    }

    /// This container on `other`'s card.
    fn beside(mut self, other: &Container) -> Self {
        self.gpu = Some(other.dir.path().join("gpu"));
        self
    }

    fn limited(memory_mib: u64, core: Option<u32>) -> Self {
        let mut c = format!("uuid=GPU-00000000-0000-0000-0000-000000000001\nmemory_limit_mib={memory_mib}\n");
        if let Some(core) = core {
            c += &format!("core_limit={core}\n");
        }
        Self::new(Some(&c))
    }

    fn command(&self, client: &str, args: &[&str]) -> Command {
        let b = built();
        let gpu = self.gpu.clone().unwrap_or_else(|| self.dir.path().join("gpu"));
        let mut cmd = Command::new(b.lib_dir.join(client));
        cmd.args(args)
            .env("LD_LIBRARY_PATH", &b.lib_dir)
            .env("FAKE_GPU_STATE", &gpu)
            .env("FAKE_GPU_MEMORY_MIB", GPU_MIB.to_string())
            .env("LD_PRELOAD", hook_lib());
        if let Some(c) = &self.config {
            let path = self.dir.path().join("config");
            // As the NRI plugin does: the container's own host-pid socket.
            let state = self.state_dir.clone().unwrap_or_else(|| self.dir.path().join("state"));
            let c = format!(
                "{c}state_dir={}\npid_socket={}\n",
                state.display(),
                common::pid_socket().display()
            );
            // Atomically, as the NRI plugin writes it: a process of an earlier command of this
            // container may be reading it now.
            let tmp = path.with_extension(format!("tmp{}", std::process::id()));
            std::fs::write(&tmp, c).unwrap();
            std::fs::rename(&tmp, &path).unwrap();
            cmd.env("TESSERA_HOOK_CONFIG", path);
        }
        cmd
    }

    fn run(&self, client: &str, args: &[&str]) -> (BTreeMap<String, String>, String) {
        let out: Output = self.command(client, args).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{client} {args:?}: {stdout}{stderr}");
        (
            stdout
                .lines()
                .flat_map(|l| l.split_whitespace())
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            stderr,
        )
    }
}

/// The number a client printed as `key=...` in `out`.
fn value(out: &str, key: &str) -> f64 {
    out.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
        .unwrap_or_else(|| panic!("no {key} in {out}"))
        .parse()
        .unwrap()
}

fn num(kv: &BTreeMap<String, String>, k: &str) -> f64 {
    kv.get(k).unwrap_or_else(|| panic!("no {k} in {kv:?}")).parse().unwrap()
}

const MIB: f64 = (1u64 << 20) as f64;

#[test]
fn memory_stops_at_the_share_for_linked_and_runtime_style_programs() {
    for client in ["client_linked", "client_dl"] {
        let c = Container::limited(4096, None);
        let (kv, _) = c.run(client, &["info"]);
        // The share is the card as the program sees it.
        assert_eq!(num(&kv, "total") / MIB, 4096.0, "{client}");
        assert_eq!(num(&kv, "devtotal") / MIB, 4096.0, "{client}");
        assert_eq!(num(&kv, "free") / MIB, 4096.0, "{client}");
        let (kv, _) = c.run(client, &["fill", "256"]);
        assert_eq!(num(&kv, "allocated_mib"), 4096.0, "{client}: {kv:?}");
        assert_eq!(num(&kv, "free_after_mib"), 4096.0, "{client}: frees give it back");
    }
}

#[test]
fn the_limit_holds_across_threads_and_processes() {
    let c = Container::limited(4096, None);
    let (kv, _) = c.run("client_dl", &["threads", "8", "64"]);
    assert_eq!(num(&kv, "allocated_mib"), 4096.0, "{kv:?}");
    // Two processes of the container fill at once and hold: together they get the share.
    let spawn = |client: &str| {
        c.command(client, &["fill", "128", "1500"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (spawn("client_linked"), spawn("client_dl"));
    let outs: Vec<Output> = [a, b].into_iter().map(|p| p.wait_with_output().unwrap()).collect();
    let got: Vec<f64> = outs
        .iter()
        .map(|o| {
            let s = String::from_utf8_lossy(&o.stdout);
            value(&s, "allocated_mib")
        })
        .collect();
    // Both held at once: what one got, the other could not.
    assert_eq!(got.iter().sum::<f64>(), 4096.0, "{got:?}");
    // A process killed while holding memory does not keep it.
    let mut held = c
        .command("client_dl", &["fill", "512", "60000"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(500));
    held.kill().unwrap();
    held.wait().unwrap();
    let (kv, _) = c.run("client_linked", &["fill", "256"]);
    assert_eq!(num(&kv, "allocated_mib"), 4096.0, "a dead process's memory came back");
}

#[test]
fn every_allocation_kind_is_counted_and_freed() {
    let c = Container::limited(4096, None);
    let (kv, _) = c.run("client_dl", &["kinds"]);
    for kind in ["alloc", "pitch", "managed", "async", "pool", "vmm", "array", "array3d"] {
        assert_eq!(kv[kind], "0", "{kind} failed: {kv:?}");
    }
    // Each allocation of about 1 MiB shows in cuMemGetInfo, and all of it goes when freed.
    let out = c.command("client_dl", &["kinds"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let used: Vec<f64> = text
        .lines()
        .filter_map(|l| l.split_once(" used=").map(|(_, u)| u.parse::<f64>().unwrap() / MIB))
        .collect();
    assert_eq!(used, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], "{text}");
    assert!(text.contains("after_free=0"), "{text}");
    // Counted against the limit: a 4 GiB share with 8 MiB held allocates 4088 more.
    let (kv, _) = c.run("client_linked", &["fill", "8"]);
    assert_eq!(num(&kv, "allocated_mib"), 4096.0);
}

#[test]
fn without_a_configuration_calls_pass_through_and_a_broken_one_refuses() {
    // No configuration: the whole fake card.
    let c = Container::new(None);
    let (kv, stderr) = c.run("client_dl", &["fill", "1024"]);
    assert_eq!(num(&kv, "allocated_mib"), GPU_MIB as f64);
    assert!(stderr.is_empty(), "{stderr}");
    // A broken one: no memory (not the whole card), said once.
    let c = Container::new(Some("uuid=GPU-1\nmemory_limit_mib=lots\n"));
    let (kv, stderr) = c.run("client_linked", &["fill", "1024"]);
    assert_eq!(num(&kv, "allocated_mib"), 0.0);
    assert_eq!(stderr.matches("tessera-cuda-hook:").count(), 1, "{stderr}");
    assert!(
        stderr.contains("memory_limit_mib=\"lots\"") && stderr.contains("refusing"),
        "{stderr}"
    );
}

#[test]
fn legacy_entry_points_are_not_wrapped() {
    // cuGetProcAddress for a pre-3.2 version gives the 32-bit cuMemAlloc: another signature,
    // handed out untouched (so also not limited).
    let c = Container::limited(1024, None);
    let (kv, _) = c.run("client_dl", &["legacy", "2048"]);
    assert_eq!(kv["legacy"], "0");
}

#[test]
fn launches_are_throttled_to_the_compute_share() {
    // Unhooked, the loop keeps the fake GPU busy.
    let free = Container::new(None);
    let (kv, _) = free.run("client_dl", &["launch", "2000", "100"]);
    assert!(num(&kv, "busy_percent") > 85.0, "{kv:?}");
    for (client, core) in [("client_dl", 30u32), ("client_linked", 60)] {
        let c = Container::limited(4096, Some(core));
        let (kv, _) = c.run(client, &["launch", "4000", "100"]);
        let busy = num(&kv, "busy_percent");
        assert!((busy - f64::from(core)).abs() <= 10.0, "{client} at {core}%: {busy}");
    }
}

/// Two busy processes of one 40% share: the container's figure is the newest NVML sample of
/// each of its processes (sampled on phases of their own), not only the ones a reading brings;
/// summing those, each process read its own and the two took 81% together.
#[test]
fn two_processes_of_a_share_together_stay_near_it() {
    let c = Container::limited(4096, Some(40));
    let procs: Vec<_> = ["client_dl", "client_linked"]
        .iter()
        .map(|cl| {
            c.command(cl, &["launch", "5000", "100"])
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let busy: Vec<f64> = procs
        .into_iter()
        .map(|p| {
            let o = p.wait_with_output().unwrap();
            let s = String::from_utf8_lossy(&o.stdout).into_owned();
            value(&s, "busy_percent")
        })
        .collect();
    let sum: f64 = busy.iter().sum();
    assert!((sum - 40.0).abs() <= 12.0, "together {sum}% ({busy:?})");
}

/// The busy shares two containers of `shares` on one card reach, busy at once from their
/// start. Context creation is slow (as on a real GPU): each process learns its pid from its
/// own socket, waiting for nothing the other container holds.
fn busy_beside(shares: [u32; 2]) -> (f64, f64) {
    let a = Container::limited(4096, Some(shares[0]));
    let b = Container::limited(4096, Some(shares[1])).beside(&a);
    busy_together(&a, &b, &[])
}

/// The busy shares containers `a` and `b` (on one card) reach, busy at once from their start,
/// with `env` set for both.
fn busy_together(a: &Container, b: &Container, env: &[(&str, &str)]) -> (f64, f64) {
    let run = |c: &Container| {
        c.command("client_dl", &["launch", "6000", blocks(env)])
            .env("FAKE_CTX_DELAY_MS", "200")
            .envs(env.iter().copied())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (pa, pb) = (run(a), run(b));
    let busy = |p: std::process::Child| -> f64 {
        let s = String::from_utf8_lossy(&p.wait_with_output().unwrap().stdout).into_owned();
        value(&s, "busy_percent")
    };
    (busy(pa), busy(pb))
}

/// Blocks per launch: 1 ms kernels with 5 ms queued ahead where `env` says so (a client starved
/// of CPU on a loaded machine still keeps the card busy), else 0.1 ms ones.
fn blocks(env: &[(&str, &str)]) -> &'static str {
    if env.contains(&WINDOWS_LOAD[0]) { "1000" } else { "100" }
}

/// What the window tests run with: NVML counting waits as an H100's under time-slicing, and 5
/// ms of work queued ahead at most.
const WINDOWS_LOAD: [(&str, &str); 2] = [("FAKE_QUEUE_MS", "5"), ("FAKE_NVML_TIMESLICED", "1")];

/// A share's configuration on a hook node, held by `compute` (`window` when in windows).
fn hook_share(core: u32, compute: &str, window: Option<&str>) -> String {
    let mut c = format!(
        "uuid=GPU-00000000-0000-0000-0000-000000000001\nmemory_limit_mib=4096\ncore_limit={core}\ncompute={compute}\n"
    );
    if let Some(w) = window {
        c += &format!("window={w}\nperiod_ms=50\n");
    }
    c
}

/// Two busy containers of 50% and 30% of one card, NVML counting a process's waits behind
/// the other's work as its use (as an H100 with driver 580 does under time-slicing). Held at
/// their readings, each gets less than its share (on the H100 two 50% shares got 0.18x to 0.33x
/// each). In windows of the card's time that do not overlap, as the NRI plugin gives them, each
/// gets its share, and a 30% share alone its 30%.
#[test]
fn co_tenants_in_windows_of_the_card_s_time_get_their_shares() {
    let timesliced = WINDOWS_LOAD;
    let a = Container::new(Some(&hook_share(50, "throttle", None)));
    let b = Container::new(Some(&hook_share(30, "throttle", None))).beside(&a);
    let (ta, tb) = busy_together(&a, &b, &timesliced);
    eprintln!("held at their readings: 50% share {ta}%, 30% share {tb}%");
    assert!(ta + tb < 76.0, "held at their readings: {ta}% and {tb}% of 80% sold");

    let a = Container::new(Some(&hook_share(50, "windows", Some("30-80"))));
    let b = Container::new(Some(&hook_share(30, "windows", Some("0-30")))).beside(&a);
    let (wa, wb) = busy_together(&a, &b, &timesliced);
    eprintln!("in windows: 50% share {wa}%, 30% share {wb}%");
    // The ceiling is the point; below it a loaded machine's scheduling costs a little.
    assert!(
        (43.0..=55.0).contains(&wa) && (24.0..=35.0).contains(&wb),
        "in windows: {wa}% and {wb}% (held at their readings: {ta}% and {tb}%)"
    );

    let alone = Container::new(Some(&hook_share(30, "windows", Some("20-50"))));
    let out = alone
        .command("client_dl", &["launch", "3000", "1000"])
        .envs(WINDOWS_LOAD)
        .output()
        .unwrap();
    let busy = value(&String::from_utf8_lossy(&out.stdout), "busy_percent");
    eprintln!("a 30% share alone in its window: {busy}%");
    assert!(
        (24.0..=34.0).contains(&busy),
        "a 30% share alone in its window: {busy}%"
    );
}

/// Three processes of one 30% share in its window hold about 30% of the card together: the
/// window is the container's, whatever its processes.
#[test]
fn three_processes_in_a_window_together_stay_near_it() {
    let c = Container::new(Some(&hook_share(30, "windows", Some("0-30"))));
    let procs: Vec<_> = ["client_dl", "client_linked", "client_dl"]
        .iter()
        .map(|cl| {
            c.command(cl, &["launch", "4000", "1000"])
                .envs(WINDOWS_LOAD)
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let each: Vec<f64> = procs
        .into_iter()
        .map(|p| {
            value(
                &String::from_utf8_lossy(&p.wait_with_output().unwrap().stdout),
                "busy_percent",
            )
        })
        .collect();
    let sum: f64 = each.iter().sum();
    eprintln!("three processes of a 30% share in its window: {sum:.1}% together ({each:?})");
    // The ceiling is the point; below it a loaded machine's scheduling costs a little.
    assert!((20.0..=35.0).contains(&sum), "together {sum:.1}% ({each:?})");
    assert!(each.iter().all(|b| *b >= 3.0), "each runs in the window: {each:?}");
}

/// Two containers with different shares on one card: each measures its own processes'
/// utilization (its host pids, found when its context was created), not the card's, so each
/// settles at its own share. Taking the card's utilization instead would have both chase the
/// sum.
#[test]
fn two_containers_on_one_card_each_get_their_own_share() {
    let (ba, bb) = busy_beside([25, 50]);
    assert!(
        (ba - 25.0).abs() <= 10.0 && (bb - 50.0).abs() <= 12.0,
        "25% share: {ba}, 50% share: {bb}"
    );
}

/// Two busy containers of 50% and 20% of one card: NVML samples each process on a phase of
/// its own (the fake as the H100 with driver 580 does), so a container's reading often holds
/// the other's newer sample and none of its own. That is no news, not an idle container: read
/// as 0%, it raised the rate every other step, and each share settled about a fifth above
/// itself (on the H100 two 50% shares read 60-62% each, and one reached 0.64x of the card).
#[test]
fn a_co_tenant_s_samples_do_not_lift_a_container_above_its_share() {
    let (ba, bb) = busy_beside([50, 20]);
    assert!(
        (40.0..=55.0).contains(&ba) && (12.0..=24.0).contains(&bb),
        "50% share: {ba}, 20% share: {bb}"
    );
}

/// What `clients` of one container, launching at once under the fake MPS card (each process
/// at `percent` of the SMs, 100 ms of work queued ahead at most), have the card do together:
/// its busy share over 2 s, from 1.5 s after they start (read off the card at both ends, so
/// every process is counted over the same window), and each process's own share over the
/// second half of its run.
fn busy_under_mps(c: &Container, clients: &[&str], percent: u32) -> (f64, Vec<f64>) {
    let env = |mut cmd: Command| {
        cmd.env("FAKE_MPS", "1")
            .env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", percent.to_string())
            .env("FAKE_QUEUE_MS", "100")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        cmd
    };
    let procs: Vec<_> = clients
        .iter()
        .map(|cl| env(c.command(cl, &["launch", "4000", "100"])).spawn().unwrap())
        .collect();
    let work = || {
        let o = env(c.command("client_dl", &["work"])).output().unwrap();
        let s = String::from_utf8_lossy(&o.stdout).into_owned();
        (value(&s, "work_ns"), value(&s, "at_ns"))
    };
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let (w1, t1) = work();
    std::thread::sleep(std::time::Duration::from_millis(2000));
    let (w2, t2) = work();
    let each = procs
        .into_iter()
        .map(|p| {
            let o = p.wait_with_output().unwrap();
            let s = String::from_utf8_lossy(&o.stdout).into_owned();
            assert!(o.status.success(), "{s}{}", String::from_utf8_lossy(&o.stderr));
            value(&s, "busy_percent")
        })
        .collect();
    (100.0 * (w2 - w1) / (t2 - t1), each)
}

/// On MPS nodes MPS holds each process of a 30% share to 30% of the SMs, so three busy
/// processes of one container take 90% of the card between them (the fake card serves them
/// side by side, as MPS does), and the hook's throttle cannot see them. With `compute=turns`,
/// as the NRI plugin configures MPS shares,
/// they take turns, each one's queued work drained before the next one's turn, and hold about
/// 30% together; one process alone still gets its 30%.
#[test]
fn three_processes_of_an_mps_share_together_stay_near_it() {
    // Without turns the hook's throttle would read the container's utilization from NVML,
    // which (on the fake card as on an H100 with driver 580) gives MPS clients' SM use to the
    // server: it sees nothing to hold back, and MPS's per-process cap is all there is.
    let config = |compute: &str| {
        format!(
            "uuid=GPU-00000000-0000-0000-0000-000000000001\nmemory_limit_mib=4096\ncore_limit=30\ncompute={compute}\n"
        )
    };
    let three = ["client_dl", "client_linked", "client_dl"];
    let (sum, each) = busy_under_mps(&Container::new(Some(&config("throttle"))), &three, 30);
    assert!(sum > 75.0, "MPS and a blind throttle: together {sum:.1}% ({each:?})");

    let (sum, each) = busy_under_mps(&Container::new(Some(&config("turns"))), &three, 30);
    // The ceiling is the point; below it, handovers cost a little and a loaded machine's
    // scheduling more (a waiting process that is not scheduled leaves the card idle).
    assert!(sum <= 33.0, "taking turns: together {sum:.1}% ({each:?})");
    assert!(sum >= 20.0, "taking turns: together only {sum:.1}% ({each:?})");
    assert!(each.iter().all(|b| *b >= 2.0), "each gets turns: {each:?}");

    let (alone, _) = busy_under_mps(&Container::new(Some(&config("turns"))), &["client_dl"], 30);
    assert!(
        (alone - 30.0).abs() <= 3.0,
        "one process alone keeps its share: {alone:.1}%"
    );
}

/// A process that captures a stream into a graph (PyTorch's CUDA graphs, `torch.compile`) keeps
/// its turn until the capture ends: a handover's synchronisation in the middle would make the
/// driver invalidate the capture (the fake does as the real one does). Here it captures for
/// 400 ms, idle, while another process of the container waits to launch.
#[test]
fn a_capture_in_progress_keeps_its_turn() {
    let c = Container::new(Some(
        "uuid=GPU-00000000-0000-0000-0000-000000000001\nmemory_limit_mib=4096\ncore_limit=30\ncompute=turns\n",
    ));
    let mps = |mut cmd: Command| {
        cmd.env("FAKE_MPS", "1")
            .env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "30")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        cmd
    };
    let busy = mps(c.command("client_dl", &["launch", "1500", "100"])).spawn().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(200));
    for client in ["client_dl", "client_linked"] {
        let out = mps(c.command(client, &["capture", "400"])).output().unwrap();
        let s = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(s.lines().any(|l| l == "begin_capture=0"), "{client}: {s}");
        assert!(
            s.lines().any(|l| l == "capture=0"),
            "{client}: the capture was broken: {s}"
        );
    }
    let o = busy.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// Every process of a container is held to its share whatever its user: the accounting lives in
/// the container's own tmpfs (mode 1777, as the NRI plugin mounts it), and the container's first
/// process, whatever its user and umask, makes the file open to all (before, it made it for its
/// own user alone, and another user's process was refused or, earlier still, unlimited). And a
/// limit whose accounting cannot be opened refuses instead of passing through.
#[test]
fn a_process_of_another_user_is_held_to_the_share_too() {
    use std::os::unix::fs::PermissionsExt as _;
    use std::os::unix::process::CommandExt as _;
    use tessera_core::enforcement::HOOK_ACCOUNTING_FILE;
    let open =
        |p: &std::path::Path, mode: u32| std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    let mut c = Container::limited(4096, None);
    // What the test's processes need to reach as uid 65534, as in a container.
    open(c.dir.path(), 0o777);
    open(&built().lib_dir, 0o755);
    let gpu = c.dir.path().join("gpu");
    std::fs::write(&gpu, b"").unwrap();
    open(&gpu, 0o666);
    // As the NRI plugin mounts it: an empty directory open to all, sticky.
    let state = c.dir.path().join("state");
    std::fs::create_dir(&state).unwrap();
    open(&state, 0o1777);
    c.state_dir = Some(state.clone());
    // Root holds 3 GiB; a process of uid 65534 then fills: it gets the last GiB, no more.
    let mut root = c
        .command("client_dl", &["fill", "3072", "3000"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(500));
    let other = |c: &Container| {
        let out = c
            .command("client_linked", &["fill", "256"])
            .uid(65534)
            .gid(65534)
            .output()
            .unwrap();
        (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (stdout, stderr) = other(&c);
    assert!(stdout.contains("allocated_mib=1024"), "{stdout}{stderr}");
    assert!(!stderr.contains("unavailable"), "{stderr}");
    root.kill().unwrap();
    root.wait().unwrap();
    // An accounting file the process cannot open (made by another user, 0644): refused.
    let memory = state.join(HOOK_ACCOUNTING_FILE);
    assert_eq!(std::fs::metadata(&memory).unwrap().permissions().mode() & 0o777, 0o666);
    open(&memory, 0o644);
    let (stdout, stderr) = other(&c);
    assert!(stdout.contains("allocated_mib=0"), "{stdout}{stderr}");
    assert!(stderr.contains("refusing GPU memory allocations"), "{stderr}");
}

/// `dlsym(RTLD_NEXT, ...)` from a library preloaded after the hook still means "after that
/// library": LLVM's real OpenMP runtime (Debian's libomp5, which hung here before) starts and
/// answers, and an interposer of `puts` reaches libc's.
#[test]
fn rtld_next_lookups_stay_relative_to_their_caller() {
    use std::time::Duration;
    let u = tessera_tests::nvidia::Userspace::get().unwrap();
    let omp_dir = u.libomp5().join("usr/lib/llvm-14/lib");
    let dir = tempfile::tempdir().unwrap();
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c");
    let out = |n: &str| dir.path().join(n).display().to_string();
    let cc = |args: &[&str]| {
        let st = Command::new("cc").args(args).status().unwrap();
        assert!(st.success(), "cc {args:?}");
    };
    cc(&[
        "-O2",
        "-o",
        &out("omp_probe"),
        src.join("omp_probe.c").to_str().unwrap(),
        &format!("-L{}", omp_dir.display()),
        "-l:libomp.so.5",
    ]);
    cc(&[
        "-O2",
        "-shared",
        "-fPIC",
        "-o",
        &out("libnext.so"),
        src.join("next_interposer.c").to_str().unwrap(),
    ]);
    cc(&[
        "-O2",
        "-o",
        &out("next_main"),
        src.join("next_main.c").to_str().unwrap(),
    ]);
    // Bounded: the bug was a hang.
    let run = |cmd: &mut Command| {
        let mut child = cmd
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while child.try_wait().unwrap().is_none() {
            if std::time::Instant::now() > deadline {
                child.kill().unwrap();
                panic!("{cmd:?} hung");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let o = child.wait_with_output().unwrap();
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr),
        )
    };
    let (ok, text) = run(Command::new(out("omp_probe"))
        .env("LD_LIBRARY_PATH", &omp_dir)
        .env("LD_PRELOAD", hook_lib()));
    assert!(ok && text.starts_with("omp_max_threads="), "{text}");
    let preload = format!("{} {}", hook_lib().display(), out("libnext.so"));
    let (ok, text) = run(Command::new(out("next_main")).env("LD_PRELOAD", &preload));
    assert!(ok && text == "interposed: hello\n", "{text}");
}

/// Virtual memory management as ggml-cuda (llama.cpp, Ollama) uses it: `cuMemRelease` right after
/// `cuMemMap`. The driver keeps the memory until the last unmap (the fake does too, checked
/// without the hook), and so does the hook's count: it is not given back at the release.
#[test]
fn vmm_memory_released_while_mapped_stays_counted_until_unmapped() {
    let field = |kv: &BTreeMap<String, String>, k: &str| num(kv, k);
    let (kv, _) = Container::new(None).run("client_dl", &["vmm", "1024"]);
    assert_eq!(
        (field(&kv, "released_used_mib"), field(&kv, "unmapped_used_mib")),
        (1024.0, 0.0),
        "the fake driver: {kv:?}"
    );
    for client in ["client_linked", "client_dl"] {
        let c = Container::limited(4096, None);
        let (kv, _) = c.run(client, &["vmm", "1024"]);
        assert_eq!(num(&kv, "release"), 0.0, "{client}: {kv:?}");
        assert_eq!(
            (field(&kv, "released_used_mib"), field(&kv, "unmapped_used_mib")),
            (1024.0, 0.0),
            "{client}: {kv:?}"
        );
    }
}

/// A process's context holds device memory of its own (527 MiB for a CUDA 13 context on an
/// H100): the hook charges the process what the driver (NVML) says it holds beyond what it
/// counted, so a share's processes together stay within the share on the card, not only in
/// the hook's books. The fake's contexts hold 500 MiB here.
#[test]
fn a_context_s_own_memory_is_charged_to_the_share() {
    let c = Container::limited(4096, None);
    for client in ["client_linked", "client_dl"] {
        let out = c
            .command(client, &["fill", "4"])
            .env("FAKE_CTX_MIB", "500")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{text}");
        let allocated: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix("allocated_mib="))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{text}"));
        assert_eq!(allocated, 4096.0 - 500.0, "{client}: {text}");
    }
}

/// NVML names a sampled process by its pid in the *querying* process's pid namespace (driver 580
/// on an H100: a container's process is sampled under its container pid, not the host pid its
/// node agent answers), and the fake NVML answers so for a client in a pid namespace of its own.
/// The hook matches both, so a container's launches are throttled whichever a driver uses.
#[test]
fn launches_in_a_pid_namespace_are_throttled_too() {
    let c = Container::limited(4096, Some(30));
    let cmd = c.command("client_dl", &["launch", "4000", "100"]);
    let mut unshared = Command::new("unshare");
    unshared
        .args(["--pid", "--fork", "--kill-child"])
        .arg(cmd.get_program())
        .args(cmd.get_args());
    for (k, v) in cmd.get_envs() {
        if let Some(v) = v {
            unshared.env(k, v);
        }
    }
    let out = unshared.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    let busy: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("busy_percent="))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{text}"));
    assert!((busy - 30.0).abs() <= 10.0, "in its own pid namespace at 30%: {busy}");
}

/// Stream-ordered pools keep what is freed into them up to their release threshold (TensorFlow's
/// `cuda_malloc_async`, RAPIDS and PyTorch's `cudaMallocAsync` backend set it to the most), as the
/// driver does and the fake does (checked without the hook): the hook charges a pool what it
/// holds, so memory kept there is not admitted a second time beside it, and gives it back when
/// the pool does (a synchronisation with threshold 0, a trim).
#[test]
fn a_pool_is_charged_what_it_holds_until_it_gives_it_back() {
    let (kept, _) = Container::new(None).run("client_dl", &["pool", "3000", "keep"]);
    let (released, _) = Container::new(None).run("client_dl", &["pool", "3000", "release"]);
    assert_eq!(
        (num(&kept, "held_mib"), num(&released, "held_mib")),
        (3000.0, 0.0),
        "the fake driver: {kept:?} {released:?}"
    );
    for client in ["client_linked", "client_dl"] {
        let c = Container::limited(4096, None);
        let (kv, _) = c.run(client, &["pool", "3000", "keep"]);
        assert_eq!(
            (num(&kv, "async"), num(&kv, "held_mib"), num(&kv, "beside")),
            (0.0, 3000.0, 2.0),
            "{client}: 3000 MiB kept in the pool and 3000 more beside it in a 4096 MiB share: {kv:?}"
        );
        assert_eq!(
            (num(&kv, "trimmed_beside"), num(&kv, "used_after_mib")),
            (0.0, 0.0),
            "{client}: trimmed, the pool's memory is the share's again: {kv:?}"
        );
        let (kv, _) = c.run(client, &["pool", "3000", "release"]);
        assert_eq!(
            (num(&kv, "held_mib"), num(&kv, "beside")),
            (0.0, 0.0),
            "{client}: given back at the sync: {kv:?}"
        );
    }
}

/// `cuCtxCreate` looked up as CUDA 11.4+ runtimes do resolves to `cuCtxCreate_v3` (so the real
/// 535 libcuda answers, and the fake as it): the hook hands out its own, so such processes are
/// seen creating contexts (host-pid discovery).
#[test]
fn cu_ctx_create_at_cuda_12_is_hooked() {
    let c = Container::limited(4096, Some(50));
    for client in ["client_dl", "client_linked"] {
        let (kv, _) = c.run(client, &["ctx"]);
        assert_eq!(kv.get("ctx").map(String::as_str), Some("0"), "{client}: {kv:?}");
        let from = kv.get("ctx_from").cloned().unwrap_or_default();
        assert!(from.starts_with("libtessera_cuda_hook"), "{client}: {kv:?}");
    }
}
