//! The decoder's backward pass: the chain rule of the forward pass, op for op, accumulating
//! into the flat gradient buffer.

use super::{LayerWeights, TrainBatch, Transformer, all_reduce, overlap};
use crate::comm::Communicator;
use crate::model::layout::{carve, layer_block};
use crate::model::{ActivationLayout, ModelError, ParamKind};
use crate::ops::{
    attention_backward, bias_backward, crossentropy_backward, embedding_backward, entropy_backward,
    matmul_backward, rmsnorm_backward, rope_backward, swiglu_backward,
};

impl Transformer {
    /// Runs the backward pass of the last [`forward`](Self::forward) on the same batch,
    /// accumulating into `grads` (`+=`: zero them first for a fresh step).
    ///
    /// # Errors
    /// As [`forward`](Self::forward).
    pub fn backward(
        &self,
        params: &[f32],
        grads: &mut [f32],
        acts: &mut [f32],
        al: &ActivationLayout,
        batch: &TrainBatch<'_>,
    ) -> Result<(), ModelError> {
        self.backward_tp(params, grads, acts, al, batch, None)
    }

    /// [`backward`](Self::backward) of one tensor-parallel shard (see
    /// [`forward_tp`](Self::forward_tp)): the gradients flowing into the replicated norms are
    /// summed over `tp`, so replicated parameters get the same gradient on every rank.
    ///
    /// # Errors
    /// As [`forward_tp`](Self::forward_tp).
    pub fn backward_tp(
        &self,
        params: &[f32],
        grads: &mut [f32],
        acts: &mut [f32],
        al: &ActivationLayout,
        batch: &TrainBatch<'_>,
        tp: Option<&dyn Communicator>,
    ) -> Result<(), ModelError> {
        self.layout.check("params", params)?;
        self.layout.check("grads", grads)?;
        al.check(acts)?;
        self.check_batch(al, batch)?;
        let lay = &self.layout;
        let norm_w = self.weight(params, ParamKind::FinalNorm, 0);
        let head = self.weight(params, ParamKind::LmHead, 0);
        let [d_norm, d_head] = carve(
            grads,
            [
                &lay.range(ParamKind::FinalNorm, 0),
                &lay.range(ParamKind::LmHead, 0),
            ],
        )
        .ok_or_else(overlap)?;
        self.head_backward_unchecked(norm_w, head, d_norm, d_head, acts, al, batch)?;
        for l in (0..self.config.num_layers).rev() {
            let w = self.layer_weights(params, l);
            let d_w = &mut grads[lay.layer_range(l)];
            self.layer_backward_unchecked(l, &w, d_w, acts, al, batch, tp)?;
        }
        let d_emb = &mut grads[lay.range(ParamKind::Embedding, 0)];
        self.embed_backward_unchecked(d_emb, acts, al, batch);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(in crate::model) fn head_backward_unchecked(
        &self,
        norm_w: &[f32],
        head: &[f32],
        d_norm: &mut [f32],
        d_head: &mut [f32],
        acts: &mut [f32],
        al: &ActivationLayout,
        batch: &TrainBatch<'_>,
    ) -> Result<(), ModelError> {
        let c = &self.config;
        let (n, h, l_n, v) = (
            batch.batch * batch.seq,
            c.hidden_size,
            c.num_layers,
            c.vocab_size,
        );
        let [
            res_last,
            lnf,
            lnf_rstd,
            logits,
            probs,
            d_logits,
            d_ln,
            d_res,
        ] = carve(
            acts,
            [
                &layer_block(&al.residual, l_n, l_n + 1),
                &al.lnf,
                &al.lnf_rstd,
                &al.logits,
                &al.probs,
                &al.d_logits,
                &al.d_ln,
                &al.d_residual,
            ],
        )
        .ok_or_else(overlap)?;
        d_logits.fill(0.0);
        crossentropy_backward(
            d_logits,
            probs,
            batch.targets,
            batch.weights,
            batch.normaliser,
        );
        if batch.entropy_coef != 0.0
            && let Some(mask) = batch.entropy_mask
        {
            entropy_backward(
                d_logits,
                probs,
                logits,
                mask,
                batch.entropy_coef,
                batch.normaliser,
            );
        }
        d_ln.fill(0.0);
        matmul_backward(d_ln, d_head, d_logits, lnf, head, n, h, v, self.profile())?;
        d_res.fill(0.0);
        rmsnorm_backward(d_res, d_norm, d_ln, res_last, norm_w, lnf_rstd);
        Ok(())
    }

    /// Layer `l`'s backward pass; with `tp`, the gradients flowing into the replicated norms
    /// are summed over it.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::model) fn layer_backward_unchecked(
        &self,
        l: usize,
        w: &LayerWeights<'_>,
        d_weights: &mut [f32],
        acts: &mut [f32],
        al: &ActivationLayout,
        batch: &TrainBatch<'_>,
        tp: Option<&dyn Communicator>,
    ) -> Result<(), ModelError> {
        let c = &self.config;
        let (n, h, l_n) = (batch.batch * batch.seq, c.hidden_size, c.num_layers);
        let (qd, kvd, f) = (c.q_dim(), c.kv_dim(), c.intermediate_size);
        let positions: Vec<usize> = (0..n).map(|i| i % batch.seq).collect();
        let shape = self.attention_shape(batch);
        let prof = self.profile();
        let lay = &self.layout;
        let [
            res_in,
            ln1,
            rstd1,
            q,
            k,
            vv,
            att,
            att_out,
            res_mid,
            ln2,
            rstd2,
            gate,
            up,
            sw,
            q_pre,
            k_pre,
            q_rstd,
            k_rstd,
            d_res,
            d_ln,
            d_att_out,
            d_q,
            d_k,
            d_v,
            d_q_pre,
            d_k_pre,
            d_att,
            d_gate,
            d_up,
            d_sw,
        ] = carve(
            acts,
            [
                &layer_block(&al.residual, l, l_n + 1),
                &layer_block(&al.ln1, l, l_n),
                &layer_block(&al.ln1_rstd, l, l_n),
                &layer_block(&al.q, l, l_n),
                &layer_block(&al.k, l, l_n),
                &layer_block(&al.v, l, l_n),
                &layer_block(&al.att, l, l_n),
                &layer_block(&al.att_out, l, l_n),
                &layer_block(&al.residual_mid, l, l_n),
                &layer_block(&al.ln2, l, l_n),
                &layer_block(&al.ln2_rstd, l, l_n),
                &layer_block(&al.gate, l, l_n),
                &layer_block(&al.up, l, l_n),
                &layer_block(&al.swiglu, l, l_n),
                &layer_block(&al.q_pre, l, l_n),
                &layer_block(&al.k_pre, l, l_n),
                &layer_block(&al.q_rstd, l, l_n),
                &layer_block(&al.k_rstd, l, l_n),
                &al.d_residual,
                &al.d_ln,
                &al.d_att_out,
                &al.d_q,
                &al.d_k,
                &al.d_v,
                &al.d_q_pre,
                &al.d_k_pre,
                &al.d_att,
                &al.d_gate,
                &al.d_up,
                &al.d_swiglu,
            ],
        )
        .ok_or_else(overlap)?;
        // Gradient ranges within the layer's block.
        let base = lay.layer_range(l).start;
        let g = |k: ParamKind| {
            let r = lay.range(k, l);
            r.start - base..r.end - base
        };
        let grads = d_weights;
        // MLP: res_out = res_mid + down(swiglu(gate(ln2), up(ln2))); d_res holds d res_out.
        d_sw.fill(0.0);
        matmul_backward(
            d_sw,
            &mut grads[g(ParamKind::DownProj)],
            d_res,
            sw,
            w.down,
            n,
            f,
            h,
            prof,
        )?;
        d_gate.fill(0.0);
        d_up.fill(0.0);
        swiglu_backward(d_gate, d_up, d_sw, gate, up);
        d_ln.fill(0.0);
        matmul_backward(
            d_ln,
            &mut grads[g(ParamKind::GateProj)],
            d_gate,
            ln2,
            w.gate,
            n,
            h,
            f,
            prof,
        )?;
        matmul_backward(
            d_ln,
            &mut grads[g(ParamKind::UpProj)],
            d_up,
            ln2,
            w.up,
            n,
            h,
            f,
            prof,
        )?;
        all_reduce(tp, d_ln)?;
        rmsnorm_backward(
            d_res,
            &mut grads[g(ParamKind::PostAttentionNorm)],
            d_ln,
            res_mid,
            w.post_norm,
            rstd2,
        );
        // Attention: res_mid = res_in + o(attention(rope(q(ln1)), rope(k(ln1)), v(ln1))).
        d_att_out.fill(0.0);
        matmul_backward(
            d_att_out,
            &mut grads[g(ParamKind::OProj)],
            d_res,
            att_out,
            w.o,
            n,
            qd,
            h,
            prof,
        )?;
        d_q.fill(0.0);
        d_k.fill(0.0);
        d_v.fill(0.0);
        attention_backward(d_q, d_k, d_v, d_att, d_att_out, q, k, vv, att, shape)?;
        rope_backward(d_q, &positions, c.num_heads, &self.rope);
        rope_backward(d_k, &positions, c.num_kv_heads, &self.rope);
        // The gradients of the projections' outputs: through the q/k norms when there are.
        let (dq_lin, dk_lin) = match w.qk_norm {
            Some([qn, kn]) => {
                d_q_pre.fill(0.0);
                d_k_pre.fill(0.0);
                for (kind, d_pre, d_out, pre, weight, rstd) in [
                    (
                        ParamKind::QNorm,
                        &mut *d_q_pre,
                        &*d_q,
                        &*q_pre,
                        qn,
                        &*q_rstd,
                    ),
                    (
                        ParamKind::KNorm,
                        &mut *d_k_pre,
                        &*d_k,
                        &*k_pre,
                        kn,
                        &*k_rstd,
                    ),
                ] {
                    // Each tensor-parallel rank sees its own heads: sum the norm's gradient.
                    let mut d_weight = vec![0.0; weight.len()];
                    rmsnorm_backward(d_pre, &mut d_weight, d_out, pre, weight, rstd);
                    all_reduce(tp, &mut d_weight)?;
                    for (g, d) in grads[g(kind)].iter_mut().zip(&d_weight) {
                        *g += d;
                    }
                }
                (&*d_q_pre, &*d_k_pre)
            }
            None => (&*d_q, &*d_k),
        };
        if w.qkv_bias.is_some() {
            bias_backward(&mut grads[g(ParamKind::QBias)], dq_lin);
            bias_backward(&mut grads[g(ParamKind::KBias)], dk_lin);
            bias_backward(&mut grads[g(ParamKind::VBias)], d_v);
        }
        d_ln.fill(0.0);
        matmul_backward(
            d_ln,
            &mut grads[g(ParamKind::QProj)],
            dq_lin,
            ln1,
            w.q,
            n,
            h,
            qd,
            prof,
        )?;
        matmul_backward(
            d_ln,
            &mut grads[g(ParamKind::KProj)],
            dk_lin,
            ln1,
            w.k,
            n,
            h,
            kvd,
            prof,
        )?;
        matmul_backward(
            d_ln,
            &mut grads[g(ParamKind::VProj)],
            d_v,
            ln1,
            w.v,
            n,
            h,
            kvd,
            prof,
        )?;
        all_reduce(tp, d_ln)?;
        rmsnorm_backward(
            d_res,
            &mut grads[g(ParamKind::InputNorm)],
            d_ln,
            res_in,
            w.input_norm,
            rstd1,
        );
        Ok(())
    }

    pub(in crate::model) fn embed_backward_unchecked(
        &self,
        d_embedding: &mut [f32],
        acts: &[f32],
        al: &ActivationLayout,
        batch: &TrainBatch<'_>,
    ) {
        let d_res = &acts[al.d_residual.clone()];
        embedding_backward(d_embedding, d_res, batch.inputs, self.config.hidden_size);
    }
}
