//! A PPO critic from any [`TrainBackend`]: the language model itself is the value head.
//!
//! Rewards of the tasks lie in `[0, 1]`, so a value is a probability: the critic reads the
//! prompt followed by a query byte `?` and the value is `p('1') / (p('1') + p('0'))` at the
//! next position. Training minimises `-(r log p('1') + (1 - r) log p('0'))`, a weighted
//! cross-entropy that the backend's ordinary training step computes (two rows per sample, one
//! per answer token), and whose minimum puts `p('1') = r`: a Bernoulli regression of the value
//! on the reward. No backend needs a scalar head for it.

use std::path::Path;

use crate::backend::{BackendError, Batch, Critic, OffloadStats, TrainBackend};
use crate::memory::MemoryTag;

/// The byte that asks the critic for a value.
const QUERY: u32 = b'?' as u32;
/// The answer byte whose probability is the value.
const YES: u32 = b'1' as u32;
/// The other answer byte.
const NO: u32 = b'0' as u32;

/// A critic on a second [`TrainBackend`] of the same kind as the actor.
pub struct LmCritic {
    backend: Box<dyn TrainBackend>,
    pad: u32,
}

impl LmCritic {
    /// A critic over `backend`, padding its batches with `pad`.
    pub fn new(backend: Box<dyn TrainBackend>, pad: u32) -> Self {
        Self { backend, pad }
    }

    /// Two rows per `(queried prompt, reward)`: the last position (the query byte) predicts `1`
    /// weighted by the reward, and `0` weighted by one minus it; every other target weighs 0.
    fn batch(&self, rows: &[(&[u32], f32)]) -> Batch {
        let seq = rows.iter().map(|(q, _)| q.len()).max().unwrap_or(1).max(1);
        let b = rows.len() * 2;
        // (B, T)
        let mut inputs = vec![self.pad; b * seq];
        let mut targets = vec![self.pad; b * seq];
        let mut weights = vec![0.0; b * seq];
        for (i, &(queried, reward)) in rows.iter().enumerate() {
            let reward = reward.clamp(0.0, 1.0);
            let len = queried.len();
            for (row, (answer, weight)) in
                [(YES, reward), (NO, 1.0 - reward)].into_iter().enumerate()
            {
                let base = (2 * i + row) * seq;
                inputs[base..base + len].copy_from_slice(queried);
                targets[base..base + len - 1].copy_from_slice(&queried[1..]);
                targets[base + len - 1] = answer;
                weights[base + len - 1] = weight;
            }
        }
        Batch {
            batch: b,
            seq,
            inputs,
            targets,
            weights,
            normaliser: rows.len().max(1) as f32,
            entropy_mask: None,
            entropy_coef: 0.0,
        }
    }
}

/// `prompt` with the query byte appended.
fn with_query(prompt: &[u32]) -> Vec<u32> {
    let mut ids = prompt.to_vec();
    ids.push(QUERY);
    ids
}

impl Critic for LmCritic {
    fn name(&self) -> &'static str {
        self.backend.name()
    }

    fn device_memory(&self) -> Vec<(MemoryTag, u64)> {
        self.backend.device_memory()
    }

    fn values(&mut self, prompts: &[Vec<u32>]) -> Result<Vec<f32>, BackendError> {
        let queried: Vec<Vec<u32>> = prompts.iter().map(|p| with_query(p)).collect();
        let rows: Vec<(&[u32], f32)> = queried.iter().map(|p| (p.as_slice(), 0.5)).collect();
        let batch = self.batch(&rows);
        let (logprobs, _) = self.backend.logprobs(&batch)?;
        Ok(queried
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let at = |row: usize| logprobs[(2 * i + row) * batch.seq + p.len() - 1];
                let (yes, no) = (f64::from(at(0)).exp(), f64::from(at(1)).exp());
                (yes / (yes + no).max(f64::MIN_POSITIVE)) as f32
            })
            .collect())
    }

    fn train_values(&mut self, prompts: &[Vec<u32>], targets: &[f32]) -> Result<f32, BackendError> {
        if prompts.len() != targets.len() {
            return Err(BackendError::Batch(format!(
                "{} prompts with {} value targets; give one target per prompt",
                prompts.len(),
                targets.len()
            )));
        }
        let queried: Vec<Vec<u32>> = prompts.iter().map(|p| with_query(p)).collect();
        let rows: Vec<(&[u32], f32)> = queried
            .iter()
            .zip(targets)
            .map(|(p, &r)| (p.as_slice(), r))
            .collect();
        Ok(self.backend.train_step(&self.batch(&rows))?.loss)
    }

    fn is_offloaded(&self) -> bool {
        self.backend.is_offloaded()
    }

    fn offload(&mut self) -> Result<OffloadStats, BackendError> {
        self.backend.offload()
    }

    fn onload(&mut self) -> Result<OffloadStats, BackendError> {
        self.backend.onload()
    }

    fn save(&mut self, dir: &Path) -> Result<(), BackendError> {
        self.backend.save(dir)
    }

    fn assist_save(&mut self) -> Result<(), BackendError> {
        self.backend.assist_save()
    }

    fn load(&mut self, dir: &Path) -> Result<(), BackendError> {
        self.backend.load(dir)
    }
}
