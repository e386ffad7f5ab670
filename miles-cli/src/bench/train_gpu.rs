//! `miles bench train --device cuda`: the GPU trainer's forward + backward + AdamW tokens/s next
//! to PyTorch on the same shapes (fp32 master weights, bf16 autocast) run in the same call:
//! eager with matmul-softmax-matmul attention (`eager`, the same arithmetic as ours), eager with
//! PyTorch's fused attention (`sdpa`), and `torch.compile` of the model with its loss, sdpa and
//! `AdamW(fused=True)`; each with model TFLOP/s, MFU against the H200's dense bf16 rate and peak
//! device memory. With several processes
//! (`--nproc-per-node`, or a launcher), data parallelism over their GPUs against one GPU.

use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use miles_core::backend::DataParallelSplit;
use miles_core::device::{Gpu, NcclComm};
use miles_core::model::{
    ByteTokenizer, GpuTrainer, LlamaConfig, OptimizerShard, ParamLayout, StepTimes, TrainBatch,
    init_params, standalone_gpu_trainer,
};
use miles_core::{Batch, DeviceChoice, LaunchEnv, MemoryTag};
use serde_json::Value;

use crate::bench::baseline::python_json;
use crate::bench::train::{BenchTrainArgs, TorchLeg, text_batch};

/// What the GPU bench trains: the preset, its parameter table, the batch of text and the
/// weights seeded with 0.
struct Workload {
    config: LlamaConfig,
    layout: ParamLayout,
    owned: Batch,
    params: Vec<f32>,
}

impl Workload {
    fn of(args: &BenchTrainArgs) -> anyhow::Result<Workload> {
        let config = args.preset.clone();
        let tokenizer = ByteTokenizer::from_config(&config)?;
        let owned = text_batch(&tokenizer, args.batch, args.seq);
        let layout = ParamLayout::new(&config);
        let mut params = vec![0.0; layout.len()];
        init_params(&layout, &config, 0, &mut params)?;
        Ok(Workload {
            config,
            layout,
            owned,
            params,
        })
    }
}

/// The warmup then the timed steps of `args` of `trainer` on `batch`: every step's loss, the
/// timed steps' seconds and, with `--phases`, their phases' mean.
fn train_steps(
    trainer: &mut GpuTrainer,
    batch: &TrainBatch<'_>,
    args: &BenchTrainArgs,
) -> anyhow::Result<(Vec<f32>, f64, Option<StepTimes>)> {
    let mut losses = Vec::with_capacity(args.warmup + args.steps);
    for step in 1..=args.warmup as u64 {
        losses.push(trainer.train_step(batch, step).context("warmup step")?.loss);
    }
    if args.phases {
        trainer.time_steps()?;
    }
    let mut phases = StepTimes::default();
    trainer.synchronize()?;
    let start = Instant::now();
    for step in 1..=args.steps as u64 {
        let step = args.warmup as u64 + step;
        losses.push(trainer.train_step(batch, step)?.loss);
        phases += trainer.step_times().unwrap_or_default();
    }
    // The last optimizer step may still run behind the trainer's stream.
    trainer.synchronize()?;
    let seconds = start.elapsed().as_secs_f64();
    let mean = args.phases.then(|| {
        let n = args.steps.max(1) as f64;
        StepTimes {
            passes: phases.passes / n,
            reduction: phases.reduction / n,
            optimizer: phases.optimizer / n,
        }
    });
    Ok((losses, seconds, mean))
}

/// A step's phases in milliseconds, for a line of the report.
fn phases_line(times: &StepTimes) -> String {
    format!(
        "passes {:.1} ms, gradient reduction {:.1} ms, optimizer step {:.1} ms",
        times.passes * 1e3,
        times.reduction * 1e3,
        times.optimizer * 1e3
    )
}

/// Runs the GPU benchmark and its baselines and prints the figures and ratios.
///
/// # Errors
/// No GPU, a failure of the trainer, or a baseline that fails or prints no figure.
pub fn run(args: &BenchTrainArgs) -> anyhow::Result<()> {
    let Some(gpu) = crate::gpu::gpu_for(DeviceChoice::Cuda)? else {
        bail!("--device cuda found no gpu");
    };
    let Workload {
        config,
        layout,
        owned,
        params,
    } = Workload::of(args)?;
    let (b, t) = (args.batch, args.seq);
    let batch = owned.view();
    let mut trainer =
        standalone_gpu_trainer(gpu, config.clone(), &params, b * t, OptimizerShard::WHOLE)?;
    drop(params);
    let (losses, seconds, phases) = train_steps(&mut trainer, &batch, args)?;
    let loss = losses.last().copied().unwrap_or(f32::NAN);
    let ours = (args.steps * b * t) as f64 / seconds;
    let held: u64 = trainer
        .memory()
        .resident_bytes()
        .iter()
        .map(|(_, bytes)| bytes)
        .sum();
    let per_token = flops_per_token(&config, layout.len(), t);
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "bench train: {} parameters, batch {b} x seq {t}, {} timed steps on cuda, last loss {loss:.4}",
        layout.len(),
        args.steps
    )?;
    writeln!(
        out,
        "  miles forward+backward+AdamW: {ours:.0} tokens/s ({:.3} s/step); {}; device memory of its tags {:.2} GiB",
        seconds / args.steps as f64,
        model_rate(ours, per_token),
        held as f64 / GIB
    )?;
    if let Some(phases) = &phases {
        writeln!(
            out,
            "  phases a step (each waited for): {}",
            phases_line(phases)
        )?;
    }
    drop(trainer);
    if args.no_baseline {
        return Ok(());
    }
    let config_file =
        std::env::temp_dir().join(format!("miles-bench-train-{}.json", std::process::id()));
    std::fs::write(&config_file, config.to_json_string())
        .with_context(|| format!("cannot write {}", config_file.display()))?;
    let eager: anyhow::Result<Vec<Value>> = [(TorchLeg::Eager, "eager"), (TorchLeg::Sdpa, "sdpa")]
        .into_iter()
        .filter(|(leg, _)| args.baselines.contains(leg))
        .map(|(_, attn)| torch_baseline(args, &config_file, attn, false))
        .collect();
    // The compiled baseline needs Triton and a compiler on the GPU machine: its failure is
    // reported, not fatal, so the eager figures still print.
    let compiled = args
        .baselines
        .contains(&TorchLeg::Compiled)
        .then(|| torch_baseline(args, &config_file, "sdpa", true))
        .transpose();
    if let Err(error) = std::fs::remove_file(&config_file) {
        tracing::warn!(%error, file = %config_file.display(), "cannot remove the baseline's config");
    }
    let compiled = match compiled {
        Ok(figures) => figures,
        Err(error) => {
            writeln!(out, "  pytorch compiled: failed: {error:#}")?;
            None
        }
    };
    for torch in eager?.into_iter().chain(compiled) {
        let attn = torch["attn"].as_str().unwrap_or("?").to_string();
        let mode = if torch["compiled"].as_bool() == Some(true) {
            "torch.compile (model and loss) + AdamW(fused=True)"
        } else {
            "eager"
        };
        let theirs = torch["tokens_per_s"]
            .as_f64()
            .context("the baseline printed no tokens_per_s")?;
        writeln!(
            out,
            "  pytorch {} {mode}, attention {attn}: {theirs:.0} tokens/s ({:.3} s/step, loss {:.4}); {}; peak memory {:.2} GiB; ratio miles / pytorch {:.2}x",
            torch["torch"].as_str().unwrap_or("?"),
            torch["step_s"].as_f64().unwrap_or(f64::NAN),
            torch["loss"].as_f64().unwrap_or(f64::NAN),
            model_rate(theirs, per_token),
            torch["peak_memory_bytes"].as_f64().unwrap_or(f64::NAN) / GIB,
            ours / theirs
        )?;
    }
    Ok(())
}

/// Bytes in a GiB.
const GIB: f64 = (1u64 << 30) as f64;

/// The H200's dense bf16 tensor rate, NVIDIA's figure (989.4 TFLOP/s); an 8192^3 product
/// through PyTorch reached about 790 of it on these machines.
const H200_BF16_FLOPS: f64 = 989.4e12;

/// Model FLOPs of one trained token, forward and backward: 6 per matrix parameter (every
/// parameter but an untied embedding's, which is a lookup) plus 12 L C T for attention's two
/// products (the PaLM paper's count, with no discount for the causal mask).
fn flops_per_token(config: &LlamaConfig, params: usize, seq: usize) -> f64 {
    let lookup = if config.tie_word_embeddings {
        0
    } else {
        config.vocab_size * config.hidden_size
    };
    let matrices = params.saturating_sub(lookup) as f64;
    6.0 * matrices + 12.0 * (config.num_layers * config.q_dim() * seq) as f64
}

/// `tokens/s` as model TFLOP/s and MFU.
fn model_rate(tokens_per_second: f64, flops_per_token: f64) -> String {
    let flops = tokens_per_second * flops_per_token;
    format!(
        "{:.0} model TFLOP/s, MFU {:.1}% of {:.0} dense bf16 TFLOP/s",
        flops / 1e12,
        100.0 * flops / H200_BF16_FLOPS,
        H200_BF16_FLOPS / 1e12
    )
}

/// One rank of parallel training over the job's GPUs: data parallel (every rank trains its share
/// of the batch's sequences, NCCL sums the gradients) or, with `--tensor-parallel`, tensor
/// parallel (every rank holds its shard of the model and trains the whole batch); then rank 0
/// trains the whole batch alone on its GPU from the same weights, and prints both throughputs
/// and every step's losses.
///
/// # Errors
/// No GPU; the job's group or NCCL failing; a batch of fewer sequences than ranks; a failure
/// of a trainer.
pub fn run_ranks(args: &BenchTrainArgs, env: &LaunchEnv) -> anyhow::Result<()> {
    let Some(gpu) = crate::gpu::gpu_for(DeviceChoice::Cuda)? else {
        bail!("--device cuda found no gpu");
    };
    let (mut group, comm) = crate::gpu::join_job(env, &gpu)?;
    let Workload {
        config,
        layout,
        owned,
        params,
    } = Workload::of(args)?;
    let (b, t) = (args.batch, args.seq);
    let batch = owned.view();
    let parallel = if args.tensor_parallel {
        tensor_parallel_rank(Arc::clone(&gpu), &config, &params, comm, &batch, args)?
    } else {
        // The gradients' sums behind the backward pass run on a stream and communicator of
        // their own.
        let behind = match args.overlap_grad_reduce {
            true => {
                let stream = Arc::new(gpu.with_own_stream()?);
                Some(crate::gpu::open_comm(&mut group, &stream)?)
            }
            false => None,
        };
        let comms = (comm, behind);
        data_parallel_rank(Arc::clone(&gpu), &config, &params, comms, &batch, env, args)?
    };
    let gathered = group.gather(&serde_json::to_vec(&parallel)?)?;
    let alone = match env.rank {
        0 => {
            let mut trainer =
                standalone_gpu_trainer(gpu, config, &params, b * t, OptimizerShard::WHOLE)?;
            let (losses, seconds, phases) = train_steps(&mut trainer, &batch, args)?;
            Some((losses, seconds, state_bytes(&trainer), phases))
        }
        _ => None,
    };
    group.barrier()?;
    let (Some(gathered), Some((alone_losses, alone_seconds, alone_bytes, alone_phases))) =
        (gathered, alone)
    else {
        return Ok(());
    };
    let ranks: Vec<RankRun> = gathered
        .iter()
        .map(|part| serde_json::from_slice(part))
        .collect::<Result<_, _>>()
        .context("a rank sent figures this rank cannot read; run the same miles on every rank")?;
    let slowest = ranks.iter().map(|(_, s, _, _)| *s).fold(0.0, f64::max);
    let tokens = (args.steps * b * t) as f64;
    let (together, single) = (tokens / slowest, tokens / alone_seconds);
    let worst = ranks[0]
        .0
        .iter()
        .zip(&alone_losses)
        .map(|(p, a)| ((p - a) / a).abs())
        .fold(0.0f32, f32::max);
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "bench train: {} parameters, batch {b} x seq {t}, {} parallel over {} gpus, {} timed steps after {} warmup",
        layout.len(),
        if args.tensor_parallel {
            "tensor"
        } else if args.fully_shard && args.overlap_grad_reduce {
            "data (fully sharded, each layer's weights gathered a layer ahead and its gradients summed behind the backward pass)"
        } else if args.fully_shard {
            "data (fully sharded: optimizer state, gradients and bf16 weights split)"
        } else if args.overlap_grad_reduce {
            "data (optimizer state and gradients split, the gradients summed behind the backward pass)"
        } else if args.grad_reduce_in_bf16 {
            "data (optimizer state split, gradients reduced in bf16)"
        } else {
            "data (optimizer state split, gradients reduced in fp32)"
        },
        ranks.len(),
        args.steps,
        args.warmup
    )?;
    writeln!(
        out,
        "  miles over {} gpus: {together:.0} tokens/s ({:.3} s/step); one gpu, the same batch: {single:.0} tokens/s; scaling {:.2}x",
        ranks.len(),
        slowest / args.steps as f64,
        together / single
    )?;
    for (step, (p, a)) in ranks[0].0.iter().zip(&alone_losses).enumerate() {
        writeln!(
            out,
            "  step {}: loss {p:.6} over {} gpus, {a:.6} on one",
            step + 1,
            ranks.len()
        )?;
    }
    let same = ranks.iter().all(|(losses, _, _, _)| *losses == ranks[0].0);
    writeln!(
        out,
        "  largest relative loss difference against one gpu: {worst:.2e}; every rank reports the same losses: {same}"
    )?;
    let state: Vec<u64> = ranks.iter().map(|(_, _, bytes, _)| bytes.state).collect();
    bytes_line(
        &mut out,
        "parameters + optimizer state",
        &state,
        alone_bytes.state,
    )?;
    let grads: Vec<u64> = ranks.iter().map(|(_, _, bytes, _)| bytes.grads).collect();
    bytes_line(&mut out, "gradients", &grads, alone_bytes.grads)?;
    for (rank, (_, _, _, phases)) in ranks.iter().enumerate() {
        if let Some(phases) = phases {
            writeln!(
                out,
                "  rank {rank}'s phases a step: {}",
                phases_line(phases)
            )?;
        }
    }
    if let Some(phases) = &alone_phases {
        writeln!(out, "  one gpu's phases a step: {}", phases_line(phases))?;
    }
    Ok(())
}

/// Writes `what`'s device bytes on each rank and on one GPU, and the largest rank's share.
fn bytes_line(out: &mut impl Write, what: &str, per_rank: &[u64], one: u64) -> std::io::Result<()> {
    let gib = |bytes: u64| bytes as f64 / f64::from(1u32 << 30);
    let each: Vec<String> = per_rank.iter().map(|&b| format!("{:.2}", gib(b))).collect();
    let largest = per_rank.iter().copied().max().unwrap_or(0);
    writeln!(
        out,
        "  {what} on the device, per rank: {} GiB; one gpu: {:.2} GiB ({:.2}x)",
        each.join(", "),
        gib(one),
        largest as f64 / one.max(1) as f64
    )
}

/// One rank's run: its losses, its timed seconds, the device bytes of its state, and with
/// `--phases` its steps' phases.
type RankRun = (Vec<f32>, f64, StateBytes, Option<StepTimes>);

/// Device bytes of a trainer's state.
#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize)]
struct StateBytes {
    /// The bf16 weights and the optimizer state (tags `params` and `optimizer`).
    state: u64,
    /// The gradients (tag `grads`).
    grads: u64,
}

/// Device bytes of `trainer`'s state.
fn state_bytes(trainer: &GpuTrainer) -> StateBytes {
    let held = trainer.memory().resident_bytes();
    let of = |tags: &[MemoryTag]| {
        held.iter()
            .filter(|(tag, _)| tags.contains(tag))
            .map(|(_, bytes)| bytes)
            .sum()
    };
    StateBytes {
        state: of(&[MemoryTag::Params, MemoryTag::Optimizer]),
        grads: of(&[MemoryTag::Grads]),
    }
}

/// This rank's steps of Megatron's tensor-parallel GPU trainer over the job's GPUs, its shard
/// of the full weights `params`, on the whole `batch`.
///
/// # Errors
/// A world size that does not divide the model (bad settings, naming `--tensor-parallel`); a
/// failure of the trainer.
#[cfg(feature = "megatron")]
fn tensor_parallel_rank(
    gpu: Arc<Gpu>,
    config: &LlamaConfig,
    params: &[f32],
    comm: NcclComm,
    batch: &TrainBatch<'_>,
    args: &BenchTrainArgs,
) -> anyhow::Result<RankRun> {
    let tokens = batch.batch * batch.seq;
    let mut trainer = miles_megatron::tensor_parallel_gpu_trainer(
        gpu, config, params, comm, tokens,
    )
    .map_err(|error| match error {
        error @ miles_core::BackendError::Settings { .. } => anyhow::Error::new(
            crate::settings_args::BadSettings(format!("--tensor-parallel: {error}")),
        ),
        error => error.into(),
    })?;
    let (losses, seconds, phases) = train_steps(&mut trainer, batch, args)?;
    Ok((losses, seconds, state_bytes(&trainer), phases))
}

#[cfg(not(feature = "megatron"))]
fn tensor_parallel_rank(
    _: Arc<Gpu>,
    _: &LlamaConfig,
    _: &[f32],
    _: NcclComm,
    _: &TrainBatch<'_>,
    _: &BenchTrainArgs,
) -> anyhow::Result<RankRun> {
    Err(crate::settings_args::BackendNotBuilt(miles_core::TrainBackendKind::Megatron).into())
}

/// This rank's steps of the data-parallel GPU trainer over the job's GPUs (its block of the
/// optimizer state), on its share of `batch`'s sequences.
///
/// # Errors
/// A batch of fewer sequences than ranks; a failure of the trainer.
fn data_parallel_rank(
    gpu: Arc<Gpu>,
    config: &LlamaConfig,
    params: &[f32],
    comms: (NcclComm, Option<NcclComm>),
    batch: &TrainBatch<'_>,
    env: &LaunchEnv,
    args: &BenchTrainArgs,
) -> anyhow::Result<RankRun> {
    let part = batch.shard(env.rank, env.world_size)?;
    let tokens = part.batch * part.seq;
    let split = if args.grad_reduce_in_bf16 {
        DataParallelSplit::OptimizerReducedInBf16
    } else if args.fully_shard && args.overlap_grad_reduce {
        DataParallelSplit::FullAhead
    } else if args.fully_shard {
        DataParallelSplit::Full
    } else if args.overlap_grad_reduce {
        DataParallelSplit::GradientsBehind
    } else {
        DataParallelSplit::Optimizer
    };
    let mut trainer = miles_core::backend::data_parallel_gpu_trainer(
        gpu,
        config.clone(),
        params,
        comms,
        tokens,
        split,
    )?;
    let (losses, seconds, phases) = train_steps(&mut trainer, &part, args)?;
    Ok((losses, seconds, state_bytes(&trainer), phases))
}

/// Runs the PyTorch script on the same shapes and returns its JSON figures.
fn torch_baseline(
    args: &BenchTrainArgs,
    config: &std::path::Path,
    attn: &str,
    compile: bool,
) -> anyhow::Result<Value> {
    let mut script_args = vec![
        "--config".into(),
        config.display().to_string(),
        "--batch".into(),
        args.batch.to_string(),
        "--seq".into(),
        args.seq.to_string(),
        "--steps".into(),
        args.steps.to_string(),
        "--warmup".into(),
        args.warmup.max(1).to_string(),
        "--attn".into(),
        attn.to_string(),
    ];
    if compile {
        script_args.push("--compile".into());
    }
    let what = format!(
        "pytorch ({attn}{})",
        if compile { ", compiled" } else { "" }
    );
    python_json(&args.python, &args.torch_script, &script_args, &what)
}
