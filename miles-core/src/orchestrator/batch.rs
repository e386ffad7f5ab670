//! Training batches from rollouts (policy gradient) and from correct answers (supervised
//! warm-up).

use crate::backend::Batch;

/// A prompt with one continuation and the weight of each continuation token.
#[derive(Clone, Debug, PartialEq)]
pub struct Sequence<'a> {
    /// Prompt ids, `BOS` first.
    pub prompt: &'a [u32],
    /// Continuation ids (a sampled completion, or a correct answer).
    pub continuation: &'a [u32],
    /// Weight of every continuation token: the advantage, or 1 for supervised tokens.
    pub weight: f32,
}

/// The batch that trains `sequences`: inputs are prompt + continuation without its last
/// token, targets the same shifted by one; weights carry each sequence's weight on the
/// targets that are continuation tokens and 0 on prompt targets and padding; rows are padded
/// with `pad` to the longest; the normaliser is the count of continuation tokens (at least 1).
pub fn build_batch(sequences: &[Sequence<'_>], pad: u32) -> Batch {
    let seq = sequences
        .iter()
        .map(|s| (s.prompt.len() + s.continuation.len()).saturating_sub(1))
        .max()
        .unwrap_or(0)
        .max(1);
    let b = sequences.len();
    // (B, T)
    let mut inputs = vec![pad; b * seq];
    let mut targets = vec![pad; b * seq];
    let mut weights = vec![0.0f32; b * seq];
    let mut counted = 0usize;
    for (row, s) in sequences.iter().enumerate() {
        let ids: Vec<u32> = s.prompt.iter().chain(s.continuation).copied().collect();
        let len = ids.len().saturating_sub(1);
        let base = row * seq;
        inputs[base..base + len].copy_from_slice(&ids[..len]);
        targets[base..base + len].copy_from_slice(&ids[1..]);
        // Target t predicts ids[t + 1]: continuation tokens start at ids[prompt.len()].
        let first = s.prompt.len().saturating_sub(1);
        for w in &mut weights[base + first..base + len] {
            *w = s.weight;
        }
        counted += len - first.min(len);
    }
    Batch {
        batch: b,
        seq,
        inputs,
        targets,
        weights,
        normaliser: counted.max(1) as f32,
        entropy_mask: None,
        entropy_coef: 0.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_shifts_targets_weights_completions_and_pads_to_the_longest() {
        let (p1, c1) = ([9u32, 1, 2], [3u32, 4]);
        let (p2, c2) = ([9u32, 5], [6u32, 7, 8, 10]);
        let batch = build_batch(
            &[
                Sequence {
                    prompt: &p1,
                    continuation: &c1,
                    weight: 0.5,
                },
                Sequence {
                    prompt: &p2,
                    continuation: &c2,
                    weight: -1.5,
                },
            ],
            99,
        );
        assert_eq!((batch.batch, batch.seq), (2, 5));
        assert_eq!(batch.inputs, vec![9, 1, 2, 3, 99, 9, 5, 6, 7, 8]);
        assert_eq!(batch.targets, vec![1, 2, 3, 4, 99, 5, 6, 7, 8, 10]);
        assert_eq!(
            batch.weights,
            vec![0.0, 0.0, 0.5, 0.5, 0.0, 0.0, -1.5, -1.5, -1.5, -1.5]
        );
        assert_eq!(batch.normaliser, 6.0);
        assert!(batch.check(2).is_ok());
    }

    #[test]
    fn every_weighted_target_is_a_continuation_token() {
        let prompt = [7u32, 8, 9, 10];
        let answer = [11u32, 12];
        let batch = build_batch(
            &[Sequence {
                prompt: &prompt,
                continuation: &answer,
                weight: 1.0,
            }],
            0,
        );
        let weighted: Vec<u32> = batch
            .targets
            .iter()
            .zip(&batch.weights)
            .filter(|(_, w)| **w != 0.0)
            .map(|(t, _)| *t)
            .collect();
        assert_eq!(weighted, answer);
    }
}
