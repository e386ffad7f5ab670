//! Where every tensor lives in the model's flat buffers: one table for the parameters (with their
//! Hugging Face names), one for the activations.
//!
//! Parameters, gradients and both AdamW moments share [`ParamLayout`]; a whole-model operation
//! (zero, update, offload) is one loop or one copy over a flat buffer.

use std::ops::Range;

use super::{LlamaConfig, ModelError};

/// The kinds of parameter tensor, in the order they sit in a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ParamKind {
    /// `model.embed_tokens.weight` `(V, C)`.
    Embedding,
    /// `model.layers.{i}.input_layernorm.weight` `(C)`.
    InputNorm,
    /// `model.layers.{i}.self_attn.q_proj.weight` `(H*D, C)`.
    QProj,
    /// `model.layers.{i}.self_attn.k_proj.weight` `(K*D, C)`.
    KProj,
    /// `model.layers.{i}.self_attn.v_proj.weight` `(K*D, C)`.
    VProj,
    /// `model.layers.{i}.self_attn.o_proj.weight` `(C, H*D)`.
    OProj,
    /// `model.layers.{i}.self_attn.q_proj.bias` `(H*D)`, when the config has q/k/v biases.
    QBias,
    /// `model.layers.{i}.self_attn.k_proj.bias` `(K*D)`, when the config has q/k/v biases.
    KBias,
    /// `model.layers.{i}.self_attn.v_proj.bias` `(K*D)`, when the config has q/k/v biases.
    VBias,
    /// `model.layers.{i}.self_attn.q_norm.weight` `(D)`, when the config has q/k norms.
    QNorm,
    /// `model.layers.{i}.self_attn.k_norm.weight` `(D)`, when the config has q/k norms.
    KNorm,
    /// `model.layers.{i}.post_attention_layernorm.weight` `(C)`.
    PostAttentionNorm,
    /// `model.layers.{i}.mlp.gate_proj.weight` `(F, C)`.
    GateProj,
    /// `model.layers.{i}.mlp.up_proj.weight` `(F, C)`.
    UpProj,
    /// `model.layers.{i}.mlp.down_proj.weight` `(C, F)`.
    DownProj,
    /// `model.norm.weight` `(C)`.
    FinalNorm,
    /// `lm_head.weight` `(V, C)`, only when the embeddings are not tied.
    LmHead,
}

/// Per-layer kinds of `config`, in storage order: the nine of every model, then the biases and
/// the q/k norms of the families that have them.
fn layer_kinds(config: &LlamaConfig) -> Vec<ParamKind> {
    let mut kinds = vec![
        ParamKind::InputNorm,
        ParamKind::QProj,
        ParamKind::KProj,
        ParamKind::VProj,
        ParamKind::OProj,
        ParamKind::PostAttentionNorm,
        ParamKind::GateProj,
        ParamKind::UpProj,
        ParamKind::DownProj,
    ];
    if config.qkv_bias {
        kinds.extend([ParamKind::QBias, ParamKind::KBias, ParamKind::VBias]);
    }
    if config.qk_norm {
        kinds.extend([ParamKind::QNorm, ParamKind::KNorm]);
    }
    kinds
}

impl ParamKind {
    /// The Hugging Face name of this kind in layer `layer` (ignored for whole-model kinds).
    pub fn hf_name(self, layer: usize) -> String {
        let l = |s: &str| format!("model.layers.{layer}.{s}");
        match self {
            Self::Embedding => "model.embed_tokens.weight".into(),
            Self::InputNorm => l("input_layernorm.weight"),
            Self::QProj => l("self_attn.q_proj.weight"),
            Self::KProj => l("self_attn.k_proj.weight"),
            Self::VProj => l("self_attn.v_proj.weight"),
            Self::OProj => l("self_attn.o_proj.weight"),
            Self::QBias => l("self_attn.q_proj.bias"),
            Self::KBias => l("self_attn.k_proj.bias"),
            Self::VBias => l("self_attn.v_proj.bias"),
            Self::QNorm => l("self_attn.q_norm.weight"),
            Self::KNorm => l("self_attn.k_norm.weight"),
            Self::PostAttentionNorm => l("post_attention_layernorm.weight"),
            Self::GateProj => l("mlp.gate_proj.weight"),
            Self::UpProj => l("mlp.up_proj.weight"),
            Self::DownProj => l("mlp.down_proj.weight"),
            Self::FinalNorm => "model.norm.weight".into(),
            Self::LmHead => "lm_head.weight".into(),
        }
    }

    /// The shape of this kind under `c`, as Hugging Face stores it (linear weights `(out, in)`).
    pub fn shape(self, c: &LlamaConfig) -> Vec<usize> {
        let (v, h, f) = (c.vocab_size, c.hidden_size, c.intermediate_size);
        match self {
            Self::Embedding | Self::LmHead => vec![v, h],
            Self::InputNorm | Self::PostAttentionNorm | Self::FinalNorm => vec![h],
            Self::QProj => vec![c.q_dim(), h],
            Self::KProj | Self::VProj => vec![c.kv_dim(), h],
            Self::OProj => vec![h, c.q_dim()],
            Self::QBias => vec![c.q_dim()],
            Self::KBias | Self::VBias => vec![c.kv_dim()],
            Self::QNorm | Self::KNorm => vec![c.head_dim],
            Self::GateProj | Self::UpProj => vec![f, h],
            Self::DownProj => vec![h, f],
        }
    }

    /// Whether this kind is a norm weight (initialised to ones).
    pub fn is_norm(self) -> bool {
        matches!(
            self,
            Self::InputNorm | Self::PostAttentionNorm | Self::FinalNorm | Self::QNorm | Self::KNorm
        )
    }

    /// Whether this kind is a bias (initialised to zeros).
    pub fn is_bias(self) -> bool {
        matches!(self, Self::QBias | Self::KBias | Self::VBias)
    }
}

/// One tensor of a flat buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    /// What it is.
    pub kind: ParamKind,
    /// Its layer, for per-layer kinds.
    pub layer: Option<usize>,
    /// Its Hugging Face name.
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its first element in the flat buffer.
    pub offset: usize,
}

impl TensorSpec {
    /// Elements in the tensor.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Its elements in the flat buffer.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.numel()
    }
}

/// The parameter table: every tensor's name, shape and offset, derived from the config.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamLayout {
    specs: Vec<TensorSpec>,
    layer_kinds: Vec<ParamKind>,
    num_layers: usize,
    tied: bool,
    len: usize,
}

impl ParamLayout {
    /// The layout of `config`: embedding, the layers in order, final norm, then the LM head when
    /// it is not tied.
    pub fn new(config: &LlamaConfig) -> Self {
        let mut specs = Vec::new();
        let mut offset = 0;
        let mut push = |kind: ParamKind, layer: Option<usize>| {
            let shape = kind.shape(config);
            let spec = TensorSpec {
                kind,
                layer,
                name: kind.hf_name(layer.unwrap_or(0)),
                shape,
                offset,
            };
            offset += spec.numel();
            specs.push(spec);
        };
        let layer_kinds = layer_kinds(config);
        push(ParamKind::Embedding, None);
        for l in 0..config.num_layers {
            for &kind in &layer_kinds {
                push(kind, Some(l));
            }
        }
        push(ParamKind::FinalNorm, None);
        if !config.tie_word_embeddings {
            push(ParamKind::LmHead, None);
        }
        Self {
            specs,
            layer_kinds,
            num_layers: config.num_layers,
            tied: config.tie_word_embeddings,
            len: offset,
        }
    }

    /// A layout of the tensors `specs` alone, keeping their offsets into the full buffer (to
    /// write a part of the model, e.g. one safetensors shard).
    pub(crate) fn subset(specs: &[&TensorSpec]) -> Self {
        Self {
            specs: specs.iter().map(|s| (*s).clone()).collect(),
            layer_kinds: Vec::new(),
            num_layers: 0,
            tied: false,
            len: specs.iter().map(|s| s.range().end).max().unwrap_or(0),
        }
    }

    /// Every tensor, in buffer order.
    pub fn specs(&self) -> &[TensorSpec] {
        &self.specs
    }

    /// Elements in a buffer of this layout (the parameter count).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the layout holds no elements (never, for a valid config).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The elements of `kind` in `layer` (the layer is ignored for whole-model kinds); the LM
    /// head of a tied model is the embedding. A kind the model does not have (a bias of a
    /// model without biases) is the empty range at the end of the buffer.
    pub fn range(&self, kind: ParamKind, layer: usize) -> Range<usize> {
        self.get(kind, layer).unwrap_or(self.len..self.len)
    }

    /// The elements of `kind` in `layer`, or `None` when the model has no such tensor.
    pub fn get(&self, kind: ParamKind, layer: usize) -> Option<Range<usize>> {
        let per = self.layer_kinds.len();
        let index = match kind {
            ParamKind::Embedding => 0,
            ParamKind::FinalNorm => 1 + self.num_layers * per,
            ParamKind::LmHead if self.tied => 0,
            ParamKind::LmHead => 2 + self.num_layers * per,
            k => 1 + layer * per + self.layer_kinds.iter().position(|x| *x == k)?,
        };
        self.specs.get(index).map(TensorSpec::range)
    }

    /// The per-layer kinds of this model, in storage order.
    pub fn layer_kinds(&self) -> &[ParamKind] {
        &self.layer_kinds
    }

    /// The elements of decoder layer `layer`: its tensors, contiguous, in storage order.
    pub fn layer_range(&self, layer: usize) -> Range<usize> {
        let per = self.layer_kinds.len();
        let first = &self.specs[1 + layer * per];
        let last = &self.specs[layer * per + per];
        first.offset..last.range().end
    }

    /// Checks that `buf` has this layout's length.
    ///
    /// # Errors
    /// [`ModelError::BufferLength`] naming `buffer`.
    pub fn check(&self, buffer: &'static str, buf: &[f32]) -> Result<(), ModelError> {
        if buf.len() != self.len {
            return Err(ModelError::BufferLength {
                buffer,
                len: buf.len(),
                need: self.len,
            });
        }
        Ok(())
    }
}

/// The activation table for a batch of `B` sequences of `T` positions: what the forward pass
/// keeps for the backward pass, then the backward pass's scratch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ActivationLayout {
    /// `B`.
    pub batch: usize,
    /// `T`.
    pub seq: usize,
    /// Residual stream entering each layer, and leaving the last: `(L+1, B, T, C)`.
    pub residual: Range<usize>,
    /// Input norm output `(L, B, T, C)`.
    pub ln1: Range<usize>,
    /// Input norm reciprocal RMS `(L, B, T)`.
    pub ln1_rstd: Range<usize>,
    /// Rotated queries `(L, B, T, H*D)`.
    pub q: Range<usize>,
    /// Rotated keys `(L, B, T, K*D)`.
    pub k: Range<usize>,
    /// Values `(L, B, T, K*D)`.
    pub v: Range<usize>,
    /// Queries before their q norm `(L, B, T, H*D)` (empty without q/k norms).
    pub q_pre: Range<usize>,
    /// Keys before their k norm `(L, B, T, K*D)` (empty without q/k norms).
    pub k_pre: Range<usize>,
    /// Q norm reciprocal RMS `(L, B, T, H)` (empty without q/k norms).
    pub q_rstd: Range<usize>,
    /// K norm reciprocal RMS `(L, B, T, K)` (empty without q/k norms).
    pub k_rstd: Range<usize>,
    /// Attention probabilities `(L, B, T, H, T)`.
    pub att: Range<usize>,
    /// Attention output before `o_proj` `(L, B, T, H*D)`.
    pub att_out: Range<usize>,
    /// Residual stream after attention `(L, B, T, C)`.
    pub residual_mid: Range<usize>,
    /// Post-attention norm output `(L, B, T, C)`.
    pub ln2: Range<usize>,
    /// Post-attention norm reciprocal RMS `(L, B, T)`.
    pub ln2_rstd: Range<usize>,
    /// Gate projection `(L, B, T, F)`.
    pub gate: Range<usize>,
    /// Up projection `(L, B, T, F)`.
    pub up: Range<usize>,
    /// `silu(gate) * up` `(L, B, T, F)`.
    pub swiglu: Range<usize>,
    /// Final norm output `(B, T, C)`.
    pub lnf: Range<usize>,
    /// Final norm reciprocal RMS `(B, T)`.
    pub lnf_rstd: Range<usize>,
    /// Logits `(B, T, V)`.
    pub logits: Range<usize>,
    /// Softmax of the logits `(B, T, V)`.
    pub probs: Range<usize>,
    /// Log-probability of each target `(B, T)`.
    pub logprobs: Range<usize>,
    /// Entropy of each position's next-token distribution `(B, T)`.
    pub entropy: Range<usize>,
    /// Backward scratch: gradient of the residual stream `(B, T, C)`.
    pub d_residual: Range<usize>,
    /// Backward scratch: gradient of a norm output `(B, T, C)`.
    pub d_ln: Range<usize>,
    /// Backward scratch: gradient of the attention output `(B, T, H*D)`.
    pub d_att_out: Range<usize>,
    /// Backward scratch: gradient of the queries `(B, T, H*D)`.
    pub d_q: Range<usize>,
    /// Backward scratch: gradient of the keys `(B, T, K*D)`.
    pub d_k: Range<usize>,
    /// Backward scratch: gradient of the values `(B, T, K*D)`.
    pub d_v: Range<usize>,
    /// Backward scratch: gradient of the queries before their norm `(B, T, H*D)` (empty
    /// without q/k norms).
    pub d_q_pre: Range<usize>,
    /// Backward scratch: gradient of the keys before their norm `(B, T, K*D)` (empty without
    /// q/k norms).
    pub d_k_pre: Range<usize>,
    /// Backward scratch: gradient of the attention scores `(B, T, H, T)`.
    pub d_att: Range<usize>,
    /// Backward scratch: gradient of the gate projection `(B, T, F)`.
    pub d_gate: Range<usize>,
    /// Backward scratch: gradient of the up projection `(B, T, F)`.
    pub d_up: Range<usize>,
    /// Backward scratch: gradient of the SwiGLU output `(B, T, F)`.
    pub d_swiglu: Range<usize>,
    /// Backward scratch: gradient of the logits `(B, T, V)`.
    pub d_logits: Range<usize>,
    len: usize,
}

impl ActivationLayout {
    /// The layout for `batch` sequences of `seq` positions under `c`.
    pub fn new(c: &LlamaConfig, batch: usize, seq: usize) -> Self {
        let n = batch * seq;
        let (l, h, f, v) = (
            c.num_layers,
            c.hidden_size,
            c.intermediate_size,
            c.vocab_size,
        );
        let (qd, kvd, heads) = (c.q_dim(), c.kv_dim(), c.num_heads);
        let qk = usize::from(c.qk_norm);
        let mut offset = 0;
        let mut take = |len: usize| {
            let r = offset..offset + len;
            offset += len;
            r
        };
        Self {
            batch,
            seq,
            residual: take((l + 1) * n * h),
            ln1: take(l * n * h),
            ln1_rstd: take(l * n),
            q: take(l * n * qd),
            k: take(l * n * kvd),
            v: take(l * n * kvd),
            q_pre: take(qk * l * n * qd),
            k_pre: take(qk * l * n * kvd),
            q_rstd: take(qk * l * n * heads),
            k_rstd: take(qk * l * n * c.num_kv_heads),
            att: take(l * n * heads * seq),
            att_out: take(l * n * qd),
            residual_mid: take(l * n * h),
            ln2: take(l * n * h),
            ln2_rstd: take(l * n),
            gate: take(l * n * f),
            up: take(l * n * f),
            swiglu: take(l * n * f),
            lnf: take(n * h),
            lnf_rstd: take(n),
            logits: take(n * v),
            probs: take(n * v),
            logprobs: take(n),
            entropy: take(n),
            d_residual: take(n * h),
            d_ln: take(n * h),
            d_att_out: take(n * qd),
            d_q: take(n * qd),
            d_k: take(n * kvd),
            d_v: take(n * kvd),
            d_q_pre: take(qk * n * qd),
            d_k_pre: take(qk * n * kvd),
            d_att: take(n * heads * seq),
            d_gate: take(n * f),
            d_up: take(n * f),
            d_swiglu: take(n * f),
            d_logits: take(n * v),
            len: offset,
        }
    }

    /// Elements in an activation buffer of this layout.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the layout holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Checks that `buf` has this layout's length.
    ///
    /// # Errors
    /// [`ModelError::BufferLength`].
    pub fn check(&self, buf: &[f32]) -> Result<(), ModelError> {
        if buf.len() != self.len {
            return Err(ModelError::BufferLength {
                buffer: "activations",
                len: buf.len(),
                need: self.len,
            });
        }
        Ok(())
    }
}

/// Layer `layer`'s block of a per-layer range `(L, ...)` split into `parts` equal blocks.
pub(crate) fn layer_block(r: &Range<usize>, layer: usize, parts: usize) -> Range<usize> {
    let size = (r.end - r.start) / parts;
    r.start + layer * size..r.start + (layer + 1) * size
}

/// Disjoint mutable views of `buf` at `ranges` (in any order), or `None` when two overlap or one
/// runs past the end.
pub(crate) fn carve<'a, const N: usize>(
    buf: &'a mut [f32],
    ranges: [&Range<usize>; N],
) -> Option<[&'a mut [f32]; N]> {
    let mut order: Vec<usize> = (0..N).collect();
    // Empty ranges first among equal starts, so one never lands inside the range it touches.
    order.sort_by_key(|&i| (ranges[i].start, ranges[i].end));
    let mut out: [Option<&'a mut [f32]>; N] = std::array::from_fn(|_| None);
    let mut rest = buf;
    let mut consumed = 0;
    for i in order {
        let r = ranges[i];
        if r.start < consumed || r.end < r.start {
            return None;
        }
        let tail = std::mem::take(&mut rest);
        if r.end - consumed > tail.len() {
            return None;
        }
        let (_, tail) = tail.split_at_mut(r.start - consumed);
        let (piece, tail) = tail.split_at_mut(r.end - r.start);
        out[i] = Some(piece);
        rest = tail;
        consumed = r.end;
    }
    let mut result = out.into_iter();
    let arr: [&'a mut [f32]; N] =
        std::array::from_fn(|_| result.next().flatten().unwrap_or_default());
    Some(arr)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn param_layout_is_contiguous_and_names_are_hugging_face_names() {
        for preset in ["tiny", "small"] {
            let c = LlamaConfig::preset(preset).unwrap();
            let layout = ParamLayout::new(&c);
            let mut next = 0;
            for s in layout.specs() {
                assert_eq!(s.offset, next, "{}", s.name);
                next += s.numel();
            }
            assert_eq!(next, layout.len());
            let q = layout.range(ParamKind::QProj, 1);
            assert_eq!(
                layout
                    .specs()
                    .iter()
                    .find(|s| s.range() == q)
                    .map(|s| s.name.as_str()),
                Some("model.layers.1.self_attn.q_proj.weight")
            );
            assert_eq!(
                layout.specs().iter().any(|s| s.name == "lm_head.weight"),
                !c.tie_word_embeddings
            );
        }
    }

    #[test]
    fn carve_refuses_overlapping_ranges() {
        let mut buf = vec![1.0f32; 10];
        assert!(carve(&mut buf, [&(0..5), &(4..6)]).is_none());
        let [a, b] = carve(&mut buf, [&(6..10), &(0..2)]).unwrap();
        assert_eq!((a.len(), b.len()), (4, 2));
    }
}
