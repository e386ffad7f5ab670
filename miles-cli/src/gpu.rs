//! The GPU this process computes on: opened once (device, NVRTC kernels, cuBLAS) and shared by
//! the trainers and the rollout engine, which each keep their own memory manager over it.

use std::sync::{Arc, Mutex, PoisonError};

use anyhow::Context;
use miles_core::device::{self, CudaDevice, DeviceError, Gpu};
use miles_core::{DeviceChoice, DeviceKind};

use crate::settings_args::BadSettings;

static SHARED: Mutex<Option<Arc<Gpu>>> = Mutex::new(None);

/// The shared GPU when `choice` resolves to CUDA (`auto` does when a driver and a GPU are
/// there), `None` for the CPU device.
///
/// # Errors
/// [`BadSettings`] (exit status 2) when CUDA is asked for and not there; the GPU cannot be
/// opened or its kernels do not compile, with the reason.
pub fn gpu_for(choice: DeviceChoice) -> anyhow::Result<Option<Arc<Gpu>>> {
    if device::resolve(choice) == DeviceKind::Cpu {
        return Ok(None);
    }
    let mut shared = SHARED.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(gpu) = shared.as_ref() {
        return Ok(Some(Arc::clone(gpu)));
    }
    let cuda = match CudaDevice::open(0) {
        Ok(cuda) => Arc::new(cuda),
        Err(error @ DeviceError::CudaUnavailable(_)) => {
            return Err(BadSettings(format!("--device {choice}: {error}")).into());
        }
        Err(error) => return Err(anyhow::Error::new(error).context("cannot open cuda:0")),
    };
    let gpu = Arc::new(Gpu::new(cuda).context("cannot start gpu compute on cuda:0")?);
    *shared = Some(Arc::clone(&gpu));
    Ok(Some(gpu))
}
