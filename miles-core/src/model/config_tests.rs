use serde_json::json;

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
    v["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 2.0});
    let err = LlamaConfig::from_json_str(&v.to_string())
        .unwrap_err()
        .to_string();
    assert!(err.contains("rope_scaling.rope_type = \"yarn\""), "{err}");
}

type Edit = Box<dyn FnOnce(&mut Value)>;

fn with(family: &str, edit: impl FnOnce(&mut Value)) -> Result<LlamaConfig, ModelError> {
    let mut v: Value = serde_json::from_str(include_str!("../../presets/tiny.json")).unwrap();
    v["model_type"] = Value::String(family.into());
    edit(&mut v);
    LlamaConfig::from_json_str(&v.to_string())
}

fn refused(family: &str, edit: impl FnOnce(&mut Value)) -> String {
    with(family, edit).unwrap_err().to_string()
}

#[test]
fn every_unimplemented_field_is_refused_naming_it_and_its_value() {
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "mistral",
            Box::new(|v| v["sliding_window"] = json!(4096)),
            "sliding_window = 4096",
        ),
        (
            "qwen2",
            Box::new(|v| v["use_sliding_window"] = json!(true)),
            "use_sliding_window = true",
        ),
        (
            "qwen3",
            Box::new(|v| v["layer_types"] = json!(["sliding_attention", "full_attention"])),
            "layer_types",
        ),
        (
            "llama",
            Box::new(|v| v["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0})),
            "rope_scaling.rope_type = \"yarn\"",
        ),
        (
            "llama",
            Box::new(|v| {
                v["rope_scaling"] = json!({"type": "linear", "factor": 2.0, "beta_fast": 32})
            }),
            "rope_scaling.beta_fast = 32",
        ),
        (
            "llama",
            Box::new(|v| v["num_experts"] = json!(8)),
            "num_experts = 8",
        ),
        (
            "llama",
            Box::new(|v| v["attention_bias"] = json!(true)),
            "attention_bias = true",
        ),
        (
            "qwen3",
            Box::new(|v| v["attention_bias"] = json!(true)),
            "attention_bias = true",
        ),
        (
            "llama",
            Box::new(|v| v["hidden_act"] = json!("gelu")),
            "hidden_act = \"gelu\"",
        ),
        (
            "llama",
            Box::new(|v| v["attention_dropout"] = json!(0.1)),
            "attention_dropout = 0.1",
        ),
        ("qwen2_moe", Box::new(|_| {}), "model_type = \"qwen2_moe\""),
        (
            "llama",
            Box::new(|v| v["hidden_size"] = json!(1u64 << 40)),
            "hidden_size = 1099511627776",
        ),
        (
            "llama",
            Box::new(|v| v["vocab_size"] = json!(-3)),
            "vocab_size = -3",
        ),
        (
            "llama",
            Box::new(|v| v["rms_norm_eps"] = json!(2.0)),
            "rms_norm_eps = 2.0",
        ),
        (
            "llama",
            Box::new(|v| v["eos_token_id"] = json!([257, 999])),
            "eos_token_id = 999",
        ),
    ];
    for (family, edit, named) in cases {
        let err = refused(family, edit);
        assert!(err.contains(named), "{named}: {err}");
    }
}

#[test]
fn the_largest_config_within_every_range_is_refused_by_its_parameter_count() {
    let err = refused("llama", |v| {
        v["hidden_size"] = json!(1 << 16);
        v["num_attention_heads"] = json!(64);
        v["num_key_value_heads"] = json!(64);
        v["intermediate_size"] = json!(1 << 20);
        v["num_hidden_layers"] = json!(1024);
    });
    assert!(err.contains("parameters"), "{err}");
}

#[test]
fn families_rope_scaling_and_eos_lists_are_read() {
    let c = with("llama", |v| {
        v["rope_parameters"] = json!({
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192
        });
        v.as_object_mut().unwrap().remove("rope_theta");
        v.as_object_mut().unwrap().remove("rope_scaling");
        v["eos_token_id"] = json!([257, 258]);
    })
    .unwrap();
    assert_eq!(c.rope_theta, 500000.0);
    assert!(matches!(c.rope_scaling, RopeScaling::Llama3 { factor, .. } if factor == 32.0));
    assert_eq!(c.eos_token_ids(), vec![257, 258]);
    let q2 = with("qwen2", |v| v["sliding_window"] = json!(32768)).unwrap();
    assert!(q2.qkv_bias && !q2.qk_norm);
    let q3 = with("qwen3", |v| v["head_dim"] = json!(48)).unwrap();
    assert!(q3.qk_norm && q3.head_dim == 48 && q3.q_dim() == 192);
    let dynamic = with("llama", |v| {
        v["rope_scaling"] = json!({"type": "dynamic", "factor": 2.0})
    });
    assert_eq!(dynamic.unwrap().rope_scaling, RopeScaling::Default);
}

#[test]
fn differences_name_every_field_that_changes_the_model() {
    let a = LlamaConfig::preset("tiny").unwrap();
    let b = with("llama", |v| {
        v["rope_theta"] = json!(500000.0);
        v["rms_norm_eps"] = json!(1e-6);
    })
    .unwrap();
    let d = a.differences(&b).join("; ");
    assert!(
        d.contains("rope_theta") && d.contains("rms_norm_eps"),
        "{d}"
    );
    assert!(a.differences(&a).is_empty());
}

#[test]
fn a_run_takes_its_model_from_load_and_hf_checkpoint_never_the_preset() {
    let dir = tempfile::tempdir().unwrap();
    let theta = with("llama", |v| {
        v["rope_theta"] = json!(500000.0);
        v["rms_norm_eps"] = json!(1e-6);
    })
    .unwrap();
    let actor = dir.path().join("step-00000001/actor");
    std::fs::create_dir_all(&actor).unwrap();
    std::fs::write(actor.join("config.json"), theta.to_json_string()).unwrap();
    std::fs::write(dir.path().join("latest"), "step-00000001").unwrap();
    let mut s = crate::config::Settings {
        load: Some(dir.path().to_path_buf()),
        ..Default::default()
    };
    let c = LlamaConfig::from_settings(&s).unwrap();
    assert_eq!((c.rope_theta, c.rms_norm_eps), (500000.0, 1e-6));
    s.hf_checkpoint = Some(actor.clone());
    assert_eq!(LlamaConfig::from_settings(&s).unwrap(), c);
    let other = dir.path().join("other");
    std::fs::create_dir_all(&other).unwrap();
    let tiny = LlamaConfig::preset("tiny").unwrap();
    std::fs::write(other.join("config.json"), tiny.to_json_string()).unwrap();
    s.hf_checkpoint = Some(other);
    let err = LlamaConfig::from_settings(&s).unwrap_err().to_string();
    assert!(
        err.contains("rope_theta: 10000 vs 500000") && err.contains("rms_norm_eps"),
        "{err}"
    );
}
