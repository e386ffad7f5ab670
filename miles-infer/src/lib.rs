//! Rollout engine of miles: model weights under tag `weights`, a paged KV cache under `kv_cache`,
//! batched seeded sampling, and the `InferenceController` the colocated loop drives.
//!
//! [`Engine::generate`] runs many prompts with `n` samples each; the samples of a prompt
//! share its KV blocks, sequences wait or are preempted and recomputed when the cache is full,
//! and every sample draws from its own seeded generator, so results do not depend on batching,
//! sharing or preemption (on the CPU exactly; on the GPU up to bf16 rounding, since cuBLAS may
//! pick other kernels for other batch sizes). [`InferenceController`] offloads and onloads the
//! two tags and takes weight updates by name.
//!
//! The engine computes on the CPU device in fp32 ([`Engine::new`]) or on a CUDA device in
//! bf16 ([`Engine::on_gpu`]): a step is one pass of kernels over the tokens of several
//! prompts (prefill) or of the running sequences (decode), with a paged attention kernel reading
//! the cache through the block tables.
#![deny(unsafe_code)]

mod controller;
mod engine;
mod error;
mod gpu;
mod host;
mod paged;
mod rl_engine;
mod sampling;
mod schedule;
mod weights;

pub use controller::InferenceController;
pub use engine::{Engine, EngineConfig, Generation, KvCapacity};
pub use error::InferError;
pub use paged::{BlockTables, PagedKv};
pub use sampling::{DrawKey, SamplingParams, draw_uniform, sample_token};
pub use schedule::{Completion, FinishReason, GenerationStats};
pub use weights::{Dtype, NamedTensor, TensorData, WeightUpdateReport};
