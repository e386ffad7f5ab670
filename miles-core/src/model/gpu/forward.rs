//! The GPU transformer and its forward pass: the CPU [`Transformer`]'s ops, one for one, as
//! kernels and cuBLAS products on bf16 parameters and activations.

use half::bf16;

use super::TrainerGroup;
use super::backward::{input_grad, weight_grad};
use super::layout::{GpuActivationLayout, GpuActivations, HEAD_GRAD_ROWS, HEAD_ROWS, LayerActs};
use super::weights::{Edges, LayerTensors, WeightUnits, edge_units, tensor_in};
use crate::device::{Gemm, Gpu, GpuSlice, Transpose};
use crate::model::layout::layer_block;
use crate::model::{LlamaConfig, ModelError, ParamKind, ParamLayout, TrainBatch, Transformer};
use crate::ops::gpu::GradWrite;
use crate::ops::{AttentionShape, embedding_rows};

/// What a forward pass is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ForwardMode {
    /// Log-probs (and the loss): the whole model.
    Score,
    /// Up to the final norm: [`GpuTransformer::backward`] starts with the LM head and its
    /// cross-entropy, a chunk of rows at a time, so the log-probs are there after it.
    Train,
}

/// Where the LM head's backward writes: the head's weight gradient (as `write` says: the first
/// block of rows overwrites it or adds, the rest add) and the gradient of the final norm's
/// output `(B, T, C)` (overwritten).
pub(super) struct HeadGrads {
    pub d_head: GpuSlice<f32>,
    pub d_lnf: GpuSlice<bf16>,
    pub write: GradWrite,
}

/// The Llama decoder on the GPU: config, parameter table and rotary tables; no storage.
///
/// Parameters are one bf16 buffer and gradients one fp32 buffer, both laid out by the model's
/// [`ParamLayout`] (the CPU's offsets); activations are a [`GpuActivations`]. Every pass only
/// queues work on the [`Gpu`]'s stream, except the uploads of a batch's inputs and the
/// download of log-probs, which wait.
#[derive(Clone, Debug)]
pub struct GpuTransformer {
    model: Transformer,
}

impl GpuTransformer {
    /// The model of `config`.
    pub fn new(config: LlamaConfig) -> GpuTransformer {
        GpuTransformer {
            model: Transformer::new(config),
        }
    }

    /// The config.
    pub fn config(&self) -> &LlamaConfig {
        self.model.config()
    }

    /// The parameter table (also that of gradients, master weights and moments).
    pub fn layout(&self) -> &ParamLayout {
        self.model.layout()
    }

    /// The activation table for `batch` sequences of `seq` positions.
    ///
    /// # Errors
    /// [`ModelError::Batch`] when `seq` exceeds `max_position_embeddings` or a size is zero.
    pub fn activation_layout(
        &self,
        batch: usize,
        seq: usize,
    ) -> Result<GpuActivationLayout, ModelError> {
        self.model.activation_layout(batch, seq)?;
        Ok(GpuActivationLayout::new(self.config(), batch, seq))
    }

    /// Checks `batch` as the CPU model does: sizes, lengths, normaliser, and every token id
    /// inside the vocabulary.
    ///
    /// # Errors
    /// [`ModelError::Batch`] or [`ModelError::TokenOutOfRange`].
    pub fn check_batch(&self, batch: &TrainBatch<'_>) -> Result<(), ModelError> {
        let al = self.model.activation_layout(batch.batch, batch.seq)?;
        self.model.check_batch(&al, batch)
    }

    /// Uploads `batch`'s inputs and queues the forward pass over `weights` (fetched a unit at
    /// a time, embedding first and the edges last: see [`WeightUnits`]): for [`ForwardMode::Score`] the
    /// per-token log-probs are then in `acts` ([`logprobs`](Self::logprobs) reads them); for
    /// [`ForwardMode::Train`] the final norm's output is, and the log-probs come with the
    /// [`backward`](Self::backward) pass. With `group`, the o and down products go through
    /// [`TrainerGroup::sum_row_parallel`] (a tensor-parallel rank's shard sums them over the
    /// group).
    ///
    /// # Errors
    /// [`ModelError::Batch`] or [`ModelError::TokenOutOfRange`] before any GPU work;
    /// [`ModelError::Gpu`] for buffers of the wrong length or a failed launch.
    pub fn forward(
        &self,
        gpu: &Gpu,
        weights: &dyn WeightUnits,
        acts: &GpuActivations,
        batch: &TrainBatch<'_>,
        mode: ForwardMode,
        group: Option<&dyn TrainerGroup>,
    ) -> Result<(), ModelError> {
        self.check_batch(batch)?;
        acts.check_shape(batch)?;
        self.upload_inputs(gpu, acts, batch)?;
        let (c, lay) = (self.config(), self.layout());
        let (layers, a) = (c.num_layers, acts.layout());
        // The units in the order an optimizer step behind the pass updates them
        // (`weights::update_units`): the embedding's first, the tail's last.
        let unit = edge_units(lay)[0].clone();
        let base = unit.start;
        let embedding = tensor_in(
            lay,
            weights.fetch(gpu, unit)?,
            base,
            ParamKind::Embedding,
            0,
        )?;
        let res0 = acts.bf(&layer_block(&a.residual, 0, layers + 1))?;
        gpu.embedding_forward(res0, acts.u(&a.inputs)?, embedding, c.hidden_size)?;
        for l in 0..layers {
            let w = self.layer_weights(gpu, weights, l)?;
            self.layer_forward(gpu, &w, &acts.layer(l, layers)?, acts, group)?;
        }
        let edges = self.edge_weights(gpu, weights)?;
        self.head_forward(gpu, &edges, acts, batch.normaliser, mode)
    }

    /// The edges' weights (embedding, final norm, head), fetched from `weights`.
    pub(super) fn edge_weights(
        &self,
        gpu: &Gpu,
        weights: &dyn WeightUnits,
    ) -> Result<Edges<bf16>, ModelError> {
        let units = edge_units(self.layout());
        let bufs = [
            weights.fetch(gpu, units[0].clone())?,
            weights.fetch(gpu, units[1].clone())?,
        ];
        Ok(Edges { units, bufs })
    }

    /// Layer `l`'s weights, fetched from `weights`.
    pub(super) fn layer_weights(
        &self,
        gpu: &Gpu,
        weights: &dyn WeightUnits,
        l: usize,
    ) -> Result<LayerTensors<bf16>, ModelError> {
        let unit = self.layout().layer_range(l);
        let buf = weights.fetch(gpu, unit.clone())?;
        Ok(LayerTensors::in_unit(self.layout(), buf, unit.start, l)?)
    }

    /// The per-token log-probs `(B, T)` of the last scoring forward pass or backward pass on
    /// `acts` (waits for it).
    ///
    /// # Errors
    /// [`ModelError::Gpu`]: the download's error, or the first error a queued kernel hit.
    pub fn logprobs(&self, gpu: &Gpu, acts: &GpuActivations) -> Result<Vec<f32>, ModelError> {
        let a = acts.layout();
        let mut out = vec![0.0; a.batch * a.seq];
        gpu.download(&mut out, acts.f(&a.logprobs)?)?;
        Ok(out)
    }

    /// The loss of `batch` from its per-token `logprobs`, as the CPU's cross-entropy sums it.
    pub fn loss(logprobs: &[f32], batch: &TrainBatch<'_>) -> f32 {
        (nll_sum(logprobs, batch.weights) / f64::from(batch.normaliser)) as f32
    }

    /// Uploads the ids, targets, positions and the rows grouped by id (one copy) and the
    /// weights and the first `T` rows of the rotary tables (another).
    fn upload_inputs(
        &self,
        gpu: &Gpu,
        acts: &GpuActivations,
        batch: &TrainBatch<'_>,
    ) -> Result<(), ModelError> {
        let (n, t) = (batch.batch * batch.seq, batch.seq);
        let (order, starts) = embedding_rows(batch.inputs);
        let mut ids = Vec::with_capacity(5 * n + 1);
        ids.extend_from_slice(batch.inputs);
        ids.extend_from_slice(batch.targets);
        ids.extend((0..n).map(|i| (i % t) as u32));
        ids.extend_from_slice(&order);
        ids.extend_from_slice(&starts);
        gpu.upload(acts.u32_all(), &ids)?;
        let rows = t * self.config().head_dim / 2;
        let rope = self.model.rope();
        let (Some(cos), Some(sin)) = (rope.cos().get(..rows), rope.sin().get(..rows)) else {
            return Err(ModelError::Batch(format!(
                "sequence of {t} positions exceeds the rotary table of {} positions",
                rope.max_positions()
            )));
        };
        let mut floats = Vec::with_capacity(n + 2 * rows);
        floats.extend_from_slice(batch.weights);
        floats.extend_from_slice(cos);
        floats.extend_from_slice(sin);
        gpu.upload(acts.f(&acts.layout().f32_inputs)?, &floats)?;
        Ok(())
    }

    /// Layer `l`'s forward pass: `res_out = res_mid + down(swiglu(gate(ln2), up(ln2)))` with
    /// `res_mid = res_in + o(attention(rope(q(ln1)), rope(k(ln1)), v(ln1)))`; the q, k and v
    /// products take their biases and q and k their per-head norms (before the rotation) in
    /// the families that have them, as the CPU model does.
    fn layer_forward(
        &self,
        gpu: &Gpu,
        w: &LayerTensors<bf16>,
        la: &LayerActs,
        acts: &GpuActivations,
        group: Option<&dyn TrainerGroup>,
    ) -> Result<(), ModelError> {
        let c = self.config();
        let a = acts.layout();
        let (n, h, f) = (a.batch * a.seq, c.hidden_size, c.intermediate_size);
        let (qd, kvd, eps) = (c.q_dim(), c.kv_dim(), c.rms_norm_eps);
        let (pos, cos, sin) = (
            acts.u(&a.positions)?,
            acts.f(&a.rope_cos)?,
            acts.f(&a.rope_sin)?,
        );
        // y (n, out) = x (n, in) W^T, W stored (out, in).
        let linear = |out: usize, inp: usize| Gemm::new(n, out, inp, Transpose::No, Transpose::Yes);
        let (ln, sw) = (acts.bf(&a.ln)?, acts.swiglu()?);
        gpu.rmsnorm_forward(ln, Some(la.rstd1), la.res_in, w.input_norm, eps)?;
        // With q/k norms the products land in q_pre and k_pre and are normed into q and k.
        let (q_lin, k_lin) = match w.qk_norm {
            Some(_) => (la.q_pre, la.k_pre),
            None => (la.q, la.k),
        };
        gpu.gemm(linear(qd, h), q_lin, ln, w.q)?; // (B, T, H*D)
        gpu.gemm(linear(kvd, h), k_lin, ln, w.k)?; // (B, T, K*D)
        gpu.gemm(linear(kvd, h), la.v, ln, w.v)?; // (B, T, K*D)
        if let Some([qb, kb, vb]) = w.qkv_bias {
            gpu.bias_add(q_lin, qb)?;
            gpu.bias_add(k_lin, kb)?;
            gpu.bias_add(la.v, vb)?;
        }
        if let Some([qn, kn]) = w.qk_norm {
            gpu.rmsnorm_forward(la.q, Some(la.q_rstd), la.q_pre, qn, eps)?; // (B, T, H, D)
            gpu.rmsnorm_forward(la.k, Some(la.k_rstd), la.k_pre, kn, eps)?; // (B, T, K, D)
        }
        gpu.rope_forward(la.q, pos, cos, sin, c.num_heads, c.head_dim)?;
        gpu.rope_forward(la.k, pos, cos, sin, c.num_kv_heads, c.head_dim)?;
        let shape = attention_shape(c, acts);
        gpu.flash_attention_forward(la.att_out, la.lse, [la.q, la.k, la.v], shape)?; // (B, T, H*D)
        gpu.gemm(linear(h, qd), la.res_mid, la.att_out, w.o)?; // (B, T, C)
        sum_over_shards(group, la.res_mid)?;
        gpu.residual_add(la.res_mid, la.res_in)?;
        gpu.rmsnorm_forward(ln, Some(la.rstd2), la.res_mid, w.post_norm, eps)?;
        gpu.gemm(linear(f, h), la.gate, ln, w.gate)?; // (B, T, F)
        gpu.gemm(linear(f, h), la.up, ln, w.up)?; // (B, T, F)
        gpu.swiglu_forward(sw, la.gate, la.up)?;
        gpu.gemm(linear(h, f), la.res_out, sw, w.down)?; // (B, T, C)
        sum_over_shards(group, la.res_out)?;
        gpu.residual_add(la.res_out, la.res_mid)?;
        Ok(())
    }

    /// The final norm; for [`ForwardMode::Score`], the LM head and its cross-entropy too.
    fn head_forward(
        &self,
        gpu: &Gpu,
        edges: &Edges<bf16>,
        acts: &GpuActivations,
        normaliser: f32,
        mode: ForwardMode,
    ) -> Result<(), ModelError> {
        let c = self.config();
        let a = acts.layout();
        let layers = c.num_layers;
        let norm = edges.tensor(self.layout(), ParamKind::FinalNorm)?;
        let res_last = acts.bf(&layer_block(&a.residual, layers, layers + 1))?;
        gpu.rmsnorm_forward(
            acts.bf(&a.lnf)?,
            Some(acts.f(&a.lnf_rstd)?),
            res_last,
            norm,
            c.rms_norm_eps,
        )?;
        match mode {
            ForwardMode::Score => {
                let head = edges.tensor(self.layout(), ParamKind::LmHead)?;
                self.head_rows(gpu, head, acts, normaliser, None)
            }
            ForwardMode::Train => Ok(()),
        }
    }

    /// The LM head `head` over the final norm's output into fp32 logits and the fused
    /// cross-entropy into the log-probs, [`HEAD_ROWS`] rows at a time; with `grads`, the logit
    /// gradients of [`HEAD_GRAD_ROWS`] rows at a time go back through the head:
    /// `d_lnf = d_logits W` and `d_head (+)= d_logits^T lnf`.
    pub(super) fn head_rows(
        &self,
        gpu: &Gpu,
        head: GpuSlice<bf16>,
        acts: &GpuActivations,
        normaliser: f32,
        grads: Option<&HeadGrads>,
    ) -> Result<(), ModelError> {
        let c = self.config();
        let a = acts.layout();
        let (n, h, v) = (a.batch * a.seq, c.hidden_size, c.vocab_size);
        let lnf = acts.bf(&a.lnf)?;
        let (logits, d_logits) = acts.head_logits()?;
        let (logprobs, targets, weights) = (
            acts.f(&a.logprobs)?,
            acts.u(&a.targets)?,
            acts.f(&a.weights)?,
        );
        for block in (0..n).step_by(HEAD_GRAD_ROWS) {
            let block_rows = HEAD_GRAD_ROWS.min(n - block);
            for first in (block..block + block_rows).step_by(HEAD_ROWS) {
                let rows = HEAD_ROWS.min(block + block_rows - first);
                let z = logits.sub(0, rows * v)?;
                let x = lnf.sub(first * h, rows * h)?;
                gpu.gemm(
                    Gemm::new(rows, v, h, Transpose::No, Transpose::Yes),
                    z,
                    x,
                    head,
                )?;
                let dz = match grads {
                    Some(_) => Some(d_logits.sub((first - block) * v, rows * v)?),
                    None => None,
                };
                gpu.crossentropy(
                    logprobs.sub(first, rows)?,
                    dz,
                    z,
                    targets.sub(first, rows)?,
                    weights.sub(first, rows)?,
                    normaliser,
                )?;
            }
            if let Some(g) = grads {
                let (dz, x) = (
                    d_logits.sub(0, block_rows * v)?,
                    lnf.sub(block * h, block_rows * h)?,
                );
                gpu.gemm(
                    input_grad(block_rows, h, v),
                    g.d_lnf.sub(block * h, block_rows * h)?,
                    dz,
                    head,
                )?;
                let write = if block == 0 { g.write } else { GradWrite::Add };
                gpu.gemm(weight_grad(v, h, block_rows, write), g.d_head, dz, x)?;
            }
        }
        Ok(())
    }
}

/// With `group`: [`TrainerGroup::sum_row_parallel`] on `x`, in place: a row-parallel
/// product's partial output, or the partial gradient of a column-parallel product's input.
pub(super) fn sum_over_shards(
    group: Option<&dyn TrainerGroup>,
    x: GpuSlice<bf16>,
) -> Result<(), ModelError> {
    match group {
        Some(group) => group.sum_row_parallel(x),
        None => Ok(()),
    }
}

/// `-sum(weights * logprobs)`, in f64 as the CPU's cross-entropy sums it.
pub(super) fn nll_sum(logprobs: &[f32], weights: &[f32]) -> f64 {
    logprobs
        .iter()
        .zip(weights)
        .map(|(&lp, &w)| -f64::from(w) * f64::from(lp))
        .sum()
}

/// The shape of `acts`' attention under `c`.
pub(super) fn attention_shape(c: &LlamaConfig, acts: &GpuActivations) -> AttentionShape {
    AttentionShape {
        batch: acts.layout().batch,
        seq: acts.layout().seq,
        heads: c.num_heads,
        kv_heads: c.num_kv_heads,
        head_dim: c.head_dim,
    }
}
