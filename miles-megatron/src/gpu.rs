//! Megatron on GPUs in `miles train`: tensor parallel size 1, one GPU a process, computed by
//! core's GPU trainer; over several processes data parallel with the distributed optimizer
//! (each rank keeps its block of the fp32 master weights and moments). Saved in core's
//! optimizer files, gathered to rank 0 (so a GPU checkpoint loads on the CPU at any parallel
//! size, and back).

use std::path::Path;
use std::sync::Arc;

use miles_core::backend::{GpuBackend, OptimizerFiles, SavedOptimizer};
use miles_core::device::{Gpu, NcclComm};
use miles_core::model::{LlamaConfig, ParamLayout};
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

/// The Megatron trainer on one GPU (one data-parallel rank of several).
pub type MegatronGpu = GpuBackend<MegatronFiles>;

/// The trainer `settings` describe, on `gpu`: the preset, seeded weights, `--load` when given;
/// with `group`, this process's rank of a data-parallel job over one GPU a process, the
/// optimizer state split over the ranks as Megatron's distributed optimizer splits it
/// ([`GpuBackend::on_ranks`]).
///
/// # Errors
/// [`BackendError::Settings`] for tensor parallelism (on GPUs it runs in `bench train
/// --tensor-parallel`), a data-parallel size other than the group's (1 alone), or optimizer
/// streaming over several ranks; as [`GpuBackend::on_ranks`] (which streams the optimizer
/// state through the disk with `--stream-optimizer-state-to-disk`).
pub fn gpu_trainer(
    gpu: Arc<Gpu>,
    settings: &Settings,
    group: Option<NcclComm>,
) -> Result<MegatronGpu, BackendError> {
    check_gpu_settings(settings, group.as_ref().map_or(1, NcclComm::world_size))?;
    GpuBackend::on_ranks(gpu, settings, group)
}

/// The settings [`gpu_trainer`] refuses for a job of `ranks` processes, checked before
/// anything touches the GPU.
fn check_gpu_settings(settings: &Settings, ranks: usize) -> Result<(), BackendError> {
    let refuse = |reason: String| BackendError::Settings {
        backend: MegatronFiles::NAME,
        reason,
    };
    if settings.tensor_model_parallel_size != 1 {
        return Err(refuse(format!(
            "on cuda miles train runs it data parallel, one gpu a process (tensor parallelism on gpus runs in bench train --tensor-parallel); set --tensor-model-parallel-size 1 (got {})",
            settings.tensor_model_parallel_size
        )));
    }
    if settings.data_parallel_size != ranks {
        return Err(refuse(format!(
            "on cuda it runs one data-parallel rank a process, here {ranks}; set --data-parallel-size {ranks} (got {}), or start {} processes (--nproc-per-node or a launcher)",
            settings.data_parallel_size, settings.data_parallel_size
        )));
    }
    if settings.stream_optimizer_state_to_disk && ranks > 1 {
        return Err(refuse(format!(
            "over {ranks} gpus the distributed optimizer keeps each rank's block of the optimizer state, which does not stream through the disk yet; drop --stream-optimizer-state-to-disk or train on one gpu"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_the_gpu_trainer_cannot_run_are_refused_by_flag_before_the_gpu_is_touched() {
        let parallel = Settings {
            tensor_model_parallel_size: 2,
            ..Settings::default()
        };
        let err = check_gpu_settings(&parallel, 1).unwrap_err().to_string();
        assert!(err.contains("--tensor-model-parallel-size 1"), "{err}");
        let data_parallel = Settings {
            data_parallel_size: 2,
            ..Settings::default()
        };
        let err = check_gpu_settings(&data_parallel, 1)
            .unwrap_err()
            .to_string();
        assert!(err.contains("--data-parallel-size 1"), "{err}");
        check_gpu_settings(&data_parallel, 2).unwrap();
        let err = check_gpu_settings(&Settings::default(), 2)
            .unwrap_err()
            .to_string();
        assert!(err.contains("--data-parallel-size 2"), "{err}");
        let streamed = Settings {
            stream_optimizer_state_to_disk: true,
            ..Settings::default()
        };
        check_gpu_settings(&streamed, 1).unwrap();
        let split_streamed = Settings {
            data_parallel_size: 2,
            ..streamed
        };
        let err = check_gpu_settings(&split_streamed, 2)
            .unwrap_err()
            .to_string();
        assert!(err.contains("--stream-optimizer-state-to-disk"), "{err}");
        check_gpu_settings(&Settings::default(), 1).unwrap();
    }
}
