//! What can stop the RL loop.

use std::path::PathBuf;

use crate::backend::BackendError;
use crate::metrics::MetricsError;

use crate::backend::EngineError;

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
    /// The actor could not come back for lack of device memory, after every attempt.
    #[error(
        "the trainer cannot resume {tag}: {missing} bytes of device memory missing (margin {margin}) after {attempts} attempts over {seconds:.1} s; nothing is lost: every tag stays paused with its backup; free the memory another process holds, or lower --train-memory-margin-bytes, and resume from the last checkpoint (--load)"
    )]
    NoMemoryToResume {
        /// The tag that could not resume.
        tag: crate::memory::MemoryTag,
        /// Bytes missing: its need and the margin, less what was free.
        missing: u64,
        /// `--train-memory-margin-bytes`.
        margin: u64,
        /// Attempts made.
        attempts: u64,
        /// Seconds from the first attempt to the last.
        seconds: f64,
    },
    /// The ranks of a job could not agree (a peer left or timed out).
    #[error("the job's ranks cannot agree {about}")]
    Agreement {
        /// What they had to agree on.
        about: &'static str,
        /// Why not.
        #[source]
        source: crate::comm::CommError,
    },
    /// The rollout engine failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The tokenizer failed on a prompt or an answer.
    #[error(transparent)]
    Tokenizer(#[from] crate::model::ModelError),
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
    /// The rollout a tensor-parallel group shares could not be encoded or decoded.
    #[error(
        "cannot share the rollout in this rank's tensor-parallel group: {0}; run the same miles on every rank"
    )]
    SharedRollout(String),
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
    /// Output locations that cannot be written, found before the loop does any work; one line
    /// per location.
    #[error("{}", problems.join("\n"))]
    Outputs {
        /// What is wrong with each location, naming its flag and the fix.
        problems: Vec<String>,
    },
    /// A step's loss or gradient norm is not a finite number: the weights are broken, and the
    /// loop stops before the step is saved.
    #[error(
        "{role} {what} of {phase} {step} is {value}; stopped before saving it (checkpoints on disk are from earlier steps): check the weights --load read and the learning rate"
    )]
    NonFinite {
        /// `actor` or `critic`.
        role: &'static str,
        /// `loss` or `gradient norm`.
        what: &'static str,
        /// `step` or `warm-up step`.
        phase: &'static str,
        /// The step (1 for the first).
        step: u64,
        /// The value.
        value: f32,
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
