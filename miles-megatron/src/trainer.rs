//! The Megatron trainer: one thread per rank, each owning a [`Rank`], driven by jobs from the
//! caller's thread; it implements the core's [`TrainBackend`].

use std::path::Path;
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::Instant;

use miles_core::backend::{TrainBackend, sum_over_ranks};
use miles_core::backend::{export_full_weights, load_checkpoint_of};
use miles_core::config::{OptimizerStream, Settings, TrainOffload};
use miles_core::model::{LlamaConfig, ParamLayout, Transformer, init_params, save_checkpoint};
use miles_core::ops::AdamWConfig;
use miles_core::{
    BackendError, Batch, CommError, Communicator, LocalComm, MemoryManager, MemoryTag,
    OffloadStats, RankOffload, StepStats, WeightSink,
};

use crate::checkpoint::{own_slice, read_full_optimizer};
use crate::error::invalid;
use crate::rank::{Comms, Grid, Rank, RankSpec, StreamSpec};
use crate::shard::{gather_tensor, scatter, shard_config};
use miles_core::backend::optimizer::write_optimizer_rank;

/// A job a rank runs; collective jobs make a failing rank leave its groups.
type Job = Box<dyn FnOnce(&mut Rank) -> Result<Reply, BackendError> + Send>;

/// What a rank sends back.
#[derive(Debug)]
enum Reply {
    Step {
        loss: f32,
        grad_norm: f32,
        entropy: Option<f32>,
    },
    Logprobs {
        loss: f32,
        logprobs: Vec<f32>,
    },
    Offload(RankOffload),
    Params(Vec<f32>),
    Bytes(u64),
    /// A rank is built; its memory manager, for the trainer to read.
    Built(Arc<MemoryManager>),
    Loaded {
        step: Option<u64>,
    },
    Done,
}

#[derive(Debug)]
struct Worker {
    jobs: Option<mpsc::Sender<(Job, bool)>>,
    replies: mpsc::Receiver<Result<Reply, BackendError>>,
    handle: Option<JoinHandle<()>>,
}

/// How a [`MegatronTrainer`] runs: parallel sizes, optimizer, memory and offload settings.
#[derive(Clone, Debug)]
pub struct MegatronOptions {
    /// Tensor-parallel ranks.
    pub tensor_parallel: usize,
    /// Data-parallel ranks.
    pub data_parallel: usize,
    /// AdamW hyperparameters.
    pub adamw: AdamWConfig,
    /// Capacity of each rank's CPU device in bytes.
    pub device_bytes: u64,
    /// Free memory a resume must leave (`--train-memory-margin-bytes`).
    pub margin_bytes: u64,
    /// Where [`TrainBackend::offload`] sends parameters and optimizer state.
    pub offload: TrainOffload,
    /// Keep the Adam moments on disk, streamed bucket by bucket.
    pub stream_optimizer: Option<OptimizerStream>,
    /// Sequences per forward and backward pass of a rank (`--micro-batch-size`): a rank's share
    /// of a step runs in micro-batches of this many whose gradients add up before the one
    /// optimizer step; `None` runs the share in one pass.
    pub micro_batch_size: Option<usize>,
}

impl Default for MegatronOptions {
    /// One rank, default AdamW, a 4 GiB device per rank, no margin, offload to host memory.
    fn default() -> MegatronOptions {
        MegatronOptions {
            tensor_parallel: 1,
            data_parallel: 1,
            adamw: AdamWConfig::default(),
            device_bytes: 4 << 30,
            margin_bytes: 0,
            offload: TrainOffload::Host,
            stream_optimizer: None,
            micro_batch_size: None,
        }
    }
}

/// Fresh full weights of `config` from `seed` (Hugging Face's initialisation).
///
/// # Errors
/// [`BackendError::Model`] when the layout and buffer disagree (a bug).
pub fn init_weights(config: &LlamaConfig, seed: u64) -> Result<Vec<f32>, BackendError> {
    let layout = ParamLayout::new(config);
    let mut params = vec![0.0; layout.len()];
    init_params(&layout, config, seed, &mut params)?;
    Ok(params)
}

impl MegatronOptions {
    /// The options `settings` ask for.
    ///
    /// # Errors
    /// [`BackendError::Settings`] for a disk target or optimizer streaming without a usable disk
    /// directory or chunk (settings that did not go through [`Settings::resolve`]).
    pub fn from_settings(settings: &Settings) -> Result<MegatronOptions, BackendError> {
        let refused = |error: miles_core::config::SettingsError| invalid(error.to_string());
        Ok(MegatronOptions {
            tensor_parallel: settings.tensor_model_parallel_size,
            data_parallel: settings.data_parallel_size,
            adamw: AdamWConfig {
                lr: settings.lr as f32,
                max_grad_norm: settings.max_grad_norm(),
                ..AdamWConfig::default()
            },
            device_bytes: settings.device_memory_bytes(),
            margin_bytes: settings.train_memory_margin_bytes,
            offload: TrainOffload::of(settings).map_err(refused)?,
            stream_optimizer: OptimizerStream::of(settings).map_err(refused)?,
            micro_batch_size: settings.micro_batch_size,
        })
    }
}

/// The Megatron-style trainer: tensor parallelism, a data-parallel distributed optimizer, and
/// offload through each rank's memory manager. Ranks are threads, each with its own CPU device.
#[derive(Debug)]
pub struct MegatronTrainer {
    config: LlamaConfig,
    full_layout: ParamLayout,
    local_layout: ParamLayout,
    options: MegatronOptions,
    workers: Vec<Worker>,
    /// Each rank's memory manager, in rank order.
    managers: Vec<Arc<MemoryManager>>,
    step: u64,
    offloaded: bool,
}

impl MegatronTrainer {
    /// A trainer for the preset and seed of `settings`, with its options.
    ///
    /// # Errors
    /// As [`new`](Self::new), and [`BackendError::Model`] for an unknown preset.
    pub fn from_settings(settings: &Settings) -> Result<MegatronTrainer, BackendError> {
        let config = LlamaConfig::from_settings(settings)?;
        let params = init_weights(&config, settings.seed)?;
        MegatronTrainer::new(config, &params, MegatronOptions::from_settings(settings)?)
    }

    /// A trainer of `config` starting from the full weights `params`.
    ///
    /// # Errors
    /// [`BackendError::Settings`] for parallel sizes the model cannot be cut into, a disk
    /// target without a directory, or streamed master weights (the cuda trainer's); what a
    /// rank hit while allocating its memory.
    pub fn new(
        config: LlamaConfig,
        params: &[f32],
        options: MegatronOptions,
    ) -> Result<MegatronTrainer, BackendError> {
        let (tp, dp) = (options.tensor_parallel, options.data_parallel);
        if dp == 0 {
            return Err(invalid(
                "--data-parallel-size must be at least 1".to_string(),
            ));
        }
        if options
            .stream_optimizer
            .as_ref()
            .is_some_and(|stream| stream.master_weights)
        {
            return Err(invalid(
                "streams the master weights through the disk on cuda only (the cpu ranks keep them beside their shards); drop --stream-optimizer-master-weights or pass --device cuda".into(),
            ));
        }
        let local_config = shard_config(&config, tp)?;
        let full_layout = ParamLayout::new(&config);
        full_layout.check("params", params)?;
        let local_model = Transformer::new(local_config);
        let local_layout = local_model.layout().clone();
        let full = Arc::new(params.to_vec());
        let comms = LocalComm::world(tp * dp)?;
        let mut workers = Vec::with_capacity(tp * dp);
        for (rank, comm) in comms.into_iter().enumerate() {
            let grid = Grid { rank, tp, dp };
            let spec = RankSpec {
                grid,
                model: local_model.clone(),
                adamw: options.adamw,
                device_bytes: options.device_bytes,
                margin_bytes: options.margin_bytes,
                backup: options.offload.policy(),
                disk: options.offload.disk(rank),
                stream: options.stream_optimizer.as_ref().map(|stream| StreamSpec {
                    dtype: stream.dtype,
                    bucket_bytes: stream.bucket_bytes,
                    disk: stream.disk(rank),
                }),
                micro_batch_size: options.micro_batch_size,
            };
            workers.push(spawn_rank(
                spec,
                comm,
                Arc::clone(&full),
                full_layout.clone(),
            ));
        }
        let mut trainer = MegatronTrainer {
            config,
            full_layout,
            local_layout,
            options,
            workers,
            managers: Vec::new(),
            step: 0,
            offloaded: false,
        };
        trainer.managers = trainer
            .collect()?
            .into_iter()
            .map(|r| match r {
                Reply::Built(manager) => Ok(manager),
                other => Err(unexpected(&other)),
            })
            .collect::<Result<_, _>>()?;
        Ok(trainer)
    }

    /// The options.
    pub fn options(&self) -> &MegatronOptions {
        &self.options
    }

    /// Each rank's bytes of its tags resident in RAM (the CPU device's physical memory), in
    /// rank order: near zero while offloaded.
    ///
    /// # Errors
    /// What a rank hit measuring.
    pub fn resident_bytes(&mut self) -> Result<Vec<u64>, BackendError> {
        self.run_all(false, |_| {
            Box::new(|rank| Ok(Reply::Bytes(rank.resident_bytes()?)))
        })?
        .into_iter()
        .map(|r| match r {
            Reply::Bytes(b) => Ok(b),
            other => Err(unexpected(&other)),
        })
        .collect()
    }

    fn grid(&self, rank: usize) -> Grid {
        Grid {
            rank,
            tp: self.options.tensor_parallel,
            dp: self.options.data_parallel,
        }
    }

    /// Sends each rank its job, then waits for every reply (in rank order).
    fn run_all(
        &mut self,
        collective: bool,
        job: impl Fn(usize) -> Job,
    ) -> Result<Vec<Reply>, BackendError> {
        for (rank, worker) in self.workers.iter().enumerate() {
            let sent = worker
                .jobs
                .as_ref()
                .is_some_and(|jobs| jobs.send((job(rank), collective)).is_ok());
            if !sent {
                return Err(BackendError::RankLost {
                    backend: "megatron",
                    rank,
                });
            }
        }
        self.collect()
    }

    /// Waits for one reply per rank. Of several errors, a rank's own failure is returned rather
    /// than the peers' reports that it left their collective.
    fn collect(&mut self) -> Result<Vec<Reply>, BackendError> {
        let mut replies = Vec::with_capacity(self.workers.len());
        let mut errors = Vec::new();
        for (rank, worker) in self.workers.iter().enumerate() {
            match worker.replies.recv() {
                Ok(Ok(reply)) => replies.push(reply),
                Ok(Err(error)) => errors.push(error),
                Err(_) => errors.push(BackendError::RankLost {
                    backend: "megatron",
                    rank,
                }),
            }
        }
        let secondary =
            |e: &BackendError| matches!(e, BackendError::Comm(CommError::PeerGone { .. }));
        match errors.iter().position(|e| !secondary(e)) {
            Some(root) => Err(errors.swap_remove(root)),
            None => match errors.pop() {
                Some(error) => Err(error),
                None => Ok(replies),
            },
        }
    }

    /// Replies of the first tensor-parallel rank of each data-parallel group, in data order.
    fn per_dp(&self, replies: Vec<Reply>) -> Vec<Reply> {
        let tp = self.options.tensor_parallel;
        replies
            .into_iter()
            .enumerate()
            .filter(|(r, _)| r % tp == 0)
            .map(|(_, x)| x)
            .collect()
    }

    /// The full weights, gathered from the tensor-parallel shards of data-parallel rank 0.
    fn full_params(&mut self) -> Result<Vec<f32>, BackendError> {
        let tp = self.options.tensor_parallel;
        let replies = self.run_all(false, |r| {
            if r < tp {
                Box::new(|rank| Ok(Reply::Params(rank.local_params()?)))
            } else {
                Box::new(|_| Ok(Reply::Done))
            }
        })?;
        let locals: Vec<Vec<f32>> = replies
            .into_iter()
            .take(tp)
            .map(|r| match r {
                Reply::Params(p) => Ok(p),
                other => Err(unexpected(&other)),
            })
            .collect::<Result<_, _>>()?;
        let mut full = vec![0.0; self.full_layout.len()];
        for (f, l) in self
            .full_layout
            .specs()
            .iter()
            .zip(self.local_layout.specs())
        {
            gather_tensor(f, l, &locals, &mut full[f.range()]);
        }
        Ok(full)
    }

    fn offload_stats(
        &self,
        replies: Vec<Reply>,
        start: Instant,
    ) -> Result<OffloadStats, BackendError> {
        let ranks = replies
            .into_iter()
            .map(|r| match r {
                Reply::Offload(o) => Ok(o),
                other => Err(unexpected(&other)),
            })
            .collect::<Result<_, _>>()?;
        Ok(OffloadStats {
            target: self.options.offload.target(),
            ranks,
            seconds: start.elapsed().as_secs_f64(),
        })
    }

    fn check_on_device(&self, op: &'static str) -> Result<(), BackendError> {
        if self.offloaded {
            return Err(BackendError::Offloaded { op });
        }
        Ok(())
    }

    /// Checks `batch` here, before any rank starts: a rank that failed on its rows alone would
    /// leave its peers in a collective.
    fn check_batch(&self, batch: &Batch) -> Result<(), BackendError> {
        batch.check(self.options.data_parallel)?;
        let vocab = self.config.vocab_size;
        let ids = batch.inputs.iter().chain(&batch.targets);
        match ids.enumerate().find(|(_, id)| **id as usize >= vocab) {
            Some((position, id)) => Err(BackendError::Batch(format!(
                "token id {id} at flat position {} of the {} is outside the vocabulary of {vocab} ids",
                position % batch.inputs.len().max(1),
                if position < batch.inputs.len() {
                    "inputs"
                } else {
                    "targets"
                }
            ))),
            None => Ok(()),
        }
    }
}

fn unexpected(reply: &Reply) -> BackendError {
    invalid(format!(
        "a rank answered {reply:?} to a different job; this is a bug in miles-megatron"
    ))
}

fn spawn_rank(
    spec: RankSpec,
    world: LocalComm,
    full: Arc<Vec<f32>>,
    full_layout: ParamLayout,
) -> Worker {
    let (job_tx, job_rx) = mpsc::channel::<(Job, bool)>();
    let (reply_tx, reply_rx) = mpsc::channel();
    let rank = spec.grid.rank;
    let handle = std::thread::Builder::new()
        .name(format!("megatron-rank-{rank}"))
        .spawn(move || {
            let built = build_rank(spec, world, &full, &full_layout);
            drop(full);
            let mut rank = match built {
                Ok(rank) => {
                    if reply_tx.send(Ok(Reply::Built(rank.manager()))).is_err() {
                        return;
                    }
                    rank
                }
                Err(error) => {
                    let _ = reply_tx.send(Err(error));
                    return;
                }
            };
            for (job, collective) in job_rx {
                let result = job(&mut rank);
                if result.is_err() && collective {
                    rank.leave_groups();
                }
                if reply_tx.send(result).is_err() {
                    break;
                }
            }
        });
    match handle {
        Ok(handle) => Worker {
            jobs: Some(job_tx),
            replies: reply_rx,
            handle: Some(handle),
        },
        Err(error) => {
            tracing::error!(rank, %error, "cannot spawn a megatron rank thread");
            Worker {
                jobs: None,
                replies: reply_rx,
                handle: None,
            }
        }
    }
}

fn build_rank(
    spec: RankSpec,
    world: LocalComm,
    full: &[f32],
    full_layout: &ParamLayout,
) -> Result<Rank, BackendError> {
    let grid = spec.grid;
    let tp = world.split(grid.dp_rank(), grid.tp_rank())?;
    let dp = world.split(grid.tp_rank(), grid.dp_rank())?;
    let mut local = vec![0.0; spec.model.layout().len()];
    scatter(
        full_layout,
        spec.model.layout(),
        full,
        &mut local,
        grid.tp_rank(),
    );
    let comms = Comms {
        world: Box::new(world),
        tp,
        dp,
    };
    Rank::new(spec, comms, &local)
}

impl Drop for MegatronTrainer {
    fn drop(&mut self) {
        for worker in &mut self.workers {
            worker.jobs = None;
        }
        for (rank, worker) in self.workers.iter_mut().enumerate() {
            if let Some(handle) = worker.handle.take()
                && handle.join().is_err()
            {
                tracing::error!(rank, "megatron rank thread panicked");
            }
        }
    }
}

impl TrainBackend for MegatronTrainer {
    fn name(&self) -> &'static str {
        "megatron"
    }

    fn config(&self) -> &LlamaConfig {
        &self.config
    }

    fn step(&self) -> u64 {
        self.step
    }

    fn is_offloaded(&self) -> bool {
        self.offloaded
    }

    fn device_memory(&self) -> Vec<(MemoryTag, u64)> {
        sum_over_ranks(self.managers.iter().map(|m| m.resident_bytes()))
    }

    fn set_lr(&mut self, lr: f32) -> Result<(), BackendError> {
        self.options.adamw.lr = lr;
        self.run_all(false, |_| {
            Box::new(move |rank| {
                rank.set_lr(lr);
                Ok(Reply::Done)
            })
        })?;
        Ok(())
    }

    fn train_step(&mut self, batch: &Batch) -> Result<StepStats, BackendError> {
        self.check_on_device("train")?;
        self.check_batch(batch)?;
        let dp = self.options.data_parallel;
        let start = Instant::now();
        let shared = Arc::new(batch.clone());
        let grids: Vec<Grid> = (0..self.workers.len()).map(|r| self.grid(r)).collect();
        let replies = self.run_all(true, |r| {
            let batch = Arc::clone(&shared);
            let rows = batch.share(grids[r].dp_rank(), dp);
            Box::new(move |rank| {
                let (loss, grad_norm, entropy) = rank.train_step(&batch.rows(rows))?;
                Ok(Reply::Step {
                    loss,
                    grad_norm,
                    entropy,
                })
            })
        })?;
        let (mut loss, mut grad_norm, mut entropy) = (0.0f32, 0.0f32, None);
        for reply in self.per_dp(replies) {
            match reply {
                Reply::Step {
                    loss: part,
                    grad_norm: norm,
                    entropy: share,
                } => {
                    loss += part;
                    grad_norm = norm;
                    entropy = share.map(|e| e + entropy.unwrap_or(0.0));
                }
                other => return Err(unexpected(&other)),
            }
        }
        self.step += 1;
        Ok(StepStats {
            step: self.step,
            loss,
            grad_norm,
            entropy,
            tokens: (batch.batch * batch.seq) as u64,
            seconds: start.elapsed().as_secs_f64(),
            optimizer_stream: None,
        })
    }

    fn logprobs(&mut self, batch: &Batch) -> Result<(Vec<f32>, f32), BackendError> {
        self.check_on_device("compute log-probs")?;
        self.check_batch(batch)?;
        let dp = self.options.data_parallel;
        let shared = Arc::new(batch.clone());
        let grids: Vec<Grid> = (0..self.workers.len()).map(|r| self.grid(r)).collect();
        let replies = self.run_all(true, |r| {
            let batch = Arc::clone(&shared);
            let rows = batch.share(grids[r].dp_rank(), dp);
            Box::new(move |rank| {
                let (loss, logprobs) = rank.logprobs(&batch.rows(rows))?;
                Ok(Reply::Logprobs { loss, logprobs })
            })
        })?;
        let (mut loss, mut all) = (0.0f32, Vec::with_capacity(batch.batch * batch.seq));
        for reply in self.per_dp(replies) {
            match reply {
                Reply::Logprobs {
                    loss: part,
                    logprobs,
                } => {
                    loss += part;
                    all.extend_from_slice(&logprobs);
                }
                other => return Err(unexpected(&other)),
            }
        }
        Ok((all, loss))
    }

    fn offload(&mut self) -> Result<OffloadStats, BackendError> {
        self.check_on_device("offload")?;
        let start = Instant::now();
        let result = self.run_all(false, |_| {
            Box::new(|rank| Ok(Reply::Offload(rank.offload()?)))
        });
        match result {
            Ok(replies) => {
                self.offloaded = true;
                self.offload_stats(replies, start)
            }
            Err(error) => {
                // Ranks that did offload come back, so the trainer stays usable on the device.
                let undo = self.run_all(false, |_| {
                    Box::new(|rank| {
                        if rank.is_offloaded() {
                            rank.onload()?;
                        }
                        Ok(Reply::Done)
                    })
                });
                if let Err(undo) = undo {
                    tracing::error!(%undo, "cannot bring ranks back after a failed offload");
                }
                Err(error)
            }
        }
    }

    fn onload(&mut self) -> Result<OffloadStats, BackendError> {
        if !self.offloaded {
            return Err(BackendError::NotOffloaded);
        }
        let start = Instant::now();
        let replies = self.run_all(false, |_| {
            Box::new(|rank| Ok(Reply::Offload(rank.onload()?)))
        })?;
        self.offloaded = false;
        self.offload_stats(replies, start)
    }

    fn export_weights(
        &mut self,
        bucket_bytes: usize,
        sink: &mut WeightSink<'_>,
    ) -> Result<(), BackendError> {
        self.check_on_device("export weights")?;
        let full = self.full_params()?;
        export_full_weights(&self.full_layout, &full, bucket_bytes, sink)
    }

    fn save(&mut self, dir: &Path) -> Result<(), BackendError> {
        self.check_on_device("save")?;
        let full = self.full_params()?;
        save_checkpoint(dir, &self.config, &self.full_layout, &full)?;
        let (tp, dp, step) = (
            self.options.tensor_parallel,
            self.options.data_parallel,
            self.step,
        );
        let dir = Arc::new(dir.to_path_buf());
        self.run_all(false, |_| {
            let dir = Arc::clone(&dir);
            Box::new(move |rank| {
                let (m, v) = rank.moments()?;
                write_optimizer_rank(&dir, rank.grid.rank, tp, dp, step, &m, &v)?;
                Ok(Reply::Done)
            })
        })?;
        Ok(())
    }

    fn load(&mut self, dir: &Path) -> Result<(), BackendError> {
        self.check_on_device("load")?;
        let (_, params) = load_checkpoint_of(dir, &self.full_layout)?;
        let full = Arc::new(params);
        let optimizer = Arc::new(read_full_optimizer(dir, &self.config, &self.full_layout)?);
        let full_layout = self.full_layout.clone();
        let steps = self.run_all(false, |_| {
            let (full, full_layout, optimizer) = (
                Arc::clone(&full),
                full_layout.clone(),
                Arc::clone(&optimizer),
            );
            Box::new(move |rank| {
                let (tp_rank, dp_rank) = (rank.grid.tp_rank(), rank.grid.dp_rank());
                let mut local = vec![0.0; rank.layout().len()];
                scatter(&full_layout, rank.layout(), &full, &mut local, tp_rank);
                rank.set_local_params(&local)?;
                let Some(saved) = optimizer.as_ref() else {
                    return Ok(Reply::Loaded { step: None });
                };
                let slice = |full: &[f32]| {
                    own_slice(
                        &full_layout,
                        rank.layout(),
                        full,
                        tp_rank,
                        dp_rank,
                        rank.shard_len(),
                    )
                };
                let (m, v) = (slice(&saved.m), slice(&saved.v));
                rank.set_moments(&m, &v)?;
                rank.step = saved.step;
                Ok(Reply::Loaded {
                    step: Some(saved.step),
                })
            })
        })?;
        if let Some(Reply::Loaded { step: Some(step) }) = steps.first() {
            self.step = *step;
        }
        Ok(())
    }
}
