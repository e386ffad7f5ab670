//! Baselines the benches measure in the same run: a single-threaded memcpy and an O_DIRECT
//! write and read of the same bytes (offload benches), and the Python scripts of the PyTorch
//! baselines (train and rollout benches).

use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use miles_core::device::OpenedDevice;
use miles_core::{Buffer, CudaDevice, Device, HostBuffer};

/// Runs the baseline script `script` with `python` and `args` and returns the JSON object its
/// last line of output holds; `what` names the baseline in errors.
///
/// # Errors
/// The script cannot start, fails (with the last line of its stderr), or prints no JSON.
pub fn python_json(
    python: &str,
    script: &Path,
    args: &[String],
    what: &str,
) -> anyhow::Result<serde_json::Value> {
    let output = Command::new(python)
        .arg(script)
        .args(args)
        .output()
        .with_context(|| {
            format!(
                "cannot run {python} {}; give --python, or --no-baseline",
                script.display()
            )
        })?;
    if !output.status.success() {
        bail!(
            "the {what} baseline failed: {}",
            String::from_utf8_lossy(&output.stderr)
                .lines()
                .last()
                .unwrap_or("no output")
        );
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(line).with_context(|| format!("the {what} baseline printed {line:?}"))
}

/// A seeded, incompressible byte pattern of `len` bytes.
pub fn pattern_block(len: usize) -> Vec<u8> {
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 24) as u8
        })
        .collect()
}

/// Plain single-threaded memcpy of the bench's bytes between two resident buffers.
pub struct MemcpyBaseline {
    src: Vec<u8>,
    dst: Vec<u8>,
}

impl MemcpyBaseline {
    /// Source and destination of `size` bytes.
    pub fn new(size: usize) -> MemcpyBaseline {
        MemcpyBaseline {
            src: pattern_block(size),
            dst: vec![1u8; size],
        }
    }

    /// One copy, in GB/s.
    pub fn run(&mut self) -> f64 {
        let started = Instant::now();
        self.dst.copy_from_slice(&self.src);
        std::hint::black_box(&self.dst);
        self.src.len() as f64 / started.elapsed().as_secs_f64() / 1e9
    }
}

/// The plain copy a pause or resume is measured against, on the bench's own bytes.
pub enum CopyBaseline {
    /// CPU device: one single-threaded memcpy between two resident buffers, each way.
    Memcpy(MemcpyBaseline),
    /// CUDA device: one synchronous pinned `cuMemcpyDtoH` of the tag's bytes into a pinned
    /// buffer of the same size, then one `cuMemcpyHtoD` of them back (the same bytes, so the
    /// tag is unchanged).
    Pinned {
        device: Arc<CudaDevice>,
        host: HostBuffer,
    },
}

impl CopyBaseline {
    pub fn new(opened: &OpenedDevice, size: usize) -> anyhow::Result<CopyBaseline> {
        Ok(match opened {
            OpenedDevice::Cpu(_) => CopyBaseline::Memcpy(MemcpyBaseline::new(size)),
            OpenedDevice::Cuda(device) => CopyBaseline::Pinned {
                host: device.alloc_host(size)?,
                device: Arc::clone(device),
            },
        })
    }

    pub fn name(&self) -> &'static str {
        match self {
            CopyBaseline::Memcpy(_) => "memcpy",
            CopyBaseline::Pinned { .. } => "plain pinned cuMemcpy",
        }
    }

    /// One copy each way of `buffer`'s bytes (active), in GB/s.
    pub fn run(&mut self, buffer: &Buffer) -> anyhow::Result<(f64, f64)> {
        Ok((self.out(buffer)?, self.back(buffer)?))
    }

    /// One copy of `buffer`'s bytes (active) out of the device, in GB/s.
    pub fn out(&mut self, buffer: &Buffer) -> anyhow::Result<f64> {
        let started = Instant::now();
        match self {
            CopyBaseline::Memcpy(memcpy) => return Ok(memcpy.run()),
            CopyBaseline::Pinned { device, host } => {
                device.plain_copy_to_host(buffer.range(), host, 0)?;
            }
        }
        Ok(buffer.len() as f64 / started.elapsed().as_secs_f64() / 1e9)
    }

    /// One copy back into `buffer` of what [`out`](Self::out) copied out of it (so its bytes
    /// stay unchanged), in GB/s.
    pub fn back(&mut self, buffer: &Buffer) -> anyhow::Result<f64> {
        let started = Instant::now();
        match self {
            CopyBaseline::Memcpy(memcpy) => return Ok(memcpy.run()),
            CopyBaseline::Pinned { device, host } => {
                device.plain_copy_from_host(host, 0, buffer.range())?;
            }
        }
        Ok(buffer.len() as f64 / started.elapsed().as_secs_f64() / 1e9)
    }
}

/// Plain O_DIRECT write (then fsync) and read of the bench's bytes, in blocks of the chunk
/// size, in the same directory.
pub struct DirectIoBaseline {
    path: PathBuf,
    buffer: HostBuffer,
}

impl DirectIoBaseline {
    /// A staging buffer of `block` bytes from `device` and a file in `dir`.
    ///
    /// # Errors
    /// When the host buffer cannot be allocated.
    pub fn new(device: &dyn Device, dir: &Path, block: usize) -> anyhow::Result<DirectIoBaseline> {
        let mut buffer = device.alloc_host(block)?;
        buffer
            .as_mut_slice()?
            .copy_from_slice(&pattern_block(block));
        let path = dir.join(format!("miles-bench-baseline-{}.bin", std::process::id()));
        Ok(DirectIoBaseline { path, buffer })
    }

    /// Write then read `size` bytes; GB/s of each. The file is removed afterwards.
    ///
    /// # Errors
    /// When the file cannot be opened with O_DIRECT, written or read.
    pub fn run(&mut self, size: usize) -> anyhow::Result<(f64, f64)> {
        let path = &self.path;
        let block = self.buffer.len();
        let padded = size.next_multiple_of(4096);
        let file = OpenOptions::new()
            .write(true)
            .read(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .with_context(|| format!("cannot open {} with O_DIRECT", path.display()))?;
        let started = Instant::now();
        let mut offset = 0;
        while offset < padded {
            let len = block.min(padded - offset);
            file.write_all_at(&self.buffer.as_slice()?[..len], offset as u64)?;
            offset += len;
        }
        file.sync_all()?;
        let write_gbps = size as f64 / started.elapsed().as_secs_f64() / 1e9;
        let started = Instant::now();
        let mut offset = 0;
        while offset < padded {
            let len = block.min(padded - offset);
            file.read_exact_at(&mut self.buffer.as_mut_slice()?[..len], offset as u64)?;
            offset += len;
        }
        let read_gbps = size as f64 / started.elapsed().as_secs_f64() / 1e9;
        std::fs::remove_file(path).with_context(|| format!("cannot remove {}", path.display()))?;
        Ok((write_gbps, read_gbps))
    }
}
