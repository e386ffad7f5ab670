//! The seam between the single-GPU trainer and a parallel group it is one rank of: the trainer
//! calls a [`TrainerGroup`] at the points where ranks must agree, and the backends that name a
//! parallel layout implement it (Megatron's tensor-parallel group in `miles-megatron`; the
//! data-parallel group both backends use is core's, in `backend/data_parallel.rs`). A
//! data-parallel group may also split the optimizer state over its ranks ([`OptimizerShard`]),
//! as ZeRO does: then the gradients are reduce-scattered, each rank updates its block, and the
//! bf16 weights are all-gathered (stage 1); or the gradients are split too (stage 2), each
//! unit's summed into their owners' blocks as soon as its backward pass is done
//! ([`SplitGrads`]), on a second communicator and stream while the pass goes on where the group
//! has one ([`TrainerGroup::behind`]); or the bf16 weights are split as well, as FSDP does
//! (stage 3), each unit's gathered from the blocks that hold them before it runs
//! ([`SplitWeights`]).

use std::borrow::Cow;
use std::cell::RefCell;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use half::bf16;

use super::weights::{GradUnits, WeightUnits};
use crate::device::{Collectives, Fence, Gpu, GpuSlice};
use crate::model::ModelError;
use crate::ops::gpu::GradWrite;

/// A group's communicator behind a lock (a [`TrainerGroup`] is `Sync` and answers through
/// `&self`, an NCCL communicator is neither), with the GPU it runs on: what every group holds,
/// and the calls that do not depend on its layout. It carries the collectives over NCCL
/// ([`NcclComm`](crate::device::NcclComm)), or in tests over the host between ranks on one GPU.
pub struct GroupComm {
    gpu: Arc<Gpu>,
    comm: Mutex<Box<dyn Collectives>>,
}

impl std::fmt::Debug for GroupComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupComm").finish_non_exhaustive()
    }
}

impl GroupComm {
    /// `comm`, on its GPU.
    pub fn new(comm: impl Collectives + 'static) -> GroupComm {
        GroupComm {
            gpu: Arc::clone(comm.gpu()),
            comm: Mutex::new(Box::new(comm)),
        }
    }

    /// The communicator, for a collective: hold it for no more than the calls at hand.
    pub fn lock(&self) -> MutexGuard<'_, Box<dyn Collectives>> {
        self.comm.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The GPU the communicator runs on.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// This rank's place in the group.
    pub fn rank(&self) -> usize {
        self.lock().rank()
    }

    /// The ranks of the group.
    pub fn world_size(&self) -> usize {
        self.lock().world_size()
    }

    /// Sums `grads` and the negative log-probs `nll` over the ranks (replicas that each trained
    /// on their own part of a batch); returns the sum of `nll`. `scalar` is one fp32 element of
    /// scratch on the device. Every rank's sum is the same, bit for bit.
    ///
    /// # Errors
    /// [`ModelError::Gpu`] when a copy or the collective fails.
    pub fn sum_replicas(
        &self,
        grads: GpuSlice<f32>,
        scalar: GpuSlice<f32>,
        nll: f64,
    ) -> Result<f64, ModelError> {
        let comm = self.lock();
        comm.all_reduce_sum(grads)?;
        self.gpu.upload(scalar, &[nll as f32])?;
        comm.all_reduce_sum(scalar)?;
        let mut sum = [0.0f32];
        self.gpu.download(&mut sum, scalar)?;
        Ok(f64::from(sum[0]))
    }

    /// [`TrainerGroup::release`]: the communicator's own device buffers released where NCCL
    /// can (`ncclCommSuspend`), their bytes; `None` where they stay.
    ///
    /// # Errors
    /// [`ModelError::Gpu`] when NCCL fails.
    pub fn release(&self) -> Result<Option<u64>, ModelError> {
        Ok(self.lock().suspend()?)
    }

    /// [`TrainerGroup::restore`]: the buffers [`release`](Self::release) released, back.
    ///
    /// # Errors
    /// [`ModelError::Gpu`] when NCCL fails.
    pub fn restore(&self) -> Result<(), ModelError> {
        Ok(self.lock().resume()?)
    }
}

/// One rank's view of a parallel group of [`GpuTrainer`](super::GpuTrainer)s, called on the
/// trainer's compute stream at the points where the ranks must agree.
///
/// A group must be `Send + Sync` so that a trainer can move across threads; an implementation
/// holding a communicator that is neither keeps it behind a lock.
pub trait TrainerGroup: Send + Sync {
    /// The group's kind, for messages (`data`, `tensor`).
    fn name(&self) -> &'static str;

    /// This rank's index in the group.
    fn rank(&self) -> usize;

    /// Ranks in the group.
    fn world_size(&self) -> usize;

    /// This rank's place `(rank, ranks)` among the ranks a split optimizer state
    /// ([`OptimizerShard`]) is split over: the whole group, unless the group also holds
    /// tensor-parallel ranks, which keep the same blocks of their own shards.
    fn split_place(&self) -> (usize, usize) {
        (self.rank(), self.world_size())
    }

    /// The GPU whose stream the group's collectives run on: the trainer's own (the second
    /// communicator of [`behind`](Self::behind) has a stream of its own).
    fn gpu(&self) -> &Arc<Gpu>;

    /// Called in the forward pass on each row-parallel product's partial output (o and down),
    /// and in the backward pass on the partial gradient entering each of a layer's two norms,
    /// in place. A group whose ranks hold whole weights leaves `x` as it is.
    ///
    /// # Errors
    /// [`ModelError::Gpu`] when a collective fails.
    fn sum_row_parallel(&self, x: GpuSlice<bf16>) -> Result<(), ModelError>;

    /// Called once all micro-batches' backward passes are done, on the gradients and on `nll`,
    /// this rank's summed weighted negative log-probs; returns the loss's numerator the trainer
    /// reports. `scalar` is one fp32 element of scratch on the device.
    ///
    /// # Errors
    /// [`ModelError::Gpu`] when a copy or a collective fails.
    fn after_backward(
        &self,
        gpu: &Gpu,
        grads: GpuSlice<f32>,
        scalar: GpuSlice<f32>,
        nll: f64,
    ) -> Result<f64, ModelError>;

    /// The squared global norm of the gradients over the group, the same on every rank (it
    /// sets the clipping factor, and ranks that clip apart drift apart). `sums` is two zeroed
    /// fp32 elements of scratch on the device, `partials` the scratch of
    /// [`Gpu::sum_of_squares`].
    ///
    /// # Errors
    /// [`ModelError::Gpu`] when a kernel, a copy or a collective fails.
    fn grad_norm_sq(
        &self,
        gpu: &Gpu,
        grads: GpuSlice<f32>,
        sums: GpuSlice<f32>,
        partials: GpuSlice<f32>,
    ) -> Result<f32, ModelError>;

    /// Called once the trainer's memory is paused, on every rank of the group at once:
    /// releases the device memory the group's communicator holds for itself (NCCL's buffers)
    /// until [`restore`](Self::restore), and returns its bytes; `None` where it stays (no such
    /// memory, or a library that cannot release it).
    ///
    /// # Errors
    /// [`ModelError::Gpu`] when the release fails.
    fn release(&self) -> Result<Option<u64>, ModelError> {
        Ok(None)
    }

    /// For a trainer whose optimizer state is split over the group ([`OptimizerShard`]), in
    /// place of [`after_backward`](Self::after_backward)'s sum: sums `all` (the group's size
    /// times a block) over the ranks, leaving this rank's block of the sum in its own block (the
    /// others are then undefined).
    ///
    /// # Errors
    /// [`ModelError::Config`] for a group that does not split the optimizer state (the
    /// default); [`ModelError::Gpu`] when the collective fails.
    fn reduce_scatter_f32(&self, _all: GpuSlice<f32>) -> Result<(), ModelError> {
        Err(not_sharded(self.name()))
    }

    /// As [`reduce_scatter_f32`](Self::reduce_scatter_f32) on bf16 elements (each sum rounded
    /// to bf16): half the bytes (`--grad-reduce-in-bf16`).
    ///
    /// # Errors
    /// As [`reduce_scatter_f32`](Self::reduce_scatter_f32).
    fn reduce_scatter_bf16(&self, _all: GpuSlice<bf16>) -> Result<(), ModelError> {
        Err(not_sharded(self.name()))
    }

    /// For a split state: the squared global norm of the gradients, `block` being this rank's
    /// block of them from parameter `start` on, the same on every rank. `sums` is two zeroed
    /// fp32 elements of scratch on the device, `partials` the scratch of
    /// [`Gpu::sum_of_squares`]. By default the block's sum of squares summed over the ranks
    /// ([`sum_f32`](Self::sum_f32)).
    ///
    /// # Errors
    /// As [`reduce_scatter_f32`](Self::reduce_scatter_f32).
    fn block_norm_sq(
        &self,
        gpu: &Gpu,
        block: GpuSlice<f32>,
        _start: usize,
        sums: GpuSlice<f32>,
        partials: GpuSlice<f32>,
    ) -> Result<f32, ModelError> {
        gpu.sum_of_squares(sums.sub(0, 1)?, block, partials)?;
        self.sum_f32(sums.sub(0, 1)?)?;
        let mut sum = [0.0f32; 2];
        gpu.download(&mut sum, sums)?;
        Ok(sum[0])
    }

    /// Sums `x` over the ranks in place (a split optimizer's loss and squared gradient norm).
    ///
    /// # Errors
    /// As [`reduce_scatter_f32`](Self::reduce_scatter_f32).
    fn sum_f32(&self, _x: GpuSlice<f32>) -> Result<(), ModelError> {
        Err(not_sharded(self.name()))
    }

    /// Fills every block of `all` (the group's size times a block) with that rank's block: the
    /// bf16 weights after each rank updated its own.
    ///
    /// # Errors
    /// As [`reduce_scatter_f32`](Self::reduce_scatter_f32).
    fn all_gather_bf16(&self, _all: GpuSlice<bf16>) -> Result<(), ModelError> {
        Err(not_sharded(self.name()))
    }

    /// Concatenates every rank's `block` in rank order into `all` (the group's size times the
    /// block): a split optimizer's master weights or moments, whole, for a checkpoint.
    ///
    /// # Errors
    /// As [`reduce_scatter_f32`](Self::reduce_scatter_f32).
    fn all_gather_f32(&self, _block: GpuSlice<f32>, _all: GpuSlice<f32>) -> Result<(), ModelError> {
        Err(not_sharded(self.name()))
    }

    /// For a trainer whose bf16 weights are split too ([`OptimizerShard::split_weights`]):
    /// `recv` on every rank becomes rank `owner`'s `send` (a piece of a unit's weights that
    /// `owner`'s block holds; `send` is read on `owner` alone).
    ///
    /// # Errors
    /// As [`reduce_scatter_f32`](Self::reduce_scatter_f32).
    fn broadcast_bf16(
        &self,
        _send: GpuSlice<bf16>,
        _recv: GpuSlice<bf16>,
        _owner: usize,
    ) -> Result<(), ModelError> {
        Err(not_sharded(self.name()))
    }

    /// For a trainer whose gradients are split too ([`OptimizerShard::split_grads`]): sums
    /// `part` (a piece of a unit's gradients that rank `owner`'s block holds) over the ranks
    /// into `owner`'s `part`, in place; the others' stay.
    ///
    /// # Errors
    /// As [`reduce_scatter_f32`](Self::reduce_scatter_f32).
    fn reduce_f32(&self, _part: GpuSlice<f32>, _owner: usize) -> Result<(), ModelError> {
        Err(not_sharded(self.name()))
    }

    /// A second communicator over the group's ranks, on a stream of its own, that sums split
    /// gradients behind the backward pass ([`OptimizerShard::reduce_behind`]); `None` where
    /// the group has none.
    fn behind(&self) -> Option<&GroupComm> {
        None
    }

    /// Called before the trainer's memory is resumed, on every rank of the group at once:
    /// brings back what [`release`](Self::release) released.
    ///
    /// # Errors
    /// [`ModelError::Gpu`] when it cannot come back (no memory, a peer gone).
    fn restore(&self) -> Result<(), ModelError> {
        Ok(())
    }
}

/// The gradients of a rank whose gradients are split over its group
/// ([`OptimizerShard::split_grads`]): each unit accumulates in `units` (the embedding's at the
/// start, a layer's or the tail's in a slot after it) and, once closed, is summed into its
/// owners' blocks over the group ([`TrainerGroup::reduce_f32`]); this rank adds the pieces it
/// owns into `own`, its block of the gradients. With `behind`, the sums run on that
/// communicator's stream while the pass goes on, the layers taking two slots in turn, and a
/// slot is zeroed for its next unit only once its last sum is done.
pub(super) struct SplitGrads<'a> {
    pub group: &'a dyn TrainerGroup,
    pub shard: OptimizerShard,
    /// The model's parameters.
    pub params: usize,
    pub own: GpuSlice<f32>,
    pub units: GpuSlice<f32>,
    /// The embedding unit's length: where the slots start in `units`.
    pub embedding: usize,
    /// A layer's parameters (every layer's alike), and the layers: a unit's index among them
    /// (the tail's being the number of layers) says its slot.
    pub layer: usize,
    pub layers: usize,
    /// The first slot's length: the larger of a layer's and the tail's. The second, where the
    /// sums run behind, holds a layer.
    pub slot: usize,
    /// The communicator and stream the sums run behind on, if they do.
    pub behind: Option<&'a GroupComm>,
    /// The sums still running behind: each with its unit's place in `units`.
    pub running: RefCell<Vec<(usize, Fence)>>,
}

impl SplitGrads<'_> {
    /// Where `unit` accumulates in `units`: the embedding (the unit starting at parameter 0)
    /// first, any other in its slot after it: the tail and every other layer from the last in
    /// the first slot, the layers between them in the second where the sums run behind.
    fn place(&self, unit: &Range<usize>) -> usize {
        if unit.start == 0 {
            return 0;
        }
        let index = (unit.start - self.embedding) / self.layer.max(1);
        let second = self.behind.is_some() && (self.layers.saturating_sub(index)) % 2 == 1;
        self.embedding + usize::from(second) * self.slot
    }

    /// Sums each piece of `unit`'s gradients (in `units` at `at`) into its owner with
    /// `reduce`, the owner adding it to its block on `stream`'s GPU.
    fn sum_into_owners(
        &self,
        unit: &Range<usize>,
        at: usize,
        stream: &Gpu,
        reduce: impl Fn(GpuSlice<f32>, usize) -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        let grads = self.units.sub(at, unit.len())?;
        let start = self.shard.start(self.params);
        for (owner, piece) in self.shard.owners(unit.clone(), self.params) {
            let part = grads.sub(piece.start - unit.start, piece.len())?;
            reduce(part, owner)?;
            if owner == self.shard.rank {
                stream.add_f32(self.own.sub(piece.start - start, piece.len())?, part)?;
            }
        }
        Ok(())
    }

    /// Makes `gpu`'s later work wait for the sums behind that read `units` at `at`, or for
    /// all of them.
    fn wait(&self, gpu: &Gpu, at: Option<usize>) -> Result<(), ModelError> {
        let mut running = self.running.borrow_mut();
        for (_, done) in running
            .iter()
            .filter(|(place, _)| at.is_none_or(|a| a == *place))
        {
            gpu.wait_for(done)?;
        }
        running.retain(|(place, _)| at.is_some_and(|a| a != *place));
        Ok(())
    }
}

/// The bf16 weights of a rank whose weights are split over its group
/// ([`OptimizerShard::split_weights`]): the edges' units gathered into `units` once (the
/// embedding's at the start, the tail's after it, [`gather_edges`](Self::gather_edges)), and
/// each layer's after them when fetched, from the ranks whose blocks hold its pieces
/// ([`TrainerGroup::broadcast_bf16`]); this rank's block is `own`. With `ahead`, the layers
/// are gathered on that communicator's stream into two slots in turn, the layer the passes
/// fetch next while the current one runs ([`LayerSlots`]).
pub(super) struct SplitWeights<'a> {
    pub group: &'a dyn TrainerGroup,
    pub shard: OptimizerShard,
    /// The model's parameters.
    pub params: usize,
    pub own: GpuSlice<bf16>,
    pub units: GpuSlice<bf16>,
    /// The edge units (`weights::edge_units`): the embedding's and the tail's.
    pub edges: [Range<usize>; 2],
    /// The first layer's unit; every layer's is as long, one after another.
    pub first_layer: Range<usize>,
    /// The layers.
    pub layers: usize,
    /// The communicator and stream the layers are gathered ahead on, if they are.
    pub ahead: Option<&'a GroupComm>,
    /// What the two slots hold, where the layers are gathered ahead, and the fence after each
    /// slot's last gather.
    pub slots: RefCell<(LayerSlots, [Option<Fence>; 2])>,
}

impl SplitWeights<'_> {
    /// Gathers the edges' weights, which stay in place for the passes. Collective.
    pub(super) fn gather_edges(&self) -> Result<(), ModelError> {
        for unit in &self.edges {
            self.gather(unit, self.edge_place(unit), |send, recv, owner| {
                self.group.broadcast_bf16(send, recv, owner)
            })?;
        }
        Ok(())
    }

    /// Where edge `unit` lies in `units`: the embedding's first, the tail's after it.
    fn edge_place(&self, unit: &Range<usize>) -> usize {
        if *unit == self.edges[0] {
            0
        } else {
            self.edges[0].len()
        }
    }

    /// Where a layer in `slot` starts in `units`: after both edges.
    fn layer_at(&self, slot: usize) -> usize {
        self.edges[0].len() + self.edges[1].len() + slot * self.first_layer.len()
    }

    /// The layer in `slot`.
    fn layer_place(&self, slot: usize) -> Result<GpuSlice<bf16>, ModelError> {
        Ok(self
            .units
            .sub(self.layer_at(slot), self.first_layer.len())?)
    }

    /// `unit`'s weights into `units` at `at`, a piece from each rank whose block holds one,
    /// each moved by `broadcast(send, recv, owner)`.
    fn gather(
        &self,
        unit: &Range<usize>,
        at: usize,
        broadcast: impl Fn(GpuSlice<bf16>, GpuSlice<bf16>, usize) -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        let into = self.units.sub(at, unit.len())?;
        let start = self.shard.start(self.params);
        for (owner, piece) in self.shard.owners(unit.clone(), self.params) {
            let recv = into.sub(piece.start - unit.start, piece.len())?;
            let send = if owner == self.shard.rank {
                self.own.sub(piece.start - start, piece.len())?
            } else {
                recv
            };
            broadcast(send, recv, owner)?;
        }
        Ok(())
    }

    /// Layer `l` into its slot on `ahead`'s stream, once `gpu`'s work queued so far (the
    /// slot's last reader among it) is done; the slot's fence then follows the gather.
    fn gather_ahead(
        &self,
        gpu: &Gpu,
        ahead: &GroupComm,
        l: usize,
        fences: &mut [Option<Fence>; 2],
    ) -> Result<(), ModelError> {
        let len = self.first_layer.len();
        let unit = self.first_layer.start + l * len..self.first_layer.end + l * len;
        let stream = ahead.gpu();
        stream.wait_for(&gpu.record_fence()?)?;
        let comm = ahead.lock();
        let queued = self.gather(&unit, self.layer_at(l % 2), |send, recv, owner| {
            Ok(comm.broadcast_bf16(send, recv, owner)?)
        });
        // Whatever was queued, the slot is read only after it.
        fences[l % 2] = Some(stream.record_fence()?);
        queued
    }

    /// Layer `l`'s slot where the layers are gathered ahead on `ahead`: gathered now if no
    /// slot holds it, the next layer gathered behind it.
    fn fetch_ahead(
        &self,
        gpu: &Gpu,
        ahead: &GroupComm,
        l: usize,
    ) -> Result<GpuSlice<bf16>, ModelError> {
        let mut slots = self.slots.borrow_mut();
        let (plan, fences) = &mut *slots;
        let (now, next) = plan.fetch(l, self.layers);
        if now {
            self.gather_ahead(gpu, ahead, l, fences)?;
        }
        if let Some(fence) = &fences[l % 2] {
            gpu.wait_for(fence)?;
        }
        if let Some(next) = next {
            self.gather_ahead(gpu, ahead, next, fences)?;
        }
        self.layer_place(l % 2)
    }
}

impl WeightUnits for SplitWeights<'_> {
    fn fetch(&self, gpu: &Gpu, unit: Range<usize>) -> Result<GpuSlice<bf16>, ModelError> {
        if self.edges.contains(&unit) {
            return Ok(self.units.sub(self.edge_place(&unit), unit.len())?);
        }
        let l = (unit.start - self.first_layer.start) / self.first_layer.len().max(1);
        if let Some(ahead) = self.ahead {
            return self.fetch_ahead(gpu, ahead, l);
        }
        self.gather(&unit, self.layer_at(0), |send, recv, owner| {
            self.group.broadcast_bf16(send, recv, owner)
        })?;
        self.layer_place(0)
    }
}

/// Which layers the two slots of weights gathered ahead hold (layer `l` in slot `l % 2`), and
/// which way the passes walk the layers: up in a forward pass, down in a backward one, turning
/// where a layer is fetched twice in a row (the last layer between a forward and its backward
/// pass, the first between a backward and the next forward). The trainer starts a new one for
/// every pass, a micro-batch's or one without a batch, so that every rank gathers the same
/// layers in the same order whatever passes it runs.
#[derive(Debug, Default)]
pub(super) struct LayerSlots {
    held: [Option<usize>; 2],
    last: Option<usize>,
    down: bool,
}

impl LayerSlots {
    /// For a fetch of layer `l` of `layers`: whether to gather it first (no slot holds it),
    /// and the layer to gather ahead, the next the passes fetch where no slot holds it (none
    /// at either end, where the passes turn and fetch `l` again). Both are held from then on.
    pub(super) fn fetch(&mut self, l: usize, layers: usize) -> (bool, Option<usize>) {
        self.down = match self.last {
            Some(p) if p == l => !self.down,
            Some(p) if p == l + 1 => true,
            Some(p) if p + 1 == l => false,
            Some(_) => self.down,
            None => false,
        };
        self.last = Some(l);
        let now = self.held[l % 2] != Some(l);
        self.held[l % 2] = Some(l);
        let next = if self.down {
            l.checked_sub(1)
        } else {
            Some(l + 1).filter(|&n| n < layers)
        };
        let ahead = next.filter(|&n| self.held[n % 2] != Some(n));
        if let Some(n) = ahead {
            self.held[n % 2] = Some(n);
        }
        (now, ahead)
    }
}

impl GradUnits for SplitGrads<'_> {
    /// A unit's buffer is zeroed as it opens (its pass's sums go out from it), so the kernels
    /// add.
    fn write(&self) -> GradWrite {
        GradWrite::Add
    }

    fn open(&self, gpu: &Gpu, unit: Range<usize>) -> Result<GpuSlice<f32>, ModelError> {
        let at = self.place(&unit);
        self.wait(gpu, Some(at))?;
        let grads = self.units.sub(at, unit.len())?;
        gpu.zero(grads)?;
        Ok(grads)
    }

    fn close(&self, gpu: &Gpu, unit: Range<usize>) -> Result<(), ModelError> {
        let at = self.place(&unit);
        let Some(behind) = self.behind else {
            return self.sum_into_owners(&unit, at, gpu, |part, owner| {
                self.group.reduce_f32(part, owner)
            });
        };
        // The unit's gradients are done on the trainer's stream; its sums go behind.
        let stream = behind.gpu();
        stream.wait_for(&gpu.record_fence()?)?;
        let comm = behind.lock();
        let queued = self.sum_into_owners(&unit, at, stream, |part, owner| {
            Ok(comm.reduce_sum(part, owner)?)
        });
        // Whatever was queued, the slot is free again only after it.
        self.running.borrow_mut().push((at, stream.record_fence()?));
        queued
    }

    fn finish(&self, gpu: &Gpu) -> Result<(), ModelError> {
        self.wait(gpu, None)
    }
}

/// The error of a group asked for a split optimizer's collectives it does not run.
fn not_sharded(group: &str) -> ModelError {
    ModelError::Config(format!(
        "a {group}-parallel group does not split the optimizer state over its ranks; build the trainer with OptimizerShard::WHOLE"
    ))
}

/// Which block of the optimizer state (fp32 master weights and AdamW moments) a trainer keeps:
/// rank `rank` of `ranks` keeps the parameters from `rank * block` on, `block` of them (the last
/// block padded with zeros that stay zero). The gradients and bf16 weights are padded to
/// `ranks * block` elements so that a collective can move whole blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OptimizerShard {
    /// This rank.
    pub rank: usize,
    /// Ranks the state is split over.
    pub ranks: usize,
    /// The gradients are reduce-scattered in bf16 (`--grad-reduce-in-bf16`), not fp32: each
    /// rank's fp32 gradients rounded to bf16, summed over the ranks in bf16, the block widened
    /// back to fp32 for the optimizer step.
    pub bf16_reduce: bool,
    /// The gradients are split too (ZeRO stage 2, as FSDP shards them): each unit's gradients
    /// (a layer's; the embedding's; the final norm's and an untied head's) accumulate in a
    /// unit buffer during the backward pass and are summed into their owners' blocks as soon
    /// as the unit is done, so a rank holds its block of the gradients and a unit's, not all
    /// of them. Not with `bf16_reduce`.
    pub split_grads: bool,
    /// The bf16 weights are split too (ZeRO stage 3, FSDP's full sharding): a rank keeps its
    /// block of them; the edges' weights (embedding, final norm, untied head) are gathered
    /// into a unit buffer at the start of a step's passes and each layer's just before it
    /// runs, forward and backward. Needs `split_grads`.
    pub split_weights: bool,
    /// Split gradients are summed behind the backward pass (`--overlap-grad-reduce`): each
    /// unit's sums run on the group's second communicator and stream
    /// ([`TrainerGroup::behind`]) while the next layers' gradients are computed, the layers
    /// alternating between two slots of the unit buffer. With `split_weights`, the layers'
    /// gathers run there too, each a layer ahead of the pass, into two slots in turn
    /// ([`SplitWeights`]). Needs `split_grads`.
    pub reduce_behind: bool,
}

/// A block is a multiple of this many elements, so that every block of bf16 or fp32 elements
/// starts 256-byte aligned.
const BLOCK_ALIGN: usize = 128;

impl OptimizerShard {
    /// The whole state on one rank.
    pub const WHOLE: OptimizerShard = OptimizerShard::split(0, 1);

    /// Rank `rank`'s block of a state split over `ranks`, reduced in fp32.
    pub const fn split(rank: usize, ranks: usize) -> OptimizerShard {
        OptimizerShard {
            rank,
            ranks,
            bf16_reduce: false,
            split_grads: false,
            split_weights: false,
            reduce_behind: false,
        }
    }

    /// Whether the state is split over more than one rank.
    pub fn is_split(&self) -> bool {
        self.ranks > 1
    }

    /// Elements of one rank's block of `params` parameters.
    pub fn block(&self, params: usize) -> usize {
        if self.is_split() {
            params.div_ceil(self.ranks).next_multiple_of(BLOCK_ALIGN)
        } else {
            params
        }
    }

    /// The first parameter of this rank's block.
    pub fn start(&self, params: usize) -> usize {
        self.rank * self.block(params)
    }

    /// Elements of the padded gradients and bf16 weights: every rank's block.
    pub fn padded(&self, params: usize) -> usize {
        self.ranks * self.block(params)
    }

    /// An error naming what this split cannot do: weights split without the gradients,
    /// sums behind the pass without split gradients, split gradients over one rank or
    /// reduced in bf16.
    ///
    /// # Errors
    /// [`ModelError::Config`].
    pub fn check(&self) -> Result<(), ModelError> {
        let refused = if self.split_weights && !self.split_grads {
            "bf16 weights split over a data-parallel group need the gradients split too (OptimizerShard::split_grads)"
        } else if self.reduce_behind && !self.split_grads {
            "gradients summed behind the backward pass (--overlap-grad-reduce) need them split (OptimizerShard::split_grads)"
        } else if self.split_grads && (!self.is_split() || self.bf16_reduce) {
            "gradients split over a data-parallel group need the optimizer state split over more than one rank and reduced in fp32; drop --grad-reduce-in-bf16"
        } else {
            return Ok(());
        };
        Err(ModelError::Config(refused.into()))
    }

    /// The pieces of `range` (of `params` parameters) each rank's block holds, in order: the
    /// owner and its piece, in the parameters' numbering.
    pub fn owners(
        &self,
        range: Range<usize>,
        params: usize,
    ) -> impl Iterator<Item = (usize, Range<usize>)> {
        let block = self.block(params);
        (range.start / block.max(1)..self.ranks)
            .map(move |owner| {
                let piece = range.start.max(owner * block)..range.end.min((owner + 1) * block);
                (owner, piece)
            })
            .take_while(|(_, piece)| !piece.is_empty())
    }

    /// This rank's block of `full` (the whole parameter vector), zero-padded to a block:
    /// `full` itself when the state is whole.
    pub fn block_of<'a>(&self, full: &'a [f32]) -> Cow<'a, [f32]> {
        if !self.is_split() {
            return Cow::Borrowed(full);
        }
        let (start, block) = (self.start(full.len()), self.block(full.len()));
        let mut out = vec![0.0; block];
        let end = full.len().min(start + block);
        if start < end {
            out[..end - start].copy_from_slice(&full[start..end]);
        }
        Cow::Owned(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_a_trainer_cannot_run_are_refused_naming_why() {
        let stage_1 = OptimizerShard::split(0, 2);
        let stage_2 = OptimizerShard {
            split_grads: true,
            ..stage_1
        };
        let stage_3 = OptimizerShard {
            split_weights: true,
            ..stage_2
        };
        let behind = OptimizerShard {
            reduce_behind: true,
            ..stage_2
        };
        let stage_3_ahead = OptimizerShard {
            reduce_behind: true,
            ..stage_3
        };
        for ok in [
            OptimizerShard::WHOLE,
            stage_1,
            stage_2,
            stage_3,
            behind,
            stage_3_ahead,
        ] {
            ok.check().unwrap();
        }
        for (bad, why) in [
            (
                OptimizerShard {
                    split_weights: true,
                    ..stage_1
                },
                "need the gradients split too",
            ),
            (
                OptimizerShard {
                    reduce_behind: true,
                    ..stage_1
                },
                "--overlap-grad-reduce",
            ),
            (
                OptimizerShard {
                    bf16_reduce: true,
                    ..stage_2
                },
                "--grad-reduce-in-bf16",
            ),
            (
                OptimizerShard {
                    split_grads: true,
                    ..OptimizerShard::WHOLE
                },
                "more than one rank",
            ),
        ] {
            let err = bad.check().unwrap_err().to_string();
            assert!(err.contains(why), "{bad:?}: {err}");
        }
    }

    #[test]
    fn layers_gathered_ahead_follow_the_passes_up_and_down_and_reuse_what_a_slot_holds() {
        let mut slots = LayerSlots::default();
        let layers = 4;
        let mut fetch = |l| slots.fetch(l, layers);
        // A forward pass: the first layer gathered now, each next one ahead, none past the top.
        assert_eq!(fetch(0), (true, Some(1)));
        assert_eq!(fetch(1), (false, Some(2)));
        assert_eq!(fetch(2), (false, Some(3)));
        assert_eq!(fetch(3), (false, None));
        // Its backward pass: the top two layers are still in their slots.
        assert_eq!(fetch(3), (false, None));
        assert_eq!(fetch(2), (false, Some(1)));
        assert_eq!(fetch(1), (false, Some(0)));
        assert_eq!(fetch(0), (false, None));
        // The next forward pass turns at the bottom, its first two layers still held.
        assert_eq!(fetch(0), (false, None));
        assert_eq!(fetch(1), (false, Some(2)));
        // A forward pass after another (scoring): the first layer's slot holds layer 2.
        assert_eq!(fetch(2), (false, Some(3)));
        assert_eq!(fetch(3), (false, None));
        assert_eq!(fetch(0), (true, Some(1)));
        // One layer: always held after the first fetch, nothing ahead.
        let mut one = LayerSlots::default();
        assert_eq!(one.fetch(0, 1), (true, None));
        assert_eq!(one.fetch(0, 1), (false, None));
    }

    #[test]
    fn owners_cut_a_range_at_the_blocks_it_crosses() {
        let n = 1000;
        let shard = OptimizerShard::split(1, 3); // blocks of 384
        let pieces = |r: Range<usize>| shard.owners(r, n).collect::<Vec<_>>();
        assert_eq!(pieces(10..20), [(0, 10..20)]);
        assert_eq!(pieces(380..390), [(0, 380..384), (1, 384..390)]);
        assert_eq!(pieces(0..n), [(0, 0..384), (1, 384..768), (2, 768..n)]);
        assert_eq!(pieces(768..n), [(2, 768..n)]);
        assert_eq!(pieces(5..5), []);
        for start in (0..n).step_by(37) {
            for end in (start + 1..=n).step_by(53) {
                let got = pieces(start..end);
                let covered: Vec<usize> = got.iter().flat_map(|(_, p)| p.clone()).collect();
                assert_eq!(covered, (start..end).collect::<Vec<_>>(), "{start}..{end}");
                for (owner, piece) in got {
                    let own = shard.block(n) * owner..shard.block(n) * (owner + 1);
                    assert!(own.contains(&piece.start) && own.contains(&(piece.end - 1)));
                }
            }
        }
        let whole = OptimizerShard::WHOLE;
        assert_eq!(whole.owners(3..9, 10).collect::<Vec<_>>(), [(0, 3..9)]);
    }

    #[test]
    fn blocks_cover_every_parameter_once_aligned_and_padded_with_zeros() {
        let full: Vec<f32> = (0..1000).map(|i| i as f32 + 1.0).collect();
        let whole = OptimizerShard::WHOLE;
        assert_eq!(
            (whole.block(1000), whole.start(1000), whole.padded(1000)),
            (1000, 0, 1000)
        );
        assert_eq!(*whole.block_of(&full), full[..]);
        for ranks in [2, 3, 8, 16] {
            let blocks: Vec<Vec<f32>> = (0..ranks)
                .map(|rank| {
                    OptimizerShard::split(rank, ranks)
                        .block_of(&full)
                        .into_owned()
                })
                .collect();
            let shard = OptimizerShard::split(0, ranks);
            assert_eq!(shard.block(1000) % BLOCK_ALIGN, 0);
            assert_eq!(shard.padded(1000), ranks * shard.block(1000));
            let joined: Vec<f32> = blocks.concat();
            assert_eq!(joined.len(), shard.padded(1000));
            assert_eq!(&joined[..1000], &full[..], "{ranks} ranks");
            assert!(joined[1000..].iter().all(|&x| x == 0.0), "{ranks} ranks");
        }
    }
}
