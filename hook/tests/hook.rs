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
            s.lines()
                .find_map(|l| l.strip_prefix("allocated_mib="))
                .unwrap_or_else(|| panic!("{s}"))
                .parse()
                .unwrap()
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
            s.lines()
                .find_map(|l| l.strip_prefix("busy_percent="))
                .unwrap_or_else(|| panic!("{s}"))
                .parse()
                .unwrap()
        })
        .collect();
    let sum: f64 = busy.iter().sum();
    assert!((sum - 40.0).abs() <= 12.0, "together {sum}% ({busy:?})");
}

/// Two containers with different shares on one card: each measures its own processes'
/// utilization (its host pids, found when its context was created), not the card's, so each
/// settles at its own share. Taking the card's utilization instead would have both chase the
/// sum. Both start at once and context creation is slow (as on a real GPU): each process learns
/// its pid from its own socket, waiting for nothing the other container holds.
#[test]
fn two_containers_on_one_card_each_get_their_own_share() {
    let a = Container::limited(4096, Some(25));
    let b = Container::limited(4096, Some(50)).beside(&a);
    let run = |c: &Container| {
        c.command("client_dl", &["launch", "6000", "100"])
            .env("FAKE_CTX_DELAY_MS", "200")
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (pa, pb) = (run(&a), run(&b));
    let busy = |p: std::process::Child| -> f64 {
        let s = String::from_utf8_lossy(&p.wait_with_output().unwrap().stdout).into_owned();
        s.lines()
            .find_map(|l| l.strip_prefix("busy_percent="))
            .unwrap_or_else(|| panic!("{s}"))
            .parse()
            .unwrap()
    };
    let (ba, bb) = (busy(pa), busy(pb));
    assert!(
        (ba - 25.0).abs() <= 10.0 && (bb - 50.0).abs() <= 12.0,
        "25% share: {ba}, 50% share: {bb}"
    );
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
