//! Megatron's tensor parallelism in `miles train` on GPUs: [`TensorParallelGpu`], one process's
//! rank of a job of `--tensor-model-parallel-size` times `--data-parallel-size` processes, one
//! GPU each. Its trainer holds the rank's shard of the model (the GPU trainer over
//! [`shard_config`](crate::shard_config)'s model, in a [`TensorParallelGroup`]); the ranks
//! holding the same shard in the other tensor-parallel groups are its data-parallel ranks, over
//! which the shard's optimizer state is split (Megatron's distributed optimizer).
//!
//! What leaves the trainer is the full model: the weights the engine receives and the
//! checkpoint rank 0 writes are the shards gathered over the tensor-parallel group (NCCL, a few
//! MiB at a time through the device) and joined on the host. The checkpoint holds the full
//! weights (which every backend loads) and Megatron's optimizer files, one a tensor-parallel
//! rank, which Megatron's trainers read at any parallel size (and on the CPU device).

use std::path::Path;
use std::sync::Arc;

use miles_core::backend::optimizer::write_optimizer_rank;
use miles_core::backend::{
    DeviceWeights, GpuBackend, WeightSink, export_full_weights, load_checkpoint_of,
};
use miles_core::device::{Gpu, GpuSlice};
use miles_core::memory::MemoryTag;
use miles_core::model::{
    GroupComm, LlamaConfig, ModelError, OptimizerShard, ParamLayout, save_checkpoint,
};
use miles_core::{BackendError, Batch, OffloadStats, Settings, StepStats, TrainBackend};

use crate::checkpoint::{own_slice, read_full_optimizer};
use crate::gpu::MegatronGpu;
use crate::gpu_parallel::{TensorParallelGroup, shard_weights};
use crate::shard::gather_tensor;
use crate::trainer::init_weights;

/// Elements of a shard one rank sends in each all-gather of [`TensorParallelGpu`]'s gathers.
const GATHER_CHUNK: usize = 4 << 20;

/// One rank of a Megatron job over GPUs with tensor parallelism: see the module's doc.
pub struct TensorParallelGpu {
    /// The trainer of this rank's shard.
    shard: MegatronGpu,
    /// The full model and its layout.
    config: LlamaConfig,
    layout: ParamLayout,
    /// The tensor-parallel group (the trainer's group shares it), for the gathers.
    comm: Arc<GroupComm>,
    /// Whether this rank's tensor-parallel group holds rank 0, which writes the checkpoints.
    with_writer: bool,
}

impl std::fmt::Debug for TensorParallelGpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorParallelGpu")
            .field("shard", &self.shard)
            .field("with_writer", &self.with_writer)
            .finish_non_exhaustive()
    }
}

impl TensorParallelGpu {
    /// Rank `rank` of the job `settings` describe, on `gpu`: its shard of the preset's seeded
    /// weights (`tensor`'s rank of its size), a trainer of that shard joined to the
    /// tensor-parallel group `tensor` and, with `data`, keeping its block of the shard's
    /// optimizer state split over the shard's data-parallel ranks `data`; then `--load` when
    /// given.
    ///
    /// # Errors
    /// [`BackendError::Settings`] for a tensor-parallel size that does not divide the model;
    /// as [`GpuBackend::new`] and [`TrainBackend::load`].
    pub fn from_settings(
        gpu: Arc<Gpu>,
        settings: &Settings,
        rank: usize,
        tensor: GroupComm,
        data: Option<GroupComm>,
    ) -> Result<TensorParallelGpu, BackendError> {
        let config = LlamaConfig::from_settings(settings)?;
        let (local_config, local) = shard_weights(
            &config,
            &init_weights(&config, settings.seed)?,
            tensor.rank(),
            tensor.world_size(),
        )?;
        // Megatron's distributed optimizer: the shard's state split over its data-parallel ranks.
        let split = data.as_ref().map_or(OptimizerShard::WHOLE, |data| {
            OptimizerShard::split(data.rank(), data.world_size())
        });
        let mut shard = GpuBackend::new(gpu, local_config, settings, &local, split, rank)?;
        let tp = tensor.world_size();
        let comm = Arc::new(tensor);
        let group = TensorParallelGroup::across(Arc::clone(&comm), data, shard.trainer().layout());
        shard.join(Box::new(group), split.ranks)?;
        tracing::info!(
            rank,
            tensor_parallel = tp,
            data_parallel = split.ranks,
            shard_params = shard.trainer().layout().len(),
            "this rank trains its tensor-parallel shard of the model, and keeps its block of the shard's optimizer state"
        );
        let mut backend = TensorParallelGpu {
            shard,
            layout: ParamLayout::new(&config),
            config,
            comm,
            with_writer: rank < tp,
        };
        if let Some(dir) = &settings.load {
            backend.load(dir)?;
        }
        Ok(backend)
    }

    /// Every tensor-parallel rank's `local` (its shard of a parameter vector, laid out as this
    /// rank's), in rank order; `None` without `keep`, for a rank that only sends. Collective
    /// over the group.
    fn gather_shards(
        &self,
        local: &[f32],
        keep: bool,
    ) -> Result<Option<Vec<Vec<f32>>>, ModelError> {
        let comm = self.comm.lock();
        let (gpu, tp) = (self.comm.gpu(), comm.world_size());
        let chunk = GATHER_CHUNK.min(local.len()).max(1);
        let scratch = self
            .shard
            .trainer()
            .memory()
            .alloc(&MemoryTag::Activations, (tp + 1) * chunk * size_of::<f32>())?;
        let all = GpuSlice::<f32>::of(scratch.range())?;
        let (send, recv) = (all.sub(0, chunk)?, all.sub(chunk, tp * chunk)?);
        let mut shards = keep.then(|| vec![vec![0.0f32; local.len()]; tp]);
        let mut gathered = vec![0.0f32; if keep { tp * chunk } else { 0 }];
        let mut gather = || -> Result<(), ModelError> {
            for start in (0..local.len()).step_by(chunk) {
                let len = chunk.min(local.len() - start);
                let (send, recv) = (send.sub(0, len)?, recv.sub(0, tp * len)?);
                gpu.upload(send, &local[start..start + len])?;
                comm.all_gather(send, recv)?;
                if let Some(shards) = &mut shards {
                    gpu.download(&mut gathered[..tp * len], recv)?;
                    for (shard, part) in shards.iter_mut().zip(gathered.chunks_exact(len)) {
                        shard[start..start + len].copy_from_slice(part);
                    }
                }
            }
            Ok(())
        };
        let gathered = gather();
        // The scratch goes back to the memory manager once the queued collectives are done,
        // whatever happened to them.
        let synced = gpu.synchronize();
        gathered?;
        synced?;
        Ok(shards)
    }

    /// The full parameter vector of every rank's shard `shards`.
    fn join(&self, shards: &[Vec<f32>]) -> Vec<f32> {
        let mut full = vec![0.0; self.layout.len()];
        for (f, l) in self
            .layout
            .specs()
            .iter()
            .zip(self.shard.trainer().layout().specs())
        {
            gather_tensor(f, l, shards, &mut full[f.range()]);
        }
        full
    }

    /// The gathers of a checkpoint (master weights, then m, then v, every rank's shard): rank
    /// 0 writes them to `dir`, the other ranks of its group only send (`dir` is `None`). The
    /// writer takes part in every gather even when a write failed, since the others wait in
    /// them, and then returns the first failure.
    fn gather_state(&self, dir: Option<&Path>) -> Result<(), BackendError> {
        self.shard.check_on_device("save")?;
        let trainer = self.shard.trainer();
        let master = self.gather_shards(&trainer.master_params()?, dir.is_some())?;
        let mut written = Ok(());
        if let (Some(dir), Some(master)) = (dir, master) {
            written = save_checkpoint(dir, &self.config, &self.layout, &self.join(&master))
                .map_err(BackendError::from);
        }
        let (m, v) = trainer.moments()?;
        let keep = dir.is_some() && written.is_ok();
        let (m, v) = (self.gather_shards(&m, keep)?, self.gather_shards(&v, keep)?);
        written?;
        if let (Some(dir), Some(m), Some(v)) = (dir, m, v) {
            let tp = m.len();
            for (rank, (m, v)) in m.iter().zip(&v).enumerate() {
                write_optimizer_rank(dir, rank, tp, 1, self.shard.step(), m, v)?;
            }
        }
        Ok(())
    }
}

impl TrainBackend for TensorParallelGpu {
    fn name(&self) -> &'static str {
        self.shard.name()
    }

    fn config(&self) -> &LlamaConfig {
        &self.config
    }

    fn step(&self) -> u64 {
        self.shard.step()
    }

    fn is_offloaded(&self) -> bool {
        self.shard.is_offloaded()
    }

    fn device_memory(&self) -> Vec<(MemoryTag, u64)> {
        self.shard.device_memory()
    }

    fn train_step(&mut self, batch: &Batch) -> Result<StepStats, BackendError> {
        self.shard.train_step(batch)
    }

    fn logprobs(&mut self, batch: &Batch) -> Result<(Vec<f32>, f32), BackendError> {
        self.shard.logprobs(batch)
    }

    fn offload(&mut self) -> Result<OffloadStats, BackendError> {
        self.shard.offload()
    }

    fn onload(&mut self) -> Result<OffloadStats, BackendError> {
        self.shard.onload()
    }

    /// The full bf16 weights, gathered over the tensor-parallel group: collective, every rank
    /// of the group exports at once.
    fn export_weights(
        &mut self,
        bucket_bytes: usize,
        sink: &mut WeightSink<'_>,
    ) -> Result<(), BackendError> {
        self.shard.check_on_device("export weights")?;
        let local = self.shard.trainer().weights()?;
        let shards = self.gather_shards(&local, true)?.unwrap_or_default();
        export_full_weights(&self.layout, &self.join(&shards), bucket_bytes, sink)
    }

    /// `None`: no device holds the full weights, which go through the host.
    fn device_weights(&self) -> Result<Option<DeviceWeights>, BackendError> {
        Ok(None)
    }

    fn save(&mut self, dir: &Path) -> Result<(), BackendError> {
        self.gather_state(Some(dir))
    }

    /// In the writer's tensor-parallel group, its part of the gathers; elsewhere its blocks of
    /// the shard's state, which its data-parallel rank in the writer's group gathers.
    fn assist_save(&mut self) -> Result<(), BackendError> {
        if self.with_writer {
            self.gather_state(None)
        } else {
            self.shard.assist_save()
        }
    }

    fn load(&mut self, dir: &Path) -> Result<(), BackendError> {
        self.shard.check_on_device("load")?;
        let (config, params) = load_checkpoint_of(dir, &self.layout)?;
        let (rank, tp) = (self.comm.rank(), self.comm.world_size());
        let (local_config, local) = shard_weights(&config, &params, rank, tp)?;
        drop(params);
        self.shard.trainer_mut().set_params(&local)?;
        if let Some(saved) = read_full_optimizer(dir, &config, &self.layout)? {
            let local_layout = ParamLayout::new(&local_config);
            let own = |full: &[f32]| {
                own_slice(
                    &self.layout,
                    &local_layout,
                    full,
                    rank,
                    0,
                    local_layout.len(),
                )
            };
            let (m, v) = (own(&saved.m), own(&saved.v));
            self.shard.trainer_mut().set_moments(&m, &v)?;
            self.shard.set_step(saved.step);
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic, clippy::print_stderr)]
mod tests {
    //! The GPU tests of `miles train`'s tensor-parallel backend, over two GPUs (tensor parallel
    //! 2) and four (2 x 2, the optimizer state split over the data-parallel ranks). On a GPU
    //! machine: `MILES_TEST_DEVICE=cuda cargo test -p miles-megatron gpu_ -- --test-threads=1`;
    //! elsewhere (or with fewer GPUs) they skip.

    use miles_core::device::NcclComm;
    use miles_core::model::gpu_testing::{
        self, HostCollectives, HostExchange, backend_batch, exported, gpus, one_gpu,
    };

    use super::*;

    /// The tiny preset on cuda at a learning rate that moves it.
    fn settings() -> Settings {
        Settings {
            preset: "tiny".into(),
            seed: 23,
            lr: 1e-3,
            device: miles_core::DeviceChoice::Cuda,
            ..Settings::default()
        }
    }

    #[test]
    fn gpu_tensor_parallel_backend_exports_saves_and_trains_as_one_gpu() {
        let test = "gpu_tensor_parallel_backend_exports_saves_and_trains_as_one_gpu";
        over_nccl(test, 2, 1);
    }

    #[test]
    fn gpu_tensor_by_data_parallel_backend_splits_its_optimizer_and_trains_as_one_gpu() {
        let test = "gpu_tensor_by_data_parallel_backend_splits_its_optimizer_and_trains_as_one_gpu";
        over_nccl(test, 2, 2);
    }

    #[test]
    fn gpu_tensor_parallel_backend_on_one_gpu_through_the_host_trains_as_one_gpu() {
        let test = "gpu_tensor_parallel_backend_on_one_gpu_through_the_host_trains_as_one_gpu";
        let Some(gpu) = one_gpu(test) else {
            return;
        };
        for (tp, dp) in [(2, 1), (2, 2)] {
            let ranks: Vec<Arc<Gpu>> = (0..tp * dp)
                .map(|_| Arc::new(gpu.with_own_stream().unwrap()))
                .collect();
            let tensor: Vec<_> = (0..dp).map(|_| HostExchange::new(tp)).collect();
            let data: Vec<_> = (0..tp).map(|_| HostExchange::new(dp)).collect();
            let comms = move |rank: usize, gpu: &Arc<Gpu>| {
                let (t, d) = (rank % tp, rank / tp);
                let host = |rank, world, exchange: &Arc<HostExchange>| {
                    let comm =
                        HostCollectives::new(Arc::clone(gpu), rank, world, Arc::clone(exchange));
                    GroupComm::new(comm)
                };
                (
                    host(t, tp, &tensor[d]),
                    (dp > 1).then(|| host(d, dp, &data[t])),
                )
            };
            follows_one_gpu(&gpu, ranks, (tp, dp), Arc::new(comms));
        }
    }

    /// [`follows_one_gpu`] over `tp` x `dp` GPUs and NCCL.
    fn over_nccl(test: &str, tp: usize, dp: usize) {
        let Some(gpus) = gpus(test, tp * dp) else {
            return;
        };
        let tensor: Vec<_> = (0..dp).map(|_| NcclComm::unique_id().unwrap()).collect();
        let data: Vec<_> = (0..tp).map(|_| NcclComm::unique_id().unwrap()).collect();
        let comms = move |rank: usize, gpu: &Arc<Gpu>| {
            let (t, d) = (rank % tp, rank / tp);
            let nccl = |id, rank, world| {
                GroupComm::new(NcclComm::new(Arc::clone(gpu), id, rank, world).unwrap())
            };
            (
                nccl(tensor[d], t, tp),
                (dp > 1).then(|| nccl(data[t], d, dp)),
            )
        };
        follows_one_gpu(&Arc::clone(&gpus[0]), gpus, (tp, dp), Arc::new(comms));
    }

    /// Rank `rank`'s tensor-parallel communicator, and its data-parallel one where there are
    /// several data-parallel ranks, on its `gpu`.
    type Comms = dyn Fn(usize, &Arc<Gpu>) -> (GroupComm, Option<GroupComm>) + Send + Sync;

    /// A job of `tp` x `dp` ranks on `gpus` (tensor-parallel groups of consecutive ranks, each
    /// data rank on its share of the batch, their communicators from `comms`) against one
    /// GPU (`alone`) on the whole batch: the weights every rank exports at the start and after
    /// 3 steps with an offload cycle after the second (the same on every rank), the losses,
    /// then a checkpoint written by rank 0 with the others assisting, loaded on one GPU: the
    /// same weights and step, and the next loss.
    fn follows_one_gpu(
        alone: &Arc<Gpu>,
        gpus: Vec<Arc<Gpu>>,
        (tp, dp): (usize, usize),
        comms: Arc<Comms>,
    ) {
        let settings = settings();
        let config = LlamaConfig::from_settings(&settings).unwrap();
        let whole = backend_batch(29, config.vocab_size, 0..4, 1);
        let dir = tempfile::tempdir().unwrap();
        let mut one =
            MegatronGpu::on_ranks(Arc::clone(alone), &settings, None::<NcclComm>).unwrap();
        let one_start = exported(&mut one);
        let one_losses: Vec<f32> = (0..3)
            .map(|_| one.train_step(&whole).unwrap().loss)
            .collect();
        drop(one);
        let ranks: Vec<_> = gpus
            .into_iter()
            .enumerate()
            .map(|(rank, gpu)| {
                let (settings, comms) = (settings.clone(), Arc::clone(&comms));
                let d = rank / tp;
                let part = backend_batch(29, config.vocab_size, d * 4 / dp..(d + 1) * 4 / dp, dp);
                let dir = dir.path().to_path_buf();
                std::thread::spawn(move || {
                    let (tensor, data) = comms(rank, &gpu);
                    let mut backend =
                        TensorParallelGpu::from_settings(gpu, &settings, rank, tensor, data)
                            .unwrap();
                    let start = exported(&mut backend);
                    let mut losses = Vec::new();
                    for step in 1..=3 {
                        losses.push(backend.train_step(&part).unwrap().loss);
                        if step == 2 {
                            // The shard's state leaves the device and comes back (its bf16
                            // weights gathered again where the optimizer state is split).
                            backend.offload().unwrap();
                            backend.onload().unwrap();
                        }
                    }
                    let trained = exported(&mut backend);
                    match rank {
                        0 => backend.save(&dir).unwrap(),
                        _ => backend.assist_save().unwrap(),
                    }
                    let next = backend.train_step(&part).unwrap().loss;
                    (start, losses, trained, next)
                })
            })
            .collect();
        let ranks: Vec<_> = ranks.into_iter().map(|r| r.join().unwrap()).collect();
        for (rank, (start, _, trained, _)) in ranks.iter().enumerate() {
            assert!(
                *start == one_start,
                "tp {tp} x dp {dp}: rank {rank} exports other weights than one gpu's at the start"
            );
            assert!(
                *trained == ranks[0].2,
                "tp {tp} x dp {dp}: rank {rank} exports other weights than rank 0 after training"
            );
        }
        // A step's loss is the data-parallel ranks' mean: each rank reports it alike.
        let losses: Vec<Vec<f32>> = ranks.iter().map(|r| r.1.clone()).collect();
        for (rank, rank_losses) in losses.iter().enumerate() {
            gpu_testing::assert_pair_follows(
                &format!("tensor {tp} x data {dp} (rank {rank})"),
                &[rank_losses.clone(), losses[0].clone()],
                &one_losses,
            );
        }
        let mut loaded = MegatronGpu::on_ranks(
            Arc::clone(alone),
            &Settings {
                load: Some(dir.path().to_path_buf()),
                ..settings
            },
            None::<NcclComm>,
        )
        .unwrap();
        let job = (&ranks[0].2[..], &whole, ranks[0].3);
        gpu_testing::assert_resumes(&format!("tp {tp} x dp {dp}"), &mut loaded, 3, job);
    }

    #[test]
    fn ranges_within_a_block_are_cut_to_it_and_shifted_to_its_start() {
        let ranges = [2..5, 8..10, 12..20];
        let cut: Vec<_> = crate::gpu_parallel::within(&ranges, 4, 10).collect();
        assert_eq!(cut, [0..1, 4..6, 8..10]);
        assert_eq!(crate::gpu_parallel::within(&ranges, 0, 2).count(), 0);
    }
}
