//! Bring your own model: Hugging Face directories of each family, made here with the family's
//! exact tensor names and shapes (bf16, sharded in two files with an index) and a BPE
//! `tokenizer.json` trained here by the `tokenizers` crate, through `miles model score`,
//! `generate`, `train --save` and `model inspect`; every unsupported field or mismatch exits 2
//! naming it.

// Test helpers outside #[test] functions: a failing step should stop the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::path::Path;
use std::process::{Command, Output};

use miles_core::model::{LlamaConfig, ParamLayout, Transformer, score_tokens};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use serde_json::{Value, json};
use tokenizers::models::TrainerWrapper;
use tokenizers::models::bpe::{BPE, BpeTrainer};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, DecoderWrapper, PostProcessorWrapper, PreTokenizerWrapper};

const TEXT: &str = "hello world, the quick brown fox";
const SPECIALS: [&str; 3] = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_end|>"];

fn miles(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_miles"))
        .args(args)
        .output()
        .expect("run miles")
}

fn ok(args: &[&str]) -> String {
    let out = miles(args);
    assert!(
        out.status.success(),
        "miles {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Runs miles and asserts exit 2 with every one of `named` in the message.
fn refused(args: &[&str], named: &[&str]) {
    let out = miles(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "miles {args:?}: {err}");
    for n in named {
        assert!(err.contains(n), "miles {args:?} does not name {n}: {err}");
    }
}

/// A byte-level BPE tokenizer of about 300 tokens trained on a small corpus; BOS added by the
/// post-processor for Llama, none for Qwen (as their tokenizers do).
fn write_tokenizer(dir: &Path, bos: bool) {
    let mut tk = tokenizers::Tokenizer::new(BPE::default());
    let byte_level = ByteLevel::new(false, true, true);
    tk.with_pre_tokenizer(Some(PreTokenizerWrapper::ByteLevel(byte_level)));
    tk.with_decoder(Some(DecoderWrapper::ByteLevel(byte_level)));
    let mut trainer: TrainerWrapper = BpeTrainer::builder()
        .vocab_size(300)
        .show_progress(false)
        .special_tokens(
            SPECIALS
                .iter()
                .map(|s| AddedToken::from(*s, true))
                .collect(),
        )
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    let corpus = [
        "the quick brown fox jumps over the lazy dog",
        "hello world, hello miles; byte-level pairs of a chat",
        "repeat after me: abc def, reverse 123 and add 4 + 5",
    ];
    tk.train(&mut trainer, corpus.iter().cycle().take(48))
        .unwrap();
    if bos {
        let post = TemplateProcessing::builder()
            .try_single(format!("{} $A", SPECIALS[0]))
            .unwrap()
            .special_tokens(vec![(SPECIALS[0], 0)])
            .build()
            .unwrap();
        tk.with_post_processor(Some(PostProcessorWrapper::Template(post)));
    }
    tk.save(dir.join("tokenizer.json"), false).unwrap();
    let template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    let config = json!({
        "bos_token": if bos { Value::String(SPECIALS[0].into()) } else { Value::Null },
        "eos_token": SPECIALS[2],
        "pad_token": SPECIALS[1],
        "chat_template": template,
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
}

/// The config.json of a small random model of `family`, as transformers writes that family.
fn family_config(family: &str) -> Value {
    let mut c = json!({
        "model_type": family,
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": true,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.0",
    });
    match family {
        "llama" => {
            c["architectures"] = json!(["LlamaForCausalLM"]);
            c["tie_word_embeddings"] = json!(false);
            c["attention_bias"] = json!(false);
            c["mlp_bias"] = json!(false);
            c["pretraining_tp"] = json!(1);
            c["bos_token_id"] = json!(0);
            c["eos_token_id"] = json!([1, 2]);
            c["rope_theta"] = json!(500000.0);
            c["rope_scaling"] = json!({
                "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64
            });
        }
        "qwen2" => {
            c["architectures"] = json!(["Qwen2ForCausalLM"]);
            c["tie_word_embeddings"] = json!(true);
            c["use_sliding_window"] = json!(false);
            c["sliding_window"] = json!(4096);
            c["max_window_layers"] = json!(2);
            c["eos_token_id"] = json!(2);
        }
        "qwen3" => {
            c["architectures"] = json!(["Qwen3ForCausalLM"]);
            c["tie_word_embeddings"] = json!(true);
            c["head_dim"] = json!(24);
            c["attention_bias"] = json!(false);
            c["use_sliding_window"] = json!(false);
            c["sliding_window"] = Value::Null;
            c["eos_token_id"] = json!(2);
        }
        _ => unreachable!("{family}"),
    }
    c
}

/// Every tensor of `family` by its Hugging Face name and shape, written out by hand.
fn hf_tensors(family: &str, c: &Value) -> Vec<(String, Vec<usize>)> {
    let n = |k: &str| c[k].as_u64().unwrap() as usize;
    let (v, h, f, l) = (
        n("vocab_size"),
        n("hidden_size"),
        n("intermediate_size"),
        n("num_hidden_layers"),
    );
    let (heads, kv) = (n("num_attention_heads"), n("num_key_value_heads"));
    let d = c["head_dim"].as_u64().map_or(h / heads, |x| x as usize);
    let mut t = vec![("model.embed_tokens.weight".to_string(), vec![v, h])];
    for i in 0..l {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        t.push((p("input_layernorm.weight"), vec![h]));
        t.push((p("self_attn.q_proj.weight"), vec![heads * d, h]));
        t.push((p("self_attn.k_proj.weight"), vec![kv * d, h]));
        t.push((p("self_attn.v_proj.weight"), vec![kv * d, h]));
        t.push((p("self_attn.o_proj.weight"), vec![h, heads * d]));
        if family == "qwen2" {
            t.push((p("self_attn.q_proj.bias"), vec![heads * d]));
            t.push((p("self_attn.k_proj.bias"), vec![kv * d]));
            t.push((p("self_attn.v_proj.bias"), vec![kv * d]));
        }
        if family == "qwen3" {
            t.push((p("self_attn.q_norm.weight"), vec![d]));
            t.push((p("self_attn.k_norm.weight"), vec![d]));
        }
        t.push((p("post_attention_layernorm.weight"), vec![h]));
        t.push((p("mlp.gate_proj.weight"), vec![f, h]));
        t.push((p("mlp.up_proj.weight"), vec![f, h]));
        t.push((p("mlp.down_proj.weight"), vec![h, f]));
    }
    t.push(("model.norm.weight".to_string(), vec![h]));
    if !c["tie_word_embeddings"].as_bool().unwrap() {
        t.push(("lm_head.weight".to_string(), vec![v, h]));
    }
    t
}

/// Makes a Hugging Face directory of `family` in `dir`: random bf16 weights sharded in two
/// files with an index, the tokenizer files, and the config (edited by `edit`). Returns every
/// tensor's values as the bf16 on disk decodes.
fn make_checkpoint(
    dir: &Path,
    family: &str,
    edit: impl FnOnce(&mut Value),
) -> HashMap<String, Vec<f32>> {
    std::fs::create_dir_all(dir).unwrap();
    let mut c = family_config(family);
    let tensors = hf_tensors(family, &c);
    edit(&mut c);
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&c).unwrap(),
    )
    .unwrap();
    write_tokenizer(dir, family == "llama");
    let mut rng = ChaCha8Rng::seed_from_u64(family.len() as u64);
    let mut values = HashMap::new();
    let mut bytes: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, shape) in &tensors {
        let numel: usize = shape.iter().product();
        let norm = name.ends_with("norm.weight");
        let vals: Vec<half::bf16> = (0..numel)
            .map(|_| {
                let u = rng.random::<f32>() * 2.0 - 1.0;
                half::bf16::from_f32(if norm { 1.0 + 0.2 * u } else { 0.15 * u })
            })
            .collect();
        values.insert(name.clone(), vals.iter().map(|x| x.to_f32()).collect());
        bytes.push((
            name.clone(),
            shape.clone(),
            vals.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ));
    }
    let split = bytes.len() / 2;
    let mut weight_map = serde_json::Map::new();
    for (i, part) in [&bytes[..split], &bytes[split..]].into_iter().enumerate() {
        let file = format!("model-0000{}-of-00002.safetensors", i + 1);
        let views: Vec<_> = part
            .iter()
            .map(|(n, s, b)| {
                (
                    n.clone(),
                    TensorView::new(Dtype::BF16, s.clone(), b).unwrap(),
                )
            })
            .collect();
        let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
        safetensors::serialize_to_file(views, Some(meta), &dir.join(&file)).unwrap();
        for (n, _, _) in part {
            weight_map.insert(n.clone(), Value::String(file.clone()));
        }
    }
    let index = json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    values
}

/// The model's own log-probs of `tokens` on the weights `values`, computed in this process.
fn in_process_logprobs(dir: &Path, values: &HashMap<String, Vec<f32>>, tokens: &[u32]) -> Vec<f32> {
    let config = LlamaConfig::from_file(&dir.join("config.json")).unwrap();
    let layout = ParamLayout::new(&config);
    let mut params = vec![0.0; layout.len()];
    for spec in layout.specs() {
        params[spec.range()].copy_from_slice(&values[&spec.name]);
    }
    score_tokens(&Transformer::new(config), &params, tokens)
        .unwrap()
        .0
}

fn score_json(dir: &Path) -> Value {
    serde_json::from_str(&ok(&[
        "model",
        "score",
        "--hf-checkpoint",
        dir.to_str().unwrap(),
        "--text",
        TEXT,
        "--json",
    ]))
    .unwrap()
}

fn as_u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn score_gives_the_tokenizers_ids_and_the_models_log_probs_for_every_family() {
    for family in ["llama", "qwen2", "qwen3"] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join(family);
        let values = make_checkpoint(&dir, family, |_| {});
        let out = score_json(&dir);
        let reference = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
        let want = reference.encode(TEXT, true).unwrap().get_ids().to_vec();
        let tokens = as_u32s(&out["tokens"]);
        assert_eq!(tokens, want, "{family}");
        assert_eq!(
            tokens[0] == 0,
            family == "llama",
            "{family}: bos only for llama"
        );
        let lp: Vec<f64> = out["logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        let expected = in_process_logprobs(&dir, &values, &tokens);
        assert_eq!(lp.len(), tokens.len() - 1);
        let worst = lp
            .iter()
            .zip(&expected)
            .map(|(a, b)| (a - f64::from(*b)).abs())
            .fold(0.0, f64::max);
        // The same computation on the same bf16 weights: only the JSON round trip differs.
        assert!(worst < 1e-6, "{family}: largest difference {worst}");
    }
}

#[test]
fn generate_renders_the_chat_template_and_stops_on_the_eos_list() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("llama");
    make_checkpoint(&dir, "llama", |_| {});
    let out: Value = serde_json::from_str(&ok(&[
        "generate",
        "--hf-checkpoint",
        dir.to_str().unwrap(),
        "--prompt",
        "hello",
        "--apply-chat-template",
        "--max-new-tokens",
        "6",
        "-n",
        "2",
        "--json",
    ]))
    .unwrap();
    let completions = out["completions"].as_array().unwrap();
    assert_eq!(completions.len(), 2);
    for c in completions {
        let tokens = as_u32s(&c["tokens"]);
        assert!(!tokens.is_empty() && tokens.len() <= 6, "{c}");
        let stops = tokens.iter().filter(|t| [1, 2].contains(*t)).count();
        assert!(
            stops <= 1 && (stops == 0 || [1, 2].contains(tokens.last().unwrap())),
            "{c}"
        );
    }
}

#[test]
fn train_saves_a_bf16_hugging_face_directory_that_loads_back() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("qwen2");
    make_checkpoint(&dir, "qwen2", |_| {});
    let save = tmp.path().join("out");
    let args = |extra: &[&str]| {
        let mut a = vec![
            "train",
            "--hf-checkpoint",
            dir.to_str().unwrap(),
            "--steps",
            "2",
            "--rollout-batch-size",
            "2",
            "--n-samples-per-prompt",
            "2",
            "--global-batch-size",
            "4",
            // A supervised step moves the weights past bf16 rounding even if every reward ties.
            "--sft-warmup-steps",
            "1",
            "--lr",
            "1e-2",
        ]
        .into_iter()
        .map(String::from)
        .collect::<Vec<_>>();
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let a = args(&[
        "--save",
        save.to_str().unwrap(),
        "--save-shard-size",
        "40000",
    ]);
    ok(&a.iter().map(String::as_str).collect::<Vec<_>>());
    let actor = save.join("step-00000002/actor");
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(actor.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["torch_dtype"], "bfloat16");
    assert_eq!(config["model_type"], "qwen2");
    assert_eq!(
        config["sliding_window"], 4096,
        "the config is written back as read"
    );
    assert!(actor.join("model.safetensors.index.json").exists());
    assert!(actor.join("tokenizer.json").exists() && actor.join("tokenizer_config.json").exists());
    let before = score_json(&dir);
    let after = score_json(&actor);
    assert_eq!(before["tokens"], after["tokens"]);
    assert_ne!(
        before["logprobs"], after["logprobs"],
        "two steps changed the weights"
    );
    let inspect: Value = serde_json::from_str(&ok(&[
        "model",
        "inspect",
        actor.to_str().unwrap(),
        "--json",
    ]))
    .unwrap();
    assert_eq!(
        inspect["dtypes"],
        json!({"BF16": hf_tensors("qwen2", &family_config("qwen2")).len()})
    );
    assert_eq!(inspect["chat_template"], true);
    // --load resumes with the checkpoint's own config; a --load of another model is refused.
    let other = tmp.path().join("qwen3");
    make_checkpoint(&other, "qwen3", |_| {});
    refused(
        &[
            "train",
            "--hf-checkpoint",
            other.to_str().unwrap(),
            "--load",
            save.to_str().unwrap(),
            "--steps",
            "3",
        ],
        &["--load", "model_type: qwen3 vs qwen2", "head_dim: 24 vs 16"],
    );
}

#[test]
fn every_unsupported_field_and_mismatch_exits_2_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    type Edit = Box<dyn FnOnce(&mut Value)>;
    let cases: Vec<(&str, Edit, Vec<&str>)> = vec![
        (
            "qwen2",
            Box::new(|c| c["use_sliding_window"] = json!(true)),
            vec!["use_sliding_window = true"],
        ),
        (
            "llama",
            Box::new(|c| c["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0})),
            vec!["rope_scaling.rope_type = \"yarn\""],
        ),
        (
            "llama",
            Box::new(|c| c["num_local_experts"] = json!(8)),
            vec!["num_local_experts = 8"],
        ),
        (
            "qwen3",
            Box::new(|c| c["hidden_size"] = json!(1u64 << 40)),
            vec!["hidden_size = 1099511627776"],
        ),
        (
            "qwen3",
            Box::new(|c| c["head_dim"] = json!(16)),
            vec![
                "model.layers.0.self_attn.q_proj.weight",
                "[96, 64]",
                "[64, 64]",
            ],
        ),
        (
            "qwen2",
            Box::new(|c| c["tie_word_embeddings"] = json!(false)),
            vec!["missing tensor lm_head.weight of shape [320, 64]"],
        ),
    ];
    for (i, (family, edit, named)) in cases.into_iter().enumerate() {
        let dir = tmp.path().join(format!("case-{i}"));
        make_checkpoint(&dir, family, edit);
        let d = dir.to_str().unwrap();
        refused(
            &["model", "score", "--hf-checkpoint", d, "--text", TEXT],
            &named,
        );
        refused(&["model", "inspect", d], &named);
        if i < 4 {
            refused(&["train", "--hf-checkpoint", d, "--steps", "1"], &named);
            refused(
                &["generate", "--hf-checkpoint", d, "--prompt", "hi"],
                &named,
            );
        }
    }
}
