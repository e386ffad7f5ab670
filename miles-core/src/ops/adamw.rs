//! AdamW over flat fp32 buffers, with global-norm gradient clipping.
//!
//! Parameters (the fp32 master weights), gradients and both moments are each one flat buffer of
//! the same layout, so a step is one loop over the lot, as `torch.optim.AdamW` with a single
//! parameter group computes it (decoupled weight decay on every parameter).

use rayon::prelude::*;

/// AdamW hyperparameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    /// Learning rate.
    pub lr: f32,
    /// Decay of the first moment.
    pub beta1: f32,
    /// Decay of the second moment.
    pub beta2: f32,
    /// Added to the root of the second moment.
    pub eps: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
    /// Gradients are scaled down so their global L2 norm is at most this; `None` never clips.
    pub max_grad_norm: Option<f32>,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            max_grad_norm: Some(1.0),
        }
    }
}

/// What one step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStepStats {
    /// The step number just taken (1 for the first).
    pub step: u64,
    /// Global L2 norm of the gradients before clipping.
    pub grad_norm: f32,
    /// The factor gradients were multiplied by (1 when not clipped).
    pub clip_scale: f32,
}

/// The global L2 norm of a gradient buffer, summed in f64.
pub fn global_grad_norm(grads: &[f32]) -> f32 {
    grads
        .par_chunks(1 << 14)
        .map(|c| c.iter().map(|&g| f64::from(g) * f64::from(g)).sum::<f64>())
        .sum::<f64>()
        .sqrt() as f32
}

/// Takes AdamW step number `step` (counting from 1) over `params`, with `grads` and the moments
/// `m`, `v` of the same length.
pub fn adamw_step(
    params: &mut [f32],
    grads: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    step: u64,
    cfg: &AdamWConfig,
) -> AdamWStepStats {
    let grad_norm = global_grad_norm(grads);
    let clip_scale = clip_scale(cfg, grad_norm);
    adamw_update(params, grads, m, v, step, cfg, clip_scale);
    AdamWStepStats {
        step,
        grad_norm,
        clip_scale,
    }
}

/// The factor gradients of global norm `grad_norm` are multiplied by (1 when not clipped), as
/// `torch.nn.utils.clip_grad_norm_` computes it: `max_norm / (norm + 1e-6)` when below 1.
pub fn clip_scale(cfg: &AdamWConfig, grad_norm: f32) -> f32 {
    match cfg.max_grad_norm {
        Some(max) => (max / (grad_norm + 1e-6)).min(1.0),
        None => 1.0,
    }
}

/// AdamW's per-step scalars at `step` (counting from 1), shared by the CPU update and the GPU
/// kernel so both do the same arithmetic.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWScalars {
    /// `lr / (1 - beta1^t)`.
    pub step_size: f32,
    /// `sqrt(1 - beta2^t)`.
    pub bias2_sqrt: f32,
    /// `1 - lr * weight_decay`.
    pub decay: f32,
}

impl AdamWScalars {
    /// The scalars of step `step` under `cfg`.
    pub fn at(cfg: &AdamWConfig, step: u64) -> AdamWScalars {
        let t = step.min(i32::MAX as u64) as i32;
        AdamWScalars {
            step_size: cfg.lr / (1.0 - cfg.beta1.powi(t)),
            bias2_sqrt: (1.0 - cfg.beta2.powi(t)).sqrt(),
            decay: 1.0 - cfg.lr * cfg.weight_decay,
        }
    }
}

/// The element-wise part of AdamW step `step` over any slice of the flat buffers, with the
/// gradients scaled by `clip_scale`: a sharded optimizer computes the global norm over all
/// shards, then updates its own shard (or a bucket of it) with this.
pub fn adamw_update(
    params: &mut [f32],
    grads: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    step: u64,
    cfg: &AdamWConfig,
    clip_scale: f32,
) {
    let AdamWScalars {
        step_size,
        bias2_sqrt,
        decay,
    } = AdamWScalars::at(cfg, step);
    params
        .par_iter_mut()
        .zip(grads.par_iter())
        .zip(m.par_iter_mut().zip(v.par_iter_mut()))
        .for_each(|((p, &g), (m, v))| {
            let g = g * clip_scale;
            *p *= decay;
            *m = cfg.beta1 * *m + (1.0 - cfg.beta1) * g;
            *v = cfg.beta2 * *v + (1.0 - cfg.beta2) * g * g;
            let denom = v.sqrt() / bias2_sqrt + cfg.eps;
            *p -= step_size * *m / denom;
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adamw_matches_hand_computed_reference_over_three_steps() {
        // Tolerance 1e-6: f32 update against the textbook formulas in f64.
        let cfg = AdamWConfig {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.1,
            max_grad_norm: Some(1.0),
        };
        let mut params = vec![0.5f32, -1.5, 2.0];
        let (mut m, mut v) = (vec![0.0f32; 3], vec![0.0f32; 3]);
        let grads = [[0.3f32, -0.4, 0.0], [2.0, 1.0, -2.0], [0.1, 0.2, -0.3]];
        let mut p_ref = [0.5f64, -1.5, 2.0];
        let (mut m_ref, mut v_ref) = ([0.0f64; 3], [0.0f64; 3]);
        for (i, g) in grads.iter().enumerate() {
            let stats = adamw_step(&mut params, g, &mut m, &mut v, i as u64 + 1, &cfg);
            let norm = g.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
            let clip = (1.0 / (norm + 1e-6)).min(1.0);
            assert!((f64::from(stats.grad_norm) - norm).abs() < 1e-6);
            let t = i as i32 + 1;
            for j in 0..3 {
                let gj = f64::from(g[j]) * clip;
                p_ref[j] -= 0.1 * 0.1 * p_ref[j];
                m_ref[j] = 0.9 * m_ref[j] + 0.1 * gj;
                v_ref[j] = 0.99 * v_ref[j] + 0.01 * gj * gj;
                let m_hat = m_ref[j] / (1.0 - 0.9f64.powi(t));
                let v_hat = v_ref[j] / (1.0 - 0.99f64.powi(t));
                p_ref[j] -= 0.1 * m_hat / (v_hat.sqrt() + 1e-8);
            }
            let worst = params
                .iter()
                .zip(&p_ref)
                .map(|(a, b)| (f64::from(*a) - b).abs())
                .fold(0.0, f64::max);
            assert!(worst < 1e-6, "step {t}: worst difference {worst}");
        }
    }
}
