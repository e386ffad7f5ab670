//! A training backend on one GPU: the model's state in memory-manager regions of a CUDA device,
//! computed by the GPU transformer ([`GpuTrainer`]).
//!
//! On one GPU a Megatron-style trainer (tensor and data parallel size 1) and an FSDP trainer
//! (data parallel size 1) run the same step; what differs is the backend's name and its reading
//! of the shared optimizer files, which [`OptimizerFiles`] supplies, and the flags each backend
//! accepts, which its constructor checks before building this. Over several GPUs, one process
//! each, either backend runs data parallel with the optimizer state split over the ranks
//! ([`GpuBackend::on_ranks`]): Megatron's distributed optimizer (ZeRO stage 1), and fsdp's
//! stage 3, its gradients and bf16 weights split too.

use std::marker::PhantomData;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use super::data_parallel::DataParallelGroup;
use super::optimizer::{SavedOptimizer, read_optimizer, write_optimizer};
use super::{
    BackendError, Batch, DeviceWeights, OffloadStats, RankOffload, StepStats, TrainBackend,
    WeightSink, export_full_weights, load_checkpoint_of,
};
use crate::TrainBackendKind;
use crate::config::{OffloadTarget, OptimizerStream, Settings, TrainOffload};
use crate::device::{Collectives, Device, Gpu};
use crate::memory::{ManagerSettings, MemoryManager, MemoryTag};
use crate::model::{
    GpuTrainer, GpuTrainerSpec, LlamaConfig, MomentStream, OptimizerShard, ParamLayout,
    TrainerGroup, init_params, save_checkpoint,
};
use crate::ops::AdamWConfig;

/// What one backend's [`GpuBackend`] adds to the shared trainer: its name, and how it reads
/// the optimizer state of a checkpoint (every backend writes the one format of
/// [`optimizer`](super::optimizer); the Megatron backend also re-joins tensor-parallel shards).
pub trait OptimizerFiles: Send {
    /// The backend's name (`megatron`, `fsdp`).
    const NAME: &'static str;

    /// The full moments and step saved in `dir` for a model of `config` laid out by `layout`,
    /// or `None` when the checkpoint holds weights only. By default, a checkpoint written at
    /// tensor parallel 1 ([`read_optimizer`]).
    ///
    /// # Errors
    /// [`BackendError::Io`] or [`BackendError::Checkpoint`] for files that do not fit.
    fn read(
        dir: &Path,
        _config: &LlamaConfig,
        layout: &ParamLayout,
    ) -> Result<Option<SavedOptimizer>, BackendError> {
        read_optimizer(dir, layout.len())
    }
}

/// One GPU's trainer behind [`TrainBackend`], named and checkpointed by `F`.
pub struct GpuBackend<F> {
    trainer: GpuTrainer,
    layout: ParamLayout,
    target: OffloadTarget,
    step: u64,
    /// Ranks of the data-parallel group this backend is one of (1: alone).
    ranks: usize,
    files: PhantomData<F>,
}

impl<F> std::fmt::Debug for GpuBackend<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuBackend")
            .field("target", &self.target)
            .field("step", &self.step)
            .finish_non_exhaustive()
    }
}

/// Tokens of one micro-batch's activations: enough for the loop's batches of a few thousand
/// tokens, a few GiB of activations for a 1B model.
const MAX_BATCH_TOKENS: usize = 8192;

impl<F: OptimizerFiles> GpuBackend<F> {
    /// The trainer `settings` describe, on `gpu`, keeping `shard` of the optimizer state (its
    /// rank is this process's rank in its job): the preset, weights seeded by `--seed`, then
    /// `--load` when given. Backends check their own flags first.
    ///
    /// # Errors
    /// An unknown preset; as [`GpuBackend::new`] and [`TrainBackend::load`].
    pub fn from_settings(
        gpu: Arc<Gpu>,
        settings: &Settings,
        shard: OptimizerShard,
    ) -> Result<GpuBackend<F>, BackendError> {
        let config = LlamaConfig::from_settings(settings)?;
        let layout = ParamLayout::new(&config);
        let mut params = vec![0.0; layout.len()];
        init_params(&layout, &config, settings.seed, &mut params)?;
        let mut trainer = GpuBackend::new(gpu, config, settings, &params, shard, shard.rank)?;
        if let Some(dir) = &settings.load {
            trainer.load(dir)?;
        }
        Ok(trainer)
    }

    /// A trainer of `config` on `gpu` starting from the full weights `params`, keeping `shard`
    /// of the optimizer state, offloading to `--offload-train-target` (with its disk settings;
    /// each rank of a job writes its own files there, named by `rank`, its rank in the job), its AdamW moments streamed through the disk with
    /// `--stream-optimizer-state-to-disk`, keeping `--train-memory-margin-bytes` free on resume, with the learning
    /// rate of `settings`.
    ///
    /// # Errors
    /// [`BackendError::Settings`] for a disk target or streaming without a directory;
    /// [`BackendError::Memory`] or [`BackendError::Model`] when the state does not fit the GPU.
    pub fn new(
        gpu: Arc<Gpu>,
        config: LlamaConfig,
        settings: &Settings,
        params: &[f32],
        shard: OptimizerShard,
        rank: usize,
    ) -> Result<GpuBackend<F>, BackendError> {
        let refused = |error: crate::config::SettingsError| BackendError::Settings {
            backend: F::NAME,
            reason: error.to_string(),
        };
        let offload = TrainOffload::of(settings).map_err(refused)?;
        let stream = OptimizerStream::of(settings).map_err(refused)?;
        let device: Arc<dyn Device> = gpu.device().clone();
        let memory = Arc::new(MemoryManager::new(
            device,
            ManagerSettings {
                margin_bytes: settings.train_memory_margin_bytes,
                disk: offload.disk(rank),
            },
        )?);
        let spec = GpuTrainerSpec {
            config: config.clone(),
            adamw: AdamWConfig {
                lr: settings.lr as f32,
                max_grad_norm: settings.max_grad_norm(),
                ..AdamWConfig::default()
            },
            backup: offload.policy(),
            max_batch_tokens: MAX_BATCH_TOKENS,
            stream: stream.map(|stream| MomentStream {
                dtype: stream.dtype,
                master_weights: stream.master_weights,
                disk: stream.disk(rank),
            }),
            shard,
            // FSDP's native CPU offload; it yields to core offload (`--offload-train`).
            optimizer_on_host: settings.fsdp_cpu_offload && !settings.offload_train,
        };
        let trainer = GpuTrainer::new(gpu, Arc::clone(&memory), spec, params)?;
        let started = Instant::now();
        let pinned = memory.prepare_host_backups(&[MemoryTag::Params, MemoryTag::Optimizer])?;
        if pinned > 0 {
            tracing::info!(
                bytes = pinned,
                seconds = started.elapsed().as_secs_f64(),
                "pinned the host pool for the trainer's backups up front"
            );
        }
        Ok(GpuBackend {
            trainer,
            layout: ParamLayout::new(&config),
            target: offload.target(),
            step: 0,
            ranks: 1,
            files: PhantomData,
        })
    }

    /// The trainer `settings` describe on `gpu` ([`GpuBackend::from_settings`]): alone, or with
    /// `comm` (NCCL's, or in tests the host's) this process's rank of a data-parallel job over
    /// one GPU a process, keeping its block of the optimizer state ([`OptimizerShard::split`],
    /// its gradients reduced in bf16 with `--grad-reduce-in-bf16`; under fsdp, reduced in fp32,
    /// its blocks of the gradients and bf16 weights too) in a [`DataParallelGroup`]. Every rank trains on its own
    /// batches (normalised by their own normaliser), the gradients are averaged over the
    /// ranks, and every rank takes the same step. A step's loss is the ranks' summed negative
    /// log-probs over this rank's normaliser times the ranks: their mean loss when the ranks'
    /// batches weigh alike. Backends check their own flags first.
    ///
    /// # Errors
    /// [`BackendError::Settings`] for tensor parallelism, a data-parallel size other than the
    /// job's (1 alone), or optimizer streaming over several ranks, before anything is built; as
    /// [`GpuBackend::from_settings`]; [`BackendError::Model`] for a communicator on another GPU.
    pub fn on_ranks<C: Collectives + 'static>(
        gpu: Arc<Gpu>,
        settings: &Settings,
        comm: Option<C>,
    ) -> Result<GpuBackend<F>, BackendError> {
        GpuBackend::joined(gpu, settings, comm.map(|comm| (comm, None)))
    }

    /// As [`on_ranks`](Self::on_ranks) over `comm`'s ranks, with `behind` (a second
    /// communicator over the same ranks, on a stream of its own of `gpu`) summing the
    /// gradients behind the backward pass (`--overlap-grad-reduce`): each rank keeps its block
    /// of the gradients too ([`OptimizerShard::reduce_behind`]); fully sharded (fsdp), it
    /// gathers each layer's weights there too, a layer ahead of the passes.
    ///
    /// # Errors
    /// As [`on_ranks`](Self::on_ranks); [`BackendError::Model`] for a `behind` over other
    /// ranks or on the trainer's own stream.
    pub fn on_ranks_with_sums_behind<C: Collectives + 'static>(
        gpu: Arc<Gpu>,
        settings: &Settings,
        comm: C,
        behind: C,
    ) -> Result<GpuBackend<F>, BackendError> {
        GpuBackend::joined(gpu, settings, Some((comm, Some(behind))))
    }

    /// [`on_ranks`](Self::on_ranks), with the second communicator where there is one.
    fn joined<C: Collectives + 'static>(
        gpu: Arc<Gpu>,
        settings: &Settings,
        comms: Option<(C, Option<C>)>,
    ) -> Result<GpuBackend<F>, BackendError> {
        let ranks = comms.as_ref().map_or(1, |(comm, _)| comm.world_size());
        check_job_ranks(settings, ranks).map_err(|reason| BackendError::Settings {
            backend: F::NAME,
            reason,
        })?;
        // FSDP splits the gradients and the bf16 weights too (ZeRO stage 3) where the
        // gradients are reduced in fp32; Megatron's distributed optimizer keeps both whole
        // (stage 1), or with a second communicator splits the gradients and sums them behind
        // the backward pass (stage 2).
        let fully_sharded = settings.train_backend == TrainBackendKind::Fsdp
            && ranks > 1
            && !settings.grad_reduce_in_bf16;
        let sums_behind = comms.as_ref().is_some_and(|(_, behind)| behind.is_some());
        let shard = OptimizerShard {
            bf16_reduce: settings.grad_reduce_in_bf16,
            split_grads: fully_sharded || sums_behind,
            split_weights: fully_sharded,
            reduce_behind: sums_behind,
            ..OptimizerShard::split(comms.as_ref().map_or(0, |(comm, _)| comm.rank()), ranks)
        };
        let mut backend = GpuBackend::from_settings(gpu, settings, shard)?;
        if let Some((comm, behind)) = comms {
            let mut group = DataParallelGroup::new(comm);
            if let Some(behind) = behind {
                group = group.with_sums_behind(behind)?;
            }
            backend.join(Box::new(group), ranks)?;
            let held = backend.device_memory();
            let bytes =
                |tag: MemoryTag| held.iter().find(|(t, _)| *t == tag).map_or(0, |(_, b)| *b);
            tracing::info!(
                backend = F::NAME,
                rank = shard.rank,
                ranks,
                params = bytes(MemoryTag::Params),
                optimizer = bytes(MemoryTag::Optimizer),
                grads = bytes(MemoryTag::Grads),
                "this rank keeps its block of the optimizer state (fp32 master weights and moments){}",
                if fully_sharded {
                    ", of the gradients and of the bf16 weights"
                } else if sums_behind {
                    " and of the gradients (summed behind the backward pass), and the whole bf16 weights"
                } else {
                    " and the whole bf16 weights"
                }
            );
        }
        Ok(backend)
    }

    /// Makes this trainer one rank of `group`, whose batches are normalised over
    /// `data_ranks` data-parallel ranks (each rank's batch is its own part of the step's).
    ///
    /// # Errors
    /// [`BackendError::Model`] when the trainer is in a group already or `group` is on another
    /// GPU.
    pub fn join(
        &mut self,
        group: Box<dyn TrainerGroup>,
        data_ranks: usize,
    ) -> Result<(), BackendError> {
        self.trainer.join(group)?;
        self.ranks = data_ranks;
        Ok(())
    }

    /// The GPU trainer.
    pub fn trainer(&self) -> &GpuTrainer {
        &self.trainer
    }

    /// The GPU trainer, to change its state (a backend's own load).
    pub fn trainer_mut(&mut self) -> &mut GpuTrainer {
        &mut self.trainer
    }

    /// Sets the optimizer step a loaded state had reached.
    pub fn set_step(&mut self, step: u64) {
        self.step = step;
    }

    /// Fails with [`BackendError::Offloaded`] naming `op` while the trainer is offloaded.
    ///
    /// # Errors
    /// As said.
    pub fn check_on_device(&self, op: &'static str) -> Result<(), BackendError> {
        if self.trainer.is_offloaded() {
            Err(BackendError::Offloaded { op })
        } else {
            Ok(())
        }
    }

    fn stats(&self, seconds: f64, tags: Vec<crate::memory::OffloadReport>) -> OffloadStats {
        OffloadStats {
            target: self.target,
            ranks: vec![RankOffload::new(0, seconds, tags)],
            seconds,
        }
    }
}

/// Why settings cannot run as one rank of a job of `ranks` processes, naming the flag to
/// change; a launcher asks it before any work. A job is `--tensor-model-parallel-size` times
/// `--data-parallel-size` processes, one GPU each, its tensor-parallel groups contiguous ranks
/// (Megatron's order); tensor parallelism is Megatron's.
///
/// # Errors
/// The reason, for sizes whose product is not `ranks`, tensor parallelism off Megatron or with
/// `--grad-reduce-in-bf16`, or optimizer streaming over several ranks.
pub fn check_job_ranks(settings: &Settings, ranks: usize) -> Result<(), String> {
    let (tp, dp) = (
        settings.tensor_model_parallel_size,
        settings.data_parallel_size,
    );
    if tp > 1 && settings.train_backend != TrainBackendKind::Megatron {
        return Err(format!(
            "tensor parallelism is Megatron's; add --train-backend megatron, or set --tensor-model-parallel-size 1 (got {tp})"
        ));
    }
    if tp * dp != ranks {
        let fitting = if ranks.is_multiple_of(tp) {
            format!("set --data-parallel-size {} (got {dp})", ranks / tp)
        } else {
            format!("set --tensor-model-parallel-size to a divisor of {ranks} (got {tp})")
        };
        return Err(format!(
            "on cuda a job is tensor parallel x data parallel processes, one gpu each: here {ranks}; {fitting}, or start {} processes (--nproc-per-node or a launcher)",
            tp * dp
        ));
    }
    if tp > 1 && settings.grad_reduce_in_bf16 {
        return Err(
            "with tensor parallelism the data-parallel ranks reduce-scatter their gradients in fp32; drop --grad-reduce-in-bf16".into(),
        );
    }
    if settings.stream_optimizer_state_to_disk && ranks > 1 {
        return Err(format!(
            "over {ranks} gpus each rank keeps its block of the optimizer state, which does not stream through the disk yet; drop --stream-optimizer-state-to-disk or train on one gpu"
        ));
    }
    Ok(())
}

impl<F: OptimizerFiles> TrainBackend for GpuBackend<F> {
    fn name(&self) -> &'static str {
        F::NAME
    }

    fn config(&self) -> &LlamaConfig {
        self.trainer.config()
    }

    fn step(&self) -> u64 {
        self.step
    }

    fn is_offloaded(&self) -> bool {
        self.trainer.is_offloaded()
    }

    fn device_memory(&self) -> Vec<(MemoryTag, u64)> {
        self.trainer.memory().resident_bytes()
    }

    fn train_step(&mut self, batch: &Batch) -> Result<StepStats, BackendError> {
        self.check_on_device("train")?;
        batch.check(1)?;
        let start = Instant::now();
        let mut view = batch.view();
        view.normaliser *= self.ranks as f32;
        let report = self.trainer.train_step(&view, self.step + 1)?;
        self.step += 1;
        Ok(StepStats {
            step: self.step,
            loss: report.loss,
            grad_norm: report.optimizer.grad_norm,
            entropy: report.entropy,
            tokens: (batch.batch * batch.seq) as u64,
            seconds: start.elapsed().as_secs_f64(),
            optimizer_stream: report.optimizer_stream,
        })
    }

    fn logprobs(&mut self, batch: &Batch) -> Result<(Vec<f32>, f32), BackendError> {
        self.check_on_device("compute log-probs")?;
        batch.check(1)?;
        Ok(self.trainer.logprobs(&batch.view())?)
    }

    fn offload(&mut self) -> Result<OffloadStats, BackendError> {
        self.check_on_device("offload")?;
        let start = Instant::now();
        let tags = self.trainer.offload()?;
        Ok(self.stats(start.elapsed().as_secs_f64(), tags))
    }

    fn onload(&mut self) -> Result<OffloadStats, BackendError> {
        if !self.trainer.is_offloaded() {
            return Err(BackendError::NotOffloaded);
        }
        let start = Instant::now();
        let tags = self.trainer.onload()?;
        Ok(self.stats(start.elapsed().as_secs_f64(), tags))
    }

    fn export_weights(
        &mut self,
        bucket_bytes: usize,
        sink: &mut WeightSink<'_>,
    ) -> Result<(), BackendError> {
        self.check_on_device("export weights")?;
        // The bf16 weights, not the master weights: what the engine and the trainer compute
        // with; gathered over the group where they are split (every rank exports at once).
        let full = self.trainer.weights()?;
        export_full_weights(&self.layout, &full, bucket_bytes, sink)
    }

    fn device_weights(&self) -> Result<Option<DeviceWeights>, BackendError> {
        let device: Arc<dyn Device> = self.trainer.memory().device().clone();
        Ok(self
            .trainer
            .device_params()?
            .map(|(params, ready)| DeviceWeights {
                device,
                params,
                ready,
            }))
    }

    fn save(&mut self, dir: &Path) -> Result<(), BackendError> {
        self.check_on_device("save")?;
        let full = self.trainer.master_params()?;
        let (m, v) = self.trainer.moments()?;
        save_checkpoint(dir, self.trainer.config(), &self.layout, &full)?;
        let saved = SavedOptimizer {
            step: self.step,
            m,
            v,
        };
        write_optimizer(dir, &saved, 1)
    }

    fn assist_save(&mut self) -> Result<(), BackendError> {
        self.check_on_device("save")?;
        Ok(self.trainer.send_state_blocks()?)
    }

    fn load(&mut self, dir: &Path) -> Result<(), BackendError> {
        self.check_on_device("load")?;
        let (config, params) = load_checkpoint_of(dir, &self.layout)?;
        self.trainer.set_params(&params)?;
        if let Some(saved) = F::read(dir, &config, &self.layout)? {
            self.trainer.set_moments(&saved.m, &saved.v)?;
            self.step = saved.step;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_a_rank_of_a_job_cannot_run_are_refused_naming_the_flag() {
        let ranks_of = |tp: usize, dp: usize, streamed: bool| Settings {
            tensor_model_parallel_size: tp,
            data_parallel_size: dp,
            stream_optimizer_state_to_disk: streamed,
            ..Settings::default()
        };
        let fsdp = Settings {
            train_backend: TrainBackendKind::Fsdp,
            ..ranks_of(2, 1, false)
        };
        let bf16 = Settings {
            grad_reduce_in_bf16: true,
            ..ranks_of(2, 2, false)
        };
        for (settings, ranks, flag) in [
            (ranks_of(2, 1, false), 1, "a divisor of 1"),
            (ranks_of(2, 2, false), 3, "a divisor of 3"),
            (ranks_of(1, 2, false), 1, "--data-parallel-size 1"),
            (ranks_of(1, 1, false), 2, "--data-parallel-size 2"),
            (ranks_of(2, 1, false), 4, "--data-parallel-size 2"),
            (ranks_of(1, 2, true), 2, "--stream-optimizer-state-to-disk"),
            (fsdp, 2, "--train-backend megatron"),
            (bf16, 4, "--grad-reduce-in-bf16"),
        ] {
            let err = check_job_ranks(&settings, ranks).unwrap_err();
            assert!(err.contains(flag), "{flag}: {err}");
        }
        check_job_ranks(&ranks_of(1, 1, true), 1).unwrap();
        check_job_ranks(&ranks_of(1, 2, false), 2).unwrap();
        check_job_ranks(&ranks_of(2, 1, false), 2).unwrap();
        check_job_ranks(&ranks_of(2, 2, false), 4).unwrap();
    }
}
