//! One rank of the Megatron backend: its device, its memory manager, its shard of the model in
//! contiguous buffers, and the step.
//!
//! Each rank's parameters and gradients are one flat buffer each (tags `params`, `grads`), laid
//! out by the rank's tensor-parallel [`ParamLayout`] and padded to a multiple of the
//! data-parallel size. Data-parallel rank `d` owns the contiguous slice `d` of that buffer: it
//! keeps the Adam moments of that slice only (tag `optimizer`, or on disk when streamed),
//! receives that slice of the summed gradients (reduce-scatter), updates it, and the slices are
//! all-gathered back into every rank's parameters. On the CPU device the parameters are fp32, so
//! they are the fp32 master weights themselves: no second copy.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use miles_core::config::MomentDtype;
use miles_core::model::{ActivationLayout, ParamLayout, TrainBatch, Transformer};
use miles_core::ops::{AdamWConfig, adamw_update, clip_scale};
use miles_core::store::stream_chunk_bytes;
use miles_core::{
    BackendError, BackupPolicy, Buffer, Communicator, CpuDevice, DiskSettings, DiskStore, HostPool,
    ManagerSettings, MemoryManager, MemoryTag, RankOffload,
};

use crate::shard::{Split, split_of};
use crate::stream::{StreamedMoments, arena_bytes, stream_tag};

/// Where a rank sits in the grid: `rank = dp_rank * tp + tp_rank`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Grid {
    pub rank: usize,
    pub tp: usize,
    pub dp: usize,
}

impl Grid {
    pub(crate) fn tp_rank(&self) -> usize {
        self.rank % self.tp
    }

    pub(crate) fn dp_rank(&self) -> usize {
        self.rank / self.tp
    }
}

/// The collectives of one rank.
#[derive(Debug)]
pub(crate) struct Comms {
    pub world: Box<dyn Communicator>,
    pub tp: Box<dyn Communicator>,
    pub dp: Box<dyn Communicator>,
}

/// What a rank is built from.
#[derive(Clone, Debug)]
pub(crate) struct RankSpec {
    pub grid: Grid,
    pub model: Transformer,
    pub adamw: AdamWConfig,
    pub device_bytes: u64,
    pub margin_bytes: u64,
    pub backup: BackupPolicy,
    pub disk: Option<DiskSettings>,
    pub stream: Option<StreamSpec>,
    pub micro_batch_size: Option<usize>,
}

/// What the forward passes over a rank's rows gave.
struct Pass {
    /// The rows' share of the loss.
    loss: f32,
    /// The rows' share of `Σ mask_t H_t / normaliser`, with an entropy mask.
    entropy: Option<f32>,
    /// The rows' per-token log-probs `(B, T)`.
    logprobs: Vec<f32>,
}

/// Optimizer streaming settings.
#[derive(Clone, Debug)]
pub(crate) struct StreamSpec {
    pub dtype: MomentDtype,
    pub disk: DiskSettings,
    pub bucket_bytes: usize,
}

/// The Adam moments of a rank's shard.
#[derive(Debug)]
enum Moments {
    Resident { m: Buffer, v: Buffer },
    Streamed(Box<StreamedMoments>),
}

/// One rank's state.
#[derive(Debug)]
pub(crate) struct Rank {
    pub grid: Grid,
    comms: Option<Comms>,
    host: Arc<CpuDevice>,
    manager: Arc<MemoryManager>,
    model: Transformer,
    adamw: AdamWConfig,
    local_len: usize,
    shard_len: usize,
    params: Buffer,
    grads: Buffer,
    grad_shard: Buffer,
    moments: Moments,
    acts: Option<Buffer>,
    micro_batch_size: Option<usize>,
    /// Spans of the local layout and whether each is replicated over tensor parallelism.
    spans: Vec<(Range<usize>, bool)>,
    pub step: u64,
    offloaded: bool,
}

const F32: usize = 4;

impl Rank {
    /// Builds the rank's memory and buffers and fills its parameters from `local_params`
    /// (its tensor-parallel shard of the initial weights).
    pub(crate) fn new(
        spec: RankSpec,
        comms: Comms,
        local_params: &[f32],
    ) -> Result<Rank, BackendError> {
        let grid = spec.grid;
        let host = Arc::new(CpuDevice::new(spec.device_bytes));
        let device: Arc<dyn miles_core::Device> = host.clone();
        let manager = Arc::new(MemoryManager::new(
            Arc::clone(&device),
            ManagerSettings {
                margin_bytes: spec.margin_bytes,
                disk: spec.disk.clone(),
            },
        )?);
        let layout = spec.model.layout().clone();
        let local_len = layout.len();
        let shard_len = local_len.div_ceil(grid.dp);
        let padded = shard_len * grid.dp;
        let backup = spec.backup;
        manager.create_region(MemoryTag::Params, backup, padded * F32)?;
        manager.create_region(
            MemoryTag::Grads,
            BackupPolicy::None,
            (padded + shard_len) * F32,
        )?;
        manager.create_region(
            MemoryTag::Activations,
            BackupPolicy::None,
            usize::try_from(spec.device_bytes).unwrap_or(usize::MAX),
        )?;
        let mut params = manager.alloc(&MemoryTag::Params, padded * F32)?;
        {
            let mut view = params.view_mut::<f32>()?;
            view[..local_len].copy_from_slice(local_params);
            view[local_len..].fill(0.0);
        }
        let mut grads = manager.alloc(&MemoryTag::Grads, padded * F32)?;
        grads.view_mut::<f32>()?.fill(0.0);
        let mut grad_shard = manager.alloc(&MemoryTag::Grads, shard_len * F32)?;
        grad_shard.view_mut::<f32>()?.fill(0.0);
        let moments = match &spec.stream {
            None => {
                manager.create_region(MemoryTag::Optimizer, backup, 2 * shard_len * F32)?;
                let mut m = manager.alloc(&MemoryTag::Optimizer, shard_len * F32)?;
                let mut v = manager.alloc(&MemoryTag::Optimizer, shard_len * F32)?;
                m.view_mut::<f32>()?.fill(0.0);
                v.view_mut::<f32>()?.fill(0.0);
                Moments::Resident { m, v }
            }
            Some(stream) => {
                let per_elem = 2 * miles_core::ops::moment_bytes(stream.dtype);
                let bucket_elems = (stream.bucket_bytes / per_elem).max(1);
                let arena = arena_bytes(stream.dtype, shard_len, bucket_elems);
                manager.create_region(stream_tag(), BackupPolicy::None, arena)?;
                let pool = Arc::new(HostPool::new(Arc::clone(&device)));
                let store = DiskStore::new(
                    &stream.disk.dir,
                    stream.disk.rank,
                    stream_chunk_bytes(stream.disk.chunk_bytes),
                    pool,
                )?;
                Moments::Streamed(Box::new(StreamedMoments::new(
                    &manager,
                    Arc::new(store),
                    stream.dtype,
                    shard_len,
                    bucket_elems,
                    stream.disk.host_budget_bytes,
                )?))
            }
        };
        let spans = layout
            .specs()
            .iter()
            .map(|s| (s.range(), split_of(s.kind) == Split::Replicated))
            .collect();
        Ok(Rank {
            grid,
            comms: Some(comms),
            host,
            manager,
            model: spec.model,
            adamw: spec.adamw,
            local_len,
            shard_len,
            params,
            grads,
            grad_shard,
            moments,
            acts: None,
            micro_batch_size: spec.micro_batch_size,
            spans,
            step: 0,
            offloaded: false,
        })
    }

    /// Runs `f` with the rank's collectives; fails while offloaded or once the rank has left
    /// its groups.
    fn with_comms<T>(
        &mut self,
        op: &'static str,
        f: impl FnOnce(&mut Rank, &Comms) -> Result<T, BackendError>,
    ) -> Result<T, BackendError> {
        self.check_active(op)?;
        let comms = self.comms.take().ok_or_else(|| BackendError::Settings {
            backend: "megatron",
            reason: format!(
                "rank {} left its groups after an earlier failure; rebuild the trainer",
                self.grid.rank
            ),
        })?;
        let result = f(self, &comms);
        self.comms = Some(comms);
        result
    }

    /// Leaves the groups so that peers waiting in a collective fail instead of hanging.
    pub(crate) fn leave_groups(&mut self) {
        self.comms = None;
    }

    /// The local parameter layout.
    pub(crate) fn layout(&self) -> &ParamLayout {
        self.model.layout()
    }

    /// The activation layout of `batch`, with a buffer that holds it: the current buffer while
    /// it is large enough (the micro-batches of a step share the first's), else a new one.
    fn activations(&mut self, batch: &TrainBatch<'_>) -> Result<ActivationLayout, BackendError> {
        let al = self.model.activation_layout(batch.batch, batch.seq)?;
        if self
            .acts
            .as_ref()
            .is_some_and(|b| b.len() >= al.len() * F32)
        {
            return Ok(al);
        }
        if let Some(old) = self.acts.take() {
            old.free().map_err(|e| e.error)?;
        }
        let buffer = self
            .manager
            .alloc(&MemoryTag::Activations, al.len() * F32)?;
        self.acts = Some(buffer);
        Ok(al)
    }

    /// Forward (and with `backward`, backward) over this rank's rows in micro-batches of
    /// `micro_batch_size` sequences, the gradients of each added into the zeroed `grads`
    /// buffer. Returns the rows' share of the loss and of the entropy sum, and their log-probs.
    fn forward_backward(
        &mut self,
        tp: &dyn Communicator,
        batch: &TrainBatch<'_>,
        backward: bool,
    ) -> Result<Pass, BackendError> {
        if backward {
            self.grads.view_mut::<f32>()?.fill(0.0);
        }
        let mut pass = Pass {
            loss: 0.0,
            entropy: batch.entropy_mask.map(|_| 0.0),
            logprobs: Vec::with_capacity(batch.batch * batch.seq),
        };
        for micro in batch.micro_batches(self.micro_batch_size) {
            let al = self.activations(&micro)?;
            let tp = Some(tp);
            let Rank {
                model,
                params,
                grads,
                acts,
                local_len,
                ..
            } = self;
            let Some(acts) = acts else {
                return Err(BackendError::Batch(
                    "no activation buffer was allocated for this batch".to_string(),
                ));
            };
            let params = params.view::<f32>()?;
            let mut acts = acts.view_mut::<f32>()?;
            let acts = &mut acts[..al.len()];
            pass.loss += model.forward_tp(&params[..*local_len], acts, &al, &micro, tp)?;
            if let (Some(sum), Some(part)) = (
                pass.entropy.as_mut(),
                micro.entropy_sum(Transformer::entropies(&al, acts)),
            ) {
                *sum += part;
            }
            pass.logprobs
                .extend_from_slice(Transformer::logprobs(&al, acts));
            if backward {
                let mut grads = grads.view_mut::<f32>()?;
                model.backward_tp(
                    &params[..*local_len],
                    &mut grads[..*local_len],
                    acts,
                    &al,
                    &micro,
                    tp,
                )?;
            }
        }
        Ok(pass)
    }

    /// Per-token log-probs of `batch` (this rank's rows) and their share of the loss.
    pub(crate) fn logprobs(
        &mut self,
        batch: &TrainBatch<'_>,
    ) -> Result<(f32, Vec<f32>), BackendError> {
        self.with_comms("compute log-probs", |rank, comms| {
            let pass = rank.forward_backward(&*comms.tp, batch, false)?;
            Ok((pass.loss, pass.logprobs))
        })
    }

    /// Sets the learning rate of the coming optimizer steps.
    pub(crate) fn set_lr(&mut self, lr: f32) {
        self.adamw.lr = lr;
    }

    /// One step on this rank's rows: forward and backward (micro-batch by micro-batch),
    /// reduce-scatter, global norm, AdamW on the owned slice, all-gather. Returns the rows'
    /// share of the loss, the grad norm and the rows' share of the entropy sum.
    pub(crate) fn train_step(
        &mut self,
        batch: &TrainBatch<'_>,
    ) -> Result<(f32, f32, Option<f32>), BackendError> {
        self.with_comms("train", |rank, comms| rank.step_with(comms, batch))
    }

    fn step_with(
        &mut self,
        comms: &Comms,
        batch: &TrainBatch<'_>,
    ) -> Result<(f32, f32, Option<f32>), BackendError> {
        if let Moments::Streamed(streamed) = &self.moments {
            streamed.prefetch()?;
        }
        let Pass { loss, entropy, .. } = self.forward_backward(&*comms.tp, batch, true)?;
        let dp_rank = self.grid.dp_rank();
        let owned = dp_rank * self.shard_len..(dp_rank + 1) * self.shard_len;
        {
            let grads = self.grads.view::<f32>()?;
            let mut shard = self.grad_shard.view_mut::<f32>()?;
            comms.dp.reduce_scatter_sum(&grads, &mut shard)?;
        }
        let grad_shard = self.grad_shard.view::<f32>()?;
        // Squared norm of the owned slice, split into tensor-parallel shards (distinct on every
        // tensor-parallel rank) and replicated tensors (identical there: counted once).
        let (mut sharded, mut replicated) = (0.0f64, 0.0f64);
        for (span, is_replicated) in &self.spans {
            let (start, end) = (span.start.max(owned.start), span.end.min(owned.end));
            if start >= end {
                continue;
            }
            let sum: f64 = grad_shard[start - owned.start..end - owned.start]
                .iter()
                .map(|&g| f64::from(g) * f64::from(g))
                .sum();
            if *is_replicated {
                replicated += sum;
            } else {
                sharded += sum;
            }
        }
        let mut sums = [sharded as f32, replicated as f32];
        comms.world.all_reduce_sum(&mut sums)?;
        let norm_sq = f64::from(sums[0]) + f64::from(sums[1]) / self.grid.tp as f64;
        let grad_norm = norm_sq.sqrt() as f32;
        let scale = clip_scale(&self.adamw, grad_norm);
        self.step += 1;
        let mut owned_params = {
            let params = self.params.view::<f32>()?;
            params[owned.clone()].to_vec()
        };
        match &mut self.moments {
            Moments::Resident { m, v } => {
                let (mut m, mut v) = (m.view_mut::<f32>()?, v.view_mut::<f32>()?);
                adamw_update(
                    &mut owned_params,
                    &grad_shard,
                    &mut m,
                    &mut v,
                    self.step,
                    &self.adamw,
                    scale,
                );
            }
            Moments::Streamed(streamed) => {
                streamed.update(
                    &mut owned_params,
                    &grad_shard,
                    self.step,
                    &self.adamw,
                    scale,
                )?;
            }
        }
        drop(grad_shard);
        let mut params = self.params.view_mut::<f32>()?;
        comms.dp.all_gather(&owned_params, &mut params)?;
        Ok((loss, grad_norm, entropy))
    }

    fn check_active(&self, op: &'static str) -> Result<(), BackendError> {
        if self.offloaded {
            return Err(BackendError::Offloaded { op });
        }
        Ok(())
    }

    fn tags(&self) -> Vec<MemoryTag> {
        let mut tags = vec![MemoryTag::Params, MemoryTag::Grads, MemoryTag::Activations];
        match self.moments {
            Moments::Resident { .. } => tags.insert(1, MemoryTag::Optimizer),
            Moments::Streamed(_) => tags.push(stream_tag()),
        }
        tags
    }

    /// Pauses every tag of the rank: parameters and optimizer state to their backup, gradients,
    /// activations and streaming buffers dropped. On a failure the tags already paused are
    /// resumed, so the rank stays usable.
    pub(crate) fn offload(&mut self) -> Result<RankOffload, BackendError> {
        self.check_active("offload")?;
        let start = Instant::now();
        let reports = self.manager.pause_all(&self.tags())?;
        self.offloaded = true;
        Ok(RankOffload::new(
            self.grid.rank,
            start.elapsed().as_secs_f64(),
            reports,
        ))
    }

    /// Resumes every tag and zeroes the gradients.
    pub(crate) fn onload(&mut self) -> Result<RankOffload, BackendError> {
        if !self.offloaded {
            return Err(BackendError::NotOffloaded);
        }
        let start = Instant::now();
        let reports = self.manager.resume_all(&self.tags())?;
        self.grads.view_mut::<f32>()?.fill(0.0);
        self.grad_shard.view_mut::<f32>()?.fill(0.0);
        self.offloaded = false;
        Ok(RankOffload::new(
            self.grid.rank,
            start.elapsed().as_secs_f64(),
            reports,
        ))
    }

    /// The rank's memory manager, shared with the trainer so it can read the device memory
    /// of each tag without a round trip to the rank.
    pub(crate) fn manager(&self) -> Arc<MemoryManager> {
        Arc::clone(&self.manager)
    }

    /// Bytes of the rank's tags resident in RAM (the CPU device's stand-in for device memory).
    pub(crate) fn resident_bytes(&self) -> Result<u64, BackendError> {
        let mut total = 0;
        for tag in self.tags() {
            let range = self.manager.arena(&tag)?;
            total += self.host.resident_bytes_in(range).map_err(|source| {
                miles_core::MemoryError::Device {
                    tag: tag.clone(),
                    source,
                }
            })?;
        }
        Ok(total)
    }

    /// The rank's local parameters (its tensor-parallel shard, unpadded).
    pub(crate) fn local_params(&self) -> Result<Vec<f32>, BackendError> {
        self.check_active("export weights")?;
        Ok(self.params.view::<f32>()?[..self.local_len].to_vec())
    }

    /// Replaces the local parameters.
    pub(crate) fn set_local_params(&mut self, local: &[f32]) -> Result<(), BackendError> {
        self.check_active("load weights")?;
        self.params.view_mut::<f32>()?[..self.local_len].copy_from_slice(local);
        Ok(())
    }

    /// Both moments of the owned slice, fp32.
    pub(crate) fn moments(&mut self) -> Result<(Vec<f32>, Vec<f32>), BackendError> {
        self.check_active("save optimizer state")?;
        match &mut self.moments {
            Moments::Resident { m, v } => {
                Ok((m.view::<f32>()?.to_vec(), v.view::<f32>()?.to_vec()))
            }
            Moments::Streamed(streamed) => streamed.read_all(self.shard_len),
        }
    }

    /// Elements of the owned slice (the length of each moment).
    pub(crate) fn shard_len(&self) -> usize {
        self.shard_len
    }

    /// Replaces both moments of the owned slice (each [`shard_len`](Self::shard_len) long).
    pub(crate) fn set_moments(&mut self, m: &[f32], v: &[f32]) -> Result<(), BackendError> {
        self.check_active("load optimizer state")?;
        match &mut self.moments {
            Moments::Resident { m: bm, v: bv } => {
                bm.view_mut::<f32>()?.copy_from_slice(m);
                bv.view_mut::<f32>()?.copy_from_slice(v);
                Ok(())
            }
            Moments::Streamed(streamed) => streamed.write_all(m, v),
        }
    }

    /// Whether the rank's tensors are offloaded.
    pub(crate) fn is_offloaded(&self) -> bool {
        self.offloaded
    }
}
