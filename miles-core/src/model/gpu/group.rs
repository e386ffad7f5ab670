//! The seam between the single-GPU trainer and a parallel group it is one rank of: the trainer
//! calls a [`TrainerGroup`] at the four points where ranks must agree, and the backends that
//! name a parallel layout implement it (Megatron's tensor-parallel group in `miles-megatron`,
//! the data-parallel group in `miles-fsdp`).

use std::sync::Arc;

use half::bf16;

use crate::device::{Gpu, GpuSlice};
use crate::model::ModelError;

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

    /// The GPU whose stream the group's collectives run on: the trainer's own.
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

    /// Called before the trainer's memory is resumed, on every rank of the group at once:
    /// brings back what [`release`](Self::release) released.
    ///
    /// # Errors
    /// [`ModelError::Gpu`] when it cannot come back (no memory, a peer gone).
    fn restore(&self) -> Result<(), ModelError> {
        Ok(())
    }
}
