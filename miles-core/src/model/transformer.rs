//! The Llama decoder's forward and backward passes (the backward in `transformer/backward.rs`)
//! over flat parameter, gradient and activation buffers.
//!
//! The model owns no storage: the caller hands it `params`, `grads` and `acts` as slices (today
//! `Vec<f32>`, later views of memory-manager regions), cut by [`ParamLayout`] and
//! [`ActivationLayout`].

use std::sync::Arc;

use super::layout::{carve, layer_block};
use super::{ActivationLayout, LlamaConfig, ModelError, ParamKind, ParamLayout};
use crate::comm::Communicator;
use crate::ops::{
    AttentionShape, MatmulProfile, RopeTable, attention_forward, bias_forward,
    crossentropy_forward, embedding_forward, matmul_forward, residual_forward, rmsnorm_forward,
    rope_forward, swiglu_forward,
};

mod backward;

/// Sums `buf` over the tensor-parallel group, when there is one.
fn all_reduce(tp: Option<&dyn Communicator>, buf: &mut [f32]) -> Result<(), ModelError> {
    match tp {
        Some(comm) if comm.world_size() > 1 => Ok(comm.all_reduce_sum(buf)?),
        _ => Ok(()),
    }
}

/// One training (or scoring) batch of `B` sequences of `T` positions.
#[derive(Clone, Copy, Debug)]
pub struct TrainBatch<'a> {
    /// `B`.
    pub batch: usize,
    /// `T`.
    pub seq: usize,
    /// Input token ids `(B, T)`.
    pub inputs: &'a [u32],
    /// Target token ids `(B, T)`: the token each position predicts.
    pub targets: &'a [u32],
    /// Weight of each target in the loss `(B, T)`: 0 masks it, an advantage scales it.
    pub weights: &'a [f32],
    /// The loss is the weighted sum of negative log-probs divided by this.
    pub normaliser: f32,
    /// Which targets' entropy the step measures and rewards `(B, T)`, 1 on response tokens and
    /// 0 elsewhere; `None` measures none.
    pub entropy_mask: Option<&'a [f32]>,
    /// The entropy bonus: the loss falls by `entropy_coef * Σ mask_t H_t / normaliser` (with the
    /// loop's batches, whose normaliser counts the response tokens, the coefficient times their
    /// mean entropy); 0 adds nothing.
    pub entropy_coef: f32,
}

impl<'a> TrainBatch<'a> {
    /// Sequences `range` of the batch (`range` inside `0..batch`), with the same normaliser.
    pub fn sequences(&self, range: std::ops::Range<usize>) -> TrainBatch<'a> {
        let t = self.seq;
        let tokens = range.start * t..range.end * t;
        TrainBatch {
            batch: range.len(),
            seq: t,
            inputs: &self.inputs[tokens.clone()],
            targets: &self.targets[tokens.clone()],
            weights: &self.weights[tokens.clone()],
            normaliser: self.normaliser,
            entropy_mask: self.entropy_mask.map(|m| &m[tokens]),
            entropy_coef: self.entropy_coef,
        }
    }

    /// The batch cut into runs of at most `size` whole sequences (`None`: the batch itself),
    /// each with the batch's normaliser, so that their losses and gradients add up to the
    /// batch's.
    pub fn micro_batches(&self, size: Option<usize>) -> Vec<TrainBatch<'a>> {
        let per = size.unwrap_or(self.batch).max(1);
        (0..self.batch)
            .step_by(per)
            .map(|first| self.sequences(first..(first + per).min(self.batch)))
            .collect()
    }

    /// `Σ mask_t H_t / normaliser` of `entropy (B, T)`, the per-position entropies of this
    /// batch; `None` without an entropy mask.
    pub fn entropy_sum(&self, entropy: &[f32]) -> Option<f32> {
        let mask = self.entropy_mask?;
        let sum: f64 = mask
            .iter()
            .zip(entropy)
            .map(|(&m, &h)| f64::from(m) * f64::from(h))
            .sum();
        Some((sum / f64::from(self.normaliser)) as f32)
    }

    /// Rank `rank`'s part of the batch over `world` data-parallel ranks: a contiguous run of
    /// whole sequences (the first `batch % world` ranks take one more), with the whole batch's
    /// normaliser, so that the ranks' gradients and losses add up to the batch's.
    ///
    /// # Errors
    /// [`ModelError::Batch`] for a rank outside the world, or fewer sequences than ranks.
    pub fn shard(&self, rank: usize, world: usize) -> Result<TrainBatch<'a>, ModelError> {
        if rank >= world || self.batch < world {
            return Err(ModelError::Batch(format!(
                "cannot give rank {rank} of {world} a part of a batch of {} sequences; every data-parallel rank needs at least one sequence",
                self.batch
            )));
        }
        let (per, extra) = (self.batch / world, self.batch % world);
        let first = rank * per + rank.min(extra);
        let len = per + usize::from(rank < extra);
        Ok(self.sequences(first..first + len))
    }
}

/// The weights of one decoder layer, as views of the parameter buffer.
pub(crate) struct LayerWeights<'a> {
    pub input_norm: &'a [f32],
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub o: &'a [f32],
    pub post_norm: &'a [f32],
    pub gate: &'a [f32],
    pub up: &'a [f32],
    pub down: &'a [f32],
    /// The q/k/v biases, for the families that have them.
    pub qkv_bias: Option<[&'a [f32]; 3]>,
    /// The per-head q and k norm weights, for the families that have them.
    pub qk_norm: Option<[&'a [f32]; 2]>,
}

/// The Llama decoder: config, parameter table and rotary tables; no storage.
#[derive(Clone, Debug)]
pub struct Transformer {
    config: LlamaConfig,
    layout: ParamLayout,
    rope: RopeTable,
    profile: Option<Arc<MatmulProfile>>,
}

impl Transformer {
    /// The model of `config`.
    pub fn new(config: LlamaConfig) -> Self {
        let layout = ParamLayout::new(&config);
        let rope = config.rope_table();
        Self {
            config,
            layout,
            rope,
            profile: None,
        }
    }

    /// Records every matrix product's shape and time into `profile` from now on.
    pub fn with_profile(mut self, profile: Arc<MatmulProfile>) -> Self {
        self.profile = Some(profile);
        self
    }

    /// The config.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The parameter table (also the layout of gradients and optimizer moments).
    pub fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    pub(crate) fn rope(&self) -> &RopeTable {
        &self.rope
    }

    pub(crate) fn profile(&self) -> Option<&MatmulProfile> {
        self.profile.as_deref()
    }

    /// The activation table for `batch` sequences of `seq` positions.
    ///
    /// # Errors
    /// [`ModelError::Batch`] when `seq` exceeds `max_position_embeddings` or a size is zero.
    pub fn activation_layout(
        &self,
        batch: usize,
        seq: usize,
    ) -> Result<ActivationLayout, ModelError> {
        if batch == 0 || seq == 0 {
            return Err(ModelError::Batch(format!(
                "batch {batch} x seq {seq} is empty; give at least one sequence of one token"
            )));
        }
        if seq > self.config.max_position_embeddings {
            return Err(ModelError::Batch(format!(
                "sequence of {seq} positions exceeds max_position_embeddings {}; shorten it",
                self.config.max_position_embeddings
            )));
        }
        Ok(ActivationLayout::new(&self.config, batch, seq))
    }

    pub(crate) fn weight<'a>(&self, params: &'a [f32], kind: ParamKind, layer: usize) -> &'a [f32] {
        &params[self.layout.range(kind, layer)]
    }

    pub(crate) fn layer_weights<'a>(&self, params: &'a [f32], l: usize) -> LayerWeights<'a> {
        self.layer_weights_in(&params[self.layout.layer_range(l)], l)
    }

    /// The weights of layer `l` as views of `weights`, the layer's block of the parameter buffer.
    pub(super) fn layer_weights_in<'a>(&self, weights: &'a [f32], l: usize) -> LayerWeights<'a> {
        let base = self.layout.layer_range(l).start;
        let w = |k| {
            let r = self.layout.range(k, l);
            &weights[r.start - base..r.end - base]
        };
        let has = |k| self.layout.get(k, l).is_some();
        LayerWeights {
            qkv_bias: has(ParamKind::QBias).then(|| {
                [
                    w(ParamKind::QBias),
                    w(ParamKind::KBias),
                    w(ParamKind::VBias),
                ]
            }),
            qk_norm: has(ParamKind::QNorm).then(|| [w(ParamKind::QNorm), w(ParamKind::KNorm)]),
            input_norm: w(ParamKind::InputNorm),
            q: w(ParamKind::QProj),
            k: w(ParamKind::KProj),
            v: w(ParamKind::VProj),
            o: w(ParamKind::OProj),
            post_norm: w(ParamKind::PostAttentionNorm),
            gate: w(ParamKind::GateProj),
            up: w(ParamKind::UpProj),
            down: w(ParamKind::DownProj),
        }
    }

    /// Checks token ids against the vocabulary.
    pub(crate) fn check_tokens(&self, ids: &[u32]) -> Result<(), ModelError> {
        match ids
            .iter()
            .position(|&id| id as usize >= self.config.vocab_size)
        {
            Some(position) => Err(ModelError::TokenOutOfRange {
                id: ids[position],
                position,
                vocab: self.config.vocab_size,
            }),
            None => Ok(()),
        }
    }

    pub(super) fn check_batch(
        &self,
        al: &ActivationLayout,
        b: &TrainBatch<'_>,
    ) -> Result<(), ModelError> {
        let n = b.batch * b.seq;
        if al.batch != b.batch || al.seq != b.seq {
            return Err(ModelError::Batch(format!(
                "batch is {} x {} but the activation layout is {} x {}; build the layout for this batch",
                b.batch, b.seq, al.batch, al.seq
            )));
        }
        for (what, len) in [
            ("inputs", b.inputs.len()),
            ("targets", b.targets.len()),
            ("weights", b.weights.len()),
            ("entropy mask", b.entropy_mask.map_or(n, <[f32]>::len)),
        ] {
            if len != n {
                return Err(ModelError::Batch(format!(
                    "{what} has {len} entries, batch {} x seq {} needs {n}",
                    b.batch, b.seq
                )));
            }
        }
        if !(b.normaliser.is_finite() && b.normaliser > 0.0) {
            return Err(ModelError::Batch(format!(
                "normaliser {} must be positive and finite",
                b.normaliser
            )));
        }
        if b.entropy_coef != 0.0 && b.entropy_mask.is_none() {
            return Err(ModelError::Batch(format!(
                "entropy coefficient {} without an entropy mask; mark the response tokens",
                b.entropy_coef
            )));
        }
        self.check_tokens(b.inputs)?;
        self.check_tokens(b.targets)
    }

    /// Runs the forward pass and returns the loss; logits, per-token log-probs and everything the
    /// backward pass needs are left in `acts`.
    ///
    /// # Errors
    /// [`ModelError::BufferLength`] for buffers of the wrong length, [`ModelError::Batch`] or
    /// [`ModelError::TokenOutOfRange`] for a bad batch.
    pub fn forward(
        &self,
        params: &[f32],
        acts: &mut [f32],
        al: &ActivationLayout,
        batch: &TrainBatch<'_>,
    ) -> Result<f32, ModelError> {
        self.forward_tp(params, acts, al, batch, None)
    }

    /// [`forward`](Self::forward) of one tensor-parallel shard: this model's config holds the
    /// rank's heads and MLP slice (`H/tp`, `K/tp`, `F/tp`), its q, k, v, gate and up weights
    /// are the rank's rows (column-parallel), its o and down weights the rank's columns
    /// (row-parallel), and the partial sums of o and down are summed over `tp` before the
    /// residual. Embedding, norms and head are replicated. `None` is the unsharded model.
    ///
    /// # Errors
    /// As [`forward`](Self::forward), and [`ModelError::Comm`] when the all-reduce fails.
    pub fn forward_tp(
        &self,
        params: &[f32],
        acts: &mut [f32],
        al: &ActivationLayout,
        batch: &TrainBatch<'_>,
        tp: Option<&dyn Communicator>,
    ) -> Result<f32, ModelError> {
        self.layout.check("params", params)?;
        al.check(acts)?;
        self.check_batch(al, batch)?;
        let emb = self.weight(params, ParamKind::Embedding, 0);
        self.embed_forward_unchecked(emb, acts, al, batch);
        for l in 0..self.config.num_layers {
            let w = self.layer_weights(params, l);
            self.layer_forward_unchecked(l, &w, acts, al, batch, tp)?;
        }
        let norm_w = self.weight(params, ParamKind::FinalNorm, 0);
        let head = self.weight(params, ParamKind::LmHead, 0);
        self.head_forward_unchecked(norm_w, head, acts, al, batch)
    }

    pub(super) fn embed_forward_unchecked(
        &self,
        embedding: &[f32],
        acts: &mut [f32],
        al: &ActivationLayout,
        batch: &TrainBatch<'_>,
    ) {
        let l_n = self.config.num_layers;
        embedding_forward(
            &mut acts[layer_block(&al.residual, 0, l_n + 1)],
            batch.inputs,
            embedding,
            self.config.hidden_size,
        );
    }

    /// Layer `l`'s forward pass; with `tp`, the row-parallel partial sums are summed over it.
    pub(super) fn layer_forward_unchecked(
        &self,
        l: usize,
        w: &LayerWeights<'_>,
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
        let [
            res_in,
            ln1,
            rstd1,
            q,
            k,
            vv,
            q_pre,
            k_pre,
            q_rstd,
            k_rstd,
            att,
            att_out,
            res_mid,
            ln2,
            rstd2,
            gate,
            up,
            sw,
            res_out,
        ] = carve(
            acts,
            [
                &layer_block(&al.residual, l, l_n + 1),
                &layer_block(&al.ln1, l, l_n),
                &layer_block(&al.ln1_rstd, l, l_n),
                &layer_block(&al.q, l, l_n),
                &layer_block(&al.k, l, l_n),
                &layer_block(&al.v, l, l_n),
                &layer_block(&al.q_pre, l, l_n),
                &layer_block(&al.k_pre, l, l_n),
                &layer_block(&al.q_rstd, l, l_n),
                &layer_block(&al.k_rstd, l, l_n),
                &layer_block(&al.att, l, l_n),
                &layer_block(&al.att_out, l, l_n),
                &layer_block(&al.residual_mid, l, l_n),
                &layer_block(&al.ln2, l, l_n),
                &layer_block(&al.ln2_rstd, l, l_n),
                &layer_block(&al.gate, l, l_n),
                &layer_block(&al.up, l, l_n),
                &layer_block(&al.swiglu, l, l_n),
                &layer_block(&al.residual, l + 1, l_n + 1),
            ],
        )
        .ok_or_else(overlap)?;
        rmsnorm_forward(ln1, rstd1, res_in, w.input_norm, c.rms_norm_eps); // (B, T, C)
        // With q/k norms the projections land in q_pre and k_pre and are normed into q and k.
        let (q_lin, k_lin) = match w.qk_norm {
            Some(_) => (&mut *q_pre, &mut *k_pre),
            None => (&mut *q, &mut *k),
        };
        matmul_forward(q_lin, ln1, w.q, n, h, qd, prof)?; // (B, T, H*D)
        matmul_forward(k_lin, ln1, w.k, n, h, kvd, prof)?; // (B, T, K*D)
        matmul_forward(vv, ln1, w.v, n, h, kvd, prof)?; // (B, T, K*D)
        if let Some([qb, kb, vb]) = w.qkv_bias {
            bias_forward(q_lin, qb);
            bias_forward(k_lin, kb);
            bias_forward(vv, vb);
        }
        if let Some([qn, kn]) = w.qk_norm {
            rmsnorm_forward(q, q_rstd, q_pre, qn, c.rms_norm_eps); // (B, T, H, D)
            rmsnorm_forward(k, k_rstd, k_pre, kn, c.rms_norm_eps); // (B, T, K, D)
        }
        rope_forward(q, &positions, c.num_heads, &self.rope);
        rope_forward(k, &positions, c.num_kv_heads, &self.rope);
        attention_forward(att_out, att, q, k, vv, shape)?; // (B, T, H*D), (B, T, H, T)
        matmul_forward(res_mid, att_out, w.o, n, qd, h, prof)?; // (B, T, C)
        all_reduce(tp, res_mid)?;
        residual_forward(res_mid, res_in);
        rmsnorm_forward(ln2, rstd2, res_mid, w.post_norm, c.rms_norm_eps);
        matmul_forward(gate, ln2, w.gate, n, h, f, prof)?; // (B, T, F)
        matmul_forward(up, ln2, w.up, n, h, f, prof)?; // (B, T, F)
        swiglu_forward(sw, gate, up);
        matmul_forward(res_out, sw, w.down, n, f, h, prof)?; // (B, T, C)
        all_reduce(tp, res_out)?;
        residual_forward(res_out, res_mid);
        Ok(())
    }

    pub(super) fn head_forward_unchecked(
        &self,
        norm_w: &[f32],
        head: &[f32],
        acts: &mut [f32],
        al: &ActivationLayout,
        batch: &TrainBatch<'_>,
    ) -> Result<f32, ModelError> {
        let c = &self.config;
        let (n, h, l_n, v) = (
            batch.batch * batch.seq,
            c.hidden_size,
            c.num_layers,
            c.vocab_size,
        );
        let [res_last, lnf, lnf_rstd, logits, probs, logprobs, entropy] = carve(
            acts,
            [
                &layer_block(&al.residual, l_n, l_n + 1),
                &al.lnf,
                &al.lnf_rstd,
                &al.logits,
                &al.probs,
                &al.logprobs,
                &al.entropy,
            ],
        )
        .ok_or_else(overlap)?;
        rmsnorm_forward(lnf, lnf_rstd, res_last, norm_w, c.rms_norm_eps);
        matmul_forward(logits, lnf, head, n, h, v, self.profile())?; // (B, T, V)
        let mut loss = crossentropy_forward(
            probs,
            logprobs,
            entropy,
            logits,
            batch.targets,
            batch.weights,
            batch.normaliser,
        );
        if batch.entropy_coef != 0.0
            && let Some(bonus) = batch.entropy_sum(entropy)
        {
            loss -= f64::from(batch.entropy_coef) * f64::from(bonus);
        }
        Ok(loss as f32)
    }

    fn attention_shape(&self, batch: &TrainBatch<'_>) -> AttentionShape {
        AttentionShape {
            batch: batch.batch,
            seq: batch.seq,
            heads: self.config.num_heads,
            kv_heads: self.config.num_kv_heads,
            head_dim: self.config.head_dim,
        }
    }

    /// The per-token log-probs the last forward pass left in `acts`, `(B, T)`.
    pub fn logprobs<'a>(al: &ActivationLayout, acts: &'a [f32]) -> &'a [f32] {
        &acts[al.logprobs.clone()]
    }

    /// The entropy of each position's distribution the last forward pass left in `acts`,
    /// `(B, T)`.
    pub fn entropies<'a>(al: &ActivationLayout, acts: &'a [f32]) -> &'a [f32] {
        &acts[al.entropy.clone()]
    }

    /// The logits the last forward pass left in `acts`, `(B, T, V)`.
    pub fn logits<'a>(al: &ActivationLayout, acts: &'a [f32]) -> &'a [f32] {
        &acts[al.logits.clone()]
    }
}

/// The error of activation ranges that overlap (a broken [`ActivationLayout`]).
fn overlap() -> ModelError {
    ModelError::Batch("activation ranges overlap".into())
}
