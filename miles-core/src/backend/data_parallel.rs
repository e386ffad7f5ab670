//! Data parallelism on GPUs: [`DataParallelGroup`], the [`TrainerGroup`] that makes the GPU
//! trainer one rank of a data-parallel group, and [`data_parallel_gpu_trainer`], which builds
//! such a rank. Both backends' GPU trainers ([`GpuBackend::on_ranks`](super::GpuBackend::on_ranks):
//! fsdp's, and Megatron's distributed optimizer) and `miles bench train` use it, with the
//! optimizer state split over the ranks.

use std::sync::Arc;

use half::bf16;

use super::BackendError;
use crate::device::{Collectives, Gpu, GpuSlice, NcclComm};
use crate::model::{
    GpuTrainer, GroupComm, LlamaConfig, ModelError, OptimizerShard, TrainerGroup,
    standalone_gpu_trainer,
};

/// One rank of a data-parallel group: every rank trains on its part of each batch
/// ([`TrainBatch::shard`](crate::model::TrainBatch::shard)), all parts with the whole batch's
/// normaliser, and every rank starts from the same weights. A trainer whose optimizer state is
/// split over the group ([`OptimizerShard`]) has its gradients reduce-scattered and its bf16
/// weights all-gathered, or where its gradients and bf16 weights are split too, each unit's
/// weights broadcast from the blocks holding them and its gradients reduced into them; a whole
/// trainer (every rank a replica, as PyTorch's DDP) has its gradients and loss summed over the
/// group after the backward pass.
/// Either way every rank takes the same optimizer step (NCCL on the trainer's stream, and for
/// sums behind the backward pass on the second communicator's own stream).
#[derive(Debug)]
pub struct DataParallelGroup {
    comm: GroupComm,
    /// The second communicator split gradients are summed on behind the backward pass.
    behind: Option<GroupComm>,
}

impl DataParallelGroup {
    /// The group of `comm`'s ranks.
    pub fn new(comm: impl Collectives + 'static) -> DataParallelGroup {
        DataParallelGroup {
            comm: GroupComm::new(comm),
            behind: None,
        }
    }

    /// The group, with `behind` (a second communicator over the same ranks, on a stream of its
    /// own of the same GPU: [`Gpu::with_own_stream`]) summing split gradients behind the
    /// backward pass ([`OptimizerShard::reduce_behind`], `--overlap-grad-reduce`).
    ///
    /// # Errors
    /// [`ModelError::Config`] for a communicator over other ranks.
    pub fn with_sums_behind(
        self,
        behind: impl Collectives + 'static,
    ) -> Result<DataParallelGroup, ModelError> {
        let behind = GroupComm::new(behind);
        let place = |comm: &GroupComm| (comm.rank(), comm.world_size());
        if place(&behind) != place(&self.comm) {
            return Err(ModelError::Config(format!(
                "the second communicator is rank {:?} of another group than the first, rank {:?}; open it over the same ranks",
                place(&behind),
                place(&self.comm)
            )));
        }
        Ok(DataParallelGroup {
            behind: Some(behind),
            ..self
        })
    }
}

impl TrainerGroup for DataParallelGroup {
    fn name(&self) -> &'static str {
        "data"
    }

    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn gpu(&self) -> &Arc<Gpu> {
        self.comm.gpu()
    }

    fn sum_row_parallel(&self, _x: GpuSlice<bf16>) -> Result<(), ModelError> {
        // Each replica holds whole weights: its products are whole already.
        Ok(())
    }

    fn after_backward(
        &self,
        _gpu: &Gpu,
        grads: GpuSlice<f32>,
        scalar: GpuSlice<f32>,
        nll: f64,
    ) -> Result<f64, ModelError> {
        self.comm.sum_replicas(grads, scalar, nll)
    }

    fn grad_norm_sq(
        &self,
        gpu: &Gpu,
        grads: GpuSlice<f32>,
        sums: GpuSlice<f32>,
        partials: GpuSlice<f32>,
    ) -> Result<f32, ModelError> {
        // The all-reduced gradients are the same on every rank, and the sum adds them in a fixed
        // order: every replica finds the same norm, clips alike and stays equal.
        gpu.sum_of_squares(sums.sub(0, 1)?, grads, partials)?;
        let mut sum = [0.0f32; 2];
        gpu.download(&mut sum, sums)?;
        Ok(sum[0])
    }

    fn reduce_scatter_f32(&self, all: GpuSlice<f32>) -> Result<(), ModelError> {
        let comm = self.comm.lock();
        let block = all.len() / comm.world_size();
        let own = all.sub(comm.rank() * block, block)?;
        Ok(comm.reduce_scatter_sum(all, own)?)
    }

    fn reduce_scatter_bf16(&self, all: GpuSlice<bf16>) -> Result<(), ModelError> {
        Ok(self.comm.lock().reduce_scatter_bf16_in_place(all)?)
    }

    fn broadcast_bf16(
        &self,
        send: GpuSlice<bf16>,
        recv: GpuSlice<bf16>,
        owner: usize,
    ) -> Result<(), ModelError> {
        Ok(self.comm.lock().broadcast_bf16(send, recv, owner)?)
    }

    fn reduce_f32(&self, part: GpuSlice<f32>, owner: usize) -> Result<(), ModelError> {
        Ok(self.comm.lock().reduce_sum(part, owner)?)
    }

    fn sum_f32(&self, x: GpuSlice<f32>) -> Result<(), ModelError> {
        Ok(self.comm.lock().all_reduce_sum(x)?)
    }

    fn all_gather_bf16(&self, all: GpuSlice<bf16>) -> Result<(), ModelError> {
        Ok(self.comm.lock().all_gather_bf16_in_place(all)?)
    }

    fn all_gather_f32(&self, block: GpuSlice<f32>, all: GpuSlice<f32>) -> Result<(), ModelError> {
        Ok(self.comm.lock().all_gather(block, all)?)
    }

    fn behind(&self) -> Option<&GroupComm> {
        self.behind.as_ref()
    }

    fn release(&self) -> Result<Option<u64>, ModelError> {
        let released = self.comm.release()?;
        let Some(behind) = &self.behind else {
            return Ok(released);
        };
        Ok(match (released, behind.release()?) {
            (Some(a), Some(b)) => Some(a + b),
            (a, b) => a.or(b),
        })
    }

    fn restore(&self) -> Result<(), ModelError> {
        self.comm.restore()?;
        match &self.behind {
            Some(behind) => behind.restore(),
            None => Ok(()),
        }
    }
}

/// What a data-parallel rank keeps of the state ([`OptimizerShard`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataParallelSplit {
    /// Its block of the optimizer state; the gradients reduce-scattered in fp32 (ZeRO stage
    /// 1, Megatron's distributed optimizer).
    Optimizer,
    /// As [`Optimizer`](Self::Optimizer), the gradients reduce-scattered in bf16.
    OptimizerReducedInBf16,
    /// Its block of the optimizer state and of the gradients, each unit's gradients summed
    /// behind the backward pass on a second communicator (ZeRO stage 2,
    /// `--overlap-grad-reduce`).
    GradientsBehind,
    /// Its block of the optimizer state, the gradients and the bf16 weights (ZeRO stage 3,
    /// fsdp's).
    Full,
    /// As [`Full`](Self::Full), each layer's weights gathered a layer ahead of the passes and
    /// each unit's gradients summed behind the backward pass, on a second communicator (fsdp
    /// with `--overlap-grad-reduce`).
    FullAhead,
}

/// A data-parallel rank on `gpu`, rank `comm.rank()` of `comm`'s group, from the full weights
/// `params` of `config` (the same on every rank), for one-off work (a benchmark): a
/// [`standalone_gpu_trainer`] trainer with activations for `max_batch_tokens` tokens (this
/// rank's part of a batch) keeping its blocks as `split` says, joined to a
/// [`DataParallelGroup`]; `behind` is the second communicator of
/// [`DataParallelSplit::GradientsBehind`] and [`DataParallelSplit::FullAhead`] (on a stream of
/// its own of `gpu`).
///
/// # Errors
/// [`BackendError::Model`] when the trainer cannot be built, `comm` is on another GPU, or
/// `behind` is missing, over other ranks or on the trainer's own stream.
pub fn data_parallel_gpu_trainer(
    gpu: Arc<Gpu>,
    config: LlamaConfig,
    params: &[f32],
    (comm, behind): (NcclComm, Option<NcclComm>),
    max_batch_tokens: usize,
    split: DataParallelSplit,
) -> Result<GpuTrainer, BackendError> {
    let full = matches!(
        split,
        DataParallelSplit::Full | DataParallelSplit::FullAhead
    );
    let sums_behind = matches!(
        split,
        DataParallelSplit::GradientsBehind | DataParallelSplit::FullAhead
    );
    let shard = OptimizerShard {
        bf16_reduce: split == DataParallelSplit::OptimizerReducedInBf16,
        split_grads: full || sums_behind,
        split_weights: full,
        reduce_behind: sums_behind,
        ..OptimizerShard::split(comm.rank(), comm.world_size())
    };
    let mut trainer = standalone_gpu_trainer(gpu, config, params, max_batch_tokens, shard)?;
    let mut group = DataParallelGroup::new(comm);
    if let Some(behind) = behind {
        group = group.with_sums_behind(behind)?;
    }
    trainer.join(Box::new(group))?;
    Ok(trainer)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic, clippy::print_stderr)]
mod tests {
    //! Two-GPU tests of the data-parallel group (and one on one GPU, its collectives computed
    //! through the host). On a GPU machine: `MILES_TEST_DEVICE=cuda cargo test -p miles-core
    //! backend::data_parallel -- --test-threads=1`; elsewhere (or with one GPU) they skip.

    use std::sync::Arc;

    use crate::BackupPolicy;
    use crate::device::{Gpu, NcclComm};
    use crate::model::gpu_testing::{
        B, Batch, HostCollectives, HostExchange, PARALLEL_STEPS, T, assert_pair_follows,
        bf16_params, family_params, gentle, losses, losses_alone, manager, one_gpu, spec, tiny,
        tiny_family, two_gpus,
    };
    use crate::model::{GpuTrainer, GpuTrainerSpec, ModelError, TrainerGroup};

    use super::*;

    #[test]
    fn gpu_data_parallel_pair_follows_one_gpu_and_keeps_its_replicas_equal() {
        let Some(gpus) = two_gpus("gpu_data_parallel_pair_follows_one_gpu") else {
            return;
        };
        let config = tiny();
        let params = Arc::new(bf16_params(&config, 51));
        let data = Arc::new(Batch::random(52, config.vocab_size));
        let alone = losses_alone(&gpus[0], &config, &params, &data);
        let id = NcclComm::unique_id().unwrap();
        let ranks: Vec<_> = gpus
            .iter()
            .enumerate()
            .map(|(rank, gpu)| {
                let (gpu, config) = (Arc::clone(gpu), config.clone());
                let (params, data) = (Arc::clone(&params), Arc::clone(&data));
                std::thread::spawn(move || {
                    let mut trainer =
                        GpuTrainer::new(Arc::clone(&gpu), manager(&gpu), gentle(config), &params)
                            .unwrap();
                    let comm = NcclComm::new(Arc::clone(&gpu), id, rank, 2).unwrap();
                    trainer
                        .join(Box::new(DataParallelGroup::new(comm)))
                        .unwrap();
                    let batch = data.view();
                    let part = batch.shard(rank, 2).unwrap();
                    (
                        losses(&mut trainer, &part),
                        trainer.master_params().unwrap(),
                    )
                })
            })
            .collect();
        let (losses, masters): (Vec<_>, Vec<_>) =
            ranks.into_iter().map(|r| r.join().unwrap()).unzip();
        assert!(
            masters[0] == masters[1],
            "the replicas' master weights drifted apart"
        );
        let first = (losses[0][0] - alone[0]).abs() / alone[0].abs();
        assert!(
            first < 1e-5,
            "step 1 starts from the same weights on the same tokens: {} vs {}",
            losses[0][0],
            alone[0]
        );
        assert_pair_follows("data-parallel", &losses, &alone);
    }

    /// What one rank of a split pair ends with: its losses, its optimizer bytes on the device,
    /// and the gathered master weights and moments.
    type RankEnd = (Vec<f32>, usize, Vec<f32>, Vec<f32>, Vec<f32>);

    /// How a split pair reduces and keeps its state.
    #[derive(Clone, Copy, Debug)]
    struct Way {
        /// Gradients reduced in bf16.
        bf16_reduce: bool,
        /// The optimizer state and step on the host.
        on_host: bool,
        /// Gradients split too, summed unit by unit; each sequence a micro-batch, so that the
        /// ranks (two sequences and one) run different numbers of them.
        split_grads: bool,
        /// bf16 weights split too, gathered unit by unit (with `split_grads`).
        split_weights: bool,
        /// Split gradients summed behind the backward pass on a second communicator.
        behind: bool,
        /// The tiny model's family (`llama`; `qwen2`: biases; `qwen3`: q/k norms, an untied
        /// head, which the fully sharded tail unit then holds).
        family: &'static str,
        /// A batch of four sequences, three to rank 0 and one to rank 1 (else three, two to
        /// rank 0): with `split_grads`, rank 1 runs two passes without a batch, whose gathers
        /// and sums must be rank 0's.
        uneven: bool,
    }

    /// The optimizer state split, the gradients reduce-scattered in fp32, the tiny llama.
    const STAGE_1: Way = Way {
        bf16_reduce: false,
        on_host: false,
        split_grads: false,
        split_weights: false,
        behind: false,
        family: "llama",
        uneven: false,
    };

    /// The optimizer state, gradients and bf16 weights split.
    const STAGE_3: Way = Way {
        split_grads: true,
        split_weights: true,
        ..STAGE_1
    };

    /// The ways a split pair is tested.
    const SPLIT_WAYS: [Way; 16] = [
        STAGE_1,
        Way {
            bf16_reduce: true,
            ..STAGE_1
        },
        Way {
            on_host: true,
            ..STAGE_1
        },
        Way {
            split_grads: true,
            ..STAGE_1
        },
        Way {
            split_grads: true,
            on_host: true,
            ..STAGE_1
        },
        Way {
            split_grads: true,
            behind: true,
            ..STAGE_1
        },
        Way {
            split_grads: true,
            behind: true,
            on_host: true,
            ..STAGE_1
        },
        STAGE_3,
        Way {
            on_host: true,
            ..STAGE_3
        },
        Way {
            family: "qwen2",
            ..STAGE_3
        },
        Way {
            family: "qwen3",
            ..STAGE_3
        },
        Way {
            split_grads: true,
            behind: true,
            family: "qwen3",
            ..STAGE_1
        },
        // The layers' gathers a layer ahead and the sums behind, on the second communicator.
        Way {
            behind: true,
            ..STAGE_3
        },
        Way {
            behind: true,
            on_host: true,
            ..STAGE_3
        },
        Way {
            behind: true,
            family: "qwen3",
            ..STAGE_3
        },
        Way {
            behind: true,
            uneven: true,
            ..STAGE_3
        },
    ];

    /// Two ranks of a split optimizer state on `gpus`, split `way`, each joined to
    /// `group(rank, gpu)`, training on parts of a batch (an offload cycle after step 2),
    /// against one GPU on the whole: the pair follows it, each rank keeps at most half the
    /// state on its device (and of the gradients where split), and both gather the same.
    fn split_pair_follows_one_gpu<G>(gpus: [Arc<Gpu>; 2], way: Way, group: G)
    where
        G: Fn(usize, &Arc<Gpu>, bool) -> Box<dyn TrainerGroup> + Send + Sync + 'static,
    {
        let config = match way.family {
            "llama" => tiny(),
            family => tiny_family(family),
        };
        let params = Arc::new(family_params(&config, 53));
        let sequences = if way.uneven { 4 } else { B };
        let data = Arc::new(Batch::random_of(54, config.vocab_size, sequences, T));
        let alone = losses_alone(&gpus[0], &config, &params, &data);
        let whole = GpuTrainer::new(
            Arc::clone(&gpus[0]),
            manager(&gpus[0]),
            gentle(config.clone()),
            &params,
        )
        .unwrap()
        .optimizer_device_bytes();
        let group = Arc::new(group);
        let ranks: Vec<_> = gpus
            .iter()
            .enumerate()
            .map(|(rank, gpu)| {
                let (gpu, config, group) = (Arc::clone(gpu), config.clone(), Arc::clone(&group));
                let (params, data) = (Arc::clone(&params), Arc::clone(&data));
                std::thread::spawn(move || -> RankEnd {
                    let max_batch_tokens = if way.split_grads { T } else { 64 };
                    let spec = GpuTrainerSpec {
                        shard: OptimizerShard {
                            bf16_reduce: way.bf16_reduce,
                            split_grads: way.split_grads,
                            split_weights: way.split_weights,
                            reduce_behind: way.behind,
                            ..OptimizerShard::split(rank, 2)
                        },
                        backup: BackupPolicy::Host,
                        optimizer_on_host: way.on_host,
                        max_batch_tokens,
                        ..gentle(config)
                    };
                    let mut trainer =
                        GpuTrainer::new(Arc::clone(&gpu), manager(&gpu), spec, &params).unwrap();
                    trainer.join(group(rank, &gpu, way.behind)).unwrap();
                    let batch = data.view();
                    let part = match (way.uneven, rank) {
                        (true, 0) => batch.sequences(0..3),
                        (true, _) => batch.sequences(3..4),
                        (false, _) => batch.shard(rank, 2).unwrap(),
                    };
                    let mut losses = Vec::new();
                    for step in 1..=PARALLEL_STEPS {
                        losses.push(trainer.train_step(&part, step).unwrap().loss);
                        if step == 2 {
                            // A split state's bf16 weights are dropped, then rounded from
                            // each block and gathered again.
                            trainer.offload().unwrap();
                            trainer.onload().unwrap();
                        }
                    }
                    let bytes = trainer.optimizer_device_bytes();
                    let grads = trainer.grads().unwrap().len();
                    let block = trainer.shard().block(trainer.layout().len());
                    assert_eq!(
                        grads == block,
                        way.split_grads,
                        "{way:?}: rank {rank} holds {grads} gradients, its block {block}"
                    );
                    let master = trainer.master_params().unwrap();
                    let (m, v) = trainer.moments().unwrap();
                    // The bf16 weights, gathered where split, are the master weights rounded.
                    let rounded: Vec<f32> = master
                        .iter()
                        .map(|&x| f32::from(bf16::from_f32(x)))
                        .collect();
                    assert!(
                        trainer.weights().unwrap() == rounded,
                        "{way:?}: rank {rank}'s bf16 weights are not its master weights rounded"
                    );
                    assert_eq!(
                        trainer.device_params().unwrap().is_none(),
                        way.split_weights,
                        "{way:?}: split weights are not shown on the device whole"
                    );
                    (losses, bytes, master, m, v)
                })
            })
            .collect();
        eprintln!("split pair {way:?}");
        let results: Vec<RankEnd> = ranks.into_iter().map(|r| r.join().unwrap()).collect();
        let losses: Vec<Vec<f32>> = results.iter().map(|r| r.0.clone()).collect();
        for (rank, (_, bytes, master, m, v)) in results.iter().enumerate() {
            assert!(
                *bytes <= whole / 2 + 4096,
                "rank {rank} keeps {bytes} bytes of optimizer state, one gpu {whole}"
            );
            assert!(
                *master == results[0].2 && *m == results[0].3 && *v == results[0].4,
                "rank {rank} gathered another state than rank 0"
            );
            assert!(
                m.iter().any(|&x| x != 0.0) && v.iter().all(|&x| x >= 0.0),
                "rank {rank}: the moments were not gathered whole"
            );
        }
        assert_pair_follows("split-optimizer data-parallel", &losses, &alone);
    }

    #[test]
    fn gpu_split_optimizer_pair_over_nccl_follows_one_gpu_every_way() {
        let test = "gpu_split_optimizer_pair_over_nccl_follows_one_gpu_every_way";
        let Some(gpus) = two_gpus(test) else {
            return;
        };
        for way in SPLIT_WAYS {
            let ids = [0, 1].map(|_| NcclComm::unique_id().unwrap());
            let pair = [Arc::clone(&gpus[0]), Arc::clone(&gpus[1])];
            split_pair_follows_one_gpu(pair, way, move |rank, gpu, behind| {
                let comm = NcclComm::new(Arc::clone(gpu), ids[0], rank, 2).unwrap();
                let group = DataParallelGroup::new(comm);
                if !behind {
                    return Box::new(group);
                }
                // The sums behind run on a stream of their own.
                let stream = Arc::new(gpu.with_own_stream().unwrap());
                let second = NcclComm::new(stream, ids[1], rank, 2).unwrap();
                Box::new(group.with_sums_behind(second).unwrap())
            });
        }
    }

    #[test]
    fn gpu_split_optimizer_pair_on_one_gpu_through_the_host_follows_one_gpu_every_way() {
        let test = "gpu_split_optimizer_pair_on_one_gpu_through_the_host_follows_one_gpu_every_way";
        let Some(gpu) = one_gpu(test) else {
            return;
        };
        for way in SPLIT_WAYS {
            // Two ranks on one GPU, each on a stream of its own, their collectives computed
            // through the host as NCCL computes them (a sum of two is the same in either order).
            let second = Arc::new(gpu.with_own_stream().unwrap());
            let exchanges = [0, 1].map(|_| HostExchange::new(2));
            let first = Arc::clone(&gpu);
            split_pair_follows_one_gpu([first, second], way, move |rank, gpu, behind| {
                let host = |gpu, exchange| HostCollectives::new(gpu, rank, 2, Arc::clone(exchange));
                let group = DataParallelGroup::new(host(Arc::clone(gpu), &exchanges[0]));
                if !behind {
                    return Box::new(group);
                }
                let stream = Arc::new(gpu.with_own_stream().unwrap());
                let second = host(stream, &exchanges[1]);
                Box::new(group.with_sums_behind(second).unwrap())
            });
        }
    }

    #[test]
    fn gpu_trainer_of_a_split_state_trains_only_in_its_own_place_of_its_group() {
        let test = "gpu_trainer_of_a_split_state_trains_only_in_its_own_place_of_its_group";
        let Some(gpu) = one_gpu(test) else {
            return;
        };
        let config = tiny();
        let params = bf16_params(&config, 91);
        let data = Batch::random(92, config.vocab_size);
        let spec = GpuTrainerSpec {
            shard: OptimizerShard::split(1, 2),
            ..gentle(config)
        };
        let mut trainer = GpuTrainer::new(Arc::clone(&gpu), manager(&gpu), spec, &params).unwrap();
        let err = trainer.train_step(&data.view(), 1).unwrap_err().to_string();
        assert!(err.contains("join its data-parallel group"), "{err}");
        let comm = NcclComm::new(Arc::clone(&gpu), NcclComm::unique_id().unwrap(), 0, 1).unwrap();
        let err = trainer
            .join(Box::new(DataParallelGroup::new(comm)))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("block 1 of 2") && err.contains("rank 0 of 1"),
            "{err}"
        );
    }

    #[test]
    fn gpu_sums_behind_need_a_second_communicator_of_the_same_ranks_on_a_stream_of_its_own() {
        let test =
            "gpu_sums_behind_need_a_second_communicator_of_the_same_ranks_on_a_stream_of_its_own";
        let Some(gpu) = one_gpu(test) else {
            return;
        };
        // Rank 0 of two; nothing here is collective, so its peer never comes.
        let rank_0 = |gpu: &Arc<Gpu>, ranks: usize| {
            HostCollectives::new(Arc::clone(gpu), 0, ranks, HostExchange::new(ranks))
        };
        let stream = Arc::new(gpu.with_own_stream().unwrap());
        let err = DataParallelGroup::new(rank_0(&gpu, 2))
            .with_sums_behind(rank_0(&stream, 3))
            .unwrap_err()
            .to_string();
        assert!(err.contains("over the same ranks"), "{err}");
        let config = tiny();
        let params = bf16_params(&config, 93);
        let spec = GpuTrainerSpec {
            shard: OptimizerShard {
                split_grads: true,
                reduce_behind: true,
                ..OptimizerShard::split(0, 2)
            },
            ..gentle(config)
        };
        let mut trainer =
            GpuTrainer::new(Arc::clone(&gpu), manager(&gpu), spec.clone(), &params).unwrap();
        let err = trainer
            .join(Box::new(DataParallelGroup::new(rank_0(&gpu, 2))))
            .unwrap_err()
            .to_string();
        assert!(err.contains("no second communicator"), "{err}");
        drop(trainer);
        let mut trainer = GpuTrainer::new(Arc::clone(&gpu), manager(&gpu), spec, &params).unwrap();
        let same_stream = DataParallelGroup::new(rank_0(&gpu, 2))
            .with_sums_behind(rank_0(&gpu, 2))
            .unwrap();
        let err = trainer.join(Box::new(same_stream)).unwrap_err().to_string();
        assert!(err.contains("stream of its own"), "{err}");
    }

    #[test]
    fn gpu_trainer_joins_one_group_and_only_on_its_own_gpu() {
        let test = "gpu_trainer_joins_one_group_and_only_on_its_own_gpu";
        let Some(gpu) = one_gpu(test) else {
            return;
        };
        let config = tiny();
        let params = bf16_params(&config, 71);
        let data = Batch::random(72, config.vocab_size);
        let mut trainer =
            GpuTrainer::new(Arc::clone(&gpu), manager(&gpu), gentle(config), &params).unwrap();
        let alone = |gpu: &Arc<Gpu>| {
            let comm =
                NcclComm::new(Arc::clone(gpu), NcclComm::unique_id().unwrap(), 0, 1).unwrap();
            Box::new(DataParallelGroup::new(comm))
        };
        // Another compute handle on the same device is not the trainer's stream.
        let other = Arc::new(crate::ops::gpu::open_gpu(Arc::clone(gpu.device())).unwrap());
        assert!(matches!(
            trainer.join(alone(&other)),
            Err(ModelError::DeviceMismatch)
        ));
        trainer.join(alone(&gpu)).unwrap();
        assert!(matches!(
            trainer.join(alone(&gpu)),
            Err(ModelError::Config(_))
        ));
        let loss = trainer.train_step(&data.view(), 1).unwrap().loss;
        assert!(loss.is_finite(), "a group of one still trains: loss {loss}");
    }

    #[test]
    fn gpu_a_group_trains_on_after_an_offload_that_released_its_nccl_buffers() {
        let test = "gpu_a_group_trains_on_after_an_offload_that_released_its_nccl_buffers";
        let Some(gpu) = one_gpu(test) else {
            return;
        };
        if !NcclComm::can_suspend() {
            eprintln!("{test}: the offload cycle runs, but this nccl keeps its buffers");
        }
        let config = tiny();
        let params = bf16_params(&config, 81);
        let data = Batch::random(82, config.vocab_size);
        let member = || {
            let spec = spec(config.clone(), BackupPolicy::Host, 64);
            let mut trainer =
                GpuTrainer::new(Arc::clone(&gpu), manager(&gpu), spec, &params).unwrap();
            let comm =
                NcclComm::new(Arc::clone(&gpu), NcclComm::unique_id().unwrap(), 0, 1).unwrap();
            trainer
                .join(Box::new(DataParallelGroup::new(comm)))
                .unwrap();
            trainer
        };
        let (mut cycled, mut resident) = (member(), member());
        for step in 1..=3 {
            let a = cycled.train_step(&data.view(), step).unwrap().loss;
            let b = resident.train_step(&data.view(), step).unwrap().loss;
            assert_eq!(
                a.to_bits(),
                b.to_bits(),
                "step {step}: loss {a} against {b}"
            );
            cycled.offload().unwrap();
            cycled.onload().unwrap();
        }
        assert!(
            cycled.master_params().unwrap() == resident.master_params().unwrap(),
            "the offload cycles changed the master weights"
        );
    }
}
