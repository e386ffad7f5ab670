//! Opening the device a command runs on, from the `--device` choice.

use std::sync::Arc;

use super::{CpuDevice, CudaDevice, CudaOptions, Device, DeviceError, DeviceKind, probe};
use crate::choice::DeviceChoice;

/// A device opened by [`open`], kept with its concrete type for the calls only one kind has
/// (the CUDA device's plain baseline copies and stream waits, say).
#[derive(Clone, Debug)]
pub enum OpenedDevice {
    /// The CPU device.
    Cpu(Arc<CpuDevice>),
    /// A GPU through the CUDA driver.
    Cuda(Arc<CudaDevice>),
}

impl OpenedDevice {
    /// The device behind the [`Device`] contract, for the memory manager and the stores.
    pub fn shared(&self) -> Arc<dyn Device> {
        match self {
            OpenedDevice::Cpu(device) => Arc::clone(device) as Arc<dyn Device>,
            OpenedDevice::Cuda(device) => Arc::clone(device) as Arc<dyn Device>,
        }
    }

    /// Which kind of device was opened.
    pub fn kind(&self) -> DeviceKind {
        match self {
            OpenedDevice::Cpu(_) => DeviceKind::Cpu,
            OpenedDevice::Cuda(_) => DeviceKind::Cuda,
        }
    }
}

/// The kind of device `choice` stands for on this machine: `auto` is CUDA when the probe finds
/// a driver with every symbol the CUDA device calls and at least one GPU, else the CPU device
/// (the reason is logged).
pub fn resolve(choice: DeviceChoice) -> DeviceKind {
    match choice {
        DeviceChoice::Cpu => DeviceKind::Cpu,
        DeviceChoice::Cuda => DeviceKind::Cuda,
        DeviceChoice::Auto => match probe::probe_cuda() {
            Ok(found) if !found.gpus.is_empty() => DeviceKind::Cuda,
            Ok(_) => {
                tracing::info!("--device auto: the cuda driver sees no gpu; using the cpu device");
                DeviceKind::Cpu
            }
            Err(error) => {
                tracing::info!(%error, "--device auto: no usable cuda driver; using the cpu device");
                DeviceKind::Cpu
            }
        },
    }
}

/// Open the device `choice` stands for (see [`resolve`]): GPU 0 with the default CUDA options,
/// or a CPU device of `cpu_capacity` bytes.
///
/// # Errors
/// [`DeviceError::CudaUnavailable`] when `cuda` is asked for and cannot open; the driver's error.
pub fn open(choice: DeviceChoice, cpu_capacity: u64) -> Result<OpenedDevice, DeviceError> {
    open_with(choice, cpu_capacity, CudaOptions::default())
}

/// As [`open`], with the given options for a CUDA device.
///
/// # Errors
/// As [`open`].
pub fn open_with(
    choice: DeviceChoice,
    cpu_capacity: u64,
    cuda: CudaOptions,
) -> Result<OpenedDevice, DeviceError> {
    open_on(choice, 0, cpu_capacity, cuda)
}

/// As [`open_with`], on GPU `ordinal` when `choice` resolves to CUDA (one process per GPU: its
/// local rank).
///
/// # Errors
/// As [`open`]; [`DeviceError::CudaUnavailable`] for an ordinal the driver does not have.
pub fn open_on(
    choice: DeviceChoice,
    ordinal: usize,
    cpu_capacity: u64,
    cuda: CudaOptions,
) -> Result<OpenedDevice, DeviceError> {
    let opened = match resolve(choice) {
        DeviceKind::Cpu => OpenedDevice::Cpu(Arc::new(CpuDevice::new(cpu_capacity))),
        DeviceKind::Cuda => {
            let ordinal = i32::try_from(ordinal)
                .map_err(|_| DeviceError::CudaUnavailable(format!("no gpu cuda:{ordinal}")))?;
            OpenedDevice::Cuda(Arc::new(CudaDevice::open_with(ordinal, cuda)?))
        }
    };
    tracing::info!(?choice, device = %opened.shared().name(), "opened device");
    Ok(opened)
}

/// The device tests run on: GPU 0 limited to `capacity` bytes when the environment says
/// `MILES_TEST_DEVICE=cuda`, else a CPU device of `capacity` bytes. With the limit, tests that
/// count on out-of-memory at small sizes behave alike on both.
///
/// # Errors
/// As [`open`], when `MILES_TEST_DEVICE=cuda` and the GPU cannot open.
pub fn open_test_device(capacity: u64) -> Result<OpenedDevice, DeviceError> {
    let choice = match std::env::var("MILES_TEST_DEVICE").as_deref() {
        Ok("cuda") => DeviceChoice::Cuda,
        _ => DeviceChoice::Cpu,
    };
    let cuda = CudaOptions {
        memory_limit: Some(capacity),
        ..CudaOptions::default()
    };
    open_with(choice, capacity, cuda)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_choice_opens_a_cpu_device_of_the_asked_capacity() {
        let opened = open(DeviceChoice::Cpu, 1 << 30).unwrap();
        assert_eq!(opened.kind(), DeviceKind::Cpu);
        assert_eq!(opened.shared().memory_info().unwrap().total, 1 << 30);
    }

    #[test]
    fn auto_agrees_with_the_probe() {
        let gpus = probe::probe_cuda().map_or(0, |found| found.gpus.len());
        let expected = if gpus > 0 {
            DeviceKind::Cuda
        } else {
            DeviceKind::Cpu
        };
        assert_eq!(resolve(DeviceChoice::Auto), expected);
    }
}
