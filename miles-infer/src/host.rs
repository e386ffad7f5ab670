//! The engine's CPU path: the model computes from host views of the fp32 weights and the fp32
//! paged cache ([`PagedKv`]), one prompt at a time in prefill and batch-invariantly in decode.

use std::collections::VecDeque;

use miles_core::model::{DecodeScratch, Transformer};

use rayon::prelude::*;

use crate::paged::{BlockTables, PagedKv, copy_host_block};
use crate::sampling::{DrawKey, sample_token};
use crate::schedule::{Feed, Step};
use crate::{InferError, SamplingParams};

/// The model, its weights and the cache storage, borrowed for one generate call.
pub(crate) struct HostStep<'a> {
    pub model: &'a Transformer,
    pub params: &'a [f32],
    pub storage: &'a mut [f32],
    pub scratch: &'a mut DecodeScratch,
    /// Floats of one cache block ([`BlockTables::block_floats`]).
    pub block_floats: usize,
    /// The draws of the decode steps queued and not collected, oldest first (each ran when
    /// queued).
    pub queued: VecDeque<Draws>,
    /// The draws of the decode step queued last, which a [`Feed::Drawn`] names.
    pub last: Option<Draws>,
}

/// A decode step's draws by row.
pub(crate) type Draws = Vec<Option<(u32, f32)>>;

/// The tokens of `feeds`, those drawn taken from `last`.
pub(crate) fn fed_tokens(feeds: &[Feed], last: Option<&Draws>) -> Result<Vec<u32>, InferError> {
    feeds
        .iter()
        .map(|&feed| match feed {
            Feed::Token(token) => Ok(token),
            Feed::Drawn(row) => last
                .and_then(|draws| draws.get(row).copied().flatten())
                .map(|(token, _)| token)
                .ok_or_else(|| {
                    InferError::Internal(format!(
                        "a decode step fed from row {row} of a step before it that drew none there"
                    ))
                }),
        })
        .collect()
}

impl Step for HostStep<'_> {
    fn prefill(
        &mut self,
        tables: &mut BlockTables,
        seqs: &[usize],
        prompts: &[&[u32]],
    ) -> Result<Vec<Vec<f32>>, InferError> {
        let v = self.model.config().vocab_size;
        let mut out = Vec::with_capacity(seqs.len());
        for (&seq, prompt) in seqs.iter().zip(prompts) {
            let mut logits = vec![0.0; v];
            let mut kv = PagedKv {
                tables: &mut *tables,
                storage: &mut *self.storage,
            };
            self.model
                .prefill(self.params, &mut kv, seq, prompt, &mut logits)?;
            out.push(logits);
        }
        Ok(out)
    }

    fn decode_logits(
        &mut self,
        tables: &mut BlockTables,
        seqs: &[usize],
        tokens: &[u32],
    ) -> Result<Vec<f32>, InferError> {
        let mut logits = vec![0.0; seqs.len() * self.model.config().vocab_size];
        let mut kv = PagedKv {
            tables,
            storage: &mut *self.storage,
        };
        self.model.decode_step(
            self.params,
            &mut kv,
            seqs,
            tokens,
            &mut logits,
            self.scratch,
        )?;
        Ok(logits)
    }

    fn queue_decode(
        &mut self,
        tables: &mut BlockTables,
        seqs: &[usize],
        feeds: &[Feed],
        draws: &[Option<DrawKey>],
        params: &SamplingParams,
    ) -> Result<(), InferError> {
        let v = self.model.config().vocab_size;
        let tokens = fed_tokens(feeds, self.last.as_ref())?;
        let logits = self.decode_logits(tables, seqs, &tokens)?;
        let drawn: Draws = logits
            .par_chunks_exact(v)
            .zip(draws)
            .map(|(row, draw)| draw.map(|key| sample_token(row, params, key)))
            .collect();
        self.queued.push_back(drawn.clone());
        self.last = Some(drawn);
        Ok(())
    }

    fn collect(&mut self) -> Result<Draws, InferError> {
        self.queued
            .pop_front()
            .ok_or_else(|| InferError::Internal("collected a decode step never queued".into()))
    }

    fn draw(
        &mut self,
        rows: &[(&[f32], DrawKey)],
        params: &SamplingParams,
    ) -> Result<Vec<(u32, f32)>, InferError> {
        self.last = None;
        Ok(rows
            .par_iter()
            .map(|&(row, key)| sample_token(row, params, key))
            .collect())
    }

    fn copy_block(&mut self, from: usize, to: usize) -> Result<(), InferError> {
        copy_host_block(self.storage, self.block_floats, from, to);
        Ok(())
    }
}
