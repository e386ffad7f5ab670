//! `miles bench offload-train`: a training backend's offload and onload, per rank, against plain
//! copies of the same bytes measured in the same run (for `cpu` a memcpy on the CPU device, a
//! plain pinned `cuMemcpy` each way on CUDA; an O_DIRECT write and read for `disk`).
//!
//! Ranks are threads that offload at once: on the CPU device they share the machine's memory
//! bandwidth and, for `disk`, one disk, so the all-ranks line is the one to hold against the
//! single-stream baseline there; on GPUs each rank has its own link.
//!
//! With `--stream-optimizer-state-to-disk` it also reports the streamed optimizer step: each
//! step's time against a resident backend's on the same batch, the disk traffic of the walk
//! against a plain O_DIRECT write and read of the same bytes (the time the stream adds to the
//! step, against the time those plain transfers take), and the optimizer state the device holds
//! against the resident backend's.

use std::io::Write;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use miles_core::config::{OffloadTarget, Settings};
use miles_core::device::Gpu;
use miles_core::model::ByteTokenizer;
use miles_core::{BackupPolicy, CpuDevice, CudaDevice, Device, MemoryTag, OffloadStats};

use crate::backends::build_backend;
use crate::bench::baseline::{DirectIoBaseline, MemcpyBaseline};
use crate::bench::train::text_batch;
use crate::settings_args::{BadSettings, SettingsArgs};

/// `miles bench offload-train`.
#[derive(Args, Debug)]
pub struct OffloadTrainBenchArgs {
    /// The settings (backend, preset, parallel sizes, offload target and directory).
    #[command(flatten)]
    pub settings: SettingsArgs,
    /// Offload/onload cycles, each after a training step; the first is reported apart, as it
    /// allocates the host pool.
    #[arg(long, default_value_t = 3)]
    pub cycles: usize,
    /// Tokens per sequence of the training steps between cycles.
    #[arg(long, default_value_t = 64)]
    pub seq: usize,
    /// Sequences per training step (per data-parallel rank); a larger batch gives the streamed
    /// optimizer's disk work more compute to hide behind.
    #[arg(long, default_value_t = 2)]
    pub batch: usize,
}

/// Runs the bench and prints its figures.
///
/// # Errors
/// [`BadSettings`] for settings that cannot run; any failure of the backend or the baselines.
pub fn run(args: OffloadTrainBenchArgs) -> anyhow::Result<()> {
    if args.cycles == 0 || args.seq == 0 || args.batch == 0 {
        return Err(
            BadSettings("--cycles, --seq and --batch must be at least 1".to_string()).into(),
        );
    }
    // The bench is about offload: `--offload-train` is implied unless switched off.
    let mut raw = args.settings.to_raw();
    raw.offload_train.get_or_insert(true);
    let settings = Settings::load(raw, args.settings.config.as_deref())?;
    let mut backend = build_backend(&settings, None)?;
    let target = settings.offload_train_target;
    let dp = settings.data_parallel_size;
    let tokenizer = ByteTokenizer::from_config(backend.config())?;
    let batch = text_batch(
        &tokenizer,
        args.batch * dp,
        args.seq.min(backend.config().max_position_embeddings),
    );

    let mut cycles = Vec::with_capacity(args.cycles);
    for _ in 0..args.cycles {
        backend.train_step(&batch)?;
        let out = backend.offload()?;
        let back = backend.onload()?;
        cycles.push((out, back));
    }
    // Steps back to back, as between two offloads of a long training phase: a streamed
    // optimizer's writes behind one step and reads ahead of the next run under its passes.
    let steps = (0..args.cycles)
        .map(|_| backend.train_step(&batch))
        .collect::<Result<Vec<_>, _>>()?;
    let last = steps.last().map_or(0.0, |s| s.loss);

    let widest = cycles
        .iter()
        .flat_map(|(out, _)| out.ranks.iter().map(moved_bytes))
        .max()
        .unwrap_or(0);
    let size = usize::try_from(widest).context("rank bytes do not fit this machine")?;
    let gpu = crate::gpu::gpu_for(settings.device)?;
    let backend_on_gpu = gpu.is_some();
    let (base_out, base_in) = baseline(&settings, gpu.as_deref(), target, size)?;

    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "offload-train: backend {}, preset {}, tp {} x dp {}, target {target}, {} cycles (loss after: {:.4})",
        backend.name(),
        settings.preset,
        settings.tensor_model_parallel_size,
        dp,
        args.cycles,
        last
    )?;
    writeln!(
        out,
        "baseline ({}, {} bytes, same run): out {base_out:.2} GB/s, in {base_in:.2} GB/s",
        match target {
            OffloadTarget::Host if backend_on_gpu => "plain pinned cuMemcpy",
            OffloadTarget::Host => "single-threaded memcpy",
            OffloadTarget::Disk => "O_DIRECT write+fsync / read",
        },
        size
    )?;
    if target == OffloadTarget::Disk && settings.offload_train_host_budget_gb > 0.0 {
        writeln!(
            out,
            "written behind: within a host budget of {} GB each offload copies to host memory, frees the device and writes to disk on its own thread; the onload right after reads the host copy (stopping a write still running)",
            settings.offload_train_host_budget_gb
        )?;
    }
    for (i, (off, on)) in cycles.iter().enumerate() {
        let label = if i == 0 { "first" } else { "steady" };
        for (what, stats, base) in [("offload", off, base_out), ("onload", on, base_in)] {
            for rank in &stats.ranks {
                let moved = moved_bytes(rank);
                let gbps = moved as f64 / rank.seconds.max(f64::MIN_POSITIVE) / 1e9;
                writeln!(
                    out,
                    "cycle {i} ({label}) {what:7} rank {}: {moved} bytes moved ({} released or committed) in {:.4} s = {gbps:.2} GB/s ({:.2}x baseline)",
                    rank.rank,
                    rank.bytes,
                    rank.seconds,
                    gbps / base.max(f64::MIN_POSITIVE)
                )?;
            }
            let all = total_moved(stats) as f64 / stats.seconds.max(f64::MIN_POSITIVE) / 1e9;
            writeln!(
                out,
                "cycle {i} ({label}) {what:7} all ranks: {} bytes in {:.4} s = {all:.2} GB/s ({:.2}x baseline)",
                total_moved(stats),
                stats.seconds,
                all / base.max(f64::MIN_POSITIVE)
            )?;
        }
    }
    if settings.stream_optimizer_state_to_disk {
        let streamed_state = optimizer_bytes(&backend.device_memory());
        drop(backend);
        streamed_report(&settings, &batch, &steps, streamed_state, &mut out)?;
    }
    Ok(())
}

/// Device bytes of optimizer state among `tags`: the resident moments and master weights, or
/// the streamed moments' slots and the master weights.
fn optimizer_bytes(tags: &[(MemoryTag, u64)]) -> u64 {
    tags.iter()
        .filter(|(tag, _)| {
            matches!(tag, MemoryTag::Optimizer)
                || matches!(tag, MemoryTag::Named(name) if name.starts_with("optimizer"))
        })
        .map(|(_, bytes)| bytes)
        .sum()
}

/// The streamed optimizer's figures: its steps against a resident backend's on `batch`, its
/// disk traffic against plain O_DIRECT transfers of the same bytes, its device state against
/// the resident one.
fn streamed_report(
    settings: &Settings,
    batch: &miles_core::backend::Batch,
    streamed: &[miles_core::StepStats],
    streamed_state: u64,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let mut plain = settings.clone();
    plain.stream_optimizer_state_to_disk = false;
    plain.stream_optimizer_master_weights = false;
    plain.offload_train = false;
    let mut resident = build_backend(&plain, None)?;
    let resident_steps = (0..streamed.len())
        .map(|_| resident.train_step(batch))
        .collect::<Result<Vec<_>, _>>()?;
    let resident_state = optimizer_bytes(&resident.device_memory());
    drop(resident);
    // The steady steps (the first of each also sets up buffers).
    let mean = |steps: &[miles_core::StepStats]| {
        let steady = if steps.len() > 1 { &steps[1..] } else { steps };
        steady.iter().map(|s| s.seconds).sum::<f64>() / steady.len() as f64
    };
    let (stream_step, resident_step) = (mean(streamed), mean(&resident_steps));
    let moved = streamed
        .last()
        .and_then(|s| s.optimizer_stream)
        .unwrap_or_default();
    writeln!(
        out,
        "streamed optimizer ({}, {} tokens a step): step {stream_step:.3} s against resident {resident_step:.3} s ({:.2}x); per step {} bytes read, {} written, the disk busy {:.3} s, the step waiting on it {:.3} s",
        settings.stream_optimizer_state_moment_dtype,
        batch.batch * batch.seq,
        stream_step / resident_step.max(f64::MIN_POSITIVE),
        moved.bytes_read,
        moved.bytes_written,
        moved.disk_seconds,
        moved.wait_seconds
    )?;
    writeln!(
        out,
        "streamed optimizer state on the device: {streamed_state} bytes against {resident_state} resident ({:.1}%)",
        100.0 * streamed_state as f64 / resident_state.max(1) as f64
    )?;
    if moved.bytes_read == 0 {
        writeln!(
            out,
            "streamed optimizer disk: this backend does not report its stream's traffic (the cpu backends); no O_DIRECT comparison"
        )?;
        return Ok(());
    }
    let size = usize::try_from(moved.bytes_written.max(moved.bytes_read))
        .context("streamed bytes do not fit this machine")?;
    let (write_gbps, read_gbps) = direct_io(settings, size)?;
    let plain_seconds = moved.bytes_written as f64 / (write_gbps * 1e9)
        + moved.bytes_read as f64 / (read_gbps * 1e9);
    let added = stream_step - resident_step;
    let busy = moved.disk_seconds.max(f64::MIN_POSITIVE);
    writeln!(
        out,
        "streamed optimizer disk: {:.2} GB/s read and written over the {busy:.3} s the disk was busy a step; plain O_DIRECT (same run, write+fsync {write_gbps:.2} GB/s, read {read_gbps:.2} GB/s) moves the same bytes in {plain_seconds:.3} s ({:.2}x of plain O_DIRECT); the stream adds {added:.3} s to the step",
        (moved.bytes_read + moved.bytes_written) as f64 / busy / 1e9,
        plain_seconds / busy
    )?;
    Ok(())
}

/// Bytes a rank copied to or from its backups (what is dropped, such as gradients and
/// activations, does not move).
fn moved_bytes(rank: &miles_core::RankOffload) -> u64 {
    rank.tags
        .iter()
        .filter(|r| r.policy != BackupPolicy::None)
        .map(|r| r.bytes)
        .sum()
}

fn total_moved(stats: &OffloadStats) -> u64 {
    stats.ranks.iter().map(moved_bytes).sum()
}

/// The plain copies of `size` bytes (pinned `cuMemcpy` on `gpu` when there is one): (out, in) GB/s.
fn baseline(
    settings: &Settings,
    gpu: Option<&Gpu>,
    target: OffloadTarget,
    size: usize,
) -> anyhow::Result<(f64, f64)> {
    match target {
        OffloadTarget::Host => match gpu {
            Some(gpu) => pinned_copies(gpu.device(), size),
            None => {
                let mut copy = MemcpyBaseline::new(size);
                copy.run();
                Ok((copy.run(), copy.run()))
            }
        },
        OffloadTarget::Disk => direct_io(settings, size),
    }
}

/// A plain O_DIRECT write (with fsync) and read of `size` bytes in `--offload-train-disk-dir`,
/// in blocks of the disk chunk: (write, read) GB/s.
fn direct_io(settings: &Settings, size: usize) -> anyhow::Result<(f64, f64)> {
    let dir = settings
        .offload_train_disk_dir
        .clone()
        .ok_or_else(|| BadSettings("a disk target needs --offload-train-disk-dir".to_string()))?;
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let chunk = usize::try_from(settings.offload_train_disk_chunk_mb << 20)
        .context("--offload-train-disk-chunk-mb does not fit this machine")?;
    let device = CpuDevice::new(settings.device_memory_bytes());
    let mut io = DirectIoBaseline::new(&device, &dir, chunk.min(size.next_multiple_of(4096)))?;
    io.run(size)
}

/// One plain pinned `cuMemcpyDtoH` and one `cuMemcpyHtoD` of `size` bytes between fresh device
/// memory and a pinned buffer: (out, in) GB/s.
fn pinned_copies(device: &CudaDevice, size: usize) -> anyhow::Result<(f64, f64)> {
    let range = device.reserve(size.max(1).next_multiple_of(device.granularity()))?;
    device.commit(range)?;
    let mut host = device.alloc_host(size)?;
    let bytes = range.slice(0, size)?;
    let started = Instant::now();
    device.plain_copy_to_host(bytes, &mut host, 0)?;
    let out = size as f64 / started.elapsed().as_secs_f64() / 1e9;
    let started = Instant::now();
    device.plain_copy_from_host(&mut host, 0, bytes)?;
    let back = size as f64 / started.elapsed().as_secs_f64() / 1e9;
    device.unreserve(range)?;
    Ok((out, back))
}
