//! Workspace integration tests of miles live in `tests/tests/`, one file per backend and one for
//! the colocated loop; this library holds what several of them share.

#![deny(unsafe_code)]

use miles_core::Batch;
use miles_core::model::LlamaConfig;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Step `step`'s batch of `b` rows of `t` positions: seeded random tokens, and weights of which
/// some are masked (0) and some are negative advantages, normalised by the position count.
pub fn seeded_batch(config: &LlamaConfig, step: usize, b: usize, t: usize) -> Batch {
    let mut rng = ChaCha8Rng::seed_from_u64(100 + step as u64);
    let n = b * t;
    let v = config.vocab_size as u32;
    Batch {
        batch: b,
        seq: t,
        inputs: (0..n).map(|_| rng.random_range(0..v)).collect(),
        targets: (0..n).map(|_| rng.random_range(0..v)).collect(),
        weights: (0..n)
            .map(|i| {
                if i % 7 == 3 {
                    0.0
                } else {
                    rng.random::<f32>() * 1.5 - 0.25
                }
            })
            .collect(),
        normaliser: n as f32,
        entropy_mask: None,
        entropy_coef: 0.0,
    }
}
