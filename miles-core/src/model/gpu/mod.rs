//! The transformer on the GPU: [`GpuTransformer`] runs the CPU model's forward and backward
//! passes op for op on bf16 parameters and activations (cuBLAS products with fp32
//! accumulation, fp32 weight gradients and logits), and [`GpuTrainer`] trains it with AdamW on
//! fp32 master weights, its state in memory-manager regions, alone or as one rank of a
//! [`TrainerGroup`] that a backend crate implements.
//!
//! GPU tests run with `MILES_TEST_DEVICE=cuda cargo test -p miles-core model::gpu --
//! --test-threads=1` on a GPU machine and skip elsewhere.

mod backward;
mod forward;
mod group;
mod layout;
mod sizing;
mod stream;
#[cfg(any(test, feature = "testing"))]
#[allow(clippy::unwrap_used, clippy::panic, clippy::print_stderr, missing_docs)]
pub mod testing;
#[cfg(test)]
#[allow(clippy::panic, clippy::print_stderr)]
mod tests;
mod trainer;
mod update;
mod weights;

pub use forward::{ForwardMode, GpuTransformer};
pub use group::{GroupComm, OptimizerShard, TrainerGroup};
pub use layout::{GpuActivationLayout, GpuActivations};
pub use stream::MomentStream;
pub use trainer::{GpuTrainer, GpuTrainerSpec, StepTimes, standalone_gpu_trainer};
pub use weights::{GradUnits, WeightUnits, WholeGrads, WholeWeights};
