//! Seeded initialisation as Hugging Face's `LlamaPreTrainedModel` does it: weight matrices and
//! embeddings from `N(0, initializer_range²)`, norm weights at one, biases at zero.

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{LlamaConfig, ModelError, ParamLayout};

/// Fills `params` (laid out by `layout`) with a fresh initialisation from `seed`.
///
/// # Errors
/// [`ModelError::BufferLength`] when `params` does not have the layout's length.
pub fn init_params(
    layout: &ParamLayout,
    config: &LlamaConfig,
    seed: u64,
    params: &mut [f32],
) -> Result<(), ModelError> {
    layout.check("params", params)?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let std = config.initializer_range;
    for spec in layout.specs() {
        let dst = &mut params[spec.range()];
        if spec.kind.is_norm() {
            dst.fill(1.0);
            continue;
        }
        if spec.kind.is_bias() {
            dst.fill(0.0);
            continue;
        }
        // Box-Muller: two uniforms give two independent standard normals.
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
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
