//! Whole-model tests: gradients against finite differences, KV-cache decoding against the full
//! forward pass, and a short training run.

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::ops::AdamWConfig;

fn tiny(tied: bool) -> LlamaConfig {
    let mut v: serde_json::Value =
        serde_json::from_str(include_str!("../../presets/tiny.json")).unwrap();
    v["tie_word_embeddings"] = serde_json::Value::Bool(tied);
    LlamaConfig::from_json_str(&v.to_string()).unwrap()
}

/// Parameters with a spread large enough that every nonlinearity is exercised (HF's 0.02 init
/// leaves attention uniform and the MLP near-linear), and norm weights away from one.
fn spread_params(model: &Transformer, seed: u64) -> Vec<f32> {
    let layout = model.layout();
    let mut params = vec![0.0; layout.len()];
    init_params(layout, model.config(), seed, &mut params).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(seed + 1);
    for spec in layout.specs() {
        for p in &mut params[spec.range()] {
            *p = if spec.kind.is_norm() {
                0.5 + rng.random::<f32>()
            } else {
                *p * 15.0
            };
        }
    }
    params
}

fn random_tokens(rng: &mut ChaCha8Rng, n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|_| rng.random_range(0..vocab as u32)).collect()
}

/// Checks every tensor's gradient against central differences of the loss; with
/// `entropy_coef`, the loss holds the entropy bonus over a random mask of the targets.
fn gradient_check(tied: bool, entropy_coef: f32) {
    let model = Transformer::new(tiny(tied));
    let params = spread_params(&model, 11);
    let (b, t) = (2, 7);
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    let v = model.config().vocab_size;
    let inputs = random_tokens(&mut rng, b * t, v);
    let targets = random_tokens(&mut rng, b * t, v);
    let weights: Vec<f32> = (0..b * t)
        .map(|_| rng.random::<f32>() * 2.0 - 0.5)
        .collect();
    let mask: Vec<f32> = (0..b * t)
        .map(|_| f32::from(rng.random::<bool>()))
        .collect();
    let batch = TrainBatch {
        batch: b,
        seq: t,
        inputs: &inputs,
        targets: &targets,
        weights: &weights,
        normaliser: 1.0,
        entropy_mask: (entropy_coef != 0.0).then_some(&mask[..]),
        entropy_coef,
    };
    let al = model.activation_layout(b, t).unwrap();
    let mut acts = vec![0.0; al.len()];
    let mut grads = vec![0.0; params.len()];
    model.forward(&params, &mut acts, &al, &batch).unwrap();
    model
        .backward(&params, &mut grads, &mut acts, &al, &batch)
        .unwrap();

    // Directional derivative along a fresh random direction per tensor, central differences.
    // Tolerance: 2e-2 relative (f32 forward, eps 1e-3 on a loss of ~30 in magnitude).
    let eps = 1e-3f32;
    let mut worst = (0.0f64, String::new());
    for spec in model.layout().specs() {
        let dir: Vec<f32> = (0..spec.numel())
            .map(|_| rng.random::<f32>() * 2.0 - 1.0)
            .collect();
        let analytic: f64 = grads[spec.range()]
            .iter()
            .zip(&dir)
            .map(|(g, u)| f64::from(*g) * f64::from(*u))
            .sum();
        let mut shifted = params.clone();
        let mut loss_at = |sign: f32| {
            for (p, (orig, u)) in shifted[spec.range()]
                .iter_mut()
                .zip(params[spec.range()].iter().zip(&dir))
            {
                *p = orig + sign * eps * u;
            }
            f64::from(model.forward(&shifted, &mut acts, &al, &batch).unwrap())
        };
        let numeric = (loss_at(1.0) - loss_at(-1.0)) / (2.0 * f64::from(eps));
        let rel = (analytic - numeric).abs() / analytic.abs().max(numeric.abs()).max(1e-2);
        if rel > worst.0 {
            worst = (
                rel,
                format!("{}: analytic {analytic} numeric {numeric}", spec.name),
            );
        }
    }
    assert!(
        worst.0 < 2e-2,
        "worst relative difference {} at {}",
        worst.0,
        worst.1
    );
}

#[test]
fn gradients_match_finite_differences_for_every_tensor_tied() {
    gradient_check(true, 0.0);
}

#[test]
fn gradients_match_finite_differences_for_every_tensor_untied() {
    gradient_check(false, 0.0);
}

#[test]
fn gradients_with_an_entropy_bonus_match_finite_differences_for_every_tensor() {
    // A large coefficient, so the bonus's share of every gradient is what is checked.
    gradient_check(false, 5.0);
}

#[test]
fn the_entropy_bonus_lowers_the_loss_by_its_coefficient_times_the_masked_mean_entropy() {
    let model = Transformer::new(tiny(false));
    let params = spread_params(&model, 31);
    let (b, t) = (2, 5);
    let v = model.config().vocab_size;
    let mut rng = ChaCha8Rng::seed_from_u64(32);
    let inputs = random_tokens(&mut rng, b * t, v);
    let weights: Vec<f32> = (0..b * t).map(|_| rng.random::<f32>() - 0.3).collect();
    let mask = [0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0];
    let plain = TrainBatch {
        batch: b,
        seq: t,
        inputs: &inputs,
        targets: &inputs,
        weights: &weights,
        normaliser: 5.0,
        entropy_mask: Some(&mask),
        entropy_coef: 0.0,
    };
    let al = model.activation_layout(b, t).unwrap();
    let mut acts = vec![0.0; al.len()];
    let ce = model.forward(&params, &mut acts, &al, &plain).unwrap();
    // The entropy of each position from its logits, in f64: -Σ p log p.
    let logits = Transformer::logits(&al, &acts);
    let entropy: Vec<f64> = logits
        .chunks(v)
        .map(|x| {
            let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let lse = f64::from(max)
                + x.iter()
                    .map(|&z| f64::from(z - max).exp())
                    .sum::<f64>()
                    .ln();
            -x.iter()
                .map(|&z| {
                    let lp = f64::from(z) - lse;
                    lp.exp() * lp
                })
                .sum::<f64>()
        })
        .collect();
    let mean: f64 = entropy
        .iter()
        .zip(&mask)
        .map(|(h, &m)| h * f64::from(m))
        .sum::<f64>()
        / 5.0;
    let measured = plain
        .entropy_sum(Transformer::entropies(&al, &acts))
        .unwrap();
    assert!(
        (f64::from(measured) - mean).abs() < 1e-5 * mean,
        "measured mean entropy {measured} vs {mean}"
    );
    let bonus = TrainBatch {
        entropy_coef: 0.25,
        ..plain
    };
    let with_bonus = model.forward(&params, &mut acts, &al, &bonus).unwrap();
    let want = f64::from(ce) - 0.25 * mean;
    // f32 losses of about 5: 1e-5 relative.
    assert!(
        (f64::from(with_bonus) - want).abs() < 1e-5 * want.abs().max(1.0),
        "loss with the bonus {with_bonus} vs {want} (cross-entropy {ce}, mean entropy {mean})"
    );
}

#[test]
fn kv_cache_decoding_gives_the_full_forward_logits_token_by_token() {
    let model = Transformer::new(tiny(false));
    let params = spread_params(&model, 21);
    let (b, t) = (2, 12);
    let v = model.config().vocab_size;
    let mut rng = ChaCha8Rng::seed_from_u64(22);
    let inputs = random_tokens(&mut rng, b * t, v);
    let weights = vec![1.0; b * t];
    let batch = TrainBatch {
        batch: b,
        seq: t,
        inputs: &inputs,
        targets: &inputs,
        weights: &weights,
        normaliser: 1.0,
        entropy_mask: None,
        entropy_coef: 0.0,
    };
    let al = model.activation_layout(b, t).unwrap();
    let mut acts = vec![0.0; al.len()];
    model.forward(&params, &mut acts, &al, &batch).unwrap();
    let full = Transformer::logits(&al, &acts);

    // Sequence 1 starts 3 steps after sequence 0, so one decode step mixes positions.
    let lag = 3;
    let mut cache = ContiguousKvCache::new(model.config(), b, t);
    let mut scratch = DecodeScratch::new(model.config(), b, t);
    let mut logits = vec![0.0; b * v];
    let mut worst = 0.0f32;
    for step in 0..t + lag {
        let mut seqs = Vec::new();
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        for (seq, start) in [(0usize, 0usize), (1, lag)] {
            if step >= start && step - start < t {
                seqs.push(seq);
                tokens.push(inputs[seq * t + step - start]);
                positions.push(step - start);
            }
        }
        let out = &mut logits[..seqs.len() * v];
        model
            .decode_step(&params, &mut cache, &seqs, &tokens, out, &mut scratch)
            .unwrap();
        for (i, (&seq, &pos)) in seqs.iter().zip(&positions).enumerate() {
            let want = &full[(seq * t + pos) * v..(seq * t + pos + 1) * v];
            let got = &out[i * v..(i + 1) * v];
            for (a, b) in want.iter().zip(got) {
                worst = worst.max((a - b).abs());
            }
        }
    }
    // Tolerance: 1e-4 absolute on logits of magnitude ~10 (the same f32 operations, but matrix
    // products blocked differently for 1 and 12 rows).
    assert!(worst < 1e-4, "worst logit difference {worst}");
    assert!(
        cache.grow(0).is_err(),
        "a full sequence must refuse to grow"
    );
}

#[test]
fn training_tiny_on_a_short_text_halves_the_loss() {
    let config = LlamaConfig::preset("tiny").unwrap();
    let tok = ByteTokenizer::from_config(&config).unwrap();
    let model = Transformer::new(config);
    let mut params = vec![0.0; model.layout().len()];
    init_params(model.layout(), model.config(), 1, &mut params).unwrap();
    let ids = tok.encode("the quick brown fox jumps over the lazy dog. ", true);
    let t = ids.len() - 1;
    let weights = vec![1.0; t];
    let batch = TrainBatch {
        batch: 1,
        seq: t,
        inputs: &ids[..t],
        targets: &ids[1..],
        weights: &weights,
        normaliser: t as f32,
        entropy_mask: None,
        entropy_coef: 0.0,
    };
    let adamw = AdamWConfig {
        lr: 1e-2,
        ..AdamWConfig::default()
    };
    let mut trainer = Trainer::new(model, params, adamw).unwrap();
    let first = trainer.train_step(&batch).unwrap().loss;
    let mut last = first;
    for _ in 0..60 {
        last = trainer.train_step(&batch).unwrap().loss;
    }
    let mut logprobs = Vec::new();
    let eval = trainer.evaluate(&batch, &mut logprobs).unwrap();
    assert!(
        eval < first / 2.0,
        "loss went from {first} to {last} (eval {eval})"
    );
    assert_eq!(logprobs.len(), t);
}

#[test]
fn a_batch_with_an_out_of_vocabulary_token_is_refused_naming_it() {
    let model = Transformer::new(tiny(true));
    let params = spread_params(&model, 31);
    let err = score_tokens(&model, &params, &[256, 300, 5])
        .unwrap_err()
        .to_string();
    assert!(err.contains("300"), "{err}");
}

#[test]
fn a_scoring_batch_needs_two_tokens_and_one_weight_per_scored_token() {
    let err = scoring_batch(&[256], &[]).unwrap_err().to_string();
    assert!(err.contains("at least two tokens"), "{err}");
    let err = scoring_batch(&[256, 1, 2], &[1.0]).unwrap_err().to_string();
    assert!(err.contains("1 weights for 2 scored tokens"), "{err}");
    let weights = [1.0, 1.0];
    let batch = scoring_batch(&[256, 1, 2], &weights).unwrap();
    assert_eq!(
        (batch.inputs, batch.targets, batch.seq),
        (&[256, 1][..], &[1, 2][..], 2)
    );
}

#[test]
fn loss_is_the_weighted_sum_of_log_probs_over_the_normaliser_and_zero_weights_mask() {
    let model = Transformer::new(tiny(true));
    let params = spread_params(&model, 41);
    let (b, t) = (2, 9);
    let v = model.config().vocab_size;
    let mut rng = ChaCha8Rng::seed_from_u64(42);
    let inputs = random_tokens(&mut rng, b * t, v);
    let mut targets = random_tokens(&mut rng, b * t, v);
    let mut weights: Vec<f32> = (0..b * t)
        .map(|_| rng.random::<f32>() * 2.0 - 1.0)
        .collect();
    weights[4] = 0.0;
    let al = model.activation_layout(b, t).unwrap();
    let mut acts = vec![0.0; al.len()];
    let mut run = |targets: &[u32], grads: &mut Vec<f32>| {
        let batch = TrainBatch {
            batch: b,
            seq: t,
            inputs: &inputs,
            targets,
            weights: &weights,
            normaliser: 3.5,
            entropy_mask: None,
            entropy_coef: 0.0,
        };
        let loss = model.forward(&params, &mut acts, &al, &batch).unwrap();
        let lp = Transformer::logprobs(&al, &acts).to_vec();
        grads.iter_mut().for_each(|g| *g = 0.0);
        model
            .backward(&params, grads, &mut acts, &al, &batch)
            .unwrap();
        (loss, lp)
    };
    let mut g1 = vec![0.0; params.len()];
    let (loss, lp) = run(&targets, &mut g1);
    let want: f64 = lp
        .iter()
        .zip(&weights)
        .map(|(l, w)| -f64::from(*l) * f64::from(*w))
        .sum::<f64>()
        / 3.5;
    // Tolerance 1e-5 relative: the same f32 log-probs summed in f64 both ways.
    assert!(
        (f64::from(loss) - want).abs() < 1e-5 * want.abs().max(1.0),
        "loss {loss} vs {want}"
    );
    // Changing the target of a zero-weight position changes neither loss nor gradients.
    targets[4] = (targets[4] + 1) % v as u32;
    let mut g2 = vec![0.0; params.len()];
    let (loss2, _) = run(&targets, &mut g2);
    assert_eq!(loss.to_bits(), loss2.to_bits());
    assert_eq!(g1, g2);
}

#[test]
fn prefill_then_decoding_gives_the_full_forward_logits() {
    let model = Transformer::new(tiny(true));
    let params = spread_params(&model, 51);
    let t = 10;
    let v = model.config().vocab_size;
    let mut rng = ChaCha8Rng::seed_from_u64(52);
    let inputs = random_tokens(&mut rng, t, v);
    let weights = vec![1.0; t];
    let batch = TrainBatch {
        batch: 1,
        seq: t,
        inputs: &inputs,
        targets: &inputs,
        weights: &weights,
        normaliser: 1.0,
        entropy_mask: None,
        entropy_coef: 0.0,
    };
    let al = model.activation_layout(1, t).unwrap();
    let mut acts = vec![0.0; al.len()];
    model.forward(&params, &mut acts, &al, &batch).unwrap();
    let full = Transformer::logits(&al, &acts);

    let prompt = 4;
    let mut cache = ContiguousKvCache::new(model.config(), 1, t);
    let mut scratch = DecodeScratch::new(model.config(), 1, t);
    let mut logits = vec![0.0; v];
    model
        .prefill(&params, &mut cache, 0, &inputs[..prompt], &mut logits)
        .unwrap();
    let mut worst = crate::ops::testing::max_abs_diff(&logits, &full[(prompt - 1) * v..prompt * v]);
    for (pos, &token) in inputs.iter().enumerate().skip(prompt) {
        model
            .decode_step(
                &params,
                &mut cache,
                &[0],
                &[token],
                &mut logits,
                &mut scratch,
            )
            .unwrap();
        let d = crate::ops::testing::max_abs_diff(&logits, &full[pos * v..(pos + 1) * v]);
        worst = worst.max(d);
    }
    // Tolerance: 1e-4 absolute, as for token-by-token decoding.
    assert!(worst < 1e-4, "worst logit difference {worst}");
    let err = model.prefill(&params, &mut cache, 0, &inputs[..2], &mut logits);
    assert!(matches!(err, Err(ModelError::KvCache(_))), "{err:?}");
}

#[test]
fn a_sequence_decodes_to_the_same_bits_alone_and_in_any_batch() {
    let model = Transformer::new(tiny(false));
    let params = spread_params(&model, 61);
    let (b, t) = (19, 6);
    let v = model.config().vocab_size;
    let mut rng = ChaCha8Rng::seed_from_u64(62);
    let inputs = random_tokens(&mut rng, b * t, v);
    let decode_all = |seqs: &[usize]| {
        let mut cache = ContiguousKvCache::new(model.config(), b, t);
        let mut scratch = DecodeScratch::new(model.config(), b, t);
        let mut logits = vec![0.0; seqs.len() * v];
        for step in 0..t {
            let tokens: Vec<u32> = seqs.iter().map(|&s| inputs[s * t + step]).collect();
            model
                .decode_step(
                    &params,
                    &mut cache,
                    seqs,
                    &tokens,
                    &mut logits,
                    &mut scratch,
                )
                .unwrap();
        }
        logits
    };
    let batch: Vec<usize> = (0..b).rev().collect();
    let together = decode_all(&batch);
    for (i, &seq) in batch.iter().enumerate() {
        let alone = decode_all(&[seq]);
        let same = alone
            .iter()
            .zip(&together[i * v..(i + 1) * v])
            .all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "sequence {seq} decodes differently in a batch of {b}");
    }
}
