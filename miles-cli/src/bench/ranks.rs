//! `miles bench offload` with one process per GPU (`--nproc-per-node N`, or under torchrun,
//! srun or mpirun): every rank pauses its own tag at the same moment, then resumes it at the
//! same moment, lined up by barriers over the job's [`HostGroup`]; between the cycles every rank
//! runs the plain copy of the same bytes at the same moment. Rank 0 gathers the times and prints
//! per-rank (per-GPU) and aggregate GB/s, each against the plain copy run on all GPUs at once.
//!
//! Each rank stamps its operations with the wall clock (the ranks share one machine's clock),
//! so an aggregate is all the ranks' bytes over the span from the first start to the last end.

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use miles_core::device::{self, OpenedDevice};
use miles_core::{BackupPolicy, HostGroup, LaunchEnv, ManagerSettings, MemoryManager, MemoryTag};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::bench::baseline::CopyBaseline;
use crate::bench::offload::{
    OffloadBenchArgs, cuda_options, fill, prepin_host_pool, settings_json, verify,
};
use crate::settings_args::BadSettings;

const GIB: u64 = 1 << 30;

/// How long a rank waits for the others to join the job.
const JOIN_TIMEOUT: Duration = Duration::from_secs(120);

/// When an operation ran on one rank, in seconds since the Unix epoch.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
struct Span {
    start: f64,
    end: f64,
}

impl Span {
    fn seconds(&self) -> f64 {
        self.end - self.start
    }
}

/// One rank's cycle.
#[derive(Debug, Serialize, Deserialize)]
struct RankCycle {
    pause: Span,
    /// The pause's own time, as its report gives it.
    pause_s: f64,
    resume: Span,
    resume_s: f64,
    copy_out: Span,
    copy_in: Span,
    resident_before: u64,
    resident_after: u64,
}

/// What a rank sends rank 0.
#[derive(Debug, Serialize, Deserialize)]
struct RankRun {
    device: String,
    /// The plain copy's name.
    baseline: String,
    pin_s: f64,
    cycles: Vec<RankCycle>,
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |since| since.as_secs_f64())
}

/// Runs `op` and stamps it.
fn timed<T>(op: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<(T, Span)> {
    let start = now();
    let value = op()?;
    Ok((value, Span { start, end: now() }))
}

/// This process's part of the bench, as rank `env.rank` of `env.world_size`.
///
/// # Errors
/// [`BadSettings`] for a target or mode the multi-process bench does not run; a failure of the
/// device, the memory manager or the group (a rank that fails makes the others fail too).
pub fn run(args: &OffloadBenchArgs, env: &LaunchEnv, size: usize) -> anyhow::Result<()> {
    if args.target == BackupPolicy::Disk || args.both_directions {
        return Err(BadSettings(
            "one process per gpu runs --target host or none, one direction at a time; drop --nproc-per-node (or the launcher) for --target disk or --both-directions".into(),
        )
        .into());
    }
    let mut group = HostGroup::connect(env, JOIN_TIMEOUT)?;
    let opened = device::open_on(
        args.device,
        env.local_rank,
        args.device_memory_gib * GIB,
        cuda_options(args),
    )?;
    let run = rank_cycles(args, &opened, &mut group, size)?;
    let part = serde_json::to_vec(&run)?;
    let Some(parts) = group.gather(&part)? else {
        return Ok(());
    };
    let runs = parts
        .iter()
        .map(|part| serde_json::from_slice::<RankRun>(part))
        .collect::<Result<Vec<_>, _>>()
        .context("a rank sent a report this rank cannot read; run the same miles on every rank")?;
    report(args, &opened, size, &runs)
}

/// The cycles of one rank, in step with the others.
fn rank_cycles(
    args: &OffloadBenchArgs,
    opened: &OpenedDevice,
    group: &mut HostGroup,
    size: usize,
) -> anyhow::Result<RankRun> {
    let policy = args.target;
    let device = opened.shared();
    let memory = MemoryManager::new(
        Arc::clone(&device),
        ManagerSettings {
            margin_bytes: 0,
            disk: None,
        },
    )?;
    let tag = MemoryTag::Named("bench".to_string());
    memory.create_region(tag.clone(), policy, size)?;
    let mut buffer = memory.alloc(&tag, size)?;
    let pattern = fill(&mut buffer)?;
    let pin_s = if policy == BackupPolicy::Host {
        prepin_host_pool(&memory, std::slice::from_ref(&tag))?
    } else {
        0.0
    };
    let mut copier = CopyBaseline::new(opened, size)?;
    let mut cycles = Vec::with_capacity(args.cycles);
    for _ in 0..args.cycles {
        let resident_before = device.resident_bytes()?;
        group.barrier()?;
        let (paused, pause) = timed(|| Ok(memory.pause(&tag)?))?;
        let resident_after = device.resident_bytes()?;
        group.barrier()?;
        let (resumed, resume) = timed(|| Ok(memory.resume(&tag)?))?;
        if policy == BackupPolicy::None {
            fill(&mut buffer)?;
        }
        group.barrier()?;
        let ((), copy_out) = timed(|| copier.out(&buffer).map(drop))?;
        group.barrier()?;
        let ((), copy_in) = timed(|| copier.back(&buffer).map(drop))?;
        cycles.push(RankCycle {
            pause,
            pause_s: paused.seconds,
            resume,
            resume_s: resumed.seconds,
            copy_out,
            copy_in,
            resident_before,
            resident_after,
        });
    }
    if policy == BackupPolicy::Host {
        verify(&buffer, &pattern)?;
    }
    Ok(RankRun {
        device: device.name(),
        baseline: copier.name().to_string(),
        pin_s,
        cycles,
    })
}

/// Which of a cycle's operations a figure is about.
type SpanOf = fn(&RankCycle) -> Span;

/// Per-rank GB/s and the aggregate over all of them, for one operation of one
/// cycle.
struct Together {
    per_rank: Vec<f64>,
    per_rank_s: Vec<f64>,
    aggregate: f64,
    wall_s: f64,
}

impl Together {
    /// `A GB/s together in W ms (per rank: a b GB/s, x y ms)`.
    fn describe(&self) -> String {
        let list = |values: &[f64], scale: f64, digits: usize| {
            values
                .iter()
                .map(|v| format!("{:.*}", digits, v * scale))
                .collect::<Vec<_>>()
                .join(" ")
        };
        format!(
            "{:.2} GB/s together in {:.2} ms (per rank: {} GB/s, {} ms)",
            self.aggregate,
            self.wall_s * 1e3,
            list(&self.per_rank, 1.0, 2),
            list(&self.per_rank_s, 1e3, 2)
        )
    }
}

fn together(runs: &[RankRun], cycle: usize, size: usize, op: SpanOf) -> Together {
    let spans: Vec<Span> = runs.iter().map(|run| op(&run.cycles[cycle])).collect();
    let first = spans.iter().map(|s| s.start).fold(f64::INFINITY, f64::min);
    let last = spans
        .iter()
        .map(|s| s.end)
        .fold(f64::NEG_INFINITY, f64::max);
    let wall_s = last - first;
    Together {
        per_rank: spans
            .iter()
            .map(|s| size as f64 / s.seconds() / 1e9)
            .collect(),
        per_rank_s: spans.iter().map(Span::seconds).collect(),
        aggregate: (size * runs.len()) as f64 / wall_s / 1e9,
        wall_s,
    }
}

fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = values.fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    sum / n.max(1) as f64
}

/// Rank 0: the figures of every rank, per cycle and over the steady cycles (all but the first).
fn report(
    args: &OffloadBenchArgs,
    opened: &OpenedDevice,
    size: usize,
    runs: &[RankRun],
) -> anyhow::Result<()> {
    let cycles = args.cycles;
    let steady: Vec<usize> = if cycles > 1 {
        (1..cycles).collect()
    } else {
        vec![0]
    };
    let ops: [(&str, SpanOf); 4] = [
        ("pause", |c| c.pause),
        ("resume", |c| c.resume),
        ("copy_out", |c| c.copy_out),
        ("copy_in", |c| c.copy_in),
    ];
    let per_cycle: Vec<Vec<Together>> = (0..cycles)
        .map(|cycle| {
            ops.iter()
                .map(|(_, op)| together(runs, cycle, size, *op))
                .collect()
        })
        .collect();
    let steady_of = |op: usize| -> (f64, Vec<f64>) {
        let aggregate = mean(steady.iter().map(|&c| per_cycle[c][op].aggregate));
        let per_rank = (0..runs.len())
            .map(|rank| mean(steady.iter().map(|&c| per_cycle[c][op].per_rank[rank])))
            .collect();
        (aggregate, per_rank)
    };
    let (pause, resume, out, back) = (steady_of(0), steady_of(1), steady_of(2), steady_of(3));
    let ratio = (pause.0 / out.0, resume.0 / back.0);
    let copier = runs[0].baseline.as_str();
    let mut stdout = std::io::stdout().lock();
    if args.json {
        let cycles_json: Vec<_> = (0..cycles)
            .map(|cycle| {
                let mut entry = serde_json::Map::new();
                for (index, (name, _)) in ops.iter().enumerate() {
                    let t = &per_cycle[cycle][index];
                    entry.insert(
                        (*name).to_string(),
                        json!({"aggregate_gbps": t.aggregate, "per_rank_gbps": t.per_rank, "wall_s": t.wall_s}),
                    );
                }
                entry.insert(
                    "pause_s".into(),
                    json!(runs.iter().map(|r| r.cycles[cycle].pause_s).collect::<Vec<_>>()),
                );
                entry.insert(
                    "resume_s".into(),
                    json!(runs.iter().map(|r| r.cycles[cycle].resume_s).collect::<Vec<_>>()),
                );
                entry.insert(
                    "resident_before_pause".into(),
                    json!(runs.iter().map(|r| r.cycles[cycle].resident_before).collect::<Vec<_>>()),
                );
                entry.insert(
                    "resident_after_pause".into(),
                    json!(runs.iter().map(|r| r.cycles[cycle].resident_after).collect::<Vec<_>>()),
                );
                serde_json::Value::Object(entry)
            })
            .collect();
        let report = json!({
            "ranks": runs.len(),
            "devices": runs.iter().map(|r| r.device.clone()).collect::<Vec<_>>(),
            "target": format!("{:?}", args.target).to_lowercase(),
            "size_bytes_per_rank": size,
            "host_pool_pin_s": runs.iter().map(|r| r.pin_s).collect::<Vec<_>>(),
            "cycles": cycles_json,
            "steady": {
                "pause_aggregate_gbps": pause.0, "pause_per_rank_gbps": pause.1,
                "resume_aggregate_gbps": resume.0, "resume_per_rank_gbps": resume.1,
            },
            "baseline": {
                "kind": copier,
                "copy_out_aggregate_gbps": out.0, "copy_out_per_rank_gbps": out.1,
                "copy_in_aggregate_gbps": back.0, "copy_in_per_rank_gbps": back.1,
            },
            "ratio": {"pause": ratio.0, "resume": ratio.1},
            "settings": settings_json(args, opened),
        });
        writeln!(stdout, "{report}")?;
        return Ok(());
    }
    writeln!(
        stdout,
        "offload bench: {} ranks at once ({}), target {:?}, {size} bytes per rank, {cycles} cycles",
        runs.len(),
        runs.iter()
            .map(|r| r.device.as_str())
            .collect::<Vec<_>>()
            .join(", "),
        args.target
    )?;
    for (cycle, row) in per_cycle.iter().enumerate() {
        writeln!(stdout, "cycle {cycle}:")?;
        for ((name, _), together) in ops.iter().zip(row) {
            writeln!(stdout, "  {name:>8}: {}", together.describe())?;
        }
    }
    let gbps = |values: &[f64]| {
        values
            .iter()
            .map(|v| format!("{v:.2}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    writeln!(
        stdout,
        "steady cycles: pause {:.2} GB/s together (per rank {}), resume {:.2} (per rank {}); {copier} on all ranks at once: out {:.2}, in {:.2}",
        pause.0,
        gbps(&pause.1),
        resume.0,
        gbps(&resume.1),
        out.0,
        back.0
    )?;
    writeln!(
        stdout,
        "ratio (together / plain copy together): pause {:.2}x, resume {:.2}x",
        ratio.0, ratio.1
    )?;
    Ok(())
}
