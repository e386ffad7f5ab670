//! FSDP-style training backend of miles: every parameter sharded across data-parallel ranks in
//! flat units; its native CPU offload yields to core offload when `--offload-train` is on.
//!
//! [`FsdpBackend`] implements [`TrainBackend`]. A unit (the embedding, a decoder layer, the
//! head) is all-gathered into a transient buffer right before its forward or backward pass and
//! its gradient reduce-scattered right after, so a rank's device holds its shards plus one
//! gathered unit; AdamW updates each rank's shard alone. Checkpoints are Hugging Face
//! safetensors plus core's optimizer files ([`miles_core::backend::optimizer`]), so either backend
//! resumes the other's.
//!
//! A user can depend on this crate alone: it re-exports what a training loop needs of the core.
//!
//! ```
//! use miles_fsdp::{Batch, FsdpBackend, Settings, TrainBackend};
//!
//! let settings = Settings {
//!     data_parallel_size: 2,
//!     device_memory_gib: 0.25,
//!     train_memory_margin_bytes: 0,
//!     lr: 1e-2,
//!     ..Settings::default()
//! };
//! let mut fsdp = FsdpBackend::from_settings(&settings)?;
//! let tokens: Vec<u32> = (0..33).map(|i| (i * 31 % 256) as u32).collect();
//! let batch = Batch {
//!     batch: 2,
//!     seq: 16,
//!     inputs: [&tokens[..16], &tokens[16..32]].concat(),
//!     targets: [&tokens[1..17], &tokens[17..33]].concat(),
//!     weights: vec![1.0; 32],
//!     normaliser: 32.0,
//!     entropy_mask: None,
//!     entropy_coef: 0.0,
//! };
//! let first = fsdp.train_step(&batch)?;
//! let second = fsdp.train_step(&batch)?;
//! assert!(second.loss < first.loss);
//! # Ok::<(), miles_fsdp::BackendError>(())
//! ```
#![deny(unsafe_code)]

mod backend;
mod gpu;
mod rank;
mod shards;
mod units;

pub use backend::FsdpBackend;
pub use gpu::{FsdpFiles, FsdpGpu, gpu_trainer};
pub use miles_core::backend::TrainBackend;
pub use miles_core::config::{OffloadTarget, Settings};
pub use miles_core::model::LlamaConfig;
pub use miles_core::ops::AdamWConfig;
pub use miles_core::{
    BackendError, Batch, NamedTensor, OffloadStats, RankOffload, StepStats, WeightBucket,
};
pub use rank::GATHER_TAG;
pub use units::{Unit, UnitKind, UnitPlan};
