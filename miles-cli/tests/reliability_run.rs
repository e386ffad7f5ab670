//! Issue 18's cases of runs that must lose nothing and let nobody in, against the built `miles`
//! binary: stop signals, output locations, non-finite losses, `--nproc-per-node` bounds and
//! hostile peers at the rendezvous of a two-rank CPU job.

// Helpers of a test crate are test code: they may unwrap and panic.
#![allow(clippy::unwrap_used, clippy::panic)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal, kill_process};
use serde_json::Value;

/// A small, fast loop on the CPU device.
const FAST: [&str; 12] = [
    "train",
    "--device",
    "cpu",
    "--preset",
    "tiny",
    "--rollout-batch-size",
    "4",
    "--n-samples-per-prompt",
    "2",
    "--global-batch-size",
    "8",
    "--seed=7",
];

fn miles() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_miles"));
    command.env("RUST_LOG", "warn");
    command
}

fn run(args: &[&str]) -> Output {
    miles().args(args).output().unwrap()
}

fn train(extra: &[&str]) -> Output {
    let args: Vec<&str> = FAST.iter().chain(extra).copied().collect();
    run(&args)
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Waits for `child` at most `limit`, killing it when it overruns.
fn wait_for(child: &mut Child, limit: Duration) -> ExitStatus {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if started.elapsed() > limit {
            child.kill().unwrap();
            panic!("miles ran past {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The JSON lines of a metrics file.
fn metrics_lines(file: &Path) -> Vec<Value> {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{line:?}: {e}")))
        .collect()
}

/// Waits until the metrics file holds at least one step line.
fn wait_for_a_step(child: &mut Child, file: &Path) {
    let started = Instant::now();
    while !metrics_lines(file).iter().any(|l| l.get("step").is_some()) {
        assert!(
            child.try_wait().unwrap().is_none(),
            "miles ended before its first step"
        );
        assert!(started.elapsed() < Duration::from_secs(120), "no step");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn signal(child: &Child, signal: Signal) {
    kill_process(Pid::from_child(child), signal).unwrap();
}

/// Waits until `child` has taken a pending SIGINT (its bit clear in `/proc/PID/status`).
fn delivered(child: &Child) {
    const SIGINT_BIT: u64 = 1 << (2 - 1);
    let status = format!("/proc/{}/status", child.id());
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        let text = std::fs::read_to_string(&status).unwrap_or_default();
        let pending = text
            .lines()
            .filter(|line| line.starts_with("ShdPnd:") || line.starts_with("SigPnd:"))
            .filter_map(|line| line.split_whitespace().nth(1))
            .filter_map(|mask| u64::from_str_radix(mask, 16).ok())
            .any(|mask| mask & SIGINT_BIT != 0);
        if !pending {
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("the child never took its SIGINT");
}

/// The step `save/latest` names, after checking that every checkpoint in `save` is whole
/// and that nothing of a save in progress is left.
fn saved_step(save: &Path) -> u64 {
    for entry in std::fs::read_dir(save).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        assert!(
            name == "latest" || name.starts_with("step-"),
            "{name} left in {}",
            save.display()
        );
        if name.starts_with("step-") {
            assert!(
                save.join(&name).join("loop_state.json").is_file(),
                "{name} is not a whole checkpoint"
            );
        }
    }
    let latest = std::fs::read_to_string(save.join("latest")).unwrap();
    let state = std::fs::read_to_string(save.join(latest.trim()).join("loop_state.json")).unwrap();
    serde_json::from_str::<Value>(&state).unwrap()["step"]
        .as_u64()
        .unwrap()
}

#[test]
fn ctrl_c_during_train_with_save_exits_130_after_saving_and_writing_the_last_step() {
    let dir = tempfile::tempdir().unwrap();
    let (save, metrics) = (dir.path().join("ckpt"), dir.path().join("m.jsonl"));
    let args: Vec<&str> = FAST
        .iter()
        .copied()
        .chain([
            "--steps",
            "100000",
            "--save",
            path(&save),
            "--metrics",
            path(&metrics),
        ])
        .collect();
    let mut child = miles().args(&args).stderr(Stdio::piped()).spawn().unwrap();
    wait_for_a_step(&mut child, &metrics);
    signal(&child, Signal::INT);
    let status = wait_for(&mut child, Duration::from_secs(60));
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert_eq!(status.code(), Some(130), "{err}");
    assert!(err.contains("SIGINT"), "{err}");
    let step = saved_step(&save);
    let lines = metrics_lines(&metrics);
    assert!(lines[0].get("header").is_some(), "{:?}", lines[0]);
    let last = lines.last().unwrap();
    assert_eq!(
        last["step"].as_u64(),
        Some(step),
        "the last metrics line is the saved step"
    );
    let resumed = train(&["--load", path(&save), "--steps", &(step + 1).to_string()]);
    assert_eq!(resumed.status.code(), Some(0), "{}", text(&resumed.stderr));
}

#[test]
fn sigterm_exits_143_and_a_second_signal_stops_at_once_leaving_nothing_partial() {
    let dir = tempfile::tempdir().unwrap();
    let (save, metrics) = (dir.path().join("ckpt"), dir.path().join("m.jsonl"));
    let args: Vec<&str> = FAST
        .iter()
        .copied()
        .chain([
            "--steps",
            "100000",
            "--save-interval",
            "1",
            "--save",
            path(&save),
            "--metrics",
            path(&metrics),
        ])
        .collect();
    let mut child = miles().args(&args).spawn().unwrap();
    wait_for_a_step(&mut child, &metrics);
    signal(&child, Signal::TERM);
    assert_eq!(
        wait_for(&mut child, Duration::from_secs(60)).code(),
        Some(143)
    );
    // Rollouts long enough (tenths of a second) that the second signal lands mid-phase, and a
    // fresh metrics file: the signals must come once this run's handlers are installed.
    let again = dir.path().join("again.jsonl");
    let args: Vec<&str> = args
        .iter()
        .map(|&arg| match arg {
            "4" => "256",
            "2" => "8",
            "8" => "2048",
            _ if arg == path(&metrics) => path(&again),
            _ => arg,
        })
        .collect();
    let mut child = miles().args(&args).stdout(Stdio::piped()).spawn().unwrap();
    wait_for_a_step(&mut child, &again);
    signal(&child, Signal::INT);
    // Two SIGINTs pending at once are one: the second goes once the first was taken.
    delivered(&child);
    std::thread::sleep(Duration::from_millis(100));
    signal(&child, Signal::INT);
    let status = wait_for(&mut child, Duration::from_secs(10));
    let mut out = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    assert_eq!(status.code(), Some(130), "{out}");
    assert!(
        !out.contains("stopped after"),
        "the second signal waited for the phase: {out}"
    );
    saved_step(&save);
    metrics_lines(&again);
}

#[test]
fn unusable_output_locations_exit_2_before_any_work_naming_each() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, "not a directory").unwrap();
    let notes = dir.path().join("notes.txt");
    std::fs::write(&notes, "my notes\n").unwrap();
    let started = Instant::now();
    let output = train(&[
        "--steps",
        "1",
        "--save",
        path(&file.join("ckpt")),
        "--metrics",
        path(&notes),
        "--memory-timeline",
        path(dir.path()),
    ]);
    let err = text(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{err}");
    for flag in ["--save", "--metrics", "--memory-timeline"] {
        assert!(err.contains(flag), "{flag} missing from {err}");
    }
    assert!(err.contains("not a miles metrics file"), "{err}");
    assert_eq!(std::fs::read_to_string(&notes).unwrap(), "my notes\n");
    assert!(started.elapsed() < Duration::from_secs(10), "{err}");
}

#[test]
fn a_checkpoint_with_nan_weights_stops_at_its_first_step_with_exit_1_saving_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (save, metrics) = (dir.path().join("ckpt"), dir.path().join("m.jsonl"));
    let first = train(&["--steps", "1", "--save", path(&save)]);
    assert_eq!(first.status.code(), Some(0), "{}", text(&first.stderr));
    // The weights: the Hugging Face files and the fp32 master weights `--load` resumes from.
    let actor = save.join("step-00000001").join("actor");
    let weights = [actor.clone(), actor.join("miles_state")]
        .iter()
        .filter_map(|dir| std::fs::read_dir(dir).ok())
        .flatten()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect::<Vec<PathBuf>>();
    assert!(!weights.is_empty(), "no safetensors in the checkpoint");
    for file in weights {
        let mut bytes = std::fs::read(&file).unwrap();
        let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        bytes[8 + header..].fill(0xff);
        std::fs::write(&file, bytes).unwrap();
    }
    let output = train(&[
        "--steps",
        "3",
        "--load",
        path(&save),
        "--save",
        path(&save),
        "--save-interval",
        "1",
        "--metrics",
        path(&metrics),
    ]);
    let err = text(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{err}");
    assert!(err.contains("step 2 is NaN"), "{err}");
    assert_eq!(
        saved_step(&save),
        1,
        "nothing newer than the last checkpoint"
    );
    assert!(!save.join("step-00000002").exists());
    assert!(
        metrics_lines(&metrics)
            .iter()
            .all(|l| l.get("loss").is_none_or(Value::is_number)),
        "a non-finite loss reached the metrics"
    );
}

#[test]
fn nproc_per_node_100000_exits_2_spawning_nothing() {
    for command in [
        &["train", "--device", "cpu", "--steps", "1"][..],
        &["bench", "offload", "--device", "cpu", "--size", "4MiB"][..],
    ] {
        let mut args = command.to_vec();
        args.extend(["--nproc-per-node", "100000"]);
        let output = run(&args);
        let err = text(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains("use at most --nproc-per-node"), "{err}");
        assert!(
            !err.contains("rank 0") && !err.contains("refused its settings"),
            "a rank was started: {err}"
        );
    }
}

/// A rank of a two-rank `bench offload` job on the CPU device, rank 0 publishing its port in
/// `port_file`.
fn bench_rank(rank: usize, port_file: &Path, secret: &str) -> Child {
    miles()
        .args([
            "bench", "offload", "--device", "cpu", "--size", "4MiB", "--target", "host",
            "--cycles", "1",
        ])
        .env("RANK", rank.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("WORLD_SIZE", "2")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MILES_PORT_FILE", port_file)
        .env("MILES_JOB_SECRET", secret)
        .stdout(Stdio::null())
        .spawn()
        .unwrap()
}

#[test]
fn hostile_peers_at_the_rendezvous_do_not_stop_a_two_rank_cpu_job() {
    let dir = tempfile::tempdir().unwrap();
    let port_file = dir.path().join("port");
    let secret = "the-secret-of-this-test-job-0123";
    let mut zero = bench_rank(0, &port_file, secret);
    let started = Instant::now();
    let port: u16 = loop {
        if let Some(port) = std::fs::read_to_string(&port_file)
            .ok()
            .and_then(|t| t.trim().parse().ok())
        {
            break port;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "rank 0 never listened"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    let connect = || TcpStream::connect(("127.0.0.1", port)).unwrap();
    let silent = connect();
    let mut huge = connect();
    let mut claim = b"MLI3".to_vec();
    claim.extend_from_slice(&2u32.to_le_bytes());
    claim.extend_from_slice(&1u32.to_le_bytes());
    claim.push(3);
    claim.extend_from_slice(&(1u32 << 30).to_le_bytes());
    huge.write_all(&claim).unwrap();
    let mut impostor = connect();
    let mut hello = b"MLI3".to_vec();
    hello.extend_from_slice(&2u32.to_le_bytes());
    hello.extend_from_slice(&1u32.to_le_bytes());
    hello.extend_from_slice(&8u16.to_le_bytes());
    hello.extend_from_slice(b"guessed!");
    impostor.write_all(&hello).unwrap();
    let mut one = bench_rank(1, &port_file, secret);
    let joined = Instant::now();
    let one_status = wait_for(&mut one, Duration::from_secs(60));
    let zero_status = wait_for(&mut zero, Duration::from_secs(60));
    assert!(
        one_status.success() && zero_status.success(),
        "{one_status} {zero_status}"
    );
    assert!(
        joined.elapsed() < Duration::from_secs(30),
        "the job took {:?} to form and run",
        joined.elapsed()
    );
    drop((silent, huge, impostor));
}

/// The processes whose parent is `parent`, read from /proc.
fn children_of(parent: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| {
                    let after = &stat[stat.rfind(')')? + 1..];
                    after.split_whitespace().nth(1)?.parse::<u32>().ok()
                })
                == Some(parent)
        })
        .collect()
}

#[test]
fn the_launcher_passes_sigint_on_to_its_ranks_and_exits_130() {
    let dir = tempfile::tempdir().unwrap();
    let mut launcher = miles()
        .args([
            "bench",
            "offload",
            "--device",
            "cpu",
            "--size",
            "16MiB",
            "--target",
            "host",
            "--cycles",
            "100000",
            "--nproc-per-node",
            "2",
        ])
        .env("TMPDIR", dir.path())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let ranks = loop {
        let ranks = children_of(launcher.id());
        let listening = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .any(|job| job.path().join("port").exists());
        if ranks.len() == 2 && listening {
            break ranks;
        }
        assert!(launcher.try_wait().unwrap().is_none(), "the launcher ended");
        assert!(started.elapsed() < Duration::from_secs(60), "no ranks");
        std::thread::sleep(Duration::from_millis(20));
    };
    signal(&launcher, Signal::INT);
    let status = wait_for(&mut launcher, Duration::from_secs(30));
    assert_eq!(status.code(), Some(130));
    for rank in ranks {
        assert!(
            !Path::new(&format!("/proc/{rank}")).exists(),
            "rank {rank} outlived the launcher"
        );
    }
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "the job directory is left"
    );
}
