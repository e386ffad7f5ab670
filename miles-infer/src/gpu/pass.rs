//! A pass's index arrays, built on the host: each sequence's tokens, positions, cache slots
//! and block table, and the rows that need logits.

use miles_core::ops::gpu::FEED_HOST;

use super::GpuModel;
use crate::InferError;
use crate::paged::BlockTables;

/// The index arrays of one pass, built on the host.
#[derive(Debug, Default)]
pub(super) struct Pass {
    pub ids: Vec<u32>,        // (N) token ids
    pub positions: Vec<u32>,  // (N)
    pub seq_rows: Vec<u32>,   // (N) row of `tables`
    pub slots: Vec<u32>,      // (N) block * P + position % P
    pub feeds: Vec<u32>,      // (N) the drawn token taken instead of the id, or FEED_HOST
    pub logit_rows: Vec<u32>, // (R) token index of each sequence's last token
    pub tables: Vec<u32>,     // (R, blocks)
}

impl GpuModel {
    /// Adds `tokens` at positions `first..` of `seq` to `pass`, with one row of logits for
    /// the last of them.
    pub(super) fn push(
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
        if tokens.is_empty() || end > self.limits.positions || blocks.len() > self.limits.blocks {
            return Err(InferError::Internal(format!(
                "sequence {seq} with {} blocks cannot take positions {first}..{end} (the engine's positions {})",
                blocks.len(),
                self.limits.positions
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
            pass.feeds.push(FEED_HOST);
        }
        pass.logit_rows.push((pass.ids.len() - 1) as u32);
        let start = pass.tables.len();
        pass.tables.resize(start + self.limits.blocks, 0);
        for (entry, &block) in pass.tables[start..].iter_mut().zip(blocks) {
            *entry = block as u32;
        }
        Ok(())
    }

    /// Pads the decode `pass` to `rows` sequences: each extra row feeds token 0 at position 0
    /// of a table holding the spare block alone, so it writes nowhere a sequence reads.
    pub(super) fn pad(&self, pass: &mut Pass, rows: usize) -> Result<(), InferError> {
        let slot = self
            .shape
            .slot(self.spare_block as usize, 0)
            .map_err(InferError::device("address the kv cache"))?;
        while pass.logit_rows.len() < rows {
            let row = pass.logit_rows.len() as u32;
            pass.ids.push(0);
            pass.positions.push(0);
            pass.seq_rows.push(row);
            pass.slots.push(slot);
            pass.feeds.push(FEED_HOST);
            pass.logit_rows.push(row);
            let start = pass.tables.len();
            pass.tables.resize(start + self.limits.blocks, 0);
            pass.tables[start] = self.spare_block;
        }
        Ok(())
    }

    /// The pass appending `tokens[b]` to `seqs[b]`.
    pub(super) fn decode_pass(
        &self,
        tables: &mut BlockTables,
        seqs: &[usize],
        tokens: &[u32],
    ) -> Result<Pass, InferError> {
        if seqs.len() != tokens.len() || seqs.len() > self.limits.rows {
            return Err(InferError::Internal(format!(
                "decode of {} sequences with {} tokens; a step takes at most {}",
                seqs.len(),
                tokens.len(),
                self.limits.rows
            )));
        }
        // The decode attention stores each token's key and value while other blocks read the
        // cache: one token a sequence, or a block could read a position not yet stored.
        if let Some(seq) = repeated(seqs) {
            return Err(InferError::Internal(format!(
                "decode of sequence {seq} twice in one step"
            )));
        }
        let mut pass = Pass::default();
        for (b, &seq) in seqs.iter().enumerate() {
            let first = tables.advance(seq, 1)?;
            self.push(&mut pass, tables, seq, first, &tokens[b..=b])?;
        }
        Ok(pass)
    }
}

/// A sequence `seqs` names more than once, if any.
fn repeated(seqs: &[usize]) -> Option<usize> {
    let mut sorted = seqs.to_vec();
    sorted.sort_unstable();
    sorted.windows(2).find(|w| w[0] == w[1]).map(|w| w[0])
}

#[cfg(test)]
mod tests {
    use super::repeated;

    #[test]
    fn a_sequence_named_twice_in_a_decode_step_is_found() {
        assert_eq!(repeated(&[3, 1, 2]), None);
        assert_eq!(repeated(&[]), None);
        assert_eq!(repeated(&[4, 9, 2, 9]), Some(9));
    }
}
