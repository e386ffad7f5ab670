//! The training backend `--train-backend` names, from the crates this binary was built with.

use std::sync::Arc;

use miles_core::backend::TrainBackend;
use miles_core::config::Settings;
use miles_core::device::{Gpu, NcclComm};

use crate::settings_args::BadSettings;

/// The backend `--train-backend` names, built from the settings; with `group`, this process's
/// rank of a data-parallel job over one GPU a process.
///
/// # Errors
/// `BadSettings` for settings the backend refuses, `BackendNotBuilt` for a backend this
/// binary was built without, or the backend's failure to start.
pub fn build_backend(
    settings: &Settings,
    group: Option<NcclComm>,
) -> anyhow::Result<Box<dyn TrainBackend>> {
    let gpu = crate::gpu::training_gpu_for(settings.device)?;
    match settings.train_backend {
        miles_core::TrainBackendKind::Megatron => megatron(settings, gpu, group),
        miles_core::TrainBackendKind::Fsdp => fsdp(settings, gpu, group),
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
    group: Option<NcclComm>,
) -> anyhow::Result<Box<dyn TrainBackend>> {
    Ok(match gpu {
        Some(gpu) => Box::new(miles_megatron::gpu_trainer(gpu, settings, group).map_err(refused)?),
        None => {
            Box::new(miles_megatron::MegatronTrainer::from_settings(settings).map_err(refused)?)
        }
    })
}

#[cfg(not(feature = "megatron"))]
fn megatron(
    _: &Settings,
    _: Option<Arc<Gpu>>,
    _: Option<NcclComm>,
) -> anyhow::Result<Box<dyn TrainBackend>> {
    Err(crate::settings_args::BackendNotBuilt(miles_core::TrainBackendKind::Megatron).into())
}

#[cfg(feature = "fsdp")]
fn fsdp(
    settings: &Settings,
    gpu: Option<Arc<Gpu>>,
    group: Option<NcclComm>,
) -> anyhow::Result<Box<dyn TrainBackend>> {
    Ok(match gpu {
        Some(gpu) => Box::new(miles_fsdp::gpu_trainer(gpu, settings, group).map_err(refused)?),
        None => Box::new(miles_fsdp::FsdpBackend::from_settings(settings).map_err(refused)?),
    })
}

#[cfg(not(feature = "fsdp"))]
fn fsdp(
    _: &Settings,
    _: Option<Arc<Gpu>>,
    _: Option<NcclComm>,
) -> anyhow::Result<Box<dyn TrainBackend>> {
    Err(crate::settings_args::BackendNotBuilt(miles_core::TrainBackendKind::Fsdp).into())
}
