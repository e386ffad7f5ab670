//! Evaluation on held-out prompts (`--eval-prompt-data`, `--eval-interval`): one sample per
//! row at `--eval-temperature`, scored by the run's reward, never trained on; and the dump of
//! every rollout sample (`--dump-rollouts`).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde_json::json;

use super::{Orchestrator, Rollout};
use crate::backend::Sampling;
use crate::orchestrator::task::{Stream, stream_seed};
use crate::orchestrator::{OrchestratorError, PromptDataset};

/// Keeps evaluation sampling seeds apart from the rollouts' (`Stream::Sampling` of step `n`).
const EVAL_SEED_OFFSET: u64 = 1 << 62;

impl Orchestrator {
    /// Evaluates on `dataset` before every `--eval-interval` steps; nothing trains on it.
    pub fn with_eval_data(mut self, dataset: PromptDataset) -> Self {
        self.eval = Some(dataset);
        self
    }

    /// The mean reward of one sample per evaluation row, when an evaluation is due before
    /// `step` (steps 1, N + 1, 2N + 1, ...).
    pub(super) fn evaluate_if_due(&mut self, step: u64) -> Result<Option<f32>, OrchestratorError> {
        let (Some(dataset), Some(every), false) = (
            &self.eval,
            self.config.rl.eval_interval,
            self.skips_evaluation,
        ) else {
            return Ok(None);
        };
        if !(step - 1).is_multiple_of(every) {
            return Ok(None);
        }
        let problems: Vec<_> = dataset.rows.iter().map(|r| r.problem.clone()).collect();
        let prompts = problems
            .iter()
            .map(|p| p.prompt(&self.tokenizer))
            .collect::<Result<Vec<_>, _>>()?;
        let sampling = Sampling {
            temperature: self.config.rl.eval_temperature,
            seed: stream_seed(self.config.seed, Stream::Sampling, EVAL_SEED_OFFSET + step),
            ..self.sampling(step)
        };
        let mut samples = self.engine.generate(&prompts, 1, &sampling)?;
        let texts = self.responses(&mut samples);
        let (rewards, _) = self.score(&problems, &samples, texts)?;
        let mean = super::mean_std(&rewards).0;
        tracing::info!(step, rows = rewards.len(), reward_mean = mean, "evaluation");
        Ok(Some(mean))
    }
}

/// One JSON line per rollout sample: `step`, `prompt`, `response`, `label`, `reward`,
/// `tokens`, `stopped`.
pub(super) struct RolloutDump {
    path: PathBuf,
    out: BufWriter<File>,
}

impl RolloutDump {
    /// Opens `path` for appending.
    pub(super) fn append(path: &Path) -> Result<Self, OrchestratorError> {
        let io = |source| OrchestratorError::Io {
            action: "open the rollout dump",
            path: path.to_path_buf(),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let file = File::options()
            .create(true)
            .append(true)
            .open(path)
            .map_err(io)?;
        Ok(Self {
            path: path.to_path_buf(),
            out: BufWriter::new(file),
        })
    }

    /// Writes every sample of `rollout`, flushed.
    pub(super) fn write(&mut self, step: u64, rollout: &Rollout) -> Result<(), OrchestratorError> {
        let mut index = 0;
        let mut lines = String::new();
        for (problem, group) in rollout.problems.iter().zip(&rollout.samples) {
            for sample in group {
                let line = json!({
                    "step": step,
                    "prompt": problem.text,
                    "response": rollout.responses[index],
                    "label": problem.answer,
                    "reward": rollout.rewards[index],
                    "tokens": sample.tokens.len(),
                    "stopped": sample.stopped,
                });
                lines.push_str(&line.to_string());
                lines.push('\n');
                index += 1;
            }
        }
        self.out
            .write_all(lines.as_bytes())
            .and_then(|()| self.out.flush())
            .map_err(|source| OrchestratorError::Io {
                action: "write the rollout dump",
                path: self.path.clone(),
                source,
            })
    }
}
