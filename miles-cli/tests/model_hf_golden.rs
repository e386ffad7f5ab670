//! `miles model init` + `miles model score --json` against log-probs that Hugging Face
//! transformers computed on the same checkpoints (fixtures made with `bench/hf_check.sh`).

// Test helpers outside #[test] functions: a failing step should stop the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Command;

use serde_json::Value;

fn miles(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_miles"))
        .args(args)
        .output()
        .expect("run miles");
    assert!(
        out.status.success(),
        "miles {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

fn check_against_hf(fixture: &str, extra_init: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let ck = ck.to_str().unwrap();
    let mut init = vec![
        "model", "init", "--preset", "tiny", "--seed", "1", "--out", ck,
    ];
    init.extend_from_slice(extra_init);
    miles(&init);
    let ours: Value = serde_json::from_str(&miles(&[
        "model",
        "score",
        "--checkpoint",
        ck,
        "--text",
        "hello world",
        "--json",
    ]))
    .unwrap();
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(fixture);
    let hf: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(ours["tokens"], hf["tokens"]);
    let ours_lp = ours["logprobs"].as_array().unwrap();
    let hf_lp = hf["logprobs"].as_array().unwrap();
    assert_eq!(ours_lp.len(), hf_lp.len());
    assert_eq!(ours_lp.len() + 1, ours["tokens"].as_array().unwrap().len());
    let worst = ours_lp
        .iter()
        .zip(hf_lp)
        .map(|(a, b)| (a.as_f64().unwrap() - b.as_f64().unwrap()).abs())
        .fold(0.0, f64::max);
    let loss_diff = (ours["mean_loss"].as_f64().unwrap() - hf["mean_loss"].as_f64().unwrap()).abs();
    // Tolerance 1e-4, the acceptance bound of issue 4.
    assert!(
        worst < 1e-4 && loss_diff < 1e-4,
        "{fixture}: worst log-prob difference {worst:e}, mean loss difference {loss_diff:e}"
    );
}

#[test]
fn tiny_seed1_scores_hello_world_as_hugging_face_does() {
    check_against_hf("hf_tiny_seed1_hello_world.json", &[]);
}

#[test]
fn tiny_seed1_with_sharp_weights_scores_hello_world_as_hugging_face_does() {
    check_against_hf(
        "hf_tiny_seed1_std05_hello_world.json",
        &["--init-std", "0.5"],
    );
}
