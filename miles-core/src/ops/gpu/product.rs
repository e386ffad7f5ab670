//! Products of the decode step on Hopper's warpgroup MMA (`kernels/product.cu`): `y = x w^T`
//! for at most [`DECODE_PRODUCT_MAX_ROWS`] rows of `x`, each block a slice of `y`'s columns
//! (and of `k`) streamed through shared memory by the tensor memory accelerator; the MLP's
//! gate/up product may end in its SwiGLU.

use half::bf16;

use crate::device::{DeviceError, Gpu, GpuSlice, LaunchConfig, TILE_COLUMNS};

pub(super) const KERNELS: [&str; 3] = [
    "decode_product_64",
    "decode_product_128",
    "decode_product_swiglu",
];

/// Most rows of `x` a decode product takes (the kernel's two warpgroups of 64).
pub const DECODE_PRODUCT_MAX_ROWS: usize = 128;

/// Bytes of a block's ring of stages (`PRODUCT_RING_BYTES` in the kernel).
const RING_BYTES: u32 = 192 * 1024;

/// Rows of `w` a block of [`ProductOut::Swiglu`] takes: 64 of gate and the same 64 of up.
pub const DECODE_PRODUCT_SWIGLU_COLUMNS: usize = 128;

/// Threads of a block: a warpgroup fetching, two multiplying.
const THREADS: u32 = 384;

/// Where a decode product writes.
#[derive(Clone, Copy, Debug)]
pub enum ProductOut {
    /// `y (m, n)` rounded to bf16.
    Bf16(GpuSlice<bf16>),
    /// `y` split along `k` into `len / (m n)` slices: their fp32 partial products
    /// `(slices, m, n)`, to be summed in order by the kernel after (`residual_rmsnorm`).
    Partials(GpuSlice<f32>),
    /// Where `w`'s rows are gate's then up's `(2 f, k)`: `silu(g) u`, `(m, f)` in bf16, of `g`
    /// and `u` rounded to bf16 (`y` in bf16, then [`Gpu::swiglu_rows`]). Blocks of 128
    /// columns: 64 of gate and the same 64 of up.
    Swiglu(GpuSlice<bf16>),
}

impl Gpu {
    /// Whether [`Gpu::decode_product`] runs here: on Hopper only.
    pub fn has_decode_product(&self) -> bool {
        KERNELS.iter().all(|name| self.has_kernel(name))
    }

    /// `out = x w^T` for `x (m, k)`, `m` from 1 to [`DECODE_PRODUCT_MAX_ROWS`], and `w (n,
    /// k)`, each block `block_columns` (64 or 128; 128 for [`ProductOut::Swiglu`]) columns of
    /// `w`'s rows.
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`] naming what does not fit: `k` not whole tiles of
    /// [`TILE_COLUMNS`] (nor the slices whole tiles), `x` or `w` not whole rows of `k`, too many
    /// rows, `n` not whole blocks, an output of another length, an operand not 16-byte
    /// aligned; the launch's error.
    pub fn decode_product(
        &self,
        out: ProductOut,
        x: GpuSlice<bf16>,
        w: GpuSlice<bf16>,
        k: usize,
        block_columns: usize,
    ) -> Result<(), DeviceError> {
        let shape = |what, expected, actual| DeviceError::ShapeMismatch {
            what,
            expected,
            actual,
        };
        if k == 0 || !k.is_multiple_of(TILE_COLUMNS) {
            return Err(shape(
                "decode product k (whole tiles of 64)",
                TILE_COLUMNS,
                k,
            ));
        }
        let m = super::rows_of("decode product x (rows of k)", x.len(), k)?;
        let n = super::rows_of("decode product w (rows of k)", w.len(), k)?;
        if !(1..=DECODE_PRODUCT_MAX_ROWS).contains(&m) {
            return Err(shape("decode product rows", DECODE_PRODUCT_MAX_ROWS, m));
        }
        let kernel = match (out, block_columns) {
            (ProductOut::Swiglu(_), DECODE_PRODUCT_SWIGLU_COLUMNS) => "decode_product_swiglu",
            (ProductOut::Swiglu(_), other) => {
                return Err(shape(
                    "decode product swiglu block columns",
                    DECODE_PRODUCT_SWIGLU_COLUMNS,
                    other,
                ));
            }
            (_, 64) => "decode_product_64",
            (_, 128) => "decode_product_128",
            (_, other) => {
                return Err(shape(
                    "decode product block columns (64 or 128)",
                    128,
                    other,
                ));
            }
        };
        if !n.is_multiple_of(block_columns) {
            return Err(shape(
                "decode product columns (whole blocks)",
                block_columns,
                n,
            ));
        }
        let (address, slices, out_f32) = match out {
            ProductOut::Bf16(y) => {
                y.expect_len("decode product output", m * n)?;
                (y.address(), 1, 0i32)
            }
            ProductOut::Partials(y) => {
                let slices =
                    super::rows_of("decode product partials (whole slices)", y.len(), m * n)?;
                (y.address(), slices, 1)
            }
            ProductOut::Swiglu(y) => {
                y.expect_len("decode product swiglu output", m * n / 2)?;
                (y.address(), 1, 0)
            }
        };
        let tiles = k / TILE_COLUMNS;
        if slices == 0 || !tiles.is_multiple_of(slices) {
            return Err(shape(
                "decode product slices (dividing k's tiles)",
                tiles,
                slices,
            ));
        }
        if !address.is_multiple_of(16) {
            return Err(shape(
                "decode product output address (16-byte aligned)",
                16,
                (address % 16) as usize,
            ));
        }
        // A swiglu block fetches its gate and up rows as two boxes of half its columns, and
        // writes half as many columns as `w` has rows.
        let (box_rows, columns) = match out {
            ProductOut::Swiglu(_) => (block_columns / 2, n / 2),
            _ => (block_columns, n),
        };
        let w_map = self.tensor_map(w, k, box_rows as u32)?;
        let x_map = self.tensor_map(x, k, DECODE_PRODUCT_MAX_ROWS as u32)?;
        let (m32, n32) = (m as i32, columns as i32);
        let k_tiles = (tiles / slices) as i32;
        self.launch(
            kernel,
            LaunchConfig {
                grid_dim: ((n / block_columns) as u32, slices as u32, 1),
                block_dim: (THREADS, 1, 1),
                // The ring, aligned to 1024 bytes in the kernel, and its barriers.
                shared_mem_bytes: RING_BYTES + 1024 + 1024,
            },
            &[&w_map, &x_map, &address, &out_f32, &m32, &n32, &k_tiles],
        )
    }
}
