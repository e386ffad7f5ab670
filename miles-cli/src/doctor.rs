//! `miles doctor`: what this machine offers to miles.

use std::io::Write;
use std::path::{Path, PathBuf};

use clap::Args;
use miles_core::DeviceError;
use miles_core::device::probe::{CudaProbe, FsStats, HostInfo, NcclProbe, Probe, probe};
use serde_json::{Value, json};

/// Arguments of `miles doctor`.
#[derive(Args, Debug)]
pub struct DoctorArgs {
    /// Also report the filesystem type and free space under this directory (or its nearest
    /// existing parent)
    #[arg(long, value_name = "DIR")]
    offload_train_disk_dir: Option<PathBuf>,
    /// Print the findings as one JSON object
    #[arg(long)]
    json: bool,
}

/// Probes the machine and prints what it found. A missing GPU, driver or library is a finding,
/// not a failure.
///
/// # Errors
/// Only when stdout is gone.
pub fn run(args: DoctorArgs) -> anyhow::Result<()> {
    let asked = args.offload_train_disk_dir.as_deref();
    let dir = asked.map(existing_ancestor);
    let found = probe(dir.as_deref());
    let text = if args.json {
        serde_json::to_string_pretty(&to_json(&found, asked))?
    } else {
        describe(&found, asked)
    };
    writeln!(std::io::stdout().lock(), "{text}")?;
    Ok(())
}

/// The directory itself when it exists, else its nearest existing parent (where it would be
/// created).
fn existing_ancestor(dir: &Path) -> PathBuf {
    dir.ancestors()
        .find(|p| p.exists())
        .unwrap_or(Path::new("."))
        .to_path_buf()
}

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

fn describe(found: &Probe, asked: Option<&Path>) -> String {
    let mut out = Vec::new();
    out.push(match &found.host {
        Ok(HostInfo {
            cpu_cores,
            memory_total_bytes,
            memory_available_bytes,
        }) => format!(
            "host: {cpu_cores} cpu cores, {} memory ({} available)",
            gib(*memory_total_bytes),
            gib(*memory_available_bytes)
        ),
        Err(error) => format!("host: cannot read cpu and memory: {error}"),
    });
    match &found.cuda {
        Ok(cuda) => describe_cuda(cuda, &mut out),
        Err(DeviceError::CudaUnavailable(why)) => out.push(format!(
            "cuda: no CUDA driver found ({why}); miles runs on the cpu device (--device cpu)"
        )),
        Err(error) => out.push(format!("cuda: the CUDA driver loads but fails: {error}")),
    }
    out.push(match &found.nccl {
        Ok(nccl @ NcclProbe { library, .. }) => {
            format!("nccl: {library}, version {}", nccl.version_string())
        }
        Err(DeviceError::CudaUnavailable(why)) => format!("nccl: not found ({why})"),
        Err(error) => format!("nccl: loads but fails: {error}"),
    });
    if let (Some((probed, stats)), Some(asked)) = (&found.disk, asked) {
        let place = if probed == asked {
            asked.display().to_string()
        } else {
            format!(
                "{} (not created yet; probed {})",
                asked.display(),
                probed.display()
            )
        };
        out.push(match stats {
            Ok(stats) => describe_disk(&place, stats),
            Err(error) => format!("disk {place}: {error}"),
        });
    }
    out.join("\n")
}

fn describe_cuda(cuda: &CudaProbe, out: &mut Vec<String>) {
    out.push(format!(
        "cuda: driver {} (CUDA {}), {} gpu(s)",
        cuda.library,
        cuda.driver_version_string(),
        cuda.gpus.len()
    ));
    for gpu in &cuda.gpus {
        out.push(format!(
            "  gpu {}: {}, {}",
            gpu.ordinal,
            gpu.name,
            gib(gpu.total_memory_bytes)
        ));
    }
}

fn describe_disk(place: &str, stats: &FsStats) -> String {
    let warning = if stats.is_tmpfs() {
        " (tmpfs is RAM, not disk: offloaded state would stay in memory)"
    } else {
        ""
    };
    format!(
        "disk {place}: {}, {} free of {}{warning}",
        stats.kind,
        gib(stats.free_bytes),
        gib(stats.total_bytes)
    )
}

/// A finding with `"available": true`, or `"available": false` and why.
fn finding<T: serde::Serialize>(result: &Result<T, DeviceError>) -> Value {
    match result {
        Ok(value) => {
            let mut value = serde_json::to_value(value).unwrap_or(Value::Null);
            if let Value::Object(fields) = &mut value {
                fields.insert("available".into(), Value::Bool(true));
            }
            value
        }
        Err(DeviceError::CudaUnavailable(why)) => json!({ "available": false, "error": why }),
        Err(error) => json!({ "available": false, "error": error.to_string() }),
    }
}

fn to_json(found: &Probe, asked: Option<&Path>) -> Value {
    let disk = found.disk.as_ref().map(|(probed, stats)| {
        let mut value = finding(stats);
        if let Value::Object(fields) = &mut value {
            fields.insert("dir".into(), json!(asked));
            fields.insert("probed".into(), json!(probed));
        }
        value
    });
    json!({
        "host": finding(&found.host),
        "cuda": finding(&found.cuda),
        "nccl": finding(&found.nccl),
        "disk": disk,
    })
}
