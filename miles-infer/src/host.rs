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
    /// queued); a [`Feed::Drawn`] names a row of the last.
    pub queued: VecDeque<Draws>,
}

/// A decode step's draws by row.
pub(crate) type Draws = Vec<Option<(u32, f32)>>;

/// The tokens of `feeds`, those drawn taken from `last`.
fn fed_tokens(feeds: &[Feed], last: Option<&Draws>) -> Result<Vec<u32>, InferError> {
    feeds
        .iter()
        .map(|&feed| match feed {
            Feed::Token(token) => Ok(token),
            Feed::Drawn(row) => last
                .and_then(|draws| draws.get(row).copied().flatten())
                .map(|(token, _)| token)
                .ok_or_else(|| Feed::undrawn(row)),
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
        let tokens = fed_tokens(feeds, self.queued.back())?;
        let logits = self.decode_logits(tables, seqs, &tokens)?;
        let drawn: Draws = logits
            .par_chunks_exact(v)
            .zip(draws)
            .map(|(row, draw)| draw.map(|key| sample_token(row, params, key)))
            .collect();
        self.queued.push_back(drawn);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drawn_feeds_take_the_last_steps_draws_and_refuse_a_row_without_one() {
        let last: Draws = vec![Some((7, -0.5)), None];
        let feeds = [Feed::Token(3), Feed::Drawn(0)];
        assert_eq!(fed_tokens(&feeds, Some(&last)).unwrap(), vec![3, 7]);
        for (feeds, last) in [
            (&[Feed::Drawn(1)][..], Some(&last)),
            (&[Feed::Drawn(2)], Some(&last)),
            (&[Feed::Drawn(0)], None),
        ] {
            assert!(
                matches!(fed_tokens(feeds, last), Err(InferError::Internal(_))),
                "{feeds:?} from {last:?}"
            );
        }
    }

    #[test]
    fn a_collect_with_no_step_queued_is_refused() {
        let config = miles_core::model::LlamaConfig::preset("tiny").unwrap();
        let model = Transformer::new(config.clone());
        let mut scratch = DecodeScratch::new(&config, 1, 8);
        let mut step = HostStep {
            model: &model,
            params: &[],
            storage: &mut [],
            scratch: &mut scratch,
            block_floats: 0,
            queued: VecDeque::new(),
        };
        assert!(matches!(step.collect(), Err(InferError::Internal(_))));
    }
}
