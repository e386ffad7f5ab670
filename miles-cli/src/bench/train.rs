//! `miles bench train`: forward + backward + AdamW tokens/s, and how much of the step is matrix
//! products, against the `gemm` crate's own speed on the same shapes measured in the same run.
//! On `--device cuda` the baseline is a PyTorch eager implementation of the same shapes
//! (`bench/torch_train.py`, run in the same call with both of its attention implementations).
//!
//! The profiled products are the linear layers' (projections, MLP, LM head; forward and both
//! backward products); attention's per-head products run inside the attention kernel and count
//! as the rest of the step.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use clap::{Args, ValueEnum};
use miles_core::Batch;
use miles_core::model::{ByteTokenizer, LlamaConfig, Trainer, Transformer, init_params};
use miles_core::ops::{AdamWConfig, MatmulProfile};

use crate::model_cmd::parse_preset;
use crate::settings_args::BadSettings;

/// Where the benchmark runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BenchDevice {
    /// The CPU: gemm + rayon kernels.
    Cpu,
    /// GPU 0: cuBLAS + NVRTC kernels, bf16 compute, fp32 master weights.
    Cuda,
}

/// `miles bench train`.
#[derive(Args, Debug)]
pub struct BenchTrainArgs {
    /// Preset config: tiny, small, 0.5b, 1b or 3b.
    #[arg(long, default_value = "small", value_parser = parse_preset)]
    pub preset: LlamaConfig,
    /// Device to train on.
    #[arg(long, value_enum, default_value_t = BenchDevice::Cpu)]
    pub device: BenchDevice,
    /// Sequences per step.
    #[arg(long, default_value_t = 4)]
    pub batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 256)]
    pub seq: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 3)]
    pub steps: usize,
    /// Untimed steps first.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// On cuda: the PyTorch baseline script run in the same call (nothing to skip it).
    #[arg(long, default_value = "bench/torch_train.py")]
    pub torch_script: PathBuf,
    /// On cuda: the Python that runs it (one with torch and transformers).
    #[arg(long, default_value = "python3")]
    pub python: String,
    /// On cuda: skip the PyTorch baseline.
    #[arg(long)]
    pub no_baseline: bool,
    /// On cuda: which PyTorch baselines to run, comma-separated (eager attention's scores
    /// in memory make it slow at long sequences).
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [TorchLeg::Eager, TorchLeg::Sdpa, TorchLeg::Compiled])]
    pub baselines: Vec<TorchLeg>,
    /// On cuda: train data-parallel over this many GPUs of this machine, one process each
    /// (each takes its share of the batch's sequences); rank 0 then trains the whole batch
    /// alone on its GPU and prints both throughputs and the losses of every step side by side.
    /// Under torchrun, srun or mpirun leave it out: the launcher's ranks do the same.
    #[arg(long, default_value_t = 1)]
    pub nproc_per_node: usize,
    /// With several processes: tensor parallelism instead (Megatron's split of heads and MLP
    /// columns over the ranks, every rank on the whole batch).
    #[arg(long)]
    pub tensor_parallel: bool,
    /// With several processes, data parallel: reduce-scatter the gradients in bf16.
    #[arg(long)]
    pub grad_reduce_in_bf16: bool,
    /// With several processes, data parallel: shard fully, as `--train-backend fsdp` does
    /// (ZeRO stage 3: each rank keeps its block of the bf16 weights and gradients too, each
    /// unit's weights gathered before it runs and its gradients summed into their owners'
    /// blocks after).
    #[arg(long)]
    pub fully_shard: bool,
    /// With several processes, data parallel: split the gradients too and sum each layer's
    /// on a second communicator and stream while the backward pass goes on (ZeRO stage 2, as
    /// Megatron's `--overlap-grad-reduce`); with `--fully-shard`, gather each layer's weights
    /// there too, a layer ahead of the passes.
    #[arg(long)]
    pub overlap_grad_reduce: bool,
    /// On cuda: also say where each timed step's time went (the passes, the group's gradient
    /// reduction, the optimizer step), each phase waited for on the host.
    #[arg(long)]
    pub phases: bool,
}

/// A PyTorch baseline of `bench train --device cuda` (`bench/torch_train.py`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum TorchLeg {
    /// Eager, attention as matmul + softmax + matmul.
    Eager,
    /// Eager with PyTorch's fused attention.
    Sdpa,
    /// `torch.compile` of the model and its loss with sdpa and `AdamW(fused=True)`.
    Compiled,
}

/// `b` sequences of `t` tokens of deterministic text (a paragraph repeated to fill every
/// sequence, shifted per sequence), every target weighted 1, the loss their mean.
pub fn text_batch(tokenizer: &ByteTokenizer, b: usize, t: usize) -> Batch {
    let text = "Reinforcement learning alternates rollout and training on the same devices. ";
    let corpus = tokenizer.encode(&text.repeat(t / text.len() + 2), false);
    let mut inputs = Vec::with_capacity(b * t);
    let mut targets = Vec::with_capacity(b * t);
    for s in 0..b {
        let start = s % text.len();
        inputs.extend_from_slice(&corpus[start..start + t]);
        targets.extend_from_slice(&corpus[start + 1..start + t + 1]);
    }
    Batch {
        batch: b,
        seq: t,
        inputs,
        targets,
        weights: vec![1.0; b * t],
        normaliser: (b * t) as f32,
        entropy_mask: None,
        entropy_coef: 0.0,
    }
}

/// Checks the flags that hold on every device.
///
/// # Errors
/// Bad sizes or rank counts.
pub fn check(args: &BenchTrainArgs) -> anyhow::Result<()> {
    BadSettings::refuse_zero(&[
        ("--batch", args.batch),
        ("--seq", args.seq),
        ("--steps", args.steps),
        ("--nproc-per-node", args.nproc_per_node),
    ])?;
    if args.device != BenchDevice::Cuda && (args.nproc_per_node > 1 || args.tensor_parallel) {
        return Err(BadSettings(
            "--nproc-per-node and --tensor-parallel train over gpus; add --device cuda".into(),
        )
        .into());
    }
    if args.phases && args.device != BenchDevice::Cuda {
        return Err(BadSettings(
            "--phases times the gpu trainer's step; add --device cuda (on the cpu the report already gives the matrix products' share)".into(),
        )
        .into());
    }
    if args.grad_reduce_in_bf16 && (args.device != BenchDevice::Cuda || args.tensor_parallel) {
        return Err(BadSettings(
            "--grad-reduce-in-bf16 reduces the gradients of data parallelism over gpus; add --device cuda and drop --tensor-parallel, or drop it".into(),
        )
        .into());
    }
    if args.fully_shard
        && (args.device != BenchDevice::Cuda || args.tensor_parallel || args.grad_reduce_in_bf16)
    {
        return Err(BadSettings(
            "--fully-shard splits data parallelism's weights and gradients over gpus, reduced in fp32; add --device cuda and drop --tensor-parallel and --grad-reduce-in-bf16, or drop it".into(),
        )
        .into());
    }
    if args.overlap_grad_reduce
        && (args.device != BenchDevice::Cuda || args.tensor_parallel || args.grad_reduce_in_bf16)
    {
        return Err(BadSettings(
            "--overlap-grad-reduce sums data parallelism's split gradients in fp32 behind the backward pass; add --device cuda and drop --tensor-parallel and --grad-reduce-in-bf16, or drop it".into(),
        )
        .into());
    }
    Ok(())
}

/// Runs the benchmark on the CPU device and prints its figures.
///
/// # Errors
/// A failure of the model.
pub fn run_cpu(args: BenchTrainArgs) -> anyhow::Result<()> {
    let config = args.preset;
    let tokenizer = ByteTokenizer::from_config(&config)?;
    let profile = Arc::new(MatmulProfile::default());
    let model = Transformer::new(config.clone()).with_profile(Arc::clone(&profile));
    let mut params = vec![0.0; model.layout().len()];
    init_params(model.layout(), &config, 0, &mut params)?;
    let n_params = params.len();

    let (b, t) = (args.batch, args.seq);
    let owned = text_batch(&tokenizer, b, t);
    let batch = owned.view();
    let mut trainer = Trainer::new(model, params, AdamWConfig::default())?;
    for _ in 0..args.warmup {
        trainer.train_step(&batch).context("warmup step")?;
    }
    profile.clear();
    let start = Instant::now();
    let mut loss = 0.0;
    for _ in 0..args.steps {
        loss = trainer.train_step(&batch)?.loss;
    }
    let step_seconds = start.elapsed().as_secs_f64();
    let tokens = (args.steps * b * t) as f64;

    // The same shapes, each called as often, on fresh buffers outside the model.
    let shapes = profile.shapes();
    let mut ours = (0.0f64, 0.0f64);
    let mut base = (0.0f64, 0.0f64);
    let mut rows = Vec::new();
    for (call, calls, seconds) in &shapes {
        let lhs = vec![0.5f32; call.m * call.k];
        let rhs = vec![0.25f32; call.k * call.n];
        let mut dst = vec![1.0f32; call.m * call.n];
        call.run(&mut dst, &lhs, &rhs)?;
        let t0 = Instant::now();
        for _ in 0..*calls {
            call.run(&mut dst, &lhs, &rhs)?;
        }
        let baseline = t0.elapsed().as_secs_f64();
        let flops = call.flops() * *calls as f64;
        ours = (ours.0 + flops, ours.1 + seconds);
        base = (base.0 + flops, base.1 + baseline);
        rows.push((*call, *calls, flops / seconds / 1e9, flops / baseline / 1e9));
    }
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "bench train: {} parameters, batch {b} x seq {t}, {} timed steps on {:?} ({} cores), last loss {loss:.4}",
        n_params,
        args.steps,
        args.device,
        std::thread::available_parallelism().map_or(1, usize::from)
    )?;
    writeln!(
        out,
        "  forward+backward+AdamW: {:.1} tokens/s ({:.3} s/step)",
        tokens / step_seconds,
        step_seconds / args.steps as f64
    )?;
    writeln!(
        out,
        "  linear-layer matrix products: {:.1}% of step time, {:.2} GFLOP/s in the step",
        100.0 * ours.1 / step_seconds,
        ours.0 / ours.1 / 1e9
    )?;
    writeln!(
        out,
        "  gemm crate alone on the same shapes: {:.2} GFLOP/s; ratio in-step / alone: {:.3}",
        base.0 / base.1 / 1e9,
        (ours.0 / ours.1) / (base.0 / base.1)
    )?;
    writeln!(
        out,
        "  per shape (m x n x k, lhsT, rhsT, acc, calls, in-step GFLOP/s, alone GFLOP/s):"
    )?;
    for (c, calls, in_step, alone) in rows {
        writeln!(
            out,
            "    {:>5} x {:>5} x {:>5}  {:<5} {:<5} {:<5} {calls:>4}  {in_step:>8.2}  {alone:>8.2}",
            c.m, c.n, c.k, c.lhs_transposed, c.rhs_transposed, c.accumulate
        )?;
    }
    Ok(())
}
