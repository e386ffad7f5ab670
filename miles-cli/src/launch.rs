//! `--nproc-per-node N`: run N copies of this command on this machine, one per GPU, with the
//! variables torchrun would set (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
//! `MASTER_ADDR`), so that each copy finds its place as under any launcher; plus a fresh job
//! secret and a private port file through which rank 0 publishes the port it bound itself
//! (no port is picked here and freed for rank 0 to take: another process could take it first).
//!
//! N is checked against the GPUs present (on the CPU device, against the cores) before anything
//! starts. SIGINT and SIGTERM are passed on to every rank, which stop, save and exit with 128 +
//! the signal; the ranks run in their own process group, so a Ctrl-C on the terminal reaches
//! them once, through here.

use std::ffi::OsString;
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus};
use std::time::Duration;

use anyhow::Context;
use miles_core::comm::{PORT_FILE_VAR, SECRET_VAR};
use miles_core::config::DeviceChoice;
use miles_core::{DeviceKind, LaunchEnv};
use rustix::process::{Pid, Signal, kill_process};

use crate::settings_args::BadSettings;
use crate::signals::Forwarder;

/// The flag this module answers, as the command line spells it.
const FLAG: &str = "--nproc-per-node";

/// How often the parent looks at its children.
const POLL: Duration = Duration::from_millis(50);

/// Where this process stands: `Some` when it is one rank of several (started by
/// `--nproc-per-node` or by a launcher), `None` for a single process.
///
/// # Errors
/// [`BadSettings`] (exit status 2) for launch variables that do not parse, naming the
/// variable, or for `--nproc-per-node` above 1 under a launcher that already started the ranks.
pub fn rank_env(nproc_per_node: usize) -> anyhow::Result<Option<LaunchEnv>> {
    let env = LaunchEnv::from_process_env().map_err(|error| BadSettings(error.to_string()))?;
    match env {
        Some(env) if env.world_size > 1 && nproc_per_node > 1 => Err(BadSettings(format!(
            "{FLAG} {nproc_per_node} starts its own processes, but a launcher already started this one as rank {} of {}; drop {FLAG} under torchrun, srun or mpirun",
            env.rank, env.world_size
        ))
        .into()),
        Some(env) if env.world_size > 1 => Ok(Some(env)),
        _ => Ok(None),
    }
}

/// The most ranks the CPU device runs on this machine: one per core, and two on a machine of
/// one core (so that a job of two can still be tried anywhere).
pub fn max_cpu_ranks() -> usize {
    std::thread::available_parallelism()
        .map_or(1, std::num::NonZero::get)
        .max(2)
}

/// Checks `nproc` ranks on the device `device` stands for: at most one per GPU present, or
/// [`max_cpu_ranks`] on the CPU device.
///
/// # Errors
/// [`BadSettings`] naming the flag, the bound and the fix.
pub fn check_nproc(nproc: usize, device: DeviceChoice) -> anyhow::Result<()> {
    let (bound, what) = match miles_core::device::resolve(device) {
        DeviceKind::Cpu => (
            max_cpu_ranks(),
            "cpu cores (the cpu device runs one rank per core)",
        ),
        DeviceKind::Cuda => match miles_core::device::probe::probe_cuda() {
            Ok(found) => (found.gpus.len(), "gpus"),
            Err(error) => {
                return Err(BadSettings(format!(
                    "{FLAG} {nproc} starts one process per gpu, but no gpu can be counted: {error}"
                ))
                .into());
            }
        },
    };
    if nproc > bound {
        return Err(BadSettings(format!(
            "{FLAG} {nproc} is more than this machine runs: it has {bound} {what}; use at most {FLAG} {bound}"
        ))
        .into());
    }
    Ok(())
}

/// Starts `nproc` copies of this process's command line (without `--nproc-per-node`) as ranks
/// `0..nproc` of one job on `device` on this machine and waits for them. When a rank fails, the
/// others are stopped; SIGINT and SIGTERM are passed on to every rank.
///
/// # Errors
/// [`BadSettings`] for more ranks than the machine runs ([`check_nproc`], before anything
/// starts) or when a rank exited with status 2 (its message is on stderr above);
/// [`Interrupted`](crate::signals::Interrupted) when a signal stopped the ranks; an error
/// naming the first rank that failed otherwise, or the spawn that failed.
pub fn run_local(nproc: usize, device: DeviceChoice) -> anyhow::Result<()> {
    check_nproc(nproc, device)?;
    let exe = std::env::current_exe().context("cannot find this program to start its ranks")?;
    let args = without_flag(std::env::args_os().skip(1));
    let mut forwarder = Forwarder::install()?;
    let dir = JobDir::create()?;
    let secret = fresh_secret();
    let port_file = dir.path.join("port");
    tracing::info!(nproc, "starting the ranks of this job on this machine");
    let mut children = spawn_ranks(nproc, |rank| {
        let mut command = Command::new(&exe);
        command
            .args(&args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", nproc.to_string())
            .env("LOCAL_WORLD_SIZE", nproc.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env_remove("MASTER_PORT")
            .env(PORT_FILE_VAR, &port_file)
            .env(SECRET_VAR, &secret)
            .process_group(0);
        command
    })?;
    wait_all(&mut children, &mut forwarder)
}

/// A private directory of one job (mode 0700), removed when dropped.
struct JobDir {
    path: PathBuf,
}

impl JobDir {
    fn create() -> anyhow::Result<JobDir> {
        let path = std::env::temp_dir().join(format!(
            "miles-job-{}-{:016x}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&path)
            .with_context(|| format!("cannot create the job directory {}", path.display()))?;
        Ok(JobDir { path })
    }
}

impl Drop for JobDir {
    fn drop(&mut self) {
        if let Err(error) = std::fs::remove_dir_all(&self.path) {
            tracing::warn!(dir = %self.path.display(), %error, "cannot remove the job directory");
        }
    }
}

/// 32 random bytes in hex: the secret of one job.
fn fresh_secret() -> String {
    rand::random::<[u8; 32]>()
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

/// Starts the command `command(rank)` of every rank of `0..nproc`; when one cannot start, stops
/// those already started.
fn spawn_ranks(
    nproc: usize,
    mut command: impl FnMut(usize) -> Command,
) -> anyhow::Result<Vec<Child>> {
    let mut children: Vec<Child> = Vec::with_capacity(nproc);
    for rank in 0..nproc {
        match command(rank).spawn() {
            Ok(child) => children.push(child),
            Err(error) => {
                stop(&mut children);
                return Err(error).with_context(|| {
                    format!("cannot start rank {rank}; the ranks already started were stopped")
                });
            }
        }
    }
    Ok(children)
}

/// Waits until every child exits 0, or one fails: then stops the rest and says which. Every
/// signal that arrives meanwhile is passed on; after one, the children are waited for however
/// they exit.
fn wait_all(children: &mut [Child], forwarder: &mut Forwarder) -> anyhow::Result<()> {
    let mut done = vec![false; children.len()];
    loop {
        for signal in forwarder.arrived() {
            forward(children, &done, signal);
        }
        for (rank, child) in children.iter_mut().enumerate() {
            if done[rank] {
                continue;
            }
            let status = child
                .try_wait()
                .with_context(|| format!("cannot wait for rank {rank}"))?;
            match status {
                Some(status) if status.success() || forwarder.received().is_some() => {
                    done[rank] = true;
                }
                Some(status) => {
                    stop(children);
                    return Err(failed(rank, status));
                }
                None => {}
            }
        }
        if done.iter().all(|&d| d) {
            return match forwarder.received() {
                Some(stopped) => Err(stopped.into()),
                None => Ok(()),
            };
        }
        std::thread::sleep(POLL);
    }
}

/// Sends `signal` to every child still running.
fn forward(children: &[Child], done: &[bool], signal: i32) {
    let Some(sent) = Signal::from_named_raw(signal) else {
        return;
    };
    tracing::warn!(signal, "passing the signal on to the ranks");
    for (child, _) in children.iter().zip(done).filter(|(_, done)| !**done) {
        if let Err(error) = kill_process(Pid::from_child(child), sent) {
            tracing::warn!(%error, pid = child.id(), "cannot pass the signal on to a rank");
        }
    }
}

/// The error of rank `rank` that exited with `status`.
fn failed(rank: usize, status: ExitStatus) -> anyhow::Error {
    if status.code() == Some(2) {
        BadSettings(format!(
            "rank {rank} refused its settings (its message is above)"
        ))
        .into()
    } else {
        anyhow::anyhow!("rank {rank} failed ({status}); the other ranks were stopped")
    }
}

/// Kills and reaps every child still running.
fn stop(children: &mut [Child]) {
    for child in children {
        if matches!(child.try_wait(), Ok(None))
            && let Err(error) = child.kill()
        {
            tracing::warn!(%error, "cannot stop a rank");
        }
        if let Err(error) = child.wait() {
            tracing::warn!(%error, "cannot reap a rank");
        }
    }
}

/// `args` without `--nproc-per-node N` or `--nproc-per-node=N`.
fn without_flag(args: impl Iterator<Item = OsString>) -> Vec<OsString> {
    let mut kept = Vec::new();
    let mut skip_value = false;
    for arg in args {
        if skip_value {
            skip_value = false;
            continue;
        }
        match arg.to_str() {
            Some(text) if text == FLAG => skip_value = true,
            Some(text) if text.starts_with(FLAG) && text[FLAG.len()..].starts_with('=') => {}
            _ => kept.push(arg),
        }
    }
    kept
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    #[test]
    fn more_ranks_than_cores_are_refused_on_the_cpu_device() {
        check_nproc(max_cpu_ranks(), DeviceChoice::Cpu).unwrap();
        let error = check_nproc(100_000, DeviceChoice::Cpu).unwrap_err();
        assert!(crate::settings_args::is_bad_settings(&error), "{error}");
        let text = error.to_string();
        assert!(text.contains("--nproc-per-node 100000"), "{text}");
        assert!(
            text.contains(&format!("at most --nproc-per-node {}", max_cpu_ranks())),
            "{text}"
        );
    }

    #[test]
    fn a_rank_that_cannot_start_stops_those_already_started() {
        let started = Instant::now();
        let error = spawn_ranks(3, |rank| {
            if rank == 2 {
                Command::new("/nonexistent/miles-rank")
            } else {
                let mut sleep = Command::new("sleep");
                sleep.arg("30");
                sleep
            }
        })
        .unwrap_err();
        assert!(
            format!("{error:#}").contains("cannot start rank 2"),
            "{error:#}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the ranks already started were waited for instead of stopped"
        );
    }

    #[test]
    fn a_job_secret_is_64_hex_digits_and_fresh_each_time() {
        let (a, b) = (fresh_secret(), fresh_secret());
        assert_eq!(a.len(), 64);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()), "{a}");
        assert_ne!(a, b);
    }

    fn strip(args: &[&str]) -> Vec<String> {
        without_flag(args.iter().map(OsString::from))
            .into_iter()
            .map(|arg| arg.into_string().unwrap_or_default())
            .collect()
    }

    #[test]
    fn the_flag_and_its_value_are_dropped_in_both_spellings() {
        assert_eq!(
            strip(&["bench", "offload", "--nproc-per-node", "2", "--json"]),
            ["bench", "offload", "--json"]
        );
        assert_eq!(
            strip(&["bench", "--nproc-per-node=4", "offload"]),
            ["bench", "offload"]
        );
        assert_eq!(
            strip(&["bench", "--nproc-per-nodes", "x"]),
            ["bench", "--nproc-per-nodes", "x"]
        );
    }
}
