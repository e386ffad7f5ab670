//! Every model family against a float64 reference written here from the transformers modelling
//! code (independent of the kernels): log-probs, gradients by finite differences of the
//! reference, and KV-cache decoding against the full forward pass.

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{Value, json};

use super::*;

/// A small config of `family` with every feature of it switched on.
pub(crate) fn family_config(family: &str) -> LlamaConfig {
    let mut v = json!({
        "model_type": family,
        "vocab_size": 61,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100.0,
        "tie_word_embeddings": false,
        "bos_token_id": 1,
        "eos_token_id": 2,
    });
    match family {
        "llama" => {
            v["rope_scaling"] = json!({
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64
            });
            v["eos_token_id"] = json!([2, 3]);
        }
        "qwen2" => {
            v["tie_word_embeddings"] = Value::Bool(true);
            v["use_sliding_window"] = Value::Bool(false);
            v["sliding_window"] = json!(4096);
        }
        "qwen3" => {
            v["head_dim"] = json!(12);
            v["attention_bias"] = Value::Bool(false);
        }
        _ => v["sliding_window"] = Value::Null,
    }
    LlamaConfig::from_json_str(&v.to_string()).unwrap()
}

const FAMILIES: [&str; 4] = ["llama", "qwen2", "qwen3", "mistral"];

/// Parameters far enough from zero that every piece matters: norms in 0.5..1.5, the rest
/// uniform in ±0.4 (biases included).
fn random_params(layout: &ParamLayout, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut params = vec![0.0; layout.len()];
    for spec in layout.specs() {
        for p in &mut params[spec.range()] {
            *p = if spec.kind.is_norm() {
                0.5 + rng.random::<f32>()
            } else {
                (rng.random::<f32>() * 2.0 - 1.0) * 0.4
            };
        }
    }
    params
}

/// The rotary inverse frequencies as transformers computes them, in float64.
fn reference_inv_freq(c: &LlamaConfig) -> Vec<f64> {
    let d = c.head_dim as f64;
    (0..c.head_dim / 2)
        .map(|i| {
            let f = 1.0 / c.rope_theta.powf(2.0 * i as f64 / d);
            match c.rope_scaling {
                crate::ops::RopeScaling::Default => f,
                crate::ops::RopeScaling::Linear { factor } => f / f64::from(factor),
                crate::ops::RopeScaling::Llama3 {
                    factor,
                    low_freq_factor: low,
                    high_freq_factor: high,
                    original_max_position_embeddings: old,
                } => {
                    let (factor, low, high, old) =
                        (factor as f64, low as f64, high as f64, old as f64);
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < old / high {
                        f
                    } else if wavelen > old / low {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low) / (high - low);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                }
            }
        })
        .collect()
}

fn rmsnorm(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(x, w)| x * r * w).collect()
}

/// `x (in) · W^T` for `W (out, in)`, plus the bias.
fn linear(x: &[f64], w: &[f64], bias: Option<&[f64]>) -> Vec<f64> {
    let n_in = x.len();
    w.chunks(n_in)
        .enumerate()
        .map(|(o, row)| {
            row.iter().zip(x).map(|(a, b)| a * b).sum::<f64>() + bias.map_or(0.0, |b| b[o])
        })
        .collect()
}

fn rotate(x: &mut [f64], pos: usize, inv_freq: &[f64]) {
    let half = inv_freq.len();
    for head in x.chunks_mut(2 * half) {
        for i in 0..half {
            let (c, s) = (
                (pos as f64 * inv_freq[i]).cos(),
                (pos as f64 * inv_freq[i]).sin(),
            );
            let (a, b) = (head[i], head[i + half]);
            head[i] = a * c - b * s;
            head[i + half] = b * c + a * s;
        }
    }
}

/// The log-prob of each target of one sequence under the float64 reference.
fn reference_logprobs(
    c: &LlamaConfig,
    params: &[f64],
    inputs: &[u32],
    targets: &[u32],
) -> Vec<f64> {
    let layout = ParamLayout::new(c);
    let w = |kind, layer| &params[layout.range(kind, layer)];
    let opt = |kind, layer| layout.get(kind, layer).map(|r| &params[r]);
    let (h, d, eps) = (c.hidden_size, c.head_dim, f64::from(c.rms_norm_eps));
    let (heads, kv_heads) = (c.num_heads, c.num_kv_heads);
    let inv_freq = reference_inv_freq(c);
    let emb = w(ParamKind::Embedding, 0);
    let mut xs: Vec<Vec<f64>> = inputs
        .iter()
        .map(|&t| emb[t as usize * h..(t as usize + 1) * h].to_vec())
        .collect();
    for l in 0..c.num_layers {
        let mut qs = Vec::new();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for (pos, x) in xs.iter().enumerate() {
            let n = rmsnorm(x, w(ParamKind::InputNorm, l), eps);
            let mut q = linear(&n, w(ParamKind::QProj, l), opt(ParamKind::QBias, l));
            let mut k = linear(&n, w(ParamKind::KProj, l), opt(ParamKind::KBias, l));
            let v = linear(&n, w(ParamKind::VProj, l), opt(ParamKind::VBias, l));
            if let (Some(qn), Some(kn)) = (opt(ParamKind::QNorm, l), opt(ParamKind::KNorm, l)) {
                q = q.chunks(d).flat_map(|hd| rmsnorm(hd, qn, eps)).collect();
                k = k.chunks(d).flat_map(|hd| rmsnorm(hd, kn, eps)).collect();
            }
            rotate(&mut q, pos, &inv_freq);
            rotate(&mut k, pos, &inv_freq);
            qs.push(q);
            ks.push(k);
            vs.push(v);
        }
        for t in 0..xs.len() {
            let mut att = vec![0.0; heads * d];
            for hd in 0..heads {
                let kv = hd / (heads / kv_heads);
                let q = &qs[t][hd * d..(hd + 1) * d];
                let scores: Vec<f64> = (0..=t)
                    .map(|u| {
                        let k = &ks[u][kv * d..(kv + 1) * d];
                        q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() / (d as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                for (u, s) in scores.iter().enumerate() {
                    let p = (s - max).exp() / z;
                    for i in 0..d {
                        att[hd * d + i] += p * vs[u][kv * d + i];
                    }
                }
            }
            let o = linear(&att, w(ParamKind::OProj, l), None);
            for (x, o) in xs[t].iter_mut().zip(o) {
                *x += o;
            }
            let n = rmsnorm(&xs[t], w(ParamKind::PostAttentionNorm, l), eps);
            let gate = linear(&n, w(ParamKind::GateProj, l), None);
            let up = linear(&n, w(ParamKind::UpProj, l), None);
            let act: Vec<f64> = gate
                .iter()
                .zip(&up)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let down = linear(&act, w(ParamKind::DownProj, l), None);
            for (x, o) in xs[t].iter_mut().zip(down) {
                *x += o;
            }
        }
    }
    xs.iter()
        .zip(targets)
        .map(|(x, &target)| {
            let n = rmsnorm(x, w(ParamKind::FinalNorm, 0), eps);
            let logits = linear(&n, w(ParamKind::LmHead, 0), None);
            let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = max + logits.iter().map(|z| (z - max).exp()).sum::<f64>().ln();
            logits[target as usize] - lse
        })
        .collect()
}

struct Case {
    model: Transformer,
    params: Vec<f32>,
    inputs: Vec<u32>,
    targets: Vec<u32>,
    weights: Vec<f32>,
    batch: usize,
    seq: usize,
}

impl Case {
    fn new(family: &str, seed: u64) -> Self {
        let model = Transformer::new(family_config(family));
        let params = random_params(model.layout(), seed);
        let (batch, seq) = (2, 7);
        let mut rng = ChaCha8Rng::seed_from_u64(seed + 1);
        let v = model.config().vocab_size as u32;
        let inputs = (0..batch * seq).map(|_| rng.random_range(0..v)).collect();
        let targets = (0..batch * seq).map(|_| rng.random_range(0..v)).collect();
        let weights = (0..batch * seq)
            .map(|_| rng.random::<f32>() + 0.25)
            .collect();
        Self {
            model,
            params,
            inputs,
            targets,
            weights,
            batch,
            seq,
        }
    }

    fn train_batch(&self) -> TrainBatch<'_> {
        TrainBatch {
            batch: self.batch,
            seq: self.seq,
            inputs: &self.inputs,
            targets: &self.targets,
            weights: &self.weights,
            normaliser: 3.0,
            entropy_mask: None,
            entropy_coef: 0.0,
        }
    }

    /// The reference loss of `params`, as the model defines it.
    fn reference_loss(&self, params: &[f64]) -> f64 {
        let t = self.seq;
        (0..self.batch)
            .map(|b| {
                let r = b * t..(b + 1) * t;
                let lp = reference_logprobs(
                    self.model.config(),
                    params,
                    &self.inputs[r.clone()],
                    &self.targets[r.clone()],
                );
                lp.iter()
                    .zip(&self.weights[r])
                    .map(|(lp, w)| -lp * f64::from(*w))
                    .sum::<f64>()
            })
            .sum::<f64>()
            / 3.0
    }
}

#[test]
fn every_family_gives_the_float64_reference_log_probs_within_1e_4() {
    for family in FAMILIES {
        let case = Case::new(family, 5);
        let batch = case.train_batch();
        let al = case
            .model
            .activation_layout(batch.batch, batch.seq)
            .unwrap();
        let mut acts = vec![0.0; al.len()];
        case.model
            .forward(&case.params, &mut acts, &al, &batch)
            .unwrap();
        let got = Transformer::logprobs(&al, &acts);
        let params64: Vec<f64> = case.params.iter().map(|&x| f64::from(x)).collect();
        let mut worst = 0.0f64;
        for b in 0..batch.batch {
            let r = b * batch.seq..(b + 1) * batch.seq;
            let want = reference_logprobs(
                case.model.config(),
                &params64,
                &case.inputs[r.clone()],
                &case.targets[r.clone()],
            );
            for (g, w) in got[r].iter().zip(&want) {
                worst = worst.max((f64::from(*g) - w).abs());
            }
        }
        assert!(
            worst < 1e-4,
            "{family}: largest log-prob difference {worst}"
        );
    }
}

#[test]
fn every_family_has_gradients_equal_to_finite_differences_of_the_reference() {
    for family in FAMILIES {
        let case = Case::new(family, 9);
        let batch = case.train_batch();
        let lay = case.model.layout();
        let al = case
            .model
            .activation_layout(batch.batch, batch.seq)
            .unwrap();
        let mut acts = vec![0.0; al.len()];
        let mut grads = vec![0.0; lay.len()];
        case.model
            .forward(&case.params, &mut acts, &al, &batch)
            .unwrap();
        case.model
            .backward(&case.params, &mut grads, &mut acts, &al, &batch)
            .unwrap();
        // Directional derivative along a fresh direction per tensor; central differences of
        // the float64 reference with step 1e-5 are exact to ~1e-9, the float32 gradient to
        // ~1e-5 relative: tolerance 1e-3 relative.
        let params64: Vec<f64> = case.params.iter().map(|&x| f64::from(x)).collect();
        let mut rng = ChaCha8Rng::seed_from_u64(77);
        let mut worst = (0.0f64, String::new());
        for spec in lay.specs() {
            let dir: Vec<f64> = (0..spec.numel())
                .map(|_| rng.random::<f64>() * 2.0 - 1.0)
                .collect();
            let analytic: f64 = grads[spec.range()]
                .iter()
                .zip(&dir)
                .map(|(g, u)| f64::from(*g) * u)
                .sum();
            let eps = 1e-5;
            let at = |sign: f64| {
                let mut p = params64.clone();
                for (x, u) in p[spec.range()].iter_mut().zip(&dir) {
                    *x += sign * eps * u;
                }
                case.reference_loss(&p)
            };
            let numeric = (at(1.0) - at(-1.0)) / (2.0 * eps);
            let rel = (analytic - numeric).abs() / analytic.abs().max(numeric.abs()).max(1e-3);
            if rel > worst.0 {
                worst = (rel, format!("{}: {analytic} vs {numeric}", spec.name));
            }
        }
        assert!(worst.0 < 1e-3, "{family}: worst {} at {}", worst.0, worst.1);
    }
}

#[test]
fn every_family_decodes_with_a_kv_cache_as_the_full_forward_pass_computes() {
    for family in FAMILIES {
        let case = Case::new(family, 13);
        let (c, v, t) = (
            case.model.config(),
            case.model.config().vocab_size,
            case.seq,
        );
        let tokens = &case.inputs[..t];
        let batch = TrainBatch {
            batch: 1,
            seq: t,
            inputs: tokens,
            targets: tokens,
            weights: &case.weights[..t],
            normaliser: 1.0,
            entropy_mask: None,
            entropy_coef: 0.0,
        };
        let al = case.model.activation_layout(1, t).unwrap();
        let mut acts = vec![0.0; al.len()];
        case.model
            .forward(&case.params, &mut acts, &al, &batch)
            .unwrap();
        let full = Transformer::logits(&al, &acts).to_vec();
        let mut cache = ContiguousKvCache::new(c, 1, t);
        let mut scratch = DecodeScratch::new(c, 1, t);
        let mut logits = vec![0.0; v];
        case.model
            .prefill(&case.params, &mut cache, 0, &tokens[..3], &mut logits)
            .unwrap();
        let mut worst = 0.0f32;
        for (a, b) in logits.iter().zip(&full[2 * v..3 * v]) {
            worst = worst.max((a - b).abs());
        }
        for pos in 3..t {
            case.model
                .decode_step(
                    &case.params,
                    &mut cache,
                    &[0],
                    &tokens[pos..=pos],
                    &mut logits,
                    &mut scratch,
                )
                .unwrap();
            for (a, b) in logits.iter().zip(&full[pos * v..(pos + 1) * v]) {
                worst = worst.max((a - b).abs());
            }
        }
        assert!(worst < 1e-4, "{family}: largest logit difference {worst}");
    }
}
