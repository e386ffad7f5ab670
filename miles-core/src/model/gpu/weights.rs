//! Views of the flat parameter (bf16) and gradient (fp32) buffers on the device, cut by the
//! same [`ParamLayout`] as the CPU's fp32 buffers.

use crate::device::{DeviceError, GpuElement, GpuSlice};
use crate::model::{ParamKind, ParamLayout};

/// Tensor `kind` of `layer` (ignored for whole-model kinds) in `buf`; the LM head of a tied
/// model is the embedding.
pub(super) fn tensor<T: GpuElement>(
    layout: &ParamLayout,
    buf: GpuSlice<T>,
    kind: ParamKind,
    layer: usize,
) -> Result<GpuSlice<T>, DeviceError> {
    let r = layout.range(kind, layer);
    buf.sub(r.start, r.end - r.start)
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
    /// Layer `l`'s tensors in `buf`.
    pub(super) fn of(
        layout: &ParamLayout,
        buf: GpuSlice<T>,
        l: usize,
    ) -> Result<LayerTensors<T>, DeviceError> {
        let t = |kind| tensor(layout, buf, kind, l);
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
