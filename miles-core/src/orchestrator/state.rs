//! The loop's own checkpoint: the step, the warm-up done, the seed and task, the reward
//! history. Prompts and sampling seeds are keyed by `(seed, step)`, so the step is the whole
//! position of every generator.
//!
//! A save writes `DIR/step-<N>/` (`actor/`, `critic/`, `loop_state.json`, the last written
//! atomically), flushes every file and directory of it to the disk
//! ([`sync_tree`](crate::model::sync_tree)), then
//! points `DIR/latest` at it; a crash mid-save, the machine's included, leaves the previous
//! checkpoint in use.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::OrchestratorError;
use crate::config::Task;
use crate::model::sync_file;

/// The loop's state file inside a checkpoint directory.
pub const STATE_FILE: &str = "loop_state.json";
/// The file in `--save` naming the newest checkpoint directory.
pub const LATEST_FILE: &str = "latest";

/// Where the loop stands.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LoopState {
    /// RL steps finished.
    pub step: u64,
    /// Supervised warm-up steps finished.
    pub warmup_steps: u64,
    /// The run's seed.
    pub seed: u64,
    /// The task.
    pub task: Option<Task>,
    /// Mean reward of every finished step, in order.
    pub reward_means: Vec<f32>,
}

impl LoopState {
    /// Writes the state into checkpoint directory `dir`, atomically (write, sync, rename).
    ///
    /// # Errors
    /// [`OrchestratorError::Io`].
    pub fn write(&self, dir: &Path) -> Result<(), OrchestratorError> {
        let text = serde_json::to_string_pretty(self).map_err(|e| OrchestratorError::State {
            path: dir.join(STATE_FILE),
            reason: e.to_string(),
        })?;
        write_atomic(&dir.join(STATE_FILE), text.as_bytes())
    }

    /// Reads the state of checkpoint directory `dir`.
    ///
    /// # Errors
    /// [`OrchestratorError::Io`] when it cannot be read, [`OrchestratorError::State`] when it
    /// does not parse.
    pub fn read(dir: &Path) -> Result<LoopState, OrchestratorError> {
        let path = dir.join(STATE_FILE);
        let text = std::fs::read_to_string(&path).map_err(|source| OrchestratorError::Io {
            action: "read",
            path: path.clone(),
            source,
        })?;
        serde_json::from_str(&text).map_err(|e| OrchestratorError::State {
            path,
            reason: e.to_string(),
        })
    }
}

/// The directory of the checkpoint after `step` under `save`.
pub fn step_dir(save: &Path, step: u64) -> PathBuf {
    save.join(format!("step-{step:08}"))
}

/// Points `save/latest` at `checkpoint` (a directory inside `save`).
///
/// # Errors
/// [`OrchestratorError::Io`].
pub fn mark_latest(save: &Path, checkpoint: &Path) -> Result<(), OrchestratorError> {
    let name = checkpoint
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    write_atomic(&save.join(LATEST_FILE), name.as_bytes())
}

/// The checkpoint `--load dir` means: the one `dir/latest` names, else `dir` itself.
///
/// # Errors
/// [`OrchestratorError::Io`] when `latest` exists but cannot be read.
pub fn resolve_checkpoint(dir: &Path) -> Result<PathBuf, OrchestratorError> {
    let latest = dir.join(LATEST_FILE);
    if !latest.exists() {
        return Ok(dir.to_path_buf());
    }
    let name = std::fs::read_to_string(&latest).map_err(|source| OrchestratorError::Io {
        action: "read",
        path: latest.clone(),
        source,
    })?;
    let name = name.trim();
    let mut components = Path::new(name).components();
    let one_child = matches!(
        (components.next(), components.next()),
        (Some(std::path::Component::Normal(_)), None)
    );
    let checkpoint = dir.join(name);
    if !one_child || !checkpoint.is_dir() {
        return Err(OrchestratorError::State {
            path: latest,
            reason: format!(
                "it names `{name}`, which is not a checkpoint directory inside {}",
                dir.display()
            ),
        });
    }
    Ok(checkpoint)
}

/// The loop's error for `action` on `path`.
pub(crate) fn io(
    action: &'static str,
    path: &Path,
) -> impl FnOnce(std::io::Error) -> OrchestratorError {
    let path = path.to_path_buf();
    move |source| OrchestratorError::Io {
        action,
        path,
        source,
    }
}

/// Writes `path` whole or not at all, durably: a synced temporary file renamed into place, then
/// its directory synced (so the rename itself survives a crash of the machine).
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), OrchestratorError> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).map_err(io("write", &tmp))?;
    sync_path(&tmp)?;
    std::fs::rename(&tmp, path).map_err(io("rename into place", path))?;
    sync_parent(path)
}

/// Flushes the file or directory `path` to the disk.
///
/// # Errors
/// [`OrchestratorError::Io`] naming `path`.
fn sync_path(path: &Path) -> Result<(), OrchestratorError> {
    sync_file(path).map_err(io("sync", path))
}

/// Flushes the directory holding `path` (its entry for `path`) to the disk.
///
/// # Errors
/// [`OrchestratorError::Io`] naming the directory.
pub(crate) fn sync_parent(path: &Path) -> Result<(), OrchestratorError> {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => sync_path(parent),
        _ => sync_path(Path::new(".")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_latest_file_naming_a_path_outside_the_directory_is_refused() {
        let save = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        for name in [
            outside.path().to_str().unwrap().to_owned(),
            "../elsewhere".to_owned(),
            "step-00000009".to_owned(),
        ] {
            std::fs::write(save.path().join(LATEST_FILE), &name).unwrap();
            let err = resolve_checkpoint(save.path()).unwrap_err().to_string();
            assert!(err.contains("not a checkpoint directory"), "{name}: {err}");
        }
    }

    #[test]
    fn state_round_trips_and_latest_names_the_newest_checkpoint() {
        let save = tempfile::tempdir().unwrap();
        let state = LoopState {
            step: 4,
            warmup_steps: 2,
            seed: 9,
            task: Some(Task::Add),
            reward_means: vec![0.125, 0.25, 0.5, 0.75],
        };
        for step in [2, 4] {
            let dir = step_dir(save.path(), step);
            std::fs::create_dir_all(&dir).unwrap();
            LoopState {
                step,
                ..state.clone()
            }
            .write(&dir)
            .unwrap();
            mark_latest(save.path(), &dir).unwrap();
        }
        let dir = resolve_checkpoint(save.path()).unwrap();
        assert_eq!(dir, step_dir(save.path(), 4));
        assert_eq!(LoopState::read(&dir).unwrap(), state);
        // A checkpoint directory given directly is used as is.
        assert_eq!(resolve_checkpoint(&dir).unwrap(), dir);
    }

    #[test]
    fn garbled_state_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(STATE_FILE), "{ not json").unwrap();
        let error = LoopState::read(dir.path()).unwrap_err().to_string();
        assert!(error.contains(STATE_FILE), "{error}");
    }
}
