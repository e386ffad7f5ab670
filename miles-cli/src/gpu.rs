//! The GPU this process computes on: opened once (device, NVRTC kernels, cuBLAS) and shared by
//! the trainers and the rollout engine, which each keep their own memory manager over it. The
//! trainers queue on a compute stream of their own ([`training_gpu_for`]): the loop moves a
//! trainer's state on another thread while the engine captures its decode graphs, and work
//! queued there on the engine's stream would land in the graph.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::Context;
use miles_core::comm::ID_BYTES;
use miles_core::device::{self, CudaDevice, DeviceError, Gpu, NcclComm};
use miles_core::{DeviceChoice, DeviceKind, HostGroup, LaunchEnv};

use crate::settings_args::BadSettings;

static SHARED: Mutex<Option<Arc<Gpu>>> = Mutex::new(None);
static TRAINING: Mutex<Option<Arc<Gpu>>> = Mutex::new(None);

/// How long a rank waits for the others to join the job.
const JOIN_TIMEOUT: Duration = Duration::from_secs(120);

/// This process's place in `env`'s job: the job's [`HostGroup`], and an NCCL communicator over
/// every rank's GPU (`gpu` here), its id handed out by rank 0 over the group.
///
/// # Errors
/// The group cannot form (a rank missing, a port taken), or NCCL fails.
pub fn join_job(env: &LaunchEnv, gpu: &Arc<Gpu>) -> anyhow::Result<(HostGroup, NcclComm)> {
    let mut group = connect(env)?;
    let comm = open_comm(&mut group, gpu)?;
    Ok((group, comm))
}

/// This process's place in `env`'s job: the job's [`HostGroup`].
///
/// # Errors
/// The group cannot form (a rank missing, a port taken).
pub fn connect(env: &LaunchEnv) -> anyhow::Result<HostGroup> {
    Ok(HostGroup::connect(env, JOIN_TIMEOUT)?)
}

/// The communicators a trainer of `group`'s job of `tp`-rank tensor-parallel groups uses on
/// this rank's GPU `gpu`: with `tp` 1 one over the whole job; else one over this rank's
/// tensor-parallel group (`tp` consecutive ranks) and, where there are several such groups,
/// one over the ranks holding the same shard (one a group). With `sums_behind` (and `tp` 1) a
/// second one over the whole job on a stream of its own, which sums the gradients behind the
/// backward pass (`--overlap-grad-reduce`). Every rank calls it at the same point.
///
/// # Errors
/// The group fails, or NCCL does.
pub fn rank_comms(
    group: &mut HostGroup,
    gpu: &Arc<Gpu>,
    tp: usize,
    sums_behind: bool,
) -> anyhow::Result<crate::backends::RankComms> {
    let (rank, world) = (group.rank(), group.world_size());
    if tp <= 1 {
        let data = Some(open_comm(group, gpu)?);
        let behind = match sums_behind {
            true => Some(open_comm(group, &Arc::new(gpu.with_own_stream()?))?),
            false => None,
        };
        return Ok(crate::backends::RankComms {
            rank,
            tensor: None,
            data,
            behind,
        });
    }
    let (tensor_ranks, data_ranks) = groups_of(rank, world, tp);
    let tensor = open_sub_comm(group, gpu, &tensor_ranks)?;
    let data = match data_ranks.len() > 1 {
        true => Some(open_sub_comm(group, gpu, &data_ranks)?),
        false => None,
    };
    Ok(crate::backends::RankComms {
        rank,
        tensor: Some(tensor),
        data,
        behind: None,
    })
}

/// The ranks of `rank`'s tensor-parallel group (`tp` consecutive ranks, Megatron's order) and
/// of its data-parallel ranks (those holding the same shard, one in each tensor-parallel
/// group), in a job of `world` ranks, each in the job's order.
fn groups_of(rank: usize, world: usize, tp: usize) -> (Vec<usize>, Vec<usize>) {
    let first = rank - rank % tp;
    (
        (first..first + tp).collect(),
        (rank % tp..world).step_by(tp).collect(),
    )
}

/// An NCCL communicator over `members` (ranks of `group`, this one among them), ranked in
/// their order; every rank of `group` calls it at the same point, with its own members. The
/// first member makes the id, which goes to the others over the group.
///
/// # Errors
/// This rank is not among `members`; the group fails, or NCCL does.
fn open_sub_comm(
    group: &mut HostGroup,
    gpu: &Arc<Gpu>,
    members: &[usize],
) -> anyhow::Result<NcclComm> {
    let index = members
        .iter()
        .position(|&r| r == group.rank())
        .context("this rank is missing from its own group")?;
    let made = match index {
        0 => NcclComm::unique_id()?.to_vec(),
        _ => Vec::new(),
    };
    let ids = group.all_gather(&made)?;
    let id: [u8; ID_BYTES] = ids[members[0]].clone().try_into().map_err(|_| {
        anyhow::anyhow!(
            "rank {} sent a communicator id of the wrong length",
            members[0]
        )
    })?;
    Ok(NcclComm::new(Arc::clone(gpu), id, index, members.len())?)
}

/// One more NCCL communicator over every rank of `group` (this rank's GPU `gpu`), its id handed
/// out by rank 0 over the group: every rank calls it at the same point.
///
/// # Errors
/// The group fails, or NCCL does.
pub fn open_comm(group: &mut HostGroup, gpu: &Arc<Gpu>) -> anyhow::Result<NcclComm> {
    let mut id = match group.rank() {
        0 => NcclComm::unique_id()?.to_vec(),
        _ => Vec::new(),
    };
    group.broadcast(&mut id)?;
    let id: [u8; ID_BYTES] = id
        .try_into()
        .map_err(|_| anyhow::anyhow!("rank 0 sent a communicator id of the wrong length"))?;
    Ok(NcclComm::new(
        Arc::clone(gpu),
        id,
        group.rank(),
        group.world_size(),
    )?)
}

/// The shared GPU when `choice` resolves to CUDA (`auto` does when a driver and a GPU are
/// there), `None` for the CPU device. It is GPU `LOCAL_RANK` in one rank of a multi-process
/// job (torchrun, srun, mpirun or `--nproc-per-node`), else GPU 0.
///
/// # Errors
/// [`BadSettings`] (exit status 2) when CUDA is asked for and not there, or for launch
/// variables that do not parse; the GPU cannot be opened or its kernels do not compile, with
/// the reason.
pub fn gpu_for(choice: DeviceChoice) -> anyhow::Result<Option<Arc<Gpu>>> {
    if device::resolve(choice) == DeviceKind::Cpu {
        return Ok(None);
    }
    let mut shared = SHARED.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(gpu) = shared.as_ref() {
        return Ok(Some(Arc::clone(gpu)));
    }
    let ordinal = LaunchEnv::from_process_env()
        .map_err(|error| BadSettings(error.to_string()))?
        .map_or(0, |env| env.local_rank);
    let cuda = match i32::try_from(ordinal).map(CudaDevice::open) {
        Ok(Ok(cuda)) => Arc::new(cuda),
        Ok(Err(error @ DeviceError::CudaUnavailable(_))) => {
            return Err(BadSettings(format!("--device {choice}: {error}")).into());
        }
        Ok(Err(error)) => {
            return Err(anyhow::Error::new(error).context(format!("cannot open cuda:{ordinal}")));
        }
        Err(_) => return Err(BadSettings(format!("LOCAL_RANK {ordinal} names no gpu")).into()),
    };
    let gpu = Arc::new(
        miles_core::ops::gpu::open_gpu(cuda)
            .with_context(|| format!("cannot start gpu compute on cuda:{ordinal}"))?,
    );
    *shared = Some(Arc::clone(&gpu));
    Ok(Some(gpu))
}

/// The GPU of [`gpu_for`] with a compute stream of its own, for the trainers (actor, critic,
/// and the collectives of their groups), made once.
///
/// # Errors
/// As [`gpu_for`]; the stream or its cuBLAS handles cannot be made.
pub fn training_gpu_for(choice: DeviceChoice) -> anyhow::Result<Option<Arc<Gpu>>> {
    let Some(shared) = gpu_for(choice)? else {
        return Ok(None);
    };
    let mut training = TRAINING.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(gpu) = training.as_ref() {
        return Ok(Some(Arc::clone(gpu)));
    }
    let gpu = Arc::new(
        shared
            .with_own_stream()
            .context("cannot open the trainers' compute stream")?,
    );
    *training = Some(Arc::clone(&gpu));
    Ok(Some(gpu))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_parallel_groups_are_consecutive_ranks_and_data_groups_stride_over_them() {
        assert_eq!(groups_of(0, 2, 2), (vec![0, 1], vec![0]));
        assert_eq!(groups_of(5, 8, 2), (vec![4, 5], vec![1, 3, 5, 7]));
        assert_eq!(groups_of(6, 8, 4), (vec![4, 5, 6, 7], vec![2, 6]));
        // Every rank is in one group of each kind, at the same place as its peers see it.
        for rank in 0..8 {
            let (tensor, data) = groups_of(rank, 8, 4);
            for &peer in &tensor {
                assert_eq!(groups_of(peer, 8, 4).0, tensor);
            }
            for &peer in &data {
                assert_eq!(groups_of(peer, 8, 4).1, data);
            }
        }
    }
}
