//! The settings flags, shared by every command that runs with [`Settings`] (flattened into its
//! arguments with `#[command(flatten)]`).

use std::fmt;
use std::path::PathBuf;

use clap::Args;
use miles_core::config::{
    AdvantageEstimator, ConfigError, DeviceChoice, KlLossType, LongPrompt, LrDecayStyle,
    MomentDtype, OffloadTarget, RawSettings, RmType, Settings, Task, TrainBackendKind,
};

/// Every flag of DESIGN section 3 plus the run knobs. A flag left out leaves the value to the
/// `--config` file, then to the default.
#[derive(Args, Debug, Default, Clone)]
pub struct SettingsArgs {
    /// TOML file with the same keys (underscores); flags override it
    #[arg(long, value_name = "FILE", help_heading = "Settings")]
    pub config: Option<PathBuf>,
    /// Which training backend runs [default: megatron]
    #[arg(long, value_name = "megatron|fsdp", help_heading = "Settings")]
    pub train_backend: Option<TrainBackendKind>,
    /// Training and rollout share the same devices (turns both offloads on unless set)
    #[arg(long, help_heading = "Settings")]
    pub colocate: bool,
    /// Shorthand for --offload-train --offload-rollout
    #[arg(long, help_heading = "Settings")]
    pub offload: bool,
    /// Move training tensors off the device between train steps [default: on with --colocate]
    #[arg(long, overrides_with = "no_offload_train", help_heading = "Settings")]
    pub offload_train: bool,
    /// Keep training tensors on the device
    #[arg(long, overrides_with = "offload_train", help_heading = "Settings")]
    pub no_offload_train: bool,
    /// Move rollout tensors off the device between rollouts [default: on with --colocate]
    #[arg(long, overrides_with = "no_offload_rollout", help_heading = "Settings")]
    pub offload_rollout: bool,
    /// Keep rollout tensors on the device
    #[arg(long, overrides_with = "offload_rollout", help_heading = "Settings")]
    pub no_offload_rollout: bool,
    /// Rollout tags that leave the device: kv_cache, weight, cuda_graph [default: kv_cache weight]
    #[arg(long, num_args = 1.., value_name = "LEVEL", help_heading = "Settings")]
    pub offload_rollout_level: Option<Vec<String>>,
    /// Where training tensors go [default: cpu]
    #[arg(long, value_name = "cpu|disk", help_heading = "Settings")]
    pub offload_train_target: Option<OffloadTarget>,
    /// Directory for disk offload (one subdirectory per rank)
    #[arg(long, value_name = "DIR", help_heading = "Settings")]
    pub offload_train_disk_dir: Option<PathBuf>,
    /// Granularity of disk writes and reads in MiB [default: 64]
    #[arg(long, value_name = "N", help_heading = "Settings")]
    pub offload_train_disk_chunk_mb: Option<u64>,
    /// Optimizer state lives on disk and streams through the step
    #[arg(long, help_heading = "Settings")]
    pub stream_optimizer_state_to_disk: bool,
    /// Storage type of Adam moments on disk [default: fp32]
    #[arg(long, value_name = "fp32|bf16|fp16", help_heading = "Settings")]
    pub stream_optimizer_state_moment_dtype: Option<MomentDtype>,
    /// Resume refuses unless free memory >= need + this margin [default: 1 GiB]
    #[arg(long, value_name = "N", help_heading = "Settings")]
    pub train_memory_margin_bytes: Option<u64>,
    /// FSDP's own (native) CPU offload; yields to --offload-train
    #[arg(long, help_heading = "Settings")]
    pub fsdp_cpu_offload: bool,
    /// Which device runs [default: auto]
    #[arg(long, value_name = "auto|cpu|cuda", help_heading = "Run")]
    pub device: Option<DeviceChoice>,
    /// Capacity of the CPU device in GiB [default: 8]
    #[arg(long, value_name = "GIB", help_heading = "Run")]
    pub device_memory_gib: Option<f64>,
    /// Model preset [default: tiny]
    #[arg(long, value_name = "NAME", help_heading = "Run")]
    pub preset: Option<String>,
    /// RL steps to run [default: 10]
    #[arg(long, value_name = "N", help_heading = "Run")]
    pub steps: Option<u64>,
    /// Prompts per rollout [default: 8]
    #[arg(long, value_name = "N", help_heading = "Run")]
    pub rollout_batch_size: Option<usize>,
    /// Samples generated per prompt [default: 4]
    #[arg(long, value_name = "N", help_heading = "Run")]
    pub n_samples_per_prompt: Option<usize>,
    /// Samples per optimizer step [default: 32]
    #[arg(long, value_name = "N", help_heading = "Run")]
    pub global_batch_size: Option<usize>,
    /// Learning rate [default: 1e-4]
    #[arg(long, value_name = "LR", help_heading = "Run")]
    pub lr: Option<f64>,
    /// Seed of every random choice [default: 42]
    #[arg(long, value_name = "N", help_heading = "Run")]
    pub seed: Option<u64>,
    /// Checkpoint directory to save to
    #[arg(long, value_name = "DIR", help_heading = "Run")]
    pub save: Option<PathBuf>,
    /// Save every N steps (and at the end)
    #[arg(long, value_name = "N", help_heading = "Run")]
    pub save_interval: Option<u64>,
    /// Checkpoint directory to start from
    #[arg(long, value_name = "DIR", help_heading = "Run")]
    pub load: Option<PathBuf>,
    /// Tensor-parallel ranks [default: 1]
    #[arg(long, value_name = "N", help_heading = "Run")]
    pub tensor_model_parallel_size: Option<usize>,
    /// Data-parallel ranks [default: 1]
    #[arg(long, value_name = "N", help_heading = "Run")]
    pub data_parallel_size: Option<usize>,
    /// Fraction of device memory the rollout engine may take [default: 0.8]
    #[arg(long, value_name = "F", help_heading = "Run")]
    pub rollout_mem_fraction: Option<f64>,
    /// Bytes per bucket of the weight update [default: 512 MiB]
    #[arg(long, value_name = "BYTES", help_heading = "Run")]
    pub update_weight_buffer_size: Option<u64>,
    /// How advantages are estimated [default: grpo]
    #[arg(
        long,
        value_name = "grpo|ppo|reinforce_plus_plus",
        help_heading = "Run"
    )]
    pub advantage_estimator: Option<AdvantageEstimator>,
    /// JSON-lines file for per-phase metrics
    #[arg(long, value_name = "FILE", help_heading = "Run")]
    pub metrics: Option<PathBuf>,
    /// File for the device-memory timeline
    #[arg(long, value_name = "FILE", help_heading = "Run")]
    pub memory_timeline: Option<PathBuf>,
    /// Synthetic task with a verifiable reward [default: repeat]
    #[arg(long, value_name = "repeat|reverse|add", help_heading = "Run")]
    pub task: Option<Task>,
    /// Supervised steps on the task's answers before RL [default: 0]
    #[arg(long, value_name = "N", help_heading = "Run")]
    pub sft_warmup_steps: Option<u64>,
    /// Softmax temperature of rollout sampling, 0 is greedy [default: 1.0]
    #[arg(long, value_name = "T", help_heading = "Run")]
    pub rollout_temperature: Option<f64>,

    // Data and rewards a user brings (issue 20).
    /// JSON-lines file of prompts to train on instead of --task
    #[arg(long, value_name = "FILE", help_heading = "Data")]
    pub prompt_data: Option<PathBuf>,
    /// Field of a row holding the prompt [default: input]
    #[arg(long, value_name = "KEY", help_heading = "Data")]
    pub input_key: Option<String>,
    /// Field of a row holding the label the reward compares against
    #[arg(long, value_name = "KEY", help_heading = "Data")]
    pub label_key: Option<String>,
    /// Field of a row passed to the reward as metadata [default: metadata]
    #[arg(long, value_name = "KEY", help_heading = "Data")]
    pub metadata_key: Option<String>,
    /// Prompt tokens at most; longer prompts are skipped or an error (--rollout-long-prompt)
    #[arg(long, value_name = "N", help_heading = "Data")]
    pub rollout_max_prompt_len: Option<usize>,
    /// What a prompt over --rollout-max-prompt-len does [default: skip]
    #[arg(long, value_name = "skip|error", help_heading = "Data")]
    pub rollout_long_prompt: Option<LongPrompt>,
    /// Generated tokens per sample at most [default: the task's answer budget, 64 on --prompt-data]
    #[arg(long, value_name = "N", help_heading = "Rollout")]
    pub rollout_max_response_len: Option<usize>,
    /// Built-in reward [default: task without --prompt-data]
    #[arg(long, value_name = "math|exact|task", help_heading = "Reward")]
    pub rm_type: Option<RmType>,
    /// Reward process reading {prompt, response, label, metadata} lines on stdin and answering {"reward": R} lines; replaces --rm-type
    #[arg(long, value_name = "CMD", help_heading = "Reward")]
    pub custom_rm_command: Option<String>,
    /// Seconds the reward process may take for one rollout [default: 60]
    #[arg(long, value_name = "SECONDS", help_heading = "Reward")]
    pub custom_rm_timeout: Option<f64>,
    /// Lower clip range of the importance ratio [default: 0.2]
    #[arg(long, value_name = "EPS", help_heading = "Loss")]
    pub eps_clip: Option<f64>,
    /// Upper clip range of the importance ratio [default: --eps-clip]
    #[arg(long, value_name = "EPS", help_heading = "Loss")]
    pub eps_clip_high: Option<f64>,
    /// KL penalty to a frozen reference model (the weights at the start of RL, tag `ref`; cpu device)
    #[arg(long, help_heading = "Loss")]
    pub use_kl_loss: bool,
    /// Coefficient of the KL penalty [default: 0]
    #[arg(long, value_name = "C", help_heading = "Loss")]
    pub kl_loss_coef: Option<f64>,
    /// Estimator of the KL penalty [default: k1]
    #[arg(long, value_name = "k1|k2|k3", help_heading = "Loss")]
    pub kl_loss_type: Option<KlLossType>,
    /// Clip the global gradient norm to this, 0 never clips [default: 1.0]
    #[arg(long, value_name = "NORM", help_heading = "Loss")]
    pub clip_grad: Option<f64>,
    /// Nucleus sampling of the rollout, in (0, 1] [default: 1]
    #[arg(long, value_name = "P", help_heading = "Rollout")]
    pub rollout_top_p: Option<f64>,
    /// Token ids that end a sample, besides EOS
    #[arg(long, num_args = 1.., value_name = "ID", help_heading = "Rollout")]
    pub rollout_stop_token_ids: Option<Vec<u32>>,
    /// JSON-lines file of evaluation prompts (same keys as --prompt-data), never trained on
    #[arg(long, value_name = "FILE", help_heading = "Eval")]
    pub eval_prompt_data: Option<PathBuf>,
    /// Evaluate before steps 1, N + 1, 2N + 1, ...
    #[arg(long, value_name = "N", help_heading = "Eval")]
    pub eval_interval: Option<u64>,
    /// Sampling temperature of evaluation, 0 is greedy [default: 0]
    #[arg(long, value_name = "T", help_heading = "Eval")]
    pub eval_temperature: Option<f64>,
    /// JSON-lines file receiving every rollout sample: step, prompt, response, label, reward
    #[arg(long, value_name = "FILE", help_heading = "Run")]
    pub dump_rollouts: Option<PathBuf>,
    /// RL optimizer steps of a linear learning-rate warm-up from 0 [default: 0]
    #[arg(long, value_name = "N", help_heading = "Loss")]
    pub lr_warmup_iters: Option<u64>,
    /// How the learning rate falls after the warm-up [default: constant]
    #[arg(long, value_name = "constant|cosine|linear", help_heading = "Loss")]
    pub lr_decay_style: Option<LrDecayStyle>,
    /// RL optimizer step at which the decay reaches --min-lr [default: the last]
    #[arg(long, value_name = "N", help_heading = "Loss")]
    pub lr_decay_iters: Option<u64>,
    /// Learning rate the decay ends at [default: 0]
    #[arg(long, value_name = "LR", help_heading = "Loss")]
    pub min_lr: Option<f64>,
}

impl SettingsArgs {
    /// Reads `--config`, lays the flags over it, and resolves and checks the settings.
    ///
    /// # Errors
    /// A [`ConfigError`] for a bad file or broken rules, or [`BackendNotBuilt`]; both are bad
    /// settings (see [`is_bad_settings`]).
    pub fn load(&self) -> anyhow::Result<Settings> {
        let settings = Settings::load(self.to_raw(), self.config.as_deref())?;
        let built = match settings.train_backend {
            TrainBackendKind::Megatron => cfg!(feature = "megatron"),
            TrainBackendKind::Fsdp => cfg!(feature = "fsdp"),
        };
        if !built {
            return Err(BackendNotBuilt(settings.train_backend).into());
        }
        Ok(settings)
    }

    /// The flag layer: a switch left out is `None`, so the file can set it.
    pub fn to_raw(&self) -> RawSettings {
        let switch = |on: bool, off: bool| match (on, off) {
            (true, _) => Some(true),
            (_, true) => Some(false),
            _ => None,
        };
        let flag = |given: bool| given.then_some(true);
        RawSettings {
            train_backend: self.train_backend,
            colocate: flag(self.colocate),
            offload: flag(self.offload),
            offload_train: switch(self.offload_train, self.no_offload_train),
            offload_rollout: switch(self.offload_rollout, self.no_offload_rollout),
            offload_rollout_level: self.offload_rollout_level.clone(),
            offload_train_target: self.offload_train_target,
            offload_train_disk_dir: self.offload_train_disk_dir.clone(),
            offload_train_disk_chunk_mb: self.offload_train_disk_chunk_mb,
            stream_optimizer_state_to_disk: flag(self.stream_optimizer_state_to_disk),
            stream_optimizer_state_moment_dtype: self.stream_optimizer_state_moment_dtype,
            train_memory_margin_bytes: self.train_memory_margin_bytes,
            fsdp_cpu_offload: flag(self.fsdp_cpu_offload),
            device: self.device,
            device_memory_gib: self.device_memory_gib,
            preset: self.preset.clone(),
            steps: self.steps,
            rollout_batch_size: self.rollout_batch_size,
            n_samples_per_prompt: self.n_samples_per_prompt,
            global_batch_size: self.global_batch_size,
            lr: self.lr,
            seed: self.seed,
            save: self.save.clone(),
            save_interval: self.save_interval,
            load: self.load.clone(),
            tensor_model_parallel_size: self.tensor_model_parallel_size,
            data_parallel_size: self.data_parallel_size,
            rollout_mem_fraction: self.rollout_mem_fraction,
            update_weight_buffer_size: self.update_weight_buffer_size,
            advantage_estimator: self.advantage_estimator,
            metrics: self.metrics.clone(),
            memory_timeline: self.memory_timeline.clone(),
            task: self.task,
            sft_warmup_steps: self.sft_warmup_steps,
            rollout_temperature: self.rollout_temperature,
            prompt_data: self.prompt_data.clone(),
            input_key: self.input_key.clone(),
            label_key: self.label_key.clone(),
            metadata_key: self.metadata_key.clone(),
            rollout_max_prompt_len: self.rollout_max_prompt_len,
            rollout_long_prompt: self.rollout_long_prompt,
            rollout_max_response_len: self.rollout_max_response_len,
            rm_type: self.rm_type,
            custom_rm_command: self.custom_rm_command.clone(),
            custom_rm_timeout: self.custom_rm_timeout,
            eps_clip: self.eps_clip,
            eps_clip_high: self.eps_clip_high,
            use_kl_loss: flag(self.use_kl_loss),
            kl_loss_coef: self.kl_loss_coef,
            kl_loss_type: self.kl_loss_type,
            clip_grad: self.clip_grad,
            rollout_top_p: self.rollout_top_p,
            rollout_stop_token_ids: self.rollout_stop_token_ids.clone(),
            eval_prompt_data: self.eval_prompt_data.clone(),
            eval_interval: self.eval_interval,
            eval_temperature: self.eval_temperature,
            dump_rollouts: self.dump_rollouts.clone(),
            lr_warmup_iters: self.lr_warmup_iters,
            lr_decay_style: self.lr_decay_style,
            lr_decay_iters: self.lr_decay_iters,
            min_lr: self.min_lr,
        }
    }
}

/// `--train-backend` names a backend this binary was built without.
#[derive(Debug)]
pub struct BackendNotBuilt(pub TrainBackendKind);

impl fmt::Display for BackendNotBuilt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "--train-backend {0} is not built into this binary; rebuild with `--features {0}` or choose another backend",
            self.0
        )
    }
}

impl std::error::Error for BackendNotBuilt {}

/// Flags of a command that cannot run together, with the fix in the message; exit status 2.
#[derive(Debug)]
pub struct BadSettings(pub String);

impl fmt::Display for BadSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BadSettings {}

/// Whether an error means bad settings (exit status 2) rather than a failure (exit status 1).
pub fn is_bad_settings(error: &anyhow::Error) -> bool {
    error.downcast_ref::<ConfigError>().is_some()
        || error.downcast_ref::<BadSettings>().is_some()
        || error.downcast_ref::<BackendNotBuilt>().is_some()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Probe {
        #[command(flatten)]
        settings: SettingsArgs,
    }

    fn raw(args: &[&str]) -> RawSettings {
        let mut argv = vec!["miles"];
        argv.extend_from_slice(args);
        Probe::try_parse_from(argv).unwrap().settings.to_raw()
    }

    #[test]
    fn switches_left_out_stay_unset_for_the_file() {
        let layer = raw(&[]);
        assert_eq!(layer, RawSettings::default());
    }

    #[test]
    fn the_last_of_a_switch_and_its_negation_wins() {
        assert_eq!(
            raw(&["--offload-train", "--no-offload-train"]).offload_train,
            Some(false)
        );
        assert_eq!(
            raw(&["--no-offload-train", "--offload-train"]).offload_train,
            Some(true)
        );
        assert_eq!(raw(&["--no-offload-rollout"]).offload_rollout, Some(false));
    }

    #[test]
    fn every_config_key_has_a_flag_of_the_same_name() {
        let layer = raw(&[
            "--train-backend",
            "fsdp",
            "--colocate",
            "--offload",
            "--offload-train",
            "--offload-rollout",
            "--offload-rollout-level",
            "kv_cache",
            "weight",
            "--offload-train-target",
            "disk",
            "--offload-train-disk-dir",
            "d",
            "--offload-train-disk-chunk-mb",
            "8",
            "--stream-optimizer-state-to-disk",
            "--stream-optimizer-state-moment-dtype",
            "bf16",
            "--train-memory-margin-bytes",
            "5",
            "--fsdp-cpu-offload",
            "--device",
            "cpu",
            "--device-memory-gib",
            "2",
            "--preset",
            "p",
            "--steps",
            "3",
            "--rollout-batch-size",
            "2",
            "--n-samples-per-prompt",
            "2",
            "--global-batch-size",
            "4",
            "--lr",
            "0.1",
            "--seed",
            "1",
            "--save",
            "s",
            "--save-interval",
            "2",
            "--load",
            "l",
            "--tensor-model-parallel-size",
            "2",
            "--data-parallel-size",
            "2",
            "--rollout-mem-fraction",
            "0.5",
            "--update-weight-buffer-size",
            "9",
            "--advantage-estimator",
            "ppo",
            "--metrics",
            "m",
            "--memory-timeline",
            "t",
            "--task",
            "add",
            "--sft-warmup-steps",
            "2",
            "--rollout-temperature",
            "0.7",
            "--prompt-data",
            "d.jsonl",
            "--input-key",
            "q",
            "--label-key",
            "a",
            "--metadata-key",
            "m",
            "--rollout-max-prompt-len",
            "64",
            "--rollout-long-prompt",
            "error",
            "--rollout-max-response-len",
            "8",
            "--rm-type",
            "math",
            "--custom-rm-command",
            "python3 rm.py",
            "--custom-rm-timeout",
            "5",
            "--eps-clip",
            "0.1",
            "--eps-clip-high",
            "0.3",
            "--use-kl-loss",
            "--kl-loss-coef",
            "0.01",
            "--kl-loss-type",
            "k3",
            "--clip-grad",
            "0.5",
            "--rollout-top-p",
            "0.9",
            "--rollout-stop-token-ids",
            "10",
            "--eval-prompt-data",
            "e.jsonl",
            "--eval-interval",
            "5",
            "--eval-temperature",
            "0.5",
            "--dump-rollouts",
            "r.jsonl",
            "--lr-warmup-iters",
            "3",
            "--lr-decay-style",
            "cosine",
            "--lr-decay-iters",
            "30",
            "--min-lr",
            "0.01",
        ]);
        let value = serde_json::to_value(&layer).unwrap();
        let unset: Vec<&String> = value
            .as_object()
            .unwrap()
            .iter()
            .filter(|(_, v)| v.is_null())
            .map(|(k, _)| k)
            .collect();
        assert!(unset.is_empty(), "keys without a flag: {unset:?}");
        assert_eq!(RawSettings::keys().len(), value.as_object().unwrap().len());
    }

    #[test]
    fn bad_enum_names_are_usage_errors() {
        let error = Probe::try_parse_from(["miles", "--train-backend", "fsdpp"])
            .err()
            .unwrap()
            .to_string();
        assert!(error.contains("did you mean `fsdp`?"), "{error}");
    }
}
