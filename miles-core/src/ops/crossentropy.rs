//! Weighted token cross-entropy: `loss = -Σ w_t · log p(y_t) / normaliser`, with every token's
//! log-probability as an output (the RL loop and the inference engine read them).

use rayon::prelude::*;

/// From `logits (N, V)`: `probs (N, V)` (softmax), `logprobs (N)` (log p of each target); returns
/// the loss, summed in f64.
pub fn crossentropy_forward(
    probs: &mut [f32],
    logprobs: &mut [f32],
    logits: &[f32],
    targets: &[u32],
    weights: &[f32],
    normaliser: f32,
) -> f64 {
    let v = logits.len() / targets.len().max(1);
    probs
        .par_chunks_mut(v)
        .zip(logprobs.par_iter_mut())
        .zip(logits.par_chunks(v))
        .zip(targets.par_iter())
        .for_each(|(((p, lp), x), &y)| {
            let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0f32;
            for (p, x) in p.iter_mut().zip(x) {
                *p = (x - max).exp();
                sum += *p;
            }
            for p in p.iter_mut() {
                *p /= sum;
            }
            *lp = x[y as usize] - max - sum.ln();
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
