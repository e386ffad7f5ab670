//! The reference model of the KL penalty (`--use-kl-loss`): a frozen copy of the actor's
//! weights at the start of RL, in device memory under its own tag `ref`, that computes the
//! reference log-probs of a rollout before training and then goes to the host with the
//! actor's state.
//!
//! It runs the CPU forward pass on the CPU device; on CUDA the loop refuses `--use-kl-loss`.

use std::sync::Arc;

use crate::backend::{Batch, TrainBackend};
use crate::device::CpuDevice;
use crate::memory::{
    BackupPolicy, Buffer, ManagerSettings, MemoryError, MemoryManager, MemoryTag, OffloadReport,
};
use crate::model::{LlamaConfig, ModelError, ParamLayout, Transformer};

use super::OrchestratorError;

/// The memory tag of the reference model's weights.
pub fn ref_tag() -> MemoryTag {
    MemoryTag::Named("ref".to_owned())
}

/// A frozen model whose weights live in device memory under the tag `ref`.
pub struct ReferenceModel {
    memory: MemoryManager,
    model: Transformer,
    params: Buffer,
    offloaded: bool,
}

fn reference_error(
    action: &'static str,
) -> impl FnOnce(Box<dyn std::error::Error + Send + Sync>) -> OrchestratorError {
    move |source| OrchestratorError::Reference { action, source }
}

impl ReferenceModel {
    /// A reference model of `config` holding `weights` (the full model in
    /// [`ParamLayout`] order) on a CPU device of its own, backed up to the host when offloaded.
    ///
    /// # Errors
    /// [`OrchestratorError::Reference`] for weights of another length, or what the memory
    /// manager hit allocating.
    pub fn new(config: LlamaConfig, weights: &[f32]) -> Result<Self, OrchestratorError> {
        let layout = ParamLayout::new(&config);
        if weights.len() != layout.len() {
            return Err(reference_error("start")(
                format!(
                    "{} weights for a model of {} parameters",
                    weights.len(),
                    layout.len()
                )
                .into(),
            ));
        }
        let bytes = std::mem::size_of_val(weights);
        let device = Arc::new(CpuDevice::new(bytes as u64 * 2 + (64 << 20)));
        let memory = MemoryManager::new(
            device,
            ManagerSettings {
                margin_bytes: 0,
                disk: None,
            },
        )
        .map_err(|e| reference_error("start")(e.into()))?;
        let build = || -> Result<Buffer, MemoryError> {
            memory.create_region(ref_tag(), BackupPolicy::Host, bytes)?;
            let mut params = memory.alloc(&ref_tag(), bytes)?;
            params.view_mut::<f32>()?.copy_from_slice(weights);
            Ok(params)
        };
        let params = build().map_err(|e| reference_error("store its weights")(e.into()))?;
        Ok(Self {
            memory,
            model: Transformer::new(config),
            params,
            offloaded: false,
        })
    }

    /// A reference model holding the actor's weights now.
    ///
    /// # Errors
    /// What the actor hit exporting, or as [`new`](Self::new).
    pub fn of_actor(actor: &mut dyn TrainBackend) -> Result<Self, OrchestratorError> {
        let mut weights = Vec::new();
        actor
            .export_weights(usize::MAX, &mut |bucket| {
                for tensor in bucket.tensors {
                    weights.extend_from_slice(&tensor.data);
                }
                Ok(())
            })
            .map_err(OrchestratorError::train(
                "actor",
                "export weights for the reference",
            ))?;
        Self::new(actor.config().clone(), &weights)
    }

    /// Per-token log-probs of `batch`'s targets under the reference weights, `(B, T)`.
    ///
    /// # Errors
    /// [`OrchestratorError::Reference`] while offloaded (the memory manager refuses a paused
    /// tag) or when the forward pass fails.
    pub fn logprobs(&self, batch: &Batch) -> Result<Vec<f32>, OrchestratorError> {
        let view = batch.view();
        let params = self
            .params
            .view::<f32>()
            .map_err(|e| reference_error("read its weights")(e.into()))?;
        let forward = || -> Result<Vec<f32>, ModelError> {
            let al = self.model.activation_layout(batch.batch, batch.seq)?;
            let mut acts = vec![0.0; al.len()];
            self.model.forward(&params, &mut acts, &al, &view)?;
            Ok(Transformer::logprobs(&al, &acts).to_vec())
        };
        forward().map_err(|e| reference_error("compute log-probs")(e.into()))
    }

    /// Whether the weights are on the host.
    pub fn is_offloaded(&self) -> bool {
        self.offloaded
    }

    /// Moves the weights to the host and releases their device memory.
    ///
    /// # Errors
    /// [`OrchestratorError::Reference`] when the backup fails (the weights stay).
    pub fn offload(&mut self) -> Result<OffloadReport, OrchestratorError> {
        let report = self
            .memory
            .pause(&ref_tag())
            .map_err(|e| reference_error("offload")(e.into()))?;
        self.offloaded = true;
        Ok(report)
    }

    /// Brings the weights back, bit-exact, at the same addresses.
    ///
    /// # Errors
    /// [`OrchestratorError::Reference`] when the device lacks room or the backup is bad.
    pub fn onload(&mut self) -> Result<OffloadReport, OrchestratorError> {
        let report = self
            .memory
            .resume(&ref_tag())
            .map_err(|e| reference_error("onload")(e.into()))?;
        self.offloaded = false;
        Ok(report)
    }

    /// Device bytes of the tag `ref` now (0 while offloaded).
    pub fn device_memory(&self) -> Vec<(MemoryTag, u64)> {
        self.memory.resident_bytes()
    }
}

#[cfg(test)]
mod tests {
    use rand::{RngExt, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;

    fn tiny() -> LlamaConfig {
        LlamaConfig::preset("tiny").unwrap()
    }

    fn weights(seed: u64) -> Vec<f32> {
        let layout = ParamLayout::new(&tiny());
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..layout.len())
            .map(|_| rng.random_range(-0.05..0.05))
            .collect()
    }

    fn batch() -> Batch {
        super::super::batch::build_batch(
            &[super::super::batch::Sequence {
                prompt: &[256, 49, 50],
                continuation: &[51, 257],
                weight: 1.0,
            }],
            258,
        )
    }

    #[test]
    fn the_ref_tag_offloads_and_restores_bit_exact() {
        let w = weights(3);
        let mut reference = ReferenceModel::new(tiny(), &w).unwrap();
        let before = reference.logprobs(&batch()).unwrap();
        let resident: u64 = reference.device_memory().iter().map(|(_, b)| b).sum();
        assert!(resident >= (w.len() * 4) as u64, "{resident}");
        let report = reference.offload().unwrap();
        assert_eq!(report.tag, ref_tag());
        assert!(reference.is_offloaded());
        let after_pause: u64 = reference.device_memory().iter().map(|(_, b)| b).sum();
        assert_eq!(after_pause, 0, "a paused ref tag holds no device memory");
        assert!(
            reference.logprobs(&batch()).is_err(),
            "a paused tag is refused"
        );
        reference.onload().unwrap();
        let view = reference.params.view::<f32>().unwrap();
        assert!(
            view.iter().zip(&w).all(|(a, b)| a.to_bits() == b.to_bits()),
            "weights differ after the round trip"
        );
        drop(view);
        assert_eq!(reference.logprobs(&batch()).unwrap(), before);
    }

    #[test]
    fn weights_of_another_model_are_refused() {
        assert!(ReferenceModel::new(tiny(), &[0.0; 7]).is_err());
    }
}
