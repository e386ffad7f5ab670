//! `miles bench offload --both-directions`: one tag pauses to host memory while another resumes
//! from it, at the same time, as when training state leaves while rollout weights come back.

use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

use miles_core::device::OpenedDevice;
use miles_core::{BackupPolicy, ManagerSettings, MemoryManager, MemoryTag};
use serde_json::json;

use crate::bench::baseline::CopyBaseline;
use crate::bench::offload::{OffloadBenchArgs, fill, prepin_host_pool, settings_json, verify};

struct Cycle {
    seconds: f64,
    pause_seconds: f64,
    resume_seconds: f64,
    copy_out_gbps: f64,
    copy_in_gbps: f64,
}

/// Run the both-directions bench: two tags of `size` bytes, host backup; each cycle pauses the
/// active one on a second thread while this thread resumes the paused one.
///
/// # Errors
/// Any failure of the device or the memory manager; a round trip that is not bit-exact.
pub fn run(args: &OffloadBenchArgs, opened: &OpenedDevice, size: usize) -> anyhow::Result<()> {
    let device = opened.shared();
    let memory = MemoryManager::new(
        Arc::clone(&device),
        ManagerSettings {
            margin_bytes: 0,
            disk: None,
        },
    )?;
    let tags = [
        MemoryTag::Named("outgoing".to_string()),
        MemoryTag::Named("incoming".to_string()),
    ];
    let mut buffers = Vec::with_capacity(2);
    let mut patterns = Vec::with_capacity(2);
    for tag in &tags {
        memory.create_region(tag.clone(), BackupPolicy::Host, size)?;
        let mut buffer = memory.alloc(tag, size)?;
        patterns.push(fill(&mut buffer)?);
        buffers.push(buffer);
    }
    let pin_seconds = prepin_host_pool(&memory, &tags)?;
    let mut copier = CopyBaseline::new(opened, size)?;
    memory.pause(&tags[1])?;
    // Index of the tag that is paused now; each cycle swaps the roles.
    let mut paused_index = 1;
    let mut cycles = Vec::with_capacity(args.cycles);
    for _ in 0..args.cycles {
        let (out, back) = (&tags[1 - paused_index], &tags[paused_index]);
        let started = Instant::now();
        let (paused, resumed) = std::thread::scope(|scope| {
            let pausing = scope.spawn(|| memory.pause(out));
            let resumed = memory.resume(back);
            (pausing.join(), resumed)
        });
        let seconds = started.elapsed().as_secs_f64();
        let paused = paused
            .map_err(|_| anyhow::anyhow!("the pausing thread panicked"))?
            .map_err(anyhow::Error::from)?;
        let resumed = resumed?;
        let (copy_out_gbps, copy_in_gbps) = copier.run(&buffers[paused_index])?;
        paused_index = 1 - paused_index;
        cycles.push(Cycle {
            seconds,
            pause_seconds: paused.seconds,
            resume_seconds: resumed.seconds,
            copy_out_gbps,
            copy_in_gbps,
        });
    }
    memory.resume(&tags[paused_index])?;
    for (buffer, pattern) in buffers.iter().zip(&patterns) {
        verify(buffer, pattern)?;
    }
    let steady: &[Cycle] = if cycles.len() > 1 {
        &cycles[1..]
    } else {
        &cycles
    };
    let mean = |f: fn(&Cycle) -> f64| steady.iter().map(f).sum::<f64>() / steady.len() as f64;
    let both = |c: &Cycle| 2.0 * size as f64 / c.seconds / 1e9;
    let combined_gbps = steady.iter().map(both).sum::<f64>() / steady.len() as f64;
    let base_gbps = mean(|c| c.copy_out_gbps) + mean(|c| c.copy_in_gbps);
    let mut out = std::io::stdout().lock();
    if args.json {
        let cycles_json: Vec<_> = cycles
            .iter()
            .map(|c| {
                json!({
                    "seconds": c.seconds,
                    "combined_gbps": both(c),
                    "pause_s": c.pause_seconds,
                    "resume_s": c.resume_seconds,
                })
            })
            .collect();
        let report = json!({
            "device": device.name(),
            "mode": "both-directions",
            "size_bytes_each_way": size,
            "host_pool_pin_s": pin_seconds,
            "cycles": cycles_json,
            "combined_gbps": combined_gbps,
            "baseline": {
                "kind": copier.name(),
                "copy_out_plus_in_gbps": base_gbps,
            },
            "ratio": combined_gbps / base_gbps,
            "settings": settings_json(args, opened),
        });
        writeln!(out, "{report}")?;
        return Ok(());
    }
    writeln!(
        out,
        "offload bench, both directions: device {}, {size} bytes out of one tag while {size} come into another, {} cycles (host pool pinned up front in {pin_seconds:.3} s)",
        device.name(),
        cycles.len()
    )?;
    for (i, c) in cycles.iter().enumerate() {
        writeln!(
            out,
            "cycle {i}: {:.4} s, {:.2} GB/s together (pause {:.4} s, resume {:.4} s)",
            c.seconds,
            both(c),
            c.pause_seconds,
            c.resume_seconds
        )?;
    }
    writeln!(
        out,
        "steady cycles: {combined_gbps:.2} GB/s together; baseline {} out + in, one after the other: {base_gbps:.2} GB/s; ratio {:.3}",
        copier.name(),
        combined_gbps / base_gbps
    )?;
    Ok(())
}
