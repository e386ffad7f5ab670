//! Seeded inputs and comparisons shared by the kernels' tests.

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// `len` values drawn uniformly from [-1, 1) with `seed`.
pub fn seeded_vec(seed: u64, len: usize) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..len).map(|_| rng.random::<f32>() * 2.0 - 1.0).collect()
}

/// The largest absolute difference between two equally long slices.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}
