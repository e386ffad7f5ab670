//! The colocated loop's view of the controller: [`miles_core::backend::RolloutEngine`].

use miles_core::backend::{DeviceWeights, WeightBucket};
use miles_core::backend::{EngineError, RolloutEngine as LoopEngine, Sample, Sampling};
use miles_core::{MemoryTag, OffloadReport, RegionState};

use crate::{FinishReason, InferError, InferenceController, NamedTensor, SamplingParams};

fn wrap(action: &'static str) -> impl FnOnce(InferError) -> EngineError {
    move |error| EngineError::Engine {
        action,
        source: Box::new(error),
    }
}

impl InferenceController {
    /// Pauses or resumes `tag` only when it is not already where it is asked to go.
    fn move_tag(
        &mut self,
        tag: &MemoryTag,
        to: RegionState,
        action: &'static str,
        op: fn(&mut Self) -> Result<OffloadReport, InferError>,
    ) -> Result<Vec<OffloadReport>, EngineError> {
        if self.state(tag).map_err(wrap(action))? == to {
            return Ok(Vec::new());
        }
        Ok(vec![op(self).map_err(wrap(action))?])
    }
}

impl LoopEngine for InferenceController {
    fn generate(
        &mut self,
        prompts: &[Vec<u32>],
        n: usize,
        sampling: &Sampling,
    ) -> Result<Vec<Vec<Sample>>, EngineError> {
        let params = SamplingParams {
            n,
            temperature: sampling.temperature,
            top_p: sampling.top_p,
            top_k: sampling.top_k,
            max_new_tokens: sampling.max_new_tokens,
            stop_tokens: sampling.stop_tokens.clone(),
            seed: sampling.seed,
        };
        let started = std::time::Instant::now();
        let generation =
            InferenceController::generate(self, prompts, &params).map_err(wrap("generate"))?;
        let s = &generation.stats;
        tracing::debug!(
            seconds = started.elapsed().as_secs_f64(),
            scheduled = s.seconds,
            prefill = s.prefill_seconds,
            decode = s.decode_seconds,
            decode_steps = s.decode_steps,
            tokens = s.generated_tokens,
            "rollout: the call's seconds, the scheduler's, and its prefill and decode steps"
        );
        let mut groups: Vec<Vec<Sample>> = vec![Vec::with_capacity(n); prompts.len()];
        for c in generation.completions {
            groups[c.prompt_index].push(Sample {
                tokens: c.tokens,
                logprobs: c.logprobs,
                stopped: c.finish == FinishReason::Stop,
            });
        }
        Ok(groups)
    }

    fn flush_cache(&mut self) -> Result<(), EngineError> {
        InferenceController::flush_cache(self);
        Ok(())
    }

    fn offload_kv(&mut self) -> Result<Vec<OffloadReport>, EngineError> {
        self.move_tag(
            &MemoryTag::KvCache,
            RegionState::Paused,
            "offload the kv cache",
            Self::offload_kv,
        )
    }

    fn offload_weights(&mut self) -> Result<Vec<OffloadReport>, EngineError> {
        self.move_tag(
            &MemoryTag::Weights,
            RegionState::Paused,
            "offload the weights",
            Self::offload_weights,
        )
    }

    fn onload_weights(&mut self) -> Result<Vec<OffloadReport>, EngineError> {
        self.move_tag(
            &MemoryTag::Weights,
            RegionState::Active,
            "onload the weights",
            Self::onload_weights,
        )
    }

    fn offload_graphs(&mut self) -> Result<Vec<OffloadReport>, EngineError> {
        if !self.engine().has_graph_region() {
            return Ok(Vec::new());
        }
        self.move_tag(
            &MemoryTag::CudaGraph,
            RegionState::Paused,
            "offload the cuda graphs",
            Self::offload_graphs,
        )
    }

    fn onload_graphs(&mut self) -> Result<Vec<OffloadReport>, EngineError> {
        if !self.engine().has_graph_region() {
            return Ok(Vec::new());
        }
        self.move_tag(
            &MemoryTag::CudaGraph,
            RegionState::Active,
            "onload the cuda graphs",
            Self::onload_graphs,
        )
    }

    fn onload_kv(&mut self) -> Result<Vec<OffloadReport>, EngineError> {
        self.move_tag(
            &MemoryTag::KvCache,
            RegionState::Active,
            "onload the kv cache",
            Self::onload_kv,
        )
    }

    fn update_weights(&mut self, bucket: &WeightBucket) -> Result<(), EngineError> {
        let tensors: Vec<NamedTensor<'_>> = bucket
            .tensors
            .iter()
            .map(|t| NamedTensor::f32(&t.name, &t.shape, &t.data))
            .collect();
        InferenceController::update_weights(self, &tensors).map_err(wrap("update the weights"))?;
        Ok(())
    }

    fn accepts_device_weights(&self, weights: &DeviceWeights) -> bool {
        self.engine().takes_device_weights(weights)
    }

    fn copy_device_weights(&mut self, weights: &DeviceWeights) -> Result<Option<u64>, EngineError> {
        if !self.accepts_device_weights(weights) {
            return Ok(None);
        }
        let bytes = self
            .engine_mut()
            .copy_device_weights(weights)
            .map_err(wrap("copy the weights on the device"))?;
        Ok(Some(bytes))
    }

    fn resident_bytes(&self) -> Vec<(MemoryTag, u64)> {
        self.engine().memory().resident_bytes()
    }
}
