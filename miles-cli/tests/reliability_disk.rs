//! Issue 18's disk cases, run against the built `miles` binary: links planted under the offload
//! directory, two jobs on one directory, and what a killed job leaves behind. Each run is the
//! megatron disk example on the tiny preset (two tensor-parallel ranks, about a second a step).

// Helpers of a test crate are test code: they may unwrap and panic (clippy.toml covers only
// `#[test]` functions and `#[cfg(test)]` modules).
#![allow(clippy::unwrap_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// `miles train` on the megatron disk example, `steps` steps of the tiny preset on the CPU
/// device, offloading to `base`; run in `cwd` (the example writes its metrics and checkpoints
/// under `target/`).
fn train(cwd: &Path, base: &Path, steps: u32) -> Command {
    let config = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .join("examples/colocate-megatron-disk.toml");
    let mut command = Command::new(env!("CARGO_BIN_EXE_miles"));
    command
        .current_dir(cwd)
        .env("RUST_LOG", "warn")
        .arg("train")
        .arg("--config")
        .arg(config)
        .args(["--preset", "tiny", "--device", "cpu", "--steps"])
        .arg(steps.to_string())
        .arg("--offload-train-disk-dir")
        .arg(base);
    command
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn assert_status(output: &Output, code: i32) {
    assert_eq!(
        output.status.code(),
        Some(code),
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&output.stdout),
        stderr(output)
    );
}

/// Waits up to 30 s for `ready`.
fn wait_for(what: &str, ready: impl Fn() -> bool) {
    let start = Instant::now();
    while !ready() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// What a rank directory holds, but its lock file.
fn contents(rank_dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(rank_dir)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name != "lock")
        .collect();
    names.sort();
    names
}

#[test]
fn a_symlink_planted_anywhere_under_the_offload_directory_exits_2_leaving_its_target_untouched() {
    let victim_dir = tempfile::tempdir().unwrap();
    let victim = victim_dir.path().join("precious");
    std::fs::write(&victim, b"keep me").unwrap();
    let plants: [(&str, &Path); 4] = [
        ("offload/rank-0/params/data.bin", &victim),
        ("offload/rank-0/params", victim_dir.path()),
        ("offload/rank-0", victim_dir.path()),
        ("offload", victim_dir.path()),
    ];
    for (at, target) in plants {
        let scratch = tempfile::tempdir().unwrap();
        let base = scratch.path().join("disk");
        let link = base.join(at);
        std::fs::create_dir_all(link.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(target, &link).unwrap();
        let output = train(scratch.path(), &base, 1).output().unwrap();
        assert_status(&output, 2);
        let err = stderr(&output);
        assert!(
            err.contains(&link.display().to_string()),
            "names {at}: {err}"
        );
        assert!(err.contains("symbolic link"), "{err}");
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep me", "{at}");
        let beside = std::fs::read_dir(victim_dir.path()).unwrap().count();
        assert_eq!(
            beside, 1,
            "{at}: something was written beside the link's target"
        );
    }
}

#[test]
fn a_second_job_on_one_offload_directory_exits_2_naming_the_first_and_the_first_finishes() {
    let scratch = tempfile::tempdir().unwrap();
    let base = scratch.path().join("disk");
    let lock = base.join("offload/rank-0/lock");
    // Steps enough that the first job is still running once the second has been refused.
    let mut first = train(scratch.path(), &base, 40)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = first.id().to_string();
    wait_for("the first job's lock", || {
        std::fs::read_to_string(&lock).is_ok_and(|text| text.trim() == pid)
    });
    let second = train(scratch.path(), &base, 1).output().unwrap();
    assert!(
        first.try_wait().unwrap().is_none(),
        "the first job ended before the second started; the test proves nothing"
    );
    assert_status(&second, 2);
    let err = stderr(&second);
    assert!(
        err.contains(&format!("pid {pid}")),
        "names the first job's pid: {err}"
    );
    assert!(
        err.contains(&base.join("offload/rank-0").display().to_string()),
        "{err}"
    );
    let first = first.wait_with_output().unwrap();
    assert_status(&first, 0);
}

#[test]
fn leftovers_of_a_job_killed_mid_run_are_removed_by_the_next_job_saying_so() {
    let scratch = tempfile::tempdir().unwrap();
    let base = scratch.path().join("disk");
    let rank_dir = base.join("offload/rank-0");
    let mut killed = train(scratch.path(), &base, 50)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let manifest = rank_dir.join("params/manifest.json");
    wait_for("the killed job's first backup", || manifest.exists());
    killed.kill().unwrap();
    killed.wait().unwrap();
    // As a kill between moving a backup away and unlinking it leaves it: the trash name the
    // next job's first removal would use.
    let trash: PathBuf = rank_dir.join(".removing-0-params");
    std::fs::create_dir_all(&trash).unwrap();
    std::fs::write(trash.join("data.bin"), vec![1u8; 1 << 16]).unwrap();
    std::fs::write(trash.join("manifest.json"), b"{}").unwrap();
    let output = train(scratch.path(), &base, 2).output().unwrap();
    assert_status(&output, 0);
    let err = stderr(&output);
    assert!(
        err.contains("removed") && err.contains(".removing-0-params"),
        "{err}"
    );
    assert_eq!(contents(&rank_dir), Vec::<String>::new(), "{err}");
}

#[test]
fn a_killed_disk_bench_leaves_a_directory_the_next_bench_removes() {
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path();
    let stale = dir.join("miles-bench-offload-999999999");
    let tag_dir = stale.join("offload/rank-0/named-bench");
    std::fs::create_dir_all(&tag_dir).unwrap();
    std::fs::write(tag_dir.join("data.bin"), vec![3u8; 1 << 16]).unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_miles"))
        .env("RUST_LOG", "warn")
        .args([
            "bench", "offload", "--device", "cpu", "--size", "4MiB", "--cycles", "1",
        ])
        .args(["--target", "disk", "--disk-dir"])
        .arg(dir)
        .output()
        .unwrap();
    assert_status(&output, 0);
    assert!(!stale.exists(), "{}", stderr(&output));
    let left: Vec<_> = std::fs::read_dir(dir).unwrap().collect();
    assert!(left.is_empty(), "the bench leaves nothing behind: {left:?}");
}

#[test]
fn ppo_on_the_disk_target_keeps_the_actor_and_critic_backups_apart() {
    let scratch = tempfile::tempdir().unwrap();
    let config = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .join("examples/colocate-megatron-ppo.toml");
    let output = Command::new(env!("CARGO_BIN_EXE_miles"))
        .current_dir(scratch.path())
        .env("RUST_LOG", "warn")
        .arg("train")
        .arg("--config")
        .arg(config)
        .args([
            "--device",
            "cpu",
            "--steps",
            "1",
            "--offload-train-target",
            "disk",
        ])
        .arg("--offload-train-disk-dir")
        .arg(scratch.path().join("disk"))
        .output()
        .unwrap();
    assert_status(&output, 0);
}
