//! The RL algorithm's settings the loop reads: sampling limits, and (as they come) the loss,
//! evaluation and dump settings, kept apart from the loop's phase switches.

use crate::config::Settings;

/// Generated tokens per sample at most on a dataset when `--rollout-max-response-len` is unset.
pub const DATA_RESPONSE_LEN: usize = 64;

/// The RL algorithm's settings of a run, checked when the settings were resolved.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RlOptions {
    /// Generated tokens per sample at most; `None`: the task's answer budget, or
    /// [`DATA_RESPONSE_LEN`] on a dataset.
    pub max_response_len: Option<usize>,
}

impl RlOptions {
    /// The options of a run.
    pub fn from_settings(s: &Settings) -> Self {
        Self {
            max_response_len: s.rollout_max_response_len,
        }
    }
}
