//! The rollout side of the loop: what the orchestrator drives in an inference engine, shaped
//! after the reference system's inference controller.
//!
//! `miles-infer` implements [`RolloutEngine`]; the orchestrator only calls it, in the order of
//! DESIGN section 8.

use crate::backend::{DeviceWeights, WeightBucket};
use crate::memory::{MemoryError, MemoryTag, OffloadReport};

/// How tokens are drawn in one rollout.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampling {
    /// Softmax temperature; 0 picks the most likely token.
    pub temperature: f32,
    /// Nucleus: sample among the most likely tokens whose probabilities sum to at least this,
    /// in `(0, 1]`.
    pub top_p: f32,
    /// Sample among the `top_k` most likely tokens only; 0 keeps all.
    pub top_k: usize,
    /// Generated tokens per sample at most.
    pub max_new_tokens: usize,
    /// Tokens that end a sample (kept in its output).
    pub stop_tokens: Vec<u32>,
    /// Seed of the rollout; the same seed and weights give the same samples.
    pub seed: u64,
}

/// One generated completion.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    /// Completion token ids, the stop token included when it stopped on one.
    pub tokens: Vec<u32>,
    /// Log-prob of each completion token under the engine's weights.
    pub logprobs: Vec<f32>,
    /// Whether it ended on a stop token (else it ran out of `max_new_tokens`).
    pub stopped: bool,
}

/// What went wrong in a rollout engine.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The engine's own failure, with what it was doing.
    #[error("rollout engine cannot {action}")]
    Engine {
        /// What the loop asked for (`generate`, `onload the weights`).
        action: &'static str,
        /// The engine's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The memory manager failed under the engine.
    #[error(transparent)]
    Memory(#[from] MemoryError),
}

/// An inference engine the colocated loop can drive: generation, offload and onload of its
/// KV cache and weights, and weight updates from the trainer.
///
/// Offload and onload calls return the memory manager's report of each tag they moved, and an
/// empty list when nothing moved (the tag was already where it was asked to go).
pub trait RolloutEngine: Send {
    /// Generates `n` samples for each prompt; the outer list follows `prompts`.
    ///
    /// # Errors
    /// [`EngineError`] when the weights or KV cache are offloaded, or generation fails.
    fn generate(
        &mut self,
        prompts: &[Vec<u32>],
        n: usize,
        sampling: &Sampling,
    ) -> Result<Vec<Vec<Sample>>, EngineError>;

    /// Drops every cached prefix, so that nothing in the KV cache is needed any more.
    ///
    /// # Errors
    /// [`EngineError`] when the engine cannot.
    fn flush_cache(&mut self) -> Result<(), EngineError>;

    /// Releases the KV cache's device memory (its contents are dropped).
    ///
    /// # Errors
    /// [`EngineError`] when the pause fails.
    fn offload_kv(&mut self) -> Result<Vec<OffloadReport>, EngineError>;

    /// Moves the weights off the device, releasing their memory.
    ///
    /// # Errors
    /// [`EngineError`] when the backup fails (the weights then stay on the device).
    fn offload_weights(&mut self) -> Result<Vec<OffloadReport>, EngineError>;

    /// Brings the weights' device memory back at the same addresses.
    ///
    /// # Errors
    /// [`EngineError`] when the device lacks room or the backup is bad.
    fn onload_weights(&mut self) -> Result<Vec<OffloadReport>, EngineError>;

    /// Brings the KV cache's device memory back (empty).
    ///
    /// # Errors
    /// [`EngineError`] when the device lacks room.
    fn onload_kv(&mut self) -> Result<Vec<OffloadReport>, EngineError>;

    /// Releases the device memory of the engine's captured CUDA graphs (`--offload-rollout-level
    /// cuda_graph`); the graphs replay, without recapture, once it is back. An engine without
    /// graphs has nothing to move.
    ///
    /// # Errors
    /// [`EngineError`] when the pause fails.
    fn offload_graphs(&mut self) -> Result<Vec<OffloadReport>, EngineError> {
        Ok(Vec::new())
    }

    /// Brings the graphs' device memory back at the same addresses.
    ///
    /// # Errors
    /// [`EngineError`] when the device lacks room.
    fn onload_graphs(&mut self) -> Result<Vec<OffloadReport>, EngineError> {
        Ok(Vec::new())
    }

    /// Writes one bucket of the trainer's weights, by Hugging Face name, into the engine.
    ///
    /// # Errors
    /// [`EngineError`] for an unknown name or shape, or weights that are offloaded.
    fn update_weights(&mut self, bucket: &WeightBucket) -> Result<(), EngineError>;

    /// Whether [`copy_device_weights`](Self::copy_device_weights) takes `weights`: the engine
    /// computes on their device and holds weights of their layout. Asked before the engine's
    /// weights come back, so that the loop picks the sync path (and its order) up front; `false`
    /// for an engine that cannot (the CPU engines).
    fn accepts_device_weights(&self, weights: &DeviceWeights) -> bool {
        let _ = weights;
        false
    }

    /// Copies the trainer's bf16 weights into the engine's on the device, after `weights.ready`,
    /// and returns once the copy is done (the trainer may offload right after) with the bytes
    /// copied; `None` when the engine does not take them (see
    /// [`accepts_device_weights`](Self::accepts_device_weights)), nothing copied.
    ///
    /// # Errors
    /// [`EngineError`] while the weights are offloaded, or when the copy fails.
    fn copy_device_weights(&mut self, weights: &DeviceWeights) -> Result<Option<u64>, EngineError> {
        let _ = weights;
        Ok(None)
    }

    /// Device bytes each of the engine's tags holds now (nothing for an offloaded tag).
    fn resident_bytes(&self) -> Vec<(MemoryTag, u64)>;
}
