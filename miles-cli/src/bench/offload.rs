//! `miles bench offload`: pause/resume throughput of one tag against plain copies measured in
//! the same run.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use miles_core::device::OpenedDevice;
use miles_core::{
    BackupPolicy, Buffer, CudaOptions, DeviceChoice, DiskSettings, ManagerSettings, MemoryManager,
    MemoryTag, OffloadReport, RankDir, StoreError,
};
use serde_json::{Value, json};

use crate::bench::baseline::{CopyBaseline, DirectIoBaseline, pattern_block};
use crate::settings_args::BadSettings;

const MIB: usize = 1 << 20;

/// Settings of `miles bench offload`.
#[derive(Clone, Debug, clap::Args)]
pub struct OffloadBenchArgs {
    /// Device to bench: `cpu`, `cuda` (GPU 0), or `auto` (CUDA when the probe finds a driver
    /// and a GPU, else CPU).
    #[arg(long, default_value = "auto")]
    pub device: DeviceChoice,
    /// Bytes in the paused tag, e.g. `2GiB`, `512MiB`, `1000000`.
    #[arg(long, default_value = "2GiB", value_parser = parse_size)]
    pub size: u64,
    /// Backup target of the tag.
    #[arg(long, default_value = "host", value_name = "none|host|disk")]
    pub target: BackupPolicy,
    /// Pause/resume cycles; the first is reported apart, as it allocates the host pool.
    #[arg(long, default_value_t = 5)]
    pub cycles: usize,
    /// Directory for disk offload and for the O_DIRECT baseline (default: the temp directory;
    /// required with `--target disk`).
    #[arg(long)]
    pub disk_dir: Option<PathBuf>,
    /// Disk chunk size in MiB (as `--offload-train-disk-chunk-mb`).
    #[arg(long, default_value_t = 64)]
    pub chunk_mb: usize,
    /// Capacity of the CPU device in GiB.
    #[arg(long, default_value_t = 64)]
    pub device_memory_gib: u64,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Skip the O_DIRECT write/read of the tag's bytes that the host and none targets print
    /// for reference (it takes seconds per GiB on a slow disk).
    #[arg(long)]
    pub no_disk_baseline: bool,
    /// CUDA only: bytes of physical memory per `cuMemCreate` handle, in MiB (default: the
    /// device's, 1 GiB).
    #[arg(long)]
    pub cuda_commit_chunk_mib: Option<usize>,
    /// CUDA only: bytes per queued copy, in MiB (default: the device's, 64 MiB).
    #[arg(long)]
    pub cuda_copy_chunk_mib: Option<usize>,
    /// CUDA only: copy streams per direction (default: the device's, 2).
    #[arg(long)]
    pub cuda_streams: Option<usize>,
    /// CUDA only: milliseconds after a release at which a background thread makes the driver
    /// collect its scrub records (0: never; default: the device's, 100).
    #[arg(long)]
    pub cuda_collect_after_ms: Option<u64>,
    /// Diagnostic: sleep this long between each pause and the resume after it (not timed), to
    /// tell the driver's work after a release from the cost of the resume itself. Not with
    /// `--both-directions`.
    #[arg(long, default_value_t = 0)]
    pub pause_gap_ms: u64,
    /// Two tags of `--size` each, host target: one pauses while the other resumes, on two
    /// threads; reports the bytes of both over the wall time.
    #[arg(long)]
    pub both_directions: bool,
    /// Start this many processes on this machine, one per GPU (`cuda:0..N`), each pausing and
    /// resuming its own tag of `--size` at the same moment as the others; rank 0 prints per-GPU
    /// and aggregate figures against a plain copy run on all GPUs at once. Under torchrun,
    /// srun or mpirun leave it out: the launcher's ranks do the same.
    #[arg(long, default_value_t = 1)]
    pub nproc_per_node: usize,
}

/// The CUDA device's options: its defaults, with what the flags set.
pub(crate) fn cuda_options(args: &OffloadBenchArgs) -> CudaOptions {
    let defaults = CudaOptions::default();
    CudaOptions {
        commit_chunk: args
            .cuda_commit_chunk_mib
            .map_or(defaults.commit_chunk, |mib| mib * MIB),
        copy_chunk: args
            .cuda_copy_chunk_mib
            .map_or(defaults.copy_chunk, |mib| mib * MIB),
        streams_per_direction: args.cuda_streams.unwrap_or(defaults.streams_per_direction),
        collect_after: args
            .cuda_collect_after_ms
            .map_or(defaults.collect_after, |ms| {
                (ms > 0).then(|| Duration::from_millis(ms))
            }),
        ..defaults
    }
}

/// The settings a run measured, for its JSON report: the CUDA device's options in effect (after
/// rounding) and the memory manager's.
pub(crate) fn settings_json(args: &OffloadBenchArgs, opened: &OpenedDevice) -> Value {
    let cuda = match opened {
        OpenedDevice::Cuda(device) => {
            let options = device.options();
            json!({
                "commit_chunk": options.commit_chunk,
                "copy_chunk": options.copy_chunk,
                "streams_per_direction": options.streams_per_direction,
                "collect_after_ms": options.collect_after.map(|after| after.as_millis()),
            })
        }
        OpenedDevice::Cpu(_) => Value::Null,
    };
    json!({
        "cuda": cuda,
        "pause_gap_ms": args.pause_gap_ms,
    })
}

fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("size {text:?} must start with a whole number, e.g. 2GiB"))?;
    let scale = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        other => {
            return Err(format!(
                "unknown size unit {other:?}: use B, KiB, MiB, GiB, KB, MB or GB"
            ));
        }
    };
    number
        .checked_mul(scale)
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("size {text:?} must be positive and fit 64 bits"))
}

struct Cycle {
    pause: OffloadReport,
    resume: OffloadReport,
    resident_before: u64,
    resident_after: u64,
    /// Plain copy of the same bytes each way (CPU: one memcpy both ways; CUDA: one pinned
    /// `cuMemcpyDtoH` out and one `cuMemcpyHtoD` in).
    copy_out_gbps: f64,
    copy_in_gbps: f64,
    write_gbps: f64,
    read_gbps: f64,
}

/// Checks the flags; returns the tag's size in bytes.
///
/// # Errors
/// [`BadSettings`] for settings that cannot run.
pub fn check(args: &OffloadBenchArgs) -> anyhow::Result<usize> {
    if args.cycles == 0 || args.chunk_mb == 0 {
        return Err(BadSettings("--cycles and --chunk-mb must be at least 1".to_string()).into());
    }
    if args.target == BackupPolicy::Disk && args.disk_dir.is_none() {
        return Err(BadSettings("--target disk requires --disk-dir DIR".to_string()).into());
    }
    if args.both_directions && args.target != BackupPolicy::Host {
        return Err(BadSettings("--both-directions needs --target host".to_string()).into());
    }
    if args.both_directions && args.pause_gap_ms > 0 {
        return Err(
            BadSettings("--pause-gap-ms does not apply to --both-directions".to_string()).into(),
        );
    }
    if args.nproc_per_node == 0 {
        return Err(BadSettings("--nproc-per-node must be at least 1".to_string()).into());
    }
    usize::try_from(args.size).context("--size does not fit this machine")
}

/// Runs the bench of one process on `opened` (a tag of `size` bytes) and prints its figures.
///
/// # Errors
/// Any failure of the device, the memory manager or the baseline files.
pub fn run(args: &OffloadBenchArgs, opened: &OpenedDevice, size: usize) -> anyhow::Result<()> {
    let dir = args.disk_dir.clone().unwrap_or_else(std::env::temp_dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let bench_dir = dir.join(format!("{BENCH_DIR_PREFIX}{}", std::process::id()));
    let policy = args.target;
    if policy == BackupPolicy::Disk {
        remove_killed_benches(&dir);
    }
    let settings = ManagerSettings {
        margin_bytes: 0,
        disk: (policy == BackupPolicy::Disk).then(|| DiskSettings {
            dir: bench_dir.clone(),
            rank: 0,
            chunk_bytes: args.chunk_mb * MIB,
            host_budget_bytes: 0,
        }),
    };
    let outcome = bench(args, opened, settings, policy, size, &dir);
    if bench_dir.exists() {
        std::fs::remove_dir_all(&bench_dir)
            .with_context(|| format!("cannot remove {}", bench_dir.display()))?;
    }
    outcome
}

/// How the per-process directory of a disk bench begins (the pid follows).
const BENCH_DIR_PREFIX: &str = "miles-bench-offload-";

/// Removes the per-process directories that killed disk benches left in `dir`: those whose rank
/// directory no live process has locked (a bench still running holds its lock and keeps its
/// directory).
fn remove_killed_benches(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if !entry
            .file_name()
            .to_string_lossy()
            .starts_with(BENCH_DIR_PREFIX)
        {
            continue;
        }
        let path = entry.path();
        match RankDir::open(&path, 0) {
            Ok(held) => {
                let removed = std::fs::remove_dir_all(&path);
                drop(held);
                match removed {
                    Ok(()) => {
                        tracing::warn!(dir = %path.display(), "removed the directory of a killed disk bench")
                    }
                    Err(error) => {
                        tracing::warn!(dir = %path.display(), %error, "cannot remove the directory of a killed disk bench")
                    }
                }
            }
            Err(StoreError::Locked { .. }) => {}
            Err(error) => {
                tracing::warn!(%error, "cannot check the directory of an earlier disk bench")
            }
        }
    }
}

fn bench(
    args: &OffloadBenchArgs,
    opened: &OpenedDevice,
    settings: ManagerSettings,
    policy: BackupPolicy,
    size: usize,
    dir: &Path,
) -> anyhow::Result<()> {
    let device = opened.shared();
    let memory = MemoryManager::new(Arc::clone(&device), settings)?;
    let tag = MemoryTag::Named("bench".to_string());
    memory.create_region(tag.clone(), policy, size)?;
    let mut buffer = memory.alloc(&tag, size)?;
    let pattern = fill(&mut buffer)?;
    let pin_seconds = if policy == BackupPolicy::Host {
        prepin_host_pool(&memory, std::slice::from_ref(&tag))?
    } else {
        0.0
    };
    // Baselines run between the cycles, on the same bytes, so that load from other processes
    // hits ours and theirs alike; each figure is the mean over the same (steady) cycles.
    let mut copier = CopyBaseline::new(opened, size)?;
    let mut direct = DirectIoBaseline::new(device.as_ref(), dir, args.chunk_mb * MIB)?;
    let mut cycles = Vec::with_capacity(args.cycles);
    for _ in 0..args.cycles {
        let resident_before = device.resident_bytes()?;
        let pause = memory.pause(&tag)?;
        let resident_after = device.resident_bytes()?;
        std::thread::sleep(Duration::from_millis(args.pause_gap_ms));
        let resume = memory.resume(&tag)?;
        if policy == BackupPolicy::None {
            // The contents were dropped; write them again, as a KV cache would be, so the next
            // cycle pauses resident memory (not timed).
            fill(&mut buffer)?;
        }
        let (copy_out_gbps, copy_in_gbps) = copier.run(&buffer)?;
        let (write_gbps, read_gbps) = if policy == BackupPolicy::Disk {
            direct.run(size)?
        } else {
            (f64::NAN, f64::NAN)
        };
        cycles.push(Cycle {
            pause,
            resume,
            resident_before,
            resident_after,
            copy_out_gbps,
            copy_in_gbps,
            write_gbps,
            read_gbps,
        });
    }
    if policy != BackupPolicy::None {
        verify(&buffer, &pattern)?;
    }
    drop(buffer);
    drop(memory);
    if policy != BackupPolicy::Disk && !args.no_disk_baseline {
        let (write_gbps, read_gbps) = direct.run(size)?;
        for cycle in &mut cycles {
            cycle.write_gbps = write_gbps;
            cycle.read_gbps = read_gbps;
        }
    }
    let steady: &[Cycle] = if cycles.len() > 1 {
        &cycles[1..]
    } else {
        &cycles
    };
    let mean = |f: fn(&Cycle) -> f64| steady.iter().map(f).sum::<f64>() / steady.len() as f64;
    let pause_gbps = mean(|c| c.pause.gbps);
    let resume_gbps = mean(|c| c.resume.gbps);
    let copy_out_gbps = mean(|c| c.copy_out_gbps);
    let copy_in_gbps = mean(|c| c.copy_in_gbps);
    let write_gbps = mean(|c| c.write_gbps);
    let read_gbps = mean(|c| c.read_gbps);
    let (pause_base, resume_base) = match policy {
        BackupPolicy::Disk => (write_gbps, read_gbps),
        BackupPolicy::Host | BackupPolicy::None => (copy_out_gbps, copy_in_gbps),
    };
    let ratio = (pause_gbps / pause_base, resume_gbps / resume_base);
    let mut out = std::io::stdout().lock();
    if args.json {
        let cycles_json: Vec<_> = cycles
            .iter()
            .map(|c| {
                json!({
                    "pause_s": c.pause.seconds,
                    "pause_gbps": c.pause.gbps,
                    "resume_s": c.resume.seconds,
                    "resume_gbps": c.resume.gbps,
                    "resident_before_pause": c.resident_before,
                    "resident_after_pause": c.resident_after,
                })
            })
            .collect();
        let report = json!({
            "device": device.name(),
            "target": format!("{policy}"),
            "size_bytes": size,
            "cycles": cycles_json,
            "host_pool_pin_s": pin_seconds,
            "baseline": {
                "kind": copier.name(),
                "copy_out_gbps": copy_out_gbps,
                "copy_in_gbps": copy_in_gbps,
                "write_gbps": write_gbps,
                "read_gbps": read_gbps,
            },
            "ratio": {"pause": ratio.0, "resume": ratio.1},
            "settings": settings_json(args, opened),
        });
        writeln!(out, "{report}")?;
        return Ok(());
    }
    writeln!(
        out,
        "offload bench: device {}, target {policy}, {size} bytes, {} cycles",
        device.name(),
        cycles.len()
    )?;
    for (i, c) in cycles.iter().enumerate() {
        writeln!(
            out,
            "cycle {i}: pause {:.4} s ({:.2} GB/s), resume {:.4} s ({:.2} GB/s), device resident {} -> {} bytes",
            c.pause.seconds,
            c.pause.gbps,
            c.resume.seconds,
            c.resume.gbps,
            c.resident_before,
            c.resident_after
        )?;
        writeln!(
            out,
            "         baseline {} out {:.2} GB/s, in {:.2} GB/s, O_DIRECT write+fsync {:.2} GB/s, read {:.2} GB/s",
            copier.name(),
            c.copy_out_gbps,
            c.copy_in_gbps,
            c.write_gbps,
            c.read_gbps
        )?;
    }
    writeln!(
        out,
        "baseline (mean of steady cycles): {} out {copy_out_gbps:.2} GB/s, in {copy_in_gbps:.2} GB/s, O_DIRECT write+fsync {write_gbps:.2} GB/s, O_DIRECT read {read_gbps:.2} GB/s ({})",
        copier.name(),
        dir.display()
    )?;
    if policy == BackupPolicy::Host {
        writeln!(out, "host pool pinned up front in {pin_seconds:.3} s")?;
    }
    writeln!(
        out,
        "ratio (steady cycles / baseline): pause {:.2}x, resume {:.2}x",
        ratio.0, ratio.1
    )?;
    Ok(())
}

/// Grow the manager's host pool by a buffer for each of `tags` before the first pause, so the
/// first cycle copies instead of pinning; returns the seconds it took.
pub(crate) fn prepin_host_pool(memory: &MemoryManager, tags: &[MemoryTag]) -> anyhow::Result<f64> {
    let started = Instant::now();
    let bytes = memory.prepare_host_backups(tags)?;
    let seconds = started.elapsed().as_secs_f64();
    tracing::info!(
        bytes,
        seconds,
        gbps = bytes as f64 / seconds / 1e9,
        "pinned the host pool up front, before the first pause"
    );
    Ok(seconds)
}

/// Fill the buffer with a seeded pattern, 64 MiB at a time; returns the pattern block.
pub(crate) fn fill(buffer: &mut Buffer) -> anyhow::Result<Vec<u8>> {
    let block = pattern_block(buffer.len().min(64 * MIB));
    let mut offset = 0;
    while offset < buffer.len() {
        let len = block.len().min(buffer.len() - offset);
        buffer.write(offset, &block[..len])?;
        offset += len;
    }
    Ok(block)
}

pub(crate) fn verify(buffer: &Buffer, block: &[u8]) -> anyhow::Result<()> {
    let mut back = vec![0u8; block.len()];
    let mut offset = 0;
    while offset < buffer.len() {
        let len = block.len().min(buffer.len() - offset);
        buffer.read(offset, &mut back[..len])?;
        if back[..len] != block[..len] {
            anyhow::bail!(
                "bytes at offset {offset}.. differ after the cycles: the round trip is not bit-exact"
            );
        }
        offset += len;
    }
    Ok(())
}
