//! How the trainer sizes its work: batches cut into micro-batches of whole sequences within a
//! token budget, and the activation region that holds any of them.

use super::GpuActivationLayout;
use crate::model::{LlamaConfig, TrainBatch};
use crate::ops::gpu::SQUARE_PARTIALS;

/// Room for one buffer's rounding to the memory manager's block alignment.
pub(super) const BLOCK_SLACK: usize = 256;

/// `batch` cut into runs of whole sequences of at most `max_tokens` tokens (one sequence at
/// least); the batch is checked, so the cuts lie inside it.
pub(super) fn micro_batches<'a>(batch: &TrainBatch<'a>, max_tokens: usize) -> Vec<TrainBatch<'a>> {
    let t = batch.seq;
    let per = (max_tokens / t.max(1)).max(1);
    (0..batch.batch)
        .step_by(per)
        .map(|first| batch.sequences(first..(first + per).min(batch.batch)))
        .collect()
}

/// Bytes the activation region needs: the largest activations of any batch shape of at most
/// `max_tokens` tokens (whole sequences of up to `max_position_embeddings` positions), plus
/// block rounding of its four buffers.
pub(super) fn activation_arena_bytes(c: &LlamaConfig, max_tokens: usize) -> usize {
    let longest = max_tokens.min(c.max_position_embeddings);
    let largest = (1..=longest)
        .map(|t| GpuActivationLayout::new(c, max_tokens / t, t).bytes())
        .max()
        .unwrap_or(0);
    largest + SCALAR_BYTES + 4 * BLOCK_SLACK
}

/// The trainer's scalar scratch in the activations' region: the loss's sum over ranks, two sums
/// of squares and their partial sums.
pub(super) const SCALAR_BYTES: usize = (2 + SQUARE_PARTIALS) * size_of::<f32>();

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_the_batch_in_order_with_its_normaliser() {
        let inputs: Vec<u32> = (0..15).collect();
        let weights = vec![1.0; 15];
        let batch = TrainBatch {
            batch: 5,
            seq: 3,
            inputs: &inputs,
            targets: &inputs,
            weights: &weights,
            normaliser: 15.0,
            entropy_mask: None,
            entropy_coef: 0.0,
        };
        let parts: Vec<TrainBatch<'_>> = (0..2).map(|r| batch.shard(r, 2).unwrap()).collect();
        assert_eq!((parts[0].batch, parts[1].batch), (3, 2));
        assert_eq!(parts[0].inputs, &inputs[..9]);
        assert_eq!(parts[1].inputs, &inputs[9..]);
        assert!(parts.iter().all(|p| p.normaliser == 15.0 && p.seq == 3));
        assert!(batch.shard(2, 2).is_err());
        assert!(batch.shard(0, 6).is_err());
    }

    #[test]
    fn micro_batches_cut_whole_sequences_within_the_token_budget() {
        let (b, t) = (5, 3);
        let inputs: Vec<u32> = (0..15).collect();
        let targets: Vec<u32> = (100..115).collect();
        let weights: Vec<f32> = (0..15).map(|i| i as f32).collect();
        let batch = TrainBatch {
            batch: b,
            seq: t,
            inputs: &inputs,
            targets: &targets,
            weights: &weights,
            normaliser: 7.0,
            entropy_mask: None,
            entropy_coef: 0.0,
        };
        let cuts = micro_batches(&batch, 7);
        assert_eq!(cuts.iter().map(|m| m.batch).collect::<Vec<_>>(), [2, 2, 1]);
        let joined: Vec<u32> = cuts.iter().flat_map(|m| m.inputs.to_vec()).collect();
        assert_eq!(joined, inputs);
        assert_eq!(cuts[2].targets, &targets[12..]);
        assert_eq!(cuts[1].weights, &weights[6..12]);
        assert!(cuts.iter().all(|m| m.normaliser == 7.0 && m.seq == t));
        assert_eq!(micro_batches(&batch, 2).len(), 5, "one sequence at least");
    }

    #[test]
    fn activation_arena_covers_every_batch_shape_within_the_budget() {
        let c = LlamaConfig::preset("tiny").unwrap();
        let max_tokens = 100;
        let bound = activation_arena_bytes(&c, max_tokens);
        for t in 1..=max_tokens {
            for b in 1..=max_tokens / t {
                let bytes = GpuActivationLayout::new(&c, b, t).bytes();
                assert!(
                    bytes + 4 * BLOCK_SLACK <= bound,
                    "{b} x {t}: {bytes} > {bound}"
                );
            }
        }
    }
}
