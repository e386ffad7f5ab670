//! `miles generate`: sample completions of prompts from a checkpoint with the rollout engine.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use miles_core::device::Gpu;
use miles_core::model::{CONFIG_FILE, LlamaConfig, Tokenizer};
use miles_core::{CpuDevice, Device, ManagerSettings, MemoryManager, Settings};
use miles_infer::{Engine, EngineConfig, SamplingParams};

use crate::model_cmd::bad_model;
use crate::settings_args::{BadSettings, SettingsArgs};

/// `miles generate`.
#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// Checkpoint directory (config.json and model.safetensors), e.g. from `miles model init`;
    /// the same as --hf-checkpoint.
    #[arg(long, conflicts_with = "hf_checkpoint")]
    pub checkpoint: Option<PathBuf>,
    /// A prompt; repeat the flag for several. Encoded with the tokenizer's special tokens
    /// (BOS first where it adds one).
    #[arg(long, required = true)]
    pub prompt: Vec<String>,
    /// Render each prompt as a user message through the checkpoint's chat template (with the
    /// generation prompt), as transformers' `apply_chat_template` does.
    #[arg(long)]
    pub apply_chat_template: bool,
    /// Samples per prompt [default: --n-samples-per-prompt]
    #[arg(short = 'n', long = "num-samples")]
    pub num_samples: Option<usize>,
    /// Softmax temperature; 0 is greedy.
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f32,
    /// Nucleus sampling: keep the most likely tokens up to this probability mass.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Top-k sampling: keep the K most likely tokens only (0 keeps all).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// New tokens per sample at most (EOS ends a sample earlier).
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: usize,
    /// Print one JSON object: `completions` (tokens, log-probs, text, finish) and `stats`.
    #[arg(long)]
    pub json: bool,
    /// Settings (`--seed`, `--device`, `--device-memory-gib`, `--rollout-mem-fraction`, ...).
    #[command(flatten)]
    pub settings: SettingsArgs,
}

/// The rollout engine's memory manager under `settings`: over the shared GPU on CUDA (with the
/// GPU, which the engine computes on), over a CPU device of `--device-memory-gib` otherwise.
///
/// # Errors
/// The GPU cannot be opened, or the manager cannot start.
pub fn engine_memory(
    settings: &Settings,
) -> anyhow::Result<(Arc<MemoryManager>, Option<Arc<Gpu>>)> {
    let gpu = crate::gpu::gpu_for(settings.device)?;
    let device: Arc<dyn Device> = match &gpu {
        Some(gpu) => gpu.device().clone(),
        None => Arc::new(CpuDevice::new(settings.device_memory_bytes())),
    };
    let manager = MemoryManager::new(
        device,
        ManagerSettings {
            margin_bytes: settings.train_memory_margin_bytes,
            disk: None,
        },
    )?;
    Ok((Arc::new(manager), gpu))
}

/// A rollout engine of `model` with `config`, on the device `settings` name.
///
/// # Errors
/// As [`engine_memory`], or what the engine hit allocating.
pub fn build_engine(
    settings: &Settings,
    model: &LlamaConfig,
    config: EngineConfig,
) -> anyhow::Result<Engine> {
    let (memory, gpu) = engine_memory(settings)?;
    let engine = match gpu {
        Some(gpu) => Engine::on_gpu(memory, gpu, model.clone(), config),
        None => Engine::new(memory, model.clone(), config),
    };
    engine.context("cannot build the rollout engine")
}

/// Runs `miles generate`.
///
/// # Errors
/// Bad settings, an unreadable checkpoint, or a refused request, each with its context.
pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let settings = args.settings.load()?;
    let Some(dir) = args.checkpoint.clone().or(settings.hf_checkpoint.clone()) else {
        return Err(BadSettings("give the model with --hf-checkpoint DIR".into()).into());
    };
    let model = LlamaConfig::from_file(&dir.join(CONFIG_FILE)).map_err(bad_model(&dir))?;
    let tokenizer = Tokenizer::from_dir(&dir, &model).map_err(bad_model(&dir))?;
    if args.apply_chat_template && !tokenizer.has_chat_template() {
        return Err(BadSettings(format!(
            "--apply-chat-template: {} has no chat_template in tokenizer_config.json nor chat_template.jinja",
            dir.display()
        ))
        .into());
    }
    let prompts = args
        .prompt
        .iter()
        .map(|p| match args.apply_chat_template {
            true => tokenizer.apply_chat_template(p),
            false => tokenizer.encode(p, true),
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(bad_model(&dir))?;
    let (memory, gpu) = engine_memory(&settings)?;
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let config = EngineConfig {
        max_positions: Some(longest + args.max_new_tokens),
        ..EngineConfig::from_settings(&settings)
    };
    let mut engine = match gpu {
        Some(gpu) => Engine::from_checkpoint_on_gpu(memory, gpu, &dir, config),
        None => Engine::from_checkpoint(memory, &dir, config),
    }
    .with_context(|| format!("loading checkpoint {}", dir.display()))?;
    let params = SamplingParams {
        n: args.num_samples.unwrap_or(settings.n_samples_per_prompt),
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        max_new_tokens: args.max_new_tokens,
        stop_tokens: tokenizer.stop_tokens().to_vec(),
        seed: settings.seed,
    };
    params
        .validate()
        .map_err(|error| BadSettings(error.to_string()))?;
    let generation = engine.generate(&prompts, &params)?;
    let mut out = std::io::stdout().lock();
    if args.json {
        let completions: Vec<_> = generation
            .completions
            .iter()
            .map(|c| {
                serde_json::json!({
                    "prompt_index": c.prompt_index,
                    "sample_index": c.sample_index,
                    "text": tokenizer.decode(&c.tokens),
                    "tokens": c.tokens,
                    "logprobs": c.logprobs.iter().map(|&x| f64::from(x)).collect::<Vec<_>>(),
                    "finish": c.finish,
                })
            })
            .collect();
        let value = serde_json::json!({
            "prompts": args.prompt,
            "seed": settings.seed,
            "completions": completions,
            "stats": generation.stats,
        });
        writeln!(out, "{value}")?;
        return Ok(());
    }
    for c in &generation.completions {
        let mean = c.logprobs.iter().sum::<f32>() / c.logprobs.len().max(1) as f32;
        writeln!(
            out,
            "[prompt {} sample {}] {:?} ({} tokens, {:?}, mean logprob {mean:.3})",
            c.prompt_index,
            c.sample_index,
            tokenizer.decode(&c.tokens),
            c.tokens.len(),
            c.finish
        )?;
    }
    let s = &generation.stats;
    writeln!(
        out,
        "{} tokens in {:.3} s ({:.0} tokens/s decoding), {} preemptions, peak {} of {} kv blocks",
        s.generated_tokens,
        s.seconds,
        s.generated_tokens as f64 / s.decode_seconds.max(1e-9),
        s.preemptions,
        s.peak_blocks,
        engine.kv_blocks()
    )?;
    Ok(())
}
