//! Checkpoints of the loop (`--save`, `--save-interval`, `--load`): actor, critic and loop
//! state written whole into a hidden directory and renamed into place, and read back.

use std::path::Path;
use std::time::Instant;

use super::Orchestrator;
use crate::backend::BackendError;
use crate::model::{export_hf, sync_tree};
use crate::orchestrator::OrchestratorError;
use crate::orchestrator::state::{
    LoopState, STATE_FILE, io, mark_latest, resolve_checkpoint, step_dir, sync_parent,
};

impl Orchestrator {
    pub(super) fn save_due(&self, step: u64) -> bool {
        self.config.save.is_some()
            && (step == self.config.steps
                || self
                    .config
                    .save_interval
                    .is_some_and(|every| step.is_multiple_of(every)))
    }

    /// Writes `save/step-<N>/` (actor, critic, loop state last) and marks it latest (on a rank
    /// that [assists](Orchestrator::assist_saves), only the actor's part of the save). The
    /// checkpoint is written into `save/.step-<N>.partial/`, synced to the disk, and renamed
    /// into place whole, so a run killed mid-save (or a machine that loses power) leaves the
    /// previous checkpoint in use and only that hidden directory, which the next save removes.
    pub(super) fn save(&mut self) -> Result<(), OrchestratorError> {
        let Some(save) = self.config.save.clone() else {
            return Ok(());
        };
        if self.assists_saves {
            self.assist_save()?;
            self.saved_step = Some(self.state.step);
            return Ok(());
        }
        let dir = step_dir(&save, self.state.step);
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let partial = save.join(format!(".{name}{PARTIAL}"));
        let ready = remove_partial_saves(&save).and_then(|()| {
            std::fs::create_dir_all(partial.join("actor")).map_err(io("create", &partial))
        });
        if let Err(error) = ready {
            // The other ranks wait in the save's gathers: send them this rank's part first.
            if let Err(also) = self.assist_save() {
                tracing::error!(%also, "cannot take part in the other ranks' save either");
            }
            return Err(error);
        }
        let start = Instant::now();
        // A backend gathers its state before it writes: an actor whose files fail has sent
        // its part, and the critic's part still goes to the ranks waiting in its gathers. (A
        // failure before the actor's gathers is one every rank meets alike: offloaded state,
        // or a broken communicator.)
        let actor = self.save_actor(&partial);
        if let Some(critic) = &mut self.critic {
            let critic_dir = partial.join("critic");
            match actor
                .and_then(|()| std::fs::create_dir_all(&critic_dir).map_err(io("create", &partial)))
            {
                Ok(()) => critic
                    .save(&critic_dir)
                    .map_err(OrchestratorError::train("critic", "save"))?,
                Err(error) => {
                    if let Err(also) = critic.assist_save() {
                        tracing::error!(%also, "cannot take part in the other ranks' save of the critic either");
                    }
                    return Err(error);
                }
            }
        } else {
            actor?;
        }
        self.state.write(&partial)?;
        let written = start.elapsed();
        // On the disk before it is renamed into place and named latest, in that order.
        sync_tree(&partial, &|action, path, source| io(action, path)(source))?;
        let synced = start.elapsed();
        if dir.exists() {
            let old = save.join(format!(".{name}.old{PARTIAL}"));
            std::fs::rename(&dir, &old).map_err(io("move aside", &dir))?;
            std::fs::rename(&partial, &dir).map_err(io("rename into place", &dir))?;
            std::fs::remove_dir_all(&old).map_err(io("remove", &old))?;
        } else {
            std::fs::rename(&partial, &dir).map_err(io("rename into place", &dir))?;
        }
        sync_parent(&dir)?;
        mark_latest(&save, &dir)?;
        self.saved_step = Some(self.state.step);
        // Where a save's time goes: gathering and writing the files (into the page cache, as
        // the disk takes them), then waiting for the disk to hold them.
        tracing::info!(
            dir = %dir.display(),
            step = self.state.step,
            write_seconds = written.as_secs_f64(),
            sync_seconds = (synced - written).as_secs_f64(),
            "saved a checkpoint"
        );
        Ok(())
    }

    /// The actor's part of a save into `partial`: its files, and the Hugging Face export where
    /// asked.
    fn save_actor(&mut self, partial: &Path) -> Result<(), OrchestratorError> {
        let dir = partial.join("actor");
        self.actor
            .get()?
            .save(&dir)
            .map_err(OrchestratorError::train("actor", "save"))?;
        if let Some(options) = &self.config.save_options {
            export_hf(&dir, options)
                .map_err(BackendError::from)
                .map_err(OrchestratorError::train("actor", "save"))?;
        }
        Ok(())
    }

    /// This rank's part of a save another rank writes: the actor's, then the critic's, in the
    /// order the writer saves them.
    fn assist_save(&mut self) -> Result<(), OrchestratorError> {
        self.actor
            .get()?
            .assist_save()
            .map_err(OrchestratorError::train("actor", "save"))?;
        if let Some(critic) = &mut self.critic {
            critic
                .assist_save()
                .map_err(OrchestratorError::train("critic", "save"))?;
        }
        Ok(())
    }

    /// Restores actor, critic and loop state from a `--save` directory or one checkpoint of it;
    /// a directory without loop state is a plain weights checkpoint and starts at step 0.
    pub(super) fn load(&mut self, dir: &Path) -> Result<(), OrchestratorError> {
        let dir = resolve_checkpoint(dir)?;
        if !dir.join(STATE_FILE).exists() {
            tracing::info!(dir = %dir.display(), "initial weights from a checkpoint without loop state");
            return self
                .actor
                .get()?
                .load(&dir)
                .map_err(OrchestratorError::train("actor", "load"));
        }
        let state = LoopState::read(&dir)?;
        if state.seed != self.config.seed || state.task != Some(self.config.task) {
            tracing::warn!(
                saved_seed = state.seed,
                seed = self.config.seed,
                "resuming with another seed or task than the checkpoint's: the run will not repeat the original"
            );
        }
        self.actor
            .get()?
            .load(&dir.join("actor"))
            .map_err(OrchestratorError::train("actor", "load"))?;
        if let Some(critic) = &mut self.critic {
            critic
                .load(&dir.join("critic"))
                .map_err(OrchestratorError::train("critic", "load"))?;
        }
        self.state = LoopState {
            seed: self.config.seed,
            task: Some(self.config.task),
            ..state
        };
        // Resumed from a checkpoint of the save directory: that step is saved already.
        if self.config.save.is_some() && dir.parent() == self.config.save.as_deref() {
            self.saved_step = Some(self.state.step);
        }
        tracing::info!(dir = %dir.display(), step = self.state.step, "resumed");
        Ok(())
    }
}

/// How the directories of a save in progress end: `.step-<N>.partial`.
const PARTIAL: &str = ".partial";

/// Removes what saves killed before their rename left in `save`.
fn remove_partial_saves(save: &Path) -> Result<(), OrchestratorError> {
    let entries = match std::fs::read_dir(save) {
        Ok(entries) => entries,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(OrchestratorError::Io {
                action: "list",
                path: save.to_path_buf(),
                source,
            });
        }
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(".step-") && name.ends_with(PARTIAL) {
            tracing::info!(dir = %entry.path().display(), "removing what a killed save left");
            std::fs::remove_dir_all(entry.path()).map_err(|source| OrchestratorError::Io {
                action: "remove",
                path: entry.path(),
                source,
            })?;
        }
    }
    Ok(())
}
