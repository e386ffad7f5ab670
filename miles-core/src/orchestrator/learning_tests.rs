//! The loop and the language-model critic on the real model: a single-rank training backend
//! over [`Trainer`] and an engine that samples from the model's logits. They show that tasks,
//! rewards, advantages and batches fit together into learning, before the real backends and
//! engine are wired.

use std::path::Path;

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::backend::{
    BackendError, Batch, Critic, EngineError, NamedTensor, OffloadStats, RolloutEngine, Sample,
    Sampling, StepStats, TrainBackend, WeightBucket, WeightSink,
};
use crate::config::{AdvantageEstimator, Task};
use crate::memory::{MemoryTag, OffloadReport};
use crate::model::{ByteTokenizer, LlamaConfig, TrainBatch, Trainer, Transformer, init_params};
use crate::ops::AdamWConfig;

fn tiny() -> LlamaConfig {
    LlamaConfig::preset("tiny").unwrap()
}

fn init(seed: u64) -> Vec<f32> {
    let config = tiny();
    let model = Transformer::new(config.clone());
    let mut params = vec![0.0; model.layout().len()];
    init_params(model.layout(), &config, seed, &mut params).unwrap();
    params
}

/// One rank, `Vec` buffers, no memory regions: it has nothing to offload.
struct ModelActor {
    config: LlamaConfig,
    trainer: Trainer,
    step: u64,
}

impl ModelActor {
    fn new(seed: u64, lr: f32) -> Self {
        let adamw = AdamWConfig {
            lr,
            ..AdamWConfig::default()
        };
        Self {
            config: tiny(),
            trainer: Trainer::new(Transformer::new(tiny()), init(seed), adamw).unwrap(),
            step: 0,
        }
    }
}

fn unsupported(what: &str) -> BackendError {
    BackendError::Settings {
        backend: "test-model",
        reason: format!("{what} is not part of this test backend"),
    }
}

impl TrainBackend for ModelActor {
    fn name(&self) -> &'static str {
        "test-model"
    }
    fn config(&self) -> &LlamaConfig {
        &self.config
    }
    fn step(&self) -> u64 {
        self.step
    }
    fn is_offloaded(&self) -> bool {
        false
    }
    fn device_memory(&self) -> Vec<(MemoryTag, u64)> {
        Vec::new()
    }
    fn train_step(&mut self, batch: &Batch) -> Result<StepStats, BackendError> {
        batch.check(1)?;
        let report = self.trainer.train_step(&batch.view())?;
        self.step += 1;
        Ok(StepStats {
            step: self.step,
            loss: report.loss,
            grad_norm: 0.0,
            entropy: report.entropy,
            tokens: (batch.batch * batch.seq) as u64,
            seconds: 0.0,
            optimizer_stream: None,
        })
    }
    fn logprobs(&mut self, batch: &Batch) -> Result<(Vec<f32>, f32), BackendError> {
        let mut logprobs = Vec::new();
        let loss = self.trainer.evaluate(&batch.view(), &mut logprobs)?;
        Ok((logprobs, loss))
    }
    fn offload(&mut self) -> Result<OffloadStats, BackendError> {
        Err(unsupported("offload"))
    }
    fn onload(&mut self) -> Result<OffloadStats, BackendError> {
        Err(unsupported("onload"))
    }
    fn export_weights(
        &mut self,
        _bucket_bytes: usize,
        sink: &mut WeightSink<'_>,
    ) -> Result<(), BackendError> {
        let params = &self.trainer.buffers().params;
        let tensors = self
            .trainer
            .model()
            .layout()
            .specs()
            .iter()
            .map(|spec| NamedTensor {
                name: spec.name.clone(),
                shape: spec.shape.clone(),
                data: params[spec.range()].to_vec(),
            })
            .collect();
        sink(WeightBucket { tensors })
    }
    fn save(&mut self, _: &Path) -> Result<(), BackendError> {
        Err(unsupported("save"))
    }
    fn load(&mut self, _: &Path) -> Result<(), BackendError> {
        Err(unsupported("load"))
    }
}

/// Samples token by token from a full forward pass of each sequence.
struct ModelEngine {
    model: Transformer,
    params: Vec<f32>,
}

impl ModelEngine {
    fn next_logits(&self, ids: &[u32]) -> Vec<f32> {
        let t = ids.len();
        let al = self.model.activation_layout(1, t).unwrap();
        let mut acts = vec![0.0; al.len()];
        let weights = vec![0.0; t];
        let batch = TrainBatch {
            batch: 1,
            seq: t,
            inputs: ids,
            targets: ids,
            weights: &weights,
            normaliser: 1.0,
            entropy_mask: None,
            entropy_coef: 0.0,
        };
        self.model
            .forward(&self.params, &mut acts, &al, &batch)
            .unwrap();
        let v = self.model.config().vocab_size;
        Transformer::logits(&al, &acts)[(t - 1) * v..t * v].to_vec()
    }
}

impl RolloutEngine for ModelEngine {
    fn generate(
        &mut self,
        prompts: &[Vec<u32>],
        n: usize,
        sampling: &Sampling,
    ) -> Result<Vec<Vec<Sample>>, EngineError> {
        Ok(prompts
            .iter()
            .enumerate()
            .map(|(i, prompt)| {
                (0..n)
                    .map(|j| {
                        let mut rng = ChaCha8Rng::seed_from_u64(
                            sampling.seed ^ ((i as u64) << 20 | j as u64),
                        );
                        let mut ids = prompt.clone();
                        let (mut tokens, mut logprobs) = (Vec::new(), Vec::new());
                        while tokens.len() < sampling.max_new_tokens
                            && !tokens
                                .last()
                                .is_some_and(|t| sampling.stop_tokens.contains(t))
                        {
                            let logits = self.next_logits(&ids);
                            let top = logits.iter().copied().fold(f32::MIN, f32::max);
                            let p: Vec<f64> = logits
                                .iter()
                                .map(|&l| f64::from((l - top) / sampling.temperature).exp())
                                .collect();
                            let total: f64 = p.iter().sum();
                            let mut u = rng.random_range(0.0..total);
                            let pick = p.iter().position(|&q| {
                                u -= q;
                                u < 0.0
                            });
                            let pick = pick.unwrap_or(p.len() - 1);
                            tokens.push(pick as u32);
                            logprobs.push((p[pick] / total).ln() as f32);
                            ids.push(pick as u32);
                        }
                        let stopped = tokens
                            .last()
                            .is_some_and(|t| sampling.stop_tokens.contains(t));
                        Sample {
                            tokens,
                            logprobs,
                            stopped,
                        }
                    })
                    .collect()
            })
            .collect())
    }
    fn flush_cache(&mut self) -> Result<(), EngineError> {
        Ok(())
    }
    fn offload_kv(&mut self) -> Result<Vec<OffloadReport>, EngineError> {
        Ok(Vec::new())
    }
    fn offload_weights(&mut self) -> Result<Vec<OffloadReport>, EngineError> {
        Ok(Vec::new())
    }
    fn onload_weights(&mut self) -> Result<Vec<OffloadReport>, EngineError> {
        Ok(Vec::new())
    }
    fn onload_kv(&mut self) -> Result<Vec<OffloadReport>, EngineError> {
        Ok(Vec::new())
    }
    fn update_weights(&mut self, bucket: &WeightBucket) -> Result<(), EngineError> {
        let layout = self.model.layout().clone();
        for tensor in &bucket.tensors {
            let spec = layout
                .specs()
                .iter()
                .find(|s| s.name == tensor.name)
                .unwrap_or_else(|| panic!("unknown tensor {}", tensor.name));
            self.params[spec.range()].copy_from_slice(&tensor.data);
        }
        Ok(())
    }
    fn resident_bytes(&self) -> Vec<(MemoryTag, u64)> {
        vec![(MemoryTag::Weights, self.params.len() as u64 * 4)]
    }
}

fn tokenizer() -> ByteTokenizer {
    ByteTokenizer::from_config(&tiny()).unwrap()
}

/// Offloads off (this backend has no memory regions), 16 prompts x 8 samples per step, one
/// optimizer step per rollout, a supervised start of 24 steps (the recipe of
/// `examples/colocate-repeat-cpu.toml`).
fn repeat_task(steps: u64, advantage_estimator: AdvantageEstimator) -> LoopConfig {
    LoopConfig {
        steps,
        rollout_batch_size: 16,
        n_samples_per_prompt: 8,
        global_batch_size: 128,
        seed: 42,
        task: Task::Repeat,
        sft_warmup_steps: 24,
        temperature: 1.0,
        offload_train: false,
        offload_rollout: false,
        offload_kv: false,
        offload_weights: false,
        offload_graphs: false,
        bucket_bytes: 1 << 20,
        device_bytes: None,
        margin_bytes: 0,
        offload_when_needed: false,
        patience: Patience {
            retries: 0,
            wait: std::time::Duration::ZERO,
        },
        export_while_offloaded: false,
        advantage_estimator,
        save: None,
        save_interval: None,
        load: None,
        metrics: None,
        memory_timeline: None,
        save_options: None,
        rl: RlOptions::default(),
    }
}

fn engine() -> ModelEngine {
    let model = Transformer::new(tiny());
    let params = vec![0.0; model.layout().len()];
    ModelEngine { model, params }
}

#[test]
fn grpo_raises_the_mean_reward_on_the_repeat_task() {
    let mut o = Orchestrator::new(
        repeat_task(12, AdvantageEstimator::Grpo),
        Box::new(ModelActor::new(1, 5e-3)),
        Box::new(engine()),
        tokenizer(),
    );
    let summary = o.run(&mut |_| {}).unwrap();
    let r = &summary.reward_means;
    let start = r[0];
    let end = r[r.len() - 3..].iter().sum::<f32>() / 3.0;
    println!("mean reward per step: {r:?}");
    assert!(
        end > start + 0.1,
        "reward {start} -> {end} (needs +0.1): {r:?}"
    );
}

#[test]
fn the_entropy_is_measured_every_step_and_the_bonus_keeps_it_above_the_plain_run() {
    let run = |entropy_coef: f32| {
        let mut config = repeat_task(4, AdvantageEstimator::Grpo);
        config.rl.entropy_coef = entropy_coef;
        let mut o = Orchestrator::new(
            config,
            Box::new(ModelActor::new(1, 5e-3)),
            Box::new(engine()),
            tokenizer(),
        );
        let mut entropies = Vec::new();
        o.run(&mut |m| entropies.push(m.rl.entropy.unwrap()))
            .unwrap();
        entropies
    };
    let (plain, bonus) = (run(0.0), run(1.0));
    println!("mean response entropy per step: plain {plain:?}, with a bonus of 1 {bonus:?}");
    let ln_v = (tiny().vocab_size as f32).ln();
    assert!(
        plain.iter().chain(&bonus).all(|&h| h > 0.0 && h <= ln_v),
        "entropies lie in (0, ln V = {ln_v}]: {plain:?} {bonus:?}"
    );
    assert_eq!(
        plain[0], bonus[0],
        "the first step measures before any update"
    );
    assert!(
        bonus[3] > plain[3],
        "the bonus raises the entropy: {bonus:?} vs {plain:?}"
    );
}

#[test]
fn lm_critic_values_move_to_their_targets() {
    let mut critic = LmCritic::new(Box::new(ModelActor::new(5, 1e-2)), tokenizer().pad);
    let t = tokenizer();
    let prompts: Vec<Vec<u32>> = ["r1=", "r2=", "r3="]
        .iter()
        .map(|p| t.encode(p, true))
        .collect();
    let targets = [0.9, 0.1, 0.5];
    let before = critic.values(&prompts).unwrap();
    for _ in 0..60 {
        critic.train_values(&prompts, &targets).unwrap();
    }
    let after = critic.values(&prompts).unwrap();
    let worst = after
        .iter()
        .zip(&targets)
        .map(|(a, t)| (a - t).abs())
        .fold(0.0f32, f32::max);
    println!("values before {before:?}, after {after:?}");
    assert!(
        worst < 0.1,
        "worst difference {worst} (tolerance 0.1): {after:?}"
    );
    assert!(critic.train_values(&prompts, &targets[..2]).is_err());
}

#[test]
fn ppo_with_the_lm_critic_trains_on_the_model() {
    let critic = LmCritic::new(Box::new(ModelActor::new(9, 1e-2)), tokenizer().pad);
    let mut o = Orchestrator::new(
        repeat_task(3, AdvantageEstimator::Ppo),
        Box::new(ModelActor::new(1, 1e-2)),
        Box::new(engine()),
        tokenizer(),
    )
    .with_critic(Box::new(critic));
    let mut losses = Vec::new();
    let summary = o.run(&mut |m| losses.push(m.loss)).unwrap();
    assert_eq!(summary.steps, 3);
    assert!(
        losses.iter().all(|l| l.is_finite() && *l != 0.0),
        "{losses:?}"
    );
}

#[test]
fn kl_loss_and_ratio_clip_train_against_a_reference_under_its_own_tag() {
    let mut config = repeat_task(4, AdvantageEstimator::Grpo);
    // Two optimizer steps per rollout: the second batch trains off-policy, through the ratio.
    config.global_batch_size = 64;
    config.rl.loss = PolicyLoss {
        eps_clip: 0.2,
        eps_clip_high: 0.28,
        kl: Some((crate::config::KlLossType::K3, 0.1)),
    };
    let mut o = Orchestrator::new(
        config,
        Box::new(ModelActor::new(1, 5e-3)),
        Box::new(engine()),
        tokenizer(),
    );
    let mut steps = Vec::new();
    o.run(&mut |m| steps.push(m.rl.clone())).unwrap();
    assert_eq!(steps.len(), 4);
    for rl in &steps {
        assert!(
            rl.kl.is_finite() && rl.kl >= 0.0,
            "k3 is never negative: {rl:?}"
        );
        assert!((0.0..=1.0).contains(&rl.clip_fraction), "{rl:?}");
        assert!(rl.response_len_mean > 0.0, "{rl:?}");
    }
    assert!(
        steps.last().unwrap().kl > 0.0,
        "the actor moved away from the reference: {steps:?}"
    );
    let tags = &o.timeline().samples().last().unwrap().tags;
    assert!(
        tags.iter()
            .any(|(name, bytes)| name == "ref/ref" && *bytes > 0),
        "{tags:?}"
    );
}

#[test]
fn evaluation_changes_no_weight_and_logs_its_mean_reward() {
    let data = {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("eval.jsonl");
        let rows: String = (0..10)
            .map(|d| format!("{{\"input\": \"r{d}=\", \"label\": \"{d}\"}}\n"))
            .collect();
        std::fs::write(&path, rows).unwrap();
        let options = DataOptions {
            keys: DataKeys {
                input: "input".into(),
                label: Some("label".into()),
                metadata: "metadata".into(),
            },
            max_prompt_len: None,
            long_prompt: crate::config::LongPrompt::Skip,
        };
        let t = tokenizer();
        PromptDataset::load(&path, &options, &PlainPrompt, &|s| t.encode(s, true)).unwrap()
    };
    let run = |eval: bool, skips: bool| {
        let mut config = repeat_task(4, AdvantageEstimator::Grpo);
        config.rl.eval_interval = Some(2);
        config.rl.eval_temperature = 1.0;
        let mut o = Orchestrator::new(
            config,
            Box::new(ModelActor::new(1, 5e-3)),
            Box::new(engine()),
            tokenizer(),
        );
        if eval {
            o = o.with_eval_data(data.clone());
        }
        if skips {
            o = o.without_evaluation();
        }
        let mut evals = Vec::new();
        let summary = o.run(&mut |m| evals.push(m.rl.eval_reward_mean)).unwrap();
        (summary.reward_means, evals)
    };
    let (plain, none) = run(false, false);
    let (evaluated, evals) = run(true, false);
    assert_eq!(plain, evaluated, "evaluation must not change training");
    assert!(none.iter().all(Option::is_none));
    // A rank whose job reports the evaluation elsewhere runs none.
    let (skipped, nothing) = run(true, true);
    assert_eq!(plain, skipped);
    assert!(nothing.iter().all(Option::is_none));
    assert!(
        evals[0].is_some() && evals[1].is_none() && evals[2].is_some() && evals[3].is_none(),
        "{evals:?}"
    );
}
