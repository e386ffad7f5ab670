//! Reading a `config.json` into a [`LlamaConfig`]: which keys are known, the range of each
//! number, and every problem reported together.

use serde_json::{Map, Value};

use super::{LlamaConfig, ModelFamily};
use crate::model::ModelError;
use crate::ops::RopeScaling;

/// Keys of config.json that describe the file or the Python runtime, not the computation.
const METADATA_KEYS: [&str; 14] = [
    "architectures",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "use_cache",
    "_name_or_path",
    "pretraining_tp",
    "tokenizer_class",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "torchscript",
    "id2label",
    "label2id",
];

/// Keys this module reads and checks.
const MODEL_KEYS: [&str; 26] = [
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "tie_word_embeddings",
    "initializer_range",
    "hidden_act",
    "attention_dropout",
    "attention_bias",
    "mlp_bias",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
];

/// The largest vocabulary, width, MLP width, layer count, head count, head dim and context a
/// config may ask for (each far above any released model of these families), so that no size
/// arithmetic overflows and no allocation is asked for that no machine has.
const LIMITS: [(&str, u64); 8] = [
    ("vocab_size", 1 << 24),
    ("hidden_size", 1 << 16),
    ("intermediate_size", 1 << 20),
    ("num_hidden_layers", 1 << 10),
    ("num_attention_heads", 1 << 10),
    ("num_key_value_heads", 1 << 10),
    ("head_dim", 1 << 10),
    ("max_position_embeddings", 1 << 20),
];

/// Parameters a model may have at most (2^38, a terabyte in fp32).
const MAX_PARAMS: u128 = 1 << 38;

impl LlamaConfig {
    pub(super) fn from_value(value: Value) -> Result<Self, ModelError> {
        let Value::Object(mut raw) = value else {
            return Err(ModelError::Config(
                "config.json must be a JSON object".into(),
            ));
        };
        // The dtype of the stored weights, rewritten by whoever saves them.
        raw.remove("torch_dtype");
        raw.remove("dtype");
        let mut p = Problems::default();
        let family = match raw.get("model_type") {
            None => ModelFamily::Llama,
            Some(Value::String(t)) => ModelFamily::parse(t).unwrap_or_else(|| {
                p.push(format!(
                    "model_type = \"{t}\" is not implemented; miles computes llama, mistral (without sliding window), qwen2 and qwen3"
                ));
                ModelFamily::Llama
            }),
            Some(v) => {
                p.push(format!("model_type = {v} must be a string"));
                ModelFamily::Llama
            }
        };
        for key in raw.keys() {
            if !METADATA_KEYS.contains(&key.as_str()) && !MODEL_KEYS.contains(&key.as_str()) {
                p.push(format!(
                    "{key} = {} is not implemented by miles (it would change what the model computes or miles cannot tell); remove it if it does not",
                    raw[key]
                ));
            }
        }
        if let Some(act) = raw.get("hidden_act")
            && act.as_str() != Some("silu")
        {
            p.push(format!(
                "hidden_act = {act} is not implemented; only \"silu\" is"
            ));
        }
        if let Some(d) = raw.get("attention_dropout")
            && d.as_f64() != Some(0.0)
        {
            p.push(format!(
                "attention_dropout = {d} is not implemented; set it to 0.0"
            ));
        }
        if truthy(&raw, "mlp_bias") {
            p.push(
                "mlp_bias = true is not implemented: the mlp has no biases; set it to false".into(),
            );
        }
        if family != ModelFamily::Qwen2 && truthy(&raw, "attention_bias") {
            p.push(format!(
                "attention_bias = true is not implemented for {} (it adds an o_proj bias too); set it to false",
                family.model_type()
            ));
        }
        match family {
            ModelFamily::Qwen2 | ModelFamily::Qwen3 => {
                if truthy(&raw, "use_sliding_window") {
                    p.push("use_sliding_window = true is not implemented: attention is full; set it to false".into());
                }
            }
            ModelFamily::Llama | ModelFamily::Mistral => {
                if let Some(w) = raw.get("sliding_window").filter(|v| !v.is_null()) {
                    p.push(format!(
                        "sliding_window = {w} is not implemented: attention is full; set it to null"
                    ));
                }
            }
        }
        if let Some(types) = raw.get("layer_types").filter(|v| !v.is_null()) {
            let full = types
                .as_array()
                .is_some_and(|a| a.iter().all(|t| t.as_str() == Some("full_attention")));
            if !full {
                p.push(format!(
                    "layer_types = {types} is not implemented: every layer must be \"full_attention\""
                ));
            }
        }
        let hidden_size = p.size(&raw, "hidden_size");
        let num_heads = p.size(&raw, "num_attention_heads");
        let num_kv_heads = match raw.get("num_key_value_heads") {
            None | Some(Value::Null) => num_heads,
            Some(_) => p.size(&raw, "num_key_value_heads"),
        };
        let head_dim = match raw.get("head_dim") {
            None | Some(Value::Null) => {
                if num_heads > 0 && hidden_size % num_heads != 0 {
                    p.push(format!(
                        "hidden_size {hidden_size} is not a multiple of num_attention_heads {num_heads}; set head_dim"
                    ));
                }
                hidden_size / num_heads.max(1)
            }
            Some(_) => p.size(&raw, "head_dim"),
        };
        if num_kv_heads > 0 && num_heads % num_kv_heads != 0 {
            p.push(format!(
                "num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}"
            ));
        }
        if head_dim % 2 != 0 {
            p.push(format!(
                "head_dim {head_dim} is odd, rotary embedding needs an even head_dim"
            ));
        }
        let max_position_embeddings = p.size(&raw, "max_position_embeddings");
        let (rope_theta, rope_scaling) = p.rope(&raw, max_position_embeddings);
        let config = Self {
            family,
            vocab_size: p.size(&raw, "vocab_size"),
            hidden_size,
            intermediate_size: p.size(&raw, "intermediate_size"),
            num_layers: p.size(&raw, "num_hidden_layers"),
            num_heads,
            num_kv_heads,
            head_dim,
            max_position_embeddings,
            rms_norm_eps: p.number(&raw, "rms_norm_eps", 1e-6, f64::MIN_POSITIVE..1.0) as f32,
            rope_theta,
            rope_scaling,
            qkv_bias: family == ModelFamily::Qwen2,
            qk_norm: family == ModelFamily::Qwen3,
            tie_word_embeddings: p.flag(&raw, "tie_word_embeddings", false),
            initializer_range: p.number(&raw, "initializer_range", 0.02, 0.0..10.0) as f32,
            raw,
        };
        for key in ["bos_token_id", "pad_token_id"] {
            if let Some(v) = config.raw.get(key).filter(|v| !v.is_null()) {
                p.token(key, v, config.vocab_size);
            }
        }
        if let Some(v) = config.raw.get("eos_token_id").filter(|v| !v.is_null()) {
            match v.as_array() {
                Some(ids) if !ids.is_empty() => {
                    for id in ids {
                        p.token("eos_token_id", id, config.vocab_size);
                    }
                }
                Some(_) => p.push("eos_token_id = [] must name at least one id".into()),
                None => p.token("eos_token_id", v, config.vocab_size),
            }
        }
        if p.0.is_empty() {
            let count = config.param_count_wide();
            if count > MAX_PARAMS {
                p.push(format!(
                    "the config describes {count} parameters, more than miles holds ({MAX_PARAMS}); check hidden_size, intermediate_size, num_hidden_layers and vocab_size"
                ));
            }
        }
        if !p.0.is_empty() {
            return Err(ModelError::Config(p.0.join("; ")));
        }
        Ok(config)
    }
}

fn truthy(raw: &Map<String, Value>, key: &str) -> bool {
    raw.get(key).and_then(Value::as_bool).unwrap_or(false)
}

/// Every problem found in a config, reported together.
#[derive(Default)]
struct Problems(Vec<String>);

impl Problems {
    fn push(&mut self, problem: String) {
        self.0.push(problem);
    }

    /// A required positive integer of at most its [`LIMITS`] bound (0 after a problem).
    fn size(&mut self, raw: &Map<String, Value>, key: &str) -> usize {
        let max = LIMITS
            .iter()
            .find(|(k, _)| *k == key)
            .map_or(1 << 20, |(_, m)| *m);
        match raw.get(key) {
            None | Some(Value::Null) => {
                self.push(format!("{key} is missing; give a positive integer"));
                0
            }
            Some(v) => match v.as_u64() {
                Some(n) if (1..=max).contains(&n) => n as usize,
                _ => {
                    self.push(format!("{key} = {v} must be an integer in 1..={max}"));
                    0
                }
            },
        }
    }

    /// An optional finite number in `range` (the default when absent).
    fn number(
        &mut self,
        raw: &Map<String, Value>,
        key: &str,
        default: f64,
        range: std::ops::Range<f64>,
    ) -> f64 {
        match raw.get(key) {
            None | Some(Value::Null) => default,
            Some(v) => match v.as_f64() {
                Some(x) if range.contains(&x) => x,
                _ => {
                    self.push(format!(
                        "{key} = {v} must be a number in [{}, {})",
                        range.start, range.end
                    ));
                    default
                }
            },
        }
    }

    fn flag(&mut self, raw: &Map<String, Value>, key: &str, default: bool) -> bool {
        match raw.get(key) {
            None | Some(Value::Null) => default,
            Some(Value::Bool(b)) => *b,
            Some(v) => {
                self.push(format!("{key} = {v} must be true or false"));
                default
            }
        }
    }

    fn token(&mut self, key: &str, v: &Value, vocab: usize) {
        if v.as_u64().is_none_or(|id| id as usize >= vocab) {
            self.push(format!(
                "{key} = {v} must be a token id below vocab_size {vocab}"
            ));
        }
    }

    /// `rope_theta` and the scaling, from `rope_theta`, `rope_scaling` (transformers 4) and
    /// `rope_parameters` (transformers 5).
    fn rope(&mut self, raw: &Map<String, Value>, max_positions: usize) -> (f64, RopeScaling) {
        let params = raw.get("rope_parameters").filter(|v| !v.is_null());
        let scaling = raw.get("rope_scaling").filter(|v| !v.is_null());
        let (key, dict) = match (params, scaling) {
            (Some(_), Some(_)) => {
                self.push("rope_parameters and rope_scaling are both set; keep one".into());
                return (10000.0, RopeScaling::Default);
            }
            (Some(p), None) => ("rope_parameters", Some(p)),
            (None, Some(s)) => ("rope_scaling", Some(s)),
            (None, None) => ("rope_scaling", None),
        };
        let mut theta = self.number(raw, "rope_theta", 10000.0, f64::MIN_POSITIVE..1e12);
        let Some(dict) = dict else {
            return (theta, RopeScaling::Default);
        };
        let Some(d) = dict.as_object() else {
            self.push(format!("{key} = {dict} must be an object or null"));
            return (theta, RopeScaling::Default);
        };
        if let Some(t) = d.get("rope_theta") {
            let inner = self.number(d, "rope_theta", 10000.0, f64::MIN_POSITIVE..1e12);
            if raw.contains_key("rope_theta") && inner != theta {
                self.push(format!(
                    "rope_theta = {theta} and {key}.rope_theta = {t} differ; keep one"
                ));
            }
            theta = inner;
        }
        let kind = d
            .get("rope_type")
            .or_else(|| d.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
        let allowed: &[&str] = match kind {
            "default" => &[],
            "linear" => &["factor"],
            "dynamic" => &["factor", "original_max_position_embeddings"],
            "llama3" => &[
                "factor",
                "low_freq_factor",
                "high_freq_factor",
                "original_max_position_embeddings",
            ],
            other => {
                self.push(format!(
                    "{key}.rope_type = \"{other}\" is not implemented; miles implements default, linear, dynamic and llama3"
                ));
                return (theta, RopeScaling::Default);
            }
        };
        for (k, v) in d {
            if !["rope_type", "type", "rope_theta"].contains(&k.as_str())
                && !allowed.contains(&k.as_str())
            {
                self.push(format!(
                    "{key}.{k} = {v} is not implemented for rope_type \"{kind}\""
                ));
            }
        }
        let mut need = |field: &str, range: std::ops::Range<f64>| -> f32 {
            if !d.contains_key(field) {
                self.push(format!("{key}.{field} is missing for rope_type \"{kind}\""));
                return 1.0;
            }
            self.number(d, field, 1.0, range) as f32
        };
        let scaling = match kind {
            "linear" => RopeScaling::Linear {
                factor: need("factor", 1.0..1e6),
            },
            "dynamic" => {
                need("factor", 1.0..1e6);
                // Dynamic NTK scaling changes the frequencies only past the original context;
                // miles refuses sequences past max_position_embeddings, so below it the
                // frequencies are the default ones.
                if let Some(orig) = d.get("original_max_position_embeddings")
                    && orig.as_u64().is_none_or(|o| (o as usize) < max_positions)
                {
                    self.push(format!(
                        "{key}.original_max_position_embeddings = {orig} below max_position_embeddings {max_positions} is not implemented for rope_type \"dynamic\""
                    ));
                }
                RopeScaling::Default
            }
            "llama3" => {
                let factor = need("factor", 1.0..1e6);
                let low = need("low_freq_factor", f64::MIN_POSITIVE..1e6);
                let high = need("high_freq_factor", f64::MIN_POSITIVE..1e6);
                let orig = need("original_max_position_embeddings", 1.0..1e9);
                if high <= low {
                    self.push(format!(
                        "{key}.high_freq_factor {high} must exceed low_freq_factor {low}"
                    ));
                }
                RopeScaling::Llama3 {
                    factor,
                    low_freq_factor: low,
                    high_freq_factor: high,
                    original_max_position_embeddings: orig,
                }
            }
            _ => RopeScaling::Default,
        };
        (theta, scaling)
    }
}
