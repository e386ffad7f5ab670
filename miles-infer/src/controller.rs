//! The `InferenceController`: what the colocated loop drives between rollouts.
//!
//! Going off the device (per `--offload-rollout-level`): [`offload_kv`] drops the cache (its
//! contents are worthless after a rollout), [`offload_graphs`] the GPU engine's decode scratch
//! (the static buffers its CUDA graphs replay on; the graphs themselves stay captured), then
//! [`offload_weights`] backs the weights up to the host pool (or drops them under policy
//! `None`). Coming back, in the order that keeps peak memory low: [`onload_weights`], the
//! weight sync ([`update_weights`]), then [`onload_graphs`] and [`onload_kv`].
//!
//! [`offload_kv`]: InferenceController::offload_kv
//! [`offload_graphs`]: InferenceController::offload_graphs
//! [`onload_graphs`]: InferenceController::onload_graphs
//! [`offload_weights`]: InferenceController::offload_weights
//! [`onload_weights`]: InferenceController::onload_weights
//! [`update_weights`]: InferenceController::update_weights
//! [`onload_kv`]: InferenceController::onload_kv

use miles_core::{BackupPolicy, MemoryTag, OffloadReport, RegionState, RolloutOffload, Settings};

use crate::weights::{self, NamedTensor, WeightUpdateReport};
use crate::{Engine, Generation, InferError, SamplingParams};

/// Drives a [`Engine`] through the rollout / training switch.
#[derive(Debug)]
pub struct InferenceController {
    engine: Engine,
    levels: RolloutOffload,
    bucket_bytes: u64,
}

impl InferenceController {
    /// A controller offloading `levels` and updating weights in buckets of `bucket_bytes`.
    pub fn new(engine: Engine, levels: RolloutOffload, bucket_bytes: u64) -> Self {
        Self {
            engine,
            levels,
            bucket_bytes: bucket_bytes.max(1),
        }
    }

    /// A controller with the settings' rollout offload plan and `--update-weight-buffer-size`.
    pub fn from_settings(engine: Engine, settings: &Settings) -> Self {
        Self::new(
            engine,
            RolloutOffload::of(settings),
            settings.update_weight_buffer_size,
        )
    }

    /// The engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The engine, to load checkpoints into.
    pub fn engine_mut(&mut self) -> &mut Engine {
        &mut self.engine
    }

    /// Generates with the engine; see [`Engine::generate`].
    ///
    /// # Errors
    /// As [`Engine::generate`]; [`InferError::Offloaded`] names what must come back.
    pub fn generate(
        &mut self,
        prompts: &[Vec<u32>],
        params: &SamplingParams,
    ) -> Result<Generation, InferError> {
        self.engine.generate(prompts, params)
    }

    /// Drops every cached sequence and block table; returns the blocks freed.
    pub fn flush_cache(&mut self) -> usize {
        let used = self.engine.used_blocks();
        self.engine.flush_cache();
        used
    }

    /// Flushes the cache and pauses `kv_cache`: its memory is released, its contents dropped.
    ///
    /// # Errors
    /// [`InferError::Memory`] when the cache is offloaded already or busy.
    pub fn offload_kv(&mut self) -> Result<OffloadReport, InferError> {
        self.flush_cache();
        self.engine
            .memory()
            .pause(&MemoryTag::KvCache)
            .map_err(InferError::memory("offload the kv cache"))
    }

    /// Pauses `weights`: with a host backup they come back on
    /// [`onload_weights`](Self::onload_weights); with policy `None` they are dropped and must be
    /// re-sent with [`update_weights`](Self::update_weights) before generating.
    ///
    /// # Errors
    /// [`InferError::Memory`] when the weights are offloaded already, or the backup failed (the
    /// weights then stay on the device, intact).
    pub fn offload_weights(&mut self) -> Result<OffloadReport, InferError> {
        let report = self
            .engine
            .memory()
            .pause(&MemoryTag::Weights)
            .map_err(InferError::memory("offload the weights"))?;
        if self.engine.config().weights_policy == BackupPolicy::None {
            self.engine.forget_weights();
        }
        Ok(report)
    }

    /// Resumes `weights` at the same addresses.
    ///
    /// # Errors
    /// [`InferError::Memory`] when they are not offloaded or the device lacks room (nothing
    /// changes then).
    pub fn onload_weights(&mut self) -> Result<OffloadReport, InferError> {
        self.engine
            .memory()
            .resume(&MemoryTag::Weights)
            .map_err(InferError::memory("onload the weights"))
    }

    /// Pauses `cuda_graph` on the GPU engine: the decode scratch's memory is released (its
    /// contents dropped); the captured graphs stay valid, since it comes back at the same
    /// addresses.
    ///
    /// # Errors
    /// [`InferError::Memory`] when the region is offloaded already, busy, or absent (the CPU
    /// engine has none: see [`Engine::has_graph_region`]).
    pub fn offload_graphs(&mut self) -> Result<OffloadReport, InferError> {
        self.engine
            .memory()
            .pause(&MemoryTag::CudaGraph)
            .map_err(InferError::memory("offload the cuda graphs"))
    }

    /// Resumes `cuda_graph` at the same addresses.
    ///
    /// # Errors
    /// As [`onload_weights`](Self::onload_weights); absent on the CPU engine.
    pub fn onload_graphs(&mut self) -> Result<OffloadReport, InferError> {
        self.engine
            .memory()
            .resume(&MemoryTag::CudaGraph)
            .map_err(InferError::memory("onload the cuda graphs"))
    }

    /// Resumes `kv_cache` (empty) at the same addresses.
    ///
    /// # Errors
    /// As [`onload_weights`](Self::onload_weights).
    pub fn onload_kv(&mut self) -> Result<OffloadReport, InferError> {
        self.engine
            .memory()
            .resume(&MemoryTag::KvCache)
            .map_err(InferError::memory("onload the kv cache"))
    }

    /// Writes named tensors into the weights, in buckets of `--update-weight-buffer-size`.
    ///
    /// Every tensor is checked first; on any unknown name, wrong shape, dtype or length nothing
    /// changes and the error lists every mismatch.
    ///
    /// # Errors
    /// [`InferError::WeightMismatch`]; [`InferError::Offloaded`] while the weights are offloaded.
    pub fn update_weights(
        &mut self,
        tensors: &[NamedTensor<'_>],
    ) -> Result<WeightUpdateReport, InferError> {
        weights::update_weights(&mut self.engine, tensors, self.bucket_bytes)
    }

    /// Offloads per `--offload-rollout-level`: the kv cache, the cuda graphs' scratch, then the
    /// weights.
    ///
    /// # Errors
    /// As [`offload_kv`](Self::offload_kv) and [`offload_weights`](Self::offload_weights).
    pub fn offload(&mut self) -> Result<Vec<OffloadReport>, InferError> {
        let mut reports = Vec::new();
        if self.levels.kv_cache {
            reports.push(self.offload_kv()?);
        }
        if self.levels.cuda_graph && self.engine.has_graph_region() {
            reports.push(self.offload_graphs()?);
        }
        if self.levels.weights {
            reports.push(self.offload_weights()?);
        }
        Ok(reports)
    }

    /// Brings back what is offloaded: the weights (when `tensors` is given, they are then
    /// updated from it), the cuda graphs' scratch, then the kv cache.
    ///
    /// # Errors
    /// As [`onload_weights`](Self::onload_weights), [`update_weights`](Self::update_weights)
    /// and [`onload_kv`](Self::onload_kv).
    pub fn onload(
        &mut self,
        tensors: Option<&[NamedTensor<'_>]>,
    ) -> Result<Vec<OffloadReport>, InferError> {
        let mut reports = Vec::new();
        if self.state(&MemoryTag::Weights)? == RegionState::Paused {
            reports.push(self.onload_weights()?);
        }
        if let Some(tensors) = tensors {
            self.update_weights(tensors)?;
        }
        if self.engine.has_graph_region()
            && self.state(&MemoryTag::CudaGraph)? == RegionState::Paused
        {
            reports.push(self.onload_graphs()?);
        }
        if self.state(&MemoryTag::KvCache)? == RegionState::Paused {
            reports.push(self.onload_kv()?);
        }
        Ok(reports)
    }

    /// Where the region of `tag` stands.
    ///
    /// # Errors
    /// [`InferError::Memory`] for a tag the engine does not hold.
    pub fn state(&self, tag: &MemoryTag) -> Result<RegionState, InferError> {
        self.engine
            .memory()
            .state(tag)
            .map_err(InferError::memory("read a region's state"))
    }
}
