//! Errors of the model: its config, its buffers, its checkpoints.

use std::path::PathBuf;

use crate::device::{DeviceError, GemmShapeError};
use crate::memory::MemoryError;

/// What went wrong in the model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A config.json that is not a Llama config this model computes.
    #[error("invalid model config: {0}")]
    Config(String),
    /// A preset name that is not one of the built-in presets.
    #[error("unknown preset `{name}`: the presets are {known}")]
    UnknownPreset {
        /// The name asked for.
        name: String,
        /// The valid names, comma separated.
        known: String,
    },
    /// A buffer of the wrong length for its layout.
    #[error(
        "{buffer} buffer has {len} elements, its layout needs {need}; allocate it from the layout"
    )]
    BufferLength {
        /// Which buffer (`params`, `grads`, `activations`, ...).
        buffer: &'static str,
        /// Its length.
        len: usize,
        /// The length its layout needs.
        need: usize,
    },
    /// A batch whose shape does not fit the model or its activation buffer.
    #[error("invalid batch: {0}")]
    Batch(String),
    /// A token id outside the vocabulary.
    #[error("token id {id} at position {position} is outside the vocabulary of {vocab} ids")]
    TokenOutOfRange {
        /// The token id.
        id: u32,
        /// Its flat position in the batch.
        position: usize,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A KV cache asked for a sequence or position it does not hold.
    #[error("kv cache: {0}")]
    KvCache(String),
    /// A tensor-parallel collective failed.
    #[error(transparent)]
    Comm(#[from] crate::comm::CommError),
    /// A matrix product on operands of the wrong size (a bug in a caller's shapes).
    #[error(transparent)]
    Gemm(#[from] GemmShapeError),
    /// A GPU kernel, matrix product or copy failed (or was handed tensors of the wrong shape).
    #[error(transparent)]
    Gpu(#[from] DeviceError),
    /// The memory manager failed (a region, an allocation, a pause or a resume).
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// Streamed optimizer state could not be read or written (a checksum mismatch, a failed
    /// write, a bucket lost to an earlier failure).
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    /// An operation that needs the trainer's tensors on the device, called while offloaded.
    #[error("cannot {action}: the trainer's tensors are offloaded; call onload first")]
    Offloaded {
        /// What was asked.
        action: &'static str,
    },
    /// Onload of a trainer that is on the device.
    #[error("cannot onload: the trainer's tensors are on the device already; offload them first")]
    NotOffloaded,
    /// An optimizer step number that AdamW cannot take.
    #[error("optimizer step {step} is invalid: steps count from 1")]
    InvalidStep {
        /// The step asked for.
        step: u64,
    },
    /// A GPU and a memory manager over different devices.
    #[error(
        "the memory manager's device is not the gpu's device; build both over one Arc<CudaDevice>"
    )]
    DeviceMismatch,
    /// A file of a checkpoint could not be read or written.
    #[error("cannot {action} {path}: {source}")]
    Io {
        /// `read` or `write`.
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// A config.json that is not valid JSON.
    #[error("cannot parse {path}: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        source: serde_json::Error,
    },
    /// A safetensors file that could not be parsed or written.
    #[error("safetensors file {path}: {reason}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What the library said.
        reason: String,
    },
    /// A tokenizer that cannot be loaded or used.
    #[error("tokenizer {path}: {reason}")]
    Tokenizer {
        /// The tokenizer file.
        path: PathBuf,
        /// What is wrong and what to do.
        reason: String,
    },
    /// A buffer larger than the machine can allocate.
    #[error(
        "cannot allocate {bytes} bytes for {what}; use a machine with more memory or a smaller model"
    )]
    OutOfMemory {
        /// What the buffer holds.
        what: &'static str,
        /// Its size.
        bytes: u64,
    },
    /// A checkpoint whose tensors do not match the config's layout.
    #[error("checkpoint {path} does not match its config: {problems}")]
    CheckpointMismatch {
        /// The safetensors file.
        path: PathBuf,
        /// Every mismatch, one per tensor, separated by `; `.
        problems: String,
    },
}
