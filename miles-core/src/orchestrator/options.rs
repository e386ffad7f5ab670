//! The RL algorithm's settings the loop reads: sampling limits, and (as they come) the loss,
//! evaluation and dump settings, kept apart from the loop's phase switches.

use super::loss::PolicyLoss;
use super::schedule::LrSchedule;
use std::path::PathBuf;

use crate::config::Settings;

/// Generated tokens per sample at most on a dataset when `--rollout-max-response-len` is unset.
pub const DATA_RESPONSE_LEN: usize = 64;

/// The RL algorithm's settings of a run, checked when the settings were resolved.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RlOptions {
    /// Generated tokens per sample at most; `None`: the task's answer budget, or
    /// [`DATA_RESPONSE_LEN`] on a dataset.
    pub max_response_len: Option<usize>,
    /// The policy loss: clip ranges and the KL penalty to the reference model.
    pub loss: PolicyLoss,
    /// The actor's learning rate over the RL optimizer steps.
    pub lr: LrSchedule,
    /// Nucleus sampling of the rollout; 0 stands for 1 (no nucleus).
    pub top_p: f32,
    /// Top-k cut of the rollout; 0 keeps every token.
    pub top_k: usize,
    /// Token ids that end a sample, besides EOS.
    pub stop_token_ids: Vec<u32>,
    /// Strings that end a sample: it is cut after the token completing the first one.
    pub stop_strings: Vec<String>,
    /// The entropy bonus: the loss falls by this times the mean entropy of the response tokens.
    pub entropy_coef: f32,
    /// Evaluate before every this many steps, when evaluation rows are given.
    pub eval_interval: Option<u64>,
    /// Sampling temperature of evaluation.
    pub eval_temperature: f32,
    /// File receiving one JSON line per sample.
    pub dump_rollouts: Option<PathBuf>,
}

impl RlOptions {
    /// Generated tokens per sample at most on a dataset: `max_response_len`, else
    /// [`DATA_RESPONSE_LEN`].
    pub fn data_response_len(&self) -> usize {
        self.max_response_len.unwrap_or(DATA_RESPONSE_LEN)
    }

    /// The options of a run.
    pub fn from_settings(s: &Settings) -> Self {
        Self {
            max_response_len: s.rollout_max_response_len,
            lr: LrSchedule::from_settings(s),
            top_p: s.rollout_top_p as f32,
            top_k: s.rollout_top_k,
            stop_token_ids: s.rollout_stop_token_ids.clone(),
            stop_strings: s.rollout_stop.clone(),
            entropy_coef: s.entropy_coef as f32,
            eval_interval: s.eval_interval,
            eval_temperature: s.eval_temperature as f32,
            dump_rollouts: s.dump_rollouts.clone(),
            loss: PolicyLoss {
                eps_clip: s.eps_clip as f32,
                eps_clip_high: s.eps_clip_high.unwrap_or(s.eps_clip) as f32,
                kl: s
                    .use_kl_loss
                    .then_some((s.kl_loss_type, s.kl_loss_coef as f32)),
            },
        }
    }
}
