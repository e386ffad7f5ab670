//! FSDP on one GPU: data parallel size 1 (nothing to shard), computed by core's GPU trainer,
//! saved in this crate's optimizer files (so a GPU checkpoint loads on the CPU at any
//! data-parallel size, and back).

use std::path::Path;
use std::sync::Arc;

use miles_core::backend::{GpuBackend, OptimizerFiles, SavedOptimizer};
use miles_core::device::Gpu;
use miles_core::model::{LlamaConfig, ParamLayout};
use miles_core::{BackendError, Settings};

use crate::backend::NAME;
use crate::checkpoint::{OptimizerState, load_optimizer, save_optimizer};

/// This crate's optimizer files, for [`GpuBackend`].
#[derive(Debug)]
pub struct FsdpFiles;

impl OptimizerFiles for FsdpFiles {
    const NAME: &'static str = NAME;

    fn write(dir: &Path, step: u64, m: &[f32], v: &[f32]) -> Result<(), BackendError> {
        let state = OptimizerState {
            exp_avg: m.to_vec(),
            exp_avg_sq: v.to_vec(),
            step,
        };
        save_optimizer(dir, &state, 1)
    }

    fn read(
        dir: &Path,
        _config: &LlamaConfig,
        layout: &ParamLayout,
    ) -> Result<Option<SavedOptimizer>, BackendError> {
        Ok(
            load_optimizer(dir, layout.len())?.map(|state| SavedOptimizer {
                step: state.step,
                m: state.exp_avg,
                v: state.exp_avg_sq,
            }),
        )
    }
}

/// The FSDP trainer on one GPU.
pub type FsdpGpu = GpuBackend<FsdpFiles>;

/// The trainer `settings` describe, on `gpu`: the preset, seeded weights, `--load` when given.
///
/// # Errors
/// [`BackendError::Settings`] for a data-parallel size above 1 (several GPUs need the NCCL
/// communicator), tensor parallelism, or native CPU offload without core offload (on the GPU the
/// memory manager moves the training state: use `--offload-train`); as
/// [`GpuBackend::from_settings`].
pub fn gpu_trainer(gpu: Arc<Gpu>, settings: &Settings) -> Result<FsdpGpu, BackendError> {
    check_gpu_settings(settings)?;
    GpuBackend::from_settings(gpu, settings)
}

/// The settings [`gpu_trainer`] refuses, checked before anything touches the GPU.
fn check_gpu_settings(settings: &Settings) -> Result<(), BackendError> {
    let refuse = |reason: String| BackendError::Settings {
        backend: NAME,
        reason,
    };
    if settings.data_parallel_size != 1 || settings.tensor_model_parallel_size != 1 {
        return Err(refuse(format!(
            "on cuda it runs on one gpu for now (several need the nccl communicator); set --data-parallel-size 1 --tensor-model-parallel-size 1 (got {} and {})",
            settings.data_parallel_size, settings.tensor_model_parallel_size
        )));
    }
    if settings.fsdp_cpu_offload && !settings.offload_train {
        return Err(refuse(
            "--fsdp-cpu-offload keeps parameters on the host between passes on the cpu device only; on cuda use --offload-train".into(),
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
        let err = check_gpu_settings(&parallel).unwrap_err().to_string();
        assert!(err.contains("--data-parallel-size 1"), "{err}");
        let native = Settings {
            fsdp_cpu_offload: true,
            offload_train: false,
            ..Settings::default()
        };
        let err = check_gpu_settings(&native).unwrap_err().to_string();
        assert!(err.contains("--offload-train"), "{err}");
        check_gpu_settings(&Settings::default()).unwrap();
    }
}
