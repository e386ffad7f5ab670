//! The GPU trainer: bf16 parameters, fp32 master weights, AdamW moments and gradients, and the
//! activations, each in its memory-manager region, so that an offload is four pauses.

use std::borrow::Cow;
use std::cell::RefCell;
use std::sync::Arc;
use std::time::Instant;

use half::bf16;
use rayon::prelude::*;

use super::forward::nll_sum;
use super::group::{SplitGrads, SplitWeights};
use super::layout::gate_up_home_ranges;
use super::sizing::{BLOCK_SLACK, SCALAR_BYTES, activation_arena_bytes, micro_batches};
use super::stream::{MomentStream, StreamedMoments};
use super::update::{
    AdamWBuffers, SPARE_FOR_UPDATE, SquaredGrads, Update, UpdatingWeights, backward_units,
};
use super::weights::{GradUnits, WeightUnits, WholeGrads, WholeWeights, edge_units};
use super::{
    ForwardMode, GpuActivationLayout, GpuActivations, GpuTransformer, OptimizerShard, TrainerGroup,
};
use crate::device::{Device, DeviceError, Fence, Gpu, GpuElement, GpuSlice};
use crate::memory::{
    BackupPolicy, Buffer, ManagerSettings, MemoryError, MemoryManager, MemoryTag, OffloadReport,
    RegionState,
};
use crate::model::{LlamaConfig, ModelError, ParamLayout, StepReport, TrainBatch};
use crate::ops::gpu::{AdamWStep, GpuMoments, GradWrite, SQUARE_PARTIALS};
use crate::ops::{AdamWConfig, AdamWStepStats, clip_scale};
use crate::store::StreamStats;

/// The trainer's regions, in the order [`GpuTrainer::offload`] pauses them.
const TAGS: [MemoryTag; 4] = [
    MemoryTag::Params,
    MemoryTag::Optimizer,
    MemoryTag::Grads,
    MemoryTag::Activations,
];

/// What a [`GpuTrainer`] trains and how.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuTrainerSpec {
    /// The model.
    pub config: LlamaConfig,
    /// The optimizer.
    pub adamw: AdamWConfig,
    /// Where the optimizer state goes when offloaded, and the bf16 weights where the master
    /// weights stream through the disk; otherwise the bf16 weights are dropped and rounded
    /// again from the master weights on onload, as are the gradients and activations.
    pub backup: BackupPolicy,
    /// Activations are sized for this many tokens; a larger batch runs as micro-batches of
    /// whole sequences whose gradients add up.
    pub max_batch_tokens: usize,
    /// The AdamW moments on disk, streamed through each optimizer step a few buckets at a
    /// time (`--stream-optimizer-state-to-disk`); `None`: resident in
    /// [`MemoryTag::Optimizer`].
    pub stream: Option<MomentStream>,
    /// The block of the optimizer state this trainer keeps: [`OptimizerShard::WHOLE`], or one
    /// rank's block of a data-parallel group that splits it (the trainer then must
    /// [`join`](GpuTrainer::join) that group before it trains).
    pub shard: OptimizerShard,
    /// The optimizer state (fp32 master weights and AdamW moments; this rank's block when
    /// split) in host memory and the optimizer step on the host, as FSDP's native CPU offload
    /// (`--fsdp-cpu-offload` without `--offload-train`): the device holds only the bf16
    /// weights, gradients and activations; each step downloads the gradients (of the block)
    /// and uploads the bf16 weights (of the block, then gathered).
    pub optimizer_on_host: bool,
}

/// Where the AdamW moments live.
enum Moments {
    /// On the device: (P) fp32 each, or this rank's block of a split state, in
    /// [`MemoryTag::Optimizer`].
    Resident { m: Buffer, v: Buffer },
    /// On disk, staged through a few device slots.
    Streamed(Box<StreamedMoments>),
    /// In host memory with the master weights, updated by the host.
    Host(Box<HostOptimizer>),
}

/// The optimizer state on the host ([`GpuTrainerSpec::optimizer_on_host`]; this rank's block of
/// it when split), with the buffers a step reuses: the gradients it downloads and the bf16
/// weights it uploads.
struct HostOptimizer {
    master: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    grads: Vec<f32>,
    rounded: Vec<bf16>,
}

/// Uploads the bf16 rounding of `values` (round to nearest even, as the device's cast) into
/// `dst`, rounding in parallel into `scratch`, which is kept for the next call.
fn upload_rounded(
    gpu: &Gpu,
    values: &[f32],
    scratch: &mut Vec<bf16>,
    dst: GpuSlice<bf16>,
) -> Result<(), ModelError> {
    scratch.resize(values.len(), bf16::ZERO);
    scratch
        .par_iter_mut()
        .zip(values.par_iter())
        .for_each(|(r, &x)| *r = bf16::from_f32(x));
    Ok(gpu.upload(dst, scratch)?)
}

impl HostOptimizer {
    /// Uploads the master weights rounded to nearest even (as the device's cast) into
    /// `params`, their bf16 weights on the device.
    fn upload_rounded(&mut self, gpu: &Gpu, params: GpuSlice<bf16>) -> Result<(), ModelError> {
        upload_rounded(gpu, &self.master, &mut self.rounded, params)
    }

    /// AdamW step `step` on the host with the device's gradients `grads` (clipped by
    /// `clip`), then the new bf16 weights uploaded into `params`.
    fn step(
        &mut self,
        gpu: &Gpu,
        grads: GpuSlice<f32>,
        params: GpuSlice<bf16>,
        (step, adamw, clip): (u64, &AdamWConfig, f32),
    ) -> Result<(), ModelError> {
        gpu.download(&mut self.grads, grads)?;
        crate::ops::adamw_update(
            &mut self.master,
            &self.grads,
            &mut self.m,
            &mut self.v,
            step,
            adamw,
            clip,
        );
        self.upload_rounded(gpu, params)
    }
}

/// Where a pass keeps the gate and up outputs of the layers past the first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GateUp {
    /// In the activations, each layer's own.
    Own,
    /// In the gradients of the layer before, where they fit ([`gate_up_home_ranges`]): a
    /// training step of one pass.
    InGradients,
    /// Over the first layer's: a scoring pass, which no backward pass follows.
    Shared,
}

/// The activation buffers: allocated for one batch shape, reused for every shape they hold.
struct ActivationBuffers {
    capacity: GpuActivationLayout,
    bf16: Buffer,
    f32: Buffer,
    u32: Buffer,
}

/// A transformer trained with AdamW on one GPU, its state in memory-manager regions:
/// [`MemoryTag::Params`] (bf16 weights), [`MemoryTag::Optimizer`] (fp32 master weights and
/// both moments), [`MemoryTag::Grads`] (fp32) and [`MemoryTag::Activations`] (everything
/// per step, inputs included). With streamed moments ([`GpuTrainerSpec::stream`]) the
/// optimizer region holds the master weights only, and a fifth region (`optimizer-stream`,
/// dropped on offload) the few device slots the moments stream through.
///
/// The trainer creates the four regions; the manager must not have them yet, and keeps them
/// after the trainer drops (one trainer per manager). Every call that queues GPU work records
/// a fence on every buffer, so a pause of any of the tags waits for that work.
///
/// The activation region reserves address space for the largest shape within
/// `max_batch_tokens` and commits only what the batch at hand needs. Where the state is split
/// over a data-parallel group ([`OptimizerShard`]) the regions hold this rank's blocks, and
/// where the weights and gradients are split too, unit buffers for the units a pass is at.
pub struct GpuTrainer {
    gpu: Arc<Gpu>,
    memory: Arc<MemoryManager>,
    model: GpuTransformer,
    adamw: AdamWConfig,
    max_batch_tokens: usize,
    /// The block of the optimizer state kept here; P below is the parameters padded to whole
    /// blocks ([`OptimizerShard::padded`]), the parameters themselves when not split.
    shard: OptimizerShard,
    /// (P) bf16, Params; this rank's block where the weights are split
    /// ([`OptimizerShard::split_weights`]).
    params: Buffer,
    /// bf16, Params, where the weights are split: the unit buffer the edges' and a layer's
    /// weights are gathered into ([`SplitWeights`]).
    weight_units: Option<Buffer>,
    /// Whether the edges' weights in `weight_units` are those of the current weights (gathered
    /// since the last change of the weights).
    edges_gathered: bool,
    /// (P) fp32 (this rank's block when split), Optimizer; `None` when the master weights
    /// stream with the moments.
    master: Option<Buffer>,
    moments: Moments,
    /// (P) fp32, Grads; this rank's block where the gradients are split too
    /// ([`OptimizerShard::split_grads`]).
    grads: Buffer,
    /// fp32, Grads, where the gradients are split: the unit buffer their units accumulate in
    /// ([`SplitGrads`]), also the scratch a gather of the split state goes through.
    units: Option<Buffer>,
    /// (P) bf16, Grads: the gradients rounded for a bf16 reduce-scatter
    /// ([`OptimizerShard::bf16_reduce`] of a split state).
    low: Option<Buffer>,
    scalar: Buffer, // (SCALAR_BYTES) fp32, Activations
    acts: Option<ActivationBuffers>,
    offloaded: bool,
    /// The parallel group this trainer is one rank of, if any.
    group: Option<Box<dyn TrainerGroup>>,
    /// The last step's phases, when timed ([`time_steps`](GpuTrainer::time_steps)).
    times: Option<StepTimes>,
    /// Where the optimizer state is resident and whole: the stream AdamW updates the weights
    /// on, a unit at a time, while the next step's forward pass starts on the trainer's
    /// (`update.rs`).
    updater: Option<Arc<Gpu>>,
    /// The last update queued on `updater`, until the passes take it; the trainer's stream
    /// may not have waited for it yet.
    update: Option<Update>,
    /// Whether the gradients' sum of squares is in the scalar scratch's first word, summed on
    /// `updater` behind the last backward pass ([`SquaredGrads`]) and not read yet.
    squared: bool,
}

/// Where a training step's time went, in seconds: each phase waited for on the host, so the
/// phases add up to the step ([`GpuTrainer::time_steps`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StepTimes {
    /// The forward and backward passes over every micro-batch (where the weights and
    /// gradients are split, with their gathers and sums, including a rank's passes without a
    /// batch).
    pub passes: f64,
    /// The group's sums of the gradients and the loss (0 alone; the loss's alone where the
    /// gradients are split).
    pub reduction: f64,
    /// The gradient norm, AdamW, and a split state's gather of the bf16 weights.
    pub optimizer: f64,
}

impl std::ops::AddAssign for StepTimes {
    fn add_assign(&mut self, other: StepTimes) {
        self.passes += other.passes;
        self.reduction += other.reduction;
        self.optimizer += other.optimizer;
    }
}

impl std::fmt::Debug for GpuTrainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuTrainer")
            .field("params", &self.model.layout().len())
            .field("max_batch_tokens", &self.max_batch_tokens)
            .field("offloaded", &self.offloaded)
            .field("group", &self.group.as_ref().map(|g| g.name()))
            .finish_non_exhaustive()
    }
}

impl GpuTrainer {
    /// A trainer on `gpu` starting from the fp32 `params` (laid out by the config's
    /// [`ParamLayout`](crate::model::ParamLayout)), with zero moments; `memory` must manage
    /// the gpu's device.
    ///
    /// # Errors
    /// [`ModelError::Config`] for a model the CUDA path does not compute
    /// ([`LlamaConfig::check_gpu_support`]); [`ModelError::BufferLength`] for `params` of the
    /// wrong length; [`ModelError::Batch`] for `max_batch_tokens` 0; [`ModelError::DeviceMismatch`];
    /// [`ModelError::Memory`] when a region exists already or the device is out of memory;
    /// [`ModelError::Gpu`] when the upload fails; [`ModelError::Store`] when streamed moments
    /// cannot be written to their disk store.
    pub fn new(
        gpu: Arc<Gpu>,
        memory: Arc<MemoryManager>,
        spec: GpuTrainerSpec,
        params: &[f32],
    ) -> Result<GpuTrainer, ModelError> {
        spec.config.check_gpu_support()?;
        let model = GpuTransformer::new(spec.config);
        model.layout().check("params", params)?;
        if spec.max_batch_tokens == 0 {
            return Err(ModelError::Batch(
                "max_batch_tokens is 0; size the activations for at least one sequence".into(),
            ));
        }
        let same_device =
            std::ptr::addr_eq(Arc::as_ptr(memory.device()), Arc::as_ptr(gpu.device()));
        if !same_device {
            return Err(ModelError::DeviceMismatch);
        }
        let shard = spec.shard;
        if shard.is_split() && spec.stream.is_some() {
            return Err(ModelError::Config(
                "the optimizer state split over data-parallel ranks does not stream through the disk yet; drop --stream-optimizer-state-to-disk or train on one gpu".into(),
            ));
        }
        shard.check()?;
        if spec.optimizer_on_host && spec.stream.is_some() {
            return Err(ModelError::Config(
                "the optimizer state on the host (--fsdp-cpu-offload) stays in host memory, not streamed through the disk; drop one of them".into(),
            ));
        }
        let n = model.layout().len();
        let padded = shard.padded(n);
        // Split weights: this rank's block, and a unit buffer holding the edges' weights
        // beside a layer's (two where the layers are gathered ahead).
        let (half, weight_unit_bytes) = if shard.split_weights {
            let [embedding, tail] = edge_units(model.layout());
            // A second layer slot where the layers are gathered ahead.
            let slots = 1 + usize::from(shard.reduce_behind);
            let units = embedding.len() + tail.len() + slots * model.layout().layer_range(0).len();
            (
                shard.block(n) * size_of::<bf16>(),
                units * size_of::<bf16>(),
            )
        } else {
            (padded * size_of::<bf16>(), 0)
        };
        let (full, block) = (padded * size_of::<f32>(), shard.block(n) * size_of::<f32>());
        // Split gradients: this rank's block, and a unit buffer holding the embedding's
        // gradients beside a layer's or the tail's.
        let (grad_bytes, unit_bytes) = if shard.split_grads {
            (
                block,
                split_unit_len(model.layout(), shard) * size_of::<f32>(),
            )
        } else {
            (full, 0)
        };
        let act_bytes = activation_arena_bytes(model.config(), spec.max_batch_tokens);
        let reduces_in_bf16 = shard.is_split() && shard.bf16_reduce;
        let low_bytes = if reduces_in_bf16 {
            half + BLOCK_SLACK
        } else {
            0
        };
        let master_streams = spec.stream.as_ref().is_some_and(|s| s.master_weights);
        let optimizer_buffers = match &spec.stream {
            None if spec.optimizer_on_host => 0,
            None => 3,
            Some(_) if master_streams => 0,
            Some(_) => 1,
        };
        // The bf16 weights are the master weights rounded (the AdamW kernel writes both), so
        // with the master weights on the device or the host they need not move: 2 bytes a
        // parameter less each way. A rank of a split state rounds its own block again and
        // gathers the others' from the group (or, where the weights are split, keeps only its
        // block), so only its shard of the state moves.
        let params_backup = if master_streams {
            spec.backup
        } else {
            BackupPolicy::None
        };
        for (tag, policy, bytes) in [
            (
                MemoryTag::Params,
                params_backup,
                half + weight_unit_bytes + 2 * BLOCK_SLACK,
            ),
            (
                MemoryTag::Optimizer,
                spec.backup,
                optimizer_buffers * (block + BLOCK_SLACK),
            ),
            (
                MemoryTag::Grads,
                BackupPolicy::None,
                grad_bytes + unit_bytes + low_bytes + 2 * BLOCK_SLACK,
            ),
            (MemoryTag::Activations, BackupPolicy::None, act_bytes),
        ] {
            memory.create_region(tag, policy, bytes)?;
        }
        let moments = match &spec.stream {
            None if spec.optimizer_on_host => {
                let block = shard.block(n);
                Moments::Host(Box::new(HostOptimizer {
                    master: shard.block_of(params).into_owned(),
                    m: vec![0.0; block],
                    v: vec![0.0; block],
                    grads: vec![0.0; block],
                    rounded: vec![bf16::ZERO; block],
                }))
            }
            None => Moments::Resident {
                m: memory.alloc(&MemoryTag::Optimizer, block)?,
                v: memory.alloc(&MemoryTag::Optimizer, block)?,
            },
            Some(stream) => {
                Moments::Streamed(Box::new(StreamedMoments::new(&memory, stream, params)?))
            }
        };
        let master = match &moments {
            Moments::Streamed(streamed) if streamed.holds_master() => None,
            Moments::Host(_) => None,
            _ => Some(memory.alloc(&MemoryTag::Optimizer, block)?),
        };
        let updater = match &moments {
            Moments::Resident { .. } if !shard.is_split() => {
                Some(Arc::new(gpu.with_background_stream()?))
            }
            _ => None,
        };
        let trainer = GpuTrainer {
            shard,
            params: memory.alloc(&MemoryTag::Params, half)?,
            weight_units: shard
                .split_weights
                .then(|| memory.alloc(&MemoryTag::Params, weight_unit_bytes))
                .transpose()?,
            edges_gathered: false,
            master,
            moments,
            grads: memory.alloc(&MemoryTag::Grads, grad_bytes)?,
            units: shard
                .split_grads
                .then(|| memory.alloc(&MemoryTag::Grads, unit_bytes))
                .transpose()?,
            low: reduces_in_bf16
                .then(|| memory.alloc(&MemoryTag::Grads, half))
                .transpose()?,
            scalar: memory.alloc(&MemoryTag::Activations, SCALAR_BYTES)?,
            gpu,
            memory,
            model,
            adamw: spec.adamw,
            max_batch_tokens: spec.max_batch_tokens,
            acts: None,
            offloaded: false,
            group: None,
            times: None,
            updater,
            update: None,
            squared: false,
        };
        if let Moments::Resident { m, v } = &trainer.moments {
            trainer.gpu.zero(slice::<f32>(m)?)?;
            trainer.gpu.zero(slice::<f32>(v)?)?;
        }
        trainer.gpu.zero(slice::<f32>(&trainer.grads)?)?;
        match &trainer.master {
            Some(master) if shard.is_split() => trainer.upload_master_block(master, params)?,
            Some(master) => trainer.upload_master(master, params)?,
            // The stream wrote the master weights with the zero moments, or the host holds them.
            None => trainer.upload_rounded(params)?,
        }
        tracing::debug!(
            params = n,
            activation_arena = act_bytes,
            "gpu trainer ready"
        );
        Ok(trainer)
    }

    /// The model's config.
    pub fn config(&self) -> &LlamaConfig {
        self.model.config()
    }

    /// The model's parameter table (of this rank's shard, in a tensor-parallel group).
    pub fn layout(&self) -> &ParamLayout {
        self.model.layout()
    }

    /// The block of the optimizer state this trainer keeps.
    pub fn shard(&self) -> OptimizerShard {
        self.shard
    }

    /// The memory manager holding the trainer's regions.
    pub fn memory(&self) -> &Arc<MemoryManager> {
        &self.memory
    }

    /// Whether [`offload`](Self::offload) has paused the trainer's regions.
    pub fn is_offloaded(&self) -> bool {
        self.offloaded
    }

    /// One training step: zero the gradients, forward and backward over each micro-batch,
    /// the global gradient norm, clipping, and AdamW step `step` (counting from 1).
    ///
    /// # Errors
    /// [`ModelError::InvalidStep`] for step 0, [`ModelError::Offloaded`], and any batch error,
    /// before any GPU work; as [`compute_grads`](Self::compute_grads) and
    /// [`apply_grads`](Self::apply_grads).
    pub fn train_step(
        &mut self,
        batch: &TrainBatch<'_>,
        step: u64,
    ) -> Result<StepReport, ModelError> {
        if step == 0 {
            return Err(ModelError::InvalidStep { step });
        }
        let loss = self.compute_grads(batch)?;
        let (optimizer, optimizer_stream) = self.apply_grads(step)?;
        Ok(StepReport {
            loss,
            optimizer,
            optimizer_stream,
            entropy: None,
        })
    }

    /// Times every step's phases from now on ([`step_times`](Self::step_times)), once the work
    /// queued so far is done: the trainer then also waits for the group's reduction and the
    /// optimizer step's work before they return, and the optimizer step runs in line on the
    /// trainer's stream rather than behind the next forward pass (a benchmark's breakdown; it
    /// costs the overlap of that work with what follows).
    ///
    /// # Errors
    /// [`ModelError::Gpu`] when the wait fails.
    pub fn time_steps(&mut self) -> Result<(), ModelError> {
        self.synchronize()?;
        self.update = None;
        self.times = Some(StepTimes::default());
        Ok(())
    }

    /// Waits for every kernel the trainer queued, an optimizer step still running behind it
    /// included (a benchmark's end).
    ///
    /// # Errors
    /// [`ModelError::Gpu`]: the first error a queued kernel hit.
    pub fn synchronize(&self) -> Result<(), ModelError> {
        self.wait_behind()?;
        self.join_update()?;
        Ok(self.gpu.synchronize()?)
    }

    /// The last step's phases, once [`time_steps`](Self::time_steps) was called.
    pub fn step_times(&self) -> Option<StepTimes> {
        self.times
    }

    /// Makes this trainer one rank of `group`: from now on the trainer calls it at the points
    /// [`TrainerGroup`] names. The backends that name a parallel layout build their groups
    /// (Megatron's tensor-parallel group, the data-parallel group of either backend); the trainer must
    /// have been built for its place in the group (its shard of the model, the same weights as
    /// the other replicas).
    ///
    /// # Errors
    /// [`ModelError::DeviceMismatch`] for a group on another GPU (another compute handle on
    /// the same device included: it is not the trainer's stream); [`ModelError::Config`] when
    /// the trainer is in a group already.
    pub fn join(&mut self, group: Box<dyn TrainerGroup>) -> Result<(), ModelError> {
        if !Arc::ptr_eq(group.gpu(), &self.gpu) {
            return Err(ModelError::DeviceMismatch);
        }
        if self.group.is_some() {
            return Err(ModelError::Config(
                "the gpu trainer is one rank of a parallel group already; it joins one group, data or tensor parallel".into(),
            ));
        }
        if self.shard.reduce_behind {
            let behind = group.behind().ok_or_else(|| {
                ModelError::Config(format!(
                    "the trainer sums its gradients behind the backward pass, and the {}-parallel group has no second communicator to do it on",
                    group.name()
                ))
            })?;
            if Arc::ptr_eq(behind.gpu(), &self.gpu)
                || !Arc::ptr_eq(behind.gpu().device(), self.gpu.device())
            {
                return Err(ModelError::Config(
                    "the group's second communicator must run on a stream of its own on the trainer's gpu (Gpu::with_own_stream)".into(),
                ));
            }
        }
        let (rank, ranks) = group.split_place();
        if self.shard.is_split() && (rank, ranks) != (self.shard.rank, self.shard.ranks) {
            return Err(ModelError::Config(format!(
                "the trainer keeps block {} of {} of the optimizer state, and the group splits it as rank {rank} of {ranks}; build it for its place in the group",
                self.shard.rank, self.shard.ranks,
            )));
        }
        tracing::info!(
            rank = group.rank(),
            world = group.world_size(),
            "gpu trainer joined a {}-parallel group",
            group.name()
        );
        self.group = Some(group);
        // A sum of squares from alone is no group's norm.
        self.squared = false;
        Ok(())
    }

    /// Zeroes the gradients and fills them with those of `batch` (micro-batch by micro-batch
    /// when it holds more than `max_batch_tokens` tokens); returns the loss. In a group (see
    /// [`join`](Self::join)) both are what [`TrainerGroup::after_backward`] makes of them (a
    /// data-parallel group: the sums over the group's parts of the batch).
    ///
    /// # Errors
    /// [`ModelError::Offloaded`] (or [`ModelError::Memory`] for a region paused by someone
    /// else), [`ModelError::Batch`] or [`ModelError::TokenOutOfRange`], all before any GPU
    /// work; [`ModelError::Memory`] when activations cannot be allocated; [`ModelError::Gpu`].
    pub fn compute_grads(&mut self, batch: &TrainBatch<'_>) -> Result<f32, ModelError> {
        self.ensure_active("compute gradients")?;
        self.check_batch(batch)?;
        if let Moments::Streamed(streamed) = &self.moments {
            // The disk reads the optimizer step's buckets while the passes run.
            streamed.prefetch()?;
        }
        // The passes end in a download of the log-probs, which waits for them; a tensor-parallel
        // group's reduction queues collectives and returns, so a timed step waits for it.
        let started = Instant::now();
        let mut update = self.update.take();
        let passes = self.accumulate_grads(batch, update.as_mut());
        // The passes waited for the last optimizer step a unit at a time; a failed one may not have.
        let joined = update.map_or(Ok(()), |update| update.wait_all(&self.gpu));
        let passed = started.elapsed().as_secs_f64();
        let mut result = passes
            .and_then(|nll| Ok(joined.map(|()| nll)?))
            .and_then(|nll| self.sum_over_group(nll));
        if self.times.is_some()
            && let Ok(&nll) = result.as_ref()
        {
            result = self
                .gpu
                .synchronize()
                .map(|()| nll)
                .map_err(ModelError::from);
        }
        if let Some(times) = &mut self.times {
            times.passes = passed;
            times.reduction = started.elapsed().as_secs_f64() - passed;
        }
        let fenced = self.record_fences();
        let nll = result?;
        fenced?;
        Ok((nll / f64::from(batch.normaliser)) as f32)
    }

    /// In a group: what [`TrainerGroup::after_backward`] makes of the gradients and `nll`, or
    /// for a split state, this rank's block of the gradients summed over the group (in fp32,
    /// or through bf16 with [`OptimizerShard::bf16_reduce`]) and `nll` summed. Alone: `nll`.
    fn sum_over_group(&self, nll: f64) -> Result<f64, ModelError> {
        let Some(group) = &self.group else {
            return if self.shard.is_split() {
                Err(unjoined())
            } else {
                Ok(nll)
            };
        };
        let scalar = slice::<f32>(&self.scalar)?.sub(0, 1)?;
        if !self.shard.is_split() {
            return group.after_backward(&self.gpu, slice(&self.grads)?, scalar, nll);
        }
        let grads = slice::<f32>(&self.grads)?;
        match &self.low {
            // Split gradients were summed into their owners' blocks unit by unit.
            None if self.shard.split_grads => {}
            Some(low) => {
                let n = self.model.layout().len();
                let (start, block) = (self.shard.start(n), self.shard.block(n));
                let low = slice::<bf16>(low)?;
                self.gpu.cast_to_bf16(low, grads)?;
                group.reduce_scatter_bf16(low)?;
                self.gpu
                    .cast_to_f32(grads.sub(start, block)?, low.sub(start, block)?)?;
            }
            None => group.reduce_scatter_f32(grads)?,
        }
        self.gpu.upload(scalar, &[nll as f32])?;
        group.sum_f32(scalar)?;
        let mut sum = [0.0f32];
        self.gpu.download(&mut sum, scalar)?;
        Ok(f64::from(sum[0]))
    }

    /// AdamW step `step` (counting from 1) with the gradients in place: their global norm,
    /// the clipping factor as `ops::clip_scale` computes it, then the update of the master
    /// weights, moments and bf16 weights; with streamed moments, also what the step read
    /// and wrote and how long it waited for the disk.
    ///
    /// With streamed moments a failed read (a checksum mismatch, say) stops the step: the
    /// buckets before it are updated and written back, the failing bucket and those after it
    /// keep their weights and moments, and the error says which file failed.
    ///
    /// # Errors
    /// [`ModelError::InvalidStep`], [`ModelError::Offloaded`]; [`ModelError::Gpu`];
    /// [`ModelError::Store`] for streamed moments.
    pub fn apply_grads(
        &mut self,
        step: u64,
    ) -> Result<(AdamWStepStats, Option<StreamStats>), ModelError> {
        if step == 0 {
            return Err(ModelError::InvalidStep { step });
        }
        self.ready("take an optimizer step")?;
        let started = Instant::now();
        let mut result = self.adamw_step(step);
        if let Some(times) = &mut self.times {
            if result.is_ok()
                && let Err(error) = self.gpu.synchronize()
            {
                result = Err(error.into());
            }
            times.optimizer = started.elapsed().as_secs_f64();
        }
        let fenced = self.record_fences();
        let stats = result?;
        fenced?;
        Ok(stats)
    }

    /// The per-token log-probs `(B, T)` of `batch` and its loss, from a forward pass alone.
    ///
    /// # Errors
    /// As [`compute_grads`](Self::compute_grads).
    pub fn logprobs(&mut self, batch: &TrainBatch<'_>) -> Result<(Vec<f32>, f32), ModelError> {
        self.ensure_active("score a batch")?;
        self.check_batch(batch)?;
        let update = self.update.take();
        let scored = self.score(batch, update.as_ref());
        let joined = update.map_or(Ok(()), |update| update.wait_all(&self.gpu));
        let result = scored.and_then(|scored| Ok(joined.map(|()| scored)?));
        let fenced = self.record_fences();
        let (logprobs, nll) = result?;
        fenced?;
        Ok((logprobs, (nll / f64::from(batch.normaliser)) as f32))
    }

    /// The fp32 master weights, in [`ParamLayout`](crate::model::ParamLayout) order. With the
    /// optimizer state split over a group, every rank of the group calls it at once (the
    /// blocks are gathered through the gradients' buffer, which the next step's first pass
    /// writes over (the padding past the parameters gathers the master weights' zeros), or
    /// where the gradients are split, through their unit buffer).
    ///
    /// # Errors
    /// [`ModelError::Offloaded`]; [`ModelError::Gpu`].
    pub fn master_params(&self) -> Result<Vec<f32>, ModelError> {
        self.ready("read the master weights")?;
        match (&self.master, &self.moments) {
            (Some(master), _) if self.shard.is_split() => {
                self.gathered(Block::Device(slice(master)?))
            }
            (Some(master), _) => self.download(master),
            (None, Moments::Streamed(streamed)) => streamed.read_master(self.model.layout().len()),
            (None, Moments::Host(host)) if self.shard.is_split() => {
                self.gathered(Block::Host(&host.master))
            }
            (None, Moments::Host(host)) => Ok(host.master.clone()),
            (None, Moments::Resident { .. }) => Err(no_master(self.model.layout().len())),
        }
    }

    /// The bf16 weights on the device (each the round-to-nearest-even of its master weight), in
    /// [`ParamLayout`](crate::model::ParamLayout) order, with a fence after every kernel queued
    /// so far (the last AdamW update writes them); `None` while offloaded, and where the weights
    /// are split ([`OptimizerShard::split_weights`]: no rank holds them whole). The view stays valid
    /// until the next call that takes `&mut self`.
    ///
    /// # Errors
    /// [`ModelError::Gpu`] when the fence cannot be recorded.
    pub fn device_params(&self) -> Result<Option<(GpuSlice<bf16>, Fence)>, ModelError> {
        if self.offloaded || self.shard.split_weights {
            return Ok(None);
        }
        self.join_update()?;
        let params = slice::<bf16>(&self.params)?.sub(0, self.model.layout().len())?;
        Ok(Some((params, self.gpu.record_fence()?)))
    }

    /// The bf16 weights widened to fp32, in [`ParamLayout`](crate::model::ParamLayout) order:
    /// each the rounding of its master weight, the weights the model computes with. Not
    /// collective unless the weights are split ([`OptimizerShard::split_weights`]): then every
    /// rank of the group calls it at once, and the blocks are gathered as the master weights'.
    ///
    /// # Errors
    /// [`ModelError::Offloaded`]; [`ModelError::Gpu`] when the download fails.
    pub fn weights(&self) -> Result<Vec<f32>, ModelError> {
        self.ready("read the weights")?;
        let n = self.model.layout().len();
        let mut rounded = vec![bf16::ZERO; n];
        if self.shard.split_weights {
            // The bf16 blocks, two to a word, gathered as fp32 words.
            let words = self
                .gather_blocks(
                    Block::Device(slice::<bf16>(&self.params)?.reinterpret()?),
                    true,
                )?
                .unwrap_or_default();
            let halves: &[bf16] = bytemuck::cast_slice(&words);
            let size = self.shard.block(n);
            for (r, block) in halves.chunks_exact(size).enumerate() {
                let start = r * size;
                if start < n {
                    let end = n.min(start + size);
                    rounded[start..end].copy_from_slice(&block[..end - start]);
                }
            }
        } else {
            self.gpu
                .download(&mut rounded, slice::<bf16>(&self.params)?.sub(0, n)?)?;
        }
        Ok(rounded.into_iter().map(f32::from).collect())
    }

    /// Replaces the master weights with `params` and the bf16 weights with their rounding;
    /// the moments stay.
    ///
    /// # Errors
    /// [`ModelError::BufferLength`], [`ModelError::Offloaded`]; [`ModelError::Gpu`].
    pub fn set_params(&mut self, params: &[f32]) -> Result<(), ModelError> {
        self.model.layout().check("params", params)?;
        self.ready("set the parameters")?;
        self.upload_params(params)
    }

    /// The AdamW moments `(m, v)`, in [`ParamLayout`](crate::model::ParamLayout) order (read
    /// from disk when streamed). Collective when the state is split, as
    /// [`master_params`](Self::master_params).
    ///
    /// # Errors
    /// As [`master_params`](Self::master_params); [`ModelError::Store`] for streamed moments.
    pub fn moments(&self) -> Result<(Vec<f32>, Vec<f32>), ModelError> {
        self.ready("read the optimizer moments")?;
        match &self.moments {
            Moments::Resident { m, v } if self.shard.is_split() => Ok((
                self.gathered(Block::Device(slice(m)?))?,
                self.gathered(Block::Device(slice(v)?))?,
            )),
            Moments::Host(host) if self.shard.is_split() => Ok((
                self.gathered(Block::Host(&host.m))?,
                self.gathered(Block::Host(&host.v))?,
            )),
            Moments::Resident { m, v } => Ok((self.download(m)?, self.download(v)?)),
            Moments::Streamed(streamed) => streamed.read_all(self.model.layout().len()),
            Moments::Host(host) => Ok((host.m.clone(), host.v.clone())),
        }
    }

    /// Bytes of device memory the optimizer state takes: the master weights, and the moments
    /// (all of them when resident, the stream's slots when streamed).
    pub fn optimizer_device_bytes(&self) -> usize {
        let moments = match &self.moments {
            Moments::Resident { m, v } => m.len() + v.len(),
            Moments::Streamed(streamed) => streamed.slot_bytes(),
            Moments::Host(_) => 0,
        };
        self.master.as_ref().map_or(0, Buffer::len) + moments
    }

    /// On a rank that does not write a checkpoint, where the writer reads the master weights
    /// and moments of a split state: this rank's part of those gathers (master weights, m,
    /// v, in that order), without reading them back. Does nothing for a whole state.
    ///
    /// # Errors
    /// As [`master_params`](Self::master_params).
    pub fn send_state_blocks(&self) -> Result<(), ModelError> {
        self.ready("send its optimizer state")?;
        if !self.shard.is_split() {
            return Ok(());
        }
        let blocks = match (&self.master, &self.moments) {
            (Some(master), Moments::Resident { m, v }) => [
                Block::Device(slice(master)?),
                Block::Device(slice(m)?),
                Block::Device(slice(v)?),
            ],
            (None, Moments::Host(host)) => [
                Block::Host(&host.master),
                Block::Host(&host.m),
                Block::Host(&host.v),
            ],
            _ => return Err(no_master(self.model.layout().len())),
        };
        for block in blocks {
            self.gather_blocks(block, false)?;
        }
        self.record_fences()
    }

    /// Replaces the AdamW moments (rounded to the stream's dtype when streamed).
    ///
    /// # Errors
    /// As [`set_params`](Self::set_params); [`ModelError::Store`] for streamed moments.
    pub fn set_moments(&mut self, m: &[f32], v: &[f32]) -> Result<(), ModelError> {
        self.model.layout().check("adamw m", m)?;
        self.model.layout().check("adamw v", v)?;
        self.ready("set the optimizer moments")?;
        match &mut self.moments {
            Moments::Resident { m: dm, v: dv } => {
                self.gpu.upload(slice(dm)?, &self.shard.block_of(m))?;
                self.gpu.upload(slice(dv)?, &self.shard.block_of(v))?;
            }
            Moments::Streamed(streamed) => streamed.write_all(m, v)?,
            Moments::Host(host) => {
                host.m = self.shard.block_of(m).into_owned();
                host.v = self.shard.block_of(v).into_owned();
            }
        }
        Ok(())
    }

    /// The gradients of the last [`compute_grads`](Self::compute_grads) (or train step), before
    /// clipping. With the optimizer state split over a group, only this rank's block holds
    /// the group's sum; the rest are undefined, and after a gather of the state (a save, or
    /// [`master_params`](Self::master_params)) the buffer holds what was gathered. Where the
    /// gradients are split too ([`OptimizerShard::split_grads`]), this rank's block alone.
    ///
    /// # Errors
    /// As [`master_params`](Self::master_params).
    pub fn grads(&self) -> Result<Vec<f32>, ModelError> {
        self.ready("read the gradients")?;
        if !self.shard.split_grads {
            return self.download(&self.grads);
        }
        let own = self.own_grads()?;
        let mut out = vec![0.0; own.len()];
        self.gpu.download(&mut out, own)?;
        Ok(out)
    }

    /// This rank's block of the bf16 weights: all of them unless the state is split.
    fn own_weights(&self) -> Result<GpuSlice<bf16>, ModelError> {
        self.own_block(&self.params, self.shard.split_weights)
    }

    /// This rank's block of the (reduced) gradients: all of them unless the state is split.
    fn own_grads(&self) -> Result<GpuSlice<f32>, ModelError> {
        self.own_block(&self.grads, self.shard.split_grads)
    }

    /// This rank's block of `buffer`, laid out by the parameters: all the buffer holds where
    /// it is `split` (only the block), else the block at this rank's place.
    fn own_block<T: GpuElement>(
        &self,
        buffer: &Buffer,
        split: bool,
    ) -> Result<GpuSlice<T>, ModelError> {
        let n = self.model.layout().len();
        let start = if split { 0 } else { self.shard.start(n) };
        Ok(slice::<T>(buffer)?.sub(start, self.shard.block(n))?)
    }

    /// Records a fence after the queued work, then pauses [`MemoryTag::Params`],
    /// [`MemoryTag::Optimizer`], [`MemoryTag::Grads`] and [`MemoryTag::Activations`] (and the
    /// slots of streamed moments); returns their reports in that order. A failed pause
    /// resumes the tags paused before it. In a group, the group's communicator then releases
    /// its own buffers ([`TrainerGroup::release`], on every rank at once); where that fails,
    /// the trainer stays offloaded and the error says why.
    ///
    /// # Errors
    /// [`ModelError::Offloaded`] when offloaded already; [`ModelError::Memory`] from a pause.
    pub fn offload(&mut self) -> Result<Vec<OffloadReport>, ModelError> {
        if self.offloaded {
            return Err(ModelError::Offloaded { action: "offload" });
        }
        self.join_update()?;
        self.update = None;
        // The scalar scratch does not come back.
        self.squared = false;
        self.record_fences()?;
        let reports = self.memory.pause_all(&self.tags())?;
        self.offloaded = true;
        if let Some(group) = &self.group {
            match group.release()? {
                Some(bytes) => tracing::debug!(
                    bytes,
                    "released the {}-parallel group's nccl buffers",
                    group.name()
                ),
                None => {
                    static SAID: std::sync::Once = std::sync::Once::new();
                    SAID.call_once(|| {
                        tracing::info!(
                            "the {}-parallel group's nccl buffers stay on the device while the trainer is offloaded: this nccl cannot release them (ncclCommSuspend needs nccl 2.29.7 or later with its memory manager on)",
                            group.name()
                        );
                    });
                }
            }
        }
        Ok(reports)
    }

    /// Brings the group's communicator buffers back ([`TrainerGroup::restore`], on every rank
    /// at once), resumes the regions (same order as [`offload`](Self::offload)), rounds the bf16
    /// weights again from the master weights (on the device, or uploaded from the host where
    /// the optimizer state lives there; a rank of a split state rounds its block and gathers
    /// the others' from the group, on every rank at once, unless the weights are split, when
    /// it keeps only its block; streamed master weights' bf16
    /// weights come back from their backup), and zeroes the gradients. A failed resume pauses
    /// the tags resumed before it again, so the trainer stays offloaded.
    ///
    /// # Errors
    /// [`ModelError::NotOffloaded`]; [`ModelError::Memory`] from a resume (with
    /// `InsufficientMemory` nothing changed); [`ModelError::Gpu`].
    pub fn onload(&mut self) -> Result<Vec<OffloadReport>, ModelError> {
        if !self.offloaded {
            return Err(ModelError::NotOffloaded);
        }
        if let Some(group) = &self.group {
            group.restore()?;
        }
        let reports = self.memory.resume_all(&self.tags())?;
        self.offloaded = false;
        self.edges_gathered = false;
        // `resume` returns once its copies are complete, so the compute stream needs no wait.
        let own = self.own_weights()?;
        match (&self.master, &mut self.moments) {
            (Some(master), _) => self.gpu.cast_to_bf16(own, slice(master)?)?,
            (None, Moments::Host(host)) => host.upload_rounded(&self.gpu, own)?,
            // Streamed master weights: the bf16 weights came back from their backup.
            (None, _) => {}
        }
        if self.shard.is_split() && !self.shard.split_weights {
            let params = slice::<bf16>(&self.params)?;
            self.group
                .as_deref()
                .ok_or_else(unjoined)?
                .all_gather_bf16(params)?;
        }
        self.gpu.zero(slice::<f32>(&self.grads)?)?;
        self.record_fences()?;
        Ok(reports)
    }

    /// The trainer's regions, in the order [`offload`](Self::offload) pauses them.
    fn tags(&self) -> Vec<MemoryTag> {
        let mut tags = TAGS.to_vec();
        if let Moments::Streamed(_) = self.moments {
            tags.push(StreamedMoments::tag());
        }
        tags
    }

    /// As [`ensure_active`](Self::ensure_active), and makes the trainer's stream wait for an
    /// optimizer step still running behind it: for every call but the passes, which wait for
    /// it a unit at a time.
    fn ready(&self, action: &'static str) -> Result<(), ModelError> {
        self.ensure_active(action)?;
        self.join_update()
    }

    /// Makes the trainer's stream wait for the optimizer step queued on `updater`, if any.
    fn join_update(&self) -> Result<(), ModelError> {
        match &self.update {
            Some(update) => Ok(update.wait_all(&self.gpu)?),
            None => Ok(()),
        }
    }

    /// Errors unless the trainer is onloaded and its regions are active.
    fn ensure_active(&self, action: &'static str) -> Result<(), ModelError> {
        if self.offloaded {
            return Err(ModelError::Offloaded { action });
        }
        for tag in &self.tags() {
            match self.memory.state(tag)? {
                RegionState::Active => {}
                RegionState::Paused => {
                    return Err(MemoryError::TagPaused { tag: tag.clone() }.into());
                }
                state => {
                    return Err(MemoryError::TagBusy {
                        tag: tag.clone(),
                        state,
                    }
                    .into());
                }
            }
        }
        Ok(())
    }

    /// The model's checks, sequences no longer than `max_batch_tokens`, and no entropy bonus
    /// (the fused cross-entropy keeps no full distribution to differentiate the entropy of).
    fn check_batch(&self, batch: &TrainBatch<'_>) -> Result<(), ModelError> {
        self.model.check_batch(batch)?;
        if batch.entropy_coef != 0.0 {
            return Err(ModelError::Batch(format!(
                "the gpu trainer has no entropy bonus (coefficient {}); drop --entropy-coef or pass --device cpu",
                batch.entropy_coef
            )));
        }
        if batch.seq > self.max_batch_tokens {
            return Err(ModelError::Batch(format!(
                "a sequence of {} tokens exceeds max_batch_tokens {}; raise max_batch_tokens to at least {}",
                batch.seq, self.max_batch_tokens, batch.seq
            )));
        }
        Ok(())
    }

    /// Runs forward and backward over each micro-batch, the first backward pass writing the
    /// whole flat gradients and the rest adding to them; returns the summed weighted negative
    /// log-probs. Where the weights or gradients are split, every rank of the group takes part
    /// in as many passes' gathers and sums as the rank with the most micro-batches (a rank with
    /// fewer adds nothing to the rest). Split gradients, and whole ones no pass writes, are
    /// zeroed first. With `update` (an optimizer step still running behind), that zeroing runs
    /// behind it, and the first forward pass waits for it a unit at a time, the first backward
    /// pass for all of it.
    fn accumulate_grads(
        &mut self,
        batch: &TrainBatch<'_>,
        mut update: Option<&mut Update>,
    ) -> Result<f64, ModelError> {
        self.squared = false;
        let micros = micro_batches(batch, self.max_batch_tokens);
        // A step of one pass keeps layers' gate and up outputs in the gradients.
        let gate_up = if micros.len() == 1 {
            GateUp::InGradients
        } else {
            GateUp::Own
        };
        if let Some(first) = micros.first() {
            // The largest micro-batch's activations, before the group's first collective.
            self.activations_for(first.batch, first.seq, gate_up)?;
        }
        let passes = self.passes_over_group(micros.len(), self.shard.split_grads)?;
        if self.units.is_some() || passes == 0 {
            let zeros = slice::<f32>(&self.grads)?;
            match update.as_deref_mut() {
                Some(update) => update.zero_behind(&self.gpu, zeros)?,
                None => self.gpu.zero(zeros)?,
            }
        }
        let mut behind = update.as_deref();
        let mut nll = 0.0;
        for (i, micro) in micros.iter().enumerate() {
            let acts = self.activations_for(micro.batch, micro.seq, gate_up)?;
            let last = i + 1 == micros.len();
            let write = if i == 0 {
                GradWrite::Overwrite
            } else {
                GradWrite::Add
            };
            let (weights, grads) = (self.weight_units(behind)?, self.grad_units(write, last)?);
            let group = self.group.as_deref();
            let train = ForwardMode::Train;
            let spare = behind.map_or(0, |_| SPARE_FOR_UPDATE);
            if spare > 0 {
                self.gpu.spare_multiprocessors(spare)?;
            }
            let forward = self
                .model
                .forward(&self.gpu, &*weights, &acts, micro, train, group);
            // The pass's own error first, where both fail.
            let given_back = match spare {
                0 => Ok(()),
                _ => self.gpu.spare_multiprocessors(0),
            };
            forward?;
            given_back?;
            if let Some(update) = behind.take() {
                update.wait_all(&self.gpu)?;
            }
            let passed = self
                .model
                .backward(&self.gpu, &*weights, &*grads, &acts, micro, group);
            // Sums left running behind a failed pass are waited for too.
            let finished = grads.finish(&self.gpu);
            passed?;
            finished?;
            nll += nll_sum(&self.model.logprobs(&self.gpu, &acts)?, micro.weights);
        }
        self.squared = !micros.is_empty() && self.squares_behind().is_some();
        // Passes beyond this rank's micro-batches run only where the gradients are split,
        // whose units are zeroed as they open: the passes add nothing.
        let grads = self.grad_units(GradWrite::Add, false)?;
        for _ in micros.len()..passes {
            // Weights of their own for each pass, as each micro-batch's: gathered ahead, every
            // rank's pass then gathers the same layers.
            let weights = self.weight_units(None)?;
            let passed = self
                .model
                .pass_without_batch(&self.gpu, &*weights, Some(&*grads));
            let finished = grads.finish(&self.gpu);
            passed?;
            finished?;
        }
        // A layer gathered ahead that no pass read: its bf16 block is rewritten next.
        self.wait_behind()?;
        Ok(nll)
    }

    /// Where the passes find the weights: the whole bf16 buffer (waiting for `update` a unit
    /// at a time), or where the weights are split ([`OptimizerShard::split_weights`]), the
    /// units they are gathered into.
    fn weight_units<'a>(
        &'a self,
        update: Option<&'a Update>,
    ) -> Result<Box<dyn WeightUnits + 'a>, ModelError> {
        Ok(match self.split_weights()? {
            Some(_) if !self.edges_gathered => {
                return Err(ModelError::Config(
                    "the split weights' edges were not gathered for the current weights; a pass over split weights starts with passes_over_group".into(),
                ));
            }
            Some(split) => Box::new(split),
            None => {
                let n = self.model.layout().len();
                let whole = slice::<bf16>(&self.params)?.sub(0, n)?;
                match update {
                    Some(update) => Box::new(UpdatingWeights { whole, update }),
                    None => Box::new(WholeWeights(whole)),
                }
            }
        })
    }

    /// Where the weights are split, the units they are gathered into.
    fn split_weights(&self) -> Result<Option<SplitWeights<'_>>, ModelError> {
        let Some(units) = &self.weight_units else {
            return Ok(None);
        };
        let layout = self.model.layout();
        let group = self.group.as_deref().ok_or_else(unjoined)?;
        Ok(Some(SplitWeights {
            group,
            shard: self.shard,
            params: layout.len(),
            own: self.own_weights()?,
            units: slice(units)?,
            edges: edge_units(layout),
            first_layer: layout.layer_range(0),
            layers: self.config().num_layers,
            ahead: group.behind().filter(|_| self.shard.reduce_behind),
            slots: RefCell::default(),
        }))
    }

    /// The stream a trainer alone sums its gradients' squares on behind the last backward
    /// pass of a step: the optimizer step's, where it has one.
    fn squares_behind(&self) -> Option<&Gpu> {
        self.updater.as_deref().filter(|_| self.group.is_none())
    }

    /// Where the backward pass puts the gradients: the whole fp32 buffer (in a step's `last`
    /// pass with the sum of their squares behind it, where [`squares_behind`](Self::squares_behind)
    /// has a stream; the sum zeroed first), or where the gradients are split
    /// ([`OptimizerShard::split_grads`]), the units they accumulate in.
    fn grad_units(
        &self,
        write: GradWrite,
        last: bool,
    ) -> Result<Box<dyn GradUnits + '_>, ModelError> {
        let n = self.model.layout().len();
        let Some(units) = &self.units else {
            let whole = slice::<f32>(&self.grads)?.sub(0, n)?;
            return Ok(match self.squares_behind().filter(|_| last) {
                Some(stream) => {
                    let scalar = slice::<f32>(&self.scalar)?;
                    let (sum, partials) = (scalar.sub(0, 1)?, scalar.sub(2, SQUARE_PARTIALS)?);
                    self.gpu.zero(sum)?;
                    Box::new(SquaredGrads {
                        whole,
                        stream,
                        sum,
                        partials,
                        write,
                    })
                }
                None => Box::new(WholeGrads {
                    grads: whole,
                    write,
                }),
            });
        };
        let group = self.group.as_deref().ok_or_else(unjoined)?;
        let layout = self.model.layout();
        let embedding = edge_units(layout)[0].len();
        Ok(Box::new(SplitGrads {
            group,
            shard: self.shard,
            params: n,
            own: self.own_grads()?,
            units: slice(units)?,
            embedding,
            layer: layout.layer_range(0).len(),
            layers: self.config().num_layers,
            slot: unit_slot_len(layout),
            behind: group.behind().filter(|_| self.shard.reduce_behind),
            running: RefCell::new(Vec::new()),
        }))
    }

    /// The passes this rank runs for its `mine` micro-batches. Where a pass's units are
    /// collectives (the weights split, or with `sums` the gradients split), every rank of the
    /// group runs as many as the rank with the most micro-batches, and the split weights'
    /// edges are gathered first, for all of them.
    fn passes_over_group(&mut self, mine: usize, sums: bool) -> Result<usize, ModelError> {
        let Some(group) = self.group.as_deref() else {
            return Ok(mine);
        };
        if !(self.shard.split_weights || sums) {
            return Ok(mine);
        }
        if let Some(split) = self.split_weights()? {
            split.gather_edges()?;
            self.edges_gathered = true;
        }
        let counts = slice::<f32>(&self.scalar)?.sub(0, self.shard.ranks)?;
        let mut each = vec![0.0f32; self.shard.ranks];
        each[self.shard.rank] = mine as f32;
        self.gpu.upload(counts, &each)?;
        group.sum_f32(counts)?;
        self.gpu.download(&mut each, counts)?;
        Ok(each.into_iter().fold(0.0, f32::max) as usize)
    }

    /// Forward passes over each micro-batch: the log-probs and the summed weighted negative
    /// log-probs. Where the weights are split, as many passes' gathers as the rank with the
    /// most micro-batches runs. With `update` (an optimizer step still running behind), the
    /// first pass waits for it a unit at a time.
    fn score(
        &mut self,
        batch: &TrainBatch<'_>,
        update: Option<&Update>,
    ) -> Result<(Vec<f32>, f64), ModelError> {
        let mut logprobs = Vec::with_capacity(batch.batch * batch.seq);
        let mut nll = 0.0;
        let micros = micro_batches(batch, self.max_batch_tokens);
        if let Some(first) = micros.first() {
            self.activations_for(first.batch, first.seq, GateUp::Shared)?;
        }
        let passes = self.passes_over_group(micros.len(), false)?;
        let mut behind = update;
        for micro in &micros {
            let acts = self.activations_for(micro.batch, micro.seq, GateUp::Shared)?;
            let weights = self.weight_units(behind.take())?;
            let (score, group) = (ForwardMode::Score, self.group.as_deref());
            self.model
                .forward(&self.gpu, &*weights, &acts, micro, score, group)?;
            let lp = self.model.logprobs(&self.gpu, &acts)?;
            nll += nll_sum(&lp, micro.weights);
            logprobs.extend_from_slice(&lp);
        }
        for _ in micros.len()..passes {
            let weights = self.weight_units(None)?;
            self.model.pass_without_batch(&self.gpu, &*weights, None)?;
        }
        self.wait_behind()?;
        Ok((logprobs, nll))
    }

    /// The gradients' global norm, the clipping factor and the AdamW update, as
    /// `ops::adamw_step` computes them, and what streamed moments moved.
    fn adamw_step(
        &mut self,
        step: u64,
    ) -> Result<(AdamWStepStats, Option<StreamStats>), ModelError> {
        self.edges_gathered = false;
        let n = self.model.layout().len();
        let grads = self.own_grads()?;
        let grad_norm = self.grad_norm_sq(grads)?.sqrt();
        self.squared = false;
        let clip = clip_scale(&self.adamw, grad_norm);
        let s = AdamWStep::new(&self.adamw, step, clip);
        let params = slice::<bf16>(&self.params)?;
        let own = self.own_weights()?;
        let master = self.master.as_ref().map(slice::<f32>).transpose()?;
        let stream = match &mut self.moments {
            Moments::Resident { m, v } => {
                let master = master.ok_or_else(|| no_master(n))?;
                let (m, v) = (slice::<f32>(m)?, slice::<f32>(v)?);
                match &self.updater {
                    // Behind the next step's forward pass; timed steps run it in line.
                    Some(updater) if self.times.is_none() => {
                        let model = (self.model.layout(), self.model.config().num_layers);
                        let (params, stream) = (own, Arc::clone(updater));
                        let buffers = AdamWBuffers {
                            master,
                            params,
                            m,
                            v,
                            grads,
                        };
                        let update = Update::queue(stream, &self.gpu, model, &buffers, s)?;
                        self.update = Some(update);
                    }
                    _ => self
                        .gpu
                        .adamw_update(master, own, GpuMoments::Fp32(m, v), grads, s)?,
                }
                None
            }
            Moments::Streamed(streamed) => Some(streamed.update(&self.gpu, master, own, grads, s)?),
            Moments::Host(host) => {
                host.step(&self.gpu, grads, own, (step, &self.adamw, clip))?;
                None
            }
        };
        if self.shard.is_split() && !self.shard.split_weights {
            // Every rank updated its block of the bf16 weights; each gets all of them.
            self.group
                .as_deref()
                .ok_or_else(unjoined)?
                .all_gather_bf16(params)?;
        }
        let stats = AdamWStepStats {
            step,
            grad_norm,
            clip_scale: clip,
        };
        Ok((stats, stream))
    }

    /// The squared global norm of the gradients, `grads` being this rank's block of them: the
    /// block's sum over a split state's group, the group's own reading for a whole state in a
    /// group ([`TrainerGroup::grad_norm_sq`]), else the one summed behind the last backward
    /// pass, or the sum here in the same order (a unit at a time, as the backward pass
    /// completes them), so every way alone gives the same bits.
    fn grad_norm_sq(&self, grads: GpuSlice<f32>) -> Result<f32, ModelError> {
        let scalar = slice::<f32>(&self.scalar)?;
        let (sums, partials) = (scalar.sub(0, 2)?, scalar.sub(2, SQUARE_PARTIALS)?);
        if !self.squared {
            self.gpu.zero(sums)?;
        }
        match (&self.group, self.shard.is_split()) {
            (None, false) if self.squared => {}
            (Some(group), false) => return group.grad_norm_sq(&self.gpu, grads, sums, partials),
            (None, true) => return Err(unjoined()),
            (Some(group), true) => {
                let start = self.shard.start(self.model.layout().len());
                return group.block_norm_sq(&self.gpu, grads, start, sums, partials);
            }
            (None, false) => {
                let layers = self.config().num_layers;
                for unit in backward_units(self.model.layout(), layers) {
                    let grads = grads.sub(unit.start, unit.len())?;
                    self.gpu.sum_of_squares(sums.sub(0, 1)?, grads, partials)?;
                }
            }
        }
        let mut sum = [0.0f32; 2];
        self.gpu.download(&mut sum, sums)?;
        Ok(sum[0])
    }

    /// Every rank's `block` of a split state (master weights or a moment), gathered a piece of
    /// each block at a time through a scratch (the gradients' buffer, which holds every block
    /// at once, or where the gradients are split, the unit buffer); with `keep`, downloaded
    /// into every rank's block in rank order. Collective.
    fn gather_blocks(&self, block: Block<'_>, keep: bool) -> Result<Option<Vec<f32>>, ModelError> {
        let group = self.group.as_deref().ok_or_else(unjoined)?;
        let size = match block {
            Block::Device(own) => own.len(),
            Block::Host(values) => values.len(),
        };
        let (rank, ranks) = (self.shard.rank, self.shard.ranks);
        let scratch = slice::<f32>(self.units.as_ref().unwrap_or(&self.grads))?;
        let piece = (scratch.len() / ranks).min(size).max(1);
        let mut out = keep.then(|| vec![0.0; ranks * size]);
        for first in (0..size).step_by(piece) {
            let len = piece.min(size - first);
            let all = scratch.sub(0, ranks * len)?;
            let send = match block {
                Block::Device(own) => own.sub(first, len)?,
                Block::Host(values) => {
                    // Sent from this rank's own piece of the scratch (NCCL's in-place form).
                    let own = all.sub(rank * len, len)?;
                    self.gpu.upload(own, &values[first..first + len])?;
                    own
                }
            };
            group.all_gather_f32(send, all)?;
            if let Some(out) = &mut out {
                let mut pieces = vec![0.0; ranks * len];
                self.gpu.download(&mut pieces, all)?;
                for (r, got) in pieces.chunks_exact(len).enumerate() {
                    out[r * size + first..][..len].copy_from_slice(got);
                }
            }
        }
        Ok(out)
    }

    /// [`gather_blocks`](Self::gather_blocks) of a block of the parameters, kept: the whole
    /// vector.
    fn gathered(&self, block: Block<'_>) -> Result<Vec<f32>, ModelError> {
        let mut whole = self.gather_blocks(block, true)?.unwrap_or_default();
        whole.truncate(self.model.layout().len());
        Ok(whole)
    }

    /// Activations for `batch` sequences of `seq` positions: views of the current buffers when
    /// they are large enough, else of new ones.
    fn activations_for(
        &mut self,
        batch: usize,
        seq: usize,
        gate_up: GateUp,
    ) -> Result<GpuActivations, ModelError> {
        let own = self.model.activation_layout(batch, seq)?;
        let lending = GpuActivationLayout::lending_gate_up(self.model.config(), batch, seq);
        let homes = match gate_up {
            GateUp::InGradients => self.gate_up_homes(lending.gate_up_len())?,
            GateUp::Own | GateUp::Shared => None,
        };
        let layout = if homes.is_some() || gate_up == GateUp::Shared {
            lending
        } else {
            own
        };
        let fits = self
            .acts
            .as_ref()
            .is_some_and(|a| a.capacity.holds(&layout));
        if !fits {
            // Freeing releases device memory that queued kernels may still read.
            self.gpu.synchronize()?;
            self.acts = None;
            let tag = MemoryTag::Activations;
            self.acts = Some(ActivationBuffers {
                bf16: self
                    .memory
                    .alloc(&tag, layout.bf16_len() * size_of::<bf16>())?,
                f32: self
                    .memory
                    .alloc(&tag, layout.f32_len() * size_of::<f32>())?,
                u32: self
                    .memory
                    .alloc(&tag, layout.u32_len() * size_of::<u32>())?,
                capacity: layout.clone(),
            });
            tracing::debug!(batch, seq, bytes = layout.bytes(), "gpu activations sized");
        }
        let Some(bufs) = &self.acts else {
            return Err(ModelError::Batch(
                "gpu activations are not allocated".into(),
            ));
        };
        let acts = GpuActivations::new(
            layout,
            slice(&bufs.bf16)?,
            slice(&bufs.f32)?,
            slice(&bufs.u32)?,
        )?;
        match (homes, gate_up) {
            (Some(homes), _) => acts.with_gate_up_homes(homes),
            (None, GateUp::Shared) => acts.sharing_first_gate_up(),
            (None, _) => Ok(acts),
        }
    }

    /// Where the gate and up outputs of layers past the first live in a training pass that is
    /// its step's only one ([`gate_up_home_ranges`]: each in the gradients of the layer
    /// before), or `None` where they cannot: gradients split over a group (a unit buffer
    /// accumulates them), or too short for a layer's `gate_up_len` elements.
    fn gate_up_homes(&self, gate_up_len: usize) -> Result<Option<Vec<GpuSlice<bf16>>>, ModelError> {
        if self.shard.split_grads || self.units.is_some() {
            return Ok(None);
        }
        let layers = self.model.config().num_layers;
        let Some(ranges) = gate_up_home_ranges(self.model.layout(), layers, gate_up_len) else {
            return Ok(None);
        };
        let grads = slice::<f32>(&self.grads)?;
        let homes = ranges
            .iter()
            .map(|r| grads.sub(r.start, r.len())?.reinterpret::<bf16>())
            .collect::<Result<_, DeviceError>>()?;
        Ok(Some(homes))
    }

    /// Writes the master weights `params` (to the device, or through the stream to disk) and
    /// their bf16 rounding into the bf16 weights.
    fn upload_params(&mut self, params: &[f32]) -> Result<(), ModelError> {
        self.edges_gathered = false;
        if let Some(master) = &self.master {
            return if self.shard.is_split() {
                self.upload_master_block(master, params)
            } else {
                self.upload_master(master, params)
            };
        }
        match &mut self.moments {
            Moments::Streamed(streamed) => streamed.write_master(params)?,
            Moments::Host(host) => host.master = self.shard.block_of(params).into_owned(),
            Moments::Resident { .. } => return Err(no_master(params.len())),
        }
        self.upload_rounded(params)
    }

    /// Uploads the master weights into `master` and rounds them into the bf16 weights.
    fn upload_master(&self, master: &Buffer, params: &[f32]) -> Result<(), ModelError> {
        let master = slice::<f32>(master)?;
        self.gpu.upload(master, params)?;
        self.gpu.cast_to_bf16(slice(&self.params)?, master)?;
        self.record_fences()
    }

    /// Uploads this rank's block of `params` into `master` (a split state's) and the bf16
    /// rounding of all of them (of the block, where the weights are split) into the bf16
    /// weights.
    fn upload_master_block(&self, master: &Buffer, params: &[f32]) -> Result<(), ModelError> {
        self.gpu
            .upload(slice(master)?, &self.shard.block_of(params))?;
        self.upload_rounded(params)
    }

    /// Uploads the bf16 rounding of `params` into the bf16 weights, for master weights that
    /// live on disk or in blocks over a group.
    fn upload_rounded(&self, params: &[f32]) -> Result<(), ModelError> {
        let values = if self.shard.split_weights {
            self.shard.block_of(params)
        } else {
            Cow::Borrowed(params)
        };
        let dst = slice::<bf16>(&self.params)?.sub(0, values.len())?;
        upload_rounded(&self.gpu, &values, &mut Vec::new(), dst)?;
        self.record_fences()
    }

    fn download(&self, buffer: &Buffer) -> Result<Vec<f32>, ModelError> {
        let n = self.model.layout().len();
        let mut out = vec![0.0; n];
        self.gpu.download(&mut out, slice(buffer)?.sub(0, n)?)?;
        Ok(out)
    }

    /// Makes the trainer's stream wait, on the device, for what its group's second
    /// communicator queued on its own stream (sums behind the backward pass), so that a fence
    /// of the trainer's stream covers them too.
    fn wait_behind(&self) -> Result<(), ModelError> {
        if let Some(behind) = self.group.as_deref().and_then(|group| group.behind()) {
            self.gpu.wait_for(&behind.gpu().record_fence()?)?;
        }
        Ok(())
    }

    /// Tells every buffer that the work queued so far (with sums behind the pass, and an
    /// optimizer step behind it) uses it.
    fn record_fences(&self) -> Result<(), ModelError> {
        self.wait_behind()?;
        // The trainer's stream goes on without waiting for an update behind it.
        let fence = match &self.update {
            Some(update) => update.fence_with(&self.gpu)?,
            None => self.gpu.record_fence()?,
        };
        let state = [&self.params, &self.grads, &self.scalar]
            .into_iter()
            .chain(&self.master)
            .chain(&self.weight_units)
            .chain(&self.units)
            .chain(&self.low);
        let moments: Vec<&Buffer> = match &self.moments {
            Moments::Resident { m, v } => vec![m, v],
            Moments::Streamed(streamed) => streamed.slots().iter().collect(),
            Moments::Host(_) => Vec::new(),
        };
        let acts = self.acts.iter().flat_map(|a| [&a.bf16, &a.f32, &a.u32]);
        for buffer in state.chain(moments).chain(acts) {
            buffer.record_use(fence.clone());
        }
        Ok(())
    }
}

/// A trainer of `config` on `gpu` from the full weights `params` for one-off work (scoring,
/// a benchmark, one rank of a parallel benchmark): its own memory manager keeping no
/// margin, no backup, AdamW's defaults, activations for `max_batch_tokens` tokens, keeping
/// `shard` of the optimizer state.
///
/// # Errors
/// As [`GpuTrainer::new`].
pub fn standalone_gpu_trainer(
    gpu: Arc<Gpu>,
    config: LlamaConfig,
    params: &[f32],
    max_batch_tokens: usize,
    shard: OptimizerShard,
) -> Result<GpuTrainer, ModelError> {
    let device: Arc<dyn Device> = gpu.device().clone();
    let memory = Arc::new(MemoryManager::new(
        device,
        ManagerSettings {
            margin_bytes: 0,
            disk: None,
        },
    )?);
    let spec = GpuTrainerSpec {
        config,
        adamw: AdamWConfig::default(),
        backup: BackupPolicy::None,
        max_batch_tokens,
        stream: None,
        shard,
        optimizer_on_host: false,
    };
    GpuTrainer::new(gpu, memory, spec, params)
}

impl Drop for GpuTrainer {
    fn drop(&mut self) {
        // The buffers free their device memory next; queued kernels (sums and an optimizer
        // step behind the pass too) must not outlive it.
        if let Err(error) = self.synchronize() {
            tracing::error!(%error, "cannot wait for the gpu trainer's kernels");
        }
    }
}

/// The buffer's bytes as elements of `T`.
fn slice<T: GpuElement>(buffer: &Buffer) -> Result<GpuSlice<T>, DeviceError> {
    GpuSlice::of(buffer.range())
}

/// Where a rank's block of a split state lives.
enum Block<'a> {
    /// On the device: a buffer of its own (or a view of bf16 weights as fp32 words).
    Device(GpuSlice<f32>),
    /// In host memory ([`GpuTrainerSpec::optimizer_on_host`]).
    Host(&'a [f32]),
}

/// Elements of the unit buffer of split gradients: the embedding's gradients, and beside them
/// a slot for the tail's (final norm, untied head) and each layer's, and where `shard` sums
/// them behind the pass a second slot for every other layer.
fn split_unit_len(layout: &ParamLayout, shard: OptimizerShard) -> usize {
    let second = if shard.reduce_behind {
        layout.layer_range(0).len()
    } else {
        0
    };
    edge_units(layout)[0].len() + unit_slot_len(layout) + second
}

/// Elements of a slot of the unit buffer of split gradients: the larger of a layer's and the
/// tail's.
fn unit_slot_len(layout: &ParamLayout) -> usize {
    edge_units(layout)[1].len().max(layout.layer_range(0).len())
}

/// The error of a trainer of a split optimizer state used before it joined its group.
fn unjoined() -> ModelError {
    ModelError::Config(
        "the trainer keeps one block of a split optimizer state; join its data-parallel group before it trains or reads its state".into(),
    )
}

/// The error of a trainer that has its master weights neither on the device nor streamed
/// (the trainer's own construction rules it out).
fn no_master(need: usize) -> ModelError {
    ModelError::BufferLength {
        buffer: "master weights",
        len: 0,
        need,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adamw_scalars_match_the_cpu_update_on_one_element() {
        // Tolerance 1e-6 relative: the same f32 formulas in a different order.
        let cfg = AdamWConfig {
            lr: 0.01,
            weight_decay: 0.1,
            ..AdamWConfig::default()
        };
        let (p0, g, step, clip) = (0.7f32, -0.3f32, 3u64, 0.5f32);
        let (mut p, mut m, mut v) = ([p0], [0.02f32], [0.001f32]);
        let (m0, v0) = (m[0], v[0]);
        crate::ops::adamw_update(&mut p, &[g], &mut m, &mut v, step, &cfg, clip);
        let s = AdamWStep::new(&cfg, step, clip);
        let gs = g * s.grad_scale;
        let m1 = s.beta1 * m0 + (1.0 - s.beta1) * gs;
        let v1 = s.beta2 * v0 + (1.0 - s.beta2) * gs * gs;
        let want = p0 * s.decay - s.step_size * m1 / (v1.sqrt() / s.bias2_sqrt + s.eps);
        let diff = (want - p[0]).abs() / p[0].abs();
        assert!(
            diff < 1e-6,
            "kernel formula {want} vs cpu {} ({diff:e})",
            p[0]
        );
    }

    #[test]
    fn gpu_trainer_is_send_and_sync_so_backends_can_move_it_across_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<GpuTrainer>();
    }
}
