//! The engine's GPU path: bf16 weights in the `weights` region, the bf16 paged cache and the
//! step's scratch in the `kv_cache` region, every kernel queued on the [`Gpu`]'s stream.
//!
//! A step (a prefill of several prompts, or a decode of one token per sequence) is one pass
//! over `N` tokens, each with its sequence and position: embedding; per layer RMSNorm, the q,
//! k, v products (with their biases, and the per-head q/k norms, in the families that have
//! them), RoPE at each token's position, the new keys and values written into the
//! cache through the block tables, paged attention over each sequence's cached positions, the
//! o product and the residual, RMSNorm, gate and up, SwiGLU, down and the residual; then the
//! final norm and the LM head (fp32 logits) for the rows that need logits only: the last token
//! of each sequence. The logits come back to the host for the sampler, and a fence on every
//! buffer the pass used lets the memory manager pause the tags afterwards.
//!
//! A pass holds at most `max(max_position_embeddings, max_batch)` tokens (so any prompt fits
//! whole) and `max_batch` sequences; a prefill of more is split into several passes.

use std::sync::Arc;

use half::bf16;
use miles_core::device::{AddressRange, DeviceError, Gemm, Gpu, GpuElement, GpuSlice, Transpose};
use miles_core::model::{LlamaConfig, ParamKind, ParamLayout};
use miles_core::ops::RopeTable;
use miles_core::ops::gpu::{PAGED_MAX_HEAD_DIM, PagedCache, PagedTokens};
use miles_core::{Buffer, Device, DeviceKind, Fence, MemoryManager};
use rayon::prelude::*;

use crate::InferError;
use crate::paged::BlockTables;
use crate::schedule::Step;

/// Bytes of one weight or cache element (bf16).
pub(crate) const ELEMENT_BYTES: usize = 2;

/// Alignment of the scratch tensors, in bytes.
const SCRATCH_ALIGN: usize = 256;

/// Elements converted to bf16 per parallel task of a weight write.
const CONVERT_CHUNK: usize = 1 << 16;

/// The most one pass holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Limits {
    /// `N`: tokens.
    tokens: usize,
    /// `R`: sequences, each with one row of logits.
    rows: usize,
    /// Blocks of the longest sequence (`max_position_embeddings / P`, rounded up).
    blocks: usize,
}

impl Limits {
    /// A pass takes any prompt whole (`max_position_embeddings` tokens), a decode step of
    /// `max_batch` sequences, and at most `max_batch` sequences in all.
    pub(crate) fn new(config: &LlamaConfig, max_batch: usize, block_size: usize) -> Limits {
        Limits {
            tokens: config.max_position_embeddings.max(max_batch),
            rows: max_batch,
            blocks: config.max_position_embeddings.div_ceil(block_size),
        }
    }
}

/// Hands out aligned tensors from a device range, front to back.
struct Carver {
    start: u64,
    used: usize,
}

impl Carver {
    fn take<T: GpuElement>(&mut self, len: usize) -> Result<GpuSlice<T>, DeviceError> {
        let bytes = len * std::mem::size_of::<T>();
        let slice = GpuSlice::of(AddressRange {
            start: self.start + self.used as u64,
            len: bytes,
        })?;
        self.used = (self.used + bytes).next_multiple_of(SCRATCH_ALIGN);
        Ok(slice)
    }
}

/// The working tensors of a pass, sized for [`Limits`].
#[derive(Clone, Copy, Debug)]
struct Scratch {
    x: GpuSlice<bf16>,       // (N, C) residual stream
    ln: GpuSlice<bf16>,      // (N, C)
    q: GpuSlice<bf16>,       // (N, H*D)
    k: GpuSlice<bf16>,       // (N, K*D)
    v: GpuSlice<bf16>,       // (N, K*D)
    att: GpuSlice<bf16>,     // (N, H*D)
    proj: GpuSlice<bf16>,    // (N, C)
    gate: GpuSlice<bf16>,    // (N, F), then silu(gate) * up in place
    up: GpuSlice<bf16>,      // (N, F)
    rows: GpuSlice<bf16>,    // (R, C) the residual rows that need logits
    rows_ln: GpuSlice<bf16>, // (R, C)
    logits: GpuSlice<f32>,   // (R, V)
    cos: GpuSlice<f32>,      // (P_max, D/2)
    sin: GpuSlice<f32>,      // (P_max, D/2)
    index: GpuSlice<u32>, // ids, positions, seq rows, slots (N each), logit rows (R), tables (R, blocks)
}

impl Scratch {
    /// The tensors laid out from `start`, and the bytes they span.
    fn carve(start: u64, c: &LlamaConfig, l: Limits) -> Result<(Scratch, usize), DeviceError> {
        let (n, r) = (l.tokens, l.rows);
        let (h, qd, kvd, f) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let rope = c.max_position_embeddings * (c.head_dim / 2);
        let mut at = Carver { start, used: 0 };
        let scratch = Scratch {
            x: at.take(n * h)?,
            ln: at.take(n * h)?,
            q: at.take(n * qd)?,
            k: at.take(n * kvd)?,
            v: at.take(n * kvd)?,
            att: at.take(n * qd)?,
            proj: at.take(n * h)?,
            gate: at.take(n * f)?,
            up: at.take(n * f)?,
            rows: at.take(r * h)?,
            rows_ln: at.take(r * h)?,
            logits: at.take(r * c.vocab_size)?,
            cos: at.take(rope)?,
            sin: at.take(rope)?,
            index: at.take(4 * n + r + r * l.blocks)?,
        };
        Ok((scratch, at.used))
    }
}

/// Bytes of the scratch of a pass of `limits` under `config`.
///
/// # Errors
/// [`InferError::Device`] when a size overflows the address arithmetic.
pub(crate) fn scratch_bytes(config: &LlamaConfig, limits: Limits) -> Result<usize, InferError> {
    Scratch::carve(0, config, limits)
        .map(|(_, bytes)| bytes)
        .map_err(InferError::device("size the gpu scratch"))
}

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
    if config.head_dim > PAGED_MAX_HEAD_DIM || !config.head_dim.is_multiple_of(2) {
        return Err(bad(format!(
            "head dim {} is not supported on the gpu; it must be even and at most {PAGED_MAX_HEAD_DIM}",
            config.head_dim
        )));
    }
    Ok(())
}

/// The model on the GPU: its buffers, the cache's shape and the scratch tensors.
#[derive(Debug)]
pub(crate) struct GpuModel {
    gpu: Arc<Gpu>,
    config: LlamaConfig,
    layout: ParamLayout,
    rope: RopeTable,
    limits: Limits,
    shape: PagedCache,
    weights: Buffer, // (params) bf16, in the parameter table's order
    cache: Buffer,   // (blocks, L, 2, P, K*D) bf16
    scratch_buffer: Buffer,
    scratch: Scratch,
}

impl GpuModel {
    /// The model over `weights` (bf16, the parameter table's size), `cache` (`num_blocks`
    /// blocks of `block_size` positions, bf16) and `scratch` ([`scratch_bytes`] of `limits`).
    ///
    /// # Errors
    /// [`InferError::Internal`] when a buffer is smaller than its contents;
    /// [`InferError::Device`] when the scratch cannot be laid out.
    pub(crate) fn new(
        gpu: Arc<Gpu>,
        config: &LlamaConfig,
        layout: &ParamLayout,
        limits: Limits,
        num_blocks: usize,
        block_size: usize,
        buffers: [Buffer; 3],
    ) -> Result<GpuModel, InferError> {
        let [weights, cache, scratch_buffer] = buffers;
        let shape = PagedCache {
            num_blocks,
            num_layers: config.num_layers,
            block_size,
            kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
        };
        let (scratch, bytes) = Scratch::carve(scratch_buffer.address(), config, limits)
            .map_err(InferError::device("lay out the gpu scratch"))?;
        let short = |what: &str, have: usize, need: usize| {
            InferError::Internal(format!(
                "the gpu {what} buffer holds {have} bytes, it needs {need}"
            ))
        };
        for (what, buffer, need) in [
            ("weights", &weights, layout.len() * ELEMENT_BYTES),
            ("kv cache", &cache, shape.elems() * ELEMENT_BYTES),
            ("scratch", &scratch_buffer, bytes),
        ] {
            if buffer.len() < need {
                return Err(short(what, buffer.len(), need));
            }
        }
        Ok(GpuModel {
            rope: config.rope_table(),
            gpu,
            config: config.clone(),
            layout: layout.clone(),
            limits,
            shape,
            weights,
            cache,
            scratch_buffer,
            scratch,
        })
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
        self.weights
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
        let dst = GpuSlice::<bf16>::of(self.weights.range())
            .and_then(|all| all.sub(0, len))
            .map_err(copy)?;
        self.gpu.wait_for(ready).map_err(copy)?;
        self.gpu.copy(dst, src).map_err(copy)?;
        let done = self.gpu.record_fence().map_err(copy)?;
        self.weights.record_use(done.clone());
        done.wait().map_err(copy)
    }

    /// Uploads what a generate call needs besides the weights: the rotary tables, which live in
    /// the `kv_cache` region and are dropped with it.
    ///
    /// # Errors
    /// [`InferError::Device`] when the upload fails.
    pub(crate) fn begin(&self) -> Result<(), InferError> {
        let upload = InferError::device("upload the rotary tables");
        let s = &self.scratch;
        for (table, values) in [(s.cos, self.rope.cos()), (s.sin, self.rope.sin())] {
            self.gpu.upload(table, values).map_err(upload)?;
        }
        Ok(())
    }

    fn weight(&self, kind: ParamKind, layer: usize) -> Result<GpuSlice<bf16>, DeviceError> {
        let range = self.layout.range(kind, layer);
        GpuSlice::<bf16>::of(self.weights.range())?.sub(range.start, range.len())
    }

    fn cache_slice(&self) -> Result<GpuSlice<bf16>, DeviceError> {
        GpuSlice::<bf16>::of(self.cache.range())?.sub(0, self.shape.elems())
    }

    /// Runs one pass and returns the logits `(V)` of each of its sequences.
    fn run(&self, pass: &Pass) -> Result<Vec<Vec<f32>>, InferError> {
        let (r, v) = (pass.logit_rows.len(), self.config.vocab_size);
        let step = InferError::device("run a step on the gpu");
        let queued = self.queue(pass);
        // Every buffer the pass touched waits for its last kernel before a pause, even when a
        // launch failed after others were queued.
        let fence = self.gpu.record_fence();
        if let Ok(fence) = &fence {
            for buffer in [&self.weights, &self.cache, &self.scratch_buffer] {
                buffer.record_use(fence.clone());
            }
        }
        queued.map_err(step)?;
        fence.map_err(step)?;
        let mut logits = vec![0.0f32; r * v];
        let out = self.scratch.logits.sub(0, r * v).map_err(step)?;
        self.gpu.download(&mut logits, out).map_err(step)?;
        Ok(logits.chunks_exact(v).map(<[f32]>::to_vec).collect())
    }

    /// Uploads the pass's index arrays and queues its kernels.
    fn queue(&self, pass: &Pass) -> Result<(), DeviceError> {
        let (g, c, s) = (&*self.gpu, &self.config, &self.scratch);
        let (n, r) = (pass.ids.len(), pass.logit_rows.len());
        let (h, qd, kvd, f) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let mut index = Vec::with_capacity(4 * n + r + pass.tables.len());
        for part in [
            &pass.ids,
            &pass.positions,
            &pass.seq_rows,
            &pass.slots,
            &pass.logit_rows,
            &pass.tables,
        ] {
            index.extend_from_slice(part);
        }
        g.upload(s.index.sub(0, index.len())?, &index)?;
        let ids = s.index.sub(0, n)?;
        let positions = s.index.sub(n, n)?;
        let slots = s.index.sub(3 * n, n)?;
        let logit_rows = s.index.sub(4 * n, r)?;
        let tokens = PagedTokens {
            positions,
            seq_rows: s.index.sub(2 * n, n)?,
            tables: s.index.sub(4 * n + r, pass.tables.len())?,
            max_blocks: self.limits.blocks,
        };
        let (x, ln, att, proj) = (
            s.x.sub(0, n * h)?,
            s.ln.sub(0, n * h)?,
            s.att.sub(0, n * qd)?,
            s.proj.sub(0, n * h)?,
        );
        let (q, k, v) = (
            s.q.sub(0, n * qd)?,
            s.k.sub(0, n * kvd)?,
            s.v.sub(0, n * kvd)?,
        );
        let (gate, up) = (s.gate.sub(0, n * f)?, s.up.sub(0, n * f)?);
        let cache = self.cache_slice()?;
        let eps = c.rms_norm_eps;
        // y = x W^T for an HF weight W (out, in).
        let linear = |rows, out, inp| Gemm::new(rows, out, inp, Transpose::No, Transpose::Yes);
        g.embedding_forward(x, ids, self.weight(ParamKind::Embedding, 0)?, h)?; // (N, C)
        for l in 0..c.num_layers {
            let w = |kind| self.weight(kind, l);
            g.rmsnorm_forward(ln, None, x, w(ParamKind::InputNorm)?, eps)?;
            g.gemm(linear(n, qd, h), q, ln, w(ParamKind::QProj)?)?; // (N, H*D)
            g.gemm(linear(n, kvd, h), k, ln, w(ParamKind::KProj)?)?; // (N, K*D)
            g.gemm(linear(n, kvd, h), v, ln, w(ParamKind::VProj)?)?; // (N, K*D)
            if c.qkv_bias {
                g.bias_add(q, w(ParamKind::QBias)?)?;
                g.bias_add(k, w(ParamKind::KBias)?)?;
                g.bias_add(v, w(ParamKind::VBias)?)?;
            }
            if c.qk_norm {
                // Per head (rows of D), in place, before the rotation.
                g.rmsnorm_forward(q, None, q, w(ParamKind::QNorm)?, eps)?; // (N, H, D)
                g.rmsnorm_forward(k, None, k, w(ParamKind::KNorm)?, eps)?; // (N, K, D)
            }
            g.rope_forward(q, positions, s.cos, s.sin, c.num_heads, c.head_dim)?;
            g.rope_forward(k, positions, s.cos, s.sin, c.num_kv_heads, c.head_dim)?;
            g.paged_kv_write(cache, &self.shape, l, k, v, slots)?;
            g.paged_attention(att, q, cache, &self.shape, l, &tokens)?;
            g.gemm(linear(n, h, qd), proj, att, w(ParamKind::OProj)?)?; // (N, C)
            g.residual_add(x, proj)?;
            g.rmsnorm_forward(ln, None, x, w(ParamKind::PostAttentionNorm)?, eps)?;
            g.gemm(linear(n, f, h), gate, ln, w(ParamKind::GateProj)?)?; // (N, F)
            g.gemm(linear(n, f, h), up, ln, w(ParamKind::UpProj)?)?; // (N, F)
            g.swiglu_forward(gate, gate, up)?;
            g.gemm(linear(n, h, f), proj, gate, w(ParamKind::DownProj)?)?; // (N, C)
            g.residual_add(x, proj)?;
        }
        // Only the rows that need logits go through the final norm and the head: gather them
        // (an embedding lookup whose table is the residual stream).
        let (rows, rows_ln) = (s.rows.sub(0, r * h)?, s.rows_ln.sub(0, r * h)?);
        g.embedding_forward(rows, logit_rows, x, h)?; // (R, C)
        g.rmsnorm_forward(
            rows_ln,
            None,
            rows,
            self.weight(ParamKind::FinalNorm, 0)?,
            eps,
        )?;
        let logits = s.logits.sub(0, r * c.vocab_size)?; // (R, V) fp32
        g.gemm(
            linear(r, c.vocab_size, h),
            logits,
            rows_ln,
            self.weight(ParamKind::LmHead, 0)?,
        )
    }

    /// Adds `tokens` at positions `first..` of `seq` to `pass`, with one row of logits for
    /// the last of them.
    fn push(
        &self,
        pass: &mut Pass,
        tables: &BlockTables,
        seq: usize,
        first: usize,
        tokens: &[u32],
    ) -> Result<(), InferError> {
        let blocks = tables.blocks(seq)?;
        let (c, p) = (&self.config, self.shape.block_size);
        let end = first + tokens.len();
        if tokens.is_empty() || end > c.max_position_embeddings || blocks.len() > self.limits.blocks
        {
            return Err(InferError::Internal(format!(
                "sequence {seq} with {} blocks cannot take positions {first}..{end} (model positions {})",
                blocks.len(),
                c.max_position_embeddings
            )));
        }
        if let Some(&id) = tokens.iter().find(|&&id| id as usize >= c.vocab_size) {
            return Err(InferError::Internal(format!(
                "token {id} of sequence {seq} is outside the vocabulary of {}",
                c.vocab_size
            )));
        }
        let row = pass.logit_rows.len() as u32;
        for (i, &id) in tokens.iter().enumerate() {
            let pos = first + i;
            let block = blocks.get(pos / p).ok_or_else(|| {
                InferError::Internal(format!("sequence {seq} has no block for position {pos}"))
            })?;
            let slot = self
                .shape
                .slot(*block, pos)
                .map_err(InferError::device("address the kv cache"))?;
            pass.ids.push(id);
            pass.positions.push(pos as u32);
            pass.seq_rows.push(row);
            pass.slots.push(slot);
        }
        pass.logit_rows.push((pass.ids.len() - 1) as u32);
        let start = pass.tables.len();
        pass.tables.resize(start + self.limits.blocks, 0);
        for (entry, &block) in pass.tables[start..].iter_mut().zip(blocks) {
            *entry = block as u32;
        }
        Ok(())
    }
}

/// The index arrays of one pass, built on the host.
#[derive(Debug, Default)]
struct Pass {
    ids: Vec<u32>,        // (N) token ids
    positions: Vec<u32>,  // (N)
    seq_rows: Vec<u32>,   // (N) row of `tables`
    slots: Vec<u32>,      // (N) block * P + position % P
    logit_rows: Vec<u32>, // (R) token index of each sequence's last token
    tables: Vec<u32>,     // (R, blocks)
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
                out.extend(self.run(&pass)?);
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
            out.extend(self.run(&pass)?);
        }
        Ok(out)
    }

    fn decode(
        &mut self,
        tables: &mut BlockTables,
        seqs: &[usize],
        tokens: &[u32],
    ) -> Result<Vec<f32>, InferError> {
        if seqs.len() != tokens.len() || seqs.len() > self.limits.rows {
            return Err(InferError::Internal(format!(
                "decode of {} sequences with {} tokens; a step takes at most {}",
                seqs.len(),
                tokens.len(),
                self.limits.rows
            )));
        }
        let mut pass = Pass::default();
        for (b, &seq) in seqs.iter().enumerate() {
            let first = tables.advance(seq, 1)?;
            self.push(&mut pass, tables, seq, first, &tokens[b..=b])?;
        }
        Ok(self.run(&pass)?.concat())
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
        self.cache.record_use(fence);
        Ok(())
    }
}

#[cfg(test)]
mod tests;
