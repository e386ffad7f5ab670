//! Settings as typed or read: every value optional, nothing checked yet.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::choice::nearest;
use super::{
    AdvantageEstimator, ConfigError, DeviceChoice, KlLossType, LongPrompt, LrDecayStyle,
    MomentDtype, OffloadTarget, RmType, Task, TrainBackendKind,
};

/// One layer of settings (the `--config` file, or the flags): what was given, `None` where nothing
/// was. [`Settings::resolve`](super::Settings::resolve) turns the layers into [`Settings`](super::Settings).
///
/// The TOML keys are the flag names with underscores; an unknown key is an error.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSettings {
    /// `--train-backend`.
    pub train_backend: Option<TrainBackendKind>,
    /// `--colocate`.
    pub colocate: Option<bool>,
    /// `--offload`: shorthand for both offloads; the explicit switches of the same layer win.
    pub offload: Option<bool>,
    /// `--offload-train` / `--no-offload-train`.
    pub offload_train: Option<bool>,
    /// `--offload-rollout` / `--no-offload-rollout`.
    pub offload_rollout: Option<bool>,
    /// `--offload-rollout-level`, unchecked (rule 5 checks the names).
    pub offload_rollout_level: Option<Vec<String>>,
    /// `--offload-train-target`.
    pub offload_train_target: Option<OffloadTarget>,
    /// `--offload-train-disk-dir`.
    pub offload_train_disk_dir: Option<PathBuf>,
    /// `--offload-train-disk-chunk-mb`.
    pub offload_train_disk_chunk_mb: Option<u64>,
    /// `--stream-optimizer-state-to-disk`.
    pub stream_optimizer_state_to_disk: Option<bool>,
    /// `--stream-optimizer-state-moment-dtype`.
    pub stream_optimizer_state_moment_dtype: Option<MomentDtype>,
    /// `--train-memory-margin-bytes`.
    pub train_memory_margin_bytes: Option<u64>,
    /// `--fsdp-cpu-offload`.
    pub fsdp_cpu_offload: Option<bool>,
    /// `--device`.
    pub device: Option<DeviceChoice>,
    /// `--device-memory-gib`.
    pub device_memory_gib: Option<f64>,
    /// `--preset`.
    pub preset: Option<String>,
    /// `--steps`.
    pub steps: Option<u64>,
    /// `--rollout-batch-size`.
    pub rollout_batch_size: Option<usize>,
    /// `--n-samples-per-prompt`.
    pub n_samples_per_prompt: Option<usize>,
    /// `--global-batch-size`.
    pub global_batch_size: Option<usize>,
    /// `--lr`.
    pub lr: Option<f64>,
    /// `--seed`.
    pub seed: Option<u64>,
    /// `--save`.
    pub save: Option<PathBuf>,
    /// `--save-interval`.
    pub save_interval: Option<u64>,
    /// `--load`.
    pub load: Option<PathBuf>,
    /// `--tensor-model-parallel-size`.
    pub tensor_model_parallel_size: Option<usize>,
    /// `--data-parallel-size`.
    pub data_parallel_size: Option<usize>,
    /// `--rollout-mem-fraction`.
    pub rollout_mem_fraction: Option<f64>,
    /// `--update-weight-buffer-size`.
    pub update_weight_buffer_size: Option<u64>,
    /// `--advantage-estimator`.
    pub advantage_estimator: Option<AdvantageEstimator>,
    /// `--metrics`.
    pub metrics: Option<PathBuf>,
    /// `--memory-timeline`.
    pub memory_timeline: Option<PathBuf>,
    /// `--task`.
    pub task: Option<Task>,
    /// `--sft-warmup-steps`.
    pub sft_warmup_steps: Option<u64>,
    /// `--rollout-temperature`.
    pub rollout_temperature: Option<f64>,

    // Data and rewards a user brings (issue 20).
    /// `--prompt-data`.
    pub prompt_data: Option<PathBuf>,
    /// `--input-key`.
    pub input_key: Option<String>,
    /// `--label-key`.
    pub label_key: Option<String>,
    /// `--metadata-key`.
    pub metadata_key: Option<String>,
    /// `--rollout-max-prompt-len`.
    pub rollout_max_prompt_len: Option<usize>,
    /// `--rollout-long-prompt`.
    pub rollout_long_prompt: Option<LongPrompt>,
    /// `--rollout-max-response-len`.
    pub rollout_max_response_len: Option<usize>,
    /// `--rm-type`.
    pub rm_type: Option<RmType>,
    /// `--custom-rm-command`.
    pub custom_rm_command: Option<String>,
    /// `--custom-rm-timeout`.
    pub custom_rm_timeout: Option<f64>,
    /// `--eps-clip`.
    pub eps_clip: Option<f64>,
    /// `--eps-clip-high`.
    pub eps_clip_high: Option<f64>,
    /// `--use-kl-loss`.
    pub use_kl_loss: Option<bool>,
    /// `--kl-loss-coef`.
    pub kl_loss_coef: Option<f64>,
    /// `--kl-loss-type`.
    pub kl_loss_type: Option<KlLossType>,
    /// `--clip-grad`.
    pub clip_grad: Option<f64>,
    /// `--rollout-top-p`.
    pub rollout_top_p: Option<f64>,
    /// `--rollout-stop-token-ids`.
    pub rollout_stop_token_ids: Option<Vec<u32>>,
    /// `--eval-prompt-data`.
    pub eval_prompt_data: Option<PathBuf>,
    /// `--eval-interval`.
    pub eval_interval: Option<u64>,
    /// `--eval-temperature`.
    pub eval_temperature: Option<f64>,
    /// `--dump-rollouts`.
    pub dump_rollouts: Option<PathBuf>,
    /// `--lr-warmup-iters`.
    pub lr_warmup_iters: Option<u64>,
    /// `--lr-decay-style`.
    pub lr_decay_style: Option<LrDecayStyle>,
    /// `--lr-decay-iters`.
    pub lr_decay_iters: Option<u64>,
    /// `--min-lr`.
    pub min_lr: Option<f64>,
}

impl RawSettings {
    /// Reads a TOML config file.
    ///
    /// # Errors
    /// [`ConfigError::ReadFile`] when the file cannot be read, [`ConfigError::UnknownKey`] for a
    /// key no setting has, [`ConfigError::Parse`] for invalid TOML or a value of the wrong type.
    pub fn from_toml_file(path: &Path) -> Result<RawSettings, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::ReadFile {
            path: path.to_path_buf(),
            source,
        })?;
        RawSettings::from_toml_str(&text, path)
    }

    /// Parses TOML text; `origin` names it in errors.
    ///
    /// # Errors
    /// As [`RawSettings::from_toml_file`], without the read.
    pub fn from_toml_str(text: &str, origin: &Path) -> Result<RawSettings, ConfigError> {
        toml::from_str(text).map_err(|error| {
            let span = error.span();
            let before = span.as_ref().and_then(|span| text.get(..span.start));
            let line = before.map_or(0, |before| before.matches('\n').count() + 1);
            let spanned = span.and_then(|span| text.get(span)).unwrap_or_default();
            let key = spanned.trim().trim_matches(|c| c == '"' || c == '\'');
            if error.message().starts_with("unknown field") && !key.is_empty() {
                let keys = RawSettings::keys();
                let candidates: Vec<&str> = keys.iter().map(String::as_str).collect();
                ConfigError::UnknownKey {
                    origin: origin.to_path_buf(),
                    key: key.to_owned(),
                    line,
                    suggestion: nearest(key, &candidates).map(str::to_owned),
                }
            } else {
                ConfigError::Parse {
                    origin: origin.to_path_buf(),
                    line,
                    message: error.message().trim().to_owned(),
                }
            }
        })
    }

    /// Every key a config file may hold, sorted.
    pub fn keys() -> Vec<String> {
        // Every field is an `Option` serialised as `null`, so the object lists them all.
        match serde_json::to_value(RawSettings::default()) {
            Ok(serde_json::Value::Object(fields)) => fields.keys().cloned().collect(),
            _ => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<RawSettings, ConfigError> {
        RawSettings::from_toml_str(text, Path::new("test.toml"))
    }

    #[test]
    fn keys_list_every_field_of_a_layer() {
        let keys = RawSettings::keys();
        assert_eq!(keys.len(), 61);
        for key in [
            "offload",
            "offload_train",
            "offload_rollout_level",
            "memory_timeline",
        ] {
            assert!(keys.iter().any(|k| k == key), "{key} missing from {keys:?}");
        }
    }

    #[test]
    fn toml_keys_with_underscores_fill_the_layer() {
        let raw = parse(
            "train_backend = \"fsdp\"\ncolocate = true\noffload_rollout_level = [\"weight\"]\n\
             offload_train_disk_chunk_mb = 16\nlr = 3e-4\n",
        )
        .unwrap();
        assert_eq!(raw.train_backend, Some(TrainBackendKind::Fsdp));
        assert_eq!(raw.colocate, Some(true));
        assert_eq!(raw.offload_rollout_level, Some(vec!["weight".to_owned()]));
        assert_eq!(raw.offload_train_disk_chunk_mb, Some(16));
        assert_eq!(raw.lr, Some(3e-4));
        assert_eq!(raw.offload_train, None);
    }

    #[test]
    fn unknown_key_names_the_key_the_line_and_a_suggestion() {
        let error = parse("colocate = true\n\noffload_trian = true\n").unwrap_err();
        match &error {
            ConfigError::UnknownKey {
                key,
                line,
                suggestion,
                ..
            } => {
                assert_eq!(key, "offload_trian");
                assert_eq!(*line, 3);
                assert_eq!(suggestion.as_deref(), Some("offload_train"));
            }
            other => panic!("expected UnknownKey, got {other:?}"),
        }
        let message = error.to_string();
        assert!(
            message.contains("`offload_trian`") && message.contains("line 3"),
            "{message}"
        );
    }

    #[test]
    fn wrong_value_type_and_bad_enum_name_are_parse_errors_with_the_line() {
        let error = parse("steps = 3\ncolocate = \"yes\"\n").unwrap_err();
        assert!(
            matches!(error, ConfigError::Parse { line: 2, .. }),
            "{error:?}"
        );
        let error = parse("train_backend = \"fsdpp\"\n").unwrap_err();
        assert!(
            matches!(error, ConfigError::Parse { line: 1, .. }),
            "{error:?}"
        );
        assert!(
            error.to_string().contains("did you mean `fsdp`?"),
            "{error}"
        );
    }

    #[test]
    fn missing_file_is_a_read_error() {
        let dir = tempfile::tempdir().unwrap();
        let error = RawSettings::from_toml_file(&dir.path().join("absent.toml")).unwrap_err();
        assert!(matches!(error, ConfigError::ReadFile { .. }));
    }
}
