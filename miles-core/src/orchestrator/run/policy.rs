//! The actor's optimizer steps over one rollout with the policy loss of [`PolicyLoss`]: the
//! importance ratio against the weights that generated the rollout, its clip, and the KL
//! penalty to the reference model, each token's share expressed as its weight on `-log p`.
//!
//! The rollout trains in global batches, one optimizer step each. The first batch is on-policy
//! (ratio 1); the log-probs of the later batches under the rollout's weights are computed
//! before the first step, and each batch's current log-probs just before its own. Without a KL
//! penalty and with one batch the weights are the advantages and no extra pass runs. Every
//! step's batch marks its response tokens, so the actor measures their entropy and, with
//! `--entropy-coef`, adds the entropy bonus to the loss.
//!
//! [`PolicyLoss`]: crate::orchestrator::PolicyLoss

use std::time::Instant;

use super::Orchestrator;
use crate::backend::Batch;
use crate::orchestrator::OrchestratorError;
use crate::orchestrator::batch::{Sequence, build_batch};
use crate::store::StreamStats;

/// What the actor's steps over one rollout measured.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct PolicyStats {
    /// Mean of the backends' losses.
    pub loss: f32,
    /// Mean of the surrogate `-min(r A, clip(r) A)` over the trained tokens.
    pub pg_loss: f32,
    /// Mean KL estimate to the reference over the trained tokens (0 without one).
    pub kl: f32,
    /// Share of the trained tokens whose ratio the clip held.
    pub clip_fraction: f32,
    /// Mean entropy of the policy over the trained tokens, before each step's update; `None`
    /// where the actor does not measure it.
    pub entropy: Option<f32>,
    /// Largest gradient norm (before clipping) of the steps.
    pub grad_norm: f32,
    /// Learning rate of the last step.
    pub lr: f64,
    /// Token positions the optimizer steps processed.
    pub tokens: u64,
    /// Wall seconds of the optimizer steps and the passes they needed.
    pub seconds: f64,
    /// What the steps moved of optimizer state streamed through the disk, summed.
    pub optimizer_stream: Option<StreamStats>,
}

impl Orchestrator {
    /// The actor's optimizer steps over `sequences` in global batches.
    /// A loss or gradient norm that is not finite stops it, naming RL step `rl_step`.
    pub(super) fn train_policy(
        &mut self,
        sequences: &[Sequence<'_>],
        rl_step: u64,
    ) -> Result<PolicyStats, OrchestratorError> {
        let started = Instant::now();
        let pad = self.tokenizer.pad();
        let chunks: Vec<&[Sequence<'_>]> = sequences
            .chunks(self.config.global_batch_size.max(1))
            .collect();
        let batches: Vec<Batch> = chunks.iter().map(|c| build_batch(c, pad)).collect();
        let loss = self.config.rl.loss;
        let shaped = loss.kl.is_some() || batches.len() > 1;
        let mut stats = PolicyStats::default();
        let (mut trained, mut clipped, mut kl, mut surrogate) = (0usize, 0usize, 0.0f64, 0.0f64);
        let mut refs = Vec::new();
        let mut olds = Vec::new();
        if shaped {
            for (i, batch) in batches.iter().enumerate() {
                if let Some(reference) = &self.reference
                    && loss.kl.is_some()
                {
                    refs.push(reference.logprobs(batch)?);
                }
                olds.push(if i == 0 {
                    None
                } else {
                    Some(self.logprobs(batch)?)
                });
            }
        }
        let mut losses = Vec::with_capacity(batches.len());
        // The entropy sums of the steps times their normalisers, and the normalisers.
        let (mut entropy, mut entropy_tokens) = (Some(0.0f64), 0.0f64);
        for (i, (batch, chunk)) in batches.iter().zip(&chunks).enumerate() {
            // Continuation targets: those a weight of 1 marks.
            let ones: Vec<Sequence<'_>> = chunk
                .iter()
                .map(|s| Sequence { weight: 1.0, ..*s })
                .collect();
            let mask = build_batch(&ones, pad).weights;
            let mut step_batch = if shaped {
                let current = self.logprobs(batch)?;
                let old = olds[i].as_deref().unwrap_or(&current);
                let reference = refs.get(i).map(Vec::as_slice);
                let mut shaped = batch.clone();
                for t in 0..batch.weights.len() {
                    if mask[t] == 0.0 {
                        continue;
                    }
                    let r = reference.map_or(current[t], |r| r[t]);
                    let token = loss.token(batch.weights[t], current[t], old[t], r);
                    shaped.weights[t] = token.weight;
                    trained += 1;
                    clipped += usize::from(token.clipped);
                    kl += f64::from(token.kl);
                    surrogate += f64::from(token.surrogate);
                }
                shaped
            } else {
                // On-policy: the surrogate of a token is minus its advantage.
                surrogate -= batch.weights.iter().map(|&w| f64::from(w)).sum::<f64>();
                trained += batch.normaliser as usize;
                batch.clone()
            };
            step_batch.entropy_mask = Some(mask);
            step_batch.entropy_coef = self.config.rl.entropy_coef;
            let schedule = self.config.rl.lr;
            stats.lr = schedule.at(self.state.step * batches.len() as u64 + i as u64 + 1);
            if schedule.varies() {
                self.actor
                    .get()?
                    .set_lr(stats.lr as f32)
                    .map_err(OrchestratorError::train("actor", "set its learning rate"))?;
            }
            let step = self
                .actor
                .get()?
                .train_step(&step_batch)
                .map_err(OrchestratorError::train("actor", "train"))?;
            super::check_finite("actor", "step", rl_step, &step)?;
            losses.push(step.loss);
            let tokens = f64::from(step_batch.normaliser);
            entropy = entropy
                .zip(step.entropy)
                .map(|(sum, e)| sum + f64::from(e) * tokens);
            entropy_tokens += tokens;
            stats.grad_norm = stats.grad_norm.max(step.grad_norm);
            stats.tokens += step.tokens;
            if let Some(moved) = &step.optimizer_stream {
                stats
                    .optimizer_stream
                    .get_or_insert_with(StreamStats::default)
                    .add(moved);
            }
        }
        let per_token = |sum: f64| (sum / trained.max(1) as f64) as f32;
        stats.loss = super::mean_std(&losses).0;
        stats.pg_loss = per_token(surrogate);
        stats.kl = per_token(kl);
        stats.clip_fraction = clipped as f32 / trained.max(1) as f32;
        stats.entropy = entropy.map(|sum| (sum / entropy_tokens.max(1.0)) as f32);
        stats.seconds = started.elapsed().as_secs_f64();
        Ok(stats)
    }

    /// The actor's log-probs of `batch`'s targets now.
    fn logprobs(&mut self, batch: &Batch) -> Result<Vec<f32>, OrchestratorError> {
        self.actor
            .get()?
            .logprobs(batch)
            .map(|(logprobs, _)| logprobs)
            .map_err(OrchestratorError::train("actor", "compute log-probs"))
    }
}
