//! Sampling parameters, the per-sample seeded generator, and temperature / top-p sampling with
//! the log-prob of the sampled token.

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha20Rng;

use crate::InferError;

/// How tokens are drawn.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Samples per prompt (`n`); they share the prompt's KV blocks.
    pub n: usize,
    /// Softmax temperature; 0 picks the most likely token (greedy).
    pub temperature: f32,
    /// Nucleus: sample among the most likely tokens whose probabilities sum to at least this,
    /// in `(0, 1]`.
    pub top_p: f32,
    /// Generated tokens per sample at most.
    pub max_new_tokens: usize,
    /// Tokens that end a sample (included in its output).
    pub stop_tokens: Vec<u32>,
    /// Seed; sample `j` of prompt `i` draws from a generator seeded by `(seed, i, j)`.
    pub seed: u64,
}

impl SamplingParams {
    /// Checks the ranges.
    ///
    /// # Errors
    /// [`InferError::BadParameter`] naming the parameter.
    pub fn validate(&self) -> Result<(), InferError> {
        let bad = |what, reason: &str| {
            Err(InferError::BadParameter {
                what,
                reason: reason.to_string(),
            })
        };
        if self.n == 0 {
            return bad("n", "ask for at least one sample per prompt");
        }
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad("temperature", "use a finite value >= 0 (0 is greedy)");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", "use a value in (0, 1]");
        }
        if self.max_new_tokens == 0 {
            return bad("max_new_tokens", "ask for at least one new token");
        }
        Ok(())
    }
}

/// The generator of sample `sample` of prompt `prompt`: independent of batching and of the
/// order in which samples run.
pub fn sample_rng(seed: u64, prompt: usize, sample: usize) -> ChaCha20Rng {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    key[8..16].copy_from_slice(&(prompt as u64).to_le_bytes());
    key[16..24].copy_from_slice(&(sample as u64).to_le_bytes());
    ChaCha20Rng::from_seed(key)
}

/// Draws a token from `logits (V)` and returns it with its log-prob under the
/// temperature-scaled distribution (before the top-p cut; the raw log-softmax when greedy).
///
/// One draw of `rng` per call when `temperature > 0`, none when greedy, so a sample's sequence
/// of draws depends only on its own tokens.
pub fn sample_token(logits: &[f32], params: &SamplingParams, rng: &mut ChaCha20Rng) -> (u32, f32) {
    let t = if params.temperature > 0.0 {
        params.temperature
    } else {
        1.0
    };
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let probs: Vec<f64> = logits
        .iter()
        .map(|&x| f64::from((x - max) / t).exp())
        .collect();
    let sum: f64 = probs.iter().sum();
    let logprob = |id: usize| (f64::from((logits[id] - max) / t) - sum.ln()) as f32;
    if params.temperature == 0.0 {
        // Ties go to the lowest id.
        let id =
            (0..logits.len()).fold(0, |best, i| if logits[i] > logits[best] { i } else { best });
        return (id as u32, logprob(id));
    }
    let mut order: Vec<usize> = (0..probs.len()).collect();
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
    let target = f64::from(params.top_p) * sum;
    let mut kept = 0;
    let mut mass = 0.0;
    for &id in &order {
        mass += probs[id];
        kept += 1;
        if mass >= target {
            break;
        }
    }
    let u = rng.random::<f64>() * mass;
    let mut acc = 0.0;
    let mut pick = order[kept - 1];
    for &id in &order[..kept] {
        acc += probs[id];
        if u < acc {
            pick = id;
            break;
        }
    }
    (pick as u32, logprob(pick))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_p: f32) -> SamplingParams {
        SamplingParams {
            n: 1,
            temperature,
            top_p,
            max_new_tokens: 4,
            stop_tokens: Vec::new(),
            seed: 3,
        }
    }

    #[test]
    fn sampling_follows_the_softmax_and_top_p_cuts_the_tail() {
        let logits = [2.0f32, 1.0, 0.5, -1.0, 0.0];
        let mut rng = sample_rng(1, 0, 0);
        let draws = 20_000;
        let mut counts = [0usize; 5];
        for _ in 0..draws {
            counts[sample_token(&logits, &params(1.0, 1.0), &mut rng).0 as usize] += 1;
        }
        let z: f64 = logits.iter().map(|&x| f64::from(x).exp()).sum();
        let mut worst = 0.0f64;
        for (i, &c) in counts.iter().enumerate() {
            let want = f64::from(logits[i]).exp() / z;
            worst = worst.max((c as f64 / draws as f64 - want).abs());
        }
        // Tolerance: 0.015 absolute, about 4.5 standard errors of a frequency at 20k draws.
        assert!(worst < 0.015, "worst frequency difference {worst}");
        // p = [0.53, 0.20, 0.12, 0.03, 0.07]: top-p 0.7 keeps ids 0 and 1 only.
        for _ in 0..2000 {
            let (id, _) = sample_token(&logits, &params(1.0, 0.7), &mut rng);
            assert!(id <= 1, "id {id} is outside the nucleus");
        }
    }

    #[test]
    fn greedy_takes_the_argmax_and_log_probs_are_log_softmax() {
        let logits = [0.3f32, 2.5, -1.0, 2.5];
        let mut rng = sample_rng(2, 0, 0);
        let (id, lp) = sample_token(&logits, &params(0.0, 1.0), &mut rng);
        assert_eq!(id, 1, "ties go to the lowest id");
        let z: f64 = logits.iter().map(|&x| f64::from(x).exp()).sum();
        let want = (2.5f64 - z.ln()) as f32;
        // Tolerance: 1e-6 on a log-prob of magnitude ~1.
        assert!((lp - want).abs() < 1e-6, "log-prob {lp} vs {want}");
        let (id, lp) = sample_token(&logits, &params(2.0, 1.0), &mut rng);
        let z2: f64 = logits.iter().map(|&x| (f64::from(x) / 2.0).exp()).sum();
        let want = (f64::from(logits[id as usize]) / 2.0 - z2.ln()) as f32;
        assert!((lp - want).abs() < 1e-6, "scaled log-prob {lp} vs {want}");
    }

    #[test]
    fn generators_differ_per_sample_and_repeat_per_seed() {
        let draw = |s, p, j| sample_rng(s, p, j).random::<u64>();
        assert_eq!(draw(5, 1, 2), draw(5, 1, 2));
        assert_ne!(draw(5, 1, 2), draw(5, 2, 1));
        assert_ne!(draw(5, 1, 2), draw(6, 1, 2));
    }

    #[test]
    fn out_of_range_parameters_are_named() {
        for (p, what) in [
            (
                SamplingParams {
                    n: 0,
                    ..params(1.0, 1.0)
                },
                "n",
            ),
            (params(-1.0, 1.0), "temperature"),
            (params(1.0, 0.0), "top_p"),
            (
                SamplingParams {
                    max_new_tokens: 0,
                    ..params(1.0, 1.0)
                },
                "max_new_tokens",
            ),
        ] {
            let err = p.validate().unwrap_err();
            assert!(
                matches!(err, InferError::BadParameter { what: w, .. } if w == what),
                "{err}"
            );
        }
    }
}
