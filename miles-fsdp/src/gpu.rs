//! FSDP on GPUs: one process a GPU, computed by core's GPU trainer.
//!
//! - Over several GPUs each rank keeps its block of the optimizer state (fp32 master weights
//!   and AdamW moments, core's `OptimizerShard`) and the whole bf16 weights and gradients: the
//!   gradients are reduce-scattered, each rank updates its block, and the bf16 weights are
//!   all-gathered. In ZeRO's terms that is stage 1 (the optimizer state split); the
//!   gradients and the bf16 weights are not split per unit yet.
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
/// its block of the optimizer state ([`GpuBackend::on_ranks`]).
///
/// # Errors
/// [`BackendError::Settings`] for a data-parallel size other than the group's (1 alone),
/// tensor parallelism, native CPU offload with optimizer streaming, or optimizer streaming
/// over several ranks; as [`GpuBackend::on_ranks`].
pub fn gpu_trainer(
    gpu: Arc<Gpu>,
    settings: &Settings,
    group: Option<NcclComm>,
) -> Result<FsdpGpu, BackendError> {
    check_gpu_settings(settings, group.as_ref().map_or(1, NcclComm::world_size))?;
    GpuBackend::on_ranks(gpu, settings, group)
}

/// The settings [`gpu_trainer`] refuses for a job of `ranks` processes, checked before
/// anything touches the GPU.
fn check_gpu_settings(settings: &Settings, ranks: usize) -> Result<(), BackendError> {
    let refuse = |reason: String| BackendError::Settings {
        backend: NAME,
        reason,
    };
    if settings.data_parallel_size != ranks || settings.tensor_model_parallel_size != 1 {
        return Err(refuse(format!(
            "on cuda it runs one data-parallel rank a process, here {ranks}; set --data-parallel-size {ranks} --tensor-model-parallel-size 1 (got {} and {}), or start {} processes (--nproc-per-node or a launcher)",
            settings.data_parallel_size,
            settings.tensor_model_parallel_size,
            settings.data_parallel_size
        )));
    }
    if settings.stream_optimizer_state_to_disk && ranks > 1 {
        return Err(refuse(format!(
            "over {ranks} gpus each rank keeps its block of the optimizer state, which does not stream through the disk yet; drop --stream-optimizer-state-to-disk or train on one gpu"
        )));
    }
    if settings.fsdp_cpu_offload
        && !settings.offload_train
        && settings.stream_optimizer_state_to_disk
    {
        return Err(refuse(
            "--fsdp-cpu-offload keeps the optimizer state in host memory; drop it or --stream-optimizer-state-to-disk".into(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_one_gpu_cannot_run_are_refused_by_flag_before_the_gpu_is_touched() {
        let parallel = Settings {
            data_parallel_size: 2,
            ..Settings::default()
        };
        let err = check_gpu_settings(&parallel, 1).unwrap_err().to_string();
        assert!(err.contains("--data-parallel-size 1"), "{err}");
        check_gpu_settings(&parallel, 2).unwrap();
        let native = Settings {
            fsdp_cpu_offload: true,
            offload_train: false,
            ..Settings::default()
        };
        check_gpu_settings(&native, 1).unwrap();
        let native_pair = Settings {
            data_parallel_size: 2,
            ..native.clone()
        };
        check_gpu_settings(&native_pair, 2).unwrap();
        let native_streamed = Settings {
            stream_optimizer_state_to_disk: true,
            ..native
        };
        let err = check_gpu_settings(&native_streamed, 1)
            .unwrap_err()
            .to_string();
        assert!(err.contains("--stream-optimizer-state-to-disk"), "{err}");
        let split_streamed = Settings {
            data_parallel_size: 2,
            stream_optimizer_state_to_disk: true,
            ..Settings::default()
        };
        let err = check_gpu_settings(&split_streamed, 2)
            .unwrap_err()
            .to_string();
        assert!(err.contains("--stream-optimizer-state-to-disk"), "{err}");
        check_gpu_settings(&Settings::default(), 1).unwrap();
    }
}
