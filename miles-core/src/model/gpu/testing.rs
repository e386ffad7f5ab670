//! GPU test support shared by core's GPU model tests and the backends' parallel-group tests
//! (`miles-megatron`'s tensor-parallel pair, core's data-parallel pair): seeded weights
//! and batches, a memory manager over a GPU, trainer specs, two GPUs when the machine has them,
//! and the comparison of a parallel pair's losses against one GPU's. Built for this crate's
//! tests and behind the `testing` feature (a dev-dependency of the backend crates); it panics
//! on failure, as tests do.

use std::sync::Arc;

use half::bf16;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{GpuTrainer, GpuTrainerSpec, OptimizerShard};
use crate::device::{Collectives, CudaDevice, Device, DeviceError, Gpu, GpuSlice};
use crate::memory::{BackupPolicy, ManagerSettings, MemoryManager};
use crate::model::{LlamaConfig, ParamKind, ParamLayout, TrainBatch, init_params};
use crate::ops::AdamWConfig;
use crate::ops::gpu::testing::TestGpu;

/// Sequences in a [`Batch`].
pub const B: usize = 3;
/// Positions of each sequence in a [`Batch`].
pub const T: usize = 17;

/// The tiny preset.
pub fn tiny() -> LlamaConfig {
    LlamaConfig::preset("tiny").unwrap()
}

/// The tiny preset as a model of `model_type`: `qwen2` (q/k/v biases, tied head) or `qwen3`
/// (per-head q/k norms, `head_dim` 24 where hidden / heads is 16, an untied head).
pub fn tiny_family(model_type: &str) -> LlamaConfig {
    let mut v: serde_json::Value =
        serde_json::from_str(include_str!("../../../presets/tiny.json")).unwrap();
    v["model_type"] = model_type.into();
    if let Some(fields) = v.as_object_mut() {
        fields.remove("architectures");
    }
    if model_type == "qwen3" {
        v["head_dim"] = 24.into();
        v["tie_word_embeddings"] = false.into();
    }
    LlamaConfig::from_json_str(&v.to_string()).unwrap()
}

/// [`bf16_params`] with every bias drawn from ±0.1 and every q/k norm weight from 0.5..1.5
/// (Hugging Face starts them at zeros and ones, which would leave their kernels untested),
/// rounded to bf16.
pub fn family_params(config: &LlamaConfig, seed: u64) -> Vec<f32> {
    let layout = ParamLayout::new(config);
    let mut params = bf16_params(config, seed);
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x9e37_79b9);
    for spec in layout.specs() {
        let draw: fn(f32) -> f32 = match spec.kind {
            ParamKind::QBias | ParamKind::KBias | ParamKind::VBias => |u| (u * 2.0 - 1.0) * 0.1,
            ParamKind::QNorm | ParamKind::KNorm => |u| 0.5 + u,
            _ => continue,
        };
        for p in &mut params[spec.range()] {
            *p = bf16::from_f32(draw(rng.random::<f32>())).to_f32();
        }
    }
    params
}

/// Hugging Face initialisation from `seed`, rounded to bf16 so both devices start equal.
pub fn bf16_params(config: &LlamaConfig, seed: u64) -> Vec<f32> {
    let layout = ParamLayout::new(config);
    let mut params = vec![0.0; layout.len()];
    init_params(&layout, config, seed, &mut params).unwrap();
    params.iter().map(|&p| bf16::from_f32(p).to_f32()).collect()
}

/// Random inputs, targets and weights (some negative, as advantages are) for `B x T` tokens
/// (or another shape).
#[derive(Debug)]
pub struct Batch {
    batch: usize,
    seq: usize,
    /// Input tokens, `(B, T)`.
    pub inputs: Vec<u32>,
    /// Target tokens, `(B, T)`.
    pub targets: Vec<u32>,
    /// Per-token weights, `(B, T)`.
    pub weights: Vec<f32>,
}

impl Batch {
    /// `B x T` tokens below `vocab` and weights, drawn from `seed`.
    pub fn random(seed: u64, vocab: usize) -> Batch {
        Batch::random_of(seed, vocab, B, T)
    }

    /// `batch x seq` tokens below `vocab` and weights, drawn from `seed`.
    pub fn random_of(seed: u64, vocab: usize, batch: usize, seq: usize) -> Batch {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let n = batch * seq;
        let mut ids =
            |n: usize| -> Vec<u32> { (0..n).map(|_| rng.random_range(0..vocab as u32)).collect() };
        let (inputs, targets) = (ids(n), ids(n));
        let weights = (0..n).map(|_| rng.random::<f32>() * 2.0 - 0.5).collect();
        Batch {
            batch,
            seq,
            inputs,
            targets,
            weights,
        }
    }

    /// The batch, normalised by its token count.
    pub fn view(&self) -> TrainBatch<'_> {
        TrainBatch {
            batch: self.batch,
            seq: self.seq,
            inputs: &self.inputs,
            targets: &self.targets,
            weights: &self.weights,
            normaliser: (self.batch * self.seq) as f32,
            entropy_mask: None,
            entropy_coef: 0.0,
        }
    }
}

/// Sequences `rows` of a batch of 4 x 16 tokens drawn from `seed` (ids below `vocab`),
/// normalised by the share of the whole batch's tokens one of `parts` equal parts holds: one
/// data-parallel rank's part of a backend's batch.
pub fn backend_batch(
    seed: u64,
    vocab: usize,
    rows: std::ops::Range<usize>,
    parts: usize,
) -> crate::backend::Batch {
    let data = Batch::random_of(seed, vocab, 4, 16);
    let cut = |x: &[u32]| x[rows.start * 16..rows.end * 16].to_vec();
    crate::backend::Batch {
        batch: rows.len(),
        seq: 16,
        inputs: cut(&data.inputs),
        targets: cut(&data.targets),
        weights: data.weights[rows.start * 16..rows.end * 16].to_vec(),
        normaliser: 64.0 / parts as f32,
        entropy_mask: None,
        entropy_coef: 0.0,
    }
}

/// The full weights a backend exports.
pub fn exported(backend: &mut dyn crate::backend::TrainBackend) -> Vec<f32> {
    let mut full = Vec::new();
    backend
        .export_weights(1 << 20, &mut |bucket| {
            for tensor in bucket.tensors {
                full.extend(tensor.data);
            }
            Ok(())
        })
        .unwrap();
    full
}

/// A backend loaded from a checkpoint a parallel job wrote after `step` steps resumes it: the
/// same step, the weights the job exported (`trained`), and on `batch` a next loss within 1% of
/// the job's (`next`).
pub fn assert_resumes(
    what: &str,
    loaded: &mut dyn crate::backend::TrainBackend,
    step: u64,
    (trained, batch, next): (&[f32], &crate::backend::Batch, f32),
) {
    assert_eq!(loaded.step(), step);
    assert!(
        exported(loaded) == trained,
        "{what}: the checkpoint loads other weights than the job trained"
    );
    let loss = loaded.train_step(batch).unwrap().loss;
    let rel = (loss - next).abs() / next.abs();
    assert!(rel < 1e-2, "next loss {loss} after loading vs {next}");
}

/// A manager over the gpu's own device.
pub fn manager(gpu: &Gpu) -> Arc<MemoryManager> {
    let device: Arc<dyn Device> = Arc::clone(gpu.device()) as Arc<dyn Device>;
    let settings = ManagerSettings {
        margin_bytes: 0,
        disk: None,
    };
    Arc::new(MemoryManager::new(device, settings).unwrap())
}

/// AdamW at lr 1e-2 with `backup`, activations for `max_batch_tokens` tokens.
pub fn spec(config: LlamaConfig, backup: BackupPolicy, max_batch_tokens: usize) -> GpuTrainerSpec {
    GpuTrainerSpec {
        config,
        adamw: AdamWConfig {
            lr: 1e-2,
            ..AdamWConfig::default()
        },
        backup,
        max_batch_tokens,
        stream: None,
        shard: OptimizerShard::WHOLE,
        optimizer_on_host: false,
    }
}

/// Losses of a parallel pair against one GPU, relative: the same fp32 gradients summed in
/// another order (data parallel) or bf16 partial sums (tensor parallel), then bf16 weights. At
/// the trajectory test's learning rate (1e-2) the tiny model on random targets amplifies last
/// bits to 4% by step 5 (call 18 of `bench/RESULTS.md`, round 14), so these tests step at 1e-3.
pub const PARALLEL_TOLERANCE: f32 = 1e-2;
/// Steps of a parallel pair's comparison.
pub const PARALLEL_STEPS: u64 = 5;

/// GPU 0, or `None` with a skip note unless `MILES_TEST_DEVICE=cuda`.
pub fn one_gpu(test: &str) -> Option<Arc<Gpu>> {
    TestGpu::open(test, 1).map(|t| Arc::new(t.gpu))
}

/// GPUs 0 (with the test's lock) and 1, or `None` with a skip note on a machine with fewer.
pub fn two_gpus(test: &str) -> Option<[Arc<Gpu>; 2]> {
    gpus(test, 2).and_then(|gpus| gpus.try_into().ok())
}

/// GPUs 0 (with the test's lock) to `n - 1`, or `None` with a skip note on a machine with
/// fewer.
pub fn gpus(test: &str, n: usize) -> Option<Vec<Arc<Gpu>>> {
    let t = TestGpu::open(test, 1)?;
    let mut gpus = vec![Arc::new(t.gpu)];
    for ordinal in 1..n {
        match CudaDevice::open(i32::try_from(ordinal).unwrap()) {
            Ok(device) => {
                gpus.push(Arc::new(
                    crate::ops::gpu::open_gpu(Arc::new(device)).unwrap(),
                ));
            }
            Err(error) => {
                eprintln!("skipping {test}: it needs {n} gpus ({error})");
                return None;
            }
        }
    }
    Some(gpus)
}

/// AdamW at lr 1e-3, no backup, activations for 64 tokens.
pub fn gentle(config: LlamaConfig) -> GpuTrainerSpec {
    GpuTrainerSpec {
        adamw: AdamWConfig {
            lr: 1e-3,
            ..AdamWConfig::default()
        },
        ..spec(config, BackupPolicy::None, 64)
    }
}

/// The losses of [`PARALLEL_STEPS`] steps of `trainer` on `batch`.
pub fn losses(trainer: &mut GpuTrainer, batch: &TrainBatch<'_>) -> Vec<f32> {
    (1..=PARALLEL_STEPS)
        .map(|step| trainer.train_step(batch, step).unwrap().loss)
        .collect()
}

/// The losses of one trainer on `gpu` from `params` on the whole batch.
pub fn losses_alone(
    gpu: &Arc<Gpu>,
    config: &LlamaConfig,
    params: &[f32],
    data: &Batch,
) -> Vec<f32> {
    let spec = gentle(config.clone());
    let mut trainer = GpuTrainer::new(Arc::clone(gpu), manager(gpu), spec, params).unwrap();
    losses(&mut trainer, &data.view())
}

/// Both ranks reported the same losses, and those follow one GPU's step by step.
pub fn assert_pair_follows(what: &str, ranks: &[Vec<f32>], alone: &[f32]) {
    assert_eq!(ranks[0], ranks[1], "the two ranks report different losses");
    for (step, (got, want)) in ranks[0].iter().zip(alone).enumerate() {
        let rel = (got - want).abs() / want.abs();
        eprintln!(
            "step {}: loss over two {what} gpus {got} vs one gpu {want} (relative {rel:.3e})",
            step + 1
        );
        assert!(
            rel < PARALLEL_TOLERANCE,
            "step {}: {got} vs {want}",
            step + 1
        );
    }
}

/// The meeting point of a group of ranks on one GPU whose collectives go through the host
/// ([`HostCollectives`]): each rank leaves its bytes and the call it made, and once all have,
/// each takes every rank's bytes. Ranks whose calls differ (another collective, another
/// length) fail together, naming both calls; a rank that leaves the group (its
/// [`HostCollectives`] dropped, as a failing rank's is when its thread unwinds) fails the
/// others' waiting calls instead of leaving them to hang.
pub struct HostExchange {
    state: std::sync::Mutex<Meeting>,
    arrived: std::sync::Condvar,
}

/// A collective call as the exchange checks it: its name and its length in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Call {
    op: &'static str,
    root: Option<usize>,
    bytes: usize,
}

impl std::fmt::Display for Call {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} of {} bytes", self.op, self.bytes)?;
        match self.root {
            Some(root) => write!(f, " from root {root}"),
            None => Ok(()),
        }
    }
}

/// What the exchange holds between calls.
struct Meeting {
    /// Each rank's call and bytes of the meeting under way.
    slots: Vec<Option<(Call, Vec<u8>)>>,
    /// Meetings completed so far: a waiting rank's cue that its own is done.
    completed: u64,
    /// Every rank's bytes of the last completed meeting, in rank order.
    last: Arc<Vec<Vec<u8>>>,
    /// Why the group can meet no more.
    broken: Option<String>,
}

impl HostExchange {
    /// The meeting point of `ranks` ranks.
    pub fn new(ranks: usize) -> Arc<HostExchange> {
        Arc::new(HostExchange {
            state: std::sync::Mutex::new(Meeting {
                slots: vec![None; ranks],
                completed: 0,
                last: Arc::new(Vec::new()),
                broken: None,
            }),
            arrived: std::sync::Condvar::new(),
        })
    }

    /// Leaves `mine` in slot `rank` for `call` and returns every rank's, once all have left
    /// theirs with the same call.
    fn swap(&self, rank: usize, call: Call, mine: Vec<u8>) -> Result<Arc<Vec<Vec<u8>>>, String> {
        let mut meeting = self.lock();
        if let Some(why) = &meeting.broken {
            return Err(why.clone());
        }
        meeting.slots[rank] = Some((call, mine));
        if meeting.slots.iter().all(Option::is_some) {
            let ranks = meeting.slots.len();
            let slots = std::mem::replace(&mut meeting.slots, vec![None; ranks]);
            let (calls, parts): (Vec<Call>, Vec<Vec<u8>>) = slots.into_iter().flatten().unzip();
            if let Some((other, theirs)) = calls.iter().enumerate().find(|(_, c)| **c != calls[0]) {
                let why = format!(
                    "host collectives out of step: rank 0 called {}, rank {other} {}",
                    calls[0], theirs
                );
                meeting.broken = Some(why.clone());
                self.arrived.notify_all();
                return Err(why);
            }
            meeting.last = Arc::new(parts);
            meeting.completed += 1;
            self.arrived.notify_all();
            return Ok(Arc::clone(&meeting.last));
        }
        let mine = meeting.completed;
        while meeting.completed == mine && meeting.broken.is_none() {
            meeting = self
                .arrived
                .wait(meeting)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        match (&meeting.broken, meeting.completed == mine) {
            (Some(why), true) => Err(why.clone()),
            _ => Ok(Arc::clone(&meeting.last)),
        }
    }

    /// Rank `rank` is gone: every call waiting or to come fails.
    fn leave(&self, rank: usize) {
        let mut meeting = self.lock();
        if meeting.broken.is_none() {
            meeting.broken = Some(format!("rank {rank} left the host collectives' group"));
        }
        self.arrived.notify_all();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Meeting> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// One rank of a group on one GPU whose collectives are computed on the host (sums in rank
/// order, bf16 sums rounded once: NCCL's bits for two ranks, not for more), so that a parallel
/// group's logic runs where one GPU is lent. Each rank queues on a stream of its own
/// ([`Gpu::with_own_stream`]). Unlike NCCL, a rank that fails (and drops its collectives) or
/// calls another collective than its peers fails them rather than leaving them waiting.
pub struct HostCollectives {
    gpu: Arc<Gpu>,
    rank: usize,
    exchange: Arc<HostExchange>,
    world: usize,
}

impl HostCollectives {
    /// Rank `rank` of `world` meeting at `exchange`, on `gpu`.
    pub fn new(
        gpu: Arc<Gpu>,
        rank: usize,
        world: usize,
        exchange: Arc<HostExchange>,
    ) -> HostCollectives {
        HostCollectives {
            gpu,
            rank,
            exchange,
            world,
        }
    }

    /// Every rank's `x`, read from the device, for collective `op`.
    fn gathered<T: crate::device::GpuElement + bytemuck::Pod>(
        &self,
        op: &'static str,
        root: Option<usize>,
        x: GpuSlice<T>,
    ) -> Result<Vec<Vec<T>>, DeviceError> {
        let mut mine = vec![T::zeroed(); x.len()];
        self.gpu.download(&mut mine, x)?;
        let call = Call {
            op,
            root,
            bytes: x.bytes(),
        };
        let all = self
            .exchange
            .swap(self.rank, call, bytemuck::cast_slice(&mine).to_vec())
            .map_err(|message| DeviceError::Cuda {
                call: "host collective",
                message,
            })?;
        Ok(all
            .iter()
            .map(|bytes| {
                let mut part = vec![T::zeroed(); x.len()];
                bytemuck::cast_slice_mut(&mut part).copy_from_slice(bytes);
                part
            })
            .collect())
    }

    /// The element-wise sum in rank order of every rank's `x`.
    fn summed(&self, op: &'static str, x: GpuSlice<f32>) -> Result<Vec<f32>, DeviceError> {
        self.summed_at(op, None, x)
    }

    /// [`summed`](Self::summed) for a collective with a root.
    fn summed_at(
        &self,
        op: &'static str,
        root: Option<usize>,
        x: GpuSlice<f32>,
    ) -> Result<Vec<f32>, DeviceError> {
        let all = self.gathered(op, root, x)?;
        Ok((0..x.len())
            .map(|i| all.iter().map(|part| part[i]).sum())
            .collect())
    }

    /// The element-wise sum in rank order of every rank's bf16 `x`, in fp32 rounded once (NCCL
    /// rounds after every addition, the same for two ranks).
    fn summed_bf16(&self, op: &'static str, x: GpuSlice<bf16>) -> Result<Vec<bf16>, DeviceError> {
        let all = self.gathered(op, None, x)?;
        Ok((0..x.len())
            .map(|i| bf16::from_f32(all.iter().map(|part| f32::from(part[i])).sum()))
            .collect())
    }
}

impl Drop for HostCollectives {
    fn drop(&mut self) {
        self.exchange.leave(self.rank);
    }
}

impl Collectives for HostCollectives {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    fn all_reduce_sum(&self, buf: GpuSlice<f32>) -> Result<(), DeviceError> {
        let sum = self.summed("all_reduce_sum", buf)?;
        self.gpu.upload(buf, &sum)
    }

    fn all_reduce_sum_bf16(&self, buf: GpuSlice<bf16>) -> Result<(), DeviceError> {
        let sum = self.summed_bf16("all_reduce_sum_bf16", buf)?;
        self.gpu.upload(buf, &sum)
    }

    fn all_gather(&self, send: GpuSlice<f32>, recv: GpuSlice<f32>) -> Result<(), DeviceError> {
        let all: Vec<f32> = self.gathered("all_gather", None, send)?.concat();
        self.gpu.upload(recv, &all)
    }

    fn all_gather_bf16_in_place(&self, all: GpuSlice<bf16>) -> Result<(), DeviceError> {
        let block = all.len() / self.world;
        let whole: Vec<bf16> = self
            .gathered(
                "all_gather_bf16_in_place",
                None,
                all.sub(self.rank * block, block)?,
            )?
            .concat();
        self.gpu.upload(all, &whole)
    }

    fn reduce_scatter_sum(
        &self,
        send: GpuSlice<f32>,
        recv: GpuSlice<f32>,
    ) -> Result<(), DeviceError> {
        let sum = self.summed("reduce_scatter_sum", send)?;
        let block = recv.len();
        self.gpu
            .upload(recv, &sum[self.rank * block..(self.rank + 1) * block])
    }

    fn reduce_scatter_bf16_in_place(&self, all: GpuSlice<bf16>) -> Result<(), DeviceError> {
        let sum = self.summed_bf16("reduce_scatter_bf16_in_place", all)?;
        let block = all.len() / self.world;
        let own = self.rank * block..(self.rank + 1) * block;
        self.gpu.upload(all.sub(own.start, block)?, &sum[own])
    }

    fn broadcast(&self, buf: GpuSlice<f32>, root: usize) -> Result<(), DeviceError> {
        self.check_root("broadcast root", root)?;
        let all = self.gathered("broadcast", Some(root), buf)?;
        self.gpu.upload(buf, &all[root])
    }

    fn broadcast_bf16(
        &self,
        send: GpuSlice<bf16>,
        recv: GpuSlice<bf16>,
        root: usize,
    ) -> Result<(), DeviceError> {
        self.check_root("broadcast root", root)?;
        recv.expect_len("broadcast receive buffer", send.len())?;
        let all = self.gathered("broadcast_bf16", Some(root), send)?;
        self.gpu.upload(recv, &all[root])
    }

    fn reduce_sum(&self, buf: GpuSlice<f32>, root: usize) -> Result<(), DeviceError> {
        self.check_root("reduce root", root)?;
        let sum = self.summed_at("reduce_sum", Some(root), buf)?;
        if self.rank == root {
            self.gpu.upload(buf, &sum)?;
        }
        Ok(())
    }

    fn suspend(&mut self) -> Result<Option<u64>, DeviceError> {
        Ok(None)
    }

    fn resume(&mut self) -> Result<(), DeviceError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(op: &'static str, bytes: usize) -> Call {
        Call {
            op,
            root: None,
            bytes,
        }
    }

    /// Runs `rank`'s part for each of `ranks` ranks on a thread of its own; their results in
    /// rank order.
    fn on_ranks<R: Send>(ranks: usize, part: impl Fn(usize, &HostExchange) -> R + Sync) -> Vec<R> {
        let exchange = HostExchange::new(ranks);
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..ranks)
                .map(|rank| {
                    let (exchange, part) = (&exchange, &part);
                    scope.spawn(move || part(rank, exchange))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn host_exchange_hands_every_rank_all_bytes_in_rank_order_meeting_after_meeting() {
        let got = on_ranks(3, |rank, exchange| {
            (0..50u8)
                .map(|round| {
                    let mine = vec![rank as u8, round];
                    exchange.swap(rank, call("all_gather", 2), mine).unwrap()
                })
                .collect::<Vec<_>>()
        });
        for seen in got {
            for (round, all) in seen.iter().enumerate() {
                let want: Vec<Vec<u8>> = (0..3).map(|r| vec![r, round as u8]).collect();
                assert_eq!(**all, want, "round {round}");
            }
        }
    }

    #[test]
    fn host_exchange_fails_every_rank_whose_peers_called_another_collective() {
        let got = on_ranks(2, |rank, exchange| {
            let op = if rank == 0 { "all_gather" } else { "broadcast" };
            let first = exchange.swap(rank, call(op, 8), vec![0; 8]);
            let next = exchange.swap(rank, call("all_gather", 8), vec![0; 8]);
            (first, next)
        });
        for (first, next) in got {
            let why = first.unwrap_err();
            assert!(
                why.contains("rank 0 called all_gather of 8 bytes")
                    && why.contains("rank 1 broadcast of 8 bytes"),
                "{why}"
            );
            assert_eq!(next.unwrap_err(), why, "a broken group stays broken");
        }
        let lengths = on_ranks(2, |rank, exchange| {
            exchange.swap(rank, call("all_reduce_sum", 4 + rank * 4), vec![])
        });
        for result in lengths {
            assert!(result.unwrap_err().contains("of 8 bytes"));
        }
    }

    #[test]
    fn host_exchange_fails_the_waiting_ranks_of_a_rank_that_left_instead_of_hanging() {
        let got = on_ranks(3, |rank, exchange| {
            let met = exchange.swap(rank, call("all_reduce_sum", 1), vec![rank as u8]);
            if rank == 2 {
                // Rank 2 fails here, between collectives: its collectives are dropped.
                exchange.leave(rank);
                return (met, None);
            }
            (
                met,
                Some(exchange.swap(rank, call("all_reduce_sum", 1), vec![0])),
            )
        });
        for (rank, (met, next)) in got.into_iter().enumerate() {
            assert_eq!(
                *met.unwrap(),
                vec![vec![0], vec![1], vec![2]],
                "rank {rank}"
            );
            if let Some(next) = next {
                let why = next.unwrap_err();
                assert!(why.contains("rank 2 left"), "{why}");
            }
        }
    }
}
