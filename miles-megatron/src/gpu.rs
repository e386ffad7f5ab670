//! Megatron on GPUs in `miles train`, one GPU a process, computed by core's GPU trainer: alone,
//! over several processes data parallel with the distributed optimizer (each rank keeps its
//! block of the fp32 master weights and moments), or with tensor parallelism
//! ([`TensorParallelGpu`]). Saved in core's optimizer files, gathered to rank 0 (so a GPU
//! checkpoint loads on the CPU at any parallel size, and back).

use std::path::Path;
use std::sync::Arc;

use miles_core::backend::{GpuBackend, OptimizerFiles, SavedOptimizer, TrainBackend};
use miles_core::device::{Gpu, NcclComm};
use miles_core::model::{GroupComm, LlamaConfig, ParamLayout};
use miles_core::{BackendError, Settings};

use crate::checkpoint::read_full_optimizer;
use crate::gpu_tensor::TensorParallelGpu;

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

/// The trainer `settings` describe, on `gpu`: the preset, seeded weights, `--load` when given.
/// With `tensor`, rank `rank` of a job of tensor parallel times data parallel processes
/// ([`TensorParallelGpu`]: `tensor` its tensor-parallel group, `data` the data-parallel ranks of its
/// shard); without, alone or (with `data`) this process's rank of a data-parallel job over one
/// GPU a process, the optimizer state split over the ranks as Megatron's distributed optimizer
/// splits it, and with `behind` (a second communicator over the data-parallel ranks, on a
/// stream of its own: `--overlap-grad-reduce`) the gradients too, summed behind the backward
/// pass.
///
/// # Errors
/// As [`TensorParallelGpu::from_settings`] and [`GpuBackend::on_ranks`]; alone it streams the
/// optimizer state through the disk with `--stream-optimizer-state-to-disk`, over several ranks
/// it refuses that flag.
pub fn gpu_trainer(
    gpu: Arc<Gpu>,
    settings: &Settings,
    rank: usize,
    tensor: Option<NcclComm>,
    (data, behind): (Option<NcclComm>, Option<NcclComm>),
) -> Result<Box<dyn TrainBackend>, BackendError> {
    Ok(match (tensor, data, behind) {
        (Some(tensor), data, None) => Box::new(TensorParallelGpu::from_settings(
            gpu,
            settings,
            rank,
            GroupComm::new(tensor),
            data.map(GroupComm::new),
        )?),
        (None, Some(data), Some(behind)) => Box::new(MegatronGpu::on_ranks_with_sums_behind(
            gpu, settings, data, behind,
        )?),
        (None, data, None) => Box::new(MegatronGpu::on_ranks(gpu, settings, data)?),
        _ => {
            return Err(BackendError::Settings {
                backend: "megatron",
                reason: "--overlap-grad-reduce sums the gradients over data-parallel ranks, with no tensor parallelism; drop it, or --tensor-model-parallel-size, or add --data-parallel-size N".into(),
            });
        }
    })
}
