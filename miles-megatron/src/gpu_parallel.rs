//! Megatron's tensor parallelism on GPUs: [`TensorParallelGroup`], the [`TrainerGroup`] that
//! makes core's GPU trainer one rank of a tensor-parallel group, and
//! [`tensor_parallel_gpu_trainer`], which shards the full weights and builds that rank.

use std::ops::Range;
use std::sync::Arc;

use half::bf16;
use miles_core::BackendError;
use miles_core::device::{Gpu, GpuSlice, NcclComm};
use miles_core::model::{
    GpuTrainer, GroupComm, LlamaConfig, ModelError, OptimizerShard, ParamKind, ParamLayout,
    TrainerGroup, standalone_gpu_trainer,
};

use crate::shard::{Split, scatter, shard_config, split_of};

/// One rank of a tensor-parallel group, Megatron's way: the rank's trainer holds its shard of
/// the model ([`shard_weights`]): q, k, v, gate and up hold their rows, o and down their
/// columns, and the embedding, norms and head are whole on every rank. Every rank sees the
/// whole batch. The forward pass sums the o and down products over the group, the backward
/// pass the gradients entering the two norms of each layer (bf16, NCCL); the per-head q/k norms
/// (qwen3), whole on every rank but applied to each rank's own heads, have their gradients
/// summed over the group (fp32); the whole tensors' gradients are then rank 0's on every rank,
/// so those tensors stay equal by construction, and the gradient norm counts them once.
///
/// In a job of tensor parallel times data parallel ranks ([`TensorParallelGroup::across`]),
/// the ranks holding the same shard in the other tensor-parallel groups are its data-parallel
/// ranks, and the trainer splits its shard's optimizer state over them (Megatron's distributed
/// optimizer, [`OptimizerShard`](miles_core::model::OptimizerShard)): each trains its own
/// batch, the gradients are reduce-scattered over them, the tensor-parallel ranks then share
/// what they share within each block, each rank updates its block, and the bf16 weights are
/// all-gathered over them.
pub struct TensorParallelGroup {
    comm: Arc<GroupComm>,
    /// The data-parallel ranks of this rank's shard, when there are any.
    data: Option<GroupComm>,
    /// The parameter ranges every rank holds whole.
    replicated: Vec<Range<usize>>,
    /// The q/k norm weights among them: each rank's gradient covers its own heads only.
    head_norms: Vec<Range<usize>>,
}

impl std::fmt::Debug for TensorParallelGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorParallelGroup")
            .field("replicated", &self.replicated.len())
            .field("data_parallel", &self.data.is_some())
            .finish_non_exhaustive()
    }
}

impl TensorParallelGroup {
    /// The group of `comm`'s ranks, for a trainer whose shard is laid out by `layout` (the
    /// [`ParamLayout`] of [`shard_config`]'s config).
    pub fn new(comm: NcclComm, layout: &ParamLayout) -> TensorParallelGroup {
        TensorParallelGroup::across(Arc::new(GroupComm::new(comm)), None, layout)
    }

    /// The group of `comm`'s ranks (shared with whoever gathers the shards), and with `data`
    /// the data-parallel ranks of this rank's shard (one in each other tensor-parallel group),
    /// over which the trainer splits its optimizer state; `layout` as in [`new`](Self::new).
    pub fn across(
        comm: Arc<GroupComm>,
        data: Option<GroupComm>,
        layout: &ParamLayout,
    ) -> TensorParallelGroup {
        let replicated = layout
            .specs()
            .iter()
            .filter(|spec| split_of(spec.kind) == Split::Replicated)
            .map(|spec| spec.range())
            .collect();
        let head_norms = layout
            .specs()
            .iter()
            .filter(|spec| matches!(spec.kind, ParamKind::QNorm | ParamKind::KNorm))
            .map(|spec| spec.range())
            .collect();
        TensorParallelGroup {
            comm,
            data,
            replicated,
            head_norms,
        }
    }

    /// The data-parallel ranks, for a split state's collectives.
    fn data(&self) -> Result<&GroupComm, ModelError> {
        self.data.as_ref().ok_or_else(|| {
            ModelError::Config(
                "a tensor-parallel group without data-parallel ranks does not split the optimizer state; build the trainer whole".into(),
            )
        })
    }

    /// Within `grads` (parameters `offset..` of the shard's layout): sums the q/k norms'
    /// gradients over the group and gives every rank rank 0's gradients of the whole tensors.
    fn share_gradients(&self, grads: GpuSlice<f32>, offset: usize) -> Result<(), ModelError> {
        let comm = self.comm.lock();
        for range in within(&self.head_norms, offset, grads.len()) {
            comm.all_reduce_sum(grads.sub(range.start, range.len())?)?;
        }
        for range in within(&self.replicated, offset, grads.len()) {
            comm.broadcast(grads.sub(range.start, range.len())?, 0)?;
        }
        Ok(())
    }

    /// The sums of squares of `grads` (parameters `offset..` of the shard's layout) into
    /// `sums`: the shards' in the first, the whole tensors' (the same on every rank) in the
    /// second.
    fn squares(
        &self,
        gpu: &Gpu,
        grads: GpuSlice<f32>,
        offset: usize,
        sums: GpuSlice<f32>,
        partials: GpuSlice<f32>,
    ) -> Result<(), ModelError> {
        let (first, second) = (sums.sub(0, 1)?, sums.sub(1, 1)?);
        let mut start = 0;
        let end = grads.len()..grads.len();
        for range in within(&self.replicated, offset, grads.len()).chain([end]) {
            if range.start > start {
                gpu.sum_of_squares(first, grads.sub(start, range.start - start)?, partials)?;
            }
            if !range.is_empty() {
                gpu.sum_of_squares(second, grads.sub(range.start, range.len())?, partials)?;
            }
            start = range.end;
        }
        Ok(())
    }

    /// The squared norm from `sums` ([`squares`](Self::squares)) once summed over the group:
    /// the whole tensors counted once.
    fn norm_sq(&self, gpu: &Gpu, sums: GpuSlice<f32>) -> Result<f32, ModelError> {
        let mut sum = [0.0f32; 2];
        gpu.download(&mut sum, sums)?;
        Ok(sum[0] + sum[1] / self.comm.world_size() as f32)
    }
}

/// The parts of `ranges` (sorted, apart) inside parameters `offset..offset + len`, shifted to
/// start from `offset`.
pub(crate) fn within(
    ranges: &[Range<usize>],
    offset: usize,
    len: usize,
) -> impl Iterator<Item = Range<usize>> {
    ranges.iter().filter_map(move |range| {
        let (start, end) = (range.start.max(offset), range.end.min(offset + len));
        (start < end).then(|| start - offset..end - offset)
    })
}

impl TrainerGroup for TensorParallelGroup {
    fn name(&self) -> &'static str {
        "tensor"
    }

    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn split_place(&self) -> (usize, usize) {
        match &self.data {
            Some(data) => (data.rank(), data.world_size()),
            None => (0, 1),
        }
    }

    fn gpu(&self) -> &Arc<Gpu> {
        self.comm.gpu()
    }

    fn sum_row_parallel(&self, x: GpuSlice<bf16>) -> Result<(), ModelError> {
        Ok(self.comm.lock().all_reduce_sum_bf16(x)?)
    }

    fn after_backward(
        &self,
        _gpu: &Gpu,
        grads: GpuSlice<f32>,
        _scalar: GpuSlice<f32>,
        nll: f64,
    ) -> Result<f64, ModelError> {
        if self.data.is_some() {
            return Err(ModelError::Config(
                "a tensor-parallel group with data-parallel ranks splits the optimizer state over them; build the trainer with OptimizerShard::split".into(),
            ));
        }
        self.share_gradients(grads, 0)?;
        // Every rank saw the whole batch: `nll` is the same on every rank.
        Ok(nll)
    }

    fn grad_norm_sq(
        &self,
        gpu: &Gpu,
        grads: GpuSlice<f32>,
        sums: GpuSlice<f32>,
        partials: GpuSlice<f32>,
    ) -> Result<f32, ModelError> {
        self.squares(gpu, grads, 0, sums, partials)?;
        self.comm.lock().all_reduce_sum(sums)?;
        self.norm_sq(gpu, sums)
    }

    fn block_norm_sq(
        &self,
        gpu: &Gpu,
        block: GpuSlice<f32>,
        start: usize,
        sums: GpuSlice<f32>,
        partials: GpuSlice<f32>,
    ) -> Result<f32, ModelError> {
        self.squares(gpu, block, start, sums, partials)?;
        let data = self.data()?;
        data.lock().all_reduce_sum(sums)?;
        self.comm.lock().all_reduce_sum(sums)?;
        // Every tensor-parallel group summed over its own communicator, in an order that may
        // differ from another's over more than two ranks: all clip by the first group's sum.
        data.lock().broadcast(sums, 0)?;
        self.norm_sq(gpu, sums)
    }

    fn reduce_scatter_f32(&self, all: GpuSlice<f32>) -> Result<(), ModelError> {
        let data = self.data()?;
        let (start, block) = {
            let comm = data.lock();
            let block = all.len() / comm.world_size();
            let start = comm.rank() * block;
            comm.reduce_scatter_sum(all, all.sub(start, block)?)?;
            (start, block)
        };
        // The tensor-parallel ranks of this group hold the same block of their shards.
        self.share_gradients(all.sub(start, block)?, start)
    }

    fn sum_f32(&self, x: GpuSlice<f32>) -> Result<(), ModelError> {
        // The loss: every tensor-parallel rank saw the same batch, the data-parallel ranks
        // their own.
        Ok(self.data()?.lock().all_reduce_sum(x)?)
    }

    fn all_gather_bf16(&self, all: GpuSlice<bf16>) -> Result<(), ModelError> {
        Ok(self.data()?.lock().all_gather_bf16_in_place(all)?)
    }

    fn all_gather_f32(&self, block: GpuSlice<f32>, all: GpuSlice<f32>) -> Result<(), ModelError> {
        Ok(self.data()?.lock().all_gather(block, all)?)
    }

    fn release(&self) -> Result<Option<u64>, ModelError> {
        let tensor = self.comm.release()?;
        let data = match &self.data {
            Some(data) => data.release()?,
            None => None,
        };
        Ok(match (tensor, data) {
            (None, None) => None,
            (tensor, data) => Some(tensor.unwrap_or(0) + data.unwrap_or(0)),
        })
    }

    fn restore(&self) -> Result<(), ModelError> {
        self.comm.restore()?;
        match &self.data {
            Some(data) => data.restore(),
            None => Ok(()),
        }
    }
}

/// Rank `rank`'s shard of a model of `config` over `tp` ranks: its config and its part of the
/// full weights `params`.
///
/// # Errors
/// [`BackendError::Settings`] when `tp` does not divide the heads or the MLP width, or `rank`
/// is not below `tp`; [`BackendError::Model`] for `params` of the wrong length.
pub fn shard_weights(
    config: &LlamaConfig,
    params: &[f32],
    rank: usize,
    tp: usize,
) -> Result<(LlamaConfig, Vec<f32>), BackendError> {
    let local_config = shard_config(config, tp)?;
    if rank >= tp {
        return Err(crate::error::invalid(format!(
            "tensor-parallel rank {rank} is not below the group's {tp} ranks; start one process a rank"
        )));
    }
    let full_layout = ParamLayout::new(config);
    full_layout.check("params", params)?;
    let local_layout = ParamLayout::new(&local_config);
    let mut local = vec![0.0; local_layout.len()];
    scatter(&full_layout, &local_layout, params, &mut local, rank);
    Ok((local_config, local))
}

/// Megatron's tensor-parallel trainer on `gpu`, rank `comm.rank()` of `comm`'s group, from the
/// full weights `params` of `config`, for one-off work (a benchmark): its shard
/// ([`shard_weights`]) in a [`standalone_gpu_trainer`] trainer with activations for
/// `max_batch_tokens` tokens, joined to a [`TensorParallelGroup`].
///
/// # Errors
/// As [`shard_weights`] (naming `--tensor-model-parallel-size`); [`BackendError::Model`] when
/// the trainer cannot be built or `comm` is on another GPU.
pub fn tensor_parallel_gpu_trainer(
    gpu: Arc<Gpu>,
    config: &LlamaConfig,
    params: &[f32],
    comm: NcclComm,
    max_batch_tokens: usize,
) -> Result<GpuTrainer, BackendError> {
    let (local_config, local) = shard_weights(config, params, comm.rank(), comm.world_size())?;
    let mut trainer = standalone_gpu_trainer(
        gpu,
        local_config,
        &local,
        max_batch_tokens,
        OptimizerShard::WHOLE,
    )?;
    let group = TensorParallelGroup::new(comm, trainer.layout());
    trainer.join(Box::new(group))?;
    Ok(trainer)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic, clippy::print_stderr)]
mod tests {
    //! The tests of the tensor-parallel group, over two GPUs and NCCL, and on one GPU with its
    //! collectives through the host. On a GPU machine:
    //! `MILES_TEST_DEVICE=cuda cargo test -p miles-megatron gpu_ -- --test-threads=1`; elsewhere
    //! (or with fewer GPUs) they skip.

    use std::sync::Arc;

    use miles_core::device::NcclComm;
    use miles_core::model::gpu_testing::{
        Batch, HostCollectives, HostExchange, assert_pair_follows, family_params, gentle, losses,
        losses_alone, manager, one_gpu, tiny, tiny_family, two_gpus,
    };

    use super::*;

    #[test]
    fn gpu_tensor_parallel_pair_follows_one_gpu_and_keeps_its_whole_tensors_equal() {
        over_nccl("gpu_tensor_parallel_pair_follows_one_gpu", tiny());
    }

    #[test]
    fn gpu_tensor_parallel_pair_follows_one_gpu_with_qwen2_biases() {
        over_nccl(
            "gpu_tensor_parallel_pair_follows_one_gpu_with_qwen2_biases",
            tiny_family("qwen2"),
        );
    }

    #[test]
    fn gpu_tensor_parallel_pair_follows_one_gpu_with_qwen3_qk_norms_summed_over_heads() {
        over_nccl(
            "gpu_tensor_parallel_pair_follows_one_gpu_with_qwen3_qk_norms",
            tiny_family("qwen3"),
        );
    }

    #[test]
    fn gpu_tensor_parallel_pair_on_one_gpu_through_the_host_follows_one_gpu_in_every_family() {
        let test = "gpu_tensor_parallel_pair_on_one_gpu_through_the_host_follows_one_gpu";
        let Some(gpu) = one_gpu(test) else {
            return;
        };
        for config in [tiny(), tiny_family("qwen2"), tiny_family("qwen3")] {
            let gpus = [Arc::clone(&gpu), Arc::new(gpu.with_own_stream().unwrap())];
            let exchange = HostExchange::new(2);
            pair_follows_one_gpu(gpus, config, move |rank, gpu| {
                let host = HostCollectives::new(Arc::clone(gpu), rank, 2, Arc::clone(&exchange));
                GroupComm::new(host)
            });
        }
    }

    /// [`pair_follows_one_gpu`] over two GPUs and NCCL.
    fn over_nccl(test: &str, config: LlamaConfig) {
        let Some(gpus) = two_gpus(test) else {
            return;
        };
        let id = NcclComm::unique_id().unwrap();
        pair_follows_one_gpu(gpus, config, move |rank, gpu| {
            GroupComm::new(NcclComm::new(Arc::clone(gpu), id, rank, 2).unwrap())
        });
    }

    /// Two tensor-parallel ranks of `config` on `gpus` (random biases and q/k norm weights
    /// where it has them, their communicators from `comm`) against one GPU, step by step,
    /// their whole tensors equal throughout.
    fn pair_follows_one_gpu(
        gpus: [Arc<Gpu>; 2],
        config: LlamaConfig,
        comm: impl Fn(usize, &Arc<Gpu>) -> GroupComm + Send + Sync + 'static,
    ) {
        let params = Arc::new(family_params(&config, 61));
        let data = Arc::new(Batch::random(62, config.vocab_size));
        let alone = losses_alone(&gpus[0], &config, &params, &data);
        let comm = Arc::new(comm);
        let ranks: Vec<_> = gpus
            .iter()
            .enumerate()
            .map(|(rank, gpu)| {
                let (gpu, config, comm) = (Arc::clone(gpu), config.clone(), Arc::clone(&comm));
                let (params, data) = (Arc::clone(&params), Arc::clone(&data));
                std::thread::spawn(move || {
                    let (local_config, local) = shard_weights(&config, &params, rank, 2).unwrap();
                    let layout = ParamLayout::new(&local_config);
                    let mut trainer = GpuTrainer::new(
                        Arc::clone(&gpu),
                        manager(&gpu),
                        gentle(local_config),
                        &local,
                    )
                    .unwrap();
                    let group =
                        TensorParallelGroup::across(Arc::new(comm(rank, &gpu)), None, &layout);
                    trainer.join(Box::new(group)).unwrap();
                    let steps = losses(&mut trainer, &data.view());
                    let master = trainer.master_params().unwrap();
                    let whole: Vec<f32> = layout
                        .specs()
                        .iter()
                        .filter(|spec| split_of(spec.kind) == Split::Replicated)
                        .flat_map(|spec| master[spec.range()].to_vec())
                        .collect();
                    (steps, whole)
                })
            })
            .collect();
        let (losses, whole): (Vec<_>, Vec<_>) =
            ranks.into_iter().map(|r| r.join().unwrap()).unzip();
        assert!(
            whole[0] == whole[1],
            "the ranks' embedding, norms or head drifted apart"
        );
        assert_pair_follows("tensor-parallel", &losses, &alone);
    }
}
