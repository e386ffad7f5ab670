//! The resolved settings and where each value came from.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::validate::{parse_rollout_levels, resolve_fsdp_cpu_offload, validate};
use super::{
    AdvantageEstimator, ConfigError, DeviceChoice, InvalidSettings, KlLossType, LongPrompt,
    LrDecayStyle, MomentDtype, OffloadTarget, RawSettings, RmType, RolloutOffloadLevel, Task,
    TrainBackendKind,
};

/// The settings a run uses: every flag of DESIGN section 3 plus the run knobs, resolved and
/// checked. Built by [`Settings::resolve`] or [`Settings::load`]; serialises with the TOML keys.
///
/// [`Settings::default`] holds the defaults. Deserialising skips the rules; use it only for
/// settings that were resolved before (a rank process receiving its parent's settings, say).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// Which training backend crate runs.
    pub train_backend: TrainBackendKind,
    /// Training and rollout share the same devices.
    pub colocate: bool,
    /// Training tensors leave the device between train steps.
    pub offload_train: bool,
    /// Rollout tensors leave the device between rollouts.
    pub offload_rollout: bool,
    /// Which rollout tags leave the device, without repeats.
    pub offload_rollout_level: Vec<RolloutOffloadLevel>,
    /// Where training tensors go.
    pub offload_train_target: OffloadTarget,
    /// Directory for disk offload (one subdirectory per rank).
    pub offload_train_disk_dir: Option<PathBuf>,
    /// Granularity of disk writes and reads, in MiB.
    pub offload_train_disk_chunk_mb: u64,
    /// Optimizer state lives on disk and streams through the step.
    pub stream_optimizer_state_to_disk: bool,
    /// Storage type of Adam moments on disk.
    pub stream_optimizer_state_moment_dtype: MomentDtype,
    /// Resume refuses unless free device memory >= need + this margin, in bytes.
    pub train_memory_margin_bytes: u64,
    /// FSDP's own (native) CPU offload; off whenever core training offload is on (rule 6).
    pub fsdp_cpu_offload: bool,
    /// Which device runs.
    pub device: DeviceChoice,
    /// Capacity of the CPU device in GiB (so that out-of-memory is real there).
    pub device_memory_gib: f64,
    /// Name of the model preset.
    pub preset: String,
    /// RL steps (rollout then training) to run.
    pub steps: u64,
    /// Prompts per rollout.
    pub rollout_batch_size: usize,
    /// Samples generated per prompt.
    pub n_samples_per_prompt: usize,
    /// Samples per optimizer step.
    pub global_batch_size: usize,
    /// Learning rate of AdamW.
    pub lr: f64,
    /// Seed of every random choice of the run.
    pub seed: u64,
    /// Checkpoint directory to save to.
    pub save: Option<PathBuf>,
    /// Save every this many steps (and at the end); `None`: only at the end.
    pub save_interval: Option<u64>,
    /// Checkpoint directory to start from.
    pub load: Option<PathBuf>,
    /// Tensor-parallel ranks (megatron).
    pub tensor_model_parallel_size: usize,
    /// Data-parallel ranks.
    pub data_parallel_size: usize,
    /// Fraction of device memory the rollout engine may take for weights and KV cache.
    pub rollout_mem_fraction: f64,
    /// Bytes per bucket of the trainer-to-engine weight update.
    pub update_weight_buffer_size: u64,
    /// How advantages are estimated.
    pub advantage_estimator: AdvantageEstimator,
    /// JSON-lines file for per-phase metrics.
    pub metrics: Option<PathBuf>,
    /// File for the device-memory timeline.
    pub memory_timeline: Option<PathBuf>,
    /// The synthetic task the RL loop trains on.
    pub task: Task,
    /// Supervised steps on the task's correct answers before the first RL step.
    pub sft_warmup_steps: u64,
    /// Softmax temperature of rollout sampling (0 is greedy).
    pub rollout_temperature: f64,

    // Data and rewards a user brings (issue 20).
    /// JSON-lines file of prompts; the loop trains on it instead of `task`.
    pub prompt_data: Option<PathBuf>,
    /// The field of a row holding the prompt.
    pub input_key: String,
    /// The field of a row holding the label a reward compares against.
    pub label_key: Option<String>,
    /// The field of a row passed to the reward as metadata.
    pub metadata_key: String,
    /// Prompt tokens at most; longer prompts are skipped or an error (`rollout_long_prompt`).
    pub rollout_max_prompt_len: Option<usize>,
    /// What a prompt longer than `rollout_max_prompt_len` does.
    pub rollout_long_prompt: LongPrompt,
    /// Generated tokens per sample at most; `None`: the task's answer budget, 64 on a dataset.
    pub rollout_max_response_len: Option<usize>,
    /// The built-in reward; `None`: the task's (`task`) without `--prompt-data`.
    pub rm_type: Option<RmType>,
    /// A reward process speaking JSON lines, run under `sh -c`; replaces `rm_type`.
    pub custom_rm_command: Option<String>,
    /// Seconds the reward process may take for one rollout's answers.
    pub custom_rm_timeout: f64,
    /// Lower clip range of the importance ratio.
    pub eps_clip: f64,
    /// Upper clip range of the importance ratio; `None`: `eps_clip`.
    pub eps_clip_high: Option<f64>,
    /// Adds the KL penalty to a frozen reference model (the weights at the start of RL).
    pub use_kl_loss: bool,
    /// Coefficient of the KL penalty.
    pub kl_loss_coef: f64,
    /// Estimator of the KL penalty.
    pub kl_loss_type: KlLossType,
    /// Gradients are scaled so their global L2 norm is at most this; 0 never clips.
    pub clip_grad: f64,
    /// Nucleus sampling of the rollout, in `(0, 1]`.
    pub rollout_top_p: f64,
    /// Token ids that end a sample, besides EOS.
    pub rollout_stop_token_ids: Vec<u32>,
    /// JSON-lines file of evaluation prompts (same keys as `prompt_data`); never trained on.
    pub eval_prompt_data: Option<PathBuf>,
    /// Evaluate before every this many steps (before steps 1, N + 1, ...).
    pub eval_interval: Option<u64>,
    /// Sampling temperature of evaluation (0 is greedy).
    pub eval_temperature: f64,
    /// JSON-lines file receiving every sample: step, prompt, response, label, reward.
    pub dump_rollouts: Option<PathBuf>,
    /// RL optimizer steps over which the learning rate rises linearly from 0 to `lr`.
    pub lr_warmup_iters: u64,
    /// How the learning rate falls after the warm-up.
    pub lr_decay_style: LrDecayStyle,
    /// RL optimizer steps at which the decay reaches `min_lr`; `None`: the run's last.
    pub lr_decay_iters: Option<u64>,
    /// The learning rate the decay ends at.
    pub min_lr: f64,
    /// Where each value came from.
    #[serde(skip)]
    pub sources: Sources,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            train_backend: TrainBackendKind::Megatron,
            colocate: false,
            offload_train: false,
            offload_rollout: false,
            offload_rollout_level: vec![RolloutOffloadLevel::KvCache, RolloutOffloadLevel::Weight],
            offload_train_target: OffloadTarget::Cpu,
            offload_train_disk_dir: None,
            offload_train_disk_chunk_mb: 64,
            stream_optimizer_state_to_disk: false,
            stream_optimizer_state_moment_dtype: MomentDtype::Fp32,
            train_memory_margin_bytes: 1 << 30,
            fsdp_cpu_offload: false,
            device: DeviceChoice::Auto,
            device_memory_gib: 8.0,
            preset: "tiny".to_owned(),
            steps: 10,
            rollout_batch_size: 8,
            n_samples_per_prompt: 4,
            global_batch_size: 32,
            lr: 1e-4,
            seed: 42,
            save: None,
            save_interval: None,
            load: None,
            tensor_model_parallel_size: 1,
            data_parallel_size: 1,
            rollout_mem_fraction: 0.8,
            update_weight_buffer_size: 512 << 20,
            advantage_estimator: AdvantageEstimator::Grpo,
            metrics: None,
            memory_timeline: None,
            task: Task::Repeat,
            sft_warmup_steps: 0,
            rollout_temperature: 1.0,
            prompt_data: None,
            input_key: "input".to_owned(),
            label_key: None,
            metadata_key: "metadata".to_owned(),
            rollout_max_prompt_len: None,
            rollout_long_prompt: LongPrompt::Skip,
            rollout_max_response_len: None,
            rm_type: None,
            custom_rm_command: None,
            custom_rm_timeout: 60.0,
            eps_clip: 0.2,
            eps_clip_high: None,
            use_kl_loss: false,
            kl_loss_coef: 0.0,
            kl_loss_type: KlLossType::K1,
            clip_grad: 1.0,
            rollout_top_p: 1.0,
            rollout_stop_token_ids: Vec::new(),
            eval_prompt_data: None,
            eval_interval: None,
            eval_temperature: 0.0,
            dump_rollouts: None,
            lr_warmup_iters: 0,
            lr_decay_style: LrDecayStyle::Constant,
            lr_decay_iters: None,
            min_lr: 0.0,
            sources: Sources::default(),
        }
    }
}

/// Where a resolved value came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// Nothing set it.
    Default,
    /// The `--config` file.
    File,
    /// A flag.
    Flag,
    /// Left unset, turned on by `--colocate`.
    ImpliedByColocate,
    /// Set, then turned off because core training offload wins over it (rule 6).
    DisabledByOffloadTrain,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Source::Default => "default",
            Source::File => "file",
            Source::Flag => "flag",
            Source::ImpliedByColocate => "implied by --colocate",
            Source::DisabledByOffloadTrain => "disabled: --offload-train wins over it",
        })
    }
}

/// The [`Source`] of every resolved setting, by TOML key.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Sources(BTreeMap<&'static str, Source>);

impl Sources {
    /// Where the setting `key` came from; `None` for a key no setting has.
    pub fn get(&self, key: &str) -> Option<Source> {
        self.0.get(key).copied()
    }

    /// Every key with its source, sorted by key.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, Source)> + '_ {
        self.0.iter().map(|(&key, &source)| (key, source))
    }

    pub(crate) fn set(&mut self, key: &'static str, source: Source) {
        self.0.insert(key, source);
    }

    /// The value of the flag layer, else of the file layer, else `default`, noting which.
    fn pick<T>(&mut self, key: &'static str, flag: Option<T>, file: Option<T>, default: T) -> T {
        let (value, source) = match (flag, file) {
            (Some(value), _) => (value, Source::Flag),
            (None, Some(value)) => (value, Source::File),
            (None, None) => (default, Source::Default),
        };
        self.set(key, source);
        value
    }

    /// As [`Sources::pick`] for a setting whose default is "none".
    fn pick_optional<T>(
        &mut self,
        key: &'static str,
        flag: Option<T>,
        file: Option<T>,
        default: Option<T>,
    ) -> Option<T> {
        self.pick(key, flag.map(Some), file.map(Some), default)
    }
}

/// Resolves one offload switch (`offload_train` or `offload_rollout`): the flag layer wins over
/// the file; within a layer the explicit switch wins over the `offload` shorthand; left unset it
/// is on with `--colocate` and off without.
///
/// `explicit` and `shorthand` are the (flag, file) values of the switch and of `offload`.
fn resolve_offload_switch(
    explicit: (Option<bool>, Option<bool>),
    shorthand: (Option<bool>, Option<bool>),
    colocate: bool,
) -> (bool, Source) {
    let from_flags = explicit.0.or(shorthand.0);
    let from_file = explicit.1.or(shorthand.1);
    match (from_flags, from_file) {
        (Some(on), _) => (on, Source::Flag),
        (None, Some(on)) => (on, Source::File),
        (None, None) if colocate => (true, Source::ImpliedByColocate),
        (None, None) => (false, Source::Default),
    }
}

impl Settings {
    /// Reads the `--config` file (when given) under the flag layer and resolves both.
    ///
    /// # Errors
    /// The file's [`ConfigError`]s, or [`ConfigError::Invalid`] with every broken rule.
    pub fn load(flags: RawSettings, config: Option<&Path>) -> Result<Settings, ConfigError> {
        let file = config.map(RawSettings::from_toml_file).transpose()?;
        Ok(Settings::resolve(flags, file.unwrap_or_default())?)
    }

    /// Resolves the flag layer over the file layer over the defaults, then checks every rule of
    /// DESIGN section 3.
    ///
    /// Rule 3 creates the disk directory and writes a probe file in it; rule 6 and a disk
    /// directory on tmpfs log a warning.
    ///
    /// # Errors
    /// [`InvalidSettings`] with every broken rule, not only the first.
    pub fn resolve(flags: RawSettings, file: RawSettings) -> Result<Settings, InvalidSettings> {
        let d = Settings::default();
        let mut s = Sources::default();
        macro_rules! pick {
            ($key:ident) => {
                s.pick(stringify!($key), flags.$key, file.$key, d.$key)
            };
        }
        macro_rules! pick_optional {
            ($key:ident) => {
                s.pick_optional(stringify!($key), flags.$key, file.$key, d.$key)
            };
        }
        let colocate = pick!(colocate);
        let (offload_train, source) = resolve_offload_switch(
            (flags.offload_train, file.offload_train),
            (flags.offload, file.offload),
            colocate,
        );
        s.set("offload_train", source);
        let (offload_rollout, source) = resolve_offload_switch(
            (flags.offload_rollout, file.offload_rollout),
            (flags.offload, file.offload),
            colocate,
        );
        s.set("offload_rollout", source);
        let level_names = s.pick(
            "offload_rollout_level",
            flags.offload_rollout_level,
            file.offload_rollout_level,
            d.offload_rollout_level
                .iter()
                .map(|l| l.as_str().to_owned())
                .collect(),
        );
        let (offload_rollout_level, mut violations) = parse_rollout_levels(&level_names);

        let mut settings = Settings {
            train_backend: pick!(train_backend),
            colocate,
            offload_train,
            offload_rollout,
            offload_rollout_level,
            offload_train_target: pick!(offload_train_target),
            offload_train_disk_dir: pick_optional!(offload_train_disk_dir),
            offload_train_disk_chunk_mb: pick!(offload_train_disk_chunk_mb),
            stream_optimizer_state_to_disk: pick!(stream_optimizer_state_to_disk),
            stream_optimizer_state_moment_dtype: pick!(stream_optimizer_state_moment_dtype),
            train_memory_margin_bytes: pick!(train_memory_margin_bytes),
            fsdp_cpu_offload: pick!(fsdp_cpu_offload),
            device: pick!(device),
            device_memory_gib: pick!(device_memory_gib),
            preset: pick!(preset),
            steps: pick!(steps),
            rollout_batch_size: pick!(rollout_batch_size),
            n_samples_per_prompt: pick!(n_samples_per_prompt),
            global_batch_size: pick!(global_batch_size),
            lr: pick!(lr),
            seed: pick!(seed),
            save: pick_optional!(save),
            save_interval: pick_optional!(save_interval),
            load: pick_optional!(load),
            tensor_model_parallel_size: pick!(tensor_model_parallel_size),
            data_parallel_size: pick!(data_parallel_size),
            rollout_mem_fraction: pick!(rollout_mem_fraction),
            update_weight_buffer_size: pick!(update_weight_buffer_size),
            advantage_estimator: pick!(advantage_estimator),
            metrics: pick_optional!(metrics),
            memory_timeline: pick_optional!(memory_timeline),
            task: pick!(task),
            sft_warmup_steps: pick!(sft_warmup_steps),
            rollout_temperature: pick!(rollout_temperature),
            prompt_data: pick_optional!(prompt_data),
            input_key: pick!(input_key),
            label_key: pick_optional!(label_key),
            metadata_key: pick!(metadata_key),
            rollout_max_prompt_len: pick_optional!(rollout_max_prompt_len),
            rollout_long_prompt: pick!(rollout_long_prompt),
            rollout_max_response_len: pick_optional!(rollout_max_response_len),
            rm_type: pick_optional!(rm_type),
            custom_rm_command: pick_optional!(custom_rm_command),
            custom_rm_timeout: pick!(custom_rm_timeout),
            eps_clip: pick!(eps_clip),
            eps_clip_high: pick_optional!(eps_clip_high),
            use_kl_loss: pick!(use_kl_loss),
            kl_loss_coef: pick!(kl_loss_coef),
            kl_loss_type: pick!(kl_loss_type),
            clip_grad: pick!(clip_grad),
            rollout_top_p: pick!(rollout_top_p),
            rollout_stop_token_ids: pick!(rollout_stop_token_ids),
            eval_prompt_data: pick_optional!(eval_prompt_data),
            eval_interval: pick_optional!(eval_interval),
            eval_temperature: pick!(eval_temperature),
            dump_rollouts: pick_optional!(dump_rollouts),
            lr_warmup_iters: pick!(lr_warmup_iters),
            lr_decay_style: pick!(lr_decay_style),
            lr_decay_iters: pick_optional!(lr_decay_iters),
            min_lr: pick!(min_lr),
            sources: Sources::default(),
        };
        settings.sources = s;
        resolve_fsdp_cpu_offload(&mut settings);
        violations.extend(validate(&settings));
        if violations.is_empty() {
            Ok(settings)
        } else {
            Err(InvalidSettings { violations })
        }
    }

    /// Capacity of the CPU device in bytes.
    pub fn device_memory_bytes(&self) -> u64 {
        (self.device_memory_gib * (1u64 << 30) as f64) as u64
    }

    /// The global gradient norm the optimizer clips to (`--clip-grad`); `None` for 0.
    pub fn max_grad_norm(&self) -> Option<f32> {
        (self.clip_grad > 0.0).then_some(self.clip_grad as f32)
    }

    /// Whether any training state goes to disk (disk target, or streamed optimizer state).
    pub fn uses_disk(&self) -> bool {
        self.offload_train_target == OffloadTarget::Disk || self.stream_optimizer_state_to_disk
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offload_switch_resolves_flag_over_file_explicit_over_shorthand_then_colocate() {
        let (on, off, unset) = (Some(true), Some(false), None);
        // (explicit flag, explicit file), (shorthand flag, shorthand file), colocate -> result
        let table = [
            (
                (unset, unset),
                (unset, unset),
                false,
                (false, Source::Default),
            ),
            (
                (unset, unset),
                (unset, unset),
                true,
                (true, Source::ImpliedByColocate),
            ),
            ((off, unset), (unset, unset), true, (false, Source::Flag)),
            ((unset, off), (unset, unset), true, (false, Source::File)),
            ((unset, off), (on, unset), false, (true, Source::Flag)),
            ((off, unset), (on, unset), false, (false, Source::Flag)),
            ((unset, unset), (unset, on), false, (true, Source::File)),
            ((on, off), (unset, unset), false, (true, Source::Flag)),
            ((unset, on), (unset, off), false, (true, Source::File)),
        ];
        for (explicit, shorthand, colocate, expected) in table {
            assert_eq!(
                resolve_offload_switch(explicit, shorthand, colocate),
                expected,
                "{explicit:?} {shorthand:?} colocate={colocate}"
            );
        }
    }

    #[test]
    fn device_memory_bytes_follow_the_gib_setting() {
        let settings = Settings {
            device_memory_gib: 1.5,
            ..Settings::default()
        };
        assert_eq!(settings.device_memory_bytes(), 3 << 29);
    }
}
