//! `miles train` settings handling and the example configs, against the built binary.

// Helpers of a test crate are test code: they may unwrap and panic.
#![allow(clippy::unwrap_used, clippy::panic)]

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

#[test]
fn every_example_config_resolves_to_valid_settings() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut seen = 0;
    for entry in std::fs::read_dir(root.join("examples")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "toml") {
            continue;
        }
        let rel = path
            .strip_prefix(root)
            .unwrap()
            .to_str()
            .unwrap()
            .to_owned();
        let output = miles(&["check-config", "--config", &rel]);
        assert_eq!(output.status.code(), Some(0), "{rel}: {}", stderr(&output));
        let out = String::from_utf8_lossy(&output.stdout);
        assert!(out.contains("colocate = true"), "{rel}: {out}");
        seen += 1;
    }
    assert!(seen >= 5, "only {seen} example configs");
}

#[test]
fn train_refuses_bad_settings_with_status_2_before_building_anything() {
    let output = miles(&["train", "--steps", "0", "--rollout-temperature=-1"]);
    assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
    let err = stderr(&output);
    assert!(
        err.contains("--steps") && err.contains("--rollout-temperature"),
        "{err}"
    );
    let output = miles(&["train", "--task", "revers"]);
    assert_eq!(output.status.code(), Some(2));
    assert!(stderr(&output).contains("did you mean `reverse`?"));
}

#[test]
fn task_and_warmup_keys_come_from_the_config_file_under_flags() {
    let output = miles(&[
        "check-config",
        "--config",
        "examples/colocate-cpu.toml",
        "--task",
        "add",
    ]);
    let out = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let line = |key: &str| {
        out.lines()
            .find(|l| l.starts_with(&format!("{key} ")))
            .unwrap_or_else(|| panic!("{key} missing from {out}"))
            .to_owned()
    };
    assert!(line("task").contains("\"add\"") && line("task").ends_with("# flag"));
    assert!(
        line("sft_warmup_steps").contains("60") && line("sft_warmup_steps").ends_with("# file")
    );
}
