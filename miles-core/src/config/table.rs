//! The one list of settings. Every setting is one entry of [`settings_table!`] below; from that
//! entry come its field in [`RawSettings`] (a layer as typed or read) and in [`Settings`] (the
//! resolved values), its default, its TOML key (the name), its flag (the name with dashes), its
//! help line, the heading it is listed under, its documented range and the check of that range,
//! and its line in `check-config` and in the README's table ([`FIELDS`]).
//!
//! Adding a setting is adding one entry here.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{
    AdvantageEstimator, DeviceChoice, KlLossType, LongPrompt, LrDecayStyle, MomentDtype,
    OffloadTarget, RmType, RolloutOffloadLevel, SaveDtype, Source, Sources, Task, TrainBackendKind,
};

/// How a setting is typed on the command line and resolved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FieldKind {
    /// `--flag VALUE`; the value has a default.
    Value,
    /// `--flag VALUE`; no value by default.
    Optional,
    /// `--flag` alone turns it on.
    Switch,
    /// `--flag` turns it on, `--no-flag` off; left unset, it is resolved from other settings.
    Toggle,
    /// `--flag V1 V2 ...`: a list of names.
    List,
    /// `--flag V1 V2 ...`: a list of values.
    Many,
    /// `--flag` alone, in a layer only: a shorthand that sets other settings.
    Shorthand,
}

/// The range a numeric setting must lie in, checked when the settings resolve.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Range {
    /// Anything its type holds.
    Any,
    /// At least this.
    AtLeast(f64),
    /// Above this (and finite).
    Above(f64),
    /// Between the two, both included.
    Between(f64, f64),
    /// Above the first and at most the second.
    AboveUpTo(f64, f64),
}

impl Range {
    /// Whether `value` lies in the range (non-finite values never do, but for [`Range::Any`]).
    pub fn contains(self, value: f64) -> bool {
        match self {
            Range::Any => true,
            Range::AtLeast(low) => value.is_finite() && value >= low,
            Range::Above(low) => value.is_finite() && value > low,
            Range::Between(low, high) => value.is_finite() && value >= low && value <= high,
            Range::AboveUpTo(low, high) => value.is_finite() && value > low && value <= high,
        }
    }

    /// The range in words, for messages and the docs; `None` for [`Range::Any`].
    pub fn describe(self) -> Option<String> {
        match self {
            Range::Any => None,
            Range::AtLeast(low) => Some(format!("at least {low}")),
            Range::Above(low) => Some(format!("above {low}")),
            Range::Between(low, high) => Some(format!("between {low} and {high}")),
            Range::AboveUpTo(low, high) => Some(format!("above {low} and at most {high}")),
        }
    }
}

/// One setting, as the table describes it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Field {
    /// The TOML key (`offload_train_disk_dir`).
    pub key: &'static str,
    /// How it is typed and resolved.
    pub kind: FieldKind,
    /// The name its value goes by in help (`DIR`).
    pub value_name: &'static str,
    /// Its help line, as written in the table (see [`Field::help`]).
    pub doc: &'static str,
    /// The heading it is listed under (`Offload`, `Run`, ...).
    pub heading: &'static str,
    /// The range its value must lie in.
    pub range: Range,
}

impl Field {
    /// The flag, without its dashes (`offload-train-disk-dir`).
    pub fn flag(&self) -> String {
        self.key.replace('_', "-")
    }

    /// Its help line.
    pub fn help(&self) -> &'static str {
        self.doc.trim()
    }

    /// The default as the docs show it: `none` for an optional setting, nothing for a toggle
    /// (resolved from `--colocate`) or a shorthand.
    pub fn default_text(&self) -> String {
        match self.kind {
            FieldKind::Toggle | FieldKind::Shorthand => String::new(),
            _ => text_of(&Settings::default().value_of(self)),
        }
    }
}

/// A setting's value as the docs and messages show it.
pub fn text_of(value: &serde_json::Value) -> String {
    match value {
        serde_json::Value::Null => "none".to_owned(),
        serde_json::Value::String(text) => text.clone(),
        serde_json::Value::Array(items) => items.iter().map(text_of).collect::<Vec<_>>().join(" "),
        other => other.to_string(),
    }
}

macro_rules! raw_type {
    (List, $ty:ty) => { Vec<String> };
    (Many, $ty:ty) => { Vec<$ty> };
    ($kind:ident, $ty:ty) => { $ty };
}

macro_rules! settings_type {
    (Optional, $ty:ty) => { Option<$ty> };
    (List, $ty:ty) => { Vec<$ty> };
    (Many, $ty:ty) => { Vec<$ty> };
    ($kind:ident, $ty:ty) => { $ty };
}

/// The value of one resolved field from the layers (toggles and lists are resolved by hand
/// afterwards, from their defaults here).
macro_rules! pick_field {
    (Value, $key:ident, $s:ident, $flags:ident, $file:ident, $d:ident) => {
        $s.pick(
            stringify!($key),
            $flags.$key.clone(),
            $file.$key.clone(),
            $d.$key,
        )
    };
    (Many, $key:ident, $s:ident, $flags:ident, $file:ident, $d:ident) => {
        $s.pick(
            stringify!($key),
            $flags.$key.clone(),
            $file.$key.clone(),
            $d.$key,
        )
    };
    (Switch, $key:ident, $s:ident, $flags:ident, $file:ident, $d:ident) => {
        $s.pick(stringify!($key), $flags.$key, $file.$key, $d.$key)
    };
    (Optional, $key:ident, $s:ident, $flags:ident, $file:ident, $d:ident) => {
        $s.pick_optional(
            stringify!($key),
            $flags.$key.clone(),
            $file.$key.clone(),
            $d.$key,
        )
    };
    ($kind:ident, $key:ident, $s:ident, $flags:ident, $file:ident, $d:ident) => {
        $d.$key
    };
}

/// A flag's text as the JSON value of its field (lists: one name, as typed).
macro_rules! parse_text {
    (List, $ty:ty, $text:ident) => {
        Ok(serde_json::Value::String($text.to_owned()))
    };
    ($kind:ident, $ty:ty, $text:ident) => {
        parse_as::<$ty>($text)
    };
}

/// `text` parsed as a `T`, as JSON.
fn parse_as<T>(text: &str) -> Result<serde_json::Value, String>
where
    T: std::str::FromStr + Serialize,
    T::Err: std::fmt::Display,
{
    let value = text.parse::<T>().map_err(|error| error.to_string())?;
    serde_json::to_value(value).map_err(|error| error.to_string())
}

/// Declares the settings: `raw { .. }` holds layer-only shorthands, `settings { .. }` every
/// resolved setting as `KIND key: Type = default, "VALUE", "Heading", range;` under its doc line
/// (the help text).
macro_rules! settings_table {
    (
        raw {
            $( #[doc = $rdoc:literal] $rkey:ident, $rheading:literal; )*
        }
        settings {
            $(
                #[doc = $doc:literal]
                $kind:ident $key:ident : $ty:ty = $default:expr, $value_name:literal,
                $heading:literal, $range:expr;
            )*
        }
    ) => {
        /// One layer of settings (the `--config` file, or the flags): what was given, `None`
        /// where nothing was. [`Settings::resolve`](super::Settings::resolve) turns the layers
        /// into [`Settings`].
        ///
        /// The TOML keys are the flag names with underscores; an unknown key is an error.
        #[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct RawSettings {
            $( #[doc = $rdoc] pub $rkey: Option<bool>, )*
            $( #[doc = $doc] pub $key: Option<raw_type!($kind, $ty)>, )*
        }

        /// The settings a run uses, resolved and checked. Built by
        /// [`Settings::resolve`](super::Settings::resolve) or
        /// [`Settings::load`](super::Settings::load); serialises with the TOML keys.
        ///
        /// [`Settings::default`] holds the defaults. Deserialising skips the rules; use it only
        /// for settings that were resolved before (a rank process receiving its parent's
        /// settings, say).
        #[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct Settings {
            $( #[doc = $doc] pub $key: settings_type!($kind, $ty), )*
            /// Where each value came from.
            #[serde(skip)]
            pub sources: Sources,
        }

        impl Default for Settings {
            fn default() -> Settings {
                Settings {
                    $( $key: $default, )*
                    sources: Sources::default(),
                }
            }
        }

        /// Every setting, layer-only shorthands first, in the table's order.
        pub const FIELDS: &[Field] = &[
            $(
                Field {
                    key: stringify!($rkey),
                    kind: FieldKind::Shorthand,
                    value_name: "",
                    doc: $rdoc,
                    heading: $rheading,
                    range: Range::Any,
                },
            )*
            $(
                Field {
                    key: stringify!($key),
                    kind: FieldKind::$kind,
                    value_name: $value_name,
                    doc: $doc,
                    heading: $heading,
                    range: $range,
                },
            )*
        ];

        impl Field {
            /// The typed value of a flag's `text`, as the JSON of its field in [`RawSettings`]
            /// (for a list, one item).
            ///
            /// # Errors
            /// The parse error, in words (a choice's error names the nearest valid name).
            pub fn parse(&self, text: &str) -> Result<serde_json::Value, String> {
                match self.key {
                    $( stringify!($key) => parse_text!($kind, $ty, text), )*
                    _ => Ok(serde_json::Value::Bool(true)),
                }
            }
        }

        impl Settings {
            /// Every field picked from the flag layer, else the file layer, else the default,
            /// each source noted (toggles and lists keep their defaults: the caller resolves them).
            pub(crate) fn pick_layers(
                flags: &RawSettings,
                file: &RawSettings,
                s: &mut Sources,
            ) -> Settings {
                let d = Settings::default();
                Settings {
                    $( $key: pick_field!($kind, $key, s, flags, file, d), )*
                    sources: Sources::default(),
                }
            }
        }
    };
}

settings_table! {
    raw {
        /// Shorthand for --offload-train --offload-rollout
        offload, "Offload";
    }
    settings {
        /// Which training backend runs
        Value train_backend: TrainBackendKind = TrainBackendKind::Megatron, "megatron|fsdp",
            "Offload", Range::Any;
        /// Training and rollout share the same devices (turns both offloads on unless set)
        Switch colocate: bool = false, "", "Offload", Range::Any;
        /// Move training tensors off the device between train steps (on with --colocate unless set)
        Toggle offload_train: bool = false, "", "Offload", Range::Any;
        /// Move rollout tensors off the device between rollouts (on with --colocate unless set)
        Toggle offload_rollout: bool = false, "", "Offload", Range::Any;
        /// Rollout tags that leave the device: kv_cache, weight, cuda_graph
        List offload_rollout_level: RolloutOffloadLevel =
            vec![RolloutOffloadLevel::KvCache, RolloutOffloadLevel::Weight], "LEVEL", "Offload",
            Range::Any;
        /// Where training tensors go
        Value offload_train_target: OffloadTarget = OffloadTarget::Host, "cpu|disk", "Offload",
            Range::Any;
        /// Directory for disk offload (one subdirectory per rank)
        Optional offload_train_disk_dir: PathBuf = None, "DIR", "Offload", Range::Any;
        /// Granularity of disk writes and reads in MiB
        Value offload_train_disk_chunk_mb: u64 = 64, "N", "Offload", Range::Between(1.0, 4096.0);
        /// Host memory (GB) a disk offload copies into first, writing to disk behind it (0 writes in line), and the optimizer stream reads ahead into
        Value offload_train_host_budget_gb: f64 = 0.0, "GB", "Offload",
            Range::Between(0.0, 1_048_576.0);
        /// Optimizer state lives on disk and streams through the step
        Switch stream_optimizer_state_to_disk: bool = false, "", "Offload", Range::Any;
        /// Storage type of Adam moments on disk
        Value stream_optimizer_state_moment_dtype: MomentDtype = MomentDtype::Fp32,
            "fp32|bf16|fp16", "Offload", Range::Any;
        /// The fp32 master weights stream with the moments, none on the device (cuda)
        Switch stream_optimizer_master_weights: bool = false, "", "Offload", Range::Any;
        /// Where the GPU holds training and rollout with the margin, keep both resident (cuda)
        Switch offload_when_needed: bool = false, "", "Offload", Range::Any;
        /// Attempts after the first that a trainer's resume makes while device memory is short
        Value train_resume_retries: u64 = 10, "N", "Offload", Range::Between(0.0, 100000.0);
        /// Seconds between those attempts
        Value train_resume_wait_seconds: f64 = 3.0, "S", "Offload", Range::Between(0.0, 3600.0);
        /// Resume refuses unless free memory >= need + this margin, in bytes
        Value train_memory_margin_bytes: u64 = 1 << 30, "N", "Offload",
            Range::Between(0.0, 1_125_899_906_842_624.0);
        /// FSDP's own (native) CPU offload; yields to --offload-train
        Switch fsdp_cpu_offload: bool = false, "", "Offload", Range::Any;
        /// Which device runs
        Value device: DeviceChoice = DeviceChoice::Auto, "auto|cpu|cuda", "Run", Range::Any;
        /// Capacity of the CPU device in GiB (so out-of-memory is real there)
        Value device_memory_gib: f64 = 8.0, "GIB", "Run", Range::AboveUpTo(0.0, 65536.0);
        /// Model preset
        Value preset: String = "tiny".to_owned(), "NAME", "Run", Range::Any;
        /// RL steps to run
        Value steps: u64 = 10, "N", "Run", Range::Between(1.0, 1e9);
        /// Prompts per rollout
        Value rollout_batch_size: usize = 8, "N", "Run", Range::Between(1.0, 65536.0);
        /// Samples generated per prompt
        Value n_samples_per_prompt: usize = 4, "N", "Run", Range::Between(1.0, 4096.0);
        /// Samples per optimizer step; must divide prompts x samples
        Value global_batch_size: usize = 32, "N", "Run", Range::Between(1.0, 1_048_576.0);
        /// Sequences per forward and backward pass of a rank's share of a train step; their gradients add up before the one optimizer step (none: the whole share in one pass)
        Optional micro_batch_size: usize = None, "N", "Run", Range::Between(1.0, 1_048_576.0);
        /// AdamW learning rate
        Value lr: f64 = 1e-4, "LR", "Run", Range::AboveUpTo(0.0, 1.0);
        /// Seed of every random choice
        Value seed: u64 = 42, "N", "Run", Range::Any;
        /// Checkpoint directory to save to (each checkpoint synced to the disk before `DIR/latest` names it)
        Optional save: PathBuf = None, "DIR", "Run", Range::Any;
        /// Save every N steps (and at the end)
        Optional save_interval: u64 = None, "N", "Run", Range::AtLeast(1.0);
        /// Checkpoint directory to start from
        Optional load: PathBuf = None, "DIR", "Run", Range::Any;
        /// Tensor-parallel ranks (megatron)
        Value tensor_model_parallel_size: usize = 1, "N", "Run", Range::Between(1.0, 1024.0);
        /// Data-parallel ranks
        Value data_parallel_size: usize = 1, "N", "Run", Range::Between(1.0, 1024.0);
        /// Reduce the data-parallel gradients in bf16, half the bytes (on cuda)
        Switch grad_reduce_in_bf16: bool = false, "", "Run", Range::Any;
        /// Sum the data-parallel gradients behind the backward pass, each rank keeping its block of them; with fsdp also gather each layer's weights a layer ahead (on cuda)
        Switch overlap_grad_reduce: bool = false, "", "Run", Range::Any;
        /// Fraction of the device memory left free by the trainers and the engine's weights that the rollout engine's KV cache may take (`miles train` builds the engine after the trainers)
        Value rollout_mem_fraction: f64 = 0.8, "F", "Run", Range::AboveUpTo(0.0, 1.0);
        /// Bytes per bucket of the trainer-to-engine weight update
        Value update_weight_buffer_size: u64 = 512 << 20, "BYTES", "Run",
            Range::Between(1.0, 68_719_476_736.0);
        /// How advantages are estimated
        Value advantage_estimator: AdvantageEstimator = AdvantageEstimator::Grpo,
            "grpo|ppo|reinforce_plus_plus", "Run", Range::Any;
        /// JSON-lines file for per-phase metrics
        Optional metrics: PathBuf = None, "FILE", "Run", Range::Any;
        /// SVG file for the device-memory timeline
        Optional memory_timeline: PathBuf = None, "FILE", "Run", Range::Any;
        /// Synthetic task with a verifiable reward
        Value task: Task = Task::Repeat, "repeat|reverse|add", "Run", Range::Any;
        /// Supervised steps on the task's answers before RL
        Value sft_warmup_steps: u64 = 0, "N", "Run", Range::Between(0.0, 1e9);
        /// Softmax temperature of rollout sampling, 0 is greedy
        Value rollout_temperature: f64 = 1.0, "T", "Run", Range::Between(0.0, 100.0);
        /// Hugging Face model directory (config.json, safetensors, tokenizer.json): the model's shape, every numeric field, the weights and the tokenizer come from it, not --preset
        Optional hf_checkpoint: PathBuf = None, "DIR", "Model", Range::Any;
        /// dtype of the Hugging Face weights --save writes (fp32 master weights are kept beside for --load)
        Value save_dtype: SaveDtype = SaveDtype::Bf16, "bf16|fp32", "Model", Range::Any;
        /// Bytes per safetensors file --save writes; above it the weights are sharded with an index
        Value save_shard_size: u64 = 5_000_000_000, "BYTES", "Model",
            Range::Between(1.0, 1_099_511_627_776.0);
        /// JSON-lines file of prompts to train on instead of --task
        Optional prompt_data: PathBuf = None, "FILE", "Data", Range::Any;
        /// Field of a row holding the prompt
        Value input_key: String = "input".to_owned(), "KEY", "Data", Range::Any;
        /// Field of a row holding the label the reward compares against
        Optional label_key: String = None, "KEY", "Data", Range::Any;
        /// Field of a row passed to the reward as metadata
        Value metadata_key: String = "metadata".to_owned(), "KEY", "Data", Range::Any;
        /// Prompt tokens at most; longer prompts are skipped or an error (--rollout-long-prompt)
        Optional rollout_max_prompt_len: usize = None, "N", "Data", Range::Between(1.0, 1e7);
        /// What a prompt over --rollout-max-prompt-len does
        Value rollout_long_prompt: LongPrompt = LongPrompt::Skip, "skip|error", "Data",
            Range::Any;
        /// Generated tokens per sample at most (none: the task's answer budget, 64 on --prompt-data)
        Optional rollout_max_response_len: usize = None, "N", "Rollout", Range::Between(1.0, 1e7);
        /// Built-in reward (none: task without --prompt-data)
        Optional rm_type: RmType = None, "math|exact|task", "Reward", Range::Any;
        /// Reward process reading {prompt, response, label, metadata} lines on stdin and answering {"reward": R} lines; replaces --rm-type
        Optional custom_rm_command: String = None, "CMD", "Reward", Range::Any;
        /// Seconds the reward process may take for one rollout
        Value custom_rm_timeout: f64 = 60.0, "SECONDS", "Reward", Range::AboveUpTo(0.0, 86400.0);
        /// Lower clip range of the importance ratio
        Value eps_clip: f64 = 0.2, "EPS", "Loss", Range::Any;
        /// Upper clip range of the importance ratio (none: --eps-clip)
        Optional eps_clip_high: f64 = None, "EPS", "Loss", Range::Any;
        /// KL penalty to a frozen reference model (the weights at the start of RL, tag `ref`; cpu device)
        Switch use_kl_loss: bool = false, "", "Loss", Range::Any;
        /// Coefficient of the KL penalty
        Value kl_loss_coef: f64 = 0.0, "C", "Loss", Range::Between(0.0, 1e6);
        /// Estimator of the KL penalty
        Value kl_loss_type: KlLossType = KlLossType::K1, "k1|k2|k3", "Loss", Range::Any;
        /// Entropy bonus: the loss falls by this times the policy's mean entropy over the response tokens (cpu device)
        Value entropy_coef: f64 = 0.0, "C", "Loss", Range::Between(-1e6, 1e6);
        /// Clip the global gradient norm to this, 0 never clips
        Value clip_grad: f64 = 1.0, "NORM", "Loss", Range::Between(0.0, 1e9);
        /// Nucleus sampling of the rollout, in (0, 1]
        Value rollout_top_p: f64 = 1.0, "P", "Rollout", Range::Any;
        /// Run the GPU engine's decode steps as queued kernels, not as captured CUDA graphs
        Switch rollout_disable_cuda_graph: bool = false, "", "Rollout", Range::Any;
        /// Sample among the K most likely tokens only (ties at the cut kept), 0 keeps all
        Value rollout_top_k: usize = 0, "K", "Rollout", Range::Between(0.0, 16777216.0);
        /// Token ids that end a sample, besides EOS
        Many rollout_stop_token_ids: u32 = Vec::new(), "ID", "Rollout", Range::Any;
        /// Strings that end a sample: it is cut after the token that completes the first one, and the text the reward reads ends before it
        Many rollout_stop: String = Vec::new(), "STR", "Rollout", Range::Any;
        /// JSON-lines file of evaluation prompts (same keys as --prompt-data), never trained on
        Optional eval_prompt_data: PathBuf = None, "FILE", "Eval", Range::Any;
        /// Evaluate before steps 1, N + 1, 2N + 1, ...
        Optional eval_interval: u64 = None, "N", "Eval", Range::Any;
        /// Sampling temperature of evaluation, 0 is greedy
        Value eval_temperature: f64 = 0.0, "T", "Eval", Range::Between(0.0, 100.0);
        /// JSON-lines file receiving every rollout sample: step, prompt, response, label, reward
        Optional dump_rollouts: PathBuf = None, "FILE", "Run", Range::Any;
        /// RL optimizer steps of a linear learning-rate warm-up from 0
        Value lr_warmup_iters: u64 = 0, "N", "Loss", Range::Between(0.0, 1e9);
        /// How the learning rate falls after the warm-up
        Value lr_decay_style: LrDecayStyle = LrDecayStyle::Constant, "constant|cosine|linear",
            "Loss", Range::Any;
        /// RL optimizer step at which the decay reaches --min-lr (none: the last)
        Optional lr_decay_iters: u64 = None, "N", "Loss", Range::Any;
        /// Learning rate the decay ends at
        Value min_lr: f64 = 0.0, "LR", "Loss", Range::Between(0.0, 1.0);
    }
}

impl Settings {
    /// The value of `field` in these settings as JSON (`null` for an optional setting without a
    /// value, and for a layer-only shorthand).
    pub fn value_of(&self, field: &Field) -> serde_json::Value {
        match serde_json::to_value(self) {
            Ok(serde_json::Value::Object(mut values)) => {
                values.remove(field.key).unwrap_or(serde_json::Value::Null)
            }
            _ => serde_json::Value::Null,
        }
    }

    /// Where `field`'s value came from.
    pub fn source_of(&self, field: &Field) -> Source {
        self.sources.get(field.key).unwrap_or(Source::Default)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_field_of_both_structs_has_one_entry_and_one_flag() {
        let raw = serde_json::to_value(RawSettings::default()).unwrap();
        let raw = raw.as_object().unwrap();
        assert_eq!(raw.len(), FIELDS.len());
        for field in FIELDS {
            assert!(raw.contains_key(field.key), "{} missing", field.key);
            assert!(!field.help().is_empty(), "{} has no help", field.key);
        }
        let resolved = serde_json::to_value(Settings::default()).unwrap();
        let shorthands = FIELDS
            .iter()
            .filter(|f| f.kind == FieldKind::Shorthand)
            .count();
        assert_eq!(
            resolved.as_object().unwrap().len() + shorthands,
            FIELDS.len()
        );
    }

    #[test]
    fn defaults_lie_in_their_ranges() {
        let defaults = Settings::default();
        for field in FIELDS {
            if let Some(value) = defaults.value_of(field).as_f64() {
                assert!(field.range.contains(value), "{}: {value}", field.key);
            }
        }
    }

    #[test]
    fn ranges_refuse_what_they_do_not_hold() {
        assert!(Range::Between(1.0, 4096.0).contains(64.0));
        assert!(!Range::Between(1.0, 4096.0).contains(17_592_186_044_416.0));
        assert!(!Range::AboveUpTo(0.0, 65536.0).contains(1e30));
        assert!(!Range::AboveUpTo(0.0, 1.0).contains(f64::NAN));
        assert!(Range::Any.contains(f64::INFINITY));
        assert_eq!(
            Range::Between(1.0, 8.0).describe().as_deref(),
            Some("between 1 and 8")
        );
    }
}
