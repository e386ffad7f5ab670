//! Wrapper of the sampling kernel (`kernels/sampling.cu`): a token and its log-prob drawn for
//! each of several rows of fp32 logits on the device, so only the ids and log-probs cross the
//! link.

use super::elementwise::as_i32;
use super::per_row;
use crate::device::{DeviceError, Gpu, GpuSlice};

/// The kernels of `kernels/sampling.cu`.
pub(super) const KERNELS: [&str; 1] = ["sample_rows"];

/// Threads per draw (`SAMPLE_THREADS` in the kernel).
const SAMPLE_THREADS: u32 = 1024;

/// Words of one draw in the draws array: the logit row, then the three numbers of its key.
pub const DRAW_WORDS: usize = 4;

/// Words of a [`SampleRule`] in device memory ([`SampleRule::words`]).
pub const RULE_WORDS: usize = 5;

/// How a token is drawn: the host sampler's rule (miles-infer's `sample_token`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleRule {
    /// Softmax temperature; 0 is greedy.
    pub temperature: f32,
    /// Nucleus, in `(0, 1]`.
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens (ties included); 0 keeps all.
    pub top_k: usize,
    /// The run's seed, hashed with each draw's key into its uniform.
    pub seed: u64,
}

impl SampleRule {
    /// The rule as the kernel reads it from device memory: temperature and top-p bits, top-k,
    /// the seed's low and high words.
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`] for a top-k over `i32::MAX`.
    pub fn words(&self) -> Result<[u32; RULE_WORDS], DeviceError> {
        let top_k = as_i32("top_k", self.top_k)? as u32;
        Ok([
            self.temperature.to_bits(),
            self.top_p.to_bits(),
            top_k,
            self.seed as u32,
            (self.seed >> 32) as u32,
        ])
    }
}

impl Gpu {
    /// For each draw `i` of `draws (D, 4)` (`[row, prompt, sample, token index]`), draws a
    /// token from row `row` of `logits (R, V)` under `rule` (a [`SampleRule::words`] on the
    /// device) into `tokens[i]`, with its log-prob under the temperature-scaled distribution in
    /// `logprobs[i]`. Rows are trusted to lie below `R` (the engine builds them).
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`] for mismatched lengths; the launch's error.
    pub fn sample_rows(
        &self,
        tokens: GpuSlice<u32>,
        logprobs: GpuSlice<f32>,
        logits: GpuSlice<f32>,
        draws: GpuSlice<u32>,
        rule: GpuSlice<u32>,
        vocab: usize,
    ) -> Result<(), DeviceError> {
        let d = draws.len() / DRAW_WORDS;
        if d * DRAW_WORDS != draws.len() {
            return Err(DeviceError::ShapeMismatch {
                what: "sample draws (4 words each)",
                expected: d * DRAW_WORDS,
                actual: draws.len(),
            });
        }
        rule.expect_len("sample rule", RULE_WORDS)?;
        tokens.expect_len("sampled tokens", d)?;
        logprobs.expect_len("sampled log-probs", d)?;
        if vocab == 0 || !logits.len().is_multiple_of(vocab) {
            return Err(DeviceError::ShapeMismatch {
                what: "sample logits (rows of the vocabulary)",
                expected: vocab,
                actual: logits.len(),
            });
        }
        if d == 0 {
            return Ok(());
        }
        let vocab = as_i32("vocab", vocab)?;
        self.launch(
            "sample_rows",
            per_row(d, SAMPLE_THREADS),
            &[
                &tokens.address(),
                &logprobs.address(),
                &logits.address(),
                &draws.address(),
                &rule.address(),
                &vocab,
            ],
        )
    }
}
