//! Views of the flat parameter (bf16) and gradient (fp32) buffers on the device, cut by the
//! same [`ParamLayout`] as the CPU's fp32 buffers; where the passes find the weights
//! ([`WeightUnits`]) and where the backward pass accumulates the gradients ([`GradUnits`]):
//! the whole flat buffers, or unit by unit.

use std::ops::Range;

use half::bf16;

use crate::device::{DeviceError, Gpu, GpuElement, GpuSlice};
use crate::model::{ModelError, ParamKind, ParamLayout};
use crate::ops::gpu::GradWrite;

/// Where the backward pass puts the weight gradients, a unit at a time: a unit is a range of
/// the flat parameters (a layer's, the embedding's, the final norm's with an untied head's),
/// opened before its gradients are computed and closed once they are complete for the pass.
/// At most two units are open at once (the edges' at the start).
pub trait GradUnits {
    /// How the pass puts the gradients of every unit it opens: [`GradWrite::Add`] to what they
    /// hold (`+=`), or [`GradWrite::Overwrite`] where they hold nothing of the step yet (the
    /// pass then writes every parameter of each unit, so they need no zeroing first).
    fn write(&self) -> GradWrite;

    /// Where the gradients of `unit` accumulate: `unit.len()` elements laid out as the flat
    /// buffer's `unit`.
    ///
    /// # Errors
    /// [`ModelError::Gpu`].
    fn open(&self, gpu: &Gpu, unit: Range<usize>) -> Result<GpuSlice<f32>, ModelError>;

    /// The pass's gradients of `unit` are all there.
    ///
    /// # Errors
    /// [`ModelError::Gpu`].
    fn close(&self, gpu: &Gpu, unit: Range<usize>) -> Result<(), ModelError>;

    /// Makes `gpu`'s later work wait for whatever the closes left running beside it (sums
    /// behind the pass); called after each pass.
    ///
    /// # Errors
    /// [`ModelError::Gpu`].
    fn finish(&self, _gpu: &Gpu) -> Result<(), ModelError> {
        Ok(())
    }
}

/// Where the passes find the bf16 weights, a unit at a time (a unit as for [`GradUnits`]): each
/// pass fetches the embedding's unit, each layer's in order (the backward pass in reverse
/// order), and the tail's.
pub trait WeightUnits {
    /// The weights of `unit`, laid out as the flat buffer's `unit`, valid until the next fetch
    /// of another layer. Where the weights are split over a group, a layer's are gathered
    /// first: every rank fetches the same layers in the same order.
    ///
    /// # Errors
    /// [`ModelError::Gpu`].
    fn fetch(&self, gpu: &Gpu, unit: Range<usize>) -> Result<GpuSlice<bf16>, ModelError>;
}

/// The weights in one flat buffer laid out as the whole model.
pub struct WholeWeights(pub GpuSlice<bf16>);

impl WeightUnits for WholeWeights {
    fn fetch(&self, _gpu: &Gpu, unit: Range<usize>) -> Result<GpuSlice<bf16>, ModelError> {
        Ok(self.0.sub(unit.start, unit.len())?)
    }
}

/// The gradients in one flat buffer laid out as the whole model: written by a step's first
/// pass, added to by the rest.
pub struct WholeGrads {
    /// The flat fp32 gradients, `ParamLayout::len` of them.
    pub grads: GpuSlice<f32>,
    /// Whether the pass writes them (a step's first) or adds to them.
    pub write: GradWrite,
}

impl GradUnits for WholeGrads {
    fn write(&self) -> GradWrite {
        self.write
    }

    fn open(&self, _gpu: &Gpu, unit: Range<usize>) -> Result<GpuSlice<f32>, ModelError> {
        Ok(self.grads.sub(unit.start, unit.len())?)
    }

    fn close(&self, _gpu: &Gpu, _unit: Range<usize>) -> Result<(), ModelError> {
        Ok(())
    }
}

/// The units of the backward pass whose gradients are computed first and last: the embedding
/// (and a tied head), and the final norm with an untied head.
pub(crate) fn edge_units(layout: &ParamLayout) -> [Range<usize>; 2] {
    let embedding = layout.range(ParamKind::Embedding, 0);
    let tail = layout.range(ParamKind::FinalNorm, 0).start..layout.len();
    [embedding, tail]
}

/// The edges' tensors (embedding, final norm, head) in the buffers of the two edge units
/// ([`edge_units`]).
pub(super) struct Edges<T> {
    pub units: [Range<usize>; 2],
    pub bufs: [GpuSlice<T>; 2],
}

impl<T: GpuElement> Edges<T> {
    /// Tensor `kind` (a whole-model kind), in whichever unit holds it.
    pub(super) fn tensor(
        &self,
        layout: &ParamLayout,
        kind: ParamKind,
    ) -> Result<GpuSlice<T>, DeviceError> {
        let at = usize::from(layout.range(kind, 0).start >= self.units[1].start);
        tensor_in(layout, self.bufs[at], self.units[at].start, kind, 0)
    }
}

/// Tensor `kind` of `layer` (ignored for whole-model kinds) in `unit`, a buffer holding the
/// flat parameters from `base` on; the LM head of a tied model is the embedding.
pub(super) fn tensor_in<T: GpuElement>(
    layout: &ParamLayout,
    unit: GpuSlice<T>,
    base: usize,
    kind: ParamKind,
    layer: usize,
) -> Result<GpuSlice<T>, DeviceError> {
    let r = layout.range(kind, layer);
    let start = r
        .start
        .checked_sub(base)
        .ok_or(DeviceError::ShapeMismatch {
            what: "unit holding a tensor (its first parameter)",
            expected: base,
            actual: r.start,
        })?;
    unit.sub(start, r.len())
}

/// The tensors of one decoder layer in a flat buffer (weights or their gradients): the nine of
/// every model, and the biases and q/k norms of the families that have them.
pub(super) struct LayerTensors<T> {
    pub input_norm: GpuSlice<T>, // (C)
    pub q: GpuSlice<T>,          // (H*D, C)
    pub k: GpuSlice<T>,          // (K*D, C)
    pub v: GpuSlice<T>,          // (K*D, C)
    pub o: GpuSlice<T>,          // (C, H*D)
    pub post_norm: GpuSlice<T>,  // (C)
    pub gate: GpuSlice<T>,       // (F, C)
    pub up: GpuSlice<T>,         // (F, C)
    pub down: GpuSlice<T>,       // (C, F)
    /// The q `(H*D)`, k and v `(K*D)` biases.
    pub qkv_bias: Option<[GpuSlice<T>; 3]>,
    /// The per-head q and k norm weights `(D)`.
    pub qk_norm: Option<[GpuSlice<T>; 2]>,
}

impl<T: GpuElement> LayerTensors<T> {
    /// Layer `l`'s tensors in `unit`, a buffer holding the flat parameters from `base` on.
    pub(super) fn in_unit(
        layout: &ParamLayout,
        unit: GpuSlice<T>,
        base: usize,
        l: usize,
    ) -> Result<LayerTensors<T>, DeviceError> {
        let t = |kind| tensor_in(layout, unit, base, kind, l);
        let has = |kind| layout.get(kind, l).is_some();
        let qkv_bias = if has(ParamKind::QBias) {
            Some([
                t(ParamKind::QBias)?,
                t(ParamKind::KBias)?,
                t(ParamKind::VBias)?,
            ])
        } else {
            None
        };
        let qk_norm = if has(ParamKind::QNorm) {
            Some([t(ParamKind::QNorm)?, t(ParamKind::KNorm)?])
        } else {
            None
        };
        Ok(LayerTensors {
            qkv_bias,
            qk_norm,
            input_norm: t(ParamKind::InputNorm)?,
            q: t(ParamKind::QProj)?,
            k: t(ParamKind::KProj)?,
            v: t(ParamKind::VProj)?,
            o: t(ParamKind::OProj)?,
            post_norm: t(ParamKind::PostAttentionNorm)?,
            gate: t(ParamKind::GateProj)?,
            up: t(ParamKind::UpProj)?,
            down: t(ParamKind::DownProj)?,
        })
    }
}
