//! Weighted token cross-entropy: `loss = -Σ w_t · log p(y_t) / normaliser`, with every token's
//! log-probability and the entropy of every token's distribution as outputs (the RL loop and
//! the inference engine read them), and the gradient of an entropy bonus
//! `-coef · Σ m_t H_t / normaliser`.

use rayon::prelude::*;

/// From `logits (N, V)`: `probs (N, V)` (softmax), `logprobs (N)` (log p of each target),
/// `entropy (N)` (`H = -Σ_v p_v log p_v` of each position); returns the loss, summed in f64.
pub fn crossentropy_forward(
    probs: &mut [f32],
    logprobs: &mut [f32],
    entropy: &mut [f32],
    logits: &[f32],
    targets: &[u32],
    weights: &[f32],
    normaliser: f32,
) -> f64 {
    let v = logits.len() / targets.len().max(1);
    probs
        .par_chunks_mut(v)
        .zip(logprobs.par_iter_mut().zip(entropy.par_iter_mut()))
        .zip(logits.par_chunks(v))
        .zip(targets.par_iter())
        .for_each(|(((p, (lp, h)), x), &y)| {
            let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0f32;
            for (p, x) in p.iter_mut().zip(x) {
                *p = (x - max).exp();
                sum += *p;
            }
            let mut expected = 0.0f32;
            for (p, x) in p.iter_mut().zip(x) {
                *p /= sum;
                expected += *p * (x - max);
            }
            let lse = sum.ln();
            *lp = x[y as usize] - max - lse;
            // H = log Σ exp(x) - E_p[x], with both terms shifted by the max.
            *h = lse - expected;
        });
    let total: f64 = logprobs
        .iter()
        .zip(weights)
        .map(|(&lp, &w)| -f64::from(w) * f64::from(lp))
        .sum();
    total / f64::from(normaliser)
}

/// Backward of [`crossentropy_forward`]: `dlogits (N, V) += w_t / normaliser · (p - onehot(y_t))`.
pub fn crossentropy_backward(
    dlogits: &mut [f32],
    probs: &[f32],
    targets: &[u32],
    weights: &[f32],
    normaliser: f32,
) {
    let v = probs.len() / targets.len().max(1);
    dlogits
        .par_chunks_mut(v)
        .zip(probs.par_chunks(v))
        .zip(targets.par_iter().zip(weights.par_iter()))
        .for_each(|((d, p), (&y, &w))| {
            let scale = w / normaliser;
            for (d, p) in d.iter_mut().zip(p) {
                *d += scale * p;
            }
            d[y as usize] -= scale;
        });
}

/// Backward of the entropy bonus `-coef · Σ m_t H_t / normaliser` over `logits (N, V)` and
/// their `probs (N, V)`: `dlogits (N, V) += coef m_t / normaliser · p (x - E_p[x])`, since
/// `dH/dx_j = -p_j (x_j - E_p[x])`.
pub fn entropy_backward(
    dlogits: &mut [f32],
    probs: &[f32],
    logits: &[f32],
    mask: &[f32],
    coef: f32,
    normaliser: f32,
) {
    let v = probs.len() / mask.len().max(1);
    dlogits
        .par_chunks_mut(v)
        .zip(probs.par_chunks(v).zip(logits.par_chunks(v)))
        .zip(mask.par_iter())
        .for_each(|((d, (p, x)), &m)| {
            if m == 0.0 {
                return;
            }
            let scale = coef * m / normaliser;
            let expected: f32 = p.iter().zip(x).map(|(p, x)| p * x).sum();
            for ((d, p), x) in d.iter_mut().zip(p).zip(x) {
                *d += scale * p * (x - expected);
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::{max_abs_diff, seeded_vec};

    /// The entropies `crossentropy_forward` reports for `logits (N, V)`.
    fn entropies(logits: &[f32], n: usize) -> Vec<f32> {
        let v = logits.len() / n;
        let (mut probs, mut logprobs, mut entropy) = (vec![0.0; n * v], vec![0.0; n], vec![0.0; n]);
        let (targets, weights) = (vec![0u32; n], vec![1.0; n]);
        crossentropy_forward(
            &mut probs,
            &mut logprobs,
            &mut entropy,
            logits,
            &targets,
            &weights,
            1.0,
        );
        entropy
    }

    #[test]
    fn entropy_matches_hand_computed_values() {
        // Row 0: uniform over 4, H = ln 4. Row 1: p = (1/4, 3/4, 0-ish, 0-ish) from logits
        // (0, ln 3, -100, -100), H = -(1/4 ln 1/4 + 3/4 ln 3/4).
        let logits = [0.3, 0.3, 0.3, 0.3, 0.0, 3f32.ln(), -100.0, -100.0];
        let h = entropies(&logits, 2);
        let want = [4f32.ln(), -(0.25 * 0.25f32.ln() + 0.75 * 0.75f32.ln())];
        let diff = max_abs_diff(&h, &want);
        assert!(diff < 1e-6, "entropies {h:?} vs {want:?}: {diff}");
    }

    #[test]
    fn entropy_gradient_matches_a_central_difference() {
        // f(x) = -coef Σ m_t H_t / normaliser over 3 positions of 5 logits, one masked out.
        let (n, v, coef, normaliser) = (3, 5, 0.7f32, 2.0f32);
        let mask = [1.0, 0.0, 1.0];
        let logits: Vec<f32> = seeded_vec(11, n * v).iter().map(|x| 2.0 * x).collect();
        let bonus = |x: &[f32]| -> f64 {
            let h = entropies(x, n);
            -f64::from(coef)
                * h.iter()
                    .zip(&mask)
                    .map(|(h, m)| f64::from(h * m))
                    .sum::<f64>()
                / f64::from(normaliser)
        };
        let (mut probs, mut lp, mut h) = (vec![0.0; n * v], vec![0.0; n], vec![0.0; n]);
        crossentropy_forward(
            &mut probs, &mut lp, &mut h, &logits, &[0; 3], &[0.0; 3], 1.0,
        );
        let mut d = seeded_vec(12, n * v);
        let before = d.clone();
        entropy_backward(&mut d, &probs, &logits, &mask, coef, normaliser);
        let analytic: Vec<f32> = d.iter().zip(&before).map(|(a, b)| a - b).collect();
        let step = 1e-2f32;
        let numeric: Vec<f32> = (0..n * v)
            .map(|i| {
                let (mut hi, mut lo) = (logits.clone(), logits.clone());
                hi[i] += step;
                lo[i] -= step;
                ((bonus(&hi) - bonus(&lo)) / f64::from(2.0 * step)) as f32
            })
            .collect();
        // f32 entropies differenced over 2e-2: about 1e-4 of rounding and curvature.
        let diff = max_abs_diff(&analytic, &numeric);
        assert!(
            diff < 5e-4,
            "largest difference {diff}: {analytic:?} vs {numeric:?}"
        );
        assert!(
            analytic[v..2 * v].iter().all(|&g| g == 0.0),
            "a masked position has no gradient"
        );
        assert!(
            analytic.iter().any(|&g| g.abs() > 1e-2),
            "the check is not on zeros"
        );
    }
}
