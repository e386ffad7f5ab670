//! The GPU transformer's backward pass: the chain rule of the forward pass, op for op as the CPU
//! [`Transformer::backward`](crate::model::Transformer::backward) runs it, writing (a step's
//! first pass) or adding (`+=`, the rest) fp32 weight gradients in the flat gradient buffer.
//! It starts with the LM head's forward pass and cross-entropy (a chunk of rows at a time),
//! and recomputes each layer's norm outputs and swiglu output where they are needed, rather
//! than keeping them.

use half::bf16;

use super::GpuTransformer;
use super::TrainerGroup;
use super::forward::{HeadGrads, attention_shape, sum_over_shards};
use super::layout::{GpuActivations, LayerActs};
use super::weights::{Edges, GradUnits, LayerTensors, WeightUnits, edge_units};
use crate::device::{Gemm, Gpu, GpuSlice, Transpose};
use crate::model::layout::layer_block;
use crate::model::{ModelError, ParamKind, TrainBatch};
use crate::ops::gpu::GradWrite;

/// The backward pass's per-batch scratch (the gradients flowing through one layer), and the
/// tensor-parallel group they are summed over, if any.
struct Flow<'a> {
    group: Option<&'a dyn TrainerGroup>,
    write: GradWrite,          // how the weight gradients meet the units' buffers
    d_res: GpuSlice<bf16>,     // (B, T, C): gradient of the residual stream
    d_ln: GpuSlice<bf16>,      // (B, T, C)
    d_att_out: GpuSlice<bf16>, // (B, T, H*D)
    d_q: GpuSlice<bf16>,       // (B, T, H*D)
    d_k: GpuSlice<bf16>,       // (B, T, K*D)
    d_v: GpuSlice<bf16>,       // (B, T, K*D)
    d_q_pre: GpuSlice<bf16>,   // (B, T, H*D) (empty without q/k norms)
    d_k_pre: GpuSlice<bf16>,   // (B, T, K*D) (empty without q/k norms)
    partials: GpuSlice<f32>,   // the column sums' scratch
    ln: GpuSlice<bf16>,        // (B, T, C): a norm's output, recomputed
    sw: GpuSlice<bf16>,        // (B, T, F): the swiglu output's gradient, then the output
}

impl<'a> Flow<'a> {
    fn of(
        acts: &GpuActivations,
        group: Option<&'a dyn TrainerGroup>,
        write: GradWrite,
    ) -> Result<Flow<'a>, ModelError> {
        let a = acts.layout();
        Ok(Flow {
            group,
            write,
            d_res: acts.bf(&a.d_residual)?,
            d_ln: acts.bf(&a.d_ln)?,
            d_att_out: acts.bf(&a.d_att_out)?,
            d_q: acts.bf(&a.d_q)?,
            d_k: acts.bf(&a.d_k)?,
            d_v: acts.bf(&a.d_v)?,
            d_q_pre: acts.bf(&a.d_q_pre)?,
            d_k_pre: acts.bf(&a.d_k_pre)?,
            partials: acts.f(&a.col_partials)?,
            ln: acts.bf(&a.ln)?,
            sw: acts.swiglu()?,
        })
    }
}

/// `dX (n, in) = dY (n, out) W (out, in)`, overwriting.
pub(super) fn input_grad(n: usize, inp: usize, out: usize) -> Gemm {
    Gemm::new(n, inp, out, Transpose::No, Transpose::No)
}

/// `dW (out, in) += dY^T (out, n) X (n, in)`, or `=` with [`GradWrite::Overwrite`].
pub(super) fn weight_grad(out: usize, inp: usize, n: usize, write: GradWrite) -> Gemm {
    let product = Gemm::new(out, inp, n, Transpose::Yes, Transpose::No);
    match write {
        GradWrite::Overwrite => product,
        GradWrite::Add => product.accumulate(),
    }
}

impl GpuTransformer {
    /// Queues the backward pass of the last [`forward`](Self::forward) of `batch` on `acts`
    /// (run in [`ForwardMode::Train`](super::ForwardMode::Train)), putting the weight gradients
    /// into `grads` unit by unit as [`GradUnits::write`] says (a step's first pass over the
    /// whole flat buffer writes them, so nothing zeroes them first; later passes add); the
    /// per-token log-probs are in `acts` after it.
    /// With `group` (as in [`forward`](Self::forward)), the gradients entering each layer's
    /// two norms go through [`TrainerGroup::sum_row_parallel`].
    ///
    /// # Errors
    /// [`ModelError::Batch`] when `acts` are not of `batch`'s shape; [`ModelError::Gpu`] for
    /// buffers of the wrong length or a failed launch.
    pub fn backward(
        &self,
        gpu: &Gpu,
        weights: &dyn WeightUnits,
        grads: &dyn GradUnits,
        acts: &GpuActivations,
        batch: &TrainBatch<'_>,
        group: Option<&dyn TrainerGroup>,
    ) -> Result<(), ModelError> {
        acts.check_shape(batch)?;
        let lay = self.layout();
        let c = self.config();
        let a = acts.layout();
        let (h, layers) = (c.hidden_size, c.num_layers);
        let flow = Flow::of(acts, group, grads.write())?;
        // The edges first: the head's and final norm's gradients (a tied head's in the
        // embedding's), the embedding's at the end.
        let edge_w = self.edge_weights(gpu, weights)?;
        let [embedding, tail] = edge_units(lay);
        let edge_dw = Edges {
            bufs: [
                grads.open(gpu, embedding.clone())?,
                grads.open(gpu, tail.clone())?,
            ],
            units: [embedding.clone(), tail.clone()],
        };
        let head = HeadGrads {
            d_head: edge_dw.tensor(lay, ParamKind::LmHead)?,
            d_lnf: flow.d_ln,
            write: flow.write,
        };
        let head_weights = edge_w.tensor(lay, ParamKind::LmHead)?;
        self.head_rows(gpu, head_weights, acts, batch.normaliser, Some(&head))?;
        gpu.zero(flow.d_res)?;
        gpu.rmsnorm_backward(
            flow.d_res,
            edge_dw.tensor(lay, ParamKind::FinalNorm)?,
            flow.d_ln,
            acts.bf(&layer_block(&a.residual, layers, layers + 1))?,
            edge_w.tensor(lay, ParamKind::FinalNorm)?,
            acts.f(&a.lnf_rstd)?,
            flow.partials,
            flow.write,
        )?;
        grads.close(gpu, tail.clone())?;
        for l in (0..layers).rev() {
            let unit = lay.layer_range(l);
            let w = self.layer_weights(gpu, weights, l)?;
            let g = grads.open(gpu, unit.clone())?;
            let dw = LayerTensors::in_unit(lay, g, unit.start, l)?;
            self.layer_backward(gpu, &w, &dw, &acts.layer(l, layers)?, &flow, acts)?;
            grads.close(gpu, unit)?;
        }
        let d_embedding = edge_dw.tensor(lay, ParamKind::Embedding)?;
        if flow.write == GradWrite::Overwrite && !c.tie_word_embeddings {
            // The rows of ids the batch lacks get no gradient; a tied head's wrote them all.
            gpu.zero(d_embedding)?;
        }
        gpu.embedding_backward(
            d_embedding,
            flow.d_res,
            acts.u(&a.inputs)?,
            acts.u(&a.input_order)?,
            acts.u(&a.input_starts)?,
            h,
        )?;
        grads.close(gpu, embedding)
    }

    /// A forward pass's unit fetches and, with `grads`, a backward pass's fetches, opens and
    /// closes, in the passes' order, computing nothing: for a rank of a group that splits its
    /// weights or gradients and has fewer micro-batches than its peers, whose gathers and sums
    /// (collectives) it still takes part in. The gradients it adds are zeros.
    ///
    /// # Errors
    /// As [`backward`](Self::backward).
    pub(super) fn pass_without_batch(
        &self,
        gpu: &Gpu,
        weights: &dyn WeightUnits,
        grads: Option<&dyn GradUnits>,
    ) -> Result<(), ModelError> {
        let (lay, layers) = (self.layout(), self.config().num_layers);
        self.edge_weights(gpu, weights)?;
        for l in 0..layers {
            self.layer_weights(gpu, weights, l)?;
        }
        let Some(grads) = grads else {
            return Ok(());
        };
        self.edge_weights(gpu, weights)?;
        let [embedding, tail] = edge_units(lay);
        grads.open(gpu, embedding.clone())?;
        grads.open(gpu, tail.clone())?;
        grads.close(gpu, tail)?;
        for l in (0..layers).rev() {
            self.layer_weights(gpu, weights, l)?;
            let unit = lay.layer_range(l);
            grads.open(gpu, unit.clone())?;
            grads.close(gpu, unit)?;
        }
        grads.close(gpu, embedding)
    }

    /// Layer `l`'s backward pass; `flow.d_res` holds the gradient of the residual stream
    /// leaving the layer and is left holding the one entering it.
    fn layer_backward(
        &self,
        gpu: &Gpu,
        w: &LayerTensors<bf16>,
        dw: &LayerTensors<f32>,
        la: &LayerActs,
        flow: &Flow<'_>,
        acts: &GpuActivations,
    ) -> Result<(), ModelError> {
        let c = self.config();
        let a = acts.layout();
        let (n, h, f) = (a.batch * a.seq, c.hidden_size, c.intermediate_size);
        let (qd, kvd, eps) = (c.q_dim(), c.kv_dim(), c.rms_norm_eps);
        let d_res = flow.d_res;
        // MLP: res_out = res_mid + down(swiglu(gate(ln2), up(ln2))). The swiglu backward
        // leaves the gate and up gradients in `la.gate` and `la.up`, and the swiglu output,
        // recomputed, in `flow.sw` for the down product's weight gradient.
        gpu.gemm(input_grad(n, f, h), flow.sw, d_res, w.down)?;
        gpu.swiglu_backward(la.gate, la.up, flow.sw)?;
        gpu.gemm(weight_grad(h, f, n, flow.write), dw.down, d_res, flow.sw)?;
        gpu.rmsnorm_forward(flow.ln, None, la.res_mid, w.post_norm, eps)?;
        gpu.gemm(input_grad(n, h, f), flow.d_ln, la.gate, w.gate)?;
        gpu.gemm(input_grad(n, h, f).accumulate(), flow.d_ln, la.up, w.up)?;
        gpu.gemm(weight_grad(f, h, n, flow.write), dw.gate, la.gate, flow.ln)?;
        gpu.gemm(weight_grad(f, h, n, flow.write), dw.up, la.up, flow.ln)?;
        sum_over_shards(flow.group, flow.d_ln)?;
        gpu.rmsnorm_backward(
            d_res,
            dw.post_norm,
            flow.d_ln,
            la.res_mid,
            w.post_norm,
            la.rstd2,
            flow.partials,
            flow.write,
        )?;
        // Attention: res_mid = res_in + o(attention(rope(q(ln1)), rope(k(ln1)), v(ln1))), with
        // the biases and q/k norms of the families that have them.
        gpu.gemm(input_grad(n, qd, h), flow.d_att_out, d_res, w.o)?;
        gpu.gemm(weight_grad(h, qd, n, flow.write), dw.o, d_res, la.att_out)?;
        self.attention_backward(gpu, la, flow, acts)?;
        // The gradients of the q and k products' outputs: through the q/k norms when there are.
        let (dq_lin, dk_lin) = match (w.qk_norm, dw.qk_norm) {
            (Some([qn, kn]), Some([d_qn, d_kn])) => {
                gpu.zero(flow.d_q_pre)?;
                gpu.zero(flow.d_k_pre)?;
                gpu.rmsnorm_backward(
                    flow.d_q_pre,
                    d_qn,
                    flow.d_q,
                    la.q_pre,
                    qn,
                    la.q_rstd,
                    flow.partials,
                    flow.write,
                )?;
                gpu.rmsnorm_backward(
                    flow.d_k_pre,
                    d_kn,
                    flow.d_k,
                    la.k_pre,
                    kn,
                    la.k_rstd,
                    flow.partials,
                    flow.write,
                )?;
                (flow.d_q_pre, flow.d_k_pre)
            }
            _ => (flow.d_q, flow.d_k),
        };
        if let Some([d_qb, d_kb, d_vb]) = dw.qkv_bias {
            gpu.bias_backward(d_qb, dq_lin, flow.partials, flow.write)?;
            gpu.bias_backward(d_kb, dk_lin, flow.partials, flow.write)?;
            gpu.bias_backward(d_vb, flow.d_v, flow.partials, flow.write)?;
        }
        gpu.rmsnorm_forward(flow.ln, None, la.res_in, w.input_norm, eps)?;
        gpu.gemm(input_grad(n, h, qd), flow.d_ln, dq_lin, w.q)?;
        gpu.gemm(input_grad(n, h, kvd).accumulate(), flow.d_ln, dk_lin, w.k)?;
        gpu.gemm(input_grad(n, h, kvd).accumulate(), flow.d_ln, flow.d_v, w.v)?;
        gpu.gemm(weight_grad(qd, h, n, flow.write), dw.q, dq_lin, flow.ln)?;
        gpu.gemm(weight_grad(kvd, h, n, flow.write), dw.k, dk_lin, flow.ln)?;
        gpu.gemm(weight_grad(kvd, h, n, flow.write), dw.v, flow.d_v, flow.ln)?;
        sum_over_shards(flow.group, flow.d_ln)?;
        gpu.rmsnorm_backward(
            d_res,
            dw.input_norm,
            flow.d_ln,
            la.res_in,
            w.input_norm,
            la.rstd1,
            flow.partials,
            flow.write,
        )?;
        Ok(())
    }

    /// From `flow.d_att_out` to the gradients of the rotated-back q, k, v rows: the flash
    /// backward recomputes the probabilities from the layer's kept q, k, v, output and
    /// log-sum-exp; k and v gradients sum over each query group.
    fn attention_backward(
        &self,
        gpu: &Gpu,
        la: &LayerActs,
        flow: &Flow<'_>,
        acts: &GpuActivations,
    ) -> Result<(), ModelError> {
        let c = self.config();
        let a = acts.layout();
        gpu.flash_attention_backward(
            [flow.d_q, flow.d_k, flow.d_v],
            [acts.f(&a.delta)?, acts.kv_partials()?],
            [la.q, la.k, la.v],
            la.att_out,
            flow.d_att_out,
            la.lse,
            attention_shape(c, acts),
        )?;
        let d = c.head_dim;
        let (pos, cos, sin) = (
            acts.u(&a.positions)?,
            acts.f(&a.rope_cos)?,
            acts.f(&a.rope_sin)?,
        );
        gpu.rope_backward(flow.d_q, pos, cos, sin, c.num_heads, d)?;
        gpu.rope_backward(flow.d_k, pos, cos, sin, c.num_kv_heads, d)?;
        Ok(())
    }
}
