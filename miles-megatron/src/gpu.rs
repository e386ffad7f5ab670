//! Megatron on one GPU: tensor and data parallel size 1, computed by core's GPU trainer, saved
//! in core's optimizer files (so a GPU checkpoint loads on the CPU at any parallel size,
//! and back).

use std::path::Path;
use std::sync::Arc;

use miles_core::backend::{GpuBackend, OptimizerFiles, SavedOptimizer};
use miles_core::device::Gpu;
use miles_core::model::{LlamaConfig, OptimizerShard, ParamLayout};
use miles_core::{BackendError, Settings};

use crate::checkpoint::read_full_optimizer;

/// This backend's reading of the shared optimizer files (re-joining tensor-parallel shards),
/// for [`GpuBackend`].
#[derive(Debug)]
pub struct MegatronFiles;

impl OptimizerFiles for MegatronFiles {
    const NAME: &'static str = "megatron";

    fn read(
        dir: &Path,
        config: &LlamaConfig,
        layout: &ParamLayout,
    ) -> Result<Option<SavedOptimizer>, BackendError> {
        read_full_optimizer(dir, config, layout)
    }
}

/// The Megatron trainer on one GPU.
pub type MegatronGpu = GpuBackend<MegatronFiles>;

/// The trainer `settings` describe, on `gpu`: the preset, seeded weights, `--load` when given.
///
/// # Errors
/// [`BackendError::Settings`] for parallel sizes above 1 (this backend runs one GPU in `miles
/// train`; tensor parallelism on GPUs runs in `bench train --tensor-parallel`); as
/// [`GpuBackend::from_settings`] (which streams the optimizer state through the disk with
/// `--stream-optimizer-state-to-disk`).
pub fn gpu_trainer(gpu: Arc<Gpu>, settings: &Settings) -> Result<MegatronGpu, BackendError> {
    check_gpu_settings(settings)?;
    GpuBackend::from_settings(gpu, settings, OptimizerShard::WHOLE)
}

/// The settings [`gpu_trainer`] refuses, checked before anything touches the GPU.
fn check_gpu_settings(settings: &Settings) -> Result<(), BackendError> {
    let refuse = |reason: String| BackendError::Settings {
        backend: MegatronFiles::NAME,
        reason,
    };
    if settings.tensor_model_parallel_size != 1 || settings.data_parallel_size != 1 {
        return Err(refuse(format!(
            "on cuda it runs on one gpu for now (over several gpus use --train-backend fsdp --data-parallel-size N with --nproc-per-node N); set --tensor-model-parallel-size 1 --data-parallel-size 1 (got {} and {})",
            settings.tensor_model_parallel_size, settings.data_parallel_size
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_one_gpu_cannot_run_are_refused_by_flag_before_the_gpu_is_touched() {
        let parallel = Settings {
            tensor_model_parallel_size: 2,
            ..Settings::default()
        };
        let err = check_gpu_settings(&parallel).unwrap_err().to_string();
        assert!(err.contains("--tensor-model-parallel-size 1"), "{err}");
        let streamed = Settings {
            stream_optimizer_state_to_disk: true,
            ..Settings::default()
        };
        check_gpu_settings(&streamed).unwrap();
        check_gpu_settings(&Settings::default()).unwrap();
    }
}
