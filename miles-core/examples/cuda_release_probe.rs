//! What a release of device memory leaves behind in the driver, and what it costs later.
//!
//! `cargo run --release --example cuda_release_probe [-- GIB CYCLES]` on a GPU machine (default
//! 8 GiB, 8 cycles). The driver scrubs the memory a release frees on a copy engine, in the
//! background, and collects its records of scrubbed pages at its next allocation (or at a later
//! release). Two experiments, each cycle printed:
//!
//! - `release`: release, commit at once, copy into the fresh memory, as `bench offload --target
//!   none` does; with and without the device's collector thread (`CudaOptions::collect_after`).
//! - `pause`: a pause to host memory as one copy then one release (`whole`), or piece by piece,
//!   each piece released once its own copy is done (`pieces`), then a resume right after (commit
//!   and copy in): does freeing memory early move the scrub off the resume's copy?
//!
//! GB are 10^9 bytes.

#![allow(clippy::print_stdout)] // a probe's output is its figures

use std::error::Error;
use std::thread::sleep;
use std::time::{Duration, Instant};

use miles_core::device::{CudaDevice, CudaOptions};
use miles_core::{AddressRange, Device, HostBuffer};

const GIB: usize = 1 << 30;
const PAUSE: Duration = Duration::from_millis(300);

fn ms(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1e3
}

fn gbps(len: usize, start: Instant) -> f64 {
    len as f64 / start.elapsed().as_secs_f64() / 1e9
}

/// A committed range of `len` bytes with a pinned host buffer of the same size, filled.
fn setup(
    options: CudaOptions,
    len: usize,
) -> Result<(CudaDevice, AddressRange, HostBuffer), Box<dyn Error>> {
    let device = CudaDevice::open_with(0, options)?;
    let range = device.reserve(len)?;
    device.commit(range)?;
    let mut host = device.alloc_host(len)?;
    host.as_mut_slice()?
        .iter_mut()
        .enumerate()
        .for_each(|(i, byte)| *byte = (i * 31 % 251) as u8);
    device.copy_from_host(&mut host, 0, range)?.wait()?;
    Ok((device, range, host))
}

fn release_cycles(len: usize, cycles: usize) -> Result<(), Box<dyn Error>> {
    println!("release: collector cycle release_ms commit_ms fresh_in_gbps");
    for collect_after in [None, CudaOptions::default().collect_after] {
        let (device, range, mut host) = setup(
            CudaOptions {
                collect_after,
                ..CudaOptions::default()
            },
            len,
        )?;
        let collector = collect_after.is_some();
        for cycle in 0..cycles {
            sleep(PAUSE);
            let start = Instant::now();
            device.release(range)?;
            let release = ms(start);
            let start = Instant::now();
            device.commit(range)?;
            let commit = ms(start);
            let start = Instant::now();
            device.copy_from_host(&mut host, 0, range)?.wait()?;
            let fresh = gbps(len, start);
            println!(
                "release {collector:>9} {cycle:>5} {release:>10.3} {commit:>9.3} {fresh:>13.2}"
            );
        }
        device.release(range)?;
        device.unreserve(range)?;
    }
    Ok(())
}

fn pause_cycles(len: usize, cycles: usize) -> Result<(), Box<dyn Error>> {
    println!("pause: mode cycle pause_gbps resume_gbps");
    let (device, range, mut host) = setup(CudaOptions::default(), len)?;
    let piece = device.options().commit_chunk;
    for cycle in 0..2 * cycles {
        sleep(PAUSE);
        let pieces = cycle % 2 == 1;
        let start = Instant::now();
        if pieces {
            let parts: Vec<AddressRange> = (0..len.div_ceil(piece))
                .map(|index| range.slice(index * piece, piece.min(len - index * piece)))
                .collect::<Result<_, _>>()?;
            for part in &parts {
                let offset = (part.start - range.start) as usize;
                device.copy_to_host(*part, &mut host, offset)?;
            }
            for part in &parts {
                device.release(*part)?;
            }
            host.wait()?;
        } else {
            device.copy_to_host(range, &mut host, 0)?.wait()?;
            device.release(range)?;
        }
        let pause = gbps(len, start);
        let start = Instant::now();
        device.commit(range)?;
        device.copy_from_host(&mut host, 0, range)?.wait()?;
        let resume = gbps(len, start);
        let mode = if pieces { "pieces" } else { "whole" };
        println!(
            "pause {mode:>6} {:>5} {pause:>10.2} {resume:>11.2}",
            cycle / 2
        );
    }
    device.release(range)?;
    device.unreserve(range)?;
    Ok(())
}

fn main() -> Result<(), Box<dyn Error>> {
    let gib: usize = std::env::args().nth(1).map_or(Ok(8), |text| text.parse())?;
    let cycles: usize = std::env::args().nth(2).map_or(Ok(8), |text| text.parse())?;
    println!("{gib} GiB per cycle; times in ms; copies in GB/s");
    release_cycles(gib * GIB, cycles)?;
    pause_cycles(gib * GIB, cycles)?;
    Ok(())
}
