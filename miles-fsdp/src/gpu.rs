//! FSDP on GPUs: one process a GPU, computed by core's GPU trainer.
//!
//! - Over several GPUs each rank keeps its block of the optimizer state (fp32 master weights
//!   and AdamW moments, core's `OptimizerShard`), of the gradients and of the bf16 weights:
//!   each unit's weights (a layer's; the edges': embedding, final norm, untied head) are
//!   gathered before it runs, its gradients summed into their owners' blocks as soon as its
//!   backward pass is done, and each rank updates its block. In ZeRO's terms that is stage 3;
//!   with `--grad-reduce-in-bf16` the weights and gradients stay whole and the gradients are
//!   reduce-scattered in bf16 (stage 1). With `--overlap-grad-reduce` the layers' gathers and
//!   the gradients' sums run on a second communicator and stream: each layer's weights are
//!   gathered a layer ahead of the pass that reads them, and each unit's gradients summed
//!   while the backward pass computes the next layers'.
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
/// with `comms`, this process's rank of a data-parallel job over one GPU a process (the group's
/// communicator), keeping its block of the optimizer state; with a second communicator too
/// (`--overlap-grad-reduce`: over the same ranks, on a stream of its own), a fully sharded rank
/// gathers each layer's weights a layer ahead of the passes and sums its gradients behind the
/// backward pass on it.
///
/// # Errors
/// [`BackendError::Settings`] for native CPU offload with optimizer streaming; as
/// [`GpuBackend::on_ranks`] (which refuses tensor parallelism, a data-parallel size other than
/// the group's, and optimizer streaming over several ranks).
pub fn gpu_trainer(
    gpu: Arc<Gpu>,
    settings: &Settings,
    comms: Option<(NcclComm, Option<NcclComm>)>,
) -> Result<FsdpGpu, BackendError> {
    check_gpu_settings(settings)?;
    match comms {
        Some((group, Some(behind))) => {
            GpuBackend::on_ranks_with_sums_behind(gpu, settings, group, behind)
        }
        comms => GpuBackend::on_ranks(gpu, settings, comms.map(|(group, _)| group)),
    }
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
#[allow(clippy::unwrap_used, clippy::panic, clippy::print_stderr)]
mod tests {
    //! The fully sharded backend's GPU tests: over two GPUs and NCCL, and on one GPU with two
    //! ranks whose collectives go through the host. On a GPU machine: `MILES_TEST_DEVICE=cuda
    //! cargo test -p miles-fsdp gpu_ -- --test-threads=1`; elsewhere (or with one GPU for the
    //! NCCL test) they skip.

    use miles_core::backend::TrainBackend;
    use miles_core::device::{Collectives, NcclComm};
    use miles_core::model::gpu_testing::{
        self, HostCollectives, HostExchange, backend_batch, exported, one_gpu, two_gpus,
    };
    use miles_core::{DeviceChoice, TrainBackendKind};

    use super::*;

    /// fsdp on cuda over `ranks` data-parallel ranks, the tiny preset at a learning rate that
    /// moves it.
    fn settings(ranks: usize) -> Settings {
        Settings {
            preset: "tiny".into(),
            seed: 23,
            lr: 1e-3,
            device: DeviceChoice::Cuda,
            train_backend: TrainBackendKind::Fsdp,
            data_parallel_size: ranks,
            ..Settings::default()
        }
    }

    #[test]
    fn gpu_fully_sharded_pair_over_nccl_trains_saves_and_loads_as_one_gpu() {
        let test = "gpu_fully_sharded_pair_over_nccl_trains_saves_and_loads_as_one_gpu";
        let Some([first, second]) = two_gpus(test) else {
            return;
        };
        for ahead in [false, true] {
            let ids = [0, 1].map(|_| NcclComm::unique_id().unwrap());
            let pair = [Arc::clone(&first), Arc::clone(&second)];
            follows_one_gpu(&first, pair, ahead, move |rank, gpu, which| {
                NcclComm::new(Arc::clone(gpu), ids[which], rank, 2).unwrap()
            });
        }
    }

    #[test]
    fn gpu_fully_sharded_pair_on_one_gpu_through_the_host_trains_saves_and_loads_as_one_gpu() {
        let test =
            "gpu_fully_sharded_pair_on_one_gpu_through_the_host_trains_saves_and_loads_as_one_gpu";
        let Some(gpu) = one_gpu(test) else {
            return;
        };
        for ahead in [false, true] {
            let ranks = [0, 1].map(|_| Arc::new(gpu.with_own_stream().unwrap()));
            let exchanges = [0, 1].map(|_| HostExchange::new(2));
            follows_one_gpu(&gpu, ranks, ahead, move |rank, gpu, which| {
                HostCollectives::new(Arc::clone(gpu), rank, 2, Arc::clone(&exchanges[which]))
            });
        }
    }

    /// Two fsdp ranks on `gpus` (their collectives from `comm(rank, gpu, 0)`), each on half of
    /// a batch, against one GPU (`alone`) on the whole: fully sharded (half the optimizer state
    /// and the gradients' block a rank), the same weights exported at the start and by both
    /// ranks after 3 steps with an offload cycle, losses following one GPU's, and a checkpoint
    /// written by rank 0 with rank 1 assisting that loads on one GPU with the same weights,
    /// step and next loss. With `ahead` (`--overlap-grad-reduce`), the layers are gathered
    /// ahead and the gradients summed behind on `comm(rank, stream, 1)`, a stream of its own.
    fn follows_one_gpu<C: Collectives + 'static>(
        alone: &Arc<Gpu>,
        gpus: [Arc<Gpu>; 2],
        ahead: bool,
        comm: impl Fn(usize, &Arc<Gpu>, usize) -> C + Send + Sync + 'static,
    ) {
        let whole = backend_batch(41, 259, 0..4, 1);
        let dir = tempfile::tempdir().unwrap();
        let mut one = FsdpGpu::on_ranks(Arc::clone(alone), &settings(1), None::<C>).unwrap();
        let one_start = exported(&mut one);
        let one_losses: Vec<f32> = (0..3)
            .map(|_| one.train_step(&whole).unwrap().loss)
            .collect();
        let one_optimizer = one.trainer().optimizer_device_bytes();
        drop(one);
        let comm = Arc::new(comm);
        let ranks: Vec<_> = gpus
            .into_iter()
            .enumerate()
            .map(|(rank, gpu)| {
                let (comm, dir) = (Arc::clone(&comm), dir.path().to_path_buf());
                std::thread::spawn(move || {
                    let part = backend_batch(41, 259, rank * 2..rank * 2 + 2, 2);
                    let group = comm(rank, &gpu, 0);
                    let mut backend = if ahead {
                        let stream = Arc::new(gpu.with_own_stream().unwrap());
                        let behind = comm(rank, &stream, 1);
                        let settings = Settings {
                            overlap_grad_reduce: true,
                            ..settings(2)
                        };
                        FsdpGpu::on_ranks_with_sums_behind(gpu, &settings, group, behind).unwrap()
                    } else {
                        FsdpGpu::on_ranks(gpu, &settings(2), Some(group)).unwrap()
                    };
                    let shard = backend.trainer().shard();
                    assert!(shard.split_grads && shard.split_weights, "{shard:?}");
                    assert_eq!(shard.reduce_behind, ahead, "{shard:?}");
                    let start = exported(&mut backend);
                    let mut losses = Vec::new();
                    for step in 1..=3 {
                        losses.push(backend.train_step(&part).unwrap().loss);
                        if step == 2 {
                            backend.offload().unwrap();
                            backend.onload().unwrap();
                        }
                    }
                    let trained = exported(&mut backend);
                    let optimizer = backend.trainer().optimizer_device_bytes();
                    match rank {
                        0 => backend.save(&dir).unwrap(),
                        _ => backend.assist_save().unwrap(),
                    }
                    let next = backend.train_step(&part).unwrap().loss;
                    (start, losses, trained, next, optimizer)
                })
            })
            .collect();
        let ranks: Vec<_> = ranks.into_iter().map(|r| r.join().unwrap()).collect();
        for (rank, (start, _, trained, _, optimizer)) in ranks.iter().enumerate() {
            assert!(
                *start == one_start,
                "rank {rank} exports other weights than one gpu's at the start"
            );
            assert!(
                *trained == ranks[0].2,
                "rank {rank} exports other weights than rank 0 after training"
            );
            assert!(
                *optimizer <= one_optimizer / 2 + 4096,
                "rank {rank} holds {optimizer} bytes of optimizer state, one gpu {one_optimizer}"
            );
        }
        let losses: Vec<Vec<f32>> = ranks.iter().map(|r| r.1.clone()).collect();
        eprintln!("fully sharded pair, layers gathered ahead: {ahead}");
        gpu_testing::assert_pair_follows("fully sharded data-parallel", &losses, &one_losses);
        let loading = Settings {
            load: Some(dir.path().to_path_buf()),
            ..settings(1)
        };
        let mut loaded = FsdpGpu::on_ranks(Arc::clone(alone), &loading, None::<C>).unwrap();
        let job = (&ranks[0].2[..], &whole, ranks[0].3);
        gpu_testing::assert_resumes("fully sharded pair", &mut loaded, 3, job);
    }

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
