//! `miles generate`: sample completions of prompts from a checkpoint with the rollout engine.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use miles_core::{DeviceChoice, HostDevice, ManagerSettings, MemoryManager, Settings};
use miles_infer::{EngineConfig, RolloutEngine, SamplingParams};

use crate::settings_args::{BadSettings, SettingsArgs};

/// `miles generate`.
#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// Checkpoint directory (config.json and model.safetensors), e.g. from `miles model init`.
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// A prompt; repeat the flag for several. BOS is put in front of its bytes.
    #[arg(long, required = true)]
    pub prompt: Vec<String>,
    /// Samples per prompt [default: --n-samples-per-prompt]
    #[arg(short = 'n', long = "num-samples")]
    pub num_samples: Option<usize>,
    /// Softmax temperature; 0 is greedy.
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f32,
    /// Nucleus sampling: keep the most likely tokens up to this probability mass.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
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

/// The CPU device and a memory manager for the rollout engine under `settings`.
///
/// # Errors
/// [`BadSettings`] for `--device cuda` (the engine computes on host views of its buffers).
pub fn engine_memory(settings: &Settings) -> anyhow::Result<(Arc<HostDevice>, Arc<MemoryManager>)> {
    if settings.device == DeviceChoice::Cuda {
        return Err(BadSettings(
            "the rollout engine computes on the cpu device; use --device cpu or auto".to_string(),
        )
        .into());
    }
    let device = Arc::new(HostDevice::new(settings.device_memory_bytes()));
    let manager = MemoryManager::new(
        device.clone(),
        ManagerSettings {
            margin_bytes: settings.train_memory_margin_bytes,
            disk: None,
        },
    )?;
    Ok((device, Arc::new(manager)))
}

/// Runs `miles generate`.
///
/// # Errors
/// Bad settings, an unreadable checkpoint, or a refused request, each with its context.
pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let settings = args.settings.load()?;
    let (_, memory) = engine_memory(&settings)?;
    let mut engine = RolloutEngine::from_checkpoint(
        memory,
        &args.checkpoint,
        EngineConfig::from_settings(&settings),
    )
    .with_context(|| format!("loading checkpoint {}", args.checkpoint.display()))?;
    let tokenizer = *engine.tokenizer();
    let prompts: Vec<Vec<u32>> = args
        .prompt
        .iter()
        .map(|p| tokenizer.encode(p, true))
        .collect();
    let params = SamplingParams {
        n: args.num_samples.unwrap_or(settings.n_samples_per_prompt),
        temperature: args.temperature,
        top_p: args.top_p,
        max_new_tokens: args.max_new_tokens,
        stop_tokens: vec![tokenizer.eos],
        seed: settings.seed,
    };
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
