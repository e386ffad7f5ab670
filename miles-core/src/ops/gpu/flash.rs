//! Wrappers of the training attention (`kernels/flash.cu`): causal attention over the model's
//! own rows (q `(B, T, H, D)`, k and v `(B, T, K, D)`) in tiles of 64 positions on the tensor
//! cores, keeping per row only the log-sum-exp of its scores for the backward pass, which
//! recomputes the probabilities. No `(T, T)` matrix is written and no gradient is summed with
//! an atomic (a block sums its key tile's k and v gradients over the query group's heads in
//! registers, or over a piece of them into fp32 partials summed in order where the grid would
//! leave multiprocessors idle), so a backward pass repeats bit for bit.

use half::bf16;

use super::elementwise;
use super::elementwise::as_i32;
use crate::device::{DeviceError, Gpu, GpuSlice, LaunchConfig};
use crate::ops::AttentionShape;

/// The head dims the kernels are built for, each an instance padding smaller dims with zeros.
const PADDED: [usize; 4] = [16, 32, 64, 128];

/// The largest head dim the training attention takes.
pub const FLASH_MAX_HEAD_DIM: usize = PADDED[PADDED.len() - 1];

/// The kernels of `kernels/flash.cu`: forward, dq, dkv for each of [`PADDED`], then the sum
/// of the dkv kernel's partials.
pub(super) const KERNELS: [&str; 13] = [
    "flash_forward_16",
    "flash_backward_dq_16",
    "flash_backward_dkv_16",
    "flash_forward_32",
    "flash_backward_dq_32",
    "flash_backward_dkv_32",
    "flash_forward_64",
    "flash_backward_dq_64",
    "flash_backward_dkv_64",
    "flash_forward_128",
    "flash_backward_dq_128",
    "flash_backward_dkv_128",
    "flash_dkv_reduce",
];

/// Positions of a tile (`FA_TILE`).
const TILE: usize = 64;

/// A block's threads: 4 warps (`FA_THREADS`).
const THREADS: u32 = 128;

/// The checked shape of one call: the kernels' instance, their integer arguments and the
/// scores' scale.
struct Checked {
    /// The instance's index in [`PADDED`].
    instance: usize,
    ints: [i32; 4],
    scale: f32,
}

impl Checked {
    fn of(s: AttentionShape) -> Result<Checked, DeviceError> {
        if s.kv_heads == 0 || !s.heads.is_multiple_of(s.kv_heads) {
            return Err(DeviceError::ShapeMismatch {
                what: "attention query heads (a multiple of the key/value heads)",
                expected: s.kv_heads,
                actual: s.heads,
            });
        }
        let instance = PADDED
            .iter()
            .position(|&p| s.head_dim <= p)
            .filter(|_| s.head_dim > 0)
            .ok_or(DeviceError::ShapeMismatch {
                what: "attention head dim (1 to FLASH_MAX_HEAD_DIM)",
                expected: FLASH_MAX_HEAD_DIM,
                actual: s.head_dim,
            })?;
        Ok(Checked {
            instance,
            ints: [
                as_i32("attention seq", s.seq)?,
                as_i32("attention heads", s.heads)?,
                as_i32("attention kv heads", s.kv_heads)?,
                as_i32("attention head dim", s.head_dim)?,
            ],
            scale: 1.0 / (s.head_dim as f32).sqrt(),
        })
    }

    /// Kernel `which` (0 forward, 1 dq, 2 dkv) of this head dim's instance.
    fn kernel(&self, which: usize) -> &'static str {
        KERNELS[3 * self.instance + which]
    }

    /// Bytes of one tile in shared memory: 64 rows of `DP + 8` bf16.
    fn tile(&self) -> u32 {
        (TILE * (PADDED[self.instance] + 8) * 2) as u32
    }

    /// Query rows of a forward block (`Forward<DP>::ROWS`): each warp two row tiles of 16 up
    /// to head dim 64, one at 128.
    fn forward_rows(&self) -> usize {
        if PADDED[self.instance] <= 64 {
            2 * TILE
        } else {
            TILE
        }
    }

    /// A grid of `tiles` blocks for each of `heads` heads of each sequence, with `shared`
    /// bytes of shared memory.
    fn launch(s: AttentionShape, tiles: usize, heads: usize, shared: u32) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (tiles as u32, heads as u32, s.batch as u32),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: shared,
        }
    }
}

/// `lse` and `delta`'s floats of one tile's queries.
const ROW_BYTES: u32 = (2 * TILE * 4) as u32;

/// Shared memory tiles of each kernel: the forward's two buffers each of k and v (and its
/// queries' `forward_rows / 64` tiles); the dq kernel's q and dO and two buffers each of k and
/// v (and one tile's rows); the dkv kernel's k and v and two buffers each of q and dO (and two
/// tiles' rows).
const FORWARD_KV_TILES: u32 = 4;
const BACKWARD_TILES: u32 = 6;

/// Elements of q (and of out, dout, dq), of k (and v, dk, dv), and rows of lse (and delta).
fn lengths(s: AttentionShape) -> (usize, usize, usize) {
    let n = s.batch * s.seq;
    (
        n * s.heads * s.head_dim,
        n * s.kv_heads * s.head_dim,
        s.batch * s.heads * s.seq,
    )
}

impl Gpu {
    /// Causal attention `out = softmax(q k^T / sqrt(D)) v` per head (query head `h` reading
    /// key/value head `h / (H / K)`), into bf16 `out (B, T, H, D)`, and `lse (B, H, T)`: each
    /// row's log-sum-exp (base 2, of the scores times `log2(e)`), which the backward reads.
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`] for lengths that differ from `shape`, heads that do not
    /// group or a head dim past [`FLASH_MAX_HEAD_DIM`]; the launch's error.
    pub fn flash_attention_forward(
        &self,
        out: GpuSlice<bf16>,
        lse: GpuSlice<f32>,
        [q, k, v]: [GpuSlice<bf16>; 3],
        shape: AttentionShape,
    ) -> Result<(), DeviceError> {
        let c = Checked::of(shape)?;
        let (q_len, kv_len, rows) = lengths(shape);
        out.expect_len("attention out", q_len)?;
        q.expect_len("attention q", q_len)?;
        k.expect_len("attention k", kv_len)?;
        v.expect_len("attention v", kv_len)?;
        lse.expect_len("attention lse", rows)?;
        if rows == 0 {
            return Ok(());
        }
        let [t, h, kh, d] = c.ints;
        let scale_log2 = c.scale * std::f32::consts::LOG2_E;
        self.launch(
            c.kernel(0),
            Checked::launch(
                shape,
                shape.seq.div_ceil(c.forward_rows()),
                shape.heads,
                (FORWARD_KV_TILES + (c.forward_rows() / TILE) as u32) * c.tile(),
            ),
            &[
                &out.address(),
                &lse.address(),
                &q.address(),
                &k.address(),
                &v.address(),
                &t,
                &h,
                &kh,
                &d,
                &scale_log2,
            ],
        )
    }

    /// The gradients of [`Gpu::flash_attention_forward`]: `dq`, `dk`, `dv` (bf16, overwritten;
    /// dk and dv summed over each key/value head's query group) from `dout`, the forward's
    /// inputs, its `out` and `lse`. Scratch: `delta (B, H, T)` (`rowsum(dout * out)`) and
    /// `partials`, `2 B T H D` floats (where the dk/dv blocks split their groups, their fp32
    /// shares, [`dkv_split`]).
    ///
    /// # Errors
    /// As [`Gpu::flash_attention_forward`].
    #[allow(clippy::too_many_arguments)]
    pub fn flash_attention_backward(
        &self,
        grads: [GpuSlice<bf16>; 3],
        scratch: [GpuSlice<f32>; 2],
        inputs: [GpuSlice<bf16>; 3],
        out: GpuSlice<bf16>,
        dout: GpuSlice<bf16>,
        lse: GpuSlice<f32>,
        shape: AttentionShape,
    ) -> Result<(), DeviceError> {
        let split = dkv_split(shape, self.multiprocessors());
        self.flash_backward_split(grads, scratch, inputs, [out, dout], lse, shape, split)
    }

    /// [`Gpu::flash_attention_backward`] with each dk/dv block's query group in `split` pieces
    /// (a divisor of the group).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn flash_backward_split(
        &self,
        [dq, dk, dv]: [GpuSlice<bf16>; 3],
        [delta, partials]: [GpuSlice<f32>; 2],
        [q, k, v]: [GpuSlice<bf16>; 3],
        [out, dout]: [GpuSlice<bf16>; 2],
        lse: GpuSlice<f32>,
        shape: AttentionShape,
        split: usize,
    ) -> Result<(), DeviceError> {
        let c = Checked::of(shape)?;
        let (q_len, kv_len, rows) = lengths(shape);
        for (what, x) in [
            ("attention dq", dq),
            ("attention q", q),
            ("attention out", out),
        ] {
            x.expect_len(what, q_len)?;
        }
        dout.expect_len("attention dout", q_len)?;
        for (what, x) in [
            ("attention dk", dk),
            ("attention dv", dv),
            ("attention k", k),
            ("attention v", v),
        ] {
            x.expect_len(what, kv_len)?;
        }
        lse.expect_len("attention lse", rows)?;
        delta.expect_len("attention delta", rows)?;
        partials.expect_len("attention dk and dv partials", 2 * q_len)?;
        if rows == 0 {
            return Ok(());
        }
        let group = shape.heads / shape.kv_heads;
        if split == 0 || !group.is_multiple_of(split) {
            return Err(DeviceError::ShapeMismatch {
                what: "attention dk/dv pieces of a query group (a divisor of it)",
                expected: group,
                actual: split,
            });
        }
        let [t, h, kh, d] = c.ints;
        let scale_log2 = c.scale * std::f32::consts::LOG2_E;
        self.launch(
            c.kernel(1),
            Checked::launch(
                shape,
                shape.seq.div_ceil(TILE),
                shape.heads,
                BACKWARD_TILES * c.tile() + ROW_BYTES,
            ),
            &[
                &dq.address(),
                &delta.address(),
                &q.address(),
                &k.address(),
                &v.address(),
                &out.address(),
                &dout.address(),
                &lse.address(),
                &t,
                &h,
                &kh,
                &d,
                &scale_log2,
                &c.scale,
            ],
        )?;
        // A block takes two key tiles, one near each end of the sequence, of one piece of a kv
        // head's query group.
        let split32 = as_i32("attention dk/dv pieces", split)?;
        self.launch(
            c.kernel(2),
            Checked::launch(
                shape,
                shape.seq.div_ceil(2 * TILE),
                shape.kv_heads * split,
                BACKWARD_TILES * c.tile() + 2 * ROW_BYTES,
            ),
            &[
                &dk.address(),
                &dv.address(),
                &partials.address(),
                &split32,
                &q.address(),
                &k.address(),
                &v.address(),
                &dout.address(),
                &lse.address(),
                &delta.address(),
                &t,
                &h,
                &kh,
                &d,
                &scale_log2,
                &c.scale,
            ],
        )?;
        if split == 1 {
            return Ok(());
        }
        let n = kv_len as i64;
        self.launch(
            "flash_dkv_reduce",
            elementwise(kv_len),
            &[
                &dk.address(),
                &dv.address(),
                &partials.address(),
                &split32,
                &n,
            ],
        )
    }
}

/// Pieces a dk/dv block's query group is split into: 1 (each kv head's gradients summed in
/// registers and written once) where the grid of two key tiles a kv head already gives every
/// one of the `multiprocessors` a block (two fit one at head dim 64, so such a grid is one wave
/// of equal blocks or more), else the fewest (a divisor of the group) that do, or the whole
/// group (one query head a block), each piece's share then summed from fp32 partials. Not
/// tuned on a GPU yet. The pieces change how dk and dv are summed, so their bits depend on the
/// multiprocessor count: the same on every run and every replica of one kind of GPU, not
/// across kinds (an H100 SXM's 132 against a PCIe card's 114, or a MIG slice).
pub(super) fn dkv_split(s: AttentionShape, multiprocessors: usize) -> usize {
    let group = s.heads / s.kv_heads.max(1);
    let blocks = s.seq.div_ceil(2 * TILE) * s.kv_heads * s.batch;
    (1..=group)
        .filter(|pieces| group.is_multiple_of(*pieces))
        .find(|pieces| blocks * pieces >= multiprocessors)
        .unwrap_or(group)
}
