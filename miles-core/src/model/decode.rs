//! Decoding with a KV cache: one new token per sequence, batched, attending to cached keys and
//! values.
//!
//! The cache is reached only through [`KvCache`], so the contiguous per-sequence cache here and
//! the inference engine's paged cache serve the same decode step.

use rayon::prelude::*;

use super::layout::layer_block;
use super::{LlamaConfig, ModelError, ParamKind, TrainBatch, Transformer};
use crate::ops::{
    bias_forward, embedding_forward, matmul_rows_forward, residual_forward, rmsnorm_forward,
    rope_forward, swiglu_forward,
};

/// Cached keys and values of every layer, per sequence and position.
pub trait KvCache {
    /// Positions cached for sequence `seq`.
    ///
    /// # Errors
    /// [`ModelError::KvCache`] for an unknown sequence.
    fn len(&self, seq: usize) -> Result<usize, ModelError>;

    /// Makes room for one more position of `seq` and returns its index.
    ///
    /// # Errors
    /// [`ModelError::KvCache`] when the sequence is unknown or full.
    fn grow(&mut self, seq: usize) -> Result<usize, ModelError>;

    /// Stores the key and value `(K*D)` of `seq` at `pos` in `layer`.
    ///
    /// # Errors
    /// [`ModelError::KvCache`] when `pos` was not made room for.
    fn write(
        &mut self,
        layer: usize,
        seq: usize,
        pos: usize,
        key: &[f32],
        value: &[f32],
    ) -> Result<(), ModelError>;

    /// The key `(K*D)` of `seq` at `pos` in `layer`; `pos` is below [`len`](Self::len).
    fn key(&self, layer: usize, seq: usize, pos: usize) -> &[f32];

    /// The value `(K*D)` of `seq` at `pos` in `layer`; `pos` is below [`len`](Self::len).
    fn value(&self, layer: usize, seq: usize, pos: usize) -> &[f32];
}

/// A KV cache with one contiguous `(L, T_max, K*D)` block of keys and one of values per sequence.
#[derive(Clone, Debug)]
pub struct ContiguousKvCache {
    layers: usize,
    max_len: usize,
    kv_dim: usize,
    keys: Vec<f32>,   // (S, L, T_max, K*D)
    values: Vec<f32>, // (S, L, T_max, K*D)
    lens: Vec<usize>, // (S)
}

impl ContiguousKvCache {
    /// A cache for `max_seqs` sequences of up to `max_len` positions under `config`.
    pub fn new(config: &LlamaConfig, max_seqs: usize, max_len: usize) -> Self {
        let size = max_seqs * config.num_layers * max_len * config.kv_dim();
        Self {
            layers: config.num_layers,
            max_len,
            kv_dim: config.kv_dim(),
            keys: vec![0.0; size],
            values: vec![0.0; size],
            lens: vec![0; max_seqs],
        }
    }

    /// Forgets sequence `seq`'s positions so the slot can hold a new sequence.
    ///
    /// # Errors
    /// [`ModelError::KvCache`] for an unknown sequence.
    pub fn reset(&mut self, seq: usize) -> Result<(), ModelError> {
        let len = self.lens.get_mut(seq).ok_or_else(|| unknown(seq))?;
        *len = 0;
        Ok(())
    }

    fn offset(&self, layer: usize, seq: usize, pos: usize) -> usize {
        ((seq * self.layers + layer) * self.max_len + pos) * self.kv_dim
    }
}

fn unknown(seq: usize) -> ModelError {
    ModelError::KvCache(format!("sequence {seq} has no slot in the cache"))
}

impl KvCache for ContiguousKvCache {
    fn len(&self, seq: usize) -> Result<usize, ModelError> {
        self.lens.get(seq).copied().ok_or_else(|| unknown(seq))
    }

    fn grow(&mut self, seq: usize) -> Result<usize, ModelError> {
        let max = self.max_len;
        let len = self.lens.get_mut(seq).ok_or_else(|| unknown(seq))?;
        if *len >= max {
            return Err(ModelError::KvCache(format!(
                "sequence {seq} is full at {max} positions; build the cache with a larger max_len"
            )));
        }
        *len += 1;
        Ok(*len - 1)
    }

    fn write(
        &mut self,
        layer: usize,
        seq: usize,
        pos: usize,
        key: &[f32],
        value: &[f32],
    ) -> Result<(), ModelError> {
        if pos >= self.len(seq)? || layer >= self.layers || key.len() != self.kv_dim {
            return Err(ModelError::KvCache(format!(
                "cannot write layer {layer} position {pos} of sequence {seq}: call grow first"
            )));
        }
        let o = self.offset(layer, seq, pos);
        self.keys[o..o + self.kv_dim].copy_from_slice(key);
        self.values[o..o + self.kv_dim].copy_from_slice(value);
        Ok(())
    }

    fn key(&self, layer: usize, seq: usize, pos: usize) -> &[f32] {
        let o = self.offset(layer, seq, pos);
        &self.keys[o..o + self.kv_dim]
    }

    fn value(&self, layer: usize, seq: usize, pos: usize) -> &[f32] {
        let o = self.offset(layer, seq, pos);
        &self.values[o..o + self.kv_dim]
    }
}

/// Working memory of a decode step for up to `B` sequences.
#[derive(Clone, Debug)]
pub struct DecodeScratch {
    batch: usize,
    x: Vec<f32>,         // (B, C) residual stream
    ln: Vec<f32>,        // (B, C)
    rstd: Vec<f32>,      // (B)
    q: Vec<f32>,         // (B, H*D)
    k: Vec<f32>,         // (B, K*D)
    q_pre: Vec<f32>,     // (B, H*D) before the q norm
    k_pre: Vec<f32>,     // (B, K*D) before the k norm
    head_rstd: Vec<f32>, // (B, H)
    v: Vec<f32>,         // (B, K*D)
    att_out: Vec<f32>,   // (B, H*D)
    proj: Vec<f32>,      // (B, C)
    gate: Vec<f32>,      // (B, F)
    up: Vec<f32>,        // (B, F)
    swiglu: Vec<f32>,    // (B, F)
    scores: Vec<f32>,    // (B, T_max)
    max_len: usize,
}

impl DecodeScratch {
    /// Scratch for up to `batch` sequences attending to up to `max_len` positions.
    pub fn new(config: &LlamaConfig, batch: usize, max_len: usize) -> Self {
        let (h, f) = (config.hidden_size, config.intermediate_size);
        Self {
            batch,
            x: vec![0.0; batch * h],
            ln: vec![0.0; batch * h],
            rstd: vec![0.0; batch],
            q: vec![0.0; batch * config.q_dim()],
            k: vec![0.0; batch * config.kv_dim()],
            q_pre: vec![0.0; usize::from(config.qk_norm) * batch * config.q_dim()],
            k_pre: vec![0.0; usize::from(config.qk_norm) * batch * config.kv_dim()],
            head_rstd: vec![0.0; usize::from(config.qk_norm) * batch * config.num_heads],
            v: vec![0.0; batch * config.kv_dim()],
            att_out: vec![0.0; batch * config.q_dim()],
            proj: vec![0.0; batch * h],
            gate: vec![0.0; batch * f],
            up: vec![0.0; batch * f],
            swiglu: vec![0.0; batch * f],
            scores: vec![0.0; batch * max_len],
            max_len,
        }
    }
}

impl Transformer {
    /// Appends `tokens[b]` to sequence `seqs[b]` of `cache` for every `b` and writes the next-token
    /// logits `(B, V)` into `logits`.
    ///
    /// Batch-invariant: every kernel works row by row in a fixed order (the linear layers run on
    /// [`matmul_rows_forward`]), so a sequence's logits are bit-identical whichever sequences
    /// share the step.
    ///
    /// # Errors
    /// [`ModelError::Batch`] for mismatched lengths, repeated sequences or a batch larger than
    /// the scratch; [`ModelError::TokenOutOfRange`]; [`ModelError::KvCache`] from the cache.
    pub fn decode_step<K: KvCache + Sync>(
        &self,
        params: &[f32],
        cache: &mut K,
        seqs: &[usize],
        tokens: &[u32],
        logits: &mut [f32],
        scratch: &mut DecodeScratch,
    ) -> Result<(), ModelError> {
        let c = self.config();
        let b_n = seqs.len();
        let (h, qd, kvd, f, v) = (
            c.hidden_size,
            c.q_dim(),
            c.kv_dim(),
            c.intermediate_size,
            c.vocab_size,
        );
        self.layout().check("params", params)?;
        if tokens.len() != b_n || logits.len() != b_n * v || b_n > scratch.batch {
            return Err(ModelError::Batch(format!(
                "decode step of {b_n} sequences got {} tokens, {} logits (need {}), scratch for {}",
                tokens.len(),
                logits.len(),
                b_n * v,
                scratch.batch
            )));
        }
        if (1..b_n).any(|i| seqs[..i].contains(&seqs[i])) {
            return Err(ModelError::Batch(
                "a sequence appears twice in one decode step; give each sequence one token".into(),
            ));
        }
        self.check_tokens(tokens)?;
        let mut positions = Vec::with_capacity(b_n);
        for &s in seqs {
            let pos = cache.len(s)?;
            if pos >= scratch.max_len || pos >= c.max_position_embeddings {
                return Err(ModelError::KvCache(format!(
                    "sequence {s} at position {pos} is past the scratch ({}) or the model's positions ({})",
                    scratch.max_len, c.max_position_embeddings
                )));
            }
            positions.push(cache.grow(s)?);
        }
        let eps = c.rms_norm_eps;
        let s = scratch;
        let x = &mut s.x[..b_n * h];
        embedding_forward(x, tokens, self.weight(params, ParamKind::Embedding, 0), h);
        for l in 0..c.num_layers {
            let w = self.layer_weights(params, l);
            let (ln, rstd) = (&mut s.ln[..b_n * h], &mut s.rstd[..b_n]);
            let (q, k, vv) = (
                &mut s.q[..b_n * qd],
                &mut s.k[..b_n * kvd],
                &mut s.v[..b_n * kvd],
            );
            rmsnorm_forward(ln, rstd, x, w.input_norm, eps); // (B, C)
            let (q_pre, k_pre) = (&mut s.q_pre[..], &mut s.k_pre[..]);
            let (q_lin, k_lin) = match w.qk_norm {
                Some(_) => (&mut q_pre[..b_n * qd], &mut k_pre[..b_n * kvd]),
                None => (&mut *q, &mut *k),
            };
            matmul_rows_forward(q_lin, ln, w.q, b_n, h, qd)?; // (B, H*D)
            matmul_rows_forward(k_lin, ln, w.k, b_n, h, kvd)?; // (B, K*D)
            matmul_rows_forward(vv, ln, w.v, b_n, h, kvd)?; // (B, K*D)
            if let Some([qb, kb, vb]) = w.qkv_bias {
                bias_forward(q_lin, qb);
                bias_forward(k_lin, kb);
                bias_forward(vv, vb);
            }
            if let Some([qn, kn]) = w.qk_norm {
                let rstd = &mut s.head_rstd[..b_n * c.num_heads];
                rmsnorm_forward(q, rstd, &q_pre[..b_n * qd], qn, eps); // (B, H, D)
                let rstd = &mut rstd[..b_n * c.num_kv_heads];
                rmsnorm_forward(k, rstd, &k_pre[..b_n * kvd], kn, eps); // (B, K, D)
            }
            rope_forward(q, &positions, c.num_heads, self.rope());
            rope_forward(k, &positions, c.num_kv_heads, self.rope());
            for (b, &seq) in seqs.iter().enumerate() {
                cache.write(
                    l,
                    seq,
                    positions[b],
                    &k[b * kvd..(b + 1) * kvd],
                    &vv[b * kvd..(b + 1) * kvd],
                )?;
            }
            let att_out = &mut s.att_out[..b_n * qd];
            attention_decode(
                att_out,
                &mut s.scores,
                q,
                &*cache,
                l,
                seqs,
                &positions,
                c,
                s.max_len,
            );
            let proj = &mut s.proj[..b_n * h];
            matmul_rows_forward(proj, att_out, w.o, b_n, qd, h)?;
            residual_forward(x, proj);
            rmsnorm_forward(ln, rstd, x, w.post_norm, eps);
            let (gate, up, sw) = (
                &mut s.gate[..b_n * f],
                &mut s.up[..b_n * f],
                &mut s.swiglu[..b_n * f],
            );
            matmul_rows_forward(gate, ln, w.gate, b_n, h, f)?; // (B, F)
            matmul_rows_forward(up, ln, w.up, b_n, h, f)?; // (B, F)
            swiglu_forward(sw, gate, up);
            matmul_rows_forward(proj, sw, w.down, b_n, f, h)?; // (B, C)
            residual_forward(x, proj);
        }
        let (ln, rstd) = (&mut s.ln[..b_n * h], &mut s.rstd[..b_n]);
        rmsnorm_forward(
            ln,
            rstd,
            x,
            self.weight(params, ParamKind::FinalNorm, 0),
            eps,
        );
        matmul_rows_forward(
            logits,
            ln,
            self.weight(params, ParamKind::LmHead, 0),
            b_n,
            h,
            v,
        )?;
        Ok(())
    }
}

impl Transformer {
    /// Runs a prompt through the full forward pass, stores every position's keys and values in
    /// the empty sequence `seq` of `cache`, and writes the last position's logits `(V)`.
    ///
    /// Decoding then continues with [`decode_step`](Self::decode_step) from the next position.
    ///
    /// # Errors
    /// [`ModelError::KvCache`] when the sequence is not empty or too short for the prompt;
    /// as [`forward`](Self::forward).
    pub fn prefill<K: KvCache>(
        &self,
        params: &[f32],
        cache: &mut K,
        seq: usize,
        tokens: &[u32],
        logits: &mut [f32],
    ) -> Result<(), ModelError> {
        let c = self.config();
        let (t, v, kvd, l_n) = (tokens.len(), c.vocab_size, c.kv_dim(), c.num_layers);
        if cache.len(seq)? != 0 {
            return Err(ModelError::KvCache(format!(
                "prefill needs an empty sequence, {seq} already holds {} positions",
                cache.len(seq)?
            )));
        }
        if logits.len() != v {
            return Err(ModelError::Batch(format!(
                "prefill writes {v} logits, got a buffer of {}",
                logits.len()
            )));
        }
        let al = self.activation_layout(1, t)?;
        let mut acts = vec![0.0; al.len()];
        let weights = vec![0.0; t];
        let batch = TrainBatch {
            batch: 1,
            seq: t,
            inputs: tokens,
            targets: tokens,
            weights: &weights,
            normaliser: 1.0,
            entropy_mask: None,
            entropy_coef: 0.0,
        };
        self.forward(params, &mut acts, &al, &batch)?;
        for pos in 0..t {
            cache.grow(seq)?;
            for l in 0..l_n {
                let (k, vv) = (layer_block(&al.k, l, l_n), layer_block(&al.v, l, l_n));
                let at = |r: std::ops::Range<usize>| r.start + pos * kvd..r.start + (pos + 1) * kvd;
                cache.write(l, seq, pos, &acts[at(k)], &acts[at(vv)])?;
            }
        }
        logits.copy_from_slice(&Transformer::logits(&al, &acts)[(t - 1) * v..t * v]);
        Ok(())
    }
}

/// One query row per sequence against its cached keys and values, in the same order of
/// operations as the full forward pass so the logits agree.
#[allow(clippy::too_many_arguments)]
fn attention_decode<K: KvCache + Sync>(
    out: &mut [f32],
    scores: &mut [f32],
    q: &[f32],
    cache: &K,
    layer: usize,
    seqs: &[usize],
    positions: &[usize],
    c: &LlamaConfig,
    max_len: usize,
) {
    let (d, heads, group) = (c.head_dim, c.num_heads, c.num_heads / c.num_kv_heads);
    let qd = heads * d;
    let scale = 1.0 / (d as f32).sqrt();
    out.par_chunks_mut(qd)
        .zip(scores.par_chunks_mut(max_len))
        .enumerate()
        .for_each(|(b, (o, sc))| {
            let (seq, t) = (seqs[b], positions[b]);
            for h in 0..heads {
                let kv_off = (h / group) * d;
                let qh = &q[b * qd + h * d..b * qd + (h + 1) * d];
                let mut max = f32::NEG_INFINITY;
                for (u, p) in sc.iter_mut().enumerate().take(t + 1) {
                    let kr = &cache.key(layer, seq, u)[kv_off..kv_off + d];
                    *p = qh.iter().zip(kr).map(|(x, y)| x * y).sum::<f32>() * scale;
                    max = max.max(*p);
                }
                let mut sum = 0.0f32;
                for p in sc.iter_mut().take(t + 1) {
                    *p = (*p - max).exp();
                    sum += *p;
                }
                for p in sc.iter_mut().take(t + 1) {
                    *p /= sum;
                }
                let oh = &mut o[h * d..(h + 1) * d];
                oh.fill(0.0);
                for (u, &p) in sc.iter().enumerate().take(t + 1) {
                    let vr = &cache.value(layer, seq, u)[kv_off..kv_off + d];
                    for (o, x) in oh.iter_mut().zip(vr) {
                        *o += p * x;
                    }
                }
            }
        });
}
