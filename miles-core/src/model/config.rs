//! The model's config: a Hugging Face Llama `config.json`, validated into the sizes the model runs on.

use std::path::Path;

use serde_json::{Map, Value};

use super::ModelError;

/// The built-in presets, each a Hugging Face Llama `config.json`.
const PRESETS: [(&str, &str); 5] = [
    ("tiny", include_str!("../../presets/tiny.json")),
    ("small", include_str!("../../presets/small.json")),
    ("0.5b", include_str!("../../presets/0.5b.json")),
    ("1b", include_str!("../../presets/1b.json")),
    ("3b", include_str!("../../presets/3b.json")),
];

/// A validated Llama config.
///
/// Dimension letters used across the model: `B` batch, `T` time (sequence), `C` hidden channels,
/// `H` query heads, `K` key/value heads, `D` head dim, `F` MLP intermediate, `V` vocabulary,
/// `L` layers.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
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
    /// Whether the LM head reuses the token embedding.
    pub tie_word_embeddings: bool,
    /// Standard deviation of the normal initialisation of weight matrices.
    pub initializer_range: f32,
    /// The config.json as read, written back unchanged into checkpoints.
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

    /// Names of the built-in presets.
    pub fn preset_names() -> Vec<&'static str> {
        PRESETS.iter().map(|(n, _)| *n).collect()
    }

    /// Reads and validates a `config.json` file.
    ///
    /// # Errors
    /// [`ModelError::Io`], [`ModelError::Json`], or [`ModelError::Config`] naming the bad key.
    pub fn from_file(path: &Path) -> Result<Self, ModelError> {
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
            action: "read",
            path: path.to_path_buf(),
            source,
        })?;
        let value: Value = serde_json::from_str(&text).map_err(|source| ModelError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_value(value)
    }

    /// Parses and validates a `config.json` text.
    ///
    /// # Errors
    /// [`ModelError::Config`] naming the bad key.
    pub fn from_json_str(json: &str) -> Result<Self, ModelError> {
        let value: Value = serde_json::from_str(json)
            .map_err(|e| ModelError::Config(format!("not valid JSON: {e}")))?;
        Self::from_value(value)
    }

    fn from_value(value: Value) -> Result<Self, ModelError> {
        let Value::Object(raw) = value else {
            return Err(ModelError::Config(
                "config.json must be a JSON object".into(),
            ));
        };
        if let Some(t) = raw.get("model_type").and_then(Value::as_str)
            && t != "llama"
        {
            return Err(ModelError::Config(format!(
                "model_type is `{t}`, this model computes `llama`"
            )));
        }
        let act = raw
            .get("hidden_act")
            .and_then(Value::as_str)
            .unwrap_or("silu");
        if act != "silu" {
            return Err(ModelError::Config(format!(
                "hidden_act is `{act}`, only `silu` is implemented"
            )));
        }
        for key in ["attention_bias", "mlp_bias"] {
            if raw.get(key).and_then(Value::as_bool).unwrap_or(false) {
                return Err(ModelError::Config(format!(
                    "{key} is true, biases are not implemented; set it to false"
                )));
            }
        }
        if raw.get("rope_scaling").is_some_and(|v| !v.is_null()) {
            return Err(ModelError::Config(
                "rope_scaling is set, only the default rotary embedding is implemented; set it to null".into(),
            ));
        }
        let hidden_size = usize_key(&raw, "hidden_size")?;
        let num_heads = usize_key(&raw, "num_attention_heads")?;
        let num_kv_heads = match raw.get("num_key_value_heads") {
            None | Some(Value::Null) => num_heads,
            Some(_) => usize_key(&raw, "num_key_value_heads")?,
        };
        let head_dim = match raw.get("head_dim") {
            None | Some(Value::Null) => {
                if hidden_size % num_heads != 0 {
                    return Err(ModelError::Config(format!(
                        "hidden_size {hidden_size} is not a multiple of num_attention_heads {num_heads}; set head_dim"
                    )));
                }
                hidden_size / num_heads
            }
            Some(_) => usize_key(&raw, "head_dim")?,
        };
        if num_heads % num_kv_heads != 0 {
            return Err(ModelError::Config(format!(
                "num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}"
            )));
        }
        if head_dim % 2 != 0 {
            return Err(ModelError::Config(format!(
                "head_dim {head_dim} is odd, rotary embedding needs an even head_dim"
            )));
        }
        let rope_theta = raw
            .get("rope_theta")
            .or_else(|| raw.get("rope_parameters").and_then(|p| p.get("rope_theta")))
            .and_then(Value::as_f64)
            .unwrap_or(10000.0);
        Ok(Self {
            vocab_size: usize_key(&raw, "vocab_size")?,
            hidden_size,
            intermediate_size: usize_key(&raw, "intermediate_size")?,
            num_layers: usize_key(&raw, "num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            max_position_embeddings: usize_key(&raw, "max_position_embeddings")?,
            rms_norm_eps: f64_key(&raw, "rms_norm_eps", 1e-6)? as f32,
            rope_theta,
            tie_word_embeddings: raw
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            initializer_range: f64_key(&raw, "initializer_range", 0.02)? as f32,
            raw,
        })
    }

    /// The config as `config.json` text: the JSON it was read from, with float32 as its dtype.
    pub fn to_json_string(&self) -> String {
        let mut raw = self.raw.clone();
        raw.insert("torch_dtype".into(), Value::String("float32".into()));
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

    /// An integer token id of the config (`bos_token_id`, `eos_token_id`, `pad_token_id`), if set.
    pub fn token_id(&self, key: &str) -> Option<u32> {
        self.raw
            .get(key)
            .and_then(Value::as_u64)
            .and_then(|v| u32::try_from(v).ok())
    }

    /// `H * D`: channels of all query heads together.
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// `K * D`: channels of all key (or value) heads together.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

fn usize_key(raw: &Map<String, Value>, key: &str) -> Result<usize, ModelError> {
    match raw.get(key).and_then(Value::as_u64) {
        Some(v) if v > 0 => usize::try_from(v)
            .map_err(|_| ModelError::Config(format!("{key} = {v} does not fit this machine"))),
        Some(_) => Err(ModelError::Config(format!("{key} must be positive"))),
        None => Err(ModelError::Config(format!(
            "{key} is missing or not a positive integer"
        ))),
    }
}

fn f64_key(raw: &Map<String, Value>, key: &str, default: f64) -> Result<f64, ModelError> {
    match raw.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v
            .as_f64()
            .filter(|x| x.is_finite() && *x >= 0.0)
            .ok_or_else(|| ModelError::Config(format!("{key} must be a non-negative number"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_parses_with_consistent_heads() {
        for name in LlamaConfig::preset_names() {
            let c = LlamaConfig::preset(name).unwrap();
            assert_eq!(c.num_heads % c.num_kv_heads, 0, "{name}");
            assert_eq!(c.token_id("bos_token_id"), Some(256), "{name}");
        }
    }

    #[test]
    fn unknown_preset_lists_the_known_ones() {
        let err = LlamaConfig::preset("huge").unwrap_err().to_string();
        assert!(err.contains("huge") && err.contains("tiny"), "{err}");
    }

    #[test]
    fn biases_and_rope_scaling_are_refused_by_name() {
        let mut v: Value = serde_json::from_str(include_str!("../../presets/tiny.json")).unwrap();
        v["mlp_bias"] = Value::Bool(true);
        let err = LlamaConfig::from_json_str(&v.to_string())
            .unwrap_err()
            .to_string();
        assert!(err.contains("mlp_bias"), "{err}");
        v["mlp_bias"] = Value::Bool(false);
        v["rope_scaling"] = serde_json::json!({"rope_type": "linear", "factor": 2.0});
        let err = LlamaConfig::from_json_str(&v.to_string())
            .unwrap_err()
            .to_string();
        assert!(err.contains("rope_scaling"), "{err}");
    }
}
