//! The acceptance lines of issue 2, run against the built `miles` binary.

// Helpers of a test crate are test code: they may unwrap and panic (clippy.toml covers only
// `#[test]` functions and `#[cfg(test)]` modules).
#![allow(clippy::unwrap_used, clippy::panic)]

use std::path::Path;
use std::process::{Command, Output};

fn miles(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_miles"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap()
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Runs `miles args`, asserts the exit status, and returns stdout and stderr.
fn expect(args: &[&str], code: i32) -> (String, String) {
    let output = miles(args);
    let (out, err) = (stdout(&output), stderr(&output));
    assert_eq!(
        output.status.code(),
        Some(code),
        "miles {args:?}\nstdout:\n{out}\nstderr:\n{err}"
    );
    (out, err)
}

#[test]
fn colocate_prints_every_setting_with_its_source() {
    let (out, _) = expect(&["check-config", "--colocate"], 0);
    assert!(
        out.contains("colocate = true") && out.contains("# flag"),
        "{out}"
    );
    let train = out
        .lines()
        .find(|l| l.starts_with("offload_train "))
        .unwrap();
    assert!(
        train.contains("true") && train.ends_with("# implied by --colocate"),
        "{train}"
    );
    let level = out
        .lines()
        .find(|l| l.starts_with("offload_rollout_level "))
        .unwrap();
    assert!(level.contains("[\"kv_cache\", \"weight\"]") && level.ends_with("# default"));
    assert!(
        out.contains("# offload_train_disk_dir = none  (default)"),
        "{out}"
    );
}

#[test]
fn colocate_with_offload_train_off_exits_2_naming_both_flags() {
    let (_, err) = expect(&["check-config", "--colocate", "--no-offload-train"], 2);
    assert!(
        err.contains("--colocate") && err.contains("--offload-train"),
        "{err}"
    );
}

#[test]
fn disk_target_without_offload_train_exits_2_naming_it() {
    let (_, err) = expect(&["check-config", "--offload-train-target", "disk"], 2);
    assert!(err.contains("requires --offload-train:"), "{err}");
}

#[test]
fn colocated_disk_target_needs_a_directory_and_a_chunk_size() {
    let (_, err) = expect(
        &[
            "check-config",
            "--colocate",
            "--offload-train-target",
            "disk",
        ],
        2,
    );
    assert!(err.contains("--offload-train-disk-dir"), "{err}");
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path().join("offload");
    let dir = dir.to_str().unwrap();
    let args = [
        "check-config",
        "--colocate",
        "--offload-train-target",
        "disk",
    ];
    let (_, err) = expect(
        &[
            &args[..],
            &[
                "--offload-train-disk-dir",
                dir,
                "--offload-train-disk-chunk-mb",
                "0",
            ],
        ]
        .concat(),
        2,
    );
    assert!(err.contains("--offload-train-disk-chunk-mb"), "{err}");
    assert!(!err.contains("requires --offload-train-disk-dir"), "{err}");
    expect(&[&args[..], &["--offload-train-disk-dir", dir]].concat(), 0);
    assert!(
        Path::new(dir).is_dir(),
        "the disk directory is created while checking"
    );
}

#[test]
fn plural_rollout_level_exits_2_suggesting_the_singular() {
    let args = [
        "check-config",
        "--colocate",
        "--offload-rollout-level",
        "weights",
    ];
    let (_, err) = expect(&args, 2);
    assert!(
        err.contains("`weights`") && err.contains("did you mean `weight`?"),
        "{err}"
    );
}

#[test]
fn fsdp_cpu_offload_yields_to_colocate_with_one_warning() {
    let args = [
        "check-config",
        "--train-backend",
        "fsdp",
        "--fsdp-cpu-offload",
        "--colocate",
    ];
    let (out, err) = expect(&args, 0);
    assert_eq!(err.matches("WARN").count(), 1, "{err}");
    assert!(err.contains("--fsdp-cpu-offload"), "{err}");
    let line = out
        .lines()
        .find(|l| l.starts_with("fsdp_cpu_offload "))
        .unwrap();
    assert!(line.contains("false"), "{line}");
    let (out, _) = expect(&[&args[..], &["--json"]].concat(), 0);
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(json["fsdp_cpu_offload"], false);
}

#[test]
fn fsdp_cpu_offload_with_megatron_exits_2() {
    let args = [
        "check-config",
        "--train-backend",
        "megatron",
        "--fsdp-cpu-offload",
        "--colocate",
    ];
    let (_, err) = expect(&args, 2);
    assert!(
        err.contains("--fsdp-cpu-offload") && err.contains("--train-backend"),
        "{err}"
    );
}

#[test]
fn colocate_json_shows_both_offloads_and_the_default_level() {
    let (out, _) = expect(&["check-config", "--colocate", "--json"], 0);
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(json["offload_train"], true);
    assert_eq!(json["offload_rollout"], true);
    assert_eq!(
        json["offload_rollout_level"],
        serde_json::json!(["kv_cache", "weight"])
    );
    assert_eq!(json["train_backend"], "megatron");
    assert!(json["offload_train_disk_dir"].is_null());
}

#[test]
fn unknown_toml_key_exits_2_naming_the_key_and_line() {
    let scratch = tempfile::tempdir().unwrap();
    let file = scratch.path().join("run.toml");
    std::fs::write(&file, "colocate = true\noffload_trian = true\n").unwrap();
    let (_, err) = expect(&["check-config", "--config", file.to_str().unwrap()], 2);
    assert!(
        err.contains("`offload_trian`") && err.contains("line 2"),
        "{err}"
    );
    assert!(err.contains("did you mean `offload_train`?"), "{err}");
}

#[test]
fn flags_override_the_config_file() {
    let scratch = tempfile::tempdir().unwrap();
    let file = scratch.path().join("run.toml");
    std::fs::write(&file, "steps = 5\nseed = 3\ncolocate = true\n").unwrap();
    let config = file.to_str().unwrap();
    let (out, _) = expect(&["check-config", "--config", config, "--steps", "7"], 0);
    assert!(
        out.lines()
            .any(|l| l.starts_with("steps = 7 ") && l.ends_with("# flag")),
        "{out}"
    );
    assert!(
        out.lines()
            .any(|l| l.starts_with("seed = 3 ") && l.ends_with("# file")),
        "{out}"
    );
    let (out, _) = expect(&["check-config", "--config", config, "--json"], 0);
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(json["offload_train"], true);
}

#[test]
fn check_config_output_is_itself_a_valid_config_file() {
    let (out, _) = expect(&["check-config", "--colocate", "--steps", "4"], 0);
    let scratch = tempfile::tempdir().unwrap();
    let file = scratch.path().join("resolved.toml");
    std::fs::write(&file, &out).unwrap();
    let (again, _) = expect(
        &["check-config", "--json", "--config", file.to_str().unwrap()],
        0,
    );
    let json: serde_json::Value = serde_json::from_str(&again).unwrap();
    assert_eq!(json["steps"], 4);
    assert_eq!(json["colocate"], true);
}

#[test]
fn every_broken_rule_is_printed_at_once() {
    let args = [
        "check-config",
        "--colocate",
        "--no-offload-rollout",
        "--offload-rollout-level",
        "weights",
        "--fsdp-cpu-offload",
    ];
    let (_, err) = expect(&args, 2);
    assert!(err.contains("--offload-rollout,"), "{err}");
    assert!(err.contains("did you mean `weight`?"), "{err}");
    assert!(err.contains("--fsdp-cpu-offload requires"), "{err}");
}

#[test]
fn unknown_flag_value_is_a_usage_error_with_status_2() {
    let (_, err) = expect(&["check-config", "--train-backend", "fsdpp"], 2);
    assert!(err.contains("did you mean `fsdp`?"), "{err}");
}

#[test]
fn doctor_exits_0_and_reports_cuda_either_way() {
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path().to_str().unwrap();
    let (out, _) = expect(&["doctor", "--offload-train-disk-dir", dir], 0);
    assert!(out.contains("cpu cores"), "{out}");
    assert!(out.contains(&format!("disk {dir}:")), "{out}");
    let cuda = out.lines().find(|l| l.starts_with("cuda: ")).unwrap();
    let driver_loads = miles_core::device::probe::probe_cuda().is_ok();
    assert_eq!(
        cuda.starts_with("cuda: no CUDA driver found"),
        !driver_loads,
        "{cuda}"
    );
    let (out, _) = expect(&["doctor", "--json"], 0);
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(json["cuda"]["available"], driver_loads);
    assert!(json["host"]["cpu_cores"].as_u64().unwrap() >= 1);
}

#[test]
fn offload_sets_both_switches_without_colocate() {
    let (out, _) = expect(&["check-config", "--offload", "--json"], 0);
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(json["offload_train"], true);
    assert_eq!(json["offload_rollout"], true);
    assert_eq!(json["colocate"], false);
}

#[test]
fn disk_directory_on_tmpfs_is_accepted_with_a_warning() {
    let shm = Path::new("/dev/shm");
    let on_tmpfs = miles_core::device::probe::filesystem(shm).is_ok_and(|fs| fs.is_tmpfs());
    if !on_tmpfs {
        return;
    }
    let scratch = tempfile::tempdir_in(shm).unwrap();
    let dir = scratch.path().to_str().unwrap();
    let args = [
        "check-config",
        "--colocate",
        "--offload-train-target",
        "disk",
    ];
    let (_, err) = expect(&[&args[..], &["--offload-train-disk-dir", dir]].concat(), 0);
    assert!(err.contains("WARN") && err.contains("tmpfs"), "{err}");
    let (out, _) = expect(&["doctor", "--offload-train-disk-dir", dir], 0);
    assert!(out.contains("tmpfs is RAM, not disk"), "{out}");
}

#[test]
fn generate_samples_a_checkpoint_reproducibly() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let ck = ck.to_str().unwrap();
    expect(
        &[
            "model", "init", "--preset", "tiny", "--seed", "4", "--out", ck,
        ],
        0,
    );
    let args = [
        "generate",
        "--checkpoint",
        ck,
        "--prompt",
        "hi",
        "--prompt",
        "there",
        "-n",
        "3",
        "--seed",
        "9",
        "--max-new-tokens",
        "6",
        "--json",
    ];
    let (first, _) = expect(&args, 0);
    let (second, _) = expect(&args, 0);
    let value: serde_json::Value = serde_json::from_str(&first).unwrap();
    let completions = value["completions"].as_array().unwrap();
    assert_eq!(completions.len(), 6, "{first}");
    assert!(
        completions
            .iter()
            .all(|c| c["tokens"].as_array().unwrap().len()
                == c["logprobs"].as_array().unwrap().len())
    );
    let tokens = |text: &str| {
        let v: serde_json::Value = serde_json::from_str(text).unwrap();
        v["completions"].clone()
    };
    assert_eq!(tokens(&first), tokens(&second), "same seed, same samples");
    let (text, _) = expect(
        &["generate", "--checkpoint", ck, "--prompt", "hi", "-n", "2"],
        0,
    );
    assert!(text.contains("[prompt 0 sample 1]"), "{text}");
    let (_, err) = expect(
        &[
            "generate",
            "--checkpoint",
            ck,
            "--prompt",
            "hi",
            "--device",
            "cuda",
        ],
        2,
    );
    assert!(err.contains("--device cpu"), "{err}");
}

#[test]
fn bench_rollout_reports_decode_speed_and_every_offload_step() {
    let (out, _) = expect(
        &[
            "bench",
            "rollout",
            "--preset",
            "tiny",
            "--device",
            "cpu",
            "--prompts",
            "2",
            "--max-new-tokens",
            "4",
            "--cycles",
            "1",
            "--json",
        ],
        0,
    );
    let value: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(
        value["decode_tokens_per_second"].as_f64().unwrap() > 0.0,
        "{out}"
    );
    assert!(
        value["baseline_bare_decode_tokens_per_second"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    assert_eq!(value["identical_after_cycles"], true, "{out}");
    let steps: Vec<String> = value["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            format!(
                "{}/{}",
                s["level"].as_str().unwrap(),
                s["step"].as_str().unwrap()
            )
        })
        .collect();
    for want in [
        "kv_cache/offload_kv",
        "kv_cache/onload_kv",
        "weight/offload_weights",
        "weight/onload_weights",
        "kv_cache+weight/update_weights",
    ] {
        assert!(
            steps.iter().any(|s| s == want),
            "{want} missing from {steps:?}"
        );
    }
}

#[test]
fn bench_offload_with_two_ranks_reports_each_rank_and_both_together() {
    let mib = 1 << 20;
    let (out, _) = expect(
        &[
            "bench",
            "offload",
            "--device",
            "cpu",
            "--device-memory-gib",
            "1",
            "--size",
            "32MiB",
            "--cycles",
            "2",
            "--target",
            "host",
            "--nproc-per-node",
            "2",
            "--json",
        ],
        0,
    );
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(json["ranks"], 2, "{json}");
    let cycles = json["cycles"].as_array().unwrap();
    assert_eq!(cycles.len(), 2);
    for cycle in cycles {
        for op in ["pause", "resume", "copy_out", "copy_in"] {
            let per_rank = cycle[op]["per_rank_gbps"].as_array().unwrap();
            assert_eq!(per_rank.len(), 2, "{op}: {cycle}");
            assert!(cycle[op]["aggregate_gbps"].as_f64().unwrap() > 0.0, "{op}");
        }
        let before = cycle["resident_before_pause"].as_array().unwrap();
        let after = cycle["resident_after_pause"].as_array().unwrap();
        for (b, a) in before.iter().zip(after) {
            let freed = b.as_u64().unwrap() - a.as_u64().unwrap();
            assert!(freed >= 32 * mib, "each rank frees its tag: {freed} bytes");
        }
    }
    for side in ["pause", "resume"] {
        assert!(json["ratio"][side].as_f64().unwrap().is_finite(), "{json}");
    }
}

#[test]
fn bench_offload_ranks_refuse_the_disk_target_with_status_2() {
    let (_, err) = expect(
        &[
            "bench",
            "offload",
            "--device",
            "cpu",
            "--size",
            "4MiB",
            "--target",
            "disk",
            "--disk-dir",
            "/tmp",
            "--nproc-per-node",
            "2",
        ],
        2,
    );
    assert!(err.contains("--target disk"), "{err}");
    assert!(err.contains("refused its settings"), "{err}");
}

#[test]
fn nproc_per_node_under_a_launcher_exits_2_naming_the_flag() {
    let output = Command::new(env!("CARGO_BIN_EXE_miles"))
        .args([
            "bench",
            "offload",
            "--device",
            "cpu",
            "--size",
            "4MiB",
            "--nproc-per-node",
            "2",
        ])
        .env("RUST_LOG", "warn")
        .env("RANK", "1")
        .env("WORLD_SIZE", "2")
        .env("LOCAL_RANK", "1")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", "1")
        .env("MILES_JOB_SECRET", "a-secret-of-this-test-job")
        .output()
        .unwrap();
    let err = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{err}");
    assert!(err.contains("--nproc-per-node 2"), "{err}");
    assert!(err.contains("rank 1 of 2"), "{err}");
}

#[test]
fn bench_train_over_several_processes_needs_the_gpu() {
    let (_, err) = expect(
        &[
            "bench",
            "train",
            "--preset",
            "tiny",
            "--nproc-per-node",
            "2",
        ],
        2,
    );
    assert!(err.contains("--device cuda"), "{err}");
}

#[test]
fn train_over_several_processes_refuses_the_cpu_device_naming_the_flag() {
    let (_, err) = expect(
        &[
            "train",
            "--device",
            "cpu",
            "--preset",
            "tiny",
            "--steps",
            "1",
            "--nproc-per-node",
            "2",
        ],
        2,
    );
    assert!(err.contains("--device cuda"), "{err}");
    assert!(err.contains("refused its settings"), "{err}");
}

#[test]
fn a_rank_that_fails_stops_the_job_and_is_named() {
    let (_, err) = expect(
        &[
            "bench",
            "offload",
            "--device",
            "cpu",
            "--device-memory-gib",
            "1",
            "--size",
            "2GiB",
            "--target",
            "host",
            "--nproc-per-node",
            "2",
        ],
        1,
    );
    assert!(err.contains("out of device memory"), "{err}");
    assert!(err.contains("failed"), "{err}");
    assert!(err.contains("the other ranks were stopped"), "{err}");
}

#[test]
fn tensor_parallel_without_gpus_exits_2_naming_the_device_flag() {
    let (_, err) = expect(
        &["bench", "train", "--preset", "tiny", "--tensor-parallel"],
        2,
    );
    assert!(err.contains("--tensor-parallel"), "{err}");
    assert!(err.contains("--device cuda"), "{err}");
}

#[test]
fn bf16_gradient_reduction_in_bench_train_needs_data_parallel_gpus_exiting_2() {
    let (_, err) = expect(
        &[
            "bench",
            "train",
            "--preset",
            "tiny",
            "--grad-reduce-in-bf16",
        ],
        2,
    );
    assert!(
        err.contains("--grad-reduce-in-bf16") && err.contains("--device cuda"),
        "{err}"
    );
    // On cuda with one process it is refused before any gpu is opened.
    let (_, err) = expect(
        &[
            "bench",
            "train",
            "--device",
            "cuda",
            "--preset",
            "tiny",
            "--grad-reduce-in-bf16",
        ],
        2,
    );
    assert!(err.contains("--nproc-per-node 2"), "{err}");
}

#[test]
fn full_sharding_in_bench_train_needs_fp32_data_parallel_gpus_exiting_2() {
    let bench = ["bench", "train", "--preset", "tiny", "--fully-shard"];
    let (_, err) = expect(&bench, 2);
    assert!(
        err.contains("--fully-shard") && err.contains("--device cuda"),
        "{err}"
    );
    for other in ["--tensor-parallel", "--grad-reduce-in-bf16"] {
        let (_, err) = expect(&[&bench[..], &["--device", "cuda", other]].concat(), 2);
        assert!(
            err.contains("--fully-shard") && err.contains(other),
            "{err}"
        );
    }
    // On cuda with one process it is refused before any gpu is opened.
    let (_, err) = expect(&[&bench[..], &["--device", "cuda"]].concat(), 2);
    assert!(err.contains("--nproc-per-node 2"), "{err}");
}

#[test]
fn overlapped_gradient_sums_in_bench_train_need_fp32_data_parallel_gpus_exiting_2() {
    let bench = [
        "bench",
        "train",
        "--preset",
        "tiny",
        "--overlap-grad-reduce",
    ];
    let (_, err) = expect(&bench, 2);
    assert!(
        err.contains("--overlap-grad-reduce") && err.contains("--device cuda"),
        "{err}"
    );
    for other in ["--tensor-parallel", "--grad-reduce-in-bf16"] {
        let (_, err) = expect(&[&bench[..], &["--device", "cuda", other]].concat(), 2);
        assert!(
            err.contains("--overlap-grad-reduce") && err.contains(other),
            "{err}"
        );
    }
    // Fully sharded, the layers' gathers run ahead on the same second communicator.
    for with in [&[][..], &["--fully-shard"]] {
        let (_, err) = expect(&[&bench[..], &["--device", "cuda"], with].concat(), 2);
        assert!(err.contains("--nproc-per-node 2"), "{err}");
    }
}

#[test]
fn bench_train_phases_on_the_cpu_exit_2_naming_the_device() {
    let (_, err) = expect(&["bench", "train", "--preset", "tiny", "--phases"], 2);
    assert!(
        err.contains("--phases") && err.contains("--device cuda"),
        "{err}"
    );
}

#[test]
fn bench_sizes_of_zero_exit_2_naming_the_flag_before_any_work() {
    for (args, flag) in [
        (
            &["bench", "train", "--preset", "tiny", "--batch", "0"][..],
            "--batch",
        ),
        (
            &["bench", "train", "--preset", "tiny", "--steps", "0"],
            "--steps",
        ),
        (
            &[
                "bench",
                "train",
                "--preset",
                "tiny",
                "--nproc-per-node",
                "0",
            ],
            "--nproc-per-node",
        ),
        (
            &["bench", "rollout", "--preset", "tiny", "--prompts", "0"],
            "--prompts",
        ),
        (
            &["bench", "rollout", "--preset", "tiny", "--prompt-len", "0"],
            "--prompt-len",
        ),
        (
            &[
                "bench",
                "rollout",
                "--preset",
                "tiny",
                "--max-new-tokens",
                "0",
            ],
            "--max-new-tokens",
        ),
    ] {
        let (out, err) = expect(args, 2);
        assert!(err.contains(flag), "miles {args:?}: {err}");
        assert!(out.is_empty(), "miles {args:?} ran before refusing: {out}");
    }
}

#[test]
fn the_readme_settings_table_is_the_one_the_settings_table_prints() {
    let (table, _) = expect(&["check-config", "--table"], 0);
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md"))
            .unwrap();
    assert!(
        readme.contains(table.trim()),
        "README.md's settings table differs from `miles check-config --table`; paste its output:\n{table}"
    );
}

#[test]
fn check_config_text_is_a_config_file_even_with_a_newline_in_a_path() {
    let dir = tempfile::tempdir().unwrap();
    let odd = dir.path().join("odd\nname");
    let (text, _) = expect(
        &[
            "check-config",
            "--offload-train",
            "--offload-train-target",
            "disk",
            "--offload-train-disk-dir",
            odd.to_str().unwrap(),
        ],
        0,
    );
    let file = dir.path().join("resolved.toml");
    std::fs::write(&file, &text).unwrap();
    let (again, _) = expect(
        &["check-config", "--config", file.to_str().unwrap(), "--json"],
        0,
    );
    let json: serde_json::Value = serde_json::from_str(&again).unwrap();
    assert_eq!(
        json["offload_train_disk_dir"],
        odd.to_str().unwrap(),
        "{text}"
    );
}

#[test]
fn values_outside_their_ranges_exit_2_naming_the_flag() {
    for (flag, value) in [
        ("--offload-train-disk-chunk-mb", "17592186044416"),
        ("--device-memory-gib", "1e30"),
        ("--steps", "0"),
        ("--lr", "-1"),
    ] {
        let (_, err) = expect(&["check-config", flag, value], 2);
        assert!(err.contains(flag), "{flag} {value}: {err}");
    }
    // Said once, not once by the range and again by a rule of its own.
    for flag in ["--rollout-max-prompt-len", "--rollout-max-response-len"] {
        let (_, err) = expect(&["check-config", flag, "0"], 2);
        assert_eq!(err.matches(flag).count(), 1, "{flag} 0: {err}");
    }
}

#[test]
fn settings_knowable_before_work_exit_2_within_a_second_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let file_in_place = dir.path().join("disk");
    std::fs::create_dir_all(&file_in_place).unwrap();
    std::fs::write(file_in_place.join("offload"), b"a file, not a directory").unwrap();
    let missing = dir.path().join("no-such-checkpoint");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--preset", "7b"], "--preset 7b"),
        (
            vec!["--colocate", "--offload-rollout-level", ""],
            "--offload-rollout-level",
        ),
        (vec!["--data-parallel-size", "1000"], "--data-parallel-size"),
        (
            vec![
                "--device-memory-gib",
                "1",
                "--train-memory-margin-bytes",
                "2147483648",
            ],
            "--train-memory-margin-bytes",
        ),
        (vec!["--load", missing.to_str().unwrap()], "--load"),
        (
            vec![
                "--offload-train",
                "--offload-train-target",
                "disk",
                "--offload-train-disk-dir",
                file_in_place.to_str().unwrap(),
            ],
            "is not a directory",
        ),
    ];
    for (flags, named) in cases {
        for command in ["check-config", "train"] {
            let mut args = vec![command, "--device", "cpu"];
            args.extend(&flags);
            let started = std::time::Instant::now();
            let (_, err) = expect(&args, 2);
            assert!(err.contains(named), "{args:?}: {err}");
            assert!(
                started.elapsed() < std::time::Duration::from_secs(5),
                "{args:?} took {:?}",
                started.elapsed()
            );
        }
    }
}

#[test]
fn bad_sampling_values_of_generate_exit_2_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("tiny");
    expect(
        &[
            "model",
            "init",
            "--preset",
            "tiny",
            "--seed",
            "1",
            "--out",
            ckpt.to_str().unwrap(),
        ],
        0,
    );
    for (flag, value, named) in [
        ("--top-p", "2", "top_p"),
        ("--max-new-tokens", "0", "max_new_tokens"),
        ("--temperature", "nan", "temperature"),
    ] {
        let (_, err) = expect(
            &[
                "generate",
                "--device",
                "cpu",
                "--checkpoint",
                ckpt.to_str().unwrap(),
                "--prompt",
                "hi",
                flag,
                value,
            ],
            2,
        );
        assert!(err.contains(named), "{flag} {value}: {err}");
    }
}

#[test]
fn trainer_flags_the_cuda_trainers_lack_are_bad_settings_naming_the_flag_and_the_device() {
    for (flag, value) in [("--entropy-coef", "0.1"), ("--micro-batch-size", "2")] {
        let (_, err) = expect(
            &["train", "--device", "cuda", flag, value, "--steps", "1"],
            2,
        );
        assert!(
            err.contains(flag) && err.contains("--device cpu"),
            "{flag}: {err}"
        );
    }
    let (_, err) = expect(
        &[
            "train",
            "--device",
            "cpu",
            "--offload-when-needed",
            "--steps",
            "1",
        ],
        2,
    );
    assert!(
        err.contains("--offload-when-needed") && err.contains("--device cuda"),
        "{err}"
    );
    let (_, err) = expect(&["train", "--rollout-stop", "", "--steps", "1"], 2);
    assert!(err.contains("--rollout-stop"), "{err}");
}

#[test]
fn streamed_master_weights_on_the_cpu_device_exit_2_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().to_str().unwrap();
    let (_, err) = expect(
        &[
            "train",
            "--device",
            "cpu",
            "--preset",
            "tiny",
            "--steps",
            "1",
            "--stream-optimizer-state-to-disk",
            "--stream-optimizer-master-weights",
            "--offload-train-disk-dir",
            disk,
        ],
        2,
    );
    assert!(err.contains("--stream-optimizer-master-weights"), "{err}");
    assert!(err.contains("cuda only"), "{err}");
}
