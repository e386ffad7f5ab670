//! `miles bench offload-train` against the built binary, on the tiny preset.

// Helpers of a test crate are test code: they may unwrap (clippy.toml covers only `#[test]`
// functions and `#[cfg(test)]` modules).
#![allow(clippy::unwrap_used)]

use std::process::{Command, Output};

fn miles(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_miles"))
        .args([
            "bench",
            "offload-train",
            "--preset",
            "tiny",
            "--device-memory-gib",
            "1",
        ])
        .args(["--train-memory-margin-bytes", "0", "--cycles", "2"])
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap()
}

#[test]
fn disk_offload_reports_every_rank_against_the_direct_io_baseline() {
    let dir = tempfile::tempdir().unwrap();
    let output = miles(&[
        "--tensor-model-parallel-size",
        "2",
        "--offload-train-target",
        "disk",
        "--offload-train-disk-dir",
        dir.path().to_str().unwrap(),
    ]);
    let out = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{out}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(out.contains("baseline (O_DIRECT"), "{out}");
    for line in [
        "offload rank 0",
        "offload rank 1",
        "onload  rank 0",
        "onload  rank 1",
    ] {
        assert!(out.contains(line), "missing {line:?} in\n{out}");
    }
    assert!(out.contains("x baseline"), "{out}");
}

#[test]
fn a_tensor_parallel_size_the_heads_cannot_take_exits_2() {
    let output = miles(&["--tensor-model-parallel-size", "3"]);
    let err = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{err}");
    assert!(err.contains("does not divide"), "{err}");
}

#[test]
fn a_streamed_optimizer_reports_its_step_against_a_resident_one() {
    let dir = tempfile::tempdir().unwrap();
    let output = miles(&[
        "--stream-optimizer-state-to-disk",
        "--offload-train-target",
        "disk",
        "--offload-train-disk-dir",
        dir.path().to_str().unwrap(),
    ]);
    let out = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{out}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    for line in [
        "streamed optimizer (fp32, 128 tokens a step): step",
        "against resident",
        "streamed optimizer state on the device",
        // The cpu backends do not report their stream's traffic: the bench says so.
        "does not report its stream's traffic",
    ] {
        assert!(out.contains(line), "missing {line:?} in\n{out}");
    }
}

#[test]
fn an_empty_batch_exits_2_before_any_work() {
    let output = miles(&["--batch", "0"]);
    let err = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{err}");
    assert!(err.contains("--batch must be at least 1"), "{err}");
}
