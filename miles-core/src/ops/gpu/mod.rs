//! GPU kernels of the transformer: the CUDA C++ sources (`kernels/`, compiled at start-up for
//! `compute_90`) and their typed launch wrappers on [`Gpu`], each checking shapes before it
//! queues work. Matrix products are [`Gpu::gemm`] (cuBLAS).
//!
//! The raw launch, the compute stream and the libraries live in [`crate::device`]; everything
//! here is safe code.

#[cfg(test)]
#[allow(clippy::panic, clippy::print_stderr)]
mod bias_norm_tests;
mod elementwise;
mod flash;
#[cfg(test)]
#[allow(clippy::panic, clippy::print_stderr)]
mod flash_tests;
mod paged;
#[cfg(test)]
#[allow(clippy::panic, clippy::print_stderr)]
mod paged_tests;
mod product;
mod sampling;
#[cfg(any(test, feature = "testing"))]
#[allow(clippy::panic, clippy::print_stderr)]
// With the `testing` feature alone, `model::gpu::testing` uses only the GPU and its lock.
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) mod testing;
#[cfg(test)]
#[allow(clippy::panic, clippy::print_stderr)]
mod tests;
mod train;
#[cfg(test)]
#[allow(clippy::panic, clippy::print_stderr)]
mod train_tests;

use std::sync::Arc;

pub use elementwise::{FEED_HOST, FedIds};
pub use flash::FLASH_MAX_HEAD_DIM;
pub use paged::{PAGED_MAX_HEAD_DIM, PagedCache, PagedTokens, QkvHeads, TokenPlaces};
pub use product::{DECODE_PRODUCT_MAX_ROWS, DECODE_PRODUCT_SWIGLU_COLUMNS, ProductOut};
pub use sampling::{DRAW_WORDS, RULE_WORDS, SampleRule};
pub use train::{AdamWStep, COLUMN_SUM_CHUNKS, GpuMoments, GradWrite, SQUARE_PARTIALS};

use crate::device::{CudaDevice, DeviceError, Gpu, KernelProgram, LaunchConfig};

/// Every kernel of the transformer, compiled as one program: the shared header first.
pub const PROGRAM: KernelProgram = KernelProgram {
    name: "miles_kernels",
    sources: &[
        include_str!("kernels/common.cuh"),
        include_str!("kernels/forward.cu"),
        include_str!("kernels/train.cu"),
        include_str!("kernels/flash.cu"),
        include_str!("kernels/paged.cu"),
        include_str!("kernels/sampling.cu"),
    ],
    kernels: &[
        &FORWARD_KERNELS,
        &train::KERNELS,
        &flash::KERNELS,
        &paged::KERNELS,
        &sampling::KERNELS,
    ],
    hopper_only: false,
};

/// The kernels only Hopper runs (warpgroup MMA, the tensor memory accelerator): the decode
/// product. Absent on other GPUs, where the engine's products stay cuBLAS's.
pub const HOPPER_PROGRAM: KernelProgram = KernelProgram {
    name: "miles_hopper_kernels",
    sources: &[
        include_str!("kernels/common.cuh"),
        include_str!("kernels/product.cu"),
    ],
    kernels: &[&product::KERNELS],
    hopper_only: true,
};

/// The kernels of `kernels/forward.cu`.
const FORWARD_KERNELS: [&str; 11] = [
    "cast_f32_to_bf16",
    "add_f32",
    "cast_bf16_to_f32",
    "embedding_forward",
    "rmsnorm_forward",
    "residual_rmsnorm",
    "bias_add",
    "rope_forward",
    "swiglu_forward",
    "swiglu_rows",
    "residual_add",
];

/// GPU compute on `device` with the transformer's kernels ([`PROGRAM`], and on Hopper
/// [`HOPPER_PROGRAM`]).
///
/// # Errors
/// As [`Gpu::new`].
pub fn open_gpu(device: Arc<CudaDevice>) -> Result<Gpu, DeviceError> {
    Gpu::new(device, &[&PROGRAM, &HOPPER_PROGRAM])
}

/// A launch of one thread per element over `n` elements, in blocks of 256, at most 65535 *
/// 8 blocks (kernels loop over what remains).
fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 65535 * 8) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Whether `n` bf16 values at each of `addresses` can be taken 8 at a time (16-byte words): `n`
/// a multiple of 8 and every address 16-byte aligned.
fn eight_wide(n: usize, addresses: &[u64]) -> bool {
    n.is_multiple_of(8) && addresses.iter().all(|a| a.is_multiple_of(16))
}

/// [`elementwise`] over `n` values, or over their 16-byte words where `wide`.
fn elementwise_words(n: usize, wide: bool) -> LaunchConfig {
    elementwise(if wide { n / 8 } else { n })
}

/// The rows of `width` that `len` elements make, or [`DeviceError::ShapeMismatch`] naming
/// `what` where they are not whole (or `width` is 0).
fn rows_of(what: &'static str, len: usize, width: usize) -> Result<usize, DeviceError> {
    if width == 0 || !len.is_multiple_of(width) {
        return Err(DeviceError::ShapeMismatch {
            what,
            expected: width,
            actual: len,
        });
    }
    Ok(len / width)
}

/// A launch of one block of `threads` per row over `rows` rows.
fn per_row(rows: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.max(1) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}
