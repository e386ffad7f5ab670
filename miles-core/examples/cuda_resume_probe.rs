//! Where the time of a pause and a resume goes on the CUDA device, step by step.
//!
//! `cargo run --example cuda_resume_probe [-- GIB]` on a GPU machine. For each commit chunk size
//! it prints, per cycle of an 8 GiB (or GIB GiB) range: `cuMemGetInfo`, release, commit, a copy
//! in to freshly committed memory, the same copy again to memory already written, and a copy
//! out; so the cost of a resume beyond the link's speed can be pinned on its step. GB are 10^9
//! bytes.

#![allow(clippy::print_stdout)] // a probe's output is its figures

use std::error::Error;
use std::time::Instant;

use miles_core::device::{CudaDevice, CudaOptions};
use miles_core::{Device, Fence};

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

fn ms(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1e3
}

fn main() -> Result<(), Box<dyn Error>> {
    let gib: usize = std::env::args().nth(1).map_or(Ok(8), |text| text.parse())?;
    let len = gib * GIB;
    println!("{gib} GiB per cycle; times in ms; copies in GB/s");
    println!("chunk_mib cycle info_ms release_ms commit_ms fresh_in_gbps touched_in_gbps out_gbps");
    for chunk_mib in [1024, 8192, 64] {
        let device = CudaDevice::open_with(
            0,
            CudaOptions {
                commit_chunk: chunk_mib * MIB,
                ..CudaOptions::default()
            },
        )?;
        let range = device.reserve(len)?;
        device.commit(range)?;
        let mut host = device.alloc_host(len)?;
        host.as_mut_slice()?
            .iter_mut()
            .enumerate()
            .for_each(|(i, byte)| *byte = (i * 31 % 251) as u8);
        device.copy_from_host(&mut host, 0, range)?.wait()?;
        for cycle in 0..4 {
            let start = Instant::now();
            device.memory_info()?;
            let info = ms(start);
            let start = Instant::now();
            device.release(range)?;
            let release = ms(start);
            let start = Instant::now();
            device.commit(range)?;
            let commit = ms(start);
            let copy_in = |host: &mut miles_core::HostBuffer| -> Result<f64, Box<dyn Error>> {
                let start = Instant::now();
                device.copy_from_host(host, 0, range)?.wait()?;
                Ok(len as f64 / start.elapsed().as_secs_f64() / 1e9)
            };
            let fresh = copy_in(&mut host)?;
            let touched = copy_in(&mut host)?;
            let start = Instant::now();
            let fence: Fence = device.copy_to_host(range, &mut host, 0)?;
            fence.wait()?;
            let out = len as f64 / start.elapsed().as_secs_f64() / 1e9;
            println!(
                "{chunk_mib:>9} {cycle:>5} {info:>7.3} {release:>10.3} {commit:>9.3} {fresh:>13.2} {touched:>15.2} {out:>8.2}"
            );
        }
        device.unreserve(range)?;
    }
    Ok(())
}
