//! The training backend `--train-backend` names, from the crates this binary was built with.

use std::sync::Arc;

use miles_core::backend::TrainBackend;
use miles_core::config::Settings;
use miles_core::device::{Gpu, NcclComm};

use crate::settings_args::BadSettings;

/// One process's communicators in a job over GPUs.
pub struct RankComms {
    /// Its rank in the job.
    pub rank: usize,
    /// Its tensor-parallel group (`--tensor-model-parallel-size` above 1).
    pub tensor: Option<NcclComm>,
    /// The ranks it is data parallel with: the whole job's, or with a tensor-parallel group the
    /// replicas of its shard (`None` where there are none).
    pub data: Option<NcclComm>,
    /// A second communicator over the data-parallel ranks, on a stream of its own, that sums
    /// the gradients behind the backward pass (`--overlap-grad-reduce`).
    pub behind: Option<NcclComm>,
}

/// The backend `--train-backend` names, built from the settings; with `comms`, this process's
/// rank of a job over one GPU a process.
///
/// # Errors
/// `BadSettings` for settings the backend refuses, `BackendNotBuilt` for a backend this
/// binary was built without, or the backend's failure to start.
pub fn build_backend(
    settings: &Settings,
    comms: Option<RankComms>,
) -> anyhow::Result<Box<dyn TrainBackend>> {
    let gpu = crate::gpu::training_gpu_for(settings.device)?;
    match settings.train_backend {
        miles_core::TrainBackendKind::Megatron => megatron(settings, gpu, comms),
        miles_core::TrainBackendKind::Fsdp => fsdp(settings, gpu, comms),
    }
}

/// A backend's refusal of the settings is bad settings (exit status 2); anything else a failure.
#[cfg(any(feature = "megatron", feature = "fsdp"))]
fn refused(error: miles_core::BackendError) -> anyhow::Error {
    match error {
        error @ miles_core::BackendError::Settings { .. } => BadSettings(error.to_string()).into(),
        error => error.into(),
    }
}

#[cfg(feature = "megatron")]
fn megatron(
    settings: &Settings,
    gpu: Option<Arc<Gpu>>,
    comms: Option<RankComms>,
) -> anyhow::Result<Box<dyn TrainBackend>> {
    Ok(match gpu {
        Some(gpu) => {
            let RankComms {
                rank,
                tensor,
                data,
                behind,
            } = comms.unwrap_or(RankComms {
                rank: 0,
                tensor: None,
                data: None,
                behind: None,
            });
            miles_megatron::gpu_trainer(gpu, settings, rank, tensor, (data, behind))
                .map_err(refused)?
        }
        None => {
            Box::new(miles_megatron::MegatronTrainer::from_settings(settings).map_err(refused)?)
        }
    })
}

#[cfg(not(feature = "megatron"))]
fn megatron(
    _: &Settings,
    _: Option<Arc<Gpu>>,
    _: Option<RankComms>,
) -> anyhow::Result<Box<dyn TrainBackend>> {
    Err(crate::settings_args::BackendNotBuilt(miles_core::TrainBackendKind::Megatron).into())
}

#[cfg(feature = "fsdp")]
fn fsdp(
    settings: &Settings,
    gpu: Option<Arc<Gpu>>,
    comms: Option<RankComms>,
) -> anyhow::Result<Box<dyn TrainBackend>> {
    Ok(match gpu {
        Some(gpu) => {
            // `rank_comms` opens a second communicator only beside the data-parallel one.
            let comms = comms.and_then(|comms| Some((comms.data?, comms.behind)));
            Box::new(miles_fsdp::gpu_trainer(gpu, settings, comms).map_err(refused)?)
        }
        None => Box::new(miles_fsdp::FsdpBackend::from_settings(settings).map_err(refused)?),
    })
}

#[cfg(not(feature = "fsdp"))]
fn fsdp(
    _: &Settings,
    _: Option<Arc<Gpu>>,
    _: Option<RankComms>,
) -> anyhow::Result<Box<dyn TrainBackend>> {
    Err(crate::settings_args::BackendNotBuilt(miles_core::TrainBackendKind::Fsdp).into())
}
