//! The scratch of a pass on the GPU: the most one pass holds ([`Limits`]), its working
//! tensors carved from one device range ([`Scratch`]) and where its index arrays lie in the
//! index scratch ([`Index`]).

use half::bf16;
use miles_core::device::{AddressRange, DeviceError, GpuElement, GpuSlice};
use miles_core::model::LlamaConfig;
use miles_core::ops::gpu::{DRAW_WORDS, RULE_WORDS};

use super::{MAX_SPLIT, SPLIT_ROWS};
use crate::InferError;

/// Alignment of the scratch tensors, in bytes.
const SCRATCH_ALIGN: usize = 256;

/// The most one pass holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Limits {
    /// `N`: tokens.
    pub(super) tokens: usize,
    /// `R`: sequences, each with one row of logits.
    pub(super) rows: usize,
    /// Blocks of the longest sequence (`positions / P`, rounded up).
    pub(super) blocks: usize,
    /// Positions of the longest sequence (the engine's, at most the model's).
    pub(super) positions: usize,
}

/// Tokens a prefill pass holds at least, however short the sequences: a pass reads every weight
/// once, so short prompts are batched up to this many (the 1B preset's positions).
const PREFILL_TOKENS: usize = 4096;

impl Limits {
    /// For sequences of at most `positions` positions: a prefill pass takes any prompt whole
    /// (`positions` tokens, and at least [`PREFILL_TOKENS`]), a decode step `max_batch`
    /// sequences, and at most `max_batch` sequences in all.
    pub(crate) fn new(positions: usize, max_batch: usize, block_size: usize) -> Limits {
        Limits {
            tokens: positions.max(max_batch).max(PREFILL_TOKENS),
            rows: max_batch,
            blocks: positions.div_ceil(block_size),
            positions,
        }
    }

    /// A decode step's: one token for each of at most `max_batch` sequences.
    pub(super) fn step(self) -> Limits {
        Limits {
            tokens: self.rows,
            ..self
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
pub(super) struct Scratch {
    pub(super) x: GpuSlice<bf16>,       // (N, C) residual stream
    pub(super) ln: GpuSlice<bf16>,      // (N, C)
    pub(super) qkv: GpuSlice<bf16>,     // (N, (H + 2K) * D) the fused q/k/v product
    pub(super) q: GpuSlice<bf16>,       // (N, H*D) the queries, normed and turned
    pub(super) att: GpuSlice<bf16>,     // (N, H*D)
    pub(super) gate_up: GpuSlice<bf16>, // (N, 2F) the fused gate and up product
    pub(super) act: GpuSlice<bf16>,     // (N, F) silu(gate) * up
    pub(super) partials: GpuSlice<f32>, // (MAX_SPLIT, min(N, SPLIT_ROWS), C) fp32 partials
    pub(super) rows_ln: GpuSlice<bf16>, // (R, C) the normed rows that need logits
    pub(super) logits: GpuSlice<f32>,   // (R, V)
    pub(super) cos: GpuSlice<f32>,      // (positions, D/2)
    pub(super) sin: GpuSlice<f32>,      // (positions, D/2)
    pub(super) index: GpuSlice<u32>,    // the pass's index arrays, draws and rule ([`Index`])
    pub(super) picked: GpuSlice<u32>,   // (2R) drawn tokens, then their log-probs' bits
}

impl Scratch {
    /// The tensors laid out from `start`, and the bytes they span.
    pub(super) fn carve(
        start: u64,
        c: &LlamaConfig,
        l: Limits,
    ) -> Result<(Scratch, usize), DeviceError> {
        let (n, r) = (l.tokens, l.rows);
        let (h, qd, kvd, f) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let rope = l.positions * (c.head_dim / 2);
        let mut at = Carver { start, used: 0 };
        let scratch = Scratch {
            x: at.take(n * h)?,
            ln: at.take(n * h)?,
            qkv: at.take(n * (qd + 2 * kvd))?,
            q: at.take(n * qd)?,
            att: at.take(n * qd)?,
            gate_up: at.take(n * 2 * f)?,
            act: at.take(n * f)?,
            partials: at.take(MAX_SPLIT * n.min(SPLIT_ROWS) * h)?,
            rows_ln: at.take(r * h)?,
            logits: at.take(r * c.vocab_size)?,
            cos: at.take(rope)?,
            sin: at.take(rope)?,
            index: at.take(Index::new(n, r, r, l.blocks).len)?,
            picked: at.take(2 * r)?,
        };
        Ok((scratch, at.used))
    }
}

/// Where each array of a pass lies in the index scratch, in words: `n` token ids, positions,
/// sequence rows, slots and feeds (where a token drawn by the step before is taken instead of
/// its id, [`FedIds`](miles_core::ops::gpu::FedIds)); `r` logit rows; `r` block tables of
/// `blocks`; `d` draws of [`DRAW_WORDS`]; the [`RULE_WORDS`] of the sampling rule.
#[derive(Clone, Copy, Debug)]
pub(super) struct Index {
    pub(super) n: usize,
    pub(super) r: usize,
    pub(super) d: usize,
    pub(super) tables: usize,
    pub(super) draws: usize,
    pub(super) rule: usize,
    pub(super) len: usize,
}

impl Index {
    pub(super) fn new(n: usize, r: usize, d: usize, blocks: usize) -> Index {
        let tables = 5 * n + r;
        let draws = tables + r * blocks;
        let rule = draws + DRAW_WORDS * d;
        Index {
            n,
            r,
            d,
            tables,
            draws,
            rule,
            len: rule + RULE_WORDS,
        }
    }
}

/// Bytes of the scratch of a prefill pass of `limits` under `config`, and of a decode step's.
///
/// # Errors
/// [`InferError::Device`] when a size overflows the address arithmetic.
pub(crate) fn scratch_bytes(
    config: &LlamaConfig,
    limits: Limits,
) -> Result<[usize; 2], InferError> {
    let bytes = |limits| {
        Scratch::carve(0, config, limits)
            .map(|(_, bytes)| bytes)
            .map_err(InferError::device("size the gpu scratch"))
    };
    Ok([bytes(limits)?, bytes(limits.step())?])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scratch_follows_the_engines_positions_not_the_models() {
        // Llama 3.2 1B's shapes take 131,072 positions; a run of 1,024-token prompts and 1,024
        // new tokens fills 2,048 (prefill scratch 9.48 GB against 0.33 GB).
        let mut c = LlamaConfig::preset("1b").unwrap_or_else(|e| panic!("{e}"));
        c.max_position_embeddings = 131_072;
        let bytes = |limits| {
            Scratch::carve(0, &c, limits)
                .map(|(_, bytes)| bytes)
                .unwrap_or_else(|e| panic!("{e}"))
        };
        let (model, run) = (Limits::new(131_072, 256, 16), Limits::new(2048, 256, 16));
        assert_eq!((run.tokens, run.blocks, run.positions), (4096, 128, 2048));
        let (whole, sized) = (bytes(model), bytes(run));
        assert!(sized * 20 < whole, "{sized} bytes against {whole}");
        // A decode step uploads one block table row per sequence.
        let table_words = |l: Limits| {
            Index::new(128, 128, 128, l.blocks).draws - Index::new(128, 128, 128, 0).draws
        };
        assert_eq!(table_words(model), 128 * 8192);
        assert_eq!(table_words(run), 128 * 128);
        assert!(bytes(model.step()) > bytes(run.step()));
    }
}
