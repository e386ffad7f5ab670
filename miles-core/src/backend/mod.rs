//! The plug-in contracts: what the orchestrator and the CLI drive, whatever runs behind them.
//! [`TrainBackend`] (a trainer, whatever its parallelism), [`RolloutEngine`] (an inference
//! engine) and [`Critic`] (PPO's value function).
//!
//! A backend crate (`miles-megatron`, `miles-fsdp`) implements [`TrainBackend`] over the
//! [`Communicator`](crate::comm::Communicator) and the [`MemoryManager`](crate::MemoryManager)
//! and depends on nothing else of the workspace. Backends are built by their own constructors
//! (each takes what it needs, typically the validated [`Settings`](crate::Settings) and a
//! [`LlamaConfig`]), so the trait stays object safe: `Box<dyn TrainBackend>`.
//!
//! Every call here is collective over the backend's ranks: the backend runs them on all ranks
//! (threads on the CPU device, processes on CUDA) and returns once all are done. One exception:
//! a GPU backend whose ranks hold the bf16 weights whole (Megatron's data parallelism, fsdp on
//! one GPU) reads them in [`TrainBackend::export_weights`] alone, so a rank may export without
//! the others; where they are split (tensor parallelism, fsdp over several GPUs) every rank
//! exports at once.

mod critic;
mod data_parallel;
mod gpu;
pub mod optimizer;
mod rollout;

use std::path::Path;
use std::sync::Arc;

use half::bf16;

use crate::comm::CommError;
use crate::config::OffloadTarget;
use crate::device::{Device, Fence, GpuSlice};
use crate::memory::{MemoryError, MemoryTag, OffloadReport};
use crate::model::{LlamaConfig, ModelError, TrainBatch};
use crate::store::{StoreError, StreamStats};

pub use critic::Critic;
pub use data_parallel::{DataParallelGroup, DataParallelSplit, data_parallel_gpu_trainer};
pub use gpu::{GpuBackend, OptimizerFiles, check_job_ranks};
pub use optimizer::{OPTIMIZER_DIR, OptimizerShards, SavedOptimizer};
pub use rollout::{EngineError, RolloutEngine, Sample, Sampling};

/// A global training batch of `B` sequences of `T` positions, owned, for policy-gradient or
/// supervised loss.
///
/// The loss is `sum(weights * -log p(targets)) / normaliser` over the whole batch; a
/// data-parallel backend gives each rank whole sequences and keeps the global normaliser, so the
/// loss and gradients do not depend on how the batch was split.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    /// `B`.
    pub batch: usize,
    /// `T`.
    pub seq: usize,
    /// Input token ids `(B, T)`.
    pub inputs: Vec<u32>,
    /// Target token ids `(B, T)`: the token each position predicts.
    pub targets: Vec<u32>,
    /// Weight of each target `(B, T)`: 0 masks it, an advantage scales it (policy gradient).
    pub weights: Vec<f32>,
    /// The divisor of the weighted sum (for example the count of unmasked targets).
    pub normaliser: f32,
    /// Which targets' entropy the step measures and rewards `(B, T)`: 1 on response tokens, 0
    /// elsewhere; `None` measures none ([`StepStats::entropy`] is then `None`).
    pub entropy_mask: Option<Vec<f32>>,
    /// The entropy bonus: the loss falls by `entropy_coef * Σ mask_t H_t / normaliser`; 0 adds
    /// nothing (and every backend accepts it).
    pub entropy_coef: f32,
}

impl Batch {
    /// The batch as the model's borrowed view.
    pub fn view(&self) -> TrainBatch<'_> {
        TrainBatch {
            batch: self.batch,
            seq: self.seq,
            inputs: &self.inputs,
            targets: &self.targets,
            weights: &self.weights,
            normaliser: self.normaliser,
            entropy_mask: self.entropy_mask.as_deref(),
            entropy_coef: self.entropy_coef,
        }
    }

    /// Sequences `rows` of the batch, keeping the global normaliser (one data-parallel rank's
    /// share).
    pub fn rows(&self, rows: std::ops::Range<usize>) -> TrainBatch<'_> {
        self.view().sequences(rows)
    }

    /// Sequences of data-parallel rank `rank` of `ranks`: a contiguous, near-equal share
    /// (the first `B % ranks` ranks take one more).
    pub fn share(&self, rank: usize, ranks: usize) -> std::ops::Range<usize> {
        let ranks = ranks.max(1);
        let (base, extra) = (self.batch / ranks, self.batch % ranks);
        let start = rank * base + rank.min(extra);
        start..start + base + usize::from(rank < extra)
    }

    /// Checks the lengths, that every data-parallel rank gets at least one sequence, and the
    /// normaliser.
    ///
    /// # Errors
    /// [`BackendError::Batch`] naming what does not fit.
    pub fn check(&self, data_parallel: usize) -> Result<(), BackendError> {
        let n = self.batch * self.seq;
        for (what, len) in [
            ("inputs", self.inputs.len()),
            ("targets", self.targets.len()),
            ("weights", self.weights.len()),
            (
                "entropy mask",
                self.entropy_mask.as_ref().map_or(n, Vec::len),
            ),
        ] {
            if len != n {
                return Err(BackendError::Batch(format!(
                    "{what} has {len} entries, batch {} x seq {} needs {n}",
                    self.batch, self.seq
                )));
            }
        }
        if self.batch < data_parallel {
            return Err(BackendError::Batch(format!(
                "{} sequences cannot feed {data_parallel} data-parallel ranks; give at least one sequence per rank",
                self.batch
            )));
        }
        if !(self.normaliser.is_finite() && self.normaliser > 0.0) {
            return Err(BackendError::Batch(format!(
                "normaliser {} must be positive and finite",
                self.normaliser
            )));
        }
        Ok(())
    }
}

/// What one training step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepStats {
    /// The step just taken (1 for the first).
    pub step: u64,
    /// The loss of the batch before the update.
    pub loss: f32,
    /// Global L2 norm of the gradients before clipping.
    pub grad_norm: f32,
    /// `Σ mask_t H_t / normaliser` of the batch's entropy mask under the weights before the
    /// update (the mean entropy of the response tokens, with the loop's batches); `None`
    /// without a mask, or from a backend that does not measure it (the GPU trainers).
    pub entropy: Option<f32>,
    /// Token positions processed (`B * T`).
    pub tokens: u64,
    /// Wall time of the step.
    pub seconds: f64,
    /// What the step read and wrote of optimizer state streamed through the disk
    /// (`--stream-optimizer-state-to-disk`) and how long it waited for it; `None` when the
    /// backend does not report it (resident state).
    pub optimizer_stream: Option<StreamStats>,
}

/// One rank's share of an offload or onload.
#[derive(Clone, Debug, PartialEq)]
pub struct RankOffload {
    /// The rank (global).
    pub rank: usize,
    /// Bytes moved (or released, for tags without backup) over all its tags.
    pub bytes: u64,
    /// Wall time of the rank's whole offload or onload.
    pub seconds: f64,
    /// `bytes / seconds` in 10^9 bytes per second.
    pub gbps: f64,
    /// The memory manager's report of each tag.
    pub tags: Vec<OffloadReport>,
}

impl RankOffload {
    /// The rank's figures from its per-tag reports and its measured wall time.
    pub fn new(rank: usize, seconds: f64, tags: Vec<OffloadReport>) -> RankOffload {
        let bytes = tags.iter().map(|r| r.bytes).sum();
        RankOffload {
            rank,
            bytes,
            seconds,
            gbps: gbps(bytes, seconds),
            tags,
        }
    }
}

/// What an offload or onload did, per rank.
#[derive(Clone, Debug, PartialEq)]
pub struct OffloadStats {
    /// Where the bytes went (offload) or came from (onload).
    pub target: OffloadTarget,
    /// Each rank's figures, in rank order.
    pub ranks: Vec<RankOffload>,
    /// Wall time of the whole operation (ranks run in parallel).
    pub seconds: f64,
}

impl OffloadStats {
    /// Bytes over all ranks.
    pub fn bytes(&self) -> u64 {
        self.ranks.iter().map(|r| r.bytes).sum()
    }

    /// All ranks' bytes over the wall time, in 10^9 bytes per second.
    pub fn gbps(&self) -> f64 {
        gbps(self.bytes(), self.seconds)
    }
}

fn gbps(bytes: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        bytes as f64 / seconds / 1e9
    } else {
        0.0
    }
}

/// Whole tensors of the full (unsharded) model, by Hugging Face name: one bucket of a weight
/// export.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WeightBucket {
    /// The tensors, in [`ParamLayout`](crate::model::ParamLayout) order.
    pub tensors: Vec<NamedTensor>,
}

impl WeightBucket {
    /// Bytes of the bucket's data.
    pub fn bytes(&self) -> usize {
        self.tensors.iter().map(|t| t.data.len() * 4).sum()
    }
}

/// One full tensor by Hugging Face name.
#[derive(Clone, Debug, PartialEq)]
pub struct NamedTensor {
    /// Hugging Face name (`model.layers.0.self_attn.q_proj.weight`).
    pub name: String,
    /// Shape, row-major, as Hugging Face stores it.
    pub shape: Vec<usize>,
    /// fp32 values.
    pub data: Vec<f32>,
}

/// A backend's full bf16 weights in device memory, in [`ParamLayout`](crate::model::ParamLayout)
/// order (a tied head once, as the embedding): what a rollout engine on the same device copies
/// without crossing the host link ([`TrainBackend::device_weights`]).
#[derive(Clone, Debug)]
pub struct DeviceWeights {
    /// The device the weights live on; an engine copies them only onto the same one.
    pub device: Arc<dyn Device>,
    /// The weights: [`ParamLayout::len`](crate::model::ParamLayout::len) elements.
    pub params: GpuSlice<bf16>,
    /// Signalled once the work queued before the weights were handed out (the last optimizer
    /// update) is done: a copy waits for it on the device before reading.
    pub ready: Fence,
}

impl DeviceWeights {
    /// Bytes of the weights.
    pub fn bytes(&self) -> u64 {
        (self.params.len() * size_of::<bf16>()) as u64
    }
}

/// Receives the buckets of [`TrainBackend::export_weights`] in order.
pub type WeightSink<'a> = dyn FnMut(WeightBucket) -> Result<(), BackendError> + 'a;

/// A training backend: sharded model, optimizer and their memory, behind one handle.
pub trait TrainBackend: Send {
    /// The backend's name (`megatron`, `fsdp`).
    fn name(&self) -> &'static str;

    /// The model's config.
    fn config(&self) -> &LlamaConfig;

    /// Optimizer steps taken so far (restored by [`load`](Self::load)).
    fn step(&self) -> u64;

    /// Whether the training tensors are offloaded (and must be onloaded before training).
    fn is_offloaded(&self) -> bool;

    /// Device bytes each memory tag of the backend holds now, summed over its ranks (0 for a
    /// paused tag): what the loop's memory metrics and timeline read at every phase boundary.
    fn device_memory(&self) -> Vec<(MemoryTag, u64)>;

    /// One optimizer step on `batch`: forward, backward, gradient reduction, AdamW.
    ///
    /// # Errors
    /// [`BackendError::Offloaded`] while offloaded, [`BackendError::Batch`] for a bad batch, or
    /// what a rank hit ([`BackendError::Model`], [`BackendError::Comm`], ...).
    fn train_step(&mut self, batch: &Batch) -> Result<StepStats, BackendError>;

    /// Per-token log-probs of `batch`'s targets under the current weights, `(B, T)`, and the
    /// loss; no gradient, no update (the RL loop's trainer log-probs).
    ///
    /// # Errors
    /// As [`train_step`](Self::train_step).
    fn logprobs(&mut self, batch: &Batch) -> Result<(Vec<f32>, f32), BackendError>;

    /// Sets the learning rate of the coming optimizer steps (a schedule's warm-up and decay).
    ///
    /// # Errors
    /// [`BackendError::Settings`] for a backend that cannot change it (the default), naming the
    /// flags that ask for it.
    fn set_lr(&mut self, lr: f32) -> Result<(), BackendError> {
        let _ = lr;
        Err(BackendError::Settings {
            backend: self.name(),
            reason: "cannot change its learning rate during a run; drop --lr-warmup-iters and --lr-decay-style".into(),
        })
    }

    /// Moves parameters and optimizer state to where the backend was built to offload them
    /// (its [`TrainOffload`](crate::config::TrainOffload) plan) and drops gradients, releasing
    /// their device memory; reports per rank.
    ///
    /// # Errors
    /// [`BackendError::Offloaded`] when already offloaded; [`BackendError::Memory`] when a
    /// backup fails (every tag then stays on the device, as it was).
    fn offload(&mut self) -> Result<OffloadStats, BackendError>;

    /// Brings parameters and optimizer state back at the same addresses, bit-exact, and
    /// re-zeroes gradients; reports per rank.
    ///
    /// # Errors
    /// [`BackendError::NotOffloaded`]; [`BackendError::Memory`] when the device lacks room or
    /// a backup fails its checksum.
    fn onload(&mut self) -> Result<OffloadStats, BackendError>;

    /// Sends the full weights, gathered from the shards, by Hugging Face name to `sink` in
    /// buckets of about `bucket_bytes` (a tensor larger than that gets a bucket of its own). A
    /// GPU backend sends the weights it computes with, the bf16 rounding of its master weights
    /// (widened to fp32); the CPU backends send their fp32 weights.
    ///
    /// # Errors
    /// [`BackendError::Offloaded`]; what the sink returns; what a rank hit.
    fn export_weights(
        &mut self,
        bucket_bytes: usize,
        sink: &mut WeightSink<'_>,
    ) -> Result<(), BackendError>;

    /// The full bf16 weights where they live on the device, for a rollout engine on the same
    /// device to copy there ([`RolloutEngine::copy_device_weights`]); they stay valid until the
    /// next call that changes or moves them (a train step, an offload, a load). `None` for a
    /// backend that holds no full bf16 copy on one device (the CPU backends, tensor
    /// parallelism, fsdp over several GPUs), or while offloaded: the loop then syncs through
    /// [`export_weights`](Self::export_weights).
    ///
    ///
    /// # Errors
    /// What the device hit recording the fence.
    fn device_weights(&self) -> Result<Option<DeviceWeights>, BackendError> {
        Ok(None)
    }

    /// Writes a checkpoint into `dir`: the weights as a Hugging Face safetensors checkpoint,
    /// plus the optimizer state and step in the backend's own files.
    ///
    /// # Errors
    /// [`BackendError::Offloaded`], [`BackendError::Model`] or [`BackendError::Io`].
    fn save(&mut self, dir: &Path) -> Result<(), BackendError>;

    /// On a rank of a job that does not write the checkpoint, at the moment the writing rank
    /// calls [`save`](Self::save): the part of the save every rank takes part in (a state
    /// split over the ranks is gathered to the writer). Writes nothing. By default, nothing.
    ///
    /// # Errors
    /// [`BackendError::Offloaded`], [`BackendError::Model`].
    fn assist_save(&mut self) -> Result<(), BackendError> {
        Ok(())
    }

    /// Restores weights, optimizer state and step from a checkpoint written by
    /// [`save`](Self::save) with the same parallel layout (weights alone, from any Hugging Face
    /// checkpoint of the same config, when the optimizer files are absent).
    ///
    /// # Errors
    /// [`BackendError::Offloaded`], [`BackendError::Model`], [`BackendError::Io`] or
    /// [`BackendError::Checkpoint`] for files that do not match the backend.
    fn load(&mut self, dir: &Path) -> Result<(), BackendError>;
}

/// Sends the full weights `full` (laid out by `layout`) to `sink` tensor by tensor, in buckets of
/// about `bucket_bytes` (a tensor larger than that gets a bucket of its own): the body of every
/// backend's [`TrainBackend::export_weights`] once it holds the full weights.
///
/// # Errors
/// What the sink returns.
pub fn export_full_weights(
    layout: &crate::model::ParamLayout,
    full: &[f32],
    bucket_bytes: usize,
    sink: &mut WeightSink<'_>,
) -> Result<(), BackendError> {
    let mut bucket = WeightBucket::default();
    for spec in layout.specs() {
        let tensor = NamedTensor {
            name: spec.name.clone(),
            shape: spec.shape.clone(),
            data: full[spec.range()].to_vec(),
        };
        if !bucket.tensors.is_empty() && bucket.bytes() + tensor.data.len() * 4 > bucket_bytes {
            sink(std::mem::take(&mut bucket))?;
        }
        bucket.tensors.push(tensor);
    }
    if !bucket.tensors.is_empty() {
        sink(bucket)?;
    }
    Ok(())
}

/// The config and full weights of the checkpoint in `dir`, which must be of the model `layout`
/// lays out: the first step of every backend's [`TrainBackend::load`].
///
/// # Errors
/// [`BackendError::Checkpoint`] for a checkpoint of another model; the model's error when the
/// checkpoint cannot be read.
pub fn load_checkpoint_of(
    dir: &Path,
    layout: &crate::model::ParamLayout,
) -> Result<(LlamaConfig, Vec<f32>), BackendError> {
    let (config, params) = crate::model::load_checkpoint(dir)?;
    if crate::model::ParamLayout::new(&config) != *layout {
        return Err(BackendError::Checkpoint {
            path: dir.to_path_buf(),
            reason: "its config describes a different model than this trainer's".to_string(),
        });
    }
    Ok((config, params))
}

/// Sums per-rank tag lists (each as [`MemoryManager::resident_bytes`](crate::MemoryManager::resident_bytes)
/// gives it) tag by tag, tags in the order first seen: a multi-rank backend's
/// [`TrainBackend::device_memory`].
pub fn sum_over_ranks(
    ranks: impl IntoIterator<Item = Vec<(MemoryTag, u64)>>,
) -> Vec<(MemoryTag, u64)> {
    let mut tags: Vec<(MemoryTag, u64)> = Vec::new();
    for (tag, bytes) in ranks.into_iter().flatten() {
        match tags.iter_mut().find(|(t, _)| *t == tag) {
            Some((_, total)) => *total += bytes,
            None => tags.push((tag, bytes)),
        }
    }
    tags
}

/// What went wrong in a training backend.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// Settings the backend cannot run with.
    #[error("{backend}: {reason}")]
    Settings {
        /// The backend.
        backend: &'static str,
        /// What is wrong and what to change.
        reason: String,
    },
    /// A batch that does not fit.
    #[error("invalid training batch: {0}")]
    Batch(String),
    /// An operation that needs the tensors on the device, called while offloaded.
    #[error("cannot {op} while the training tensors are offloaded; call onload first")]
    Offloaded {
        /// The operation.
        op: &'static str,
    },
    /// Onload without a previous offload.
    #[error("cannot onload: the training tensors are not offloaded")]
    NotOffloaded,
    /// The model failed (shapes, tokens, checkpoint files).
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The memory manager failed (allocation, pause, resume).
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// A backup or streaming store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A backend file could not be read or written.
    #[error("cannot {action} {path}: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The file.
        path: std::path::PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// A checkpoint that does not match this backend.
    #[error("bad checkpoint {path}: {reason}")]
    Checkpoint {
        /// The file.
        path: std::path::PathBuf,
        /// What does not match.
        reason: String,
    },
    /// A rank's thread died without returning.
    #[error("{backend} rank {rank} stopped unexpectedly (its thread panicked); see its log")]
    RankLost {
        /// The backend.
        backend: &'static str,
        /// The rank.
        rank: usize,
    },
    /// A failure of the receiver of exported weights.
    #[error("weight sink failed: {0}")]
    Sink(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(b: usize, t: usize) -> Batch {
        let n = b * t;
        Batch {
            batch: b,
            seq: t,
            inputs: (0..n as u32).collect(),
            targets: (1..=n as u32).collect(),
            weights: (0..n).map(|i| 0.5 + i as f32).collect(),
            normaliser: n as f32,
            entropy_mask: None,
            entropy_coef: 0.0,
        }
    }

    #[test]
    fn shares_cover_the_batch_in_order_without_overlap() {
        let b = batch(7, 3);
        let shares: Vec<_> = (0..3).map(|r| b.share(r, 3)).collect();
        assert_eq!(shares, vec![0..3, 3..5, 5..7]);
        let rows = b.rows(shares[1].clone());
        assert_eq!(rows.batch, 2);
        assert_eq!(rows.inputs, &b.inputs[9..15]);
        assert_eq!(rows.normaliser, b.normaliser);
    }

    #[test]
    fn batch_check_names_what_does_not_fit() {
        let mut b = batch(2, 4);
        assert!(b.check(2).is_ok());
        assert!(matches!(b.check(3), Err(BackendError::Batch(m)) if m.contains("3 data-parallel")));
        b.weights.pop();
        assert!(matches!(b.check(1), Err(BackendError::Batch(m)) if m.contains("weights")));
    }

    #[test]
    fn sum_over_ranks_adds_each_tag_over_the_ranks() {
        let rank = |params, grads| vec![(MemoryTag::Grads, grads), (MemoryTag::Params, params)];
        assert_eq!(
            sum_over_ranks([rank(3, 5), rank(7, 0)]),
            [(MemoryTag::Grads, 5), (MemoryTag::Params, 10)]
        );
        assert!(sum_over_ranks(Vec::new()).is_empty());
    }

    #[test]
    fn offload_stats_sum_ranks_over_wall_time() {
        let rank = |r, bytes| RankOffload {
            rank: r,
            bytes,
            seconds: 1.0,
            gbps: 0.0,
            tags: Vec::new(),
        };
        let stats = OffloadStats {
            target: OffloadTarget::Host,
            ranks: vec![rank(0, 3_000_000_000), rank(1, 1_000_000_000)],
            seconds: 2.0,
        };
        assert_eq!(stats.bytes(), 4_000_000_000);
        assert!((stats.gbps() - 2.0).abs() < 1e-12);
    }
}
