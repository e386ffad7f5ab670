//! Causal grouped-query attention over rotated queries and keys.
//!
//! Query head `h` reads key/value head `h / (H / K)`. Scores are scaled by `1/sqrt(D)`, masked
//! causally and soft-maxed in fp32, as Hugging Face's eager Llama attention does. Probabilities
//! are stored `(B, T, H, T)` so that each query row's heads are one contiguous chunk.

use rayon::prelude::*;

use crate::device::{GemmShapeError, MatrixView, sgemm};

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
///
/// Per sequence and head, scores and outputs are two matrix products over strided views;
/// sequences run in parallel.
///
/// # Errors
/// [`GemmShapeError`] when a buffer is too short for `s`.
pub fn attention_forward(
    out: &mut [f32],
    att: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    s: AttentionShape,
) -> Result<(), GemmShapeError> {
    let (t_len, h_n, d) = (s.seq, s.heads, s.head_dim);
    let (qd, kvd, row) = (h_n * d, s.kv_heads * d, h_n * t_len);
    let scale = s.scale();
    out.par_chunks_mut(t_len * qd)
        .zip(att.par_chunks_mut(t_len * row))
        .enumerate()
        .try_for_each(|(b, (o, a))| {
            let (qb, kb, vb) = (
                &q[b * t_len * qd..(b + 1) * t_len * qd],
                &k[b * t_len * kvd..(b + 1) * t_len * kvd],
                &v[b * t_len * kvd..(b + 1) * t_len * kvd],
            );
            for h in 0..h_n {
                let kv_off = (h / s.group()) * d;
                // scores (T, T) = q_h (T, D) · k_hᵀ (D, T)
                sgemm(
                    t_len,
                    t_len,
                    d,
                    &mut a[h * t_len..],
                    MatrixView::row_major(row),
                    &qb[h * d..],
                    MatrixView::row_major(qd),
                    &kb[kv_off..],
                    MatrixView::transposed(kvd),
                    false,
                )?;
                for t in 0..t_len {
                    let p = &mut a[t * row + h * t_len..t * row + (h + 1) * t_len];
                    causal_softmax_row(p, t, scale);
                }
                // out_h (T, D) = probs (T, T) · v_h (T, D)
                sgemm(
                    t_len,
                    d,
                    t_len,
                    &mut o[h * d..],
                    MatrixView::row_major(qd),
                    &a[h * t_len..],
                    MatrixView::row_major(row),
                    &vb[kv_off..],
                    MatrixView::row_major(kvd),
                    false,
                )?;
            }
            Ok(())
        })
}

/// Scales the scores of query position `t`, soft-maxes positions `0..=t` and zeroes the rest.
fn causal_softmax_row(p: &mut [f32], t: usize, scale: f32) {
    let (live, masked) = p.split_at_mut(t + 1);
    let mut max = f32::NEG_INFINITY;
    for x in live.iter_mut() {
        *x *= scale;
        max = max.max(*x);
    }
    let mut sum = 0.0f32;
    for x in live.iter_mut() {
        *x = (*x - max).exp();
        sum += *x;
    }
    for x in live.iter_mut() {
        *x /= sum;
    }
    masked.fill(0.0);
}

/// Backward of [`attention_forward`]: `dq +=`, `dk +=`, `dv +=`; `datt (B, T, H, T)` is scratch.
///
/// # Errors
/// [`GemmShapeError`] when a buffer is too short for `s`.
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
) -> Result<(), GemmShapeError> {
    let (t_len, h_n, d) = (s.seq, s.heads, s.head_dim);
    let (qd, kvd, row) = (h_n * d, s.kv_heads * d, h_n * t_len);
    let scale = s.scale();
    let (nq, nkv, na) = (t_len * qd, t_len * kvd, t_len * row);
    dq.par_chunks_mut(nq)
        .zip(dk.par_chunks_mut(nkv))
        .zip(dv.par_chunks_mut(nkv))
        .zip(datt.par_chunks_mut(na))
        .enumerate()
        .try_for_each(|(b, (((dqb, dkb), dvb), da))| {
            let (qb, kb, vb) = (
                &q[b * nq..(b + 1) * nq],
                &k[b * nkv..(b + 1) * nkv],
                &v[b * nkv..(b + 1) * nkv],
            );
            let (ab, dob) = (&att[b * na..(b + 1) * na], &dout[b * nq..(b + 1) * nq]);
            for h in 0..h_n {
                let kv_off = (h / s.group()) * d;
                // dprobs (T, T) = dout_h (T, D) · v_hᵀ (D, T)
                sgemm(
                    t_len,
                    t_len,
                    d,
                    &mut da[h * t_len..],
                    MatrixView::row_major(row),
                    &dob[h * d..],
                    MatrixView::row_major(qd),
                    &vb[kv_off..],
                    MatrixView::transposed(kvd),
                    false,
                )?;
                // Softmax backward, row by row; masked positions get zero.
                for t in 0..t_len {
                    let r = t * row + h * t_len..t * row + (h + 1) * t_len;
                    let (p, dp) = (&ab[r.clone()], &mut da[r]);
                    let dot: f32 = p[..=t].iter().zip(&dp[..=t]).map(|(a, b)| a * b).sum();
                    for (u, g) in dp.iter_mut().enumerate() {
                        *g = if u <= t {
                            p[u] * (*g - dot) * scale
                        } else {
                            0.0
                        };
                    }
                }
                // dq_h (T, D) += dscores (T, T) · k_h (T, D)
                sgemm(
                    t_len,
                    d,
                    t_len,
                    &mut dqb[h * d..],
                    MatrixView::row_major(qd),
                    &da[h * t_len..],
                    MatrixView::row_major(row),
                    &kb[kv_off..],
                    MatrixView::row_major(kvd),
                    true,
                )?;
                // dk_h (T, D) += dscoresᵀ (T, T) · q_h (T, D)
                sgemm(
                    t_len,
                    d,
                    t_len,
                    &mut dkb[kv_off..],
                    MatrixView::row_major(kvd),
                    &da[h * t_len..],
                    MatrixView::transposed(row),
                    &qb[h * d..],
                    MatrixView::row_major(qd),
                    true,
                )?;
                // dv_h (T, D) += probsᵀ (T, T) · dout_h (T, D)
                sgemm(
                    t_len,
                    d,
                    t_len,
                    &mut dvb[kv_off..],
                    MatrixView::row_major(kvd),
                    &ab[h * t_len..],
                    MatrixView::transposed(row),
                    &dob[h * d..],
                    MatrixView::row_major(qd),
                    true,
                )?;
            }
            Ok(())
        })
}

/// The plain-loop twin of [`attention_forward`], the reference its tests compare against.
pub fn attention_forward_naive(
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

/// The plain-loop twin of [`attention_backward`].
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_naive(
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::{max_abs_diff, seeded_vec};

    #[test]
    fn attention_matches_its_naive_twin_forward_and_backward() {
        // Tolerance 1e-5: the same f32 sums in a different order, over O(1) inputs.
        let s = AttentionShape {
            batch: 2,
            seq: 9,
            heads: 4,
            kv_heads: 2,
            head_dim: 8,
        };
        let n = s.batch * s.seq;
        let (qd, kvd) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
        let na = n * s.heads * s.seq;
        let (q, k, v) = (
            seeded_vec(1, n * qd),
            seeded_vec(2, n * kvd),
            seeded_vec(3, n * kvd),
        );
        let dout = seeded_vec(4, n * qd);
        let (mut out, mut att) = (vec![0.0; n * qd], vec![0.0; na]);
        let (mut out_ref, mut att_ref) = (vec![0.0; n * qd], vec![0.0; na]);
        attention_forward(&mut out, &mut att, &q, &k, &v, s).unwrap();
        attention_forward_naive(&mut out_ref, &mut att_ref, &q, &k, &v, s);
        let fwd = max_abs_diff(&out, &out_ref).max(max_abs_diff(&att, &att_ref));
        assert!(fwd < 1e-5, "forward worst difference {fwd}");

        let base = |seed, len| seeded_vec(seed, len);
        let (mut dq, mut dk, mut dv) = (base(5, n * qd), base(6, n * kvd), base(7, n * kvd));
        let (mut dq_r, mut dk_r, mut dv_r) = (dq.clone(), dk.clone(), dv.clone());
        let (mut da, mut da_r) = (vec![0.0; na], vec![0.0; na]);
        attention_backward(
            &mut dq, &mut dk, &mut dv, &mut da, &dout, &q, &k, &v, &att, s,
        )
        .unwrap();
        attention_backward_naive(
            &mut dq_r, &mut dk_r, &mut dv_r, &mut da_r, &dout, &q, &k, &v, &att, s,
        );
        let bwd = max_abs_diff(&dq, &dq_r)
            .max(max_abs_diff(&dk, &dk_r))
            .max(max_abs_diff(&dv, &dv_r));
        assert!(bwd < 1e-5, "backward worst difference {bwd}");
    }
}
