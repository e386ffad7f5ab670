//! [`LoopConfig`]: the part of the settings the loop reads, and the check of its outputs
//! before any work.

use std::path::{Path, PathBuf};

use super::Patience;
use crate::config::{AdvantageEstimator, RolloutOffload, SaveDtype, Settings, Task};
use crate::metrics::check_metrics_file;
use crate::model::{DEFAULT_SHARD_BYTES, SaveOptions};
use crate::orchestrator::OrchestratorError;
use crate::orchestrator::options::RlOptions;

/// What the loop runs: the part of [`Settings`] it reads, checked.
#[derive(Clone, Debug, PartialEq)]
pub struct LoopConfig {
    /// RL steps to reach (a resumed run continues to this count).
    pub steps: u64,
    /// Prompts per rollout.
    pub rollout_batch_size: usize,
    /// Samples per prompt.
    pub n_samples_per_prompt: usize,
    /// Samples per optimizer step.
    pub global_batch_size: usize,
    /// Seed of prompts and sampling.
    pub seed: u64,
    /// The task.
    pub task: Task,
    /// Supervised warm-up steps before the first RL step.
    pub sft_warmup_steps: u64,
    /// Sampling temperature.
    pub temperature: f32,
    /// Training tensors leave the device between steps (where to, the trainer was built with).
    pub offload_train: bool,
    /// Rollout tensors leave the device between rollouts (the engine releases all at start).
    pub offload_rollout: bool,
    /// The KV cache leaves after each rollout.
    pub offload_kv: bool,
    /// The engine's weights leave after each rollout.
    pub offload_weights: bool,
    /// The engine's CUDA graph memory leaves after each rollout (it comes back with the KV cache).
    pub offload_graphs: bool,
    /// Bytes per bucket of the weight sync.
    pub bucket_bytes: usize,
    /// Capacity of the device trainer and engine share, if they share one: where it holds both
    /// phases' memory with `margin_bytes` to spare, the actor's moves run behind other work
    /// (`None`: one after another).
    pub device_bytes: Option<u64>,
    /// Memory a resume must leave free (`--train-memory-margin-bytes`).
    pub margin_bytes: u64,
    /// Where the device holds both phases, nothing moves (`--offload-when-needed`).
    pub offload_when_needed: bool,
    /// How long the actor's onload waits for device memory another process holds.
    pub patience: Patience,
    /// The actor can export its weights while offloaded (from its host backup): the sync then
    /// runs after the trainer sleeps, as DESIGN section 8 orders, and the weights cross the host
    /// link once per step. Off: the weights are exported into host memory just before the
    /// trainer offloads, and sent from there.
    pub export_while_offloaded: bool,
    /// How advantages are estimated.
    pub advantage_estimator: AdvantageEstimator,
    /// Checkpoint directory to save to.
    pub save: Option<PathBuf>,
    /// Save every this many steps (and after the last).
    pub save_interval: Option<u64>,
    /// Checkpoint directory to start from.
    pub load: Option<PathBuf>,
    /// JSON-lines metrics file.
    pub metrics: Option<PathBuf>,
    /// SVG memory timeline file.
    pub memory_timeline: Option<PathBuf>,
    /// How the actor's Hugging Face files are rewritten after each save (dtype, shards,
    /// tokenizer files); `None` keeps them as the backend writes them (bf16, 5 GB shards).
    pub save_options: Option<SaveOptions>,
    /// Sampling, loss, evaluation and dump settings of the RL algorithm.
    pub rl: RlOptions,
}

impl LoopConfig {
    /// The loop settings of a run (the settings were checked when resolved).
    pub fn from_settings(s: &Settings) -> Self {
        let rollout = RolloutOffload::of(s);
        Self {
            steps: s.steps,
            rollout_batch_size: s.rollout_batch_size,
            n_samples_per_prompt: s.n_samples_per_prompt,
            global_batch_size: s.global_batch_size,
            seed: s.seed,
            task: s.task,
            sft_warmup_steps: s.sft_warmup_steps,
            temperature: s.rollout_temperature as f32,
            offload_train: s.offload_train,
            offload_rollout: s.offload_rollout,
            offload_kv: rollout.kv_cache,
            offload_weights: rollout.weights,
            offload_graphs: rollout.cuda_graph,
            bucket_bytes: usize::try_from(s.update_weight_buffer_size).unwrap_or(usize::MAX),
            device_bytes: None,
            margin_bytes: s.train_memory_margin_bytes,
            offload_when_needed: s.offload_when_needed,
            patience: Patience {
                retries: s.train_resume_retries,
                wait: std::time::Duration::from_secs_f64(s.train_resume_wait_seconds),
            },
            export_while_offloaded: false,
            advantage_estimator: s.advantage_estimator,
            save: s.save.clone(),
            save_interval: s.save_interval,
            load: s.load.clone().or_else(|| s.hf_checkpoint.clone()),
            save_options: (s.hf_checkpoint.is_some()
                || s.save_dtype != SaveDtype::Bf16
                || s.save_shard_size != DEFAULT_SHARD_BYTES)
                .then(|| SaveOptions {
                    dtype: s.save_dtype,
                    shard_bytes: s.save_shard_size,
                    tokenizer_from: s.hf_checkpoint.clone(),
                }),
            metrics: s.metrics.clone(),
            memory_timeline: s.memory_timeline.clone(),
            rl: RlOptions::from_settings(s),
        }
    }

    /// Checks every output location before any work: `save` can be created and written
    /// (where this process `writes_saves`: a rank that only assists another's saves writes
    /// none), `metrics` is a metrics file (or new) in a writable directory, `memory_timeline`
    /// is not a directory and its directory takes new files. Creates the directories, nothing
    /// else.
    ///
    /// # Errors
    /// [`OrchestratorError::Outputs`] with one line per location at fault.
    pub fn check_outputs(&self, writes_saves: bool) -> Result<(), OrchestratorError> {
        let mut problems = Vec::new();
        if let Some(dir) = self.save.as_ref().filter(|_| writes_saves)
            && let Err(error) = check_writable_dir(dir)
        {
            problems.push(format!(
                "--save {} is not usable: {error}; choose a directory you can write to",
                dir.display()
            ));
        }
        if let Some(path) = &self.metrics
            && let Err(error) = check_metrics_file(path)
        {
            problems.push(format!("--metrics: {error}"));
        }
        if let Some(path) = &self.memory_timeline {
            let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
            let checked = if path.is_dir() {
                Err("it is a directory".to_owned())
            } else {
                check_writable_dir(dir.unwrap_or(Path::new(".")))
            };
            if let Err(error) = checked {
                problems.push(format!(
                    "--memory-timeline {} is not usable: {error}; choose a file in a directory you can write to",
                    path.display()
                ));
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(OrchestratorError::Outputs { problems })
        }
    }
}

/// Whether a run can put its files in `dir` (created when missing), in words when not.
fn check_writable_dir(dir: &Path) -> Result<(), String> {
    crate::config::probe_writable(dir)
        .map_err(|(action, source)| format!("cannot {action}: {source}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RolloutOffloadLevel;

    #[test]
    fn loop_config_follows_the_offload_switches_and_levels() {
        let colocated = Settings {
            colocate: true,
            offload_train: true,
            offload_rollout: true,
            ..Settings::default()
        };
        let c = LoopConfig::from_settings(&colocated);
        assert!(c.offload_train && c.offload_rollout && c.offload_kv && c.offload_weights);
        let kv_only = Settings {
            offload_rollout_level: vec![RolloutOffloadLevel::KvCache],
            ..colocated.clone()
        };
        let c = LoopConfig::from_settings(&kv_only);
        assert!(c.offload_kv && !c.offload_weights);
        let c = LoopConfig::from_settings(&Settings::default());
        assert!(!c.offload_train && !c.offload_rollout && !c.offload_kv && !c.offload_weights);
        assert_eq!(c.bucket_bytes, 512 << 20);
    }
}
