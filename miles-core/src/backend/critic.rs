//! The PPO critic's contract: what the loop asks of a learned value function.

use std::path::Path;

use super::{BackendError, OffloadStats};
use crate::memory::MemoryTag;

/// A learned value function for PPO: one scalar value per prompt.
///
/// The loop asks it for the value of each prompt before training, uses `reward - value` as
/// every sample's advantage (one reward per sequence, so no per-token bootstrapping: GAE with
/// `gamma = lambda = 1` reduces to this), and then regresses the values on the rewards. It is
/// trained and offloaded alongside the actor.
pub trait Critic: Send {
    /// The critic's name in logs.
    fn name(&self) -> &'static str;

    /// Device bytes each memory tag of the critic holds now, summed over its ranks (0 for a
    /// paused tag), as [`TrainBackend::device_memory`](super::TrainBackend::device_memory).
    fn device_memory(&self) -> Vec<(MemoryTag, u64)>;

    /// The value of each prompt (token ids, `BOS` first).
    ///
    /// # Errors
    /// [`BackendError::Offloaded`] while offloaded; what the model hit.
    fn values(&mut self, prompts: &[Vec<u32>]) -> Result<Vec<f32>, BackendError>;

    /// One optimizer step of the squared error between the values of `prompts` and `targets`;
    /// returns the loss before the step.
    ///
    /// # Errors
    /// As [`values`](Self::values).
    fn train_values(&mut self, prompts: &[Vec<u32>], targets: &[f32]) -> Result<f32, BackendError>;

    /// Whether the critic's tensors are offloaded.
    fn is_offloaded(&self) -> bool;

    /// Moves the critic's tensors to where it was built to offload them, releasing their device
    /// memory.
    ///
    /// # Errors
    /// As [`TrainBackend::offload`](super::TrainBackend::offload).
    fn offload(&mut self) -> Result<OffloadStats, BackendError>;

    /// Brings the critic's tensors back.
    ///
    /// # Errors
    /// As [`TrainBackend::onload`](super::TrainBackend::onload).
    fn onload(&mut self) -> Result<OffloadStats, BackendError>;

    /// Writes the critic's checkpoint into `dir`.
    ///
    /// # Errors
    /// As [`TrainBackend::save`](super::TrainBackend::save).
    fn save(&mut self, dir: &Path) -> Result<(), BackendError>;

    /// On a rank that does not write the checkpoint: its part of the critic's save, as
    /// [`TrainBackend::assist_save`](super::TrainBackend::assist_save). By default, nothing.
    ///
    /// # Errors
    /// As [`TrainBackend::assist_save`](super::TrainBackend::assist_save).
    fn assist_save(&mut self) -> Result<(), BackendError> {
        Ok(())
    }

    /// Restores the critic from `dir`.
    ///
    /// # Errors
    /// As [`TrainBackend::load`](super::TrainBackend::load).
    fn load(&mut self, dir: &Path) -> Result<(), BackendError>;
}
