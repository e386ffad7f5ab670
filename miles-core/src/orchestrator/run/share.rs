//! Ranks that train on one rollout: in a job with tensor parallelism, every rank of a
//! tensor-parallel group must train on the same batch, so each takes its group's first rank's
//! rollout ([`Orchestrator::with_rollout_share`]). The rollout crosses as its texts and shapes
//! in JSON, then every sample's tokens, log-probs and the rewards as little-endian 32-bit
//! words, so what arrives is bit for bit what left.

use serde::{Deserialize, Serialize};

use super::{Orchestrator, Rollout};
use crate::backend::Sample;
use crate::orchestrator::OrchestratorError;
use crate::orchestrator::task::Problem;

/// How a rank gets the rollout it trains on: called with its own rollout (encoded), at the
/// same point of every step on every rank, it returns the one every rank of its group trains
/// on (encoded).
pub type RolloutShare = Box<dyn FnMut(Vec<u8>) -> Result<Vec<u8>, crate::comm::CommError>>;

/// A [`Rollout`]'s texts and shapes, as they cross between ranks ahead of its numbers.
#[derive(Serialize, Deserialize)]
struct WireHead {
    /// Each problem's text, answer and metadata.
    problems: Vec<(String, String, serde_json::Value)>,
    prompts: Vec<Vec<u32>>,
    /// By prompt then sample: its tokens, and whether it stopped.
    samples: Vec<Vec<(usize, bool)>>,
    responses: Vec<String>,
}

impl Rollout {
    /// The head's length (a little-endian u64), the head, then every sample's tokens, every
    /// sample's log-probs and the rewards, each a little-endian 32-bit word.
    fn encode(&self) -> Result<Vec<u8>, OrchestratorError> {
        let head = WireHead {
            problems: self
                .problems
                .iter()
                .map(|p| (p.text.clone(), p.answer.clone(), p.metadata.clone()))
                .collect(),
            prompts: self.prompts.clone(),
            samples: self
                .samples
                .iter()
                .map(|group| group.iter().map(|s| (s.tokens.len(), s.stopped)).collect())
                .collect(),
            responses: self.responses.clone(),
        };
        let head = serde_json::to_vec(&head)
            .map_err(|error| OrchestratorError::SharedRollout(error.to_string()))?;
        let samples = || self.samples.iter().flatten();
        let words = samples()
            .flat_map(|s| s.tokens.iter().copied())
            .chain(samples().flat_map(|s| s.logprobs.iter().map(|l| l.to_bits())))
            .chain(self.rewards.iter().map(|r| r.to_bits()));
        let mut bytes = (head.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(&head);
        bytes.extend(words.flat_map(u32::to_le_bytes));
        Ok(bytes)
    }

    fn decode(bytes: &[u8]) -> Result<Rollout, OrchestratorError> {
        let bad = |what: String| OrchestratorError::SharedRollout(what);
        let (len, rest) = bytes
            .split_first_chunk::<8>()
            .ok_or_else(|| bad(format!("{} bytes hold no head", bytes.len())))?;
        let len = usize::try_from(u64::from_le_bytes(*len)).unwrap_or(usize::MAX);
        if len > rest.len() {
            return Err(bad(format!("a head of {len} bytes in {}", rest.len())));
        }
        let (head, tail) = rest.split_at(len);
        let head: WireHead =
            serde_json::from_slice(head).map_err(|error| bad(error.to_string()))?;
        let tokens: usize = head.samples.iter().flatten().map(|(n, _)| n).sum();
        let rewards = head.samples.iter().map(Vec::len).sum::<usize>();
        let words: Vec<u32> = tail
            .chunks_exact(4)
            .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
            .collect();
        if tail.len() != 4 * (2 * tokens + rewards) {
            return Err(bad(format!(
                "{} bytes of numbers for {tokens} tokens and {rewards} rewards",
                tail.len()
            )));
        }
        let (ids, rest) = words.split_at(tokens);
        let (logprobs, rewards) = rest.split_at(tokens);
        let mut at = 0;
        let samples = head
            .samples
            .iter()
            .map(|group| {
                group
                    .iter()
                    .map(|&(n, stopped)| {
                        let sample = Sample {
                            tokens: ids[at..at + n].to_vec(),
                            logprobs: logprobs[at..at + n]
                                .iter()
                                .map(|&b| f32::from_bits(b))
                                .collect(),
                            stopped,
                        };
                        at += n;
                        sample
                    })
                    .collect()
            })
            .collect();
        Ok(Rollout {
            problems: head
                .problems
                .into_iter()
                .map(|(text, answer, metadata)| Problem {
                    text,
                    answer,
                    metadata,
                })
                .collect(),
            prompts: head.prompts,
            samples,
            rewards: rewards.iter().map(|&b| f32::from_bits(b)).collect(),
            responses: head.responses,
        })
    }
}

/// A rank's part in its group's rollout ([`Orchestrator::with_rollout_share`]).
pub(super) struct Sharing {
    pub(super) share: RolloutShare,
    /// Whether this rank generates the rollout (its group's first rank) or takes it.
    pub(super) generates: bool,
}

impl Orchestrator {
    /// Step `step`'s rollout: generated and scored here, or with a share, its group's (this
    /// rank's own when it is the one that generates).
    ///
    /// # Errors
    /// As [`generate`](Self::generate); [`OrchestratorError::Agreement`] when the ranks cannot
    /// share; [`OrchestratorError::SharedRollout`] for a rollout that does not encode or parse.
    pub(super) fn rollout(&mut self, step: u64) -> Result<Rollout, OrchestratorError> {
        let own = match self.sharing.as_ref().map(|sharing| sharing.generates) {
            None => return self.generate(step),
            Some(true) => self.generate(step)?.encode()?,
            Some(false) => Vec::new(),
        };
        let shared = match &mut self.sharing {
            Some(sharing) => (sharing.share)(own),
            None => Ok(own),
        };
        let bytes = shared.map_err(|source| OrchestratorError::Agreement {
            about: "on the rollout to train on",
            source,
        })?;
        Rollout::decode(&bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rollout_crosses_bit_for_bit_and_a_cut_one_is_refused() {
        let sample = |tokens: Vec<u32>, logprobs: Vec<f32>, stopped| Sample {
            tokens,
            logprobs,
            stopped,
        };
        let rollout = Rollout {
            problems: vec![Problem {
                text: "12+7=".into(),
                answer: "19".into(),
                metadata: serde_json::json!({"source": "täsk"}),
            }],
            prompts: vec![vec![1, 2, 3]],
            samples: vec![vec![
                sample(vec![4, 5], vec![-0.25, f32::NEG_INFINITY], true),
                sample(Vec::new(), Vec::new(), false),
                sample(vec![u32::MAX], vec![f32::from_bits(0x7fc0_0001)], false),
            ]],
            rewards: vec![1.0, -0.0, f32::MIN_POSITIVE / 2.0],
            responses: vec!["19".into(), String::new(), "x".into()],
        };
        let bytes = rollout.encode().unwrap();
        let back = Rollout::decode(&bytes).unwrap();
        let bits = |r: &Rollout| {
            let floats = r.samples.iter().flatten().flat_map(|s| s.logprobs.clone());
            floats
                .chain(r.rewards.clone())
                .map(f32::to_bits)
                .collect::<Vec<_>>()
        };
        assert_eq!(bits(&back), bits(&rollout));
        assert_eq!(back.problems, rollout.problems);
        assert_eq!(back.prompts, rollout.prompts);
        assert_eq!(back.responses, rollout.responses);
        let shape = |r: &Rollout| {
            r.samples
                .iter()
                .flatten()
                .map(|s| (s.tokens.clone(), s.stopped))
                .collect::<Vec<_>>()
        };
        assert_eq!(shape(&back), shape(&rollout));
        for cut in [0, 7, bytes.len() - 1] {
            let error = Rollout::decode(&bytes[..cut]).err().unwrap();
            assert!(
                matches!(error, OrchestratorError::SharedRollout(_)),
                "{cut}: {error}"
            );
        }
    }
}
