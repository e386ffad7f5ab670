//! The training backend `--train-backend` names, from the crates this binary was built with.

use miles_core::backend::TrainBackend;
use miles_core::config::Settings;

/// The backend `--train-backend` names, built from the settings.
///
/// # Errors
/// `BadSettings` for settings the backend refuses, `BackendNotBuilt` for a backend this
/// binary was built without, or the backend's failure to start.
pub fn build_backend(settings: &Settings) -> anyhow::Result<Box<dyn TrainBackend>> {
    match settings.train_backend {
        miles_core::TrainBackendKind::Megatron => megatron(settings),
        miles_core::TrainBackendKind::Fsdp => fsdp(settings),
    }
}

/// A backend's refusal of the settings is bad settings (exit status 2); anything else a failure.
#[cfg(any(feature = "megatron", feature = "fsdp"))]
fn refused(error: miles_core::BackendError) -> anyhow::Error {
    match error {
        error @ miles_core::BackendError::Settings { .. } => {
            crate::settings_args::BadSettings(error.to_string()).into()
        }
        error => error.into(),
    }
}

#[cfg(feature = "megatron")]
fn megatron(settings: &Settings) -> anyhow::Result<Box<dyn TrainBackend>> {
    let trainer = miles_megatron::MegatronTrainer::from_settings(settings).map_err(refused)?;
    Ok(Box::new(trainer))
}

#[cfg(not(feature = "megatron"))]
fn megatron(_: &Settings) -> anyhow::Result<Box<dyn TrainBackend>> {
    Err(crate::settings_args::BackendNotBuilt(miles_core::TrainBackendKind::Megatron).into())
}

#[cfg(feature = "fsdp")]
fn fsdp(settings: &Settings) -> anyhow::Result<Box<dyn TrainBackend>> {
    let backend = miles_fsdp::FsdpBackend::from_settings(settings).map_err(refused)?;
    Ok(Box::new(backend))
}

#[cfg(not(feature = "fsdp"))]
fn fsdp(_: &Settings) -> anyhow::Result<Box<dyn TrainBackend>> {
    Err(crate::settings_args::BackendNotBuilt(miles_core::TrainBackendKind::Fsdp).into())
}
