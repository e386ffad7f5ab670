//! The model's config: a Hugging Face `config.json` of the Llama, Mistral, Qwen2 or Qwen3
//! family, validated into the sizes the model runs on. Every key is either read and checked
//! (each number against a documented range) or known not to change the computation; any other
//! key is refused by name.

use std::path::Path;

use serde_json::{Map, Value};

use super::ModelError;
use crate::ops::{RopeScaling, RopeTable};

/// The built-in presets, each a Hugging Face Llama `config.json`.
const PRESETS: [(&str, &str); 5] = [
    ("tiny", include_str!("../../presets/tiny.json")),
    ("small", include_str!("../../presets/small.json")),
    ("0.5b", include_str!("../../presets/0.5b.json")),
    ("1b", include_str!("../../presets/1b.json")),
    ("3b", include_str!("../../presets/3b.json")),
];

/// The model families a config may name in `model_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelFamily {
    /// `llama`: Llama 2 and 3.x (the presets are of this family).
    Llama,
    /// `mistral` without a sliding window: the Llama computation.
    Mistral,
    /// `qwen2`: Llama plus biases on the q, k and v projections.
    Qwen2,
    /// `qwen3`: Llama plus a per-head RMSNorm of queries and keys, with an explicit `head_dim`.
    Qwen3,
}

impl ModelFamily {
    /// The `model_type` of config.json.
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Mistral => "mistral",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
        }
    }

    /// The transformers class that loads this family.
    pub fn architecture(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Mistral => "MistralForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
        }
    }

    fn parse(model_type: &str) -> Option<Self> {
        [Self::Llama, Self::Mistral, Self::Qwen2, Self::Qwen3]
            .into_iter()
            .find(|f| f.model_type() == model_type)
    }
}

/// A validated Llama-style config (of any [`ModelFamily`]).
///
/// Dimension letters used across the model: `B` batch, `T` time (sequence), `C` hidden channels,
/// `H` query heads, `K` key/value heads, `D` head dim, `F` MLP intermediate, `V` vocabulary,
/// `L` layers.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// The family (`model_type`).
    pub family: ModelFamily,
    /// `V`: vocabulary size.
    pub vocab_size: usize,
    /// `C`: hidden size.
    pub hidden_size: usize,
    /// `F`: MLP intermediate size.
    pub intermediate_size: usize,
    /// `L`: decoder layers.
    pub num_layers: usize,
    /// `H`: query heads.
    pub num_heads: usize,
    /// `K`: key/value heads (grouped-query attention when fewer than `H`).
    pub num_kv_heads: usize,
    /// `D`: channels per head.
    pub head_dim: usize,
    /// Longest sequence the model accepts.
    pub max_position_embeddings: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// Rotary embedding base.
    pub rope_theta: f64,
    /// Rescaling of the rotary frequencies.
    pub rope_scaling: RopeScaling,
    /// Whether the q, k and v projections carry biases (`qwen2`).
    pub qkv_bias: bool,
    /// Whether queries and keys go through a per-head RMSNorm before the rotation (`qwen3`).
    pub qk_norm: bool,
    /// Whether the LM head reuses the token embedding.
    pub tie_word_embeddings: bool,
    /// Standard deviation of the normal initialisation of weight matrices.
    pub initializer_range: f32,
    /// The config.json as read, written back into checkpoints.
    raw: Map<String, Value>,
}

impl LlamaConfig {
    /// The built-in preset `name` (`tiny`, `small`, `0.5b`, `1b`, `3b`).
    ///
    /// # Errors
    /// [`ModelError::UnknownPreset`] for any other name.
    pub fn preset(name: &str) -> Result<Self, ModelError> {
        let Some((_, json)) = PRESETS.iter().find(|(n, _)| *n == name) else {
            return Err(ModelError::UnknownPreset {
                name: name.to_string(),
                known: Self::preset_names().join(", "),
            });
        };
        Self::from_json_str(json)
    }

    /// The model a run computes: the config.json of `--hf-checkpoint`, else that of the
    /// checkpoint `--load` resumes (its actor's), else `--preset`'s. With both flags the two
    /// configs must describe the same model.
    ///
    /// # Errors
    /// [`ModelError::Config`] naming the flag and every differing field; the errors of
    /// [`from_file`](Self::from_file) and [`preset`](Self::preset).
    pub fn from_settings(s: &crate::config::Settings) -> Result<Self, ModelError> {
        let named = |flag: &str, dir: &Path| {
            let flag = flag.to_string();
            let dir = dir.display().to_string();
            move |e: ModelError| ModelError::Config(format!("{flag} {dir}: {e}"))
        };
        let hf = s
            .hf_checkpoint
            .as_deref()
            .map(|dir| {
                Self::from_file(&dir.join("config.json")).map_err(named("--hf-checkpoint", dir))
            })
            .transpose()?;
        let loaded = match s.load.as_deref() {
            Some(dir) => {
                let resolved = crate::orchestrator::resolve_checkpoint(dir)
                    .map_err(|e| ModelError::Config(format!("--load {}: {e}", dir.display())))?;
                let actor = resolved.join("actor").join("config.json");
                let file = if actor.exists() {
                    actor
                } else {
                    resolved.join("config.json")
                };
                file.exists()
                    .then(|| Self::from_file(&file).map_err(named("--load", dir)))
                    .transpose()?
            }
            None => None,
        };
        match (hf, loaded) {
            (Some(hf), Some(loaded)) => {
                let diff = hf.differences(&loaded);
                if diff.is_empty() {
                    Ok(hf)
                } else {
                    Err(ModelError::Config(format!(
                        "--load's checkpoint is another model than --hf-checkpoint's ({}); load a checkpoint of this model",
                        diff.join(", ")
                    )))
                }
            }
            (Some(c), None) | (None, Some(c)) => Ok(c),
            (None, None) => Self::preset(&s.preset),
        }
    }

    /// Names of the built-in presets.
    pub fn preset_names() -> Vec<&'static str> {
        PRESETS.iter().map(|(n, _)| *n).collect()
    }

    /// Reads and validates a `config.json` file (at most 1 MiB).
    ///
    /// # Errors
    /// [`ModelError::Io`], [`ModelError::Json`], or [`ModelError::Config`] naming every bad key.
    pub fn from_file(path: &Path) -> Result<Self, ModelError> {
        let text = read_small_file(path, 1 << 20)?;
        let value: Value = serde_json::from_str(&text).map_err(|source| ModelError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_value(value)
    }

    /// Parses and validates a `config.json` text.
    ///
    /// # Errors
    /// [`ModelError::Config`] naming every bad key.
    pub fn from_json_str(json: &str) -> Result<Self, ModelError> {
        let value: Value = serde_json::from_str(json)
            .map_err(|e| ModelError::Config(format!("not valid JSON: {e}")))?;
        Self::from_value(value)
    }

    /// Parameters of the model, without overflow (every size is bounded by `parse::LIMITS`).
    fn param_count_wide(&self) -> u128 {
        let w = |x: usize| x as u128;
        let (c, f, v, d) = (
            w(self.hidden_size),
            w(self.intermediate_size),
            w(self.vocab_size),
            w(self.head_dim),
        );
        let (q, kv) = (w(self.num_heads) * d, w(self.num_kv_heads) * d);
        let mut layer = 2 * c + q * c * 2 + kv * c * 2 + 3 * c * f;
        if self.qkv_bias {
            layer += q + 2 * kv;
        }
        if self.qk_norm {
            layer += 2 * d;
        }
        let head = if self.tie_word_embeddings { 0 } else { v * c };
        v * c + w(self.num_layers) * layer + c + head
    }

    /// The config as `config.json` text: the JSON it was read from, with float32 as its dtype.
    pub fn to_json_string(&self) -> String {
        self.to_json_string_in("float32")
    }

    /// The config as `config.json` text: the JSON it was read from, with `torch_dtype` set to
    /// `dtype`.
    pub fn to_json_string_in(&self, dtype: &str) -> String {
        let mut raw = self.raw.clone();
        raw.insert("torch_dtype".into(), Value::String(dtype.into()));
        let mut text = serde_json::to_string_pretty(&Value::Object(raw)).unwrap_or_default();
        text.push('\n');
        text
    }

    /// This config with weight matrices initialised from `N(0, std²)` instead (kept in the
    /// written config.json as `initializer_range`).
    pub fn with_initializer_range(mut self, std: f32) -> Self {
        self.initializer_range = std;
        if let Some(n) = serde_json::Number::from_f64(f64::from(std)) {
            self.raw
                .insert("initializer_range".into(), Value::Number(n));
        }
        self
    }

    /// An integer token id of the config (`bos_token_id`, `eos_token_id`, `pad_token_id`), if set;
    /// for an `eos_token_id` list, its first id.
    pub fn token_id(&self, key: &str) -> Option<u32> {
        let v = self.raw.get(key)?;
        let v = v.as_array().and_then(|a| a.first()).unwrap_or(v);
        v.as_u64().and_then(|v| u32::try_from(v).ok())
    }

    /// Every id of `eos_token_id` (one, a list, or none).
    pub fn eos_token_ids(&self) -> Vec<u32> {
        match self.raw.get("eos_token_id") {
            Some(Value::Array(ids)) => ids
                .iter()
                .filter_map(|v| v.as_u64().and_then(|v| u32::try_from(v).ok()))
                .collect(),
            _ => self.token_id("eos_token_id").into_iter().collect(),
        }
    }

    /// `H * D`: channels of all query heads together.
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// `K * D`: channels of all key (or value) heads together.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// The rotary tables of this model, for every position it accepts.
    pub fn rope_table(&self) -> RopeTable {
        self.rope_table_for(self.max_position_embeddings)
    }

    /// The rotary tables of this model for its first `positions` positions (the rows of
    /// [`rope_table`](Self::rope_table), which do not depend on how many there are).
    pub fn rope_table_for(&self, positions: usize) -> RopeTable {
        RopeTable::scaled(self.head_dim, self.rope_theta, positions, self.rope_scaling)
    }

    /// The config keys whose values differ between `self` and `other`, each as
    /// `key: self's vs other's` (empty when both compute the same model).
    pub fn differences(&self, other: &Self) -> Vec<String> {
        let mut out = Vec::new();
        let mut cmp = |key: &str, a: String, b: String| {
            if a != b {
                out.push(format!("{key}: {a} vs {b}"));
            }
        };
        cmp(
            "model_type",
            self.family.model_type().into(),
            other.family.model_type().into(),
        );
        for (key, a, b) in [
            ("vocab_size", self.vocab_size, other.vocab_size),
            ("hidden_size", self.hidden_size, other.hidden_size),
            (
                "intermediate_size",
                self.intermediate_size,
                other.intermediate_size,
            ),
            ("num_hidden_layers", self.num_layers, other.num_layers),
            ("num_attention_heads", self.num_heads, other.num_heads),
            ("num_key_value_heads", self.num_kv_heads, other.num_kv_heads),
            ("head_dim", self.head_dim, other.head_dim),
            (
                "max_position_embeddings",
                self.max_position_embeddings,
                other.max_position_embeddings,
            ),
        ] {
            cmp(key, a.to_string(), b.to_string());
        }
        cmp(
            "rms_norm_eps",
            self.rms_norm_eps.to_string(),
            other.rms_norm_eps.to_string(),
        );
        cmp(
            "rope_theta",
            self.rope_theta.to_string(),
            other.rope_theta.to_string(),
        );
        cmp(
            "rope_scaling",
            format!("{:?}", self.rope_scaling),
            format!("{:?}", other.rope_scaling),
        );
        cmp(
            "tie_word_embeddings",
            self.tie_word_embeddings.to_string(),
            other.tie_word_embeddings.to_string(),
        );
        out
    }

    /// Checks that the CUDA path (the GPU trainer and the GPU rollout engine, which `--device
    /// cuda` runs together) computes this model: every family, biases and q/k norms included,
    /// with a head dim the engine's paged attention and the trainer's flash attention take
    /// (at most [`PAGED_MAX_HEAD_DIM`](crate::ops::gpu::PAGED_MAX_HEAD_DIM) and
    /// [`FLASH_MAX_HEAD_DIM`](crate::ops::gpu::FLASH_MAX_HEAD_DIM)).
    ///
    /// # Errors
    /// [`ModelError::Config`] naming `head_dim` and its value.
    pub fn check_gpu_support(&self) -> Result<(), ModelError> {
        let max = crate::ops::gpu::PAGED_MAX_HEAD_DIM.min(crate::ops::gpu::FLASH_MAX_HEAD_DIM);
        if self.head_dim > max {
            return Err(ModelError::Config(format!(
                "head_dim = {} is not implemented by the cuda kernels (their attention takes at most {max}); use --device cpu",
                self.head_dim
            )));
        }
        Ok(())
    }

    /// Parameters of the model.
    pub fn param_count(&self) -> usize {
        usize::try_from(self.param_count_wide()).unwrap_or(usize::MAX)
    }
}

/// Reads a small text file (a config, an index, a tokenizer config), refusing anything but a
/// regular file of at most `limit` bytes before reading it.
///
/// # Errors
/// [`ModelError::Io`] naming the file.
pub(crate) fn read_small_file(path: &Path, limit: u64) -> Result<String, ModelError> {
    let io = |source| ModelError::Io {
        action: "read",
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    if !meta.is_file() || meta.len() > limit {
        return Err(io(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "not a regular file of at most {limit} bytes ({} bytes, {})",
                meta.len(),
                if meta.is_file() {
                    "regular"
                } else {
                    "not regular"
                }
            ),
        )));
    }
    let mut text = String::new();
    std::io::Read::read_to_string(&mut std::io::Read::take(file, limit), &mut text).map_err(io)?;
    Ok(text)
}

#[path = "config_parse.rs"]
mod parse;

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
