//! What can stop the RL loop.

use std::path::PathBuf;

use crate::backend::BackendError;
use crate::metrics::MetricsError;

use super::engine::EngineError;

/// What went wrong in the RL loop; each names the phase or file involved.
#[derive(Debug, thiserror::Error)]
pub enum OrchestratorError {
    /// The actor or critic failed.
    #[error("{role} cannot {action}")]
    Train {
        /// `actor` or `critic`.
        role: &'static str,
        /// What the loop asked for.
        action: &'static str,
        /// The backend's error.
        #[source]
        source: BackendError,
    },
    /// The rollout engine failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// Metrics or the timeline could not be written.
    #[error(transparent)]
    Metrics(#[from] MetricsError),
    /// The reward could not be computed.
    #[error(transparent)]
    Reward(#[from] super::reward::RewardError),
    /// The reference model of the KL penalty failed.
    #[error("reference model cannot {action}: {source}")]
    Reference {
        /// What the loop asked for.
        action: &'static str,
        /// What failed under it.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The loop's settings cannot run.
    #[error("cannot run the rl loop: {0}")]
    Settings(String),
    /// The rollout returned something the loop cannot use.
    #[error("rollout returned {got} for {expected}; the engine must return n samples per prompt")]
    Rollout {
        /// What came back.
        got: String,
        /// What was asked for.
        expected: String,
    },
    /// A checkpoint file of the loop could not be read or written.
    #[error("cannot {action} {path}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// The loop's state file is not one this version wrote.
    #[error("bad loop state {path}: {reason}; point --load at a directory written by --save")]
    State {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

impl OrchestratorError {
    /// A closure wrapping a backend error of `role` doing `action`.
    pub(crate) fn train(
        role: &'static str,
        action: &'static str,
    ) -> impl FnOnce(BackendError) -> OrchestratorError {
        move |source| OrchestratorError::Train {
            role,
            action,
            source,
        }
    }
}
