//! Errors of the rollout engine and its controller.

use miles_core::model::ModelError;
use miles_core::{DeviceError, MemoryError};

/// What went wrong in the rollout engine.
#[derive(Debug, thiserror::Error)]
pub enum InferError {
    /// A memory-manager call failed.
    #[error("cannot {action}: {source}")]
    Memory {
        /// What the engine was doing.
        action: &'static str,
        /// The memory manager's error.
        #[source]
        source: MemoryError,
    },
    /// The device could not answer.
    #[error("cannot {action}: {source}")]
    Device {
        /// What the engine was doing.
        action: &'static str,
        /// The device's error.
        #[source]
        source: DeviceError,
    },
    /// The model refused its input or failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// Generation or a weight update needs memory that is offloaded.
    #[error("cannot {action}: {what} offloaded; call {fix} first")]
    Offloaded {
        /// What was asked (`generate`, `update weights`).
        action: &'static str,
        /// What is missing (`the weights are`, `the kv cache is`, ...).
        what: String,
        /// The controller calls that bring it back.
        fix: String,
    },
    /// The weights were dropped (or never loaded) and not every tensor has been sent since.
    #[error(
        "cannot generate: {missing} of {total} weight tensors have not been loaded since the weights were dropped ({names}); send them with update_weights or load a checkpoint"
    )]
    WeightsMissing {
        /// Tensors still missing.
        missing: usize,
        /// Tensors of the model.
        total: usize,
        /// The first few missing names.
        names: String,
    },
    /// `update_weights` got tensors that do not match the model; nothing was changed.
    #[error("update_weights changed nothing: {}", problems.join("; "))]
    WeightMismatch {
        /// Every mismatch, one per tensor.
        problems: Vec<String>,
    },
    /// The KV cache cannot hold even one sequence of this request.
    #[error(
        "kv cache of {have} blocks ({block_size} positions each) cannot hold one sequence of {positions} positions, which needs {need} blocks; raise --rollout-mem-fraction or the device memory, or lower max_new_tokens"
    )]
    CacheTooSmall {
        /// Blocks one sequence may need.
        need: usize,
        /// Blocks in the cache.
        have: usize,
        /// Positions of the longest sequence.
        positions: usize,
        /// Positions per block.
        block_size: usize,
    },
    /// A prompt the model cannot take.
    #[error("prompt {index} {reason}")]
    BadPrompt {
        /// Its index in the request.
        index: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// Sampling or engine parameters out of range.
    #[error("invalid {what}: {reason}")]
    BadParameter {
        /// The parameter.
        what: &'static str,
        /// Why, and the valid range.
        reason: String,
    },
    /// A broken invariant of the engine's bookkeeping (a bug); the engine state is unchanged.
    #[error("internal error of the rollout engine: {0}; please report it")]
    Internal(String),
}

impl InferError {
    /// Wraps a memory-manager error with what the engine was doing.
    pub(crate) fn memory(action: &'static str) -> impl FnOnce(MemoryError) -> InferError {
        move |source| InferError::Memory { action, source }
    }

    /// Wraps a device error with what the engine was doing.
    pub(crate) fn device(action: &'static str) -> impl Fn(DeviceError) -> InferError + Copy {
        move |source| InferError::Device { action, source }
    }
}
