//! Products of a decode step's few rows with whole weights (`kernels/skinny.cu`): `y = x W^T`
//! for an HF weight `W (out, inp)` and at most [`SKINNY_MAX_ROWS`] rows of `x`, in blocks of 128
//! output columns and, where those leave SMs idle, slices of the inner dimension whose fp32
//! partial sums a second kernel adds in a fixed order ([`Gpu::split_sum`],
//! [`Gpu::split_sum_rmsnorm`]). cuBLAS's own tiles leave most of an H200 idle on the narrow
//! products of a decode step (`bench/RESULTS.md`, round 25).

use half::bf16;

use super::elementwise::{ROW_THREADS, as_i32};
use super::{eight_wide, elementwise, per_row};
use crate::device::{DeviceError, Gpu, GpuSlice, LaunchConfig};

/// The kernels of `kernels/skinny.cu`.
pub(super) const KERNELS: [&str; 3] = ["skinny_gemm", "split_sum", "split_sum_rmsnorm"];

/// The most rows a skinny product takes (`SK_BM`).
pub const SKINNY_MAX_ROWS: usize = 128;

/// The most slices [`Skinny::plan`] cuts the inner dimension into.
pub const SKINNY_MAX_SPLITS: usize = 8;

/// Output columns of a block (`SK_BN`).
const BLOCK_COLUMNS: usize = 128;

/// Inner-dimension elements of a tile (`SK_BK`).
const TILE_K: usize = 64;

/// The fewest tiles a slice of the inner dimension gets, so its copies can run ahead.
const MIN_SLICE_TILES: usize = 4;

/// A block's threads (`SK_THREADS`).
const THREADS: u32 = 256;

/// A block's dynamic shared memory (`SK_SHARED`): 3 stages of two 128 x 64 tiles.
const SHARED_BYTES: u32 = (3 * (128 * 64 + 128 * 64) * 2) as u32;

/// The shape of a skinny product and how many slices of the inner dimension it takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Skinny {
    /// Rows of `x` and `y`.
    pub rows: usize,
    /// Output columns (the weight's rows).
    pub out: usize,
    /// Inner dimension (the weight's columns).
    pub inp: usize,
    /// Slices of the inner dimension; 1 writes the product itself.
    pub splits: usize,
    /// Inner-dimension tiles of each slice (the last may hold fewer).
    tiles_per_split: usize,
}

impl Skinny {
    /// The product of `rows` rows with a weight `(out, inp)`, sliced so that its blocks cover
    /// about `multiprocessors` SMs, each slice at least 4 tiles of 64, at most
    /// [`SKINNY_MAX_SPLITS`] slices; `None` for a product wide enough to cover half the SMs
    /// without slices (cuBLAS's tiles do that faster) and where the kernel
    /// does not take the shape (more than [`SKINNY_MAX_ROWS`] rows, no rows, an inner dimension
    /// not a multiple of 8, an odd number of columns).
    pub fn plan(rows: usize, out: usize, inp: usize, multiprocessors: usize) -> Option<Skinny> {
        let blocks = out.div_ceil(BLOCK_COLUMNS);
        if 2 * blocks >= multiprocessors {
            // Wide enough for cuBLAS's own tiles to cover the GPU, and faster there.
            return None;
        }
        let wanted = multiprocessors.div_ceil(blocks.max(1));
        let most = (inp.div_ceil(TILE_K) / MIN_SLICE_TILES).clamp(1, SKINNY_MAX_SPLITS);
        Skinny::with_splits(rows, out, inp, wanted.clamp(1, most))
    }

    /// The most fp32 partial sums a [`plan`](Self::plan) of this shape takes, whatever the
    /// GPU (0 where the kernel does not take it).
    pub fn partial_bound(rows: usize, out: usize, inp: usize) -> usize {
        Skinny::with_splits(rows, out, inp, SKINNY_MAX_SPLITS).map_or(0, |p| p.partial_len())
    }

    /// As [`plan`](Self::plan) with about `splits` slices (fewer where the inner dimension has
    /// fewer tiles).
    pub fn with_splits(rows: usize, out: usize, inp: usize, splits: usize) -> Option<Skinny> {
        let fits = (1..=SKINNY_MAX_ROWS).contains(&rows)
            && out > 0
            && out.is_multiple_of(2)
            && inp > 0
            && inp.is_multiple_of(8)
            && splits > 0;
        if !fits {
            return None;
        }
        let tiles = inp.div_ceil(TILE_K);
        let tiles_per_split = tiles.div_ceil(splits.min(tiles));
        Some(Skinny {
            rows,
            out,
            inp,
            splits: tiles.div_ceil(tiles_per_split),
            tiles_per_split,
        })
    }

    /// fp32 elements of the partial sums of a sliced product (`splits * rows * out`).
    pub fn partial_len(&self) -> usize {
        self.splits * self.rows * self.out
    }

    fn launch(&self) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (
                self.out.div_ceil(BLOCK_COLUMNS) as u32,
                self.splits as u32,
                1,
            ),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: SHARED_BYTES,
        }
    }

    fn check(&self, x: GpuSlice<bf16>, w: GpuSlice<bf16>) -> Result<[i32; 4], DeviceError> {
        x.expect_len("skinny product input", self.rows * self.inp)?;
        w.expect_len("skinny product weight", self.out * self.inp)?;
        if !x.address().is_multiple_of(16) || !w.address().is_multiple_of(16) {
            return Err(DeviceError::ShapeMismatch {
                what: "skinny product operands (16-byte aligned)",
                expected: 16,
                actual: (x.address() | w.address()) as usize % 16,
            });
        }
        Ok([
            as_i32("skinny product rows", self.rows)?,
            as_i32("skinny product columns", self.out)?,
            as_i32("skinny product inner dimension", self.inp)?,
            as_i32("skinny product slice", self.tiles_per_split)?,
        ])
    }
}

/// Where a skinny product's result goes.
#[derive(Clone, Copy, Debug)]
pub enum SkinnyOut {
    /// bf16 `(rows, out)`, added to what it holds where `accumulate`; one slice only.
    Bf16 {
        /// The product.
        y: GpuSlice<bf16>,
        /// Whether to add to `y` (a residual stream) rather than overwrite it.
        accumulate: bool,
    },
    /// fp32 `(rows, out)` (logits); one slice only.
    F32(GpuSlice<f32>),
    /// The slices' fp32 partial sums, [`Skinny::partial_len`] elements, for
    /// [`Gpu::split_sum`] or [`Gpu::split_sum_rmsnorm`].
    Partials(GpuSlice<f32>),
}

impl Gpu {
    /// Queues the skinny product `p` of bf16 `x (rows, inp)` and the weight `w (out, inp)`
    /// into `y` (see [`SkinnyOut`]).
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`] for operands of the wrong length or alignment, or a
    /// whole output for a sliced product; the launch's error.
    pub fn skinny_gemm(
        &self,
        p: Skinny,
        y: SkinnyOut,
        x: GpuSlice<bf16>,
        w: GpuSlice<bf16>,
    ) -> Result<(), DeviceError> {
        let [rows, out, inp, slice] = p.check(x, w)?;
        let whole = |len: usize| {
            if p.splits == 1 {
                Ok(())
            } else {
                Err(DeviceError::ShapeMismatch {
                    what: "skinny product slices (a whole output takes one)",
                    expected: 1,
                    actual: len,
                })
            }
        };
        let (yf, yb, accumulate) = match y {
            SkinnyOut::Bf16 { y, accumulate } => {
                whole(p.splits)?;
                y.expect_len("skinny product output", p.rows * p.out)?;
                (0u64, y.address(), i32::from(accumulate))
            }
            SkinnyOut::F32(y) => {
                whole(p.splits)?;
                y.expect_len("skinny product output", p.rows * p.out)?;
                (y.address(), 0u64, 0)
            }
            SkinnyOut::Partials(part) => {
                part.expect_len("skinny product partial sums", p.partial_len())?;
                (part.address(), 0u64, 0)
            }
        };
        self.launch(
            "skinny_gemm",
            p.launch(),
            &[
                &yf,
                &yb,
                &x.address(),
                &w.address(),
                &rows,
                &out,
                &inp,
                &slice,
                &accumulate,
            ],
        )
    }

    /// `y = bf16(sum of the slices of part (splits, y.len()) + y where accumulate)`, the
    /// slices added in order.
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`] for `part` of the wrong length; the launch's error.
    pub fn split_sum(
        &self,
        y: GpuSlice<bf16>,
        part: GpuSlice<f32>,
        splits: usize,
        accumulate: bool,
    ) -> Result<(), DeviceError> {
        part.expect_len("split partial sums", splits * y.len())?;
        if y.is_empty() {
            return Ok(());
        }
        let splits = as_i32("splits", splits)?;
        self.launch(
            "split_sum",
            elementwise(y.len()),
            &[
                &y.address(),
                &part.address(),
                &splits,
                &(y.len() as i64),
                &i32::from(accumulate),
            ],
        )
    }

    /// The residual add of a sliced product and the norm after it: `x (rows, C) +=` the sum of
    /// the slices of `part (splits, rows, C)` (rounded to bf16), then `ln = rmsnorm(x) * w` for
    /// `w (C)`, bit for bit as [`Gpu::rmsnorm_forward`] would give it.
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`] for lengths that differ, a width not a multiple of 8 or
    /// rows not 16-byte aligned; the launch's error.
    pub fn split_sum_rmsnorm(
        &self,
        x: GpuSlice<bf16>,
        ln: GpuSlice<bf16>,
        part: GpuSlice<f32>,
        w: GpuSlice<bf16>,
        splits: usize,
        eps: f32,
    ) -> Result<(), DeviceError> {
        let c = w.len();
        ln.expect_len("split rmsnorm output", x.len())?;
        part.expect_len("split partial sums", splits * x.len())?;
        if c == 0 || !x.len().is_multiple_of(c) {
            return Err(DeviceError::ShapeMismatch {
                what: "split rmsnorm input (whole rows of the norm's width)",
                expected: c,
                actual: x.len(),
            });
        }
        let addresses = [x.address(), ln.address(), part.address(), w.address()];
        if !eight_wide(c, &addresses) {
            return Err(DeviceError::ShapeMismatch {
                what: "split rmsnorm width (a multiple of 8, rows 16-byte aligned)",
                expected: 8,
                actual: c,
            });
        }
        let rows = x.len() / c;
        if rows == 0 {
            return Ok(());
        }
        self.launch(
            "split_sum_rmsnorm",
            // `rmsnorm_forward`'s threads, so its sums run in the same order.
            per_row(rows, ROW_THREADS),
            &[
                &x.address(),
                &ln.address(),
                &part.address(),
                &w.address(),
                &as_i32("splits", splits)?,
                &as_i32("split rmsnorm width", c)?,
                &eps,
            ],
        )
    }
}
