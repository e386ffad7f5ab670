//! Ranks that train on one rollout: in a job with tensor parallelism, every rank of a
//! tensor-parallel group must train on the same batch, so each takes its group's first rank's
//! rollout ([`Orchestrator::with_rollout_share`]). The rollout crosses as JSON with its floats
//! as their bits, so what arrives is bit for bit what left.

use serde::{Deserialize, Serialize};

use super::{Orchestrator, Rollout};
use crate::backend::Sample;
use crate::orchestrator::OrchestratorError;
use crate::orchestrator::task::Problem;

/// How a rank gets the rollout it trains on: called with its own rollout (encoded), at the
/// same point of every step on every rank, it returns the one every rank of its group trains
/// on (encoded).
pub type RolloutShare = Box<dyn FnMut(Vec<u8>) -> Result<Vec<u8>, crate::comm::CommError>>;

/// A [`Rollout`] as it crosses between ranks.
#[derive(Serialize, Deserialize)]
struct WireRollout {
    /// Each problem's text, answer and metadata.
    problems: Vec<(String, String, serde_json::Value)>,
    prompts: Vec<Vec<u32>>,
    /// By prompt then sample.
    samples: Vec<Vec<WireSample>>,
    /// The bits of each reward.
    rewards: Vec<u32>,
    responses: Vec<String>,
}

/// A [`Sample`]: its tokens, the bits of their log-probs, whether it stopped.
type WireSample = (Vec<u32>, Vec<u32>, bool);

impl Rollout {
    fn encode(&self) -> Result<Vec<u8>, OrchestratorError> {
        let wire = WireRollout {
            problems: self
                .problems
                .iter()
                .map(|p| (p.text.clone(), p.answer.clone(), p.metadata.clone()))
                .collect(),
            prompts: self.prompts.clone(),
            samples: self
                .samples
                .iter()
                .map(|group| {
                    group
                        .iter()
                        .map(|s| {
                            let bits = s.logprobs.iter().map(|l| l.to_bits()).collect();
                            (s.tokens.clone(), bits, s.stopped)
                        })
                        .collect()
                })
                .collect(),
            rewards: self.rewards.iter().map(|r| r.to_bits()).collect(),
            responses: self.responses.clone(),
        };
        serde_json::to_vec(&wire)
            .map_err(|error| OrchestratorError::SharedRollout(error.to_string()))
    }

    fn decode(bytes: &[u8]) -> Result<Rollout, OrchestratorError> {
        let wire: WireRollout = serde_json::from_slice(bytes)
            .map_err(|error| OrchestratorError::SharedRollout(error.to_string()))?;
        Ok(Rollout {
            problems: wire
                .problems
                .into_iter()
                .map(|(text, answer, metadata)| Problem {
                    text,
                    answer,
                    metadata,
                })
                .collect(),
            prompts: wire.prompts,
            samples: wire
                .samples
                .into_iter()
                .map(|group| {
                    group
                        .into_iter()
                        .map(|(tokens, bits, stopped)| Sample {
                            tokens,
                            logprobs: bits.into_iter().map(f32::from_bits).collect(),
                            stopped,
                        })
                        .collect()
                })
                .collect(),
            rewards: wire.rewards.into_iter().map(f32::from_bits).collect(),
            responses: wire.responses,
        })
    }
}

impl Orchestrator {
    /// The rollout this rank trains on: `rollout` itself, or with a share its group's.
    ///
    /// # Errors
    /// [`OrchestratorError::Agreement`] when the ranks cannot share;
    /// [`OrchestratorError::SharedRollout`] for a rollout that does not encode or parse.
    pub(super) fn shared(&mut self, rollout: Rollout) -> Result<Rollout, OrchestratorError> {
        let Some(share) = &mut self.share else {
            return Ok(rollout);
        };
        let bytes = share(rollout.encode()?).map_err(|source| OrchestratorError::Agreement {
            about: "on the rollout to train on",
            source,
        })?;
        Rollout::decode(&bytes)
    }
}
