//! Wrappers of the forward kernels (`kernels/forward.cu`): shapes checked, then queued.

use half::bf16;

use super::{eight_wide, elementwise, elementwise_words, per_row, rows_of};
use crate::device::DeviceError;
use crate::device::{Gpu, GpuSlice, LaunchConfig};

/// The [`FedIds::feed`] entry of a row that keeps its id (`FEED_HOST` in the kernel).
pub const FEED_HOST: u32 = u32::MAX;

/// Where an embedding's ids may come from besides its `ids`: row `i` takes `picked[feed[i]]`
/// unless `feed[i]` is [`FEED_HOST`] (a decode step's tokens drawn on the device by the step
/// before it, which the host never read).
#[derive(Clone, Copy, Debug)]
pub struct FedIds {
    /// One entry a row: an index into `picked`, or [`FEED_HOST`].
    pub feed: GpuSlice<u32>,
    /// The tokens drawn before.
    pub picked: GpuSlice<u32>,
}

/// Threads per block of the per-row kernels (norms).
const ROW_THREADS: u32 = 256;

/// Most threads of a `residual_rmsnorm` block (`RESIDUAL_NORM_THREADS` in the kernel).
const RESIDUAL_NORM_THREADS: usize = 512;

fn as_i64(n: usize) -> i64 {
    n as i64
}

pub(super) fn as_i32(what: &'static str, n: usize) -> Result<i32, DeviceError> {
    i32::try_from(n).map_err(|_| DeviceError::ShapeMismatch {
        what,
        expected: i32::MAX as usize,
        actual: n,
    })
}

impl Gpu {
    /// `out = bf16(x)`.
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`] for lengths that differ; the launch's error.
    pub fn cast_to_bf16(&self, out: GpuSlice<bf16>, x: GpuSlice<f32>) -> Result<(), DeviceError> {
        out.expect_len("cast output", x.len())?;
        let n = as_i64(x.len());
        self.launch(
            "cast_f32_to_bf16",
            elementwise(x.len()),
            &[&out.address(), &x.address(), &n],
        )
    }

    /// `out = f32(x)`.
    ///
    /// # Errors
    /// As [`Gpu::cast_to_bf16`].
    pub fn cast_to_f32(&self, out: GpuSlice<f32>, x: GpuSlice<bf16>) -> Result<(), DeviceError> {
        out.expect_len("cast output", x.len())?;
        let n = as_i64(x.len());
        self.launch(
            "cast_bf16_to_f32",
            elementwise(x.len()),
            &[&out.address(), &x.address(), &n],
        )
    }

    /// `out += x`, in fp32.
    ///
    /// # Errors
    /// As [`Gpu::cast_to_bf16`].
    pub fn add_f32(&self, out: GpuSlice<f32>, x: GpuSlice<f32>) -> Result<(), DeviceError> {
        out.expect_len("addend", x.len())?;
        let n = as_i64(x.len());
        self.launch(
            "add_f32",
            elementwise(x.len()),
            &[&out.address(), &x.address(), &n],
        )
    }

    /// `out (N, C)` = rows `ids (N)` of `table (V, C)`. Ids are trusted to be below `V`
    /// (the model checks tokens before it uploads them).
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`]; the launch's error.
    pub fn embedding_forward(
        &self,
        out: GpuSlice<bf16>,
        ids: GpuSlice<u32>,
        table: GpuSlice<bf16>,
        c: usize,
    ) -> Result<(), DeviceError> {
        self.embedding_rows(out, ids, None, table, c, None)
    }

    /// [`embedding_forward`](Self::embedding_forward) where some ids were drawn on the device
    /// by the pass before ([`FedIds`]), fused with the model's first norm: `normed (N, C)` gets
    /// [`rmsnorm_forward`](Self::rmsnorm_forward) of the rows with weight `w (C)`, the same
    /// bits. Feed entries are trusted to lie within `picked`, and the tokens there below `V`
    /// (the engine builds the one, the sampler draws the other).
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`]; the launch's error.
    pub fn embedding_norm_fed(
        &self,
        (out, normed): (GpuSlice<bf16>, GpuSlice<bf16>),
        ids: GpuSlice<u32>,
        fed: FedIds,
        table: GpuSlice<bf16>,
        (w, eps): (GpuSlice<bf16>, f32),
    ) -> Result<(), DeviceError> {
        fed.feed.expect_len("embedding feed", ids.len())?;
        normed.expect_len("embedding's norm output", out.len())?;
        self.embedding_rows(out, ids, Some(fed), table, w.len(), Some((normed, w, eps)))
    }

    fn embedding_rows(
        &self,
        out: GpuSlice<bf16>,
        ids: GpuSlice<u32>,
        fed: Option<FedIds>,
        table: GpuSlice<bf16>,
        c: usize,
        norm: Option<(GpuSlice<bf16>, GpuSlice<bf16>, f32)>,
    ) -> Result<(), DeviceError> {
        out.expect_len("embedding output", ids.len() * c)?;
        if c == 0 || !table.len().is_multiple_of(c) {
            return Err(DeviceError::ShapeMismatch {
                what: "embedding table",
                expected: c,
                actual: table.len(),
            });
        }
        if ids.is_empty() {
            return Ok(());
        }
        let c32 = as_i32("embedding width", c)?;
        let (feed, picked) = fed.map_or((0, 0), |f| (f.feed.address(), f.picked.address()));
        let (normed, w, eps) = norm.map_or((0, 0, 0.0f32), |(o, w, eps)| {
            (o.address(), w.address(), eps)
        });
        self.launch(
            "embedding_forward",
            per_row(ids.len(), ROW_THREADS),
            &[
                &out.address(),
                &ids.address(),
                &feed,
                &picked,
                &table.address(),
                &c32,
                &normed,
                &w,
                &eps,
            ],
        )
    }

    /// RMSNorm of each row of `x (N, C)` with weight `w (C)` into `out`; `rstd (N)` gets each
    /// row's reciprocal RMS when given (training keeps it for the backward pass). `out` may be
    /// `x` itself (normalised in place). With `w` of one head's `D` channels and `x` of `(N,
    /// heads, D)`, it is the per-head norm of queries or keys (`N * heads` rows).
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`]; the launch's error.
    pub fn rmsnorm_forward(
        &self,
        out: GpuSlice<bf16>,
        rstd: Option<GpuSlice<f32>>,
        x: GpuSlice<bf16>,
        w: GpuSlice<bf16>,
        eps: f32,
    ) -> Result<(), DeviceError> {
        let c = w.len();
        out.expect_len("rmsnorm output", x.len())?;
        let rows = rows_of("rmsnorm input", x.len(), c)?;
        if let Some(r) = rstd {
            r.expect_len("rmsnorm rstd", rows)?;
        }
        if rows == 0 {
            return Ok(());
        }
        let rstd_addr = rstd.map_or(0u64, |r| r.address());
        let c32 = as_i32("rmsnorm width", c)?;
        self.launch(
            "rmsnorm_forward",
            per_row(rows, ROW_THREADS),
            &[
                &out.address(),
                &rstd_addr,
                &x.address(),
                &w.address(),
                &c32,
                &eps,
            ],
        )
    }

    /// `x (N, C) += partials[0] + .. + partials[parts - 1]` (fp32, `(parts, N, C)`: a product
    /// split along its inner dimension, [`crate::device::Gemm::split_k`]), summed in order and
    /// rounded to bf16 once, then [`Gpu::rmsnorm_forward`] of the new `x` with weight `w (C)`
    /// into `out`: the residual add of a split product fused with the norm after it. `parts`
    /// is `partials`' length over `x`'s: pass exactly the partials to add.
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`]; the launch's error.
    pub fn residual_rmsnorm(
        &self,
        out: GpuSlice<bf16>,
        x: GpuSlice<bf16>,
        partials: GpuSlice<f32>,
        w: GpuSlice<bf16>,
        eps: f32,
    ) -> Result<(), DeviceError> {
        let c = w.len();
        out.expect_len("residual rmsnorm output", x.len())?;
        let rows = rows_of("residual rmsnorm input", x.len(), c)?;
        if rows == 0 {
            return Ok(());
        }
        if partials.is_empty() || !partials.len().is_multiple_of(x.len()) {
            return Err(DeviceError::ShapeMismatch {
                what: "residual rmsnorm partials (a whole number of inputs)",
                expected: x.len(),
                actual: partials.len(),
            });
        }
        let parts = as_i32("residual rmsnorm partials", partials.len() / x.len())?;
        let (rows64, c32) = (as_i64(rows), as_i32("rmsnorm width", c)?);
        // A thread for each 16-byte word of a row, up to the kernel's bound (it loops over
        // wider rows).
        let threads = (c / 8)
            .next_multiple_of(32)
            .clamp(ROW_THREADS as usize, RESIDUAL_NORM_THREADS) as u32;
        self.launch(
            "residual_rmsnorm",
            per_row(rows, threads),
            &[
                &out.address(),
                &x.address(),
                &partials.address(),
                &parts,
                &rows64,
                &w.address(),
                &c32,
                &eps,
            ],
        )
    }

    /// `x (N, C) += bias (C)` on every row (the q, k and v biases).
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`] when `x` is not whole rows of the bias's length; the
    /// launch's error.
    pub fn bias_add(&self, x: GpuSlice<bf16>, bias: GpuSlice<bf16>) -> Result<(), DeviceError> {
        let c = bias.len();
        rows_of("bias input", x.len(), c)?;
        let (n, c32) = (as_i64(x.len()), as_i32("bias width", c)?);
        self.launch(
            "bias_add",
            elementwise(x.len()),
            &[&x.address(), &bias.address(), &n, &c32],
        )
    }

    /// Rotates `x (N, heads, D)` in place, row `i` at `positions[i]`, with the rotary tables
    /// `cos`, `sin` `(P, D/2)` (see `ops::RopeTable`). Positions are trusted to be below `P`.
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`]; the launch's error.
    pub fn rope_forward(
        &self,
        x: GpuSlice<bf16>,
        positions: GpuSlice<u32>,
        cos: GpuSlice<f32>,
        sin: GpuSlice<f32>,
        heads: usize,
        head_dim: usize,
    ) -> Result<(), DeviceError> {
        self.rope("rope_forward", x, positions, [cos, sin], heads, head_dim)
    }

    /// Launches `kernel` (`rope_forward` or `rope_backward`) over `x (N, heads, D)` in place,
    /// a row a block.
    pub(super) fn rope(
        &self,
        kernel: &'static str,
        x: GpuSlice<bf16>,
        positions: GpuSlice<u32>,
        [cos, sin]: [GpuSlice<f32>; 2],
        heads: usize,
        head_dim: usize,
    ) -> Result<(), DeviceError> {
        let n = positions.len();
        x.expect_len(kernel, n * heads * head_dim)?;
        sin.expect_len("rope sin table", cos.len())?;
        let (n64, h32, d32) = (
            as_i64(n),
            as_i32("rope heads", heads)?,
            as_i32("rope head dim", head_dim)?,
        );
        self.launch(
            kernel,
            per_row(n, ROW_THREADS),
            &[
                &x.address(),
                &positions.address(),
                &cos.address(),
                &sin.address(),
                &n64,
                &h32,
                &d32,
            ],
        )
    }

    /// `out = silu(gate) * up`, elementwise.
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`]; the launch's error.
    pub fn swiglu_forward(
        &self,
        out: GpuSlice<bf16>,
        gate: GpuSlice<bf16>,
        up: GpuSlice<bf16>,
    ) -> Result<(), DeviceError> {
        out.expect_len("swiglu output", gate.len())?;
        up.expect_len("swiglu up", gate.len())?;
        let n = as_i64(gate.len());
        let wide = eight_wide(gate.len(), &[out.address(), gate.address(), up.address()]);
        self.launch(
            "swiglu_forward",
            elementwise_words(gate.len(), wide),
            &[
                &out.address(),
                &gate.address(),
                &up.address(),
                &n,
                &i32::from(wide),
            ],
        )
    }

    /// `out (N, F) = silu(gate) * up` from the fused product `gate_up (N, 2F)`, whose rows hold
    /// the gate's `F` values, then the up's: as [`Gpu::swiglu_forward`] on the two halves.
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`]; the launch's error.
    pub fn swiglu_rows(
        &self,
        out: GpuSlice<bf16>,
        gate_up: GpuSlice<bf16>,
        f: usize,
    ) -> Result<(), DeviceError> {
        gate_up.expect_len("fused gate and up rows", 2 * out.len())?;
        if f == 0 || !out.len().is_multiple_of(f) {
            return Err(DeviceError::ShapeMismatch {
                what: "swiglu rows",
                expected: f,
                actual: out.len(),
            });
        }
        let rows = out.len() / f;
        let (n, width) = (as_i64(rows), as_i32("swiglu width", f)?);
        // 8 columns a thread where the rows are whole 16-byte words.
        let wide = f.is_multiple_of(8) && (out.address() | gate_up.address()).is_multiple_of(16);
        let step = if wide { 8 } else { 1 };
        let config = LaunchConfig {
            grid_dim: (
                f.div_ceil(256 * step).min(65535) as u32,
                rows.clamp(1, 65535) as u32,
                1,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch(
            "swiglu_rows",
            config,
            &[
                &out.address(),
                &gate_up.address(),
                &n,
                &width,
                &i32::from(wide),
            ],
        )
    }

    /// `x += y`, elementwise.
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`]; the launch's error.
    pub fn residual_add(&self, x: GpuSlice<bf16>, y: GpuSlice<bf16>) -> Result<(), DeviceError> {
        y.expect_len("residual addend", x.len())?;
        let n = as_i64(x.len());
        let wide = eight_wide(x.len(), &[x.address(), y.address()]);
        self.launch(
            "residual_add",
            elementwise_words(x.len(), wide),
            &[&x.address(), &y.address(), &n, &i32::from(wide)],
        )
    }
}
