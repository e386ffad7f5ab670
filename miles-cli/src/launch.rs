//! `--nproc-per-node N`: run N copies of this command on this machine, one per GPU, with the
//! variables torchrun would set (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
//! `MASTER_ADDR`, `MASTER_PORT`), so that each copy finds its place as under any launcher.

use std::ffi::OsString;
use std::net::TcpListener;
use std::process::{Child, Command, ExitStatus};
use std::time::Duration;

use anyhow::Context;
use miles_core::LaunchEnv;

use crate::settings_args::BadSettings;

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

/// Starts `nproc` copies of this process's command line (without `--nproc-per-node`) as ranks
/// `0..nproc` of one job on this machine and waits for them. Rank 0 listens on a free local
/// port. When a rank fails, the others are stopped.
///
/// # Errors
/// [`BadSettings`] when a rank exited with status 2 (its message is on stderr above); an error
/// naming the first rank that failed otherwise, or the spawn that failed.
pub fn run_local(nproc: usize) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("cannot find this program to start its ranks")?;
    let args = without_flag(std::env::args_os().skip(1));
    let port = TcpListener::bind(("127.0.0.1", 0))
        .and_then(|listener| listener.local_addr())
        .context("cannot find a free local port for rank 0")?
        .port();
    tracing::info!(
        nproc,
        port,
        "starting the ranks of this job on this machine"
    );
    let mut children: Vec<Child> = Vec::with_capacity(nproc);
    for rank in 0..nproc {
        let spawned = Command::new(&exe)
            .args(&args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", nproc.to_string())
            .env("LOCAL_WORLD_SIZE", nproc.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .spawn();
        match spawned {
            Ok(child) => children.push(child),
            Err(error) => {
                stop(&mut children);
                return Err(error).with_context(|| format!("cannot start rank {rank}"));
            }
        }
    }
    wait_all(&mut children)
}

/// Waits until every child exits 0, or one fails: then stops the rest and says which.
fn wait_all(children: &mut [Child]) -> anyhow::Result<()> {
    let mut done = vec![false; children.len()];
    loop {
        for (rank, child) in children.iter_mut().enumerate() {
            if done[rank] {
                continue;
            }
            let status = child
                .try_wait()
                .with_context(|| format!("cannot wait for rank {rank}"))?;
            match status {
                Some(status) if status.success() => done[rank] = true,
                Some(status) => {
                    stop(children);
                    return Err(failed(rank, status));
                }
                None => {}
            }
        }
        if done.iter().all(|&d| d) {
            return Ok(());
        }
        std::thread::sleep(POLL);
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
    use super::*;

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
