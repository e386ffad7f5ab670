//! FSDP-style training backend of miles: every parameter sharded across data-parallel ranks in
//! flat units; its native CPU offload yields to core offload when `--offload-train` is on.
//!
//! [`FsdpBackend`] implements [`miles_core::TrainBackend`]. A unit (the embedding, a decoder
//! layer, the head) is all-gathered into a transient buffer right before its forward or
//! backward pass and its gradient reduce-scattered right after, so a rank's device holds its
//! shards plus one gathered unit; AdamW updates each rank's shard alone. Checkpoints are Hugging
//! Face safetensors plus full optimizer moments ([`checkpoint`]), independent of the rank count.
#![forbid(unsafe_code)]

mod backend;
pub mod checkpoint;
mod rank;
mod shards;
mod units;

pub use backend::FsdpBackend;
pub use rank::GATHER_TAG;
pub use shards::StatePart;
pub use units::{Unit, UnitKind, UnitPlan};
