//! FSDP on GPUs: one process a GPU, computed by core's GPU trainer.
//!
//! - Over several GPUs each rank keeps its block of the optimizer state (fp32 master weights
//!   and AdamW moments, core's `OptimizerShard`), of the gradients and of the bf16 weights:
//!   each unit's weights (a layer's; the edges': embedding, final norm, untied head) are
//!   gathered before it runs, its gradients summed into their owners' blocks as soon as its
//!   backward pass is done, and each rank updates its block. In ZeRO's terms that is stage 3;
//!   with `--grad-reduce-in-bf16` the weights and gradients stay whole and the gradients are
//!   reduce-scattered in bf16 (stage 1).
//! - On one GPU, `--fsdp-cpu-offload` without `--offload-train` keeps the optimizer state and
//!   its step on the host (the trainer's `optimizer_on_host`).
//! - Saved in core's optimizer files, gathered to rank 0, so a GPU checkpoint loads on the CPU
//!   at any data-parallel size, and back.

use std::sync::Arc;

use miles_core::backend::{GpuBackend, OptimizerFiles};
use miles_core::device::{Gpu, NcclComm};
use miles_core::{BackendError, Settings};

use crate::backend::NAME;

/// This backend's name and its reading of the shared optimizer files (tensor parallel 1), for
/// [`GpuBackend`].
#[derive(Debug)]
pub struct FsdpFiles;

impl OptimizerFiles for FsdpFiles {
    const NAME: &'static str = NAME;
}

/// The FSDP trainer on one GPU (one data-parallel rank of several).
pub type FsdpGpu = GpuBackend<FsdpFiles>;

/// The trainer `settings` describe, on `gpu`: the preset, seeded weights, `--load` when given;
/// with `group`, this process's rank of a data-parallel job over one GPU a process, keeping
/// its block of the optimizer state.
///
/// # Errors
/// [`BackendError::Settings`] for native CPU offload with optimizer streaming; as
/// [`GpuBackend::on_ranks`] (which refuses tensor parallelism, a data-parallel size other than
/// the group's, and optimizer streaming over several ranks).
pub fn gpu_trainer(
    gpu: Arc<Gpu>,
    settings: &Settings,
    group: Option<NcclComm>,
) -> Result<FsdpGpu, BackendError> {
    check_gpu_settings(settings)?;
    GpuBackend::on_ranks(gpu, settings, group)
}

/// The settings [`gpu_trainer`] refuses beyond [`GpuBackend::on_ranks`]'s, checked before
/// anything touches the GPU.
fn check_gpu_settings(settings: &Settings) -> Result<(), BackendError> {
    if settings.fsdp_cpu_offload
        && !settings.offload_train
        && settings.stream_optimizer_state_to_disk
    {
        return Err(BackendError::Settings {
            backend: NAME,
            reason: "--fsdp-cpu-offload keeps the optimizer state in host memory; drop it or --stream-optimizer-state-to-disk".into(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn native_cpu_offload_with_optimizer_streaming_is_refused_naming_both_flags() {
        let native = Settings {
            fsdp_cpu_offload: true,
            offload_train: false,
            ..Settings::default()
        };
        check_gpu_settings(&native).unwrap();
        let streamed = Settings {
            stream_optimizer_state_to_disk: true,
            ..native
        };
        let err = check_gpu_settings(&streamed).unwrap_err().to_string();
        assert!(
            err.contains("--fsdp-cpu-offload") && err.contains("--stream-optimizer-state-to-disk"),
            "{err}"
        );
        check_gpu_settings(&Settings::default()).unwrap();
    }
}
