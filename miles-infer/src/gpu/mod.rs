//! The engine's GPU path: bf16 weights in the `weights` region, the bf16 paged cache and the
//! prefill's scratch in the `kv_cache` region, the decode step's scratch (the static buffers of
//! its CUDA graphs) in the `cuda_graph` region, every kernel queued on the [`Gpu`]'s stream.
//!
//! A step (a prefill of several prompts, or a decode of one token per sequence) is one pass
//! over `N` tokens, each with its sequence and position: embedding; per layer RMSNorm, one
//! product for q, k and v (their weights lie side by side in the parameter table), one kernel
//! that adds the biases, norms the q/k heads (in the families that have them), turns q and k
//! by each token's position and writes the new keys and values into the cache through the
//! block tables (`qkv_rotary_cache`), paged attention over each sequence's cached positions
//! (in a pass of one token a sequence, a decode step, one kernel does both:
//! `paged_decode_attention`),
//! the o product added into the residual stream, RMSNorm, one product for gate and up, SwiGLU
//! over its rows, and the down product added into the residual, which the next layer's norm
//! (the final norm after the last layer) follows; then the LM head (fp32 logits) for the rows
//! that need logits only: the last token of each sequence. In a pass of at most `SPLIT_ROWS`
//! tokens (a decode step of up to that many sequences, or a short prefill) the o and down
//! products run as slices of their inner dimension whose fp32 partials the norm's kernel adds
//! into the residual stream (`residual_rmsnorm`); in a wider one they add into it themselves
//! (beta 1). Those split products, the LM head and the gate/up product, which then ends in its
//! SwiGLU, run on miles' own Hopper kernel (`Gpu::decode_product`, warpgroup MMA fed by the
//! tensor memory accelerator) where the shapes fit it; the kernels ahead of them let them start
//! early, so they fetch their first weights while those finish. The q/k/v product, and every
//! product of a wider pass, are cuBLAS's. A decode step then draws each sequence's next token on
//! the device (the `sample_rows` kernel), so only token ids and log-probs come back; a prefill
//! brings its prompts' rows of logits back (once per prompt: its samples draw from them
//! later). A fence on every buffer the pass used lets the memory manager pause the tags
//! afterwards.
//!
//! The decode step is captured as a CUDA graph per batch bucket (1, 2, 4, ... up to
//! `max_batch` sequences), once in the engine's life: a step of `B` sequences runs the graph
//! of the smallest bucket holding `B`, its other rows padding that write into a block no
//! sequence owns. Everything a graph reads lives at fixed addresses: the weights, the cache,
//! and the step scratch, whose index arrays, draws and sampling rule are uploaded before each
//! replay. Offloading `cuda_graph` releases that scratch; it comes back at the same addresses
//! and the graphs replay without recapture.
//!
//! A decode step is queued without a wait: its index arrays go up and its draws come down
//! through pinned mailboxes (two of each, used in turn, so the host fills one while the
//! device may still read the other), and its draws are read when the loop collects it. The
//! step queued behind it can take some of its input tokens from its draws on the device (the
//! embedding's feed), so the loop keeps one step ahead of the device.
//!
//! A prefill pass holds at most `max(positions, max_batch, 4096)` tokens, `positions` being the
//! longest sequence the engine serves (so any prompt fits whole), and `max_batch` sequences; a
//! prefill of more is split into several passes.

mod pass;
mod scratch;

use std::collections::VecDeque;
use std::sync::Arc;

use half::bf16;
use miles_core::device::{
    DeviceError, Gemm, Gpu, GpuGraph, GpuSlice, Mailbox, TILE_COLUMNS, Transpose,
};
use miles_core::model::{LlamaConfig, ParamKind, ParamLayout};
use miles_core::ops::RopeTable;
use miles_core::ops::gpu::{
    DECODE_PRODUCT_MAX_ROWS, DECODE_PRODUCT_SWIGLU_COLUMNS, DRAW_WORDS, FEED_HOST, FedIds,
    PAGED_MAX_HEAD_DIM, PagedCache, PagedTokens, ProductOut, QkvHeads, RULE_WORDS, SampleRule,
    TokenPlaces,
};
use miles_core::{Buffer, Device, DeviceKind, Fence, MemoryManager};
use rayon::prelude::*;

use self::pass::Pass;
use self::scratch::{Index, Scratch};
pub(crate) use self::scratch::{Limits, scratch_bytes};
use crate::paged::BlockTables;
use crate::sampling::DrawKey;
use crate::schedule::{Feed, Step};
use crate::{InferError, SamplingParams};

/// The q, k and v weights, one product.
const QKV: [ParamKind; 3] = [ParamKind::QProj, ParamKind::KProj, ParamKind::VProj];

/// Their biases, in the families that have them.
const QKV_BIASES: [ParamKind; 3] = [ParamKind::QBias, ParamKind::KBias, ParamKind::VBias];

/// The gate and up weights, one product.
const GATE_UP: [ParamKind; 2] = [ParamKind::GateProj, ParamKind::UpProj];

/// The most rows of a pass whose o and down products run split along their inner dimension:
/// at decode batch sizes their few output columns (the hidden size) leave most
/// multiprocessors idle in one product, and slices of it run side by side (bench/RESULTS.md,
/// round 27).
const SPLIT_ROWS: usize = 128;

/// The most slices of a split product.
const MAX_SPLIT: usize = 4;

/// The least of the inner dimension a slice keeps (small enough that the tiny preset's
/// products split too, so the engine's tests on it cover the split).
const SPLIT_MIN_INNER: usize = 32;

/// Slices of a split product of inner dimension `k`: the most, up to [`MAX_SPLIT`], that cut
/// `k` into whole 16-byte words (8 elements, so every slice starts aligned) of at least
/// [`SPLIT_MIN_INNER`] each; 1 where none does.
fn split_of(k: usize) -> usize {
    (2..=MAX_SPLIT)
        .rev()
        .find(|&p| k.is_multiple_of(8 * p) && k / p >= SPLIT_MIN_INNER)
        .unwrap_or(1)
}

/// Columns a block of miles' decode product takes in the split o and down products: 64, so
/// that four slices of the 1B's fill 128 blocks (`bench gemm`, bench/RESULTS.md round 38).
const OWN_SPLIT_COLUMNS: usize = 64;

/// Columns a block of miles' decode product takes in the LM head (`bench gemm`, round 38).
const OWN_HEAD_COLUMNS: usize = 128;

/// Slices of a split product on miles' decode product of inner dimension `k` (whole tiles):
/// the most, up to [`MAX_SPLIT`], that divide its tiles.
fn own_split_of(k: usize) -> usize {
    let tiles = k / TILE_COLUMNS;
    (1..=MAX_SPLIT)
        .rev()
        .find(|&p| tiles.is_multiple_of(p))
        .unwrap_or(1)
}

/// Whether a product of `n` rows, `out` columns in blocks of `block` and inner dimension `k`
/// runs through miles' decode product (`Gpu::decode_product`) rather than cuBLAS: on Hopper,
/// at most [`DECODE_PRODUCT_MAX_ROWS`] rows, `k` whole tiles, `out` whole blocks, the operands
/// 16-byte aligned (the tensor memory accelerator's rule). Where it runs after `paged_decode`,
/// `swiglu_rows`, `residual_rmsnorm` or the gate/up product ending in SwiGLU, which let it
/// start early, it fetches its first weights while they finish (bench/RESULTS.md rounds 38
/// and 39). The q/k/v product stays cuBLAS's, faster there; the gate/up product alone is too
/// (round 38), but ours ends in SwiGLU, which saves `swiglu_rows` and lets the down product
/// start early (round 39).
fn own_product_fits(
    gpu: &Gpu,
    inp: GpuSlice<bf16>,
    weight: GpuSlice<bf16>,
    (n, out, k): (usize, usize, usize),
    block: usize,
) -> bool {
    gpu.has_decode_product()
        && n <= DECODE_PRODUCT_MAX_ROWS
        && k.is_multiple_of(TILE_COLUMNS)
        && out.is_multiple_of(block)
        && (inp.address() | weight.address()).is_multiple_of(16)
}

/// Bytes of one weight or cache element (bf16).
pub(crate) const ELEMENT_BYTES: usize = 2;

/// Elements converted to bf16 per parallel task of a weight write.
const CONVERT_CHUNK: usize = 1 << 16;

/// Checks that `gpu` computes on the device `memory` allocates from, and that the model fits
/// the kernels.
///
/// # Errors
/// [`InferError::BadParameter`] naming the mismatch.
pub(crate) fn check_fit(
    memory: &MemoryManager,
    gpu: &Gpu,
    config: &LlamaConfig,
) -> Result<(), InferError> {
    config.check_gpu_support()?;
    let bad = |reason: String| InferError::BadParameter {
        what: "gpu engine",
        reason,
    };
    let device = memory.device();
    if device.kind() != DeviceKind::Cuda
        || !std::ptr::addr_eq(Arc::as_ptr(device), Arc::as_ptr(gpu.device()))
    {
        return Err(bad(format!(
            "the memory manager allocates on {}, not on the gpu's device {}; build both from the same CudaDevice",
            device.name(),
            gpu.device().name()
        )));
    }
    if config.head_dim > PAGED_MAX_HEAD_DIM || !config.head_dim.is_multiple_of(8) {
        return Err(bad(format!(
            "head dim {} is not supported on the gpu; it must be a multiple of 8 and at most {PAGED_MAX_HEAD_DIM}",
            config.head_dim
        )));
    }
    Ok(())
}

/// The buffers a [`GpuModel`] computes on.
#[derive(Debug)]
pub(crate) struct GpuBuffers {
    /// `(params)` bf16, in the parameter table's order (`weights` region).
    pub weights: Buffer,
    /// `(blocks + 1, L, 2, P, K*D)` bf16 (`kv_cache` region); the last block takes the writes
    /// of a graph's padding rows.
    pub cache: Buffer,
    /// The prefill's scratch (`kv_cache` region).
    pub prefill: Buffer,
    /// The decode step's scratch, the graphs' static buffers (`cuda_graph` region).
    pub step: Buffer,
}

/// The model on the GPU: its buffers, the cache's shape, the scratch tensors and the captured
/// decode graphs.
#[derive(Debug)]
pub(crate) struct GpuModel {
    gpu: Arc<Gpu>,
    config: LlamaConfig,
    layout: ParamLayout,
    rope: RopeTable,
    limits: Limits,
    shape: PagedCache,
    /// The block padding rows write into: past every block the tables hand out.
    spare_block: u32,
    buffers: GpuBuffers,
    prefill: Scratch,
    step: Scratch,
    /// The decode graph of each bucket (`2^i` sequences), once captured; empty without graphs.
    graphs: Vec<Option<GpuGraph>>,
    /// Graphs captured in the model's life.
    captures: usize,
    /// The mailboxes of the decode steps' index arrays, and of their draws, used in turn.
    inboxes: [Mailbox; 2],
    outboxes: [Mailbox; 2],
    /// The mailboxes the next decode step takes.
    turn: usize,
    /// Decode steps queued and not collected, oldest first; a step fed from the last finds
    /// each row's draw among the step scratch's drawn tokens by its `rows`.
    flights: VecDeque<Flight>,
}

/// A decode step queued and not collected: its mailboxes, its draws, and where each of its
/// rows finds its draw among them.
#[derive(Debug)]
struct Flight {
    turn: usize,
    draws: usize,
    rows: Vec<Option<u32>>,
}

impl GpuModel {
    /// The model over `buffers`: the weights (the parameter table's size), the cache of
    /// `num_blocks` blocks of `block_size` positions plus the spare block, the prefill scratch
    /// and the step scratch ([`scratch_bytes`] of `limits`). With `graphs`, decode steps run
    /// as CUDA graphs.
    ///
    /// # Errors
    /// [`InferError::Internal`] when a buffer is smaller than its contents;
    /// [`InferError::Device`] when the scratch cannot be laid out.
    pub(crate) fn new(
        gpu: Arc<Gpu>,
        config: &LlamaConfig,
        layout: &ParamLayout,
        limits: Limits,
        (num_blocks, block_size): (usize, usize),
        buffers: GpuBuffers,
        graphs: bool,
    ) -> Result<GpuModel, InferError> {
        let shape = PagedCache {
            num_blocks: num_blocks + 1,
            num_layers: config.num_layers,
            block_size,
            kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
        };
        let lay_out = InferError::device("lay out the gpu scratch");
        let (prefill, prefill_bytes) =
            Scratch::carve(buffers.prefill.address(), config, limits).map_err(lay_out)?;
        let (step, step_bytes) =
            Scratch::carve(buffers.step.address(), config, limits.step()).map_err(lay_out)?;
        for (what, buffer, need) in [
            ("weights", &buffers.weights, layout.len() * ELEMENT_BYTES),
            ("kv cache", &buffers.cache, shape.elems() * ELEMENT_BYTES),
            ("prefill scratch", &buffers.prefill, prefill_bytes),
            ("step scratch", &buffers.step, step_bytes),
        ] {
            if buffer.len() < need {
                return Err(InferError::Internal(format!(
                    "the gpu {what} buffer holds {} bytes, it needs {need}",
                    buffer.len()
                )));
            }
        }
        let spare_block = u32::try_from(num_blocks).map_err(|_| {
            InferError::Internal(format!("{num_blocks} kv blocks do not fit 32 bits"))
        })?;
        let buckets = if graphs {
            limits.rows.next_power_of_two().trailing_zeros() as usize + 1
        } else {
            0
        };
        let step_limits = limits.step();
        let index_bytes = Index::new(step_limits.tokens, limits.rows, limits.rows, limits.blocks)
            .len
            * std::mem::size_of::<u32>();
        let mailbox = |bytes| {
            gpu.mailbox(bytes)
                .map_err(InferError::device("make a mailbox"))
        };
        let inboxes = [mailbox(index_bytes)?, mailbox(index_bytes)?];
        let draw_bytes = 2 * limits.rows * std::mem::size_of::<u32>();
        let outboxes = [mailbox(draw_bytes)?, mailbox(draw_bytes)?];
        Ok(GpuModel {
            rope: config.rope_table_for(limits.positions),
            gpu,
            config: config.clone(),
            layout: layout.clone(),
            limits,
            shape,
            spare_block,
            buffers,
            prefill,
            step,
            graphs: std::iter::repeat_with(|| None).take(buckets).collect(),
            captures: 0,
            inboxes,
            outboxes,
            turn: 0,
            flights: VecDeque::new(),
        })
    }

    /// Decode graphs captured so far, in the model's life.
    pub(crate) fn graph_captures(&self) -> usize {
        self.captures
    }

    /// Waits for queued kernels, so the weights can be written from the host.
    ///
    /// # Errors
    /// [`InferError::Device`] with the first error a queued kernel hit.
    pub(crate) fn idle(&self) -> Result<(), InferError> {
        self.gpu
            .synchronize()
            .map_err(InferError::device("wait for the gpu"))
    }

    /// Writes `data` as bf16 into the weights from element `offset` on (the caller has made
    /// the gpu [`idle`](Self::idle)).
    ///
    /// # Errors
    /// [`InferError::Memory`] while the weights are offloaded or for elements past the buffer.
    pub(crate) fn write_weights(&mut self, offset: usize, data: &[f32]) -> Result<(), InferError> {
        let mut bytes = vec![0u8; data.len() * ELEMENT_BYTES];
        bytes
            .par_chunks_mut(CONVERT_CHUNK * ELEMENT_BYTES)
            .zip(data.par_chunks(CONVERT_CHUNK))
            .for_each(|(dst, src)| {
                for (d, &x) in dst.chunks_exact_mut(ELEMENT_BYTES).zip(src) {
                    d.copy_from_slice(&bf16::from_f32(x).to_le_bytes());
                }
            });
        self.buffers
            .weights
            .write(offset * ELEMENT_BYTES, &bytes)
            .map_err(InferError::memory("write the weights"))
    }

    /// Whether `device` is the one this model computes on.
    pub(crate) fn is_on(&self, device: &Arc<dyn Device>) -> bool {
        std::ptr::addr_eq(Arc::as_ptr(device), Arc::as_ptr(self.gpu.device()))
    }

    /// Copies `src` (the whole parameter table, bf16, on this model's device) into the weights
    /// on the device after `ready`, and waits for the copy, so that the owner of `src` may move
    /// it as soon as this returns.
    ///
    /// # Errors
    /// [`InferError::Internal`] for a source of another length; [`InferError::Device`] when the
    /// copy or a wait fails.
    pub(crate) fn copy_weights(
        &self,
        src: GpuSlice<bf16>,
        ready: &Fence,
    ) -> Result<(), InferError> {
        let len = self.layout.len();
        if src.len() != len {
            return Err(InferError::Internal(format!(
                "device weights of {} elements cannot fill a parameter table of {len}",
                src.len()
            )));
        }
        let copy = InferError::device("copy the weights on the gpu");
        let dst = GpuSlice::<bf16>::of(self.buffers.weights.range())
            .and_then(|all| all.sub(0, len))
            .map_err(copy)?;
        self.gpu.wait_for(ready).map_err(copy)?;
        self.gpu.copy(dst, src).map_err(copy)?;
        let done = self.gpu.record_fence().map_err(copy)?;
        self.buffers.weights.record_use(done.clone());
        done.wait().map_err(copy)
    }

    /// Uploads what a generate call needs besides the weights: the rotary tables of both
    /// scratches, whose regions drop their contents when offloaded. Forgets the decode steps a
    /// failed call left queued.
    ///
    /// # Errors
    /// [`InferError::Device`] when the upload fails.
    pub(crate) fn begin(&mut self) -> Result<(), InferError> {
        self.flights.clear();
        let upload = InferError::device("upload the rotary tables");
        for s in [&self.prefill, &self.step] {
            for (table, values) in [(s.cos, self.rope.cos()), (s.sin, self.rope.sin())] {
                self.gpu.upload(table, values).map_err(upload)?;
            }
        }
        Ok(())
    }

    fn weight(&self, kind: ParamKind, layer: usize) -> Result<GpuSlice<bf16>, DeviceError> {
        let range = self.layout.range(kind, layer);
        GpuSlice::<bf16>::of(self.buffers.weights.range())?.sub(range.start, range.len())
    }

    /// The weights of `kinds` in `layer` as one tensor: the parameter table stores them one
    /// after another, so their products run as one.
    fn fused(&self, kinds: &[ParamKind], layer: usize) -> Result<GpuSlice<bf16>, DeviceError> {
        let first = self.layout.range(kinds[0], layer).start;
        let end = kinds.iter().try_fold(first, |at, &kind| {
            let range = self.layout.range(kind, layer);
            (range.start == at).then_some(range.end)
        });
        let end = end.ok_or(DeviceError::ShapeMismatch {
            what: "fused weights (adjacent in the parameter table)",
            expected: first,
            actual: self.layout.range(kinds[0], layer).end,
        })?;
        GpuSlice::<bf16>::of(self.buffers.weights.range())?.sub(first, end - first)
    }

    fn cache_slice(&self) -> Result<GpuSlice<bf16>, DeviceError> {
        GpuSlice::<bf16>::of(self.buffers.cache.range())?.sub(0, self.shape.elems())
    }

    /// Records a fence after the work queued so far on every buffer it may use, even when
    /// `queued` failed after some of it was queued; returns `queued`'s error first.
    fn fence(&self, queued: Result<(), DeviceError>) -> Result<(), InferError> {
        let step = InferError::device("run a step on the gpu");
        let fence = self.gpu.record_fence();
        if let Ok(fence) = &fence {
            let b = &self.buffers;
            for buffer in [&b.weights, &b.cache, &b.prefill, &b.step] {
                buffer.record_use(fence.clone());
            }
        }
        queued.map_err(step)?;
        fence.map(drop).map_err(step)
    }

    /// The index arrays of `pass`, its `draws` (`(D, 4)`: row, then key) and `rule` in one
    /// array, and their layout.
    fn index_words(
        &self,
        pass: &Pass,
        draws: &[u32],
        rule: &SampleRule,
    ) -> Result<(Index, Vec<u32>), DeviceError> {
        let at = Index::new(
            pass.ids.len(),
            pass.logit_rows.len(),
            draws.len() / DRAW_WORDS,
            self.limits.blocks,
        );
        let mut index = Vec::with_capacity(at.len);
        for part in [
            &pass.ids,
            &pass.positions,
            &pass.seq_rows,
            &pass.slots,
            &pass.feeds,
            &pass.logit_rows,
            &pass.tables,
        ] {
            index.extend_from_slice(part);
        }
        index.extend_from_slice(draws);
        index.extend_from_slice(&rule.words()?);
        Ok((at, index))
    }

    /// Uploads the index arrays of `pass`, its `draws` and `rule` into `s`, and returns their
    /// layout.
    fn upload(
        &self,
        s: &Scratch,
        pass: &Pass,
        draws: &[u32],
        rule: &SampleRule,
    ) -> Result<Index, DeviceError> {
        let (at, index) = self.index_words(pass, draws, rule)?;
        self.gpu.upload(s.index.sub(0, index.len())?, &index)?;
        Ok(at)
    }

    /// Queues the kernels of a pass laid out as `at` over `s`: the model for its tokens (none
    /// when it has none), then its draws. Queues only (so it can be captured).
    fn queue(&self, s: &Scratch, at: Index) -> Result<(), DeviceError> {
        let (g, c) = (&*self.gpu, &self.config);
        let (n, r, d) = (at.n, at.r, at.d);
        let v = c.vocab_size;
        if n > 0 {
            self.queue_model(s, at)?;
        }
        if d > 0 {
            g.sample_rows(
                s.picked.sub(0, d)?,
                s.picked.sub(d, d)?.reinterpret::<f32>()?,
                s.logits.sub(0, r.max(d) * v)?,
                s.index.sub(at.draws, DRAW_WORDS * d)?,
                s.index.sub(at.rule, RULE_WORDS)?,
                v,
            )?;
        }
        Ok(())
    }

    /// Queues the model over the tokens of a pass laid out as `at`.
    fn queue_model(&self, s: &Scratch, at: Index) -> Result<(), DeviceError> {
        let (g, c) = (&*self.gpu, &self.config);
        let (n, r) = (at.n, at.r);
        let (h, qd, kvd, f) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let ids = s.index.sub(0, n)?;
        let positions = s.index.sub(n, n)?;
        let slots = s.index.sub(3 * n, n)?;
        let fed = FedIds {
            feed: s.index.sub(4 * n, n)?,
            picked: s.picked,
        };
        let tokens = PagedTokens {
            positions,
            seq_rows: s.index.sub(2 * n, n)?,
            tables: s.index.sub(at.tables, r * self.limits.blocks)?,
            max_blocks: self.limits.blocks,
        };
        let (x, ln, att) = (
            s.x.sub(0, n * h)?,
            s.ln.sub(0, n * h)?,
            s.att.sub(0, n * qd)?,
        );
        let (qkv, q) = (s.qkv.sub(0, n * (qd + 2 * kvd))?, s.q.sub(0, n * qd)?);
        let (gate_up, act) = (s.gate_up.sub(0, n * 2 * f)?, s.act.sub(0, n * f)?);
        let places = TokenPlaces {
            positions,
            slots,
            cos: s.cos,
            sin: s.sin,
        };
        let cache = self.cache_slice()?;
        let eps = c.rms_norm_eps;
        // y = x W^T for an HF weight W (out, in).
        let linear = |rows, out, inp| Gemm::new(rows, out, inp, Transpose::No, Transpose::Yes);
        let (table, norm) = (
            self.weight(ParamKind::Embedding, 0)?,
            self.weight(ParamKind::InputNorm, 0)?,
        );
        g.embedding_norm_fed((x, ln), ids, fed, table, (norm, eps))?; // (N, C) each
        for l in 0..c.num_layers {
            let w = |kind| self.weight(kind, l);
            let heads = QkvHeads {
                qkv,
                heads: c.num_heads,
                bias: c.qkv_bias.then(|| self.fused(&QKV_BIASES, l)).transpose()?,
                q_norm: c.qk_norm.then(|| w(ParamKind::QNorm)).transpose()?,
                k_norm: c.qk_norm.then(|| w(ParamKind::KNorm)).transpose()?,
                eps,
            };
            g.gemm(linear(n, qd + 2 * kvd, h), qkv, ln, self.fused(&QKV, l)?)?;
            if n == r {
                // One token a sequence: the queries never leave the attention's kernel.
                g.paged_decode_attention(att, cache, &self.shape, l, &heads, (&places, &tokens))?;
            } else {
                g.qkv_rotary_cache(q, cache, &self.shape, l, &heads, &places)?;
                g.paged_attention(att, q, cache, &self.shape, l, &tokens)?;
            }
            let post_attention = w(ParamKind::PostAttentionNorm)?;
            self.add_then_norm(s, (n, qd), att, w(ParamKind::OProj)?, post_attention)?; // x += o
            let gate_up_w = self.fused(&GATE_UP, l)?;
            if own_product_fits(
                g,
                ln,
                gate_up_w,
                (n, 2 * f, h),
                DECODE_PRODUCT_SWIGLU_COLUMNS,
            ) {
                g.decode_product(
                    ProductOut::Swiglu(act),
                    ln,
                    gate_up_w,
                    h,
                    DECODE_PRODUCT_SWIGLU_COLUMNS,
                )?;
            } else {
                g.gemm(linear(n, 2 * f, h), gate_up, ln, gate_up_w)?;
                g.swiglu_rows(act, gate_up, f)?;
            }
            let next = if l + 1 < c.num_layers {
                self.weight(ParamKind::InputNorm, l + 1)?
            } else {
                self.weight(ParamKind::FinalNorm, 0)?
            };
            self.add_then_norm(s, (n, f), act, w(ParamKind::DownProj)?, next)?; // x += down
        }
        // `ln` holds every row through the final norm; only the rows that need logits go
        // through the head: gather them (an embedding lookup whose table is `ln`). A pass of
        // one token a sequence (a decode step) needs every row's, in order: `ln` itself.
        let rows_ln = if n == r {
            ln
        } else {
            let rows_ln = s.rows_ln.sub(0, r * h)?;
            g.embedding_forward(rows_ln, s.index.sub(5 * n, r)?, ln, h)?; // (R, C)
            rows_ln
        };
        let logits = s.logits.sub(0, r * c.vocab_size)?; // (R, V) fp32
        let head = self.weight(ParamKind::LmHead, 0)?;
        if own_product_fits(g, rows_ln, head, (r, c.vocab_size, h), OWN_HEAD_COLUMNS) {
            g.decode_product(
                ProductOut::Partials(logits),
                rows_ln,
                head,
                h,
                OWN_HEAD_COLUMNS,
            )
        } else {
            g.gemm(linear(r, c.vocab_size, h), logits, rows_ln, head)
        }
    }

    /// Queues `x += inp W^T` for the product `weight (C, K)` of `inp (n, K)`, then `ln =
    /// rmsnorm(x)` with `norm`. A pass of at most [`SPLIT_ROWS`] rows splits the product along
    /// `K` ([`own_split_of`] on miles' decode product where it fits, else [`split_of`] on
    /// cuBLAS) and adds its partials in the norm's kernel; a wider one adds the product into
    /// `x` (beta 1) and norms after.
    fn add_then_norm(
        &self,
        s: &Scratch,
        (n, k): (usize, usize),
        inp: GpuSlice<bf16>,
        weight: GpuSlice<bf16>,
        norm: GpuSlice<bf16>,
    ) -> Result<(), DeviceError> {
        let (g, h, eps) = (
            &*self.gpu,
            self.config.hidden_size,
            self.config.rms_norm_eps,
        );
        let (x, ln) = (s.x.sub(0, n * h)?, s.ln.sub(0, n * h)?);
        let product = Gemm::new(n, h, k, Transpose::No, Transpose::Yes);
        if n <= SPLIT_ROWS {
            let own = own_product_fits(g, inp, weight, (n, h, k), OWN_SPLIT_COLUMNS);
            let parts = if own { own_split_of(k) } else { split_of(k) };
            let partials = s.partials.sub(0, parts * n * h)?;
            if own {
                let out = ProductOut::Partials(partials);
                g.decode_product(out, inp, weight, k, OWN_SPLIT_COLUMNS)?;
            } else {
                g.gemm(product.split_k(parts), partials, inp, weight)?;
            }
            g.residual_rmsnorm(ln, x, partials, norm, eps)
        } else {
            g.gemm(product.accumulate(), x, inp, weight)?;
            g.rmsnorm_forward(ln, None, x, norm, eps)
        }
    }

    /// Runs `pass` and its `draws` over `s` as queued kernels.
    fn execute(
        &self,
        s: &Scratch,
        pass: &Pass,
        draws: &[u32],
        rule: &SampleRule,
    ) -> Result<Index, InferError> {
        // A failed upload queued nothing of this pass.
        let at = self
            .upload(s, pass, draws, rule)
            .map_err(InferError::device("upload a step's index arrays"))?;
        self.fence(self.queue(s, at))?;
        Ok(at)
    }

    /// Runs `pass` over the prefill scratch and returns the logits `(V)` of each of its
    /// sequences.
    fn run_for_logits(&self, pass: &Pass) -> Result<Vec<Vec<f32>>, InferError> {
        let s = &self.prefill;
        self.execute(s, pass, &[], &GREEDY)?;
        let read = InferError::device("read the logits");
        let (rows, v) = (pass.logit_rows.len(), self.config.vocab_size);
        let mut logits = vec![0.0f32; rows * v];
        let out = s.logits.sub(0, rows * v).map_err(read)?;
        self.gpu.download(&mut logits, out).map_err(read)?;
        Ok(logits.chunks_exact(v).map(<[f32]>::to_vec).collect())
    }

    /// The `d` tokens and log-probs the last pass over `s` drew.
    fn picked(&self, s: &Scratch, d: usize) -> Result<Vec<(u32, f32)>, InferError> {
        let read = InferError::device("read the drawn tokens");
        let mut words = vec![0u32; 2 * d];
        self.gpu
            .download(&mut words, s.picked.sub(0, 2 * d).map_err(read)?)
            .map_err(read)?;
        let (tokens, logprobs) = words.split_at(d);
        Ok(tokens
            .iter()
            .zip(logprobs)
            .map(|(&token, &bits)| (token, f32::from_bits(bits)))
            .collect())
    }

    /// Queues the decode step laid out as `at` in the step scratch (one token per sequence,
    /// draws for all of them) as the graph of its bucket, capturing the graph the first time;
    /// falls back to queued kernels for good, with a warning, when the driver refuses the
    /// capture.
    fn replay(&mut self, at: Index) -> Result<(), DeviceError> {
        let s = self.step;
        let bucket = at.r.next_power_of_two().trailing_zeros() as usize;
        let graph = match self.graphs[bucket].take() {
            Some(graph) => graph,
            None => match self.gpu.capture(|| self.queue(&s, at)) {
                Ok(graph) => {
                    self.captures += 1;
                    tracing::info!(
                        sequences = 1usize << bucket,
                        captured = self.captures,
                        "captured the decode step's cuda graph for this batch bucket; it replays from now on"
                    );
                    graph
                }
                Err(error) => {
                    tracing::warn!(
                        %error,
                        "the driver refused to capture the decode step; it runs as queued kernels from now on"
                    );
                    self.graphs.clear();
                    return self.queue(&s, at);
                }
            },
        };
        let queued = self.gpu.replay(&graph);
        self.graphs[bucket] = Some(graph);
        queued
    }
}

/// The rule uploaded with a pass that draws nothing.
const GREEDY: SampleRule = SampleRule {
    temperature: 0.0,
    top_p: 1.0,
    top_k: 0,
    seed: 0,
};

/// The sampling kernel's rule for `params`.
fn rule(params: &SamplingParams) -> SampleRule {
    SampleRule {
        temperature: params.temperature,
        top_p: params.top_p,
        top_k: params.top_k,
        seed: params.seed,
    }
}

/// The draws array entry of a draw from logit row `row`.
fn draw_words(row: usize, key: DrawKey) -> [u32; DRAW_WORDS] {
    // Rows are below the pass's `max_batch` sequences.
    [row as u32, key.prompt, key.sample, key.token]
}

impl Step for GpuModel {
    fn prefill(
        &mut self,
        tables: &mut BlockTables,
        seqs: &[usize],
        prompts: &[&[u32]],
    ) -> Result<Vec<Vec<f32>>, InferError> {
        let mut out = Vec::with_capacity(seqs.len());
        let mut pass = Pass::default();
        for (&seq, prompt) in seqs.iter().zip(prompts) {
            let full = pass.ids.len() + prompt.len() > self.limits.tokens
                || pass.logit_rows.len() == self.limits.rows;
            if full && !pass.ids.is_empty() {
                out.extend(self.run_for_logits(&pass)?);
                pass = Pass::default();
            }
            if prompt.len() > self.limits.tokens {
                return Err(InferError::Internal(format!(
                    "a prompt of {} tokens exceeds a pass of {}",
                    prompt.len(),
                    self.limits.tokens
                )));
            }
            let first = tables.advance(seq, prompt.len())?;
            self.push(&mut pass, tables, seq, first, prompt)?;
        }
        if !pass.ids.is_empty() {
            out.extend(self.run_for_logits(&pass)?);
        }
        Ok(out)
    }

    fn decode_logits(
        &mut self,
        tables: &mut BlockTables,
        seqs: &[usize],
        tokens: &[u32],
    ) -> Result<Vec<f32>, InferError> {
        let pass = self.decode_pass(tables, seqs, tokens)?;
        Ok(self.run_for_logits(&pass)?.concat())
    }

    fn queue_decode(
        &mut self,
        tables: &mut BlockTables,
        seqs: &[usize],
        feeds: &[Feed],
        draws: &[Option<DrawKey>],
        params: &SamplingParams,
    ) -> Result<(), InferError> {
        if seqs.len() != draws.len() || seqs.len() != feeds.len() {
            return Err(InferError::Internal(format!(
                "decode of {} sequences with {} feeds and {} draws",
                seqs.len(),
                feeds.len(),
                draws.len()
            )));
        }
        if self.flights.len() == 2 {
            return Err(InferError::Internal(
                "a third decode step queued before the first was collected".into(),
            ));
        }
        // A drawn feed reads the step queued last at its row's place among the drawn tokens;
        // checked before the pass takes its positions.
        let last = self.flights.back().map(|last| last.rows.as_slice());
        let mut tokens = Vec::with_capacity(feeds.len());
        let mut fed = Vec::with_capacity(feeds.len());
        for &feed in feeds {
            let (token, from) = match feed {
                Feed::Token(token) => (token, FEED_HOST),
                Feed::Drawn(row) => {
                    let from = last.and_then(|rows| rows.get(row).copied().flatten());
                    let from = from.ok_or_else(|| Feed::undrawn(row))?;
                    (0, from)
                }
            };
            tokens.push(token);
            fed.push(from);
        }
        let mut pass = self.decode_pass(tables, seqs, &tokens)?;
        pass.feeds.copy_from_slice(&fed);
        // Where each row's draw lands among the step's draws: in a graph every row of the
        // bucket draws (rows that asked for none are dropped); queued kernels draw the asked
        // rows alone.
        let graphs = !self.graphs.is_empty();
        let mut rows = Vec::with_capacity(draws.len());
        let mut words = Vec::with_capacity(draws.len() * DRAW_WORDS);
        if graphs {
            self.pad(
                &mut pass,
                seqs.len().next_power_of_two().min(self.limits.rows),
            )?;
            let idle = DrawKey {
                prompt: 0,
                sample: 0,
                token: 0,
            };
            for b in 0..pass.logit_rows.len() {
                words.extend(draw_words(
                    b,
                    draws.get(b).copied().flatten().unwrap_or(idle),
                ));
            }
            rows.extend(
                (0..draws.len() as u32)
                    .zip(draws)
                    .map(|(b, key)| key.map(|_| b)),
            );
        } else {
            for (b, key) in draws.iter().enumerate() {
                rows.push(key.map(|key| {
                    words.extend(draw_words(b, key));
                    (words.len() / DRAW_WORDS - 1) as u32
                }));
            }
        }
        let s = self.step;
        let turn = self.turn;
        let upload = InferError::device("upload a step's index arrays");
        let (at, index) = self
            .index_words(&pass, &words, &rule(params))
            .map_err(upload)?;
        let dst = s.index.sub(0, index.len()).map_err(upload)?;
        self.gpu
            .upload_queued(&mut self.inboxes[turn], dst, &index)
            .map_err(upload)?;
        let queued = if graphs {
            self.replay(at)
        } else {
            self.queue(&s, at)
        };
        // The fence follows the draws' download too, which reads the step scratch.
        let queued = queued.and_then(|()| match at.d {
            0 => Ok(()),
            d => self
                .gpu
                .download_queued(&mut self.outboxes[turn], s.picked.sub(0, 2 * d)?),
        });
        self.fence(queued)?;
        self.turn ^= 1;
        self.flights.push_back(Flight {
            turn,
            draws: at.d,
            rows,
        });
        Ok(())
    }

    fn collect(&mut self) -> Result<Vec<Option<(u32, f32)>>, InferError> {
        let flight = self
            .flights
            .pop_front()
            .ok_or_else(|| InferError::Internal("collected a decode step never queued".into()))?;
        let d = flight.draws;
        let mut words = vec![0u32; 2 * d];
        if d > 0 {
            self.outboxes[flight.turn]
                .read(&mut words)
                .map_err(InferError::device("read the drawn tokens"))?;
        }
        let (tokens, logprobs) = words.split_at(d);
        Ok(flight
            .rows
            .iter()
            .map(|row| row.map(|i| (tokens[i as usize], f32::from_bits(logprobs[i as usize]))))
            .collect())
    }

    fn draw(
        &mut self,
        rows: &[(&[f32], DrawKey)],
        params: &SamplingParams,
    ) -> Result<Vec<(u32, f32)>, InferError> {
        // The draws land where a decode step's do, which a step fed from it would read.
        if !self.flights.is_empty() {
            return Err(InferError::Internal(
                "a draw from host logits while decode steps are queued".into(),
            ));
        }
        let upload = InferError::device("upload logits to draw from");
        let v = self.config.vocab_size;
        let s = self.step;
        let rule = rule(params);
        let mut out = Vec::with_capacity(rows.len());
        for chunk in rows.chunks(self.limits.rows) {
            // The samples of a prompt draw from its one row of logits: each distinct row goes
            // up once.
            let mut uploaded: Vec<&[f32]> = Vec::with_capacity(chunk.len());
            let mut logits = Vec::with_capacity(chunk.len() * v);
            let mut words = Vec::with_capacity(chunk.len() * DRAW_WORDS);
            for &(values, key) in chunk {
                if values.len() != v {
                    return Err(InferError::Internal(format!(
                        "a row of {} logits to draw from; the vocabulary has {v}",
                        values.len()
                    )));
                }
                let row = match uploaded.iter().position(|&u| std::ptr::eq(u, values)) {
                    Some(row) => row,
                    None => {
                        uploaded.push(values);
                        logits.extend_from_slice(values);
                        uploaded.len() - 1
                    }
                };
                words.extend(draw_words(row, key));
            }
            let dst = s.logits.sub(0, logits.len()).map_err(upload)?;
            self.gpu.upload(dst, &logits).map_err(upload)?;
            self.execute(&s, &Pass::default(), &words, &rule)?;
            out.extend(self.picked(&s, chunk.len())?);
        }
        Ok(out)
    }

    fn copy_block(&mut self, from: usize, to: usize) -> Result<(), InferError> {
        let copy = InferError::device("copy a kv cache block");
        let be = self.shape.block_elems();
        let cache = self.cache_slice().map_err(copy)?;
        let (src, dst) = (
            cache.sub(from * be, be).map_err(copy)?,
            cache.sub(to * be, be).map_err(copy)?,
        );
        self.gpu.copy(dst, src).map_err(copy)?;
        let fence = self.gpu.record_fence().map_err(copy)?;
        self.buffers.cache.record_use(fence);
        Ok(())
    }
}

#[cfg(test)]
mod tests;
