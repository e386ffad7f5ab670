//! `miles bench rollout`: decode throughput of the rollout engine next to the bare model's
//! decode step, and the time of each offload / onload step per level next to a plain copy of
//! the same bytes, with device memory after each step.

use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use miles_core::model::{ContiguousKvCache, DecodeScratch, LlamaConfig, Transformer, init_params};
use miles_core::{DeviceKind, MemoryTag, OffloadReport, RolloutOffloadLevel};
use miles_infer::{EngineConfig, Generation, InferenceController, NamedTensor, SamplingParams};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{Value, json};

use crate::generate::build_engine;
use crate::settings_args::SettingsArgs;

/// `miles bench rollout`.
#[derive(Args, Debug)]
pub struct BenchRolloutArgs {
    /// Prompts per rollout.
    #[arg(long, default_value_t = 8)]
    pub prompts: usize,
    /// Tokens per prompt (random bytes after BOS).
    #[arg(long, default_value_t = 32)]
    pub prompt_len: usize,
    /// New tokens per sample (no stop token, so every sample runs to this length).
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: usize,
    /// Offload/onload cycles per level.
    #[arg(long, default_value_t = 3)]
    pub cycles: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Settings (`--preset`, `--device`, `--seed`, `--n-samples-per-prompt`,
    /// `--rollout-mem-fraction`, `--update-weight-buffer-size`, ...).
    #[command(flatten)]
    pub settings: SettingsArgs,
}

/// One timed step of a cycle.
struct Step {
    level: &'static str,
    name: &'static str,
    bytes: u64,
    seconds: f64,
    free_after: u64,
    baseline_seconds: Option<f64>,
}

impl Step {
    fn from_report(level: &'static str, name: &'static str, r: &OffloadReport) -> Self {
        Step {
            level,
            name,
            bytes: r.bytes,
            seconds: r.seconds,
            free_after: r.free_after,
            baseline_seconds: None,
        }
    }

    fn to_json(&self) -> Value {
        json!({
            "level": self.level,
            "step": self.name,
            "bytes": self.bytes,
            "seconds": self.seconds,
            "gbps": self.bytes as f64 / self.seconds.max(1e-12) / 1e9,
            "device_free_after": self.free_after,
            "baseline_memcpy_seconds": self.baseline_seconds,
        })
    }
}

/// Runs `miles bench rollout`.
///
/// # Errors
/// Bad settings, or any failure of the engine, with its context.
pub fn run(args: &BenchRolloutArgs) -> anyhow::Result<()> {
    let settings = args.settings.load()?;
    let config = LlamaConfig::preset(&settings.preset)?;
    let model = Transformer::new(config.clone());
    let layout = model.layout().clone();
    let mut params = vec![0.0; layout.len()];
    init_params(&layout, &config, settings.seed, &mut params)?;
    let engine = build_engine(&settings, &config, EngineConfig::from_settings(&settings))?;
    let memory = Arc::clone(engine.memory());
    let kv_blocks = engine.kv_blocks();
    let mut controller = InferenceController::from_settings(engine, &settings);
    let tensors: Vec<NamedTensor<'_>> = layout
        .specs()
        .iter()
        .map(|s| NamedTensor::f32(&s.name, &s.shape, &params[s.range()]))
        .collect();
    controller.update_weights(&tensors)?;

    let bos = miles_core::model::ByteTokenizer::from_config(&config)?.bos;
    let mut rng = ChaCha8Rng::seed_from_u64(settings.seed);
    let prompts: Vec<Vec<u32>> = (0..args.prompts)
        .map(|_| {
            let mut p = vec![bos];
            p.extend((1..args.prompt_len.max(1)).map(|_| rng.random_range(32..127u32)));
            p
        })
        .collect();
    let sampling = SamplingParams {
        n: settings.n_samples_per_prompt,
        temperature: 1.0,
        top_p: settings.rollout_top_p as f32,
        top_k: settings.rollout_top_k,
        max_new_tokens: args.max_new_tokens,
        stop_tokens: Vec::new(),
        seed: settings.seed,
    };
    let first = controller.generate(&prompts, &sampling)?;
    // The first token of each sample comes from the prompt's prefill, the rest from decode steps.
    let decoded = first.stats.generated_tokens - first.completions.len();
    let engine_tps = decoded as f64 / first.stats.decode_seconds.max(1e-12);
    let end_to_end_tps = first.stats.generated_tokens as f64 / first.stats.seconds.max(1e-12);
    let batch = (prompts.len() * sampling.n).min(controller.engine().config().max_batch);
    // The bare decode step is the CPU model's: a baseline for the engine on the CPU device only.
    let on_cpu = memory.device().kind() == DeviceKind::Cpu;
    let bare_tps = if on_cpu {
        Some(bare_decode_tokens_per_second(
            &model,
            &params,
            batch,
            args.prompt_len,
            args.max_new_tokens,
        )?)
    } else {
        None
    };

    let weight_bytes = layout.len() as u64 * 4;
    let mut steps = Vec::new();
    let mut identical = true;
    let levels: [(&'static str, &[RolloutOffloadLevel]); 3] = [
        ("kv_cache", &[RolloutOffloadLevel::KvCache]),
        ("weight", &[RolloutOffloadLevel::Weight]),
        (
            "kv_cache+weight",
            &[RolloutOffloadLevel::KvCache, RolloutOffloadLevel::Weight],
        ),
    ];
    for (name, level) in levels {
        for _ in 0..args.cycles {
            let kv = level.contains(&RolloutOffloadLevel::KvCache);
            let weights = level.contains(&RolloutOffloadLevel::Weight);
            if kv {
                steps.push(Step::from_report(
                    name,
                    "offload_kv",
                    &controller.offload_kv()?,
                ));
            }
            if weights {
                let mut step =
                    Step::from_report(name, "offload_weights", &controller.offload_weights()?);
                step.baseline_seconds = Some(memcpy_seconds(&params));
                steps.push(step);
                let mut step =
                    Step::from_report(name, "onload_weights", &controller.onload_weights()?);
                step.baseline_seconds = Some(memcpy_seconds(&params));
                steps.push(step);
            }
            let update = controller.update_weights(&tensors)?;
            steps.push(Step {
                level: name,
                name: "update_weights",
                bytes: update.bytes,
                seconds: update.seconds,
                free_after: memory.device().memory_info()?.free,
                baseline_seconds: Some(memcpy_seconds(&params)),
            });
            if kv {
                steps.push(Step::from_report(
                    name,
                    "onload_kv",
                    &controller.onload_kv()?,
                ));
            }
        }
        let again: Generation = controller
            .generate(&prompts, &sampling)
            .with_context(|| format!("rollout after the {name} cycles"))?;
        identical &= again.completions == first.completions;
    }
    let kv_bytes = memory.region_bytes(&MemoryTag::KvCache)?;
    let report = json!({
        "preset": settings.preset,
        "prompts": prompts.len(),
        "samples_per_prompt": sampling.n,
        "generated_tokens": first.stats.generated_tokens,
        "preemptions": first.stats.preemptions,
        "kv_blocks": kv_blocks,
        "kv_bytes": kv_bytes,
        "weight_bytes": weight_bytes,
        "decode_tokens_per_second": engine_tps,
        "end_to_end_tokens_per_second": end_to_end_tps,
        "seconds": first.stats.seconds,
        "baseline_bare_decode_tokens_per_second": bare_tps,
        "decode_ratio": bare_tps.map(|bare| engine_tps / bare.max(1e-12)),
        "identical_after_cycles": identical,
        "steps": steps.iter().map(Step::to_json).collect::<Vec<_>>(),
    });
    let mut out = std::io::stdout().lock();
    if args.json {
        writeln!(out, "{report}")?;
        return Ok(());
    }
    writeln!(
        out,
        "rollout: {} prompts x {} samples, {} new tokens each, preset {} ({:.1} MiB weights, {} kv blocks = {:.1} MiB)",
        prompts.len(),
        sampling.n,
        args.max_new_tokens,
        settings.preset,
        weight_bytes as f64 / (1u64 << 20) as f64,
        kv_blocks,
        kv_bytes as f64 / (1u64 << 20) as f64
    )?;
    let baseline = match bare_tps {
        Some(bare) => format!(
            "bare decode step (contiguous cache, batch {batch}) {bare:.0} tokens/s, ratio {:.2}",
            engine_tps / bare.max(1e-12)
        ),
        None => "no bare-step baseline on cuda (the bare decode step runs on the cpu)".to_string(),
    };
    writeln!(
        out,
        "decode: engine {engine_tps:.0} tokens/s, {baseline}; end to end {end_to_end_tps:.0} tokens/s in {:.3} s",
        first.stats.seconds
    )?;
    writeln!(
        out,
        "{:<16} {:<16} {:>12} {:>10} {:>9} {:>12} {:>8} {:>14}",
        "level", "step", "bytes", "ms", "GB/s", "memcpy ms", "ratio", "free after MiB"
    )?;
    for s in &steps {
        let (base, ratio) = match s.baseline_seconds {
            Some(b) => (
                format!("{:.3}", b * 1e3),
                format!("{:.2}", s.seconds / b.max(1e-12)),
            ),
            None => ("-".into(), "-".into()),
        };
        writeln!(
            out,
            "{:<16} {:<16} {:>12} {:>10.3} {:>9.2} {:>12} {:>8} {:>14.1}",
            s.level,
            s.name,
            s.bytes,
            s.seconds * 1e3,
            s.bytes as f64 / s.seconds.max(1e-12) / 1e9,
            base,
            ratio,
            s.free_after as f64 / (1u64 << 20) as f64
        )?;
    }
    writeln!(
        out,
        "generation identical after every cycle: {}",
        if identical { "yes" } else { "NO" }
    )?;
    Ok(())
}

/// Seconds of a plain copy of the weight bytes into a fresh, pre-faulted buffer.
fn memcpy_seconds(params: &[f32]) -> f64 {
    let mut dst = vec![1.0f32; params.len()];
    let start = Instant::now();
    dst.copy_from_slice(params);
    let seconds = start.elapsed().as_secs_f64();
    std::hint::black_box(&dst);
    seconds
}

/// Tokens per second of the model's decode step alone: `batch` sequences in a contiguous cache,
/// timed over positions `prompt_len..prompt_len + new` as the engine decodes them, with no
/// paging, scheduling or sampling.
fn bare_decode_tokens_per_second(
    model: &Transformer,
    params: &[f32],
    batch: usize,
    prompt_len: usize,
    new: usize,
) -> anyhow::Result<f64> {
    let c = model.config();
    let total = (prompt_len + new).min(c.max_position_embeddings);
    let mut cache = ContiguousKvCache::new(c, batch, total);
    let mut scratch = DecodeScratch::new(c, batch, total);
    let seqs: Vec<usize> = (0..batch).collect();
    let mut logits = vec![0.0; batch * c.vocab_size];
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let mut start = Instant::now();
    for step in 0..total {
        if step == prompt_len {
            start = Instant::now();
        }
        let tokens: Vec<u32> = (0..batch).map(|_| rng.random_range(32..127u32)).collect();
        model.decode_step(
            params,
            &mut cache,
            &seqs,
            &tokens,
            &mut logits,
            &mut scratch,
        )?;
    }
    let timed = total.saturating_sub(prompt_len).max(1);
    Ok((batch * timed) as f64 / start.elapsed().as_secs_f64().max(1e-12))
}
