//! `miles bench rollout`: decode throughput of the rollout engine next to a baseline (on the
//! CPU the bare model's decode step; on CUDA transformers' `generate` on the same shapes with
//! its static and its dynamic cache, `bench/hf_generate.py`, and the bandwidth bound of reading the weights once per step), and
//! the time of each offload / onload step per level next to a plain copy of the same bytes,
//! with device memory after each step.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use miles_core::device::{Gpu, GpuSlice};
use miles_core::model::{ContiguousKvCache, DecodeScratch, LlamaConfig, Transformer, init_params};
use miles_core::{
    BackupPolicy, DeviceKind, MemoryManager, MemoryTag, OffloadReport, RolloutOffloadLevel,
};
use miles_infer::{EngineConfig, Generation, InferenceController, NamedTensor, SamplingParams};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{Value, json};

use crate::bench::baseline::python_json;
use crate::generate::build_engine;
use crate::settings_args::{BadSettings, SettingsArgs};

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
    /// On cuda: the transformers `generate` baseline run in the same call.
    #[arg(long, default_value = "bench/hf_generate.py")]
    pub torch_script: PathBuf,
    /// On cuda: the Python that runs it (one with torch and transformers).
    #[arg(long, default_value = "python3")]
    pub python: String,
    /// On cuda: skip the transformers baseline.
    #[arg(long)]
    pub no_baseline: bool,
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
    // Sizes of 0 leave nothing to time.
    BadSettings::refuse_zero(&[
        ("--prompts", args.prompts),
        ("--prompt-len", args.prompt_len),
        ("--max-new-tokens", args.max_new_tokens),
    ])?;
    let settings = args.settings.load()?;
    let config = LlamaConfig::preset(&settings.preset)?;
    let model = Transformer::new(config.clone());
    let layout = model.layout().clone();
    // Where the start-up goes: the seeded weights, the engine (device, kernels, cache), the
    // weights written into it.
    let started = Instant::now();
    let mut params = vec![0.0; layout.len()];
    init_params(&layout, &config, settings.seed, &mut params)?;
    let seed_seconds = started.elapsed().as_secs_f64();
    // The engine is sized for the bench's sequences, as `miles train` sizes it for its data.
    let engine_config = EngineConfig {
        max_positions: Some(args.prompt_len + args.max_new_tokens),
        ..EngineConfig::from_settings(&settings)
    };
    let engine = build_engine(&settings, &config, engine_config)?;
    let engine_seconds = started.elapsed().as_secs_f64() - seed_seconds;
    let memory = Arc::clone(engine.memory());
    let kv_blocks = engine.kv_blocks();
    let mut controller = InferenceController::from_settings(engine, &settings);
    let tensors: Vec<NamedTensor<'_>> = layout
        .specs()
        .iter()
        .map(|s| NamedTensor::f32(&s.name, &s.shape, &params[s.range()]))
        .collect();
    controller.update_weights(&tensors)?;
    let weights_seconds = started.elapsed().as_secs_f64() - seed_seconds - engine_seconds;

    let bos = miles_core::model::ByteTokenizer::from_config(&config)?.bos;
    let mut rng = ChaCha8Rng::seed_from_u64(settings.seed);
    let prompts: Vec<Vec<u32>> = (0..args.prompts)
        .map(|_| {
            let mut p = vec![bos];
            p.extend((1..args.prompt_len).map(|_| rng.random_range(32..127u32)));
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
    // The first call captures the decode graphs (on CUDA); the figures are the second call's.
    let first = controller.generate(&prompts, &sampling)?;
    let timed = controller.generate(&prompts, &sampling)?;
    // The first token of each sample comes from the prompt's prefill, the rest from decode steps.
    let decoded = timed.stats.generated_tokens - timed.completions.len();
    let engine_tps = decoded as f64 / timed.stats.decode_seconds.max(1e-12);
    let end_to_end_tps = timed.stats.generated_tokens as f64 / timed.stats.seconds.max(1e-12);
    let batch = (prompts.len() * sampling.n).min(controller.engine().config().max_batch);
    let weight_bytes = memory.region_bytes(&MemoryTag::Weights)?;
    let gpu = crate::gpu::gpu_for(settings.device)?;
    let bound = match &gpu {
        Some(gpu) => Some(bandwidth_bound(gpu, &memory, weight_bytes, batch)?),
        None => None,
    };
    // transformers' `generate` with both of its caches: the compiled static one (the strongest)
    // and the default dynamic one (what a plain call gets).
    let mut torch = Vec::new();
    if gpu.is_some() && !args.no_baseline {
        for cache in TORCH_CACHES {
            let mut figures = torch_baseline(args, &config, prompts.len() * sampling.n, cache)?;
            let ratio = figures["tokens_per_second"]
                .as_f64()
                .map(|t| end_to_end_tps / t.max(1e-12));
            figures["end_to_end_ratio"] = json!(ratio);
            torch.push(figures);
        }
    }
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
        "seconds": timed.stats.seconds,
        "prefill_seconds": timed.stats.prefill_seconds,
        "decode_seconds": timed.stats.decode_seconds,
        "decode_steps": timed.stats.decode_steps,
        "first_call_seconds": first.stats.seconds,
        "graph_captures": first.stats.graph_captures + timed.stats.graph_captures,
        "graph_captures_in_second_call": timed.stats.graph_captures,
        "baseline_bare_decode_tokens_per_second": bare_tps,
        "decode_ratio": bare_tps.map(|bare| engine_tps / bare.max(1e-12)),
        "device_copy_bytes_per_second": bound.as_ref().map(|b| b.copy_rate),
        "bandwidth_bound_tokens_per_second": bound.as_ref().map(|b| b.tokens_per_second),
        "decode_share_of_bound": bound.as_ref().map(|b| engine_tps / b.tokens_per_second),
        "torch_generate": torch,
        "identical_after_cycles": identical,
        "startup_seconds": {
            "seed_weights": seed_seconds,
            "build_engine": engine_seconds,
            "write_weights": weights_seconds,
        },
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
    writeln!(
        out,
        "start-up: weights seeded in {seed_seconds:.1} s, engine built in {engine_seconds:.1} s (device, kernels, cache), weights written in {weights_seconds:.1} s"
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
        "decode: engine {engine_tps:.0} tokens/s, {baseline}; end to end {end_to_end_tps:.0} tokens/s in {:.3} s (prefill {:.3} s, {} decode steps in {:.3} s, {} of them queued behind the step before; first call {:.3} s, {} cuda graphs captured then, {} in the timed call)",
        timed.stats.seconds,
        timed.stats.prefill_seconds,
        timed.stats.decode_steps,
        timed.stats.decode_seconds,
        timed.stats.overlapped_steps,
        first.stats.seconds,
        first.stats.graph_captures,
        timed.stats.graph_captures,
    )?;
    if let Some(b) = &bound {
        writeln!(
            out,
            "bandwidth bound: {:.2} GB of weights per step at the device copy rate {:.0} GB/s (read + written) = {:.3} ms a step, {:.0} tokens/s at batch {batch}; decode reaches {:.1}% of it",
            weight_bytes as f64 / 1e9,
            b.copy_rate / 1e9,
            b.step_seconds * 1e3,
            b.tokens_per_second,
            100.0 * engine_tps / b.tokens_per_second
        )?;
    }
    for t in &torch {
        writeln!(
            out,
            "transformers generate ({} cache, torch {}, same shapes): {:.0} tokens/s in {:.3} s; miles end to end / transformers = {:.2}",
            t["cache"].as_str().unwrap_or("?"),
            t["torch"].as_str().unwrap_or("?"),
            t["tokens_per_second"].as_f64().unwrap_or(f64::NAN),
            t["seconds"].as_f64().unwrap_or(f64::NAN),
            t["end_to_end_ratio"].as_f64().unwrap_or(f64::NAN)
        )?;
    }
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

/// The decode step's floor: reading every weight byte once, at the device-to-device copy
/// rate measured now.
struct Bound {
    /// Bytes read plus bytes written per second by `cuMemcpyDtoD`.
    copy_rate: f64,
    /// Weight bytes over that rate.
    step_seconds: f64,
    /// `batch` tokens per step at that pace.
    tokens_per_second: f64,
}

/// Copies `bytes` between two buffers of a bench region five times (after one untimed copy)
/// and derives the bound; the region is released afterwards.
fn bandwidth_bound(
    gpu: &Gpu,
    memory: &MemoryManager,
    bytes: u64,
    batch: usize,
) -> anyhow::Result<Bound> {
    let len = usize::try_from(bytes)?.next_multiple_of(256);
    let tag = MemoryTag::Named("bench-copy".into());
    memory.create_region(tag.clone(), BackupPolicy::None, 2 * len)?;
    let (src, dst) = (memory.alloc(&tag, len)?, memory.alloc(&tag, len)?);
    let (src, dst) = (
        GpuSlice::<u32>::of(src.range())?,
        GpuSlice::<u32>::of(dst.range())?,
    );
    gpu.copy(dst, src)?;
    gpu.synchronize()?;
    let reps = 5;
    let start = Instant::now();
    for _ in 0..reps {
        gpu.copy(dst, src)?;
    }
    gpu.synchronize()?;
    let seconds = start.elapsed().as_secs_f64() / f64::from(reps);
    memory.pause(&tag)?;
    let copy_rate = 2.0 * len as f64 / seconds.max(1e-12);
    let step_seconds = bytes as f64 / copy_rate;
    Ok(Bound {
        copy_rate,
        step_seconds,
        tokens_per_second: batch as f64 / step_seconds,
    })
}

/// The caches of transformers' `generate` the bench runs, each in its own process.
const TORCH_CACHES: [&str; 2] = ["static", "dynamic"];

/// Runs transformers' `generate` on the preset's shapes (`bench/hf_generate.py`) with `cache`
/// and returns its JSON figures.
fn torch_baseline(
    args: &BenchRolloutArgs,
    model: &LlamaConfig,
    sequences: usize,
    cache: &str,
) -> anyhow::Result<Value> {
    let config =
        std::env::temp_dir().join(format!("miles-bench-rollout-{}.json", std::process::id()));
    std::fs::write(&config, model.to_json_string())
        .with_context(|| format!("cannot write {}", config.display()))?;
    let script_args = [
        "--config".into(),
        config.display().to_string(),
        "--batch".into(),
        sequences.to_string(),
        "--prompt-len".into(),
        args.prompt_len.to_string(),
        "--new-tokens".into(),
        args.max_new_tokens.to_string(),
        "--cache".into(),
        cache.to_string(),
    ];
    python_json(
        &args.python,
        &args.torch_script,
        &script_args,
        "transformers",
    )
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
