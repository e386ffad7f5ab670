//! `miles train` on a user's data and reward, against the built binary: the example dataset,
//! a reward script, a reward process that dies, and bad data.

// Helpers of a test crate are test code: they may unwrap and panic.
#![allow(clippy::unwrap_used, clippy::panic, clippy::print_stdout)]

use std::path::Path;
use std::process::{Command, Output};

fn miles(args: &[&str]) -> Output {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    Command::new(env!("CARGO_BIN_EXE_miles"))
        .args(args)
        .current_dir(root)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn rewards(metrics: &Path) -> Vec<f64> {
    std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .skip(1) // the run's header
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["reward_mean"]
                .as_f64()
                .unwrap()
        })
        .collect()
}

fn python() -> bool {
    let found = Command::new("python3").arg("--version").output().is_ok();
    if !found {
        println!("skipped: no python3");
    }
    found
}

#[test]
fn the_main_job_raises_the_math_reward_on_the_example_dataset() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = dir.path().join("m.jsonl");
    let output = miles(&[
        "train",
        "--config",
        "examples/colocate-cpu.toml",
        "--metrics",
        metrics.to_str().unwrap(),
        "--memory-timeline",
        dir.path().join("t.svg").to_str().unwrap(),
    ]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let r = rewards(&metrics);
    assert_eq!(r.len(), 200);
    let mean = |s: &[f64]| s.iter().sum::<f64>() / s.len() as f64;
    let (first, last) = (mean(&r[..20]), mean(&r[160..]));
    assert!(
        last > first + 0.1,
        "reward {first:.3} -> {last:.3} (needs +0.1): {r:?}"
    );
}

/// A dataset of `rows` lines `{"q": ..., "a": ...}`, written into `dir`.
fn dataset(dir: &Path) -> String {
    let path = dir.join("f.jsonl");
    let rows: String = (0..8)
        .map(|i| {
            format!(
                "{{\"q\": \"Ann has {i} pens. One more?\", \"a\": \"{}\"}}\n",
                i + 1
            )
        })
        .collect();
    std::fs::write(&path, rows).unwrap();
    path.to_str().unwrap().to_owned()
}

fn base(data: &str, metrics: &Path) -> Vec<String> {
    [
        "train",
        "--device",
        "cpu",
        "--device-memory-gib",
        "1",
        "--train-memory-margin-bytes",
        "0",
        "--colocate",
        "--prompt-data",
        data,
        "--input-key",
        "q",
        "--label-key",
        "a",
        "--rm-type",
        "math",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "2",
        "--global-batch-size",
        "8",
        "--rollout-max-response-len",
        "3",
        "--metrics",
        metrics.to_str().unwrap(),
    ]
    .map(str::to_owned)
    .to_vec()
}

#[test]
fn a_user_reward_script_trains_the_run_with_kl_and_a_dump_of_every_sample() {
    if !python() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = dataset(dir.path());
    let script = dir.path().join("my_rm.py");
    std::fs::write(
        &script,
        "import json, sys\n\
         for line in sys.stdin:\n\
         \x20   r = json.loads(line)\n\
         \x20   print(json.dumps({'reward': 0.5 if r['label'] else 0.0}), flush=True)\n",
    )
    .unwrap();
    let metrics = dir.path().join("m.jsonl");
    let dump = dir.path().join("rollouts.jsonl");
    let mut args = base(&data, &metrics);
    args.extend(
        [
            "--steps",
            "3",
            "--use-kl-loss",
            "--kl-loss-coef",
            "0.01",
            "--kl-loss-type",
            "k3",
            "--dump-rollouts",
            dump.to_str().unwrap(),
            "--custom-rm-command",
        ]
        .map(str::to_owned)
        .into_iter()
        .chain([format!("python3 {}", script.display())]),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let output = miles(&args);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert_eq!(
        rewards(&metrics),
        [0.5, 0.5, 0.5],
        "the script's rewards train the run"
    );
    let text = std::fs::read_to_string(&metrics).unwrap();
    let last: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    for key in [
        "reward_std",
        "response_len_mean",
        "response_len_max",
        "truncated_fraction",
        "kl",
        "clip_fraction",
        "grad_norm",
        "lr",
        "rollout_tokens_per_second",
        "train_tokens_per_second",
        "phase_seconds",
        "bytes_moved",
    ] {
        assert!(!last[key].is_null(), "{key} missing from {last}");
    }
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&dump)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3 * 4 * 2, "one line per sample");
    assert!(
        lines
            .iter()
            .all(|l| l["reward"] == 0.5 && l["prompt"].is_string() && l["response"].is_string())
    );
}

#[test]
fn a_reward_process_that_dies_mid_run_exits_1_with_its_stderr() {
    if !python() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = dataset(dir.path());
    let script = dir.path().join("dies.py");
    // Answers the first rollout (8 samples), then dies on the second.
    std::fs::write(
        &script,
        "import json, os, sys\n\
         for n, line in enumerate(sys.stdin):\n\
         \x20   if n == 8:\n\
         \x20       sys.stderr.write('reward model lost its gpu\\n')\n\
         \x20       sys.stderr.flush()\n\
         \x20       os.kill(os.getpid(), 9)\n\
         \x20   print(json.dumps({'reward': 1.0}), flush=True)\n",
    )
    .unwrap();
    let metrics = dir.path().join("m.jsonl");
    let mut args = base(&data, &metrics);
    args.extend(
        ["--steps", "5", "--custom-rm-command"]
            .map(str::to_owned)
            .into_iter()
            .chain([format!("python3 {}", script.display())]),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let output = miles(&args);
    let err = stderr(&output);
    assert_eq!(output.status.code(), Some(1), "{err}");
    assert!(err.contains("reward model lost its gpu"), "{err}");
    assert_eq!(rewards(&metrics).len(), 1, "the first step finished: {err}");
}

#[test]
fn bad_data_exits_2_naming_the_line_before_any_work() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.jsonl");
    std::fs::write(&path, "{\"q\": 1}\nnot json\n").unwrap();
    let metrics = dir.path().join("m.jsonl");
    let args = base(path.to_str().unwrap(), &metrics);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let output = miles(&args);
    let err = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{err}");
    assert!(
        err.contains("line 1") && err.contains("no usable row"),
        "{err}"
    );
    assert!(!metrics.exists(), "nothing ran");
    // A label that is no number under --rm-type math names its line too.
    std::fs::write(
        &path,
        "{\"q\": \"x\", \"a\": \"7\"}\n{\"q\": \"y\", \"a\": \"seven\"}\n",
    )
    .unwrap();
    let output = miles(&args);
    let err = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{err}");
    assert!(err.contains("seven") && err.contains("line 2"), "{err}");
    // A dataset without a reward is refused.
    let output = miles(&["train", "--prompt-data", path.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(2));
    assert!(stderr(&output).contains("--rm-type"));
}

#[test]
fn the_learning_rate_warms_up_then_decays_on_the_megatron_backend() {
    let dir = tempfile::tempdir().unwrap();
    let data = dataset(dir.path());
    let metrics = dir.path().join("m.jsonl");
    let mut args = base(&data, &metrics);
    args.extend(
        [
            "--steps",
            "4",
            "--lr",
            "0.01",
            "--lr-warmup-iters",
            "2",
            "--lr-decay-style",
            "linear",
            "--min-lr",
            "0.001",
        ]
        .map(str::to_owned),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let output = miles(&args);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let lrs: Vec<f64> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .skip(1) // the run's header
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["lr"]
                .as_f64()
                .unwrap()
        })
        .collect();
    let expected = [0.005, 0.01, 0.0055, 0.001];
    let worst = lrs
        .iter()
        .zip(expected)
        .map(|(a, e)| (a - e).abs())
        .fold(0.0, f64::max);
    assert!(lrs.len() == 4 && worst < 1e-9, "{lrs:?} vs {expected:?}");
}

#[test]
fn an_entropy_bonus_micro_batches_and_stop_strings_run_on_both_cpu_backends() {
    let dir = tempfile::tempdir().unwrap();
    let data = dataset(dir.path());
    for backend in ["megatron", "fsdp"] {
        let metrics = dir.path().join(format!("{backend}.jsonl"));
        let dump = dir.path().join(format!("{backend}-rollouts.jsonl"));
        let mut args = base(&data, &metrics);
        args.extend(
            [
                "--train-backend",
                backend,
                "--steps",
                "2",
                "--entropy-coef",
                "0.01",
                "--micro-batch-size",
                "3",
                "--rollout-stop",
                "1",
                "2",
                "--dump-rollouts",
                dump.to_str().unwrap(),
            ]
            .map(str::to_owned),
        );
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let output = miles(&args);
        assert_eq!(
            output.status.code(),
            Some(0),
            "{backend}: {}",
            stderr(&output)
        );
        let text = std::fs::read_to_string(&metrics).unwrap();
        for line in text.lines().skip(1) {
            let step: serde_json::Value = serde_json::from_str(line).unwrap();
            let entropy = step["entropy"].as_f64().unwrap();
            assert!(entropy > 0.0, "{backend}: {step}");
        }
        for line in std::fs::read_to_string(&dump).unwrap().lines() {
            let sample: serde_json::Value = serde_json::from_str(line).unwrap();
            let response = sample["response"].as_str().unwrap();
            assert!(
                !response.contains('1') && !response.contains('2'),
                "{backend}: a stop string survived in {sample}"
            );
        }
    }
}
