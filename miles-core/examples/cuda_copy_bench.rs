//! Device-level benchmark of the CUDA device, to tune its chunk sizes and stream counts.
//!
//! `cargo run --release --example cuda_copy_bench [-- --gib 8 --reps 3]` on a GPU machine. For
//! `--gib` GiB it prints, each the median of `--reps` runs and next to a baseline measured in the
//! same run:
//! - commit and release time for several commit chunk sizes (the cost of a pause and resume
//!   without backup), with how far free device memory rose on release;
//! - pinning time of host buffers, with `cuMemHostAlloc` and with threaded faulting plus
//!   `cuMemHostRegister` (what a first cycle pays unless the pool is pinned up front);
//! - GB/s of our chunked multi-stream copies for each copy chunk size and stream count, next to a
//!   plain single `cuMemcpyDtoH` / `cuMemcpyHtoD` of the same pinned bytes;
//! - both directions at once (one range out while another comes in), ours and one unchunked
//!   async copy per direction on its own stream.
//!
//! GB are 10^9 bytes. The copies are verified bit-exact once.

#![allow(clippy::print_stdout)] // a benchmark's output is its figures

use std::error::Error;
use std::time::Instant;

use miles_core::device::{CudaDevice, CudaOptions};
use miles_core::{AddressRange, Device, HostBuffer};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

struct Args {
    gib: usize,
    reps: usize,
}

fn parse_args() -> Result<Args, Box<dyn Error>> {
    let mut args = Args { gib: 8, reps: 3 };
    let mut words = std::env::args().skip(1);
    while let Some(word) = words.next() {
        let value: usize = words
            .next()
            .ok_or_else(|| format!("{word} needs a value"))?
            .parse()?;
        match word.as_str() {
            "--gib" => args.gib = value,
            "--reps" => args.reps = value.max(1),
            other => return Err(format!("unknown flag {other}; use --gib N --reps N").into()),
        }
    }
    Ok(args)
}

fn median(mut seconds: Vec<f64>) -> f64 {
    seconds.sort_by(f64::total_cmp);
    seconds[seconds.len() / 2]
}

fn gbps(bytes: usize, seconds: f64) -> f64 {
    bytes as f64 / seconds / 1e9
}

/// Seconds of `run`, median over `reps`.
fn timed<F>(reps: usize, mut run: F) -> Result<f64, Box<dyn Error>>
where
    F: FnMut() -> Result<(), Box<dyn Error>>,
{
    let mut seconds = Vec::with_capacity(reps);
    for _ in 0..reps {
        let start = Instant::now();
        run()?;
        seconds.push(start.elapsed().as_secs_f64());
    }
    Ok(median(seconds))
}

fn fill_random(buffer: &mut HostBuffer, seed: u64) -> Result<(), Box<dyn Error>> {
    buffer
        .as_mut_slice()?
        .par_chunks_mut(64 * MIB)
        .enumerate()
        .for_each(|(index, piece)| {
            ChaCha8Rng::seed_from_u64(seed ^ (index as u64).wrapping_mul(0x9e37_79b9))
                .fill_bytes(piece)
        });
    Ok(())
}

fn committed(device: &CudaDevice, len: usize) -> Result<AddressRange, Box<dyn Error>> {
    let range = device.reserve(len)?;
    device.commit(range)?;
    Ok(range)
}

fn bench_commit(args: &Args, len: usize) -> Result<(), Box<dyn Error>> {
    let cycles = args.reps.max(7);
    println!(
        "\n## commit / release of {} GiB (pause/resume without backup), median of {cycles} cycles",
        args.gib
    );
    println!("commit_chunk_mib  handles  commit_ms  release_ms  freed_on_release_pct");
    for chunk_mib in [64, 256, 1024, 2048, 8192, 1024] {
        let options = CudaOptions {
            commit_chunk: chunk_mib * MIB,
            ..CudaOptions::default()
        };
        let device = CudaDevice::open_with(0, options)?;
        let range = device.reserve(len)?;
        let (mut commits, mut releases, mut freed) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..cycles {
            let start = Instant::now();
            device.commit(range)?;
            commits.push(start.elapsed().as_secs_f64());
            let before = device.memory_info()?.free;
            let start = Instant::now();
            device.release(range)?;
            releases.push(start.elapsed().as_secs_f64());
            let after = device.memory_info()?.free;
            freed.push(after.saturating_sub(before) as f64 / len as f64 * 100.0);
        }
        device.unreserve(range)?;
        let handles = len.div_ceil(device.options().commit_chunk);
        println!(
            "{chunk_mib:>16}  {handles:>7}  {:>9.3}  {:>10.3}  {:>20.2}",
            median(commits) * 1e3,
            median(releases) * 1e3,
            median(freed)
        );
    }
    Ok(())
}

/// Pinning time of `len` bytes for each way to pin, in the order given (the first also pays for
/// the machine's fresh memory).
fn bench_pinning(len: usize) -> Result<(), Box<dyn Error>> {
    println!(
        "\n## pinning {} GiB of host memory (each buffer freed before the next)",
        len / GIB
    );
    println!("pin_threads  seconds  gbps");
    for pin_threads in [0, 16, 0, 16] {
        let device = CudaDevice::open_with(
            0,
            CudaOptions {
                pin_threads,
                ..CudaOptions::default()
            },
        )?;
        let start = Instant::now();
        let buffer = device.alloc_host(len)?;
        let seconds = start.elapsed().as_secs_f64();
        drop(buffer);
        println!(
            "{pin_threads:>11}  {seconds:>7.3}  {:>4.1}",
            gbps(len, seconds)
        );
    }
    Ok(())
}

struct Buffers {
    source: HostBuffer,
    sink: HostBuffer,
    second_source: HostBuffer,
}

fn pinned_buffers(device: &CudaDevice, len: usize) -> Result<Buffers, Box<dyn Error>> {
    let mut source = device.alloc_host(len)?;
    let sink = device.alloc_host(len)?;
    let mut second_source = device.alloc_host(len)?;
    fill_random(&mut source, 1)?;
    fill_random(&mut second_source, 2)?;
    Ok(Buffers {
        source,
        sink,
        second_source,
    })
}

fn bench_copies(args: &Args, len: usize, buffers: &mut Buffers) -> Result<(), Box<dyn Error>> {
    println!(
        "\n## copies of {} GiB; baseline: one plain pinned cuMemcpy of the same bytes, timed \
         alternately with ours",
        args.gib
    );
    println!(
        "copy_chunk_mib  streams  out_gbps  plain_out_gbps  out_ratio  in_gbps  plain_in_gbps  in_ratio"
    );
    for chunk_mib in [16, 64, 128] {
        for streams in [1, 2, 4] {
            let options = CudaOptions {
                copy_chunk: chunk_mib * MIB,
                streams_per_direction: streams,
                ..CudaOptions::default()
            };
            let device = CudaDevice::open_with(0, options)?;
            let range = committed(&device, len)?;
            device
                .copy_from_host(&mut buffers.source, 0, range)?
                .wait()?;
            let (mut ours_in, mut plain_in, mut ours_out, mut plain_out) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for _ in 0..args.reps {
                plain_in.push(timed(1, || {
                    Ok(device.plain_copy_from_host(&mut buffers.source, 0, range)?)
                })?);
                ours_in.push(timed(1, || {
                    Ok(device
                        .copy_from_host(&mut buffers.source, 0, range)?
                        .wait()?)
                })?);
                plain_out.push(timed(1, || {
                    Ok(device.plain_copy_to_host(range, &mut buffers.sink, 0)?)
                })?);
                ours_out.push(timed(1, || {
                    Ok(device.copy_to_host(range, &mut buffers.sink, 0)?.wait()?)
                })?);
            }
            let (ours_in, plain_in) = (median(ours_in), median(plain_in));
            let (ours_out, plain_out) = (median(ours_out), median(plain_out));
            println!(
                "{chunk_mib:>14}  {streams:>7}  {:>8.1}  {:>14.1}  {:>9.3}  {:>7.1}  {:>13.1}  {:>8.3}",
                gbps(len, ours_out),
                gbps(len, plain_out),
                plain_out / ours_out,
                gbps(len, ours_in),
                gbps(len, plain_in),
                plain_in / ours_in
            );
        }
    }
    let same = buffers.sink.as_slice()? == buffers.source.as_slice()?;
    println!("round trip of the last configuration bit-exact: {same}");
    if !same {
        return Err("the copied bytes differ from the source".into());
    }
    Ok(())
}

/// A first cycle with nothing pinned yet: pin a buffer with the default options, copy a range
/// out into it, and time both together.
fn bench_first_cycle(len: usize) -> Result<(), Box<dyn Error>> {
    let device = CudaDevice::open(0)?;
    let range = committed(&device, len)?;
    let start = Instant::now();
    let mut backup = device.alloc_host(len)?;
    let pinned = start.elapsed().as_secs_f64();
    device.copy_to_host(range, &mut backup, 0)?.wait()?;
    let total = start.elapsed().as_secs_f64();
    println!(
        "\n## first cycle, {} GiB out into a buffer pinned on the spot (default options {:?})",
        len / GIB,
        device.options()
    );
    println!(
        "pin {:.3} s + copy {:.3} s = {:.3} s: {:.1} GB/s",
        pinned,
        total - pinned,
        total,
        gbps(len, total)
    );
    Ok(())
}

fn bench_both_ways(args: &Args, len: usize, buffers: &mut Buffers) -> Result<(), Box<dyn Error>> {
    let device = CudaDevice::open(0)?;
    let outgoing = committed(&device, len)?;
    let incoming = committed(&device, len)?;
    device
        .copy_from_host(&mut buffers.source, 0, outgoing)?
        .wait()?;
    let Buffers {
        sink,
        second_source,
        ..
    } = buffers;
    let ours = timed(args.reps, || {
        std::thread::scope(|scope| {
            let going = scope.spawn(|| device.copy_to_host(outgoing, sink, 0));
            let coming = scope.spawn(|| device.copy_from_host(second_source, 0, incoming));
            for handle in [going, coming] {
                handle
                    .join()
                    .map_err(|_| "a copy thread panicked")??
                    .wait()?;
            }
            Ok(())
        })
    })?;
    // Baseline: one unchunked async copy per direction, each on its own stream (plain
    // synchronous cuMemcpy calls would serialise on the legacy default stream).
    let whole = CudaDevice::open_with(
        0,
        CudaOptions {
            copy_chunk: usize::MAX,
            streams_per_direction: 1,
            ..CudaOptions::default()
        },
    )?;
    let plain_outgoing = committed(&whole, len)?;
    let plain_incoming = committed(&whole, len)?;
    let plain = timed(args.reps, || {
        std::thread::scope(|scope| {
            let going = scope.spawn(|| whole.copy_to_host(plain_outgoing, sink, 0));
            let coming = scope.spawn(|| whole.copy_from_host(second_source, 0, plain_incoming));
            for handle in [going, coming] {
                handle
                    .join()
                    .map_err(|_| "a copy thread panicked")??
                    .wait()?;
            }
            Ok(())
        })
    })?;
    println!(
        "\n## both directions at once, {} GiB out while {} GiB come in (options {:?})",
        args.gib,
        args.gib,
        device.options()
    );
    println!(
        "ours {:.1} GB/s together; one whole cuMemcpyAsync per direction on two streams {:.1} GB/s; ratio {:.3}",
        gbps(2 * len, ours),
        gbps(2 * len, plain),
        plain / ours
    );
    Ok(())
}

fn main() -> Result<(), Box<dyn Error>> {
    let args = parse_args()?;
    let len = args.gib * GIB;
    let device = CudaDevice::open(0)?;
    println!(
        "# cuda_copy_bench on {}, granularity {} bytes, {} GiB, median of {} runs",
        device.name(),
        device.granularity(),
        args.gib,
        args.reps
    );
    bench_pinning(len)?;
    let mut buffers = pinned_buffers(&device, len)?;
    drop(device);
    bench_commit(&args, len)?;
    bench_copies(&args, len, &mut buffers)?;
    bench_both_ways(&args, len, &mut buffers)?;
    drop(buffers);
    bench_first_cycle(len)?;
    Ok(())
}
