//! Sampling parameters, the counter-based uniform draw of each sampled token, and temperature /
//! top-k / top-p sampling with the log-prob of the sampled token.
//!
//! The same rule runs on the host ([`sample_token`]) and on the GPU (the `sample_rows` kernel):
//! the kept tokens are those at least as likely as the `top_k`-th most likely one, then the
//! most likely of those whose mass reaches `top_p` of theirs (ties at either cut are kept);
//! the draw walks the kept tokens in id order to `u · kept mass`, with `u` from
//! [`draw_uniform`] of the token's [`DrawKey`]. A sample's draws depend on its own key alone,
//! never on batching, preemption or the order in which samples run.

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
    /// Sample among the `top_k` most likely tokens only; 0 keeps them all.
    pub top_k: usize,
    /// Generated tokens per sample at most.
    pub max_new_tokens: usize,
    /// Tokens that end a sample (included in its output).
    pub stop_tokens: Vec<u32>,
    /// Seed; token `t` of sample `j` of prompt `i` draws [`draw_uniform`] of `(seed, i, j, t)`.
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
        if self.top_k > u32::MAX as usize {
            return bad("top_k", "use a value below 2^32 (0 keeps every token)");
        }
        if self.max_new_tokens == 0 {
            return bad("max_new_tokens", "ask for at least one new token");
        }
        Ok(())
    }

    /// Whether the kept set may be smaller than the vocabulary of `vocab` tokens.
    pub(crate) fn cuts(&self, vocab: usize) -> bool {
        self.top_p < 1.0 || (self.top_k > 0 && self.top_k < vocab)
    }
}

/// Which token of which sample a draw is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DrawKey {
    /// Index of the prompt in the request.
    pub prompt: u32,
    /// Index among the prompt's samples.
    pub sample: u32,
    /// Index of the token in the sample's output.
    pub token: u32,
}

/// SplitMix64's finaliser: a bijection of `u64` whose outputs look independent.
fn mix(z: u64) -> u64 {
    let z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    let z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Added before each mix so that zero inputs do not map to zero.
const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// The uniform in `[0, 1)` that token `key` of a run seeded `seed` draws: 53 bits of a hash
/// of the four numbers (the GPU kernel computes the same bits).
pub fn draw_uniform(seed: u64, key: DrawKey) -> f64 {
    let mut h = mix(seed.wrapping_add(GOLDEN));
    for part in [key.prompt, key.sample, key.token] {
        h = mix(h ^ u64::from(part).wrapping_add(GOLDEN));
    }
    (h >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Draws a token from `logits (V)` for `key` and returns it with its log-prob under the
/// temperature-scaled distribution (before the top-k / top-p cuts; the raw log-softmax when
/// greedy). Greedy takes the most likely token, ties to the lowest id.
pub fn sample_token(logits: &[f32], params: &SamplingParams, key: DrawKey) -> (u32, f32) {
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
        let id =
            (0..logits.len()).fold(0, |best, i| if logits[i] > logits[best] { i } else { best });
        return (id as u32, logprob(id));
    }
    let threshold = kept_threshold(logits, &probs, params);
    let kept = |i: usize| logits[i] >= threshold;
    let mass: f64 = (0..logits.len())
        .filter(|&i| kept(i))
        .map(|i| probs[i])
        .sum();
    let target = draw_uniform(params.seed, key) * mass;
    let mut acc = 0.0;
    let mut last = 0;
    for i in (0..logits.len()).filter(|&i| kept(i)) {
        acc += probs[i];
        last = i;
        if target < acc {
            return (i as u32, logprob(i));
        }
    }
    (last as u32, logprob(last))
}

/// The smallest logit kept by the top-k and top-p cuts (every logit ties or beats it).
fn kept_threshold(logits: &[f32], probs: &[f64], params: &SamplingParams) -> f32 {
    if !params.cuts(logits.len()) {
        return f32::NEG_INFINITY;
    }
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    let k = match params.top_k {
        0 => order.len(),
        k => k.min(order.len()),
    };
    // Ties with the k-th logit stay in.
    let kth = logits[order[k - 1]];
    let kept: Vec<usize> = order
        .into_iter()
        .take_while(|&i| logits[i] >= kth)
        .collect();
    let target = f64::from(params.top_p) * kept.iter().map(|&i| probs[i]).sum::<f64>();
    let mut mass = 0.0;
    for &i in &kept {
        mass += probs[i];
        if mass >= target {
            return logits[i];
        }
    }
    kth
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_p: f32, top_k: usize) -> SamplingParams {
        SamplingParams {
            n: 1,
            temperature,
            top_p,
            top_k,
            max_new_tokens: 4,
            stop_tokens: Vec::new(),
            seed: 3,
        }
    }

    fn key(token: u32) -> DrawKey {
        DrawKey {
            prompt: 1,
            sample: 2,
            token,
        }
    }

    /// Frequencies of 20,000 draws of `logits` under `p`.
    fn frequencies(logits: &[f32], p: &SamplingParams) -> Vec<f64> {
        let draws = 20_000;
        let mut counts = vec![0usize; logits.len()];
        for t in 0..draws {
            counts[sample_token(logits, p, key(t)).0 as usize] += 1;
        }
        counts
            .iter()
            .map(|&c| c as f64 / f64::from(draws))
            .collect()
    }

    #[test]
    fn sampling_follows_the_softmax_and_the_cuts_renormalise_what_they_keep() {
        let logits = [2.0f32, 1.0, 0.5, -1.0, 0.0];
        let softmax = |keep: &[usize]| -> Vec<f64> {
            let z: f64 = keep.iter().map(|&i| f64::from(logits[i]).exp()).sum();
            (0..logits.len())
                .map(|i| match keep.contains(&i) {
                    true => f64::from(logits[i]).exp() / z,
                    false => 0.0,
                })
                .collect()
        };
        // p = [0.53, 0.20, 0.12, 0.03, 0.07]: top-p 0.7 keeps ids 0 and 1, top-k 3 ids 0-2.
        for (p, keep) in [
            (params(1.0, 1.0, 0), vec![0, 1, 2, 3, 4]),
            (params(1.0, 0.7, 0), vec![0, 1]),
            (params(1.0, 1.0, 3), vec![0, 1, 2]),
            (params(1.0, 0.9, 3), vec![0, 1, 2]),
            (params(1.0, 0.5, 3), vec![0]),
        ] {
            let want = softmax(&keep);
            for (i, f) in frequencies(&logits, &p).into_iter().enumerate() {
                // Tolerance: 0.015 absolute, about 4.5 standard errors of a frequency at 20k draws.
                assert!(
                    (f - want[i]).abs() < 0.015,
                    "top_p {} top_k {}: id {i} drawn {f}, expected {}",
                    p.top_p,
                    p.top_k,
                    want[i]
                );
            }
        }
    }

    #[test]
    fn ties_at_a_cut_stay_in() {
        let logits = [1.0f32, 3.0, 1.0, 0.0];
        let f = frequencies(&logits, &params(1.0, 1.0, 2));
        assert!(f[0] > 0.0 && f[2] > 0.0 && f[3] == 0.0, "{f:?}");
    }

    #[test]
    fn greedy_takes_the_argmax_and_log_probs_are_log_softmax() {
        let logits = [0.3f32, 2.5, -1.0, 2.5];
        let (id, lp) = sample_token(&logits, &params(0.0, 1.0, 0), key(0));
        assert_eq!(id, 1, "ties go to the lowest id");
        let z: f64 = logits.iter().map(|&x| f64::from(x).exp()).sum();
        let want = (2.5f64 - z.ln()) as f32;
        // Tolerance: 1e-6 on a log-prob of magnitude ~1.
        assert!((lp - want).abs() < 1e-6, "log-prob {lp} vs {want}");
        let (id, lp) = sample_token(&logits, &params(2.0, 0.5, 2), key(0));
        let z2: f64 = logits.iter().map(|&x| (f64::from(x) / 2.0).exp()).sum();
        let want = (f64::from(logits[id as usize]) / 2.0 - z2.ln()) as f32;
        assert!(
            (lp - want).abs() < 1e-6,
            "scaled log-prob {lp} vs {want}, before the cuts"
        );
    }

    #[test]
    fn draws_differ_per_key_and_repeat_per_seed() {
        let at = |seed, prompt, sample, token| {
            draw_uniform(
                seed,
                DrawKey {
                    prompt,
                    sample,
                    token,
                },
            )
        };
        assert_eq!(at(5, 1, 2, 3), at(5, 1, 2, 3));
        for other in [
            at(5, 2, 1, 3),
            at(6, 1, 2, 3),
            at(5, 1, 2, 4),
            at(5, 0, 0, 0),
        ] {
            assert_ne!(at(5, 1, 2, 3), other);
        }
        let mean = (0..10_000).map(|t| at(0, 0, 0, t)).sum::<f64>() / 10_000.0;
        // Tolerance: 0.01, about 3.5 standard errors of the mean of 10k uniforms.
        assert!((mean - 0.5).abs() < 0.01, "mean {mean}");
    }

    #[test]
    fn out_of_range_parameters_are_named() {
        for (p, what) in [
            (
                SamplingParams {
                    n: 0,
                    ..params(1.0, 1.0, 0)
                },
                "n",
            ),
            (params(-1.0, 1.0, 0), "temperature"),
            (params(1.0, 0.0, 0), "top_p"),
            (params(1.0, 1.0, u32::MAX as usize + 1), "top_k"),
            (
                SamplingParams {
                    max_new_tokens: 0,
                    ..params(1.0, 1.0, 0)
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
