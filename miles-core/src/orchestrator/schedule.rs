//! The learning-rate schedule of the RL optimizer steps: a linear warm-up from 0, then
//! constant, cosine or linear decay to the minimum.

use crate::config::{LrDecayStyle, Settings};

/// The learning rate of each RL optimizer step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    /// The peak learning rate (`--lr`).
    pub lr: f64,
    /// Where the decay ends (`--min-lr`).
    pub min_lr: f64,
    /// Steps of the linear warm-up (`--lr-warmup-iters`).
    pub warmup: u64,
    /// The step at which the decay reaches `min_lr`.
    pub decay_iters: u64,
    /// How it decays.
    pub style: LrDecayStyle,
}

impl Default for LrSchedule {
    fn default() -> Self {
        Self {
            lr: 0.0,
            min_lr: 0.0,
            warmup: 0,
            decay_iters: 1,
            style: LrDecayStyle::Constant,
        }
    }
}

impl LrSchedule {
    /// The schedule of a run: the decay ends at `--lr-decay-iters`, else at the run's last RL
    /// optimizer step.
    pub fn from_settings(s: &Settings) -> Self {
        let per_step = (s.rollout_batch_size * s.n_samples_per_prompt)
            .div_ceil(s.global_batch_size.max(1)) as u64;
        Self {
            lr: s.lr,
            min_lr: s.min_lr,
            warmup: s.lr_warmup_iters,
            decay_iters: s.lr_decay_iters.unwrap_or(s.steps * per_step),
            style: s.lr_decay_style,
        }
    }

    /// Whether the rate ever differs from `lr`.
    pub fn varies(&self) -> bool {
        self.warmup > 0 || self.style != LrDecayStyle::Constant
    }

    /// The learning rate of RL optimizer step `iter` (1 for the first).
    pub fn at(&self, iter: u64) -> f64 {
        if iter <= self.warmup {
            return self.lr * iter as f64 / self.warmup as f64;
        }
        let span = self.decay_iters.saturating_sub(self.warmup).max(1) as f64;
        let done = (iter.saturating_sub(self.warmup) as f64 / span).min(1.0);
        let fall = match self.style {
            LrDecayStyle::Constant => return self.lr,
            LrDecayStyle::Linear => 1.0 - done,
            LrDecayStyle::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * done).cos()),
        };
        self.min_lr + (self.lr - self.min_lr) * fall
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(style: LrDecayStyle) -> LrSchedule {
        LrSchedule {
            lr: 1.0,
            min_lr: 0.1,
            warmup: 4,
            decay_iters: 14,
            style,
        }
    }

    #[test]
    fn warm_up_rises_linearly_then_each_style_decays_to_the_minimum() {
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        for style in LrDecayStyle::ALL {
            let s = schedule(*style);
            assert!(close(s.at(1), 0.25) && close(s.at(4), 1.0), "{style}");
        }
        let c = schedule(LrDecayStyle::Constant);
        assert!(close(c.at(9), 1.0) && close(c.at(100), 1.0));
        let l = schedule(LrDecayStyle::Linear);
        assert!(close(l.at(9), 0.55) && close(l.at(14), 0.1) && close(l.at(50), 0.1));
        let cos = schedule(LrDecayStyle::Cosine);
        assert!(close(cos.at(9), 0.55) && close(cos.at(14), 0.1));
        assert!(cos.at(6) > l.at(6), "cosine falls slower at first");
        assert!(!LrSchedule { warmup: 0, ..c }.varies() && l.varies());
    }
}
