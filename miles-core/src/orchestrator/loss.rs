//! The policy loss of one token as a weight on `-log p`: what the backends' weighted loss
//! (`sum(weights * -log p) / normaliser`) needs so that its gradient is the gradient of the
//! PPO clipped surrogate plus the KL penalty.
//!
//! With `r = exp(log p - log p_old)` and advantage `A`, the surrogate is
//! `-min(r A, clip(r, 1 - eps, 1 + eps_high) A)`; its derivative in `log p` is `-r A` where the
//! unclipped term is the minimum and 0 where the clip holds it. The KL penalty `coef * k` of an
//! estimator `k(log p, log p_ref)` has derivative `coef * k'`. A token's weight `w` in the
//! backend's `-w log p` is therefore `r A [unclipped] - coef k'`, evaluated at the current
//! weights.

use crate::config::KlLossType;

/// The settings of the policy loss.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PolicyLoss {
    /// Lower clip range: the ratio is held at `1 - eps_clip` for negative advantages.
    pub eps_clip: f32,
    /// Upper clip range: the ratio is held at `1 + eps_clip_high` for positive advantages.
    pub eps_clip_high: f32,
    /// The KL penalty to the reference model: estimator and coefficient.
    pub kl: Option<(KlLossType, f32)>,
}

impl Default for PolicyLoss {
    fn default() -> Self {
        Self {
            eps_clip: 0.2,
            eps_clip_high: 0.2,
            kl: None,
        }
    }
}

/// One token's share of the policy loss.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TokenLoss {
    /// The weight on `-log p` whose gradient is the loss's.
    pub weight: f32,
    /// The surrogate's value `-min(r A, clip(r) A)`.
    pub surrogate: f32,
    /// Whether the clip holds the ratio (the token gives no surrogate gradient).
    pub clipped: bool,
    /// The KL estimate `k` (0 without a reference).
    pub kl: f32,
}

/// The KL estimate of `log p` against `log p_ref` and its derivative in `log p`.
///
/// `k1 = log p - log p_ref`; `k2 = (log p - log p_ref)^2 / 2`;
/// `k3 = exp(log p_ref - log p) - (log p_ref - log p) - 1` (Schulman's unbiased, positive
/// estimator).
pub fn kl_estimate(kind: KlLossType, logp: f32, logp_ref: f32) -> (f32, f32) {
    let d = logp - logp_ref;
    match kind {
        KlLossType::K1 => (d, 1.0),
        KlLossType::K2 => (0.5 * d * d, d),
        KlLossType::K3 => {
            let e = (-d).exp();
            (e + d - 1.0, 1.0 - e)
        }
    }
}

impl PolicyLoss {
    /// The loss of a token with advantage `advantage`, log-probs `logp` (current), `logp_old`
    /// (the weights that generated it) and `logp_ref` (the reference, used only with a KL).
    pub fn token(&self, advantage: f32, logp: f32, logp_old: f32, logp_ref: f32) -> TokenLoss {
        let ratio = (logp - logp_old).exp();
        let clipped_ratio = ratio.clamp(1.0 - self.eps_clip, 1.0 + self.eps_clip_high);
        let (plain, held) = (ratio * advantage, clipped_ratio * advantage);
        // The surrogate takes the smaller; the clipped term wins only where it is strictly
        // smaller, so a ratio inside the range always keeps its gradient.
        let clipped = held < plain;
        let mut weight = if clipped { 0.0 } else { plain };
        let mut kl = 0.0;
        if let Some((kind, coef)) = self.kl {
            let (value, slope) = kl_estimate(kind, logp, logp_ref);
            kl = value;
            weight -= coef * slope;
        }
        TokenLoss {
            weight,
            surrogate: -plain.min(held),
            clipped,
            kl,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f32, b: f32) -> bool {
        (a - b).abs() < 1e-5
    }

    #[test]
    fn on_policy_tokens_weigh_their_advantage_and_are_never_clipped() {
        let loss = PolicyLoss::default();
        for a in [-1.5, 0.0, 2.0] {
            let t = loss.token(a, -0.7, -0.7, -0.7);
            assert!(
                close(t.weight, a) && !t.clipped && close(t.surrogate, -a),
                "{t:?}"
            );
        }
    }

    #[test]
    fn ratio_and_clip_match_hand_computed_values() {
        let loss = PolicyLoss {
            eps_clip: 0.2,
            eps_clip_high: 0.28,
            kl: None,
        };
        // r = exp(0.5) = 1.6487 > 1.28 with A = 2: clipped, surrogate -1.28 * 2.
        let t = loss.token(2.0, -0.5, -1.0, 0.0);
        assert!(
            t.clipped && t.weight == 0.0 && close(t.surrogate, -2.56),
            "{t:?}"
        );
        // Same ratio, A = -1: r A = -1.6487 is the minimum, kept with weight r A.
        let t = loss.token(-1.0, -0.5, -1.0, 0.0);
        let r = 0.5f32.exp();
        assert!(
            !t.clipped && close(t.weight, -r) && close(t.surrogate, r),
            "{t:?}"
        );
        // r = exp(-0.5) = 0.6065 < 0.8 with A = -1: clipped at 0.8.
        let t = loss.token(-1.0, -1.0, -0.5, 0.0);
        assert!(
            t.clipped && t.weight == 0.0 && close(t.surrogate, 0.8),
            "{t:?}"
        );
        // Inside the range: r = exp(0.1) with A = 1.
        let t = loss.token(1.0, -0.9, -1.0, 0.0);
        assert!(!t.clipped && close(t.weight, 0.1f32.exp()), "{t:?}");
    }

    #[test]
    fn kl_estimators_and_their_slopes_match_hand_computed_values() {
        // log p = -1, log p_ref = -1.5: d = 0.5.
        let (k1, s1) = kl_estimate(KlLossType::K1, -1.0, -1.5);
        assert!(close(k1, 0.5) && close(s1, 1.0));
        let (k2, s2) = kl_estimate(KlLossType::K2, -1.0, -1.5);
        assert!(close(k2, 0.125) && close(s2, 0.5));
        let (k3, s3) = kl_estimate(KlLossType::K3, -1.0, -1.5);
        let e = (-0.5f32).exp();
        assert!(close(k3, e + 0.5 - 1.0) && close(s3, 1.0 - e), "{k3} {s3}");
        for kind in KlLossType::ALL {
            let (k, s) = kl_estimate(*kind, -2.0, -2.0);
            assert!(close(k, 0.0), "{kind}: equal policies have no divergence");
            if *kind != KlLossType::K1 {
                assert!(close(s, 0.0), "{kind}: and no pull");
            }
        }
        // Slopes are the derivatives: a central difference agrees.
        for kind in KlLossType::ALL {
            let h = 1e-3;
            let (hi, _) = kl_estimate(*kind, -1.0 + h, -1.5);
            let (lo, _) = kl_estimate(*kind, -1.0 - h, -1.5);
            let (_, slope) = kl_estimate(*kind, -1.0, -1.5);
            let numeric = (hi - lo) / (2.0 * h);
            assert!(
                (numeric - slope).abs() < 1e-3,
                "{kind}: {numeric} vs {slope}"
            );
        }
    }

    #[test]
    fn the_kl_penalty_pulls_the_weight_toward_the_reference() {
        let loss = PolicyLoss {
            kl: Some((KlLossType::K3, 0.1)),
            ..PolicyLoss::default()
        };
        // Current above the reference: the penalty lowers log p (negative weight share).
        let t = loss.token(0.0, -1.0, -1.0, -1.5);
        let e = (-0.5f32).exp();
        assert!(close(t.weight, -0.1 * (1.0 - e)), "{t:?}");
        assert!(close(t.kl, e + 0.5 - 1.0));
    }
}
