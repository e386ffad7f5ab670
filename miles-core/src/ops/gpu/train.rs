//! Wrappers of the training kernels (`kernels/train.cu`): backward passes, the fused
//! cross-entropy, and AdamW on fp32 master weights. Training's attention is `flash.rs`.

use half::{bf16, f16};

use super::elementwise::as_i32;
use super::{eight_wide, elementwise, elementwise_words, per_row, rows_of};
use crate::device::DeviceError;
use crate::device::{Gpu, GpuSlice, LaunchConfig};
use crate::ops::{AdamWConfig, AdamWScalars};

/// The kernels of `kernels/train.cu`.
pub(super) const KERNELS: [&str; 12] = [
    "rmsnorm_backward",
    "column_partials",
    "column_reduce",
    "rope_backward",
    "swiglu_backward",
    "embedding_backward",
    "crossentropy",
    "square_partials",
    "sum_partials",
    "adamw_update",
    "adamw_update_bf16_moments",
    "adamw_update_f16_moments",
];

/// Threads per block of the per-row kernels. Their wrappers return before launching when there
/// is no row: `per_row` launches at least one block, which would touch row 0 of empty tensors.
const ROW_THREADS: u32 = 256;

/// Chunks of rows a column sum ([`Gpu::bias_backward`], [`Gpu::rmsnorm_backward`]) splits
/// its rows into, each summed by its own blocks into a row of partial sums: the scratch those
/// take is `COLUMN_SUM_CHUNKS` times the columns.
pub const COLUMN_SUM_CHUNKS: usize = 64;

/// Blocks of `square_partials`, fixed so that a sum of squares adds in the same order every run:
/// the scratch [`Gpu::sum_of_squares`] takes. At most the threads of one block of `sum_partials`.
pub const SQUARE_PARTIALS: usize = 1024;

/// Rows a block of `column_partials` strides over at once (`COLUMN_ROWS` of `train.cu`).
const COLUMN_ROWS: u32 = 8;

/// Columns a block of `column_partials` sums (a warp's lanes).
const COLUMN_LANES: usize = 32;

/// AdamW's scalars for one step, worked out on the host as `ops::adamw_update` does.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    /// `lr / (1 - beta1^t)`.
    pub step_size: f32,
    /// `sqrt(1 - beta2^t)`.
    pub bias2_sqrt: f32,
    /// `1 - lr * weight_decay`.
    pub decay: f32,
    /// `beta1`.
    pub beta1: f32,
    /// `beta2`.
    pub beta2: f32,
    /// `eps`.
    pub eps: f32,
    /// The clipping factor applied to every gradient.
    pub grad_scale: f32,
}

impl AdamWStep {
    /// The step `step` (counting from 1) of `cfg` with every gradient scaled by `grad_scale`.
    pub fn new(cfg: &AdamWConfig, step: u64, grad_scale: f32) -> AdamWStep {
        let s = AdamWScalars::at(cfg, step);
        AdamWStep {
            step_size: s.step_size,
            bias2_sqrt: s.bias2_sqrt,
            decay: s.decay,
            beta1: cfg.beta1,
            beta2: cfg.beta2,
            eps: cfg.eps,
            grad_scale,
        }
    }
}

/// AdamW's two moments `(m, v)` on the device, in their storage type.
#[derive(Clone, Copy, Debug)]
pub enum GpuMoments {
    /// fp32 moments (resident, or streamed in fp32).
    Fp32(GpuSlice<f32>, GpuSlice<f32>),
    /// bf16 moments (streamed in bf16).
    Bf16(GpuSlice<bf16>, GpuSlice<bf16>),
    /// IEEE half moments (streamed in fp16).
    Fp16(GpuSlice<f16>, GpuSlice<f16>),
}

impl GpuMoments {
    /// The kernel for this storage type and the moments' addresses, once both hold `n`
    /// elements.
    fn check(&self, n: usize) -> Result<(&'static str, u64, u64), DeviceError> {
        let (kernel, (m, m_len), (v, v_len)) = match self {
            GpuMoments::Fp32(m, v) => (
                "adamw_update",
                (m.address(), m.len()),
                (v.address(), v.len()),
            ),
            GpuMoments::Bf16(m, v) => (
                "adamw_update_bf16_moments",
                (m.address(), m.len()),
                (v.address(), v.len()),
            ),
            GpuMoments::Fp16(m, v) => (
                "adamw_update_f16_moments",
                (m.address(), m.len()),
                (v.address(), v.len()),
            ),
        };
        for (what, len) in [("adamw m", m_len), ("adamw v", v_len)] {
            if len != n {
                return Err(DeviceError::ShapeMismatch {
                    what,
                    expected: n,
                    actual: len,
                });
            }
        }
        Ok((kernel, m, v))
    }
}

/// How a gradient kernel meets what its output holds: [`Add`](Self::Add) to it (`+=`, a pass
/// after the first of a step, or a unit shared by several tensors' kernels), or
/// [`Overwrite`](Self::Overwrite) it (`=`, the first pass of a step, so that nothing has to
/// zero the gradients first).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GradWrite {
    /// `=`: what the output held does not count.
    Overwrite,
    /// `+=`.
    Add,
}

/// The operands of a column sum: `a (rows, cols)`, optionally times `b (rows, cols)`
/// elementwise and each row times `scale (rows)`.
struct ColumnTerms {
    a: GpuSlice<bf16>,
    b: Option<GpuSlice<bf16>>,
    scale: Option<GpuSlice<f32>>,
}

impl Gpu {
    /// Backward of [`Gpu::rmsnorm_forward`] over rows of `w.len()` channels (a layer's norm, or
    /// the per-head norm of queries or keys over rows of one head's `D` channels): `dx += d(x)`
    /// (bf16) and `dw += d(w)` (fp32; `=` with [`GradWrite::Overwrite`]) from `dout`, the
    /// forward's input `x`, weight `w` and saved `rstd`. `dw` is summed over the rows in a fixed
    /// order, without atomics, so that it repeats bit for bit; `partials` is fp32 scratch of at
    /// least [`COLUMN_SUM_CHUNKS`]` * w.len()` elements.
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`]; the launch's error.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_backward(
        &self,
        dx: GpuSlice<bf16>,
        dw: GpuSlice<f32>,
        dout: GpuSlice<bf16>,
        x: GpuSlice<bf16>,
        w: GpuSlice<bf16>,
        rstd: GpuSlice<f32>,
        partials: GpuSlice<f32>,
        write: GradWrite,
    ) -> Result<(), DeviceError> {
        let c = w.len();
        dw.expect_len("rmsnorm dw", c)?;
        let rows = rows_of("rmsnorm input", x.len(), c)?;
        dx.expect_len("rmsnorm dx", x.len())?;
        dout.expect_len("rmsnorm dout", x.len())?;
        rstd.expect_len("rmsnorm rstd", rows)?;
        let c32 = as_i32("rmsnorm width", c)?;
        if rows > 0 {
            self.launch(
                "rmsnorm_backward",
                per_row(rows, ROW_THREADS),
                &[
                    &dx.address(),
                    &dout.address(),
                    &x.address(),
                    &w.address(),
                    &rstd.address(),
                    &c32,
                ],
            )?;
        }
        let terms = ColumnTerms {
            a: dout,
            b: Some(x),
            scale: Some(rstd),
        };
        self.column_sums(dw, terms, rows, partials, write)
    }

    /// Backward of [`Gpu::bias_add`]: `dbias (C) +=` the sum of the rows of `dout (N, C)`
    /// (fp32; `=` with [`GradWrite::Overwrite`]), in a fixed order without atomics, so that it
    /// repeats bit for bit. `partials` is fp32 scratch of at least [`COLUMN_SUM_CHUNKS`]` * C`
    /// elements.
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`]; the launch's error.
    pub fn bias_backward(
        &self,
        dbias: GpuSlice<f32>,
        dout: GpuSlice<bf16>,
        partials: GpuSlice<f32>,
        write: GradWrite,
    ) -> Result<(), DeviceError> {
        let rows = rows_of("bias dout", dout.len(), dbias.len())?;
        let terms = ColumnTerms {
            a: dout,
            b: None,
            scale: None,
        };
        self.column_sums(dbias, terms, rows, partials, write)
    }

    /// `out (cols) +=` (or `=`, as `write` says) the column sums of `terms` over `rows` rows:
    /// [`COLUMN_SUM_CHUNKS`] chunks of rows summed into `partials`, then the chunks added in
    /// order.
    fn column_sums(
        &self,
        out: GpuSlice<f32>,
        terms: ColumnTerms,
        rows: usize,
        partials: GpuSlice<f32>,
        write: GradWrite,
    ) -> Result<(), DeviceError> {
        let cols = out.len();
        let n = rows * cols;
        terms.a.expect_len("column sum input", n)?;
        if let Some(b) = terms.b {
            b.expect_len("column sum factor", n)?;
        }
        if let Some(scale) = terms.scale {
            scale.expect_len("column sum row scale", rows)?;
        }
        if rows == 0 || cols == 0 {
            // A sum over no rows is zero.
            return match write {
                GradWrite::Overwrite => self.zero(out),
                GradWrite::Add => Ok(()),
            };
        }
        let chunks = COLUMN_SUM_CHUNKS.min(rows);
        if partials.len() < chunks * cols {
            return Err(DeviceError::ShapeMismatch {
                what: "column sum partials (COLUMN_SUM_CHUNKS x columns)",
                expected: chunks * cols,
                actual: partials.len(),
            });
        }
        let (rows64, per_chunk) = (rows as i64, rows.div_ceil(chunks) as i64);
        let (cols32, chunks32) = (as_i32("column sum columns", cols)?, chunks as i32);
        let addr = |s: Option<GpuSlice<f32>>| s.map_or(0u64, |s| s.address());
        let b_addr = terms.b.map_or(0u64, |b| b.address());
        self.launch(
            "column_partials",
            LaunchConfig {
                grid_dim: (cols.div_ceil(COLUMN_LANES) as u32, chunks32 as u32, 1),
                block_dim: (COLUMN_LANES as u32, COLUMN_ROWS, 1),
                shared_mem_bytes: 0,
            },
            &[
                &partials.address(),
                &terms.a.address(),
                &b_addr,
                &addr(terms.scale),
                &rows64,
                &cols32,
                &per_chunk,
            ],
        )?;
        self.launch(
            "column_reduce",
            elementwise(cols),
            &[
                &out.address(),
                &partials.address(),
                &chunks32,
                &cols32,
                &i32::from(write == GradWrite::Add),
            ],
        )
    }

    /// Backward of [`Gpu::rope_forward`]: rotates `dx (N, heads, D)` back, in place.
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`]; the launch's error.
    pub fn rope_backward(
        &self,
        dx: GpuSlice<bf16>,
        positions: GpuSlice<u32>,
        cos: GpuSlice<f32>,
        sin: GpuSlice<f32>,
        heads: usize,
        head_dim: usize,
    ) -> Result<(), DeviceError> {
        self.rope("rope_backward", dx, positions, [cos, sin], heads, head_dim)
    }

    /// Backward of [`Gpu::swiglu_forward`], in place: `gate` and `up` are overwritten with
    /// their gradients from `dout`, and `dout` with `swiglu(gate, up)` recomputed (the same bits
    /// as [`Gpu::swiglu_forward`]), so the backward pass needs no kept swiglu output and no
    /// gradient buffers of its own.
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`]; the launch's error.
    pub fn swiglu_backward(
        &self,
        gate: GpuSlice<bf16>,
        up: GpuSlice<bf16>,
        dout: GpuSlice<bf16>,
    ) -> Result<(), DeviceError> {
        let n = gate.len();
        up.expect_len("swiglu up", n)?;
        dout.expect_len("swiglu dout", n)?;
        let n64 = n as i64;
        let addresses = [gate, up, dout].map(|s| s.address());
        let wide = eight_wide(n, &addresses);
        self.launch(
            "swiglu_backward",
            elementwise_words(n, wide),
            &[
                &addresses[0],
                &addresses[1],
                &addresses[2],
                &n64,
                &i32::from(wide),
            ],
        )
    }

    /// Backward of [`Gpu::embedding_forward`]: `dtable[ids[i]] += dout[i]` for every row `i`,
    /// the rows of each id summed in row order without atomics, so that it repeats bit for bit.
    /// `order` and `starts` are [`embedding_rows`](crate::ops::embedding_rows)`(ids)` on the
    /// device.
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`]; the launch's error.
    pub fn embedding_backward(
        &self,
        dtable: GpuSlice<f32>,
        dout: GpuSlice<bf16>,
        ids: GpuSlice<u32>,
        order: GpuSlice<u32>,
        starts: GpuSlice<u32>,
        c: usize,
    ) -> Result<(), DeviceError> {
        dout.expect_len("embedding dout", ids.len() * c)?;
        order.expect_len("embedding row order", ids.len())?;
        starts.expect_len("embedding id starts", ids.len() + 1)?;
        rows_of("embedding dtable", dtable.len(), c)?;
        let c32 = as_i32("embedding width", c)?;
        if ids.is_empty() {
            return Ok(());
        }
        let column_blocks = c.div_ceil(ROW_THREADS as usize);
        self.launch(
            "embedding_backward",
            LaunchConfig {
                grid_dim: (
                    ids.len() as u32,
                    as_i32("embedding width", column_blocks)? as u32,
                    1,
                ),
                block_dim: (ROW_THREADS, 1, 1),
                shared_mem_bytes: 0,
            },
            &[
                &dtable.address(),
                &dout.address(),
                &ids.address(),
                &order.address(),
                &starts.address(),
                &c32,
            ],
        )
    }

    /// Token cross-entropy over fp32 `logits (N, V)`: `logprobs[i] = log p(targets[i])`, and
    /// when `dlogits` is given it is overwritten with `weights[i] / normaliser * (softmax -
    /// onehot(targets[i]))` (bf16). The loss is `-sum(weights * logprobs) / normaliser`, summed
    /// by the caller from the downloaded log-probs.
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`]; the launch's error.
    pub fn crossentropy(
        &self,
        logprobs: GpuSlice<f32>,
        dlogits: Option<GpuSlice<bf16>>,
        logits: GpuSlice<f32>,
        targets: GpuSlice<u32>,
        weights: GpuSlice<f32>,
        normaliser: f32,
    ) -> Result<(), DeviceError> {
        let n = targets.len();
        let v = rows_of("crossentropy logits", logits.len(), n.max(1))?;
        logprobs.expect_len("crossentropy logprobs", n)?;
        weights.expect_len("crossentropy weights", n)?;
        if let Some(d) = dlogits {
            d.expect_len("crossentropy dlogits", logits.len())?;
        }
        let d_addr = dlogits.map_or(0u64, |d| d.address());
        let v32 = as_i32("vocabulary", v)?;
        if n == 0 {
            return Ok(());
        }
        self.launch(
            "crossentropy",
            per_row(n, ROW_THREADS),
            &[
                &logprobs.address(),
                &d_addr,
                &logits.address(),
                &targets.address(),
                &weights.address(),
                &v32,
                &normaliser,
            ],
        )
    }

    /// `acc[0] += sum(x^2)` (fp32), in a fixed order without atomics, so that it repeats bit for
    /// bit: [`SQUARE_PARTIALS`] block sums into `partials`, then their sum.
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`]; the launch's error.
    pub fn sum_of_squares(
        &self,
        acc: GpuSlice<f32>,
        x: GpuSlice<f32>,
        partials: GpuSlice<f32>,
    ) -> Result<(), DeviceError> {
        acc.expect_len("sum of squares accumulator", 1)?;
        if partials.len() < SQUARE_PARTIALS {
            return Err(DeviceError::ShapeMismatch {
                what: "sum of squares partials (SQUARE_PARTIALS)",
                expected: SQUARE_PARTIALS,
                actual: partials.len(),
            });
        }
        let n = x.len() as i64;
        let count = SQUARE_PARTIALS as i32;
        self.launch(
            "square_partials",
            LaunchConfig {
                grid_dim: (SQUARE_PARTIALS as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            },
            &[&partials.address(), &x.address(), &n],
        )?;
        self.launch(
            "sum_partials",
            LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (SQUARE_PARTIALS as u32, 1, 1),
                shared_mem_bytes: 0,
            },
            &[&acc.address(), &partials.address(), &count],
        )
    }

    /// One AdamW step as `ops::adamw_update` takes it, on fp32 `master` weights and the
    /// `moments` from fp32 `grads`; `params` gets the updated weights rounded to bf16. Moments
    /// stored in a half type are widened, updated in fp32 and rounded back to nearest even.
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`]; the launch's error.
    pub fn adamw_update(
        &self,
        master: GpuSlice<f32>,
        params: GpuSlice<bf16>,
        moments: GpuMoments,
        grads: GpuSlice<f32>,
        s: AdamWStep,
    ) -> Result<(), DeviceError> {
        let n = master.len();
        params.expect_len("adamw params", n)?;
        grads.expect_len("adamw grads", n)?;
        let (kernel, m, v) = moments.check(n)?;
        // The fp32 kernel takes four elements a thread (and strides over the grid where its
        // arrays are not aligned for that): a thread an element would leave 3/4 of the blocks
        // idle.
        let threads = match moments {
            GpuMoments::Fp32(..) => n.div_ceil(4),
            GpuMoments::Bf16(..) | GpuMoments::Fp16(..) => n,
        };
        let n64 = n as i64;
        self.launch(
            kernel,
            elementwise(threads),
            &[
                &master.address(),
                &params.address(),
                &m,
                &v,
                &grads.address(),
                &n64,
                &s.step_size,
                &s.bias2_sqrt,
                &s.decay,
                &s.beta1,
                &s.beta2,
                &s.eps,
                &s.grad_scale,
            ],
        )
    }
}
