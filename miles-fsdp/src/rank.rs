//! One data-parallel rank: its memory manager, its shards, the buffers a unit is gathered into,
//! and its activations; the forward and backward passes unit by unit.

use std::sync::Arc;

use miles_core::config::TrainOffload;
use miles_core::memory::{
    BackupPolicy, Buffer, ManagerSettings, MemoryError, MemoryManager, MemoryTag, OffloadReport,
};
use miles_core::model::{ActivationLayout, TrainBatch, Transformer};
use miles_core::ops::AdamWConfig;
use miles_core::{BackendError, Communicator, Device};

use crate::shards::{ShardStore, StatePart};
use crate::units::{Unit, UnitPlan};

/// The tag of the buffers a unit's parameters are gathered into and its full gradient is
/// formed in (and, under native CPU offload, the staging buffer of a shard): transient, so its
/// policy is `none`.
pub const GATHER_TAG: &str = "fsdp_gather";

const F32: usize = std::mem::size_of::<f32>();

/// How a rank keeps its state.
#[derive(Clone, Debug)]
pub(crate) struct RankSetup {
    /// Native CPU offload: shards and optimizer state in host memory.
    pub native: bool,
    /// Backup policy of the parameter and optimizer regions (host or disk).
    pub policy: BackupPolicy,
    /// `--train-memory-margin-bytes`.
    pub margin_bytes: u64,
    /// Where the parameter and optimizer regions offload to (the disk store per rank).
    pub offload: TrainOffload,
}

/// One rank's state.
#[derive(Debug)]
pub(crate) struct Rank {
    device: Arc<dyn Device>,
    memory: MemoryManager,
    shards: ShardStore,
    gathered: Buffer,
    gathered_grads: Buffer,
    acts: Activations,
    /// The tags an offload pauses, in order.
    tags: Vec<MemoryTag>,
    /// Most device bytes committed at any sampled point since the last reset.
    peak_device_bytes: u64,
}

impl Rank {
    /// Rank `rank` of `plan` on `device`, holding its shards of `full` (the full parameters) and
    /// zero moments.
    pub(crate) fn new(
        rank: usize,
        device: Arc<dyn Device>,
        plan: &UnitPlan,
        setup: &RankSetup,
        full: &[f32],
    ) -> Result<Rank, BackendError> {
        let memory = MemoryManager::new(
            Arc::clone(&device),
            ManagerSettings {
                margin_bytes: setup.margin_bytes,
                disk: setup.offload.disk(rank),
            },
        )?;
        let gather_tag = MemoryTag::Named(GATHER_TAG.into());
        let largest_shard = plan.units().iter().map(|u| u.shard_len).max().unwrap_or(0);
        // Staging: a shard on its way to the device (native offload) or a later micro-batch's
        // reduced gradient on its way into the shard's.
        let gather_elems = plan.gathered_len() + plan.gathered_grad_len() + largest_shard;
        memory.create_region(
            gather_tag.clone(),
            BackupPolicy::None,
            arena_bytes(gather_elems, 3),
        )?;
        let capacity = device
            .memory_info()
            .map_err(|source| MemoryError::Device {
                tag: MemoryTag::Activations,
                source,
            })?
            .total;
        memory.create_region(
            MemoryTag::Activations,
            BackupPolicy::None,
            usize::try_from(capacity).unwrap_or(usize::MAX),
        )?;
        let gathered = memory.alloc(&gather_tag, plan.gathered_len() * F32)?;
        let gathered_grads = memory.alloc(&gather_tag, plan.gathered_grad_len() * F32)?;
        let n = plan.shard_total();
        let mut local = vec![0.0; n];
        plan.shard_of(full, rank, &mut local);
        let staging = memory.alloc(&gather_tag, largest_shard * F32)?;
        let (shards, mut tags) = if setup.native {
            let store = ShardStore::Host {
                params: local,
                grads: vec![0.0; n],
                m: vec![0.0; n],
                v: vec![0.0; n],
                staging,
            };
            (store, Vec::new())
        } else {
            memory.create_region(MemoryTag::Params, setup.policy, arena_bytes(n, 1))?;
            memory.create_region(MemoryTag::Optimizer, setup.policy, arena_bytes(2 * n, 2))?;
            memory.create_region(MemoryTag::Grads, BackupPolicy::None, arena_bytes(n, 1))?;
            let mut params = memory.alloc(&MemoryTag::Params, n * F32)?;
            params.view_mut::<f32>()?.copy_from_slice(&local);
            let zeroed = |tag: &MemoryTag| -> Result<Buffer, MemoryError> {
                let mut b = memory.alloc(tag, n * F32)?;
                b.view_mut::<f32>()?.fill(0.0);
                Ok(b)
            };
            let store = ShardStore::Device {
                params,
                grads: zeroed(&MemoryTag::Grads)?,
                m: zeroed(&MemoryTag::Optimizer)?,
                v: zeroed(&MemoryTag::Optimizer)?,
                staging,
            };
            let tags = vec![MemoryTag::Params, MemoryTag::Optimizer, MemoryTag::Grads];
            (store, tags)
        };
        tags.extend([gather_tag, MemoryTag::Activations]);
        Ok(Rank {
            device,
            memory,
            shards,
            gathered,
            gathered_grads,
            acts: Activations(None),
            tags,
            peak_device_bytes: 0,
        })
    }

    /// Device bytes committed now.
    pub(crate) fn device_bytes(&self) -> Result<u64, BackendError> {
        committed(self.device.as_ref())
    }

    /// Most device bytes committed at any point sampled during the last step.
    pub(crate) fn peak_device_bytes(&self) -> u64 {
        self.peak_device_bytes
    }

    fn sample_device(&mut self) -> Result<(), BackendError> {
        self.peak_device_bytes = self.peak_device_bytes.max(self.device_bytes()?);
        Ok(())
    }

    /// The memory manager (for reports and tests).
    pub(crate) fn memory(&self) -> &MemoryManager {
        &self.memory
    }

    /// One training step on this rank's `batch` rows, in micro-batches of `micro_batch_size`
    /// sequences: forward and backward unit by unit, the gradients reduce-scattered unit by
    /// unit and added up over the micro-batches, then AdamW on the local shard. Returns this
    /// rank's part of the loss, the global gradient norm and this rank's part of the entropy
    /// sum (with an entropy mask).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn train_step(
        &mut self,
        comm: &dyn Communicator,
        model: &Transformer,
        plan: &UnitPlan,
        batch: &TrainBatch<'_>,
        micro_batch_size: Option<usize>,
        adamw: &AdamWConfig,
        step: u64,
    ) -> Result<(f32, f32, Option<f32>), BackendError> {
        self.peak_device_bytes = 0;
        let (mut loss, mut entropy) = (0.0, batch.entropy_mask.map(|_| 0.0));
        for (i, micro) in batch.micro_batches(micro_batch_size).iter().enumerate() {
            let (part, share) = self.forward(comm, model, plan, micro)?;
            loss += part;
            entropy = entropy.zip(share).map(|(sum, share)| sum + share);
            self.backward(comm, model, plan, micro, i > 0)?;
        }
        let grad_norm = self.shards.optimizer_step(comm, adamw, step)?;
        Ok((loss, grad_norm, entropy))
    }

    /// The forward pass alone, in micro-batches of `micro_batch_size` sequences: this rank's
    /// part of the loss and its rows' log-probs `(B, T)`.
    pub(crate) fn logprobs(
        &mut self,
        comm: &dyn Communicator,
        model: &Transformer,
        plan: &UnitPlan,
        batch: &TrainBatch<'_>,
        micro_batch_size: Option<usize>,
    ) -> Result<(Vec<f32>, f32), BackendError> {
        let (mut logprobs, mut loss) = (Vec::with_capacity(batch.batch * batch.seq), 0.0);
        for micro in batch.micro_batches(micro_batch_size) {
            loss += self.forward(comm, model, plan, &micro)?.0;
            let (al, acts) = self.acts.fit(&self.memory, model, &micro)?;
            logprobs.extend_from_slice(Transformer::logprobs(&al, &acts.view::<f32>()?));
        }
        Ok((logprobs, loss))
    }

    fn forward(
        &mut self,
        comm: &dyn Communicator,
        model: &Transformer,
        plan: &UnitPlan,
        batch: &TrainBatch<'_>,
    ) -> Result<(f32, Option<f32>), BackendError> {
        let r = plan.ranks();
        let pass = {
            let Rank {
                shards,
                gathered,
                acts,
                memory,
                ..
            } = self;
            let (al, acts) = acts.fit(memory, model, batch)?;
            let mut acts = acts.view_mut::<f32>()?;
            let acts = &mut acts[..al.len()];
            let mut g = gathered.view_mut::<f32>()?;
            let e = plan.embedding();
            shards.gather(comm, e, &mut g[..e.padded_len(r)])?;
            model.embed_forward(&g[..e.range.len()], acts, &al, batch)?;
            for l in 0..model.config().num_layers {
                let u = plan.layer(l);
                shards.gather(comm, u, &mut g[..u.padded_len(r)])?;
                model.layer_forward(l, &g[..u.range.len()], acts, &al, batch)?;
            }
            gather_head(shards, comm, plan, &mut g)?;
            let (norm, head) = head_weights(model, plan, &g);
            let loss = model.head_forward(norm, head, acts, &al, batch)?;
            (loss, batch.entropy_sum(Transformer::entropies(&al, acts)))
        };
        self.sample_device()?;
        Ok(pass)
    }

    /// The backward pass after [`forward`](Self::forward) (which left the head gathered); with
    /// `accumulate`, each unit's reduced gradient is added to the shard's (a later micro-batch
    /// of the step) instead of replacing it.
    fn backward(
        &mut self,
        comm: &dyn Communicator,
        model: &Transformer,
        plan: &UnitPlan,
        batch: &TrainBatch<'_>,
        accumulate: bool,
    ) -> Result<(), BackendError> {
        let r = plan.ranks();
        let Rank {
            shards,
            gathered,
            gathered_grads,
            acts,
            memory,
            device,
            ..
        } = self;
        let (al, acts) = acts.fit(memory, model, batch)?;
        let mut acts = acts.view_mut::<f32>()?;
        let (acts, al) = (&mut acts[..al.len()], &al);
        let mut g = gathered.view_mut::<f32>()?;
        let mut dg = gathered_grads.view_mut::<f32>()?;
        let (e, h) = (plan.embedding(), plan.head());
        // Tied: the embedding's full gradient starts in the head pass and ends in the
        // embedding pass, so it keeps its own block; every other unit uses `work` in turn.
        let (acc, work) = dg.split_at_mut(if plan.tied() { e.padded_len(r) } else { 0 });
        acc.fill(0.0);
        {
            let (norm, head) = head_weights(model, plan, &g);
            let hp = h.padded_len(r);
            work[..hp].fill(0.0);
            let c = norm.len();
            if plan.tied() {
                let d_head = &mut acc[..e.range.len()];
                model.head_backward(norm, head, &mut work[..c], d_head, acts, al, batch)?;
            } else {
                let (d_norm, d_head) = work[..h.range.len()].split_at_mut(c);
                model.head_backward(norm, head, d_norm, d_head, acts, al, batch)?;
            }
            shards.reduce_grads(comm, h, &work[..hp], accumulate)?;
        }
        let mut peak = 0;
        for l in (0..model.config().num_layers).rev() {
            let u = plan.layer(l);
            let (n, up) = (u.range.len(), u.padded_len(r));
            shards.gather(comm, u, &mut g[..up])?;
            work[..up].fill(0.0);
            model.layer_backward(l, &g[..n], &mut work[..n], acts, al, batch)?;
            shards.reduce_grads(comm, u, &work[..up], accumulate)?;
            peak = peak.max(committed(device.as_ref())?);
        }
        let ep = e.padded_len(r);
        let d_emb = if plan.tied() {
            &mut acc[..ep]
        } else {
            work[..ep].fill(0.0);
            &mut work[..ep]
        };
        model.embed_backward(&mut d_emb[..e.range.len()], acts, al, batch)?;
        shards.reduce_grads(comm, e, d_emb, accumulate)?;
        self.peak_device_bytes = self.peak_device_bytes.max(peak);
        Ok(())
    }

    /// The full `part` of every unit, gathered from the ranks; only rank 0 keeps it (others
    /// return an empty buffer).
    pub(crate) fn gather_full(
        &mut self,
        comm: &dyn Communicator,
        plan: &UnitPlan,
        part: StatePart,
        len: usize,
    ) -> Result<Vec<f32>, BackendError> {
        let root = comm.rank() == 0;
        let mut full = if root { vec![0.0; len] } else { Vec::new() };
        for unit in plan.units() {
            let shard = self.shards.shard(part, unit)?;
            let mut padded = vec![0.0; unit.padded_len(plan.ranks())];
            comm.all_gather(&shard, &mut padded)?;
            if root {
                full[unit.range.clone()].copy_from_slice(&padded[..unit.range.len()]);
            }
        }
        Ok(full)
    }

    /// Replaces `part` with this rank's shards of `full`.
    pub(crate) fn scatter_full(
        &mut self,
        plan: &UnitPlan,
        rank: usize,
        part: StatePart,
        full: &[f32],
    ) -> Result<(), BackendError> {
        let mut local = vec![0.0; plan.shard_total()];
        plan.shard_of(full, rank, &mut local);
        self.shards.set_all(part, &local)?;
        Ok(())
    }

    /// Pauses every tag (parameters and optimizer state to their backup, the rest dropped); on
    /// a failure the tags already paused come back and the error is returned.
    pub(crate) fn offload(&mut self) -> Result<Vec<OffloadReport>, BackendError> {
        let reports = self.memory.pause_all(&self.tags)?;
        Ok(reports)
    }

    /// Resumes every tag and re-zeroes the gradient shards; on a failure the tags already
    /// resumed are paused again, so the rank stays offloaded and a later onload can retry.
    pub(crate) fn onload(&mut self) -> Result<Vec<OffloadReport>, BackendError> {
        let reports = self.memory.resume_all(&self.tags)?;
        if let ShardStore::Device { grads, .. } = &mut self.shards {
            grads.view_mut::<f32>()?.fill(0.0);
        }
        Ok(reports)
    }
}

/// The activation buffer, in the `activations` region.
#[derive(Debug)]
struct Activations(Option<Buffer>);

impl Activations {
    /// The layout of `batch` and a buffer whose start holds it: the current buffer while it is
    /// large enough (the micro-batches of a step share the first's), else the old one freed and
    /// a new one allocated. The backward pass finds the forward pass's.
    fn fit(
        &mut self,
        memory: &MemoryManager,
        model: &Transformer,
        batch: &TrainBatch<'_>,
    ) -> Result<(ActivationLayout, &mut Buffer), BackendError> {
        let al = model.activation_layout(batch.batch, batch.seq)?;
        if self.0.as_ref().is_some_and(|b| b.len() < al.len() * F32) {
            self.0 = None;
        }
        let buffer = match &mut self.0 {
            Some(current) => current,
            empty => empty.insert(memory.alloc(&MemoryTag::Activations, al.len() * F32)?),
        };
        Ok((al, buffer))
    }
}

/// Device bytes committed now.
fn committed(device: &dyn Device) -> Result<u64, BackendError> {
    let info = device.memory_info().map_err(|source| MemoryError::Device {
        tag: MemoryTag::Activations,
        source,
    })?;
    Ok(info.total - info.free)
}

/// Gathers the head unit, and after it the embedding when tied, into `g`.
fn gather_head(
    shards: &mut ShardStore,
    comm: &dyn Communicator,
    plan: &UnitPlan,
    g: &mut [f32],
) -> Result<(), BackendError> {
    let r = plan.ranks();
    let (h, e) = (plan.head(), plan.embedding());
    let hp = h.padded_len(r);
    shards.gather(comm, h, &mut g[..hp])?;
    if plan.tied() {
        shards.gather(comm, e, &mut g[hp..hp + e.padded_len(r)])?;
    }
    Ok(())
}

/// The final norm and LM head weights in `g` as [`gather_head`] left them.
fn head_weights<'a>(model: &Transformer, plan: &UnitPlan, g: &'a [f32]) -> (&'a [f32], &'a [f32]) {
    let (h, e): (&Unit, &Unit) = (plan.head(), plan.embedding());
    let c = model.config().hidden_size;
    if plan.tied() {
        let hp = h.padded_len(plan.ranks());
        (&g[..c], &g[hp..hp + e.range.len()])
    } else {
        (&g[..c], &g[c..h.range.len()])
    }
}

/// Arena bytes for `elems` f32s split over `blocks` buffers (each block aligned to 256 bytes).
fn arena_bytes(elems: usize, blocks: usize) -> usize {
    elems * F32 + blocks * 256
}
