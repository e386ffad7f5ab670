//! `miles bench ...`: each prints our figure next to a baseline measured in the same run. This
//! module only dispatches a bench to its process layout (one process, several, or both
//! directions at once); the benches and their baselines live in the files beside it.

pub mod baseline;
pub mod both;
pub mod gemm;
pub mod offload;
pub mod offload_train;
pub mod ranks;
pub mod rollout;
pub mod train;
pub mod train_gpu;

use miles_core::DeviceChoice;
use miles_core::device;

use crate::settings_args::BadSettings;

/// `miles bench offload`: one rank of a job (under a launcher or `--nproc-per-node`), the
/// ranks' launcher, both directions at once, or one process.
///
/// # Errors
/// Bad settings (exit status 2) or the bench's failure.
pub fn offload(args: &offload::OffloadBenchArgs) -> anyhow::Result<()> {
    let size = offload::check(args)?;
    if let Some(env) = crate::launch::rank_env(args.nproc_per_node)? {
        return ranks::run(args, &env, size);
    }
    if args.nproc_per_node > 1 {
        return crate::launch::run_local(args.nproc_per_node, args.device);
    }
    let opened = device::open_with(
        args.device,
        args.device_memory_gib << 30,
        offload::cuda_options(args),
    )?;
    if args.both_directions {
        return both::run(args, &opened, size);
    }
    offload::run(args, &opened, size)
}

/// `miles bench train`: on the CPU device, on one GPU, or one rank of a job over GPUs.
///
/// # Errors
/// Bad settings (exit status 2) or the bench's failure.
pub fn train(args: train::BenchTrainArgs) -> anyhow::Result<()> {
    train::check(&args)?;
    if args.device != train::BenchDevice::Cuda {
        return train::run_cpu(args);
    }
    if let Some(env) = crate::launch::rank_env(args.nproc_per_node)? {
        return train_gpu::run_ranks(&args, &env);
    }
    if args.nproc_per_node > 1 {
        return crate::launch::run_local(args.nproc_per_node, DeviceChoice::Cuda);
    }
    if args.tensor_parallel
        || args.grad_reduce_in_bf16
        || args.fully_shard
        || args.overlap_grad_reduce
    {
        return Err(BadSettings(
            "--tensor-parallel, --grad-reduce-in-bf16, --fully-shard and --overlap-grad-reduce run over several processes; add --nproc-per-node 2 (or more), or start the ranks with a launcher".into(),
        )
        .into());
    }
    train_gpu::run(&args)
}
