//! The GPU activation table: where every activation of a batch of `B` sequences of `T` positions
//! lives in three flat device buffers, one per element type (bf16 activations, fp32 statistics
//! log-probs and inputs, u32 token ids and positions).
//!
//! It differs from the CPU's [`ActivationLayout`](crate::model::ActivationLayout) in what a
//! layer keeps for the backward pass:
//! - attention is the flash kernels' (`ops::gpu::flash`), so a layer keeps no probabilities,
//!   only each row's log-sum-exp `(B, H, T)`; the backward pass's `rowsum(dO * O)` and the
//!   k and v gradients' fp32 partials (where its blocks split their query groups) are scratch;
//! - the two norms' outputs and the swiglu output are recomputed in the backward pass (the
//!   same kernels, so the same bits) into one layer's scratch, and the swiglu backward writes
//!   the gate and up gradients over the kept gate and up;
//! - the LM head's logits are computed [`HEAD_ROWS`] rows at a time and their bf16 gradient
//!   kept for [`HEAD_GRAD_ROWS`] rows before the head's backward products take them, so
//!   both are scratch of that many rows, never `(B, T, V)`;
//! - the swiglu output, the attention backward's k and v partials and the head's logits are
//!   never needed at once, so they share one scratch at the start of the bf16 buffer, viewed
//!   as fp32 where they are;
//! - a layout may keep the gate and up outputs of its first layer only
//!   ([`GpuActivationLayout::lending_gate_up`]): the other layers' lie elsewhere, handed to
//!   [`GpuActivations::with_gate_up_homes`] (the trainer lends each the gradients of the layer
//!   before it, which a step of one pass leaves unwritten until that layer's backward).

use std::ops::Range;

use half::bf16;

use crate::device::{DeviceError, GpuElement, GpuSlice};
use crate::model::layout::layer_block;
use crate::model::{LlamaConfig, ModelError, ParamLayout, TrainBatch};
use crate::ops::gpu::COLUMN_SUM_CHUNKS;

/// Where each activation of one batch shape lives, in elements of its type's buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuActivationLayout {
    pub(super) batch: usize,
    pub(super) seq: usize,
    /// The model's layers.
    layers: usize,
    /// The first layers whose gate and up outputs this layout holds: all of them, or one
    /// where the others lie elsewhere ([`GpuActivationLayout::lending_gate_up`]).
    gate_up_layers: usize,
    // bf16 buffer.
    /// The shared scratch, in bf16 elements: [`GpuActivations::swiglu`],
    /// [`GpuActivations::kv_partials`] and [`GpuActivations::head_logits`] are its views.
    pub(super) scratch: Range<usize>,
    swiglu_len: usize,
    kv_partials_len: usize,
    logits_len: usize,
    logit_grads_len: usize,
    pub(super) residual: Range<usize>,     // (L+1, B, T, C)
    pub(super) q: Range<usize>,            // (L, B, T, H*D), rotated
    pub(super) k: Range<usize>,            // (L, B, T, K*D), rotated
    pub(super) v: Range<usize>,            // (L, B, T, K*D)
    pub(super) q_pre: Range<usize>,        // (L, B, T, H*D) before the q norm (q/k norms only)
    pub(super) k_pre: Range<usize>,        // (L, B, T, K*D) before the k norm (q/k norms only)
    pub(super) att_out: Range<usize>,      // (L, B, T, H*D)
    pub(super) residual_mid: Range<usize>, // (L, B, T, C)
    pub(super) gate: Range<usize>,         // (gate_up_layers, B, T, F)
    pub(super) up: Range<usize>,           // (gate_up_layers, B, T, F)
    pub(super) lnf: Range<usize>,          // (B, T, C)
    /// A norm's output `(B, T, C)`: the layer's ln1 then ln2 in the forward pass, their
    /// recomputation in the backward pass.
    pub(super) ln: Range<usize>,
    pub(super) d_residual: Range<usize>, // (B, T, C)
    pub(super) d_ln: Range<usize>,       // (B, T, C)
    pub(super) d_att_out: Range<usize>,  // (B, T, H*D)
    pub(super) d_q: Range<usize>,        // (B, T, H*D)
    pub(super) d_k: Range<usize>,        // (B, T, K*D)
    pub(super) d_v: Range<usize>,        // (B, T, K*D)
    pub(super) d_q_pre: Range<usize>,    // (B, T, H*D) (q/k norms only)
    pub(super) d_k_pre: Range<usize>,    // (B, T, K*D) (q/k norms only)
    bf16_len: usize,
    // fp32 buffer.
    pub(super) ln1_rstd: Range<usize>, // (L, B, T)
    pub(super) ln2_rstd: Range<usize>, // (L, B, T)
    pub(super) lnf_rstd: Range<usize>, // (B, T)
    pub(super) q_rstd: Range<usize>,   // (L, B, T, H) (q/k norms only)
    pub(super) k_rstd: Range<usize>,   // (L, B, T, K) (q/k norms only)
    /// Scratch of the column sums (the norms' and biases' weight gradients), `(COLUMN_SUM_CHUNKS,
    /// max(C, H*D))`.
    pub(super) col_partials: Range<usize>,
    pub(super) lse: Range<usize>, // (L, B, H, T) attention rows' log-sum-exp
    pub(super) delta: Range<usize>, // (B, H, T) scratch of the attention backward
    pub(super) logprobs: Range<usize>, // (B, T)
    /// The uploaded fp32 inputs, contiguous: `weights`, `rope_cos`, `rope_sin`.
    pub(super) f32_inputs: Range<usize>,
    pub(super) weights: Range<usize>,  // (B, T)
    pub(super) rope_cos: Range<usize>, // (T, D/2)
    pub(super) rope_sin: Range<usize>, // (T, D/2)
    f32_len: usize,
    // u32 buffer: the uploaded ids, contiguous.
    pub(super) inputs: Range<usize>,    // (B, T)
    pub(super) targets: Range<usize>,   // (B, T)
    pub(super) positions: Range<usize>, // (B, T)
    /// The rows grouped by input id, for the embedding's backward (`ops::embedding_rows`).
    pub(super) input_order: Range<usize>, // (B*T)
    pub(super) input_starts: Range<usize>, // (B*T + 1)
    u32_len: usize,
}

/// Rows of the LM head's fp32 logits computed at a time (512 rows of a 128,256-token
/// vocabulary: 250 MiB, where a batch of 4096 tokens would need 2 GiB).
pub const HEAD_ROWS: usize = 512;

/// Rows of the logits' bf16 gradient kept for the head's backward products (2048 rows of a
/// 128,256-token vocabulary: 500 MiB). The head's weight gradient adds them in one product
/// whose inner dimension is these rows: it reads and writes the fp32 `(V, C)` gradient once
/// for them, so the fewer the products the less of that traffic (2 GiB a product for a 1B
/// model), which a product over few rows is bound by.
pub const HEAD_GRAD_ROWS: usize = 4 * HEAD_ROWS;

/// Where a step of one pass keeps the gate and up outputs of layers `1..layers` (each
/// `gate_up_len` bf16 elements, the two halves 16-byte aligned): the fp32 gradients of the
/// layer before, in `params`. Layer `l - 1`'s gradients are read by the optimizer step before
/// the next forward pass reaches layer `l` (the update runs in layer order, and each layer's
/// forward pass waits for its own), and written by layer `l - 1`'s backward pass, after layer
/// `l`'s has read the gate and up. `None` where some layer's gradients are too short or
/// misaligned for them.
pub(super) fn gate_up_home_ranges(
    params: &ParamLayout,
    layers: usize,
    gate_up_len: usize,
) -> Option<Vec<Range<usize>>> {
    // Two bf16 elements an fp32 gradient; each half starts on a 16-byte word.
    let half = gate_up_len / 2;
    if !half.is_multiple_of(8) {
        return None;
    }
    (1..layers)
        .map(|l| {
            let grads = params.layer_range(l - 1);
            (grads.start.is_multiple_of(4) && 2 * grads.len() >= gate_up_len).then_some(grads)
        })
        .collect()
}

/// Hands out consecutive ranges of one buffer.
struct Cursor(usize);

impl Cursor {
    fn take(&mut self, len: usize) -> Range<usize> {
        let r = self.0..self.0 + len;
        self.0 += len;
        r
    }
}

impl GpuActivationLayout {
    /// The layout for `batch` sequences of `seq` positions under `c` (sizes unchecked: the
    /// model's [`activation_layout`](super::GpuTransformer::activation_layout) checks them).
    pub(super) fn new(c: &LlamaConfig, batch: usize, seq: usize) -> GpuActivationLayout {
        GpuActivationLayout::keeping_gate_up(c, batch, seq, c.num_layers)
    }

    /// As [`new`](Self::new), holding the gate and up outputs of the first layer only: the
    /// others' `(B, T, F)` pairs are handed to [`GpuActivations::with_gate_up_homes`].
    pub(super) fn lending_gate_up(c: &LlamaConfig, batch: usize, seq: usize) -> Self {
        GpuActivationLayout::keeping_gate_up(c, batch, seq, c.num_layers.min(1))
    }

    fn keeping_gate_up(c: &LlamaConfig, batch: usize, seq: usize, kept: usize) -> Self {
        let n = batch * seq;
        let (l, h, f, v) = (
            c.num_layers,
            c.hidden_size,
            c.intermediate_size,
            c.vocab_size,
        );
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        let qk = usize::from(c.qk_norm);
        let widest = if c.qk_norm || c.qkv_bias {
            qd.max(h)
        } else {
            h
        };
        let sums = COLUMN_SUM_CHUNKS * widest;
        let att_rows = batch * c.num_heads * seq;
        let mut b = Cursor(0);
        let mut f32s = Cursor(0);
        let mut u32s = Cursor(0);
        let (logits_len, logit_grads_len) = (n.min(HEAD_ROWS) * v, n.min(HEAD_GRAD_ROWS) * v);
        let (swiglu_len, kv_partials_len) = (n * f, 2 * n * qd);
        // In bf16 elements: the swiglu output, the fp32 partials, the fp32 logits and their
        // bf16 gradient; rounded to 16 bytes for the ranges after it.
        let scratch_len = swiglu_len
            .max(2 * kv_partials_len)
            .max(2 * logits_len + logit_grads_len);
        let scratch = b.take(scratch_len.next_multiple_of(8));
        let residual = b.take((l + 1) * n * h);
        let q = b.take(l * n * qd);
        let k = b.take(l * n * kvd);
        let vv = b.take(l * n * kvd);
        let q_pre = b.take(qk * l * n * qd);
        let k_pre = b.take(qk * l * n * kvd);
        let att_out = b.take(l * n * qd);
        let residual_mid = b.take(l * n * h);
        // Side by side: a one-layer layout's pair is one slice.
        let gate = b.take(kept * n * f);
        let up = b.take(kept * n * f);
        let lnf = b.take(n * h);
        let ln = b.take(n * h);
        let d_residual = b.take(n * h);
        let d_ln = b.take(n * h);
        let d_att_out = b.take(n * qd);
        let d_q = b.take(n * qd);
        let d_k = b.take(n * kvd);
        let d_v = b.take(n * kvd);
        let d_q_pre = b.take(qk * n * qd);
        let d_k_pre = b.take(qk * n * kvd);
        let ln1_rstd = f32s.take(l * n);
        let ln2_rstd = f32s.take(l * n);
        let lnf_rstd = f32s.take(n);
        let q_rstd = f32s.take(qk * l * n * c.num_heads);
        let k_rstd = f32s.take(qk * l * n * c.num_kv_heads);
        let col_partials = f32s.take(sums);
        let lse = f32s.take(l * att_rows);
        let delta = f32s.take(att_rows);
        let logprobs = f32s.take(n);
        let rope = seq * c.head_dim / 2;
        let weights = f32s.take(n);
        let rope_cos = f32s.take(rope);
        let rope_sin = f32s.take(rope);
        let f32_inputs = weights.start..rope_sin.end;
        let inputs = u32s.take(n);
        let targets = u32s.take(n);
        let positions = u32s.take(n);
        let input_order = u32s.take(n);
        let input_starts = u32s.take(n + 1);
        GpuActivationLayout {
            batch,
            seq,
            layers: l,
            gate_up_layers: kept,
            scratch,
            swiglu_len,
            kv_partials_len,
            logits_len,
            logit_grads_len,
            residual,
            q,
            k,
            v: vv,
            q_pre,
            k_pre,
            att_out,
            residual_mid,
            gate,
            up,
            lnf,
            ln,
            d_residual,
            d_ln,
            d_att_out,
            d_q,
            d_k,
            d_v,
            d_q_pre,
            d_k_pre,
            bf16_len: b.0,
            ln1_rstd,
            ln2_rstd,
            lnf_rstd,
            q_rstd,
            k_rstd,
            col_partials,
            lse,
            delta,
            logprobs,
            f32_inputs,
            weights,
            rope_cos,
            rope_sin,
            f32_len: f32s.0,
            inputs,
            targets,
            positions,
            input_order,
            input_starts,
            u32_len: u32s.0,
        }
    }

    /// `B`.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// `T`.
    pub fn seq(&self) -> usize {
        self.seq
    }

    /// Elements of the bf16 buffer.
    pub fn bf16_len(&self) -> usize {
        self.bf16_len
    }

    /// Elements of the fp32 buffer.
    pub fn f32_len(&self) -> usize {
        self.f32_len
    }

    /// Elements of the u32 buffer.
    pub fn u32_len(&self) -> usize {
        self.u32_len
    }

    /// Bytes of the three buffers together.
    pub fn bytes(&self) -> usize {
        self.bf16_len * std::mem::size_of::<bf16>()
            + self.f32_len * std::mem::size_of::<f32>()
            + self.u32_len * std::mem::size_of::<u32>()
    }

    /// Layers whose gate and up outputs lie outside this layout's buffers.
    pub fn lent_gate_up_layers(&self) -> usize {
        self.layers - self.gate_up_layers
    }

    /// Elements of one layer's gate and up outputs together: `2 B T F`.
    pub fn gate_up_len(&self) -> usize {
        2 * self.gate.len() / self.gate_up_layers.max(1)
    }

    /// Whether buffers of this layout's lengths hold one of `other`'s.
    pub fn holds(&self, other: &GpuActivationLayout) -> bool {
        self.bf16_len >= other.bf16_len
            && self.f32_len >= other.f32_len
            && self.u32_len >= other.u32_len
    }
}

/// A batch's activations on the device: the three buffers of a [`GpuActivationLayout`].
#[derive(Clone, Debug)]
pub struct GpuActivations {
    layout: GpuActivationLayout,
    bf16: GpuSlice<bf16>,
    f32: GpuSlice<f32>,
    u32: GpuSlice<u32>,
    /// The gate and up outputs `(2, B, T, F)` of each layer past the layout's own.
    gate_up_homes: Vec<GpuSlice<bf16>>,
}

impl GpuActivations {
    /// The activations of `layout` at the starts of `bf16`, `f32` and `u32` (each at least as
    /// long as the layout's part; longer buffers serve smaller batches).
    ///
    /// # Errors
    /// [`ModelError::BufferLength`] naming the buffer that is too short.
    pub fn new(
        layout: GpuActivationLayout,
        bf16: GpuSlice<bf16>,
        f32: GpuSlice<f32>,
        u32: GpuSlice<u32>,
    ) -> Result<GpuActivations, ModelError> {
        for (buffer, len, need) in [
            ("gpu activations (bf16)", bf16.len(), layout.bf16_len),
            ("gpu activations (f32)", f32.len(), layout.f32_len),
            ("gpu activations (u32)", u32.len(), layout.u32_len),
        ] {
            if len < need {
                return Err(ModelError::BufferLength { buffer, len, need });
            }
        }
        Ok(GpuActivations {
            bf16: bf16.sub(0, layout.bf16_len)?,
            f32: f32.sub(0, layout.f32_len)?,
            u32: u32.sub(0, layout.u32_len)?,
            layout,
            gate_up_homes: Vec::new(),
        })
    }

    /// These activations with the gate and up outputs of the layers past the layout's own
    /// (one slice a layer, in order, each at least [`GpuActivationLayout::gate_up_len`] long)
    /// in `homes`, which must be free from the layer's forward pass to its backward pass.
    ///
    /// # Errors
    /// [`ModelError::BufferLength`] for a missing or short home.
    pub(super) fn with_gate_up_homes(
        mut self,
        homes: Vec<GpuSlice<bf16>>,
    ) -> Result<GpuActivations, ModelError> {
        let (want, need) = (self.layout.lent_gate_up_layers(), self.layout.gate_up_len());
        if homes.len() != want {
            return Err(ModelError::BufferLength {
                buffer: "gpu activations' gate and up homes (one a lent layer)",
                len: homes.len(),
                need: want,
            });
        }
        self.gate_up_homes = homes
            .into_iter()
            .map(|home| {
                if home.len() < need {
                    return Err(ModelError::BufferLength {
                        buffer: "gpu activations (a gate and up home)",
                        len: home.len(),
                        need,
                    });
                }
                Ok(home.sub(0, need)?)
            })
            .collect::<Result<_, ModelError>>()?;
        Ok(self)
    }

    /// The layout.
    pub fn layout(&self) -> &GpuActivationLayout {
        &self.layout
    }

    /// Checks that `batch` has this layout's shape.
    ///
    /// # Errors
    /// [`ModelError::Batch`].
    pub(super) fn check_shape(&self, batch: &TrainBatch<'_>) -> Result<(), ModelError> {
        if batch.batch != self.layout.batch || batch.seq != self.layout.seq {
            return Err(ModelError::Batch(format!(
                "batch is {} x {} but the gpu activations are {} x {}; build them for this batch",
                batch.batch, batch.seq, self.layout.batch, self.layout.seq
            )));
        }
        Ok(())
    }

    /// These activations of a lending layout with every lent layer's gate and up outputs
    /// over the first layer's, for a pass no backward pass follows (each layer reads its own
    /// right after writing them).
    ///
    /// # Errors
    /// As [`with_gate_up_homes`](Self::with_gate_up_homes).
    pub(super) fn sharing_first_gate_up(self) -> Result<GpuActivations, ModelError> {
        let a = &self.layout;
        // The kept layer's gate and up lie side by side.
        let first = self.bf(&(a.gate.start..a.up.end))?;
        let homes = vec![first; a.lent_gate_up_layers()];
        self.with_gate_up_homes(homes)
    }

    /// The bf16 activation at `r`.
    pub(super) fn bf(&self, r: &Range<usize>) -> Result<GpuSlice<bf16>, DeviceError> {
        view(self.bf16, r)
    }

    /// The fp32 activation at `r`.
    pub(super) fn f(&self, r: &Range<usize>) -> Result<GpuSlice<f32>, DeviceError> {
        view(self.f32, r)
    }

    /// The u32 input at `r`.
    pub(super) fn u(&self, r: &Range<usize>) -> Result<GpuSlice<u32>, DeviceError> {
        view(self.u32, r)
    }

    /// The swiglu output `(B, T, F)` in the forward pass; in the backward pass its gradient,
    /// then its recomputation (the shared scratch).
    pub(super) fn swiglu(&self) -> Result<GpuSlice<bf16>, DeviceError> {
        self.bf(&self.layout.scratch)?
            .sub(0, self.layout.swiglu_len)
    }

    /// The attention backward's fp32 k and v partials `(2, B, T, H, D)` (the shared scratch).
    pub(super) fn kv_partials(&self) -> Result<GpuSlice<f32>, DeviceError> {
        let scratch = self.bf(&self.layout.scratch)?.reinterpret::<f32>()?;
        scratch.sub(0, self.layout.kv_partials_len)
    }

    /// The LM head's fp32 logits `(rows, V)` for up to [`HEAD_ROWS`] rows and their bf16
    /// gradient for up to [`HEAD_GRAD_ROWS`] rows, after them (the shared scratch).
    pub(super) fn head_logits(&self) -> Result<(GpuSlice<f32>, GpuSlice<bf16>), DeviceError> {
        let scratch = self.bf(&self.layout.scratch)?;
        let (logits, grads) = (self.layout.logits_len, self.layout.logit_grads_len);
        Ok((
            scratch.reinterpret::<f32>()?.sub(0, logits)?,
            scratch.sub(2 * logits, grads)?,
        ))
    }

    /// The whole u32 buffer (the ids, uploaded in one copy).
    pub(super) fn u32_all(&self) -> GpuSlice<u32> {
        self.u32
    }

    /// Layer `l`'s activations.
    pub(super) fn layer(&self, l: usize, layers: usize) -> Result<LayerActs, DeviceError> {
        let a = &self.layout;
        let per = |r: &Range<usize>| layer_block(r, l, layers);
        let (gate, up) = match l.checked_sub(a.gate_up_layers) {
            None => (
                self.bf(&layer_block(&a.gate, l, a.gate_up_layers))?,
                self.bf(&layer_block(&a.up, l, a.gate_up_layers))?,
            ),
            Some(lent) => {
                let home = self
                    .gate_up_homes
                    .get(lent)
                    .ok_or(DeviceError::ShapeMismatch {
                        what: "gpu activations' gate and up homes (one a lent layer)",
                        expected: a.lent_gate_up_layers(),
                        actual: self.gate_up_homes.len(),
                    })?;
                let half = a.gate_up_len() / 2;
                (home.sub(0, half)?, home.sub(half, half)?)
            }
        };
        Ok(LayerActs {
            res_in: self.bf(&layer_block(&a.residual, l, layers + 1))?,
            rstd1: self.f(&per(&a.ln1_rstd))?,
            q: self.bf(&per(&a.q))?,
            k: self.bf(&per(&a.k))?,
            v: self.bf(&per(&a.v))?,
            q_pre: self.bf(&per(&a.q_pre))?,
            k_pre: self.bf(&per(&a.k_pre))?,
            q_rstd: self.f(&per(&a.q_rstd))?,
            k_rstd: self.f(&per(&a.k_rstd))?,
            lse: self.f(&per(&a.lse))?,
            att_out: self.bf(&per(&a.att_out))?,
            res_mid: self.bf(&per(&a.residual_mid))?,
            rstd2: self.f(&per(&a.ln2_rstd))?,
            gate,
            up,
            res_out: self.bf(&layer_block(&a.residual, l + 1, layers + 1))?,
        })
    }
}

fn view<T: GpuElement>(buf: GpuSlice<T>, r: &Range<usize>) -> Result<GpuSlice<T>, DeviceError> {
    buf.sub(r.start, r.end - r.start)
}

/// One layer's activations, kept from the forward pass for the backward pass.
pub(super) struct LayerActs {
    pub res_in: GpuSlice<bf16>,  // (B, T, C)
    pub rstd1: GpuSlice<f32>,    // (B, T)
    pub q: GpuSlice<bf16>,       // (B, T, H*D)
    pub k: GpuSlice<bf16>,       // (B, T, K*D)
    pub v: GpuSlice<bf16>,       // (B, T, K*D)
    pub q_pre: GpuSlice<bf16>,   // (B, T, H*D) before the q norm (empty without q/k norms)
    pub k_pre: GpuSlice<bf16>,   // (B, T, K*D) before the k norm (empty without q/k norms)
    pub q_rstd: GpuSlice<f32>,   // (B, T, H) (empty without q/k norms)
    pub k_rstd: GpuSlice<f32>,   // (B, T, K) (empty without q/k norms)
    pub lse: GpuSlice<f32>,      // (B, H, T)
    pub att_out: GpuSlice<bf16>, // (B, T, H*D)
    pub res_mid: GpuSlice<bf16>, // (B, T, C)
    pub rstd2: GpuSlice<f32>,    // (B, T)
    pub gate: GpuSlice<bf16>,    // (B, T, F); its gradient after the swiglu backward
    pub up: GpuSlice<bf16>,      // (B, T, F); its gradient after the swiglu backward
    pub res_out: GpuSlice<bf16>, // (B, T, C)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_activation_layout_tiles_each_buffer_without_gaps() {
        let qwen3 = crate::model::family_tests::family_config("qwen3");
        for c in [LlamaConfig::preset("small").unwrap(), qwen3] {
            tiles_without_gaps(&c, GpuActivationLayout::new(&c, 3, 17));
            tiles_without_gaps(&c, GpuActivationLayout::lending_gate_up(&c, 3, 17));
        }
    }

    #[test]
    fn a_lending_layout_keeps_the_first_layers_gate_and_up_and_is_smaller_by_the_rest() {
        let c = LlamaConfig::preset("small").unwrap();
        let (own, lending) = (
            GpuActivationLayout::new(&c, 3, 17),
            GpuActivationLayout::lending_gate_up(&c, 3, 17),
        );
        let pair = 2 * 3 * 17 * c.intermediate_size;
        assert_eq!((own.gate_up_len(), lending.gate_up_len()), (pair, pair));
        assert_eq!(own.lent_gate_up_layers(), 0);
        assert_eq!(lending.lent_gate_up_layers(), c.num_layers - 1);
        assert_eq!(
            own.bf16_len() - lending.bf16_len(),
            (c.num_layers - 1) * pair
        );
        assert!(own.holds(&lending) && !lending.holds(&own));
    }

    /// Device slices at made-up addresses: the views are address arithmetic only.
    fn fake<T: GpuElement>(start: u64, len: usize) -> GpuSlice<T> {
        let bytes = len * std::mem::size_of::<T>();
        GpuSlice::of(crate::device::AddressRange { start, len: bytes }).unwrap()
    }

    #[test]
    fn lent_layers_find_their_gate_and_up_in_their_homes_or_an_error_naming_them() {
        let c = LlamaConfig::preset("small").unwrap();
        let (layers, pair) = (c.num_layers, 2 * 3 * 17 * c.intermediate_size);
        let layout = GpuActivationLayout::lending_gate_up(&c, 3, 17);
        let acts = || {
            let l = layout.clone();
            let (bf, fl, ids) = (l.bf16_len(), l.f32_len(), l.u32_len());
            GpuActivations::new(l, fake(1 << 30, bf), fake(2 << 30, fl), fake(3 << 30, ids))
                .unwrap()
        };
        assert!(
            matches!(
                acts().layer(1, layers),
                Err(DeviceError::ShapeMismatch { .. })
            ),
            "a lent layer without a home"
        );
        let homes: Vec<GpuSlice<bf16>> = (0..layers - 1)
            .map(|l| fake((4 << 30) + (l as u64) * (1 << 24), pair))
            .collect();
        let missing = acts().with_gate_up_homes(homes[1..].to_vec());
        assert!(
            matches!(missing, Err(ModelError::BufferLength { need, .. }) if need == layers - 1)
        );
        let mut short = homes.clone();
        short[0] = fake(4 << 30, pair - 8);
        let short = acts().with_gate_up_homes(short);
        assert!(matches!(short, Err(ModelError::BufferLength { need, .. }) if need == pair));

        let lent = acts().with_gate_up_homes(homes.clone()).unwrap();
        let first = lent.layer(0, layers).unwrap();
        assert_eq!(
            first.gate.address(),
            (1 << 30) + 2 * layout.gate.start as u64
        );
        for (l, home) in homes.iter().enumerate() {
            let la = lent.layer(l + 1, layers).unwrap();
            assert_eq!(
                (la.gate.address(), la.gate.len()),
                (home.address(), pair / 2)
            );
            assert_eq!(
                la.up.address(),
                home.address() + pair as u64,
                "after the gate"
            );
        }
        let shared = acts().sharing_first_gate_up().unwrap();
        for l in 1..layers {
            let la = shared.layer(l, layers).unwrap();
            assert_eq!(
                (la.gate.address(), la.up.address()),
                (first.gate.address(), first.up.address())
            );
        }
    }

    #[test]
    fn gate_and_up_homes_are_the_gradients_of_the_layer_before_where_they_fit() {
        let c = LlamaConfig::preset("small").unwrap();
        let params = ParamLayout::new(&c);
        let per_layer = params.layer_range(0).len();
        // One layer's gradients hold `2 * per_layer` bf16 elements.
        let fits = (2 * per_layer / 16) * 16;
        let homes = gate_up_home_ranges(&params, c.num_layers, fits).unwrap();
        assert_eq!(homes.len(), c.num_layers - 1);
        for (l, home) in homes.iter().enumerate() {
            assert_eq!(*home, params.layer_range(l), "layer {}'s home", l + 1);
            assert_eq!(home.start % 4, 0, "16-byte aligned");
        }
        assert_eq!(gate_up_home_ranges(&params, c.num_layers, fits + 16), None);
        assert_eq!(
            gate_up_home_ranges(&params, c.num_layers, 24),
            None,
            "halves of 12 elements are not 16-byte words"
        );
        assert_eq!(gate_up_home_ranges(&params, 1, 16), Some(Vec::new()));
    }

    fn tiles_without_gaps(c: &LlamaConfig, a: GpuActivationLayout) {
        let mut bf = [
            &a.scratch,
            &a.residual,
            &a.q,
            &a.k,
            &a.v,
            &a.q_pre,
            &a.k_pre,
            &a.att_out,
            &a.residual_mid,
            &a.gate,
            &a.up,
            &a.lnf,
            &a.ln,
            &a.d_residual,
            &a.d_ln,
            &a.d_att_out,
            &a.d_q,
            &a.d_k,
            &a.d_v,
            &a.d_q_pre,
            &a.d_k_pre,
        ];
        // Empty ranges (the q/k norms' of a model without them) first among equal starts.
        bf.sort_by_key(|r| (r.start, r.end));
        let end = bf.iter().fold(0, |next, r| {
            assert_eq!(r.start, next, "gap or overlap before {r:?}");
            r.end
        });
        assert_eq!(end, a.bf16_len());
        let n = 3 * 17;
        let kept = c.num_layers - a.lent_gate_up_layers();
        assert_eq!(a.gate.len(), kept * n * c.intermediate_size);
        let qk = usize::from(c.qk_norm);
        assert_eq!(a.q_pre.len(), qk * c.num_layers * n * c.q_dim());
        assert_eq!(a.q_rstd.len(), qk * c.num_layers * n * c.num_heads);
        assert_eq!(a.k_rstd.len(), qk * c.num_layers * n * c.num_kv_heads);
        assert_eq!(
            a.col_partials.len(),
            COLUMN_SUM_CHUNKS * c.hidden_size.max(qk * c.q_dim()),
            "the column sums' scratch holds the widest norm or bias"
        );
        assert_eq!(a.lse.len(), c.num_layers * 3 * c.num_heads * 17);
        assert_eq!(a.f32_inputs.len(), n + 17 * c.head_dim);
        assert_eq!(
            (a.logits_len, a.logit_grads_len),
            (n * c.vocab_size, n * c.vocab_size),
            "fewer rows than HEAD_ROWS: all of them"
        );
        let long = GpuActivationLayout::new(c, 12, 200);
        assert_eq!(long.logits_len, HEAD_ROWS * c.vocab_size);
        assert_eq!(long.logit_grads_len, HEAD_GRAD_ROWS * c.vocab_size);
        for l in [&a, &long] {
            let bytes = 2 * l.scratch.len();
            assert!(bytes >= 2 * l.swiglu_len && bytes >= 4 * l.kv_partials_len);
            assert!(
                bytes >= 4 * l.logits_len + 2 * l.logit_grads_len,
                "fp32 logits, then their bf16 gradient"
            );
            assert_eq!(l.scratch.start, 0, "the scratch's fp32 views start aligned");
        }
        assert_eq!(a.f32_inputs.end, a.f32_len());
        assert_eq!(a.u32_len(), 5 * n + 1);
        let smaller = if a.lent_gate_up_layers() > 0 {
            GpuActivationLayout::lending_gate_up(c, 2, 17)
        } else {
            GpuActivationLayout::new(c, 2, 17)
        };
        assert!(a.holds(&smaller) && !smaller.holds(&a));
    }
}
