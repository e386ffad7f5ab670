//! `miles bench offload-train --train-backend fsdp` against the built binary, on the tiny preset.

// Helpers of a test crate are test code: they may unwrap (clippy.toml covers only `#[test]`
// functions and `#[cfg(test)]` modules).
#![allow(clippy::unwrap_used)]

use std::process::{Command, Output};

fn miles(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_miles"))
        .args(["bench", "offload-train", "--train-backend", "fsdp"])
        .args(["--preset", "tiny", "--device-memory-gib", "1"])
        .args([
            "--train-memory-margin-bytes",
            "0",
            "--cycles",
            "2",
            "--seq",
            "16",
        ])
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap()
}

#[test]
fn fsdp_offload_to_cpu_and_disk_reports_every_rank_against_the_baseline() {
    let dir = tempfile::tempdir().unwrap();
    let disk = [
        "--offload-train-target",
        "disk",
        "--offload-train-disk-dir",
        dir.path().to_str().unwrap(),
    ];
    for (extra, baseline) in [
        (&[][..], "baseline (single-threaded memcpy"),
        (&disk[..], "baseline (O_DIRECT"),
    ] {
        let output = miles(&[&["--data-parallel-size", "2"][..], extra].concat());
        let out = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success(),
            "{out}\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(out.contains("backend fsdp"), "{out}");
        assert!(out.contains(baseline), "{out}");
        for line in [
            "offload rank 0",
            "offload rank 1",
            "onload  rank 0",
            "onload  rank 1",
        ] {
            assert!(out.contains(line), "missing {line:?} in\n{out}");
        }
        assert!(!out.contains(" 0 bytes moved"), "{out}");
    }
}

#[test]
fn fsdp_with_tensor_parallelism_exits_2_naming_the_flag() {
    let output = miles(&["--tensor-model-parallel-size", "2"]);
    let err = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{err}");
    assert!(err.contains("--tensor-model-parallel-size 1"), "{err}");
}
