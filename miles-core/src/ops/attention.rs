//! Causal grouped-query attention over rotated queries and keys.
//!
//! Query head `h` reads key/value head `h / (H / K)`. Scores are scaled by `1/sqrt(D)`, masked
//! causally and soft-maxed in fp32, as Hugging Face's eager Llama attention does. Probabilities
//! are stored `(B, T, H, T)` so that each query row's heads are one contiguous chunk.

use rayon::prelude::*;

/// Sizes of one attention call.
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    /// `B`: sequences.
    pub batch: usize,
    /// `T`: positions per sequence.
    pub seq: usize,
    /// `H`: query heads.
    pub heads: usize,
    /// `K`: key/value heads.
    pub kv_heads: usize,
    /// `D`: channels per head.
    pub head_dim: usize,
}

impl AttentionShape {
    fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }
}

/// `out (B, T, H*D)` and `att (B, T, H, T)` from `q (B, T, H*D)`, `k`, `v (B, T, K*D)`.
pub fn attention_forward(
    out: &mut [f32],
    att: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    s: AttentionShape,
) {
    let (t_len, h_n, d) = (s.seq, s.heads, s.head_dim);
    let (qd, kvd) = (h_n * d, s.kv_heads * d);
    let scale = s.scale();
    out.par_chunks_mut(qd)
        .zip(att.par_chunks_mut(h_n * t_len))
        .enumerate()
        .for_each(|(row, (o, a))| {
            let (b, t) = (row / t_len, row % t_len);
            let kv_base = b * t_len * kvd;
            for h in 0..h_n {
                let qh = &q[row * qd + h * d..row * qd + (h + 1) * d];
                let kv_off = (h / s.group()) * d;
                let probs = &mut a[h * t_len..(h + 1) * t_len];
                let mut max = f32::NEG_INFINITY;
                for (u, p) in probs.iter_mut().enumerate().take(t + 1) {
                    let kr = &k[kv_base + u * kvd + kv_off..kv_base + u * kvd + kv_off + d];
                    *p = qh.iter().zip(kr).map(|(x, y)| x * y).sum::<f32>() * scale;
                    max = max.max(*p);
                }
                let mut sum = 0.0f32;
                for p in probs.iter_mut().take(t + 1) {
                    *p = (*p - max).exp();
                    sum += *p;
                }
                for p in probs.iter_mut().take(t + 1) {
                    *p /= sum;
                }
                for p in probs.iter_mut().skip(t + 1) {
                    *p = 0.0;
                }
                let oh = &mut o[h * d..(h + 1) * d];
                oh.fill(0.0);
                for (u, &p) in probs.iter().enumerate().take(t + 1) {
                    let vr = &v[kv_base + u * kvd + kv_off..kv_base + u * kvd + kv_off + d];
                    for (o, x) in oh.iter_mut().zip(vr) {
                        *o += p * x;
                    }
                }
            }
        });
}

/// Backward of [`attention_forward`]: `dq +=`, `dk +=`, `dv +=`; `datt (B, T, H, T)` is scratch
/// that ends holding the gradient of the pre-softmax scores.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    datt: &mut [f32],
    dout: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    att: &[f32],
    s: AttentionShape,
) {
    let (t_len, h_n, d) = (s.seq, s.heads, s.head_dim);
    let (qd, kvd) = (h_n * d, s.kv_heads * d);
    let scale = s.scale();
    // Pass 1, one query row at a time: softmax backward into datt, then dq.
    dq.par_chunks_mut(qd)
        .zip(datt.par_chunks_mut(h_n * t_len))
        .enumerate()
        .for_each(|(row, (dqr, da))| {
            let (b, t) = (row / t_len, row % t_len);
            let kv_base = b * t_len * kvd;
            for h in 0..h_n {
                let kv_off = (h / s.group()) * d;
                let doh = &dout[row * qd + h * d..row * qd + (h + 1) * d];
                let a = &att[(row * h_n + h) * t_len..(row * h_n + h + 1) * t_len];
                let dah = &mut da[h * t_len..(h + 1) * t_len];
                let mut dot = 0.0f32;
                for u in 0..=t {
                    let vr = &v[kv_base + u * kvd + kv_off..kv_base + u * kvd + kv_off + d];
                    dah[u] = doh.iter().zip(vr).map(|(x, y)| x * y).sum();
                    dot += a[u] * dah[u];
                }
                for u in 0..t_len {
                    dah[u] = if u <= t { a[u] * (dah[u] - dot) } else { 0.0 };
                }
                let dqh = &mut dqr[h * d..(h + 1) * d];
                for u in 0..=t {
                    let kr = &k[kv_base + u * kvd + kv_off..kv_base + u * kvd + kv_off + d];
                    let g = dah[u] * scale;
                    for (dq, x) in dqh.iter_mut().zip(kr) {
                        *dq += g * x;
                    }
                }
            }
        });
    let datt = &*datt;
    // Pass 2, one key row at a time: every later query of the group contributes to dk and dv.
    dk.par_chunks_mut(kvd)
        .zip(dv.par_chunks_mut(kvd))
        .enumerate()
        .for_each(|(row, (dkr, dvr))| {
            let (b, u) = (row / t_len, row % t_len);
            for h in 0..h_n {
                let kv_off = (h / s.group()) * d;
                let dkh = &mut dkr[kv_off..kv_off + d];
                for t in u..t_len {
                    let qrow = b * t_len + t;
                    let g = datt[(qrow * h_n + h) * t_len + u] * scale;
                    let qh = &q[qrow * qd + h * d..qrow * qd + (h + 1) * d];
                    for (dk, x) in dkh.iter_mut().zip(qh) {
                        *dk += g * x;
                    }
                }
                let dvh = &mut dvr[kv_off..kv_off + d];
                for t in u..t_len {
                    let qrow = b * t_len + t;
                    let p = att[(qrow * h_n + h) * t_len + u];
                    let doh = &dout[qrow * qd + h * d..qrow * qd + (h + 1) * d];
                    for (dv, x) in dvh.iter_mut().zip(doh) {
                        *dv += p * x;
                    }
                }
            }
        });
}
