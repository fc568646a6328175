//! The command line as a pipeline uses it: `tessera-simulator | head -1` ends quietly when the
//! reader stops (SIGPIPE, as Unix tools do), not with a panic and exit code 101; nonsense is
//! refused naming it; off a terminal it says how far it is.

use std::io::{BufRead as _, BufReader};
use std::os::unix::process::ExitStatusExt as _;
use std::process::{Command, Stdio};

#[test]
fn simulate_into_a_reader_that_stops_early_ends_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_tessera-simulator"))
        .args(["--seeds", "42..42", "--out-dir"])
        .arg(dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    // The reader is gone (dropped above); the simulator goes on to its next line.
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(first.starts_with("embedded default:"), "{first}");
    assert_eq!(out.status.signal(), Some(libc::SIGPIPE), "{:?}: {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// Nonsense is refused, naming the flag or file and the value, before any work: no panic, no
/// silent success, no million seeds printed.
#[test]
fn simulate_refuses_nonsense_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let header = "sn,cpu_milli,memory_mib,gpu,model\n";
    let empty = dir.path().join("empty.csv");
    std::fs::write(&empty, header).unwrap();
    let no_gpu = dir.path().join("no-gpu.csv");
    std::fs::write(&no_gpu, format!("{header}n1,64000,262144,0,P100\n")).unwrap();
    let pods = dir.path().join("pods.csv");
    std::fs::write(&pods, "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n").unwrap();
    let (e, n, p) = (
        empty.to_str().unwrap(),
        no_gpu.to_str().unwrap(),
        pods.to_str().unwrap(),
    );
    let cases: Vec<(Vec<&str>, String)> = vec![
        (
            vec!["--seeds", "42..18446744073709551615"],
            "--seeds=\"42..18446744073709551615\": 18446744073709551574 seeds; at most 1000".into(),
        ),
        (vec!["--seeds", "42..1000000"], "at most 1000 in one run".into()),
        (vec!["--seeds", "42,42"], "seed 42 given twice".into()),
        // A negative number is named as a bad seed, not as an unknown flag.
        (
            vec!["--seeds", "-1"],
            "--seeds=\"-1\": expected a range like 42..51 or a list like 42,43".into(),
        ),
        (vec!["--threads", "0"], "--threads=0: at least 1".into()),
        (vec!["--policies", "fgd,fgd"], "--policies: fgd given twice".into()),
        (
            vec!["--nodes", e, "--pods", p],
            format!("{e}: no node with a GPU (0 node(s))"),
        ),
        (
            vec!["--nodes", n, "--pods", p],
            format!("{n}: no node with a GPU (1 node(s))"),
        ),
    ];
    for (args, want) in cases {
        let out = Command::new(env!("CARGO_BIN_EXE_tessera-simulator"))
            .args(&args)
            .env("RUST_BACKTRACE", "0")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(
            stderr.contains(&want) && !stderr.contains("panicked"),
            "{args:?}: {stderr}"
        );
        assert!(
            out.stdout.is_empty(),
            "{args:?}: printed {}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
}

/// Output to a file or a pipe: no bar, but a progress line on stderr at each tenth of the runs.
#[test]
fn simulate_off_a_terminal_says_how_far_it_is() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tessera-simulator"))
        .args(["--seeds", "42", "--policies", "random,fgd", "--out-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let err = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("simulate: ")).collect();
    let tenths: Vec<&str> = lines
        .iter()
        .filter_map(|l| l.strip_prefix("simulate: ")?.split('%').next())
        .filter(|p| p.parse::<u32>().is_ok())
        .collect();
    assert_eq!(tenths, ["10", "20", "30", "40", "50", "60", "70", "80", "90"], "{err}");
    assert!(
        lines
            .last()
            .is_some_and(|l| l.starts_with("simulate: done, 2 runs in ")),
        "{err}"
    );
    // It ends with a conclusion: who wins, what the figures mean, what the workload is.
    let stdout = String::from_utf8_lossy(&out.stdout);
    let summary = stdout.split_once("\nSummary\n").map_or("", |(_, s)| s);
    let flat = summary.split_whitespace().collect::<Vec<_>>().join(" ");
    for want in [
        "At 100% arrived workload (the GPU requests so far equal the capacity), fgd allocates the most:",
        "The others, in points: random -",
        "With one seed the noise between seeds is unknown",
        "unalloc@100% is 100 minus it",
        "Fragmentation rate: that amount as % of all idle GPU compute.",
        "Workload: the embedded default is synthetic",
    ] {
        assert!(flat.contains(want), "{want:?} missing from:\n{stdout}");
    }
}

/// `scripts/fetch-trace.sh` (the README's way to the public trace) writes a copy whose every file
/// is the published one, and the simulator runs on it from inside the repository; a copy that
/// differs is refused, naming the file, and nothing of it is kept. The source here is the copy
/// beside the checkout (`../shared/traces`), as a mirror would serve it.
#[test]
fn the_fetched_trace_is_the_published_one_and_the_simulator_reads_it() {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let shared = repo.join("../shared/traces/alibaba-gpu-v2023");
    assert!(shared.is_dir(), "{} is missing", shared.display());
    let fetch = |source: &std::path::Path, dir: &std::path::Path| {
        Command::new("bash")
            .arg(repo.join("scripts/fetch-trace.sh"))
            .arg(dir)
            .env("TESSERA_TRACE_URL", format!("file://{}", source.display()))
            .output()
            .unwrap()
    };
    let work = tempfile::tempdir().unwrap();
    let trace = work.path().join("trace");
    let out = fetch(&shared, &trace);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), trace.display().to_string());
    let run = Command::new(env!("CARGO_BIN_EXE_tessera-simulator"))
        .arg("--trace")
        .arg(&trace)
        .args(["--seeds", "42", "--policies", "fgd", "--out-dir"])
        .arg(work.path().join("chart"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{stdout}{}", String::from_utf8_lossy(&run.stderr));
    assert!(stdout.contains("6212 GPUs") || stdout.contains("6,212"), "{stdout}");

    // A mirror serving a changed pod list.
    let mirror = work.path().join("mirror");
    std::fs::create_dir(&mirror).unwrap();
    for f in std::fs::read_dir(&shared).unwrap() {
        let f = f.unwrap().path();
        if f.extension().is_some_and(|e| e == "csv") {
            std::fs::copy(&f, mirror.join(f.file_name().unwrap())).unwrap();
        }
    }
    let pods = mirror.join("openb_pod_list_default.csv");
    let mut text = std::fs::read_to_string(&pods).unwrap();
    text.push_str("openb-pod-9999,1000,1024,1,500,,LS,Running,0,1,0\n");
    std::fs::write(&pods, text).unwrap();
    let other = work.path().join("other");
    let out = fetch(&mirror, &other);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("openb_pod_list_default.csv is not the published trace"),
        "{stderr}"
    );
    assert!(!other.join("openb_pod_list_default.csv").exists());
    assert!(!other.join("openb_pod_list_default.csv.part").exists());
}

/// An output directory that cannot take the chart is refused before the run, not after it.
#[test]
fn simulate_refuses_an_unwritable_out_dir_before_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, "").unwrap();
    let out_dir = file.join("charts");
    let out = Command::new(env!("CARGO_BIN_EXE_tessera-simulator"))
        .args(["--seeds", "42", "--policies", "fgd", "--quiet", "--out-dir"])
        .arg(&out_dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "--out-dir={}: cannot create it (the chart is written there)",
            out_dir.display()
        )),
        "{stderr}"
    );
    assert!(
        out.stdout.is_empty(),
        "ran before refusing: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// A full disk behind standard output: an error naming it and exit code 1, not a panic.
#[test]
fn simulate_into_a_full_device_says_so() {
    let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tessera-simulator"))
        .args(["--seeds", "42", "--policies", "fgd", "--quiet", "--out-dir"])
        .arg(tempfile::tempdir().unwrap().path())
        .env("RUST_BACKTRACE", "0")
        .stdout(full)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("Error: cannot write to standard output") && stderr.contains("No space left on device"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// A reader that stops early while SIGPIPE is blocked (inherited from a parent that blocks it):
/// the write fails with EPIPE instead of the signal ending the process; it still ends quietly.
#[test]
fn simulate_into_a_closed_pipe_with_sigpipe_blocked_ends_quietly() {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tessera-simulator"));
    cmd.args(["--seeds", "42", "--policies", "fgd", "--quiet", "--out-dir"])
        .arg(tempfile::tempdir().unwrap().path())
        .env("RUST_BACKTRACE", "0")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: sigprocmask is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
            let mut set = std::mem::zeroed::<libc::sigset_t>();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGPIPE);
            libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            Ok(())
        });
    }
    let mut child = cmd.spawn().unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(first.starts_with("embedded default:"), "{first}");
    assert_eq!(out.status.code(), Some(0), "{:?}: {stderr}", out.status);
    assert!(stderr.is_empty(), "{stderr}");
}
