//! Megatron-style training backend of miles: tensor-parallel shards, contiguous parameter and
//! gradient buffers, a distributed optimizer, and `offload()` through the core memory
//! manager.
//!
//! A user can depend on this crate alone: it re-exports what a training loop needs of the core.
//!
//! ```
//! use miles_megatron::{Batch, LlamaConfig, MegatronOptions, MegatronTrainer, TrainBackend};
//!
//! let config = LlamaConfig::preset("tiny")?;
//! let params = miles_megatron::init_weights(&config, 7)?;
//! let options = MegatronOptions {
//!     tensor_parallel: 2,
//!     ..MegatronOptions::default()
//! };
//! let mut trainer = MegatronTrainer::new(config, &params, options)?;
//! let tokens: Vec<u32> = (0..17).map(|i| (i * 31 % 256) as u32).collect();
//! let batch = Batch {
//!     batch: 1,
//!     seq: 16,
//!     inputs: tokens[..16].to_vec(),
//!     targets: tokens[1..].to_vec(),
//!     weights: vec![1.0; 16],
//!     normaliser: 16.0,
//!     entropy_mask: None,
//!     entropy_coef: 0.0,
//! };
//! let first = trainer.train_step(&batch)?;
//! let second = trainer.train_step(&batch)?;
//! assert!(second.loss < first.loss);
//! # Ok::<(), miles_megatron::BackendError>(())
//! ```
#![deny(unsafe_code)]

mod checkpoint;
mod error;
mod gpu;
mod gpu_parallel;
mod gpu_tensor;
mod rank;
mod shard;
mod stream;
mod trainer;

pub use gpu::{MegatronFiles, MegatronGpu, gpu_trainer};
pub use gpu_parallel::{TensorParallelGroup, shard_weights, tensor_parallel_gpu_trainer};
pub use gpu_tensor::TensorParallelGpu;
pub use miles_core::backend::{OPTIMIZER_DIR, TrainBackend};
pub use miles_core::config::{MomentDtype, OffloadTarget, OptimizerStream, Settings, TrainOffload};
pub use miles_core::model::LlamaConfig;
pub use miles_core::ops::AdamWConfig;
pub use miles_core::{
    BackendError, Batch, NamedTensor, OffloadStats, RankOffload, StepStats, WeightBucket,
};
pub use shard::{Split, gather_tensor, scatter, shard_config, split_of};
pub use trainer::{MegatronOptions, MegatronTrainer, init_weights};
