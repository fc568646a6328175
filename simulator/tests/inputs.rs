//! A user's own trace cannot make the simulator eat the machine: each bad or unbounded input
//! is refused before any run, naming the file, the line and the field with its value; a
//! workload that cannot fit says so. Each run here has a deadline and a memory limit, so that
//! a refusal that is missing fails the test instead of hanging it or exhausting the machine.

use std::io::Read as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const NODES: &str = "sn,cpu_milli,memory_mib,gpu,model\n";
const PODS: &str = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n";

/// Runs the simulator with `args` under a deadline and a 2 GiB address-space limit; panics
/// (after ending it) when it runs past the deadline.
fn simulate(args: &[&str], deadline: Duration) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tessera-simulator"));
    cmd.args(args)
        .env("RUST_BACKTRACE", "0")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: 2 << 30,
                rlim_max: 2 << 30,
            };
            if libc::setrlimit(libc::RLIMIT_AS, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().unwrap();
    // Drain both pipes while waiting, so that a chatty child never blocks on a full pipe.
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out.read_to_end(&mut v);
        v
    });
    let err = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err.read_to_end(&mut v);
        v
    });
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > deadline {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("{args:?}: still running after {deadline:?}: no refusal");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    }
}

/// A node list and a pod list in a temporary directory.
struct Trace {
    dir: tempfile::TempDir,
}

impl Trace {
    fn new(nodes: &str, pods: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("nodes.csv"), nodes).unwrap();
        std::fs::write(dir.path().join("pods.csv"), pods).unwrap();
        Self { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The simulator on this trace (one seed, one policy, output in the directory).
    fn run(&self) -> Output {
        let (n, p, o) = (self.path("nodes.csv"), self.path("pods.csv"), self.path("out"));
        simulate(
            &[
                "--nodes",
                s(&n),
                "--pods",
                s(&p),
                "--seeds",
                "42",
                "--policies",
                "fgd",
                "--quiet",
                "--out-dir",
                s(&o),
            ],
            Duration::from_secs(30),
        )
    }

    /// Runs it and checks that it is refused with `want` (after the file's path), before
    /// printing anything.
    fn refused(&self, file: &str, want: &str) {
        let out = self.run();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let want = format!("{}{want}", self.path(file).display());
        assert_eq!(out.status.code(), Some(1), "{want}\n{stderr}");
        assert!(stderr.contains(&want), "want {want:?}\ngot {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(out.stdout.is_empty(), "{}", String::from_utf8_lossy(&out.stdout));
    }
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn nodes(rows: &[&str]) -> String {
    NODES.to_string() + &rows.join("\n") + "\n"
}

fn pods(rows: &[&str]) -> String {
    PODS.to_string() + &rows.join("\n") + "\n"
}

const T4: &str = "n0,64000,262144,2,T4";

/// A GPU pod asking no compute added nothing to the arrived workload: the replay never reached
/// its target and grew without end (6.6 GB after 15 s).
#[test]
fn a_gpu_pod_asking_no_compute_is_refused() {
    Trace::new(&nodes(&[T4]), &pods(&["p0,1000,1024,1,0,"])).refused(
        "pods.csv",
        ":2: gpu_milli=0: a GPU pod (num_gpu=1) asks 1..=1000 milli per GPU (or num_gpu=0 for a CPU pod)",
    );
}

/// CPU pods are valid, but a workload of them only never reaches a GPU target either.
#[test]
fn a_workload_without_gpu_tasks_is_refused() {
    let t = Trace::new(&nodes(&[T4]), &pods(&["p0,1000,1024,0,0,", "p1,2000,1024,0,0,"]));
    t.refused(
        "pods.csv",
        &format!(
            " on the nodes of {}: no task asks for a GPU (2 CPU-only task(s))",
            t.path("nodes.csv").display()
        ),
    );
}

/// Each card is modelled: 10^8 GPUs on a node reached 16 GB in 30 s.
#[test]
fn a_node_with_absurdly_many_gpus_is_refused() {
    Trace::new(
        &nodes(&[T4, "n1,64000,262144,100000000,T4"]),
        &pods(&["p0,1000,1024,1,1000,"]),
    )
    .refused(
        "nodes.csv",
        ":3: gpu=100000000: at most 64 GPUs per node (servers have up to 16; Tessera's topology describes at most 64)",
    );
}

/// The other values each row names, one bad row at a time.
#[test]
fn bad_values_are_refused_naming_line_field_and_value() {
    let ok_pod = "p0,1000,1024,1,500,";
    let cases: [(&[&str], &[&str], &str, &str); 8] = [
        (
            &[T4],
            &[ok_pod, "p1,1000,1024,0,500,"],
            "pods.csv",
            ":3: gpu_milli=500: a CPU pod (num_gpu=0) asks gpu_milli=0",
        ),
        (
            &[T4],
            &[ok_pod, "p1,1000,1024,1,1500,"],
            "pods.csv",
            ":3: gpu_milli=1500: at most 1000 milli (one whole GPU) per GPU",
        ),
        (
            &[T4],
            &["p1,1000,1024,65,1000,"],
            "pods.csv",
            ":2: num_gpu=65: at most 64 GPUs per task",
        ),
        (
            &[T4],
            &["p1,1000,18446744073709551615,1,1000,"],
            "pods.csv",
            ":2: memory_mib=18446744073709551615: at most 1073741824 MiB",
        ),
        (
            &[T4, "n0,64000,262144,8,A100"],
            &[ok_pod],
            "nodes.csv",
            ":3: sn=n0: line 2 has the same name",
        ),
        (
            &[T4, ",64000,262144,8,A100"],
            &[ok_pod],
            "nodes.csv",
            ":3: sn=\"\": every node needs a name",
        ),
        (
            &["n9,100000000000,262144,8,A100"],
            &[ok_pod],
            "nodes.csv",
            ":2: cpu_milli=100000000000: at most 100000000 millicores",
        ),
        (
            &[T4],
            &["p1,1000,1024,2,500,"],
            "pods.csv",
            ":2: task p1 asks for 2 GPU(s) x 500 milli; shares (below 1000) are for one GPU only",
        ),
    ];
    for (n, p, file, want) in cases {
        Trace::new(&nodes(n), &pods(p)).refused(file, want);
    }
}

/// Files beyond the bounds are refused before they are read whole.
#[test]
fn oversized_files_are_refused() {
    let many: Vec<String> = (0..20_001).map(|i| format!("n{i},64000,262144,1,T4")).collect();
    let many: Vec<&str> = many.iter().map(String::as_str).collect();
    Trace::new(&nodes(&many), &pods(&["p0,1000,1024,1,500,"])).refused("nodes.csv", ": more than 20000 rows");
    let t = Trace::new(&nodes(&[T4]), "");
    let f = std::fs::File::create(t.path("pods.csv")).unwrap();
    f.set_len((128 << 20) + 1).unwrap();
    t.refused("pods.csv", ": larger than 128 MiB");
}

/// One tiny task on a large cluster: filling it to 130% would replay millions of tasks.
#[test]
fn a_workload_too_small_for_the_cluster_is_refused() {
    let rows: Vec<String> = (0..100).map(|i| format!("n{i},64000,262144,64,T4")).collect();
    let rows: Vec<&str> = rows.iter().map(String::as_str).collect();
    let t = Trace::new(&nodes(&rows), &pods(&["p0,1000,1024,1,1,"]));
    t.refused(
        "pods.csv",
        &format!(
            " on the nodes of {}: the 1 task(s) ask for 1 milli-GPU in all, against 6400 GPUs; replaying them up to 130% of the GPU capacity would submit about 83200",
            t.path("nodes.csv").display()
        ),
    );
    let stderr = String::from_utf8_lossy(&t.run().stderr).into_owned();
    assert!(stderr.contains(" tasks per run, at most 2000000"), "{stderr}");
}

/// Many nodes and many distinct task shapes: each run would take days.
#[test]
fn a_workload_far_beyond_the_public_traces_work_is_refused() {
    let n: Vec<String> = (0..10_000).map(|i| format!("n{i},64000,262144,1,T4")).collect();
    let n: Vec<&str> = n.iter().map(String::as_str).collect();
    let p: Vec<String> = (0..10_000).map(|i| format!("p{i},{},1024,1,1000,", 1000 + i)).collect();
    let p: Vec<&str> = p.iter().map(String::as_str).collect();
    let out = Trace::new(&nodes(&n), &pods(&p)).run();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("class evaluations per run, at most 5e10") && stderr.contains("x 10000 nodes x"),
        "{stderr}"
    );
}

/// No GPU task fits any node: said at once, not as tables of zeros.
#[test]
fn a_workload_that_can_never_fit_is_refused() {
    let t = Trace::new(
        &nodes(&[T4, "n1,64000,262144,1,P100"]),
        &pods(&["p0,1000,1024,4,1000,", "p1,1000,1024,1,500,A100", "p2,1000,1024,0,0,"]),
    );
    t.refused(
        "pods.csv",
        &format!(
            " on the nodes of {}: none of the 2 GPU task(s) fits any node, even on an empty cluster (e.g. task p0: it asks 4 GPUs; the largest node has 2): every table would be zeros",
            t.path("nodes.csv").display()
        ),
    );
}

/// Most of it cannot fit: a warning line right after the first, then the run.
#[test]
fn a_workload_that_mostly_cannot_fit_says_so_first() {
    let out = Trace::new(
        &nodes(&[T4]),
        &pods(&["p0,1000,1024,1,500,", "p1,1000,1024,8,1000,", "p2,128000,1024,1,1000,"]),
    )
    .run();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let second = stdout.lines().nth(1).unwrap_or_default();
    assert_eq!(
        second,
        "warning: most of this workload can never be placed: 2 of 3 GPU task(s) (94.7% of the requested GPU compute) \
         fit no node even on an empty cluster (e.g. task p1: it asks 8 GPUs; the largest node has 2); every policy \
         drops them each time they arrive.",
        "{stdout}"
    );
    assert!(
        stdout.contains("Summary\n") && stdout.contains("2 of 3 GPU task(s) (94.7% of the requested GPU compute)"),
        "{stdout}"
    );
}
