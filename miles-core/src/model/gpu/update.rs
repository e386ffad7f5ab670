//! The optimizer step beside the passes. Where the AdamW state is resident and whole, the
//! trainer keeps a stream of its own for it. Alone (in no group), the last backward pass of a
//! step sums the squares of each unit's gradients there as soon as the unit's are complete
//! ([`SquaredGrads`], the global norm's sum); and the trainer queues the step's update there a
//! unit at a time ([`update_units`]: the embedding, each layer, the tail) and returns; the
//! next step's forward pass fetches its weights through [`UpdatingWeights`], which makes the
//! trainer's stream wait for the update of each unit it reads, so the products of the first
//! layers run while the last layers are still updated. The update is memory-bound and the forward pass mostly
//! compute-bound, so the two share the GPU; the update's stream has the least priority
//! (`Gpu::with_background_stream`), so its blocks fill what the pass's leave rather than hold
//! the pass's products back. cuBLAS's products fill every multiprocessor for their whole run,
//! so while an update is queued the forward pass's products leave [`SPARE_FOR_UPDATE`] of
//! them to it.

use std::ops::Range;
use std::sync::Arc;

use half::bf16;

use super::weights::{GradUnits, WeightUnits, edge_units};
use crate::device::{DeviceError, Fence, Gpu, GpuSlice};
use crate::model::{ModelError, ParamLayout};
use crate::ops::gpu::{AdamWStep, GpuMoments, GradWrite};

/// Multiprocessors the forward pass's products leave to the update queued behind them
/// (cuBLAS's SM count target, [`Gpu::spare_multiprocessors`]). On an H100 (132 of them,
/// `bench/RESULTS.md` round 50) 16 made a step 0.9-1.4% faster at 8 x 512, 2 x 2048 and
/// 1 x 4096; 8 made no difference, 24 gained less or lost, 32 and 48 made it slower.
pub(super) const SPARE_FOR_UPDATE: usize = 16;

/// What an AdamW step reads and writes, each laid out as the whole model.
pub(super) struct AdamWBuffers {
    pub master: GpuSlice<f32>,
    pub params: GpuSlice<bf16>,
    pub m: GpuSlice<f32>,
    pub v: GpuSlice<f32>,
    pub grads: GpuSlice<f32>,
}

/// An AdamW step queued on a stream of its own, unit by unit: a fence after each unit's
/// update, in the order they were queued, and one after what the stream queued behind them.
pub(super) struct Update {
    stream: Arc<Gpu>,
    units: Vec<(Range<usize>, Fence)>,
    after: Option<Fence>,
}

impl Update {
    /// Queues AdamW step `s` over `buffers` on `stream`, unit by unit ([`update_units`] of
    /// `layout`, a model of `layers` layers), once the work queued on `trainer` so far is done.
    /// Every unit's views are cut before anything is queued, so a bad length updates nothing.
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`] for buffers shorter than the layout; the driver's error.
    pub(super) fn queue(
        stream: Arc<Gpu>,
        trainer: &Gpu,
        (layout, layers): (&ParamLayout, usize),
        buffers: &AdamWBuffers,
        s: AdamWStep,
    ) -> Result<Update, DeviceError> {
        let units = update_units(layout, layers);
        let views = units
            .iter()
            .map(|unit| {
                let (at, len) = (unit.start, unit.len());
                let b = buffers;
                Ok((
                    b.master.sub(at, len)?,
                    b.params.sub(at, len)?,
                    GpuMoments::Fp32(b.m.sub(at, len)?, b.v.sub(at, len)?),
                    b.grads.sub(at, len)?,
                ))
            })
            .collect::<Result<Vec<_>, DeviceError>>()?;
        stream.wait_for(&trainer.record_fence()?)?;
        let mut fenced = Vec::with_capacity(units.len());
        for (unit, (master, params, moments, grads)) in units.into_iter().zip(views) {
            stream.adamw_update(master, params, moments, grads, s)?;
            fenced.push((unit, stream.record_fence()?));
        }
        Ok(Update {
            stream,
            units: fenced,
            after: None,
        })
    }

    /// Zeroes `grads` (which the update reads) behind the update, once the work queued on
    /// `trainer` so far is done too; [`wait_all`](Self::wait_all) covers it.
    ///
    /// # Errors
    /// The driver's error.
    pub(super) fn zero_behind(
        &mut self,
        trainer: &Gpu,
        grads: GpuSlice<f32>,
    ) -> Result<(), DeviceError> {
        self.stream.wait_for(&trainer.record_fence()?)?;
        self.stream.zero(grads)?;
        self.after = Some(self.stream.record_fence()?);
        Ok(())
    }

    /// Makes `gpu`'s later work wait for the whole update and what was queued behind it.
    ///
    /// # Errors
    /// The driver's error.
    pub(super) fn wait_all(&self, gpu: &Gpu) -> Result<(), DeviceError> {
        // One stream queued it all in order: its last fence covers the rest.
        let last = self
            .after
            .as_ref()
            .or(self.units.last().map(|(_, fence)| fence));
        last.map_or(Ok(()), |fence| gpu.wait_for(fence))
    }

    /// A fence after the update and after the work queued on `trainer` so far, without
    /// making `trainer` wait: a buffer's last use while the update may still run.
    ///
    /// # Errors
    /// The driver's error.
    pub(super) fn fence_with(&self, trainer: &Gpu) -> Result<Fence, DeviceError> {
        self.stream.wait_for(&trainer.record_fence()?)?;
        self.stream.record_fence()
    }
}

/// The whole flat buffer of bf16 weights while an [`Update`] writes it: a fetch makes the
/// pass wait for the update of the units it reads.
pub(super) struct UpdatingWeights<'a> {
    pub whole: GpuSlice<bf16>,
    pub update: &'a Update,
}

impl WeightUnits for UpdatingWeights<'_> {
    fn fetch(&self, gpu: &Gpu, unit: Range<usize>) -> Result<GpuSlice<bf16>, ModelError> {
        for (updated, fence) in &self.update.units {
            if updated.start < unit.end && unit.start < updated.end {
                gpu.wait_for(fence)?;
            }
        }
        Ok(self.whole.sub(unit.start, unit.len())?)
    }
}

/// The whole flat fp32 gradient buffer in a step's last backward pass: as each unit's
/// gradients are complete, the sum of their squares is added to `sum` on `stream`, behind the
/// pass, in the order of [`backward_units`] (which a sum without this follows for the same
/// bits).
pub(super) struct SquaredGrads<'a> {
    pub whole: GpuSlice<f32>,
    pub stream: &'a Gpu,
    /// One element, zeroed before the pass.
    pub sum: GpuSlice<f32>,
    /// `ops::gpu::SQUARE_PARTIALS` elements of scratch.
    pub partials: GpuSlice<f32>,
    /// As [`WholeGrads::write`](super::weights::WholeGrads).
    pub write: GradWrite,
}

impl GradUnits for SquaredGrads<'_> {
    fn write(&self) -> GradWrite {
        self.write
    }

    fn open(&self, _gpu: &Gpu, unit: Range<usize>) -> Result<GpuSlice<f32>, ModelError> {
        Ok(self.whole.sub(unit.start, unit.len())?)
    }

    fn close(&self, gpu: &Gpu, unit: Range<usize>) -> Result<(), ModelError> {
        let grads = self.whole.sub(unit.start, unit.len())?;
        self.stream.wait_for(&gpu.record_fence()?)?;
        Ok(self.stream.sum_of_squares(self.sum, grads, self.partials)?)
    }

    fn finish(&self, gpu: &Gpu) -> Result<(), ModelError> {
        Ok(gpu.wait_for(&self.stream.record_fence()?)?)
    }
}

/// The units a backward pass completes the gradients of, in its order: the tail, each layer
/// from the last, the embedding (a tied head's with it) at the end.
pub(super) fn backward_units(layout: &ParamLayout, layers: usize) -> Vec<Range<usize>> {
    let mut units = update_units(layout, layers);
    units.reverse();
    units
}

/// The units an update runs through, in the order a forward pass reads them: the embedding,
/// each of the `layers` layers, and the tail (final norm and an untied head). Together they
/// cover the layout.
fn update_units(layout: &ParamLayout, layers: usize) -> Vec<Range<usize>> {
    let [embedding, tail] = edge_units(layout);
    let layers = (0..layers).map(|l| layout.layer_range(l));
    std::iter::once(embedding)
        .chain(layers)
        .chain([tail])
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ParamKind;
    use crate::model::gpu::testing::{tiny, tiny_family};

    #[test]
    fn update_units_cover_the_layout_in_order_embedding_first_and_tail_last() {
        // Tied (llama) and untied (qwen3) heads.
        for config in [tiny(), tiny_family("qwen3")] {
            let layout = ParamLayout::new(&config);
            let units = update_units(&layout, config.num_layers);
            assert_eq!(units.len(), config.num_layers + 2);
            assert_eq!(units[0], layout.range(ParamKind::Embedding, 0));
            assert_eq!(units[0].start, 0);
            assert_eq!(units[1], layout.layer_range(0));
            assert_eq!(units.last().map(|u| u.end), Some(layout.len()));
            for pair in units.windows(2) {
                assert_eq!(pair[0].end, pair[1].start, "{units:?}");
            }
        }
    }
}
