//! Seeded initialisation as Hugging Face's `LlamaPreTrainedModel` does it: weight matrices and
//! embeddings from `N(0, initializer_range²)`, norm weights at one, biases at zero.

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use super::{LlamaConfig, ModelError, ParamLayout};

/// Pairs of values one parallel task of the initialisation draws.
const PAIRS_PER_TASK: usize = 1 << 16;

/// Words of the ChaCha8 stream a pair of values takes: two f64 uniforms of two words each.
const WORDS_PER_PAIR: u128 = 4;

/// Fills `params` (laid out by `layout`) with a fresh initialisation from `seed`: the weight
/// matrices and embeddings, in layout order, draw their values in pairs (Box-Muller) from one
/// ChaCha8 stream of `seed`. Tasks on every core each seek to their first pair's place in the
/// stream, so the values are those of drawing in order on one thread.
///
/// # Errors
/// [`ModelError::BufferLength`] when `params` does not have the layout's length.
pub fn init_params(
    layout: &ParamLayout,
    config: &LlamaConfig,
    seed: u64,
    params: &mut [f32],
) -> Result<(), ModelError> {
    init_in_tasks(layout, config, seed, params, PAIRS_PER_TASK)
}

/// [`init_params`] in tasks of at most `pairs_per_task` pairs.
fn init_in_tasks(
    layout: &ParamLayout,
    config: &LlamaConfig,
    seed: u64,
    params: &mut [f32],
    pairs_per_task: usize,
) -> Result<(), ModelError> {
    layout.check("params", params)?;
    let std = config.initializer_range;
    // (values, the stream's word of their first pair)
    let mut tasks: Vec<(&mut [f32], u128)> = Vec::new();
    let (mut rest, mut offset, mut word) = (params, 0, 0u128);
    for spec in layout.specs() {
        let range = spec.range();
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(range.start - offset);
        let (dst, tail) = tail.split_at_mut(range.len());
        (rest, offset) = (tail, range.end);
        if spec.kind.is_norm() {
            dst.fill(1.0);
        } else if spec.kind.is_bias() {
            dst.fill(0.0);
        } else {
            let pairs = dst.len().div_ceil(2);
            for (i, chunk) in dst.chunks_mut(2 * pairs_per_task).enumerate() {
                tasks.push((chunk, word + WORDS_PER_PAIR * (i * pairs_per_task) as u128));
            }
            word += WORDS_PER_PAIR * pairs as u128;
        }
    }
    let stream = ChaCha8Rng::seed_from_u64(seed);
    tasks.into_par_iter().for_each(|(dst, first)| {
        let mut rng = stream.clone();
        rng.set_word_pos(first);
        normals(dst, &mut rng, std);
    });
    Ok(())
}

/// Fills `dst` with `N(0, std²)` values, a pair from each two uniforms of `rng` (Box-Muller; an
/// odd last value uses a pair's first).
fn normals(dst: &mut [f32], rng: &mut ChaCha8Rng, std: f32) {
    for pair in dst.chunks_mut(2) {
        let u1: f64 = 1.0 - rng.random::<f64>();
        let u2: f64 = rng.random::<f64>();
        let r = (-2.0 * u1.ln()).sqrt();
        let theta = std::f64::consts::TAU * u2;
        pair[0] = (r * theta.cos()) as f32 * std;
        if let Some(second) = pair.get_mut(1) {
            *second = (r * theta.sin()) as f32 * std;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tasks_draw_the_values_of_one_stream_in_layout_order() {
        // An odd hidden size gives tensors of an odd element count (a last half pair).
        let mut c = LlamaConfig::preset("tiny").unwrap();
        c.hidden_size = 33;
        let layout = ParamLayout::new(&c);
        assert!(layout.specs().iter().any(|s| s.numel() % 2 == 1));
        // The values drawn in order on one thread, from one stream.
        let mut want = vec![0.0; layout.len()];
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        for spec in layout.specs() {
            let dst = &mut want[spec.range()];
            match (spec.kind.is_norm(), spec.kind.is_bias()) {
                (true, _) => dst.fill(1.0),
                (_, true) => dst.fill(0.0),
                _ => normals(dst, &mut rng, c.initializer_range),
            }
        }
        for pairs_per_task in [1, 7, 64, PAIRS_PER_TASK] {
            let mut got = vec![f32::NAN; layout.len()];
            init_in_tasks(&layout, &c, 5, &mut got, pairs_per_task).unwrap();
            assert_eq!(got, want, "{pairs_per_task} pairs a task");
        }
    }

    #[test]
    fn init_is_seeded_with_the_configured_spread_and_unit_norms() {
        let c = LlamaConfig::preset("tiny").unwrap();
        let layout = ParamLayout::new(&c);
        let mut a = vec![0.0; layout.len()];
        let mut b = vec![0.0; layout.len()];
        init_params(&layout, &c, 1, &mut a).unwrap();
        init_params(&layout, &c, 1, &mut b).unwrap();
        assert_eq!(a, b);
        init_params(&layout, &c, 2, &mut b).unwrap();
        assert_ne!(a, b);
        let emb = &a[layout.specs()[0].range()];
        let var = emb.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>() / emb.len() as f64;
        let want = f64::from(c.initializer_range);
        assert!(
            (var.sqrt() - want).abs() < 0.05 * want,
            "std {} vs {want}",
            var.sqrt()
        );
        let norm = layout.range(crate::model::ParamKind::FinalNorm, 0);
        assert!(a[norm].iter().all(|&x| x == 1.0));
    }
}
