//! [`MemorySaverAbi`] for the process: the C entry points' behaviour on one global [`Saver`]
//! of the GPUs through the CUDA driver.

use std::path::PathBuf;
use std::sync::OnceLock;

use miles_core::device::c_abi::{FreeOutcome, MallocOutcome, MemorySaverAbi};
use miles_core::{CudaDevice, DeviceAddress};

use crate::config;
use crate::saver::{Saver, SaverSettings, open_cuda};

/// The process's drop-in, behind torch_memory_saver's C ABI.
pub struct Abi;

/// The saver, set up from the environment on first use; its error when the environment is
/// unusable.
fn saver() -> Result<&'static Saver, String> {
    static SAVER: OnceLock<Result<Saver, String>> = OnceLock::new();
    SAVER
        .get_or_init(|| {
            init_logging();
            SaverSettings::from_env()
                .map(|settings| Saver::new(settings, Box::new(open_cuda)))
                .map_err(|error| error.to_string())
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// Log to stderr at the level `RUST_LOG` gives (warnings by default), once; a process that set
/// up its own subscriber keeps it.
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Run `work` and make the GPU whose context was current on the calling thread current again:
/// the caller shares the thread with PyTorch, which must find its device as it left it.
fn keeping_current<T>(work: impl FnOnce(&Saver) -> Result<T, String>) -> Result<T, String> {
    let saver = saver()?;
    let current = CudaDevice::current_ordinal().ok().flatten();
    let outcome = work(saver);
    if let Some(ordinal) = current {
        saver.make_current(ordinal);
    }
    outcome
}

/// The GPU a `cudaMalloc` on this thread is for: the current context's, else GPU 0.
fn current_gpu() -> i32 {
    CudaDevice::current_ordinal().ok().flatten().unwrap_or(0)
}

impl MemorySaverAbi for Abi {
    fn set_interesting_region(value: bool) {
        config::set_interesting_region(value);
    }

    fn interesting_region() -> bool {
        config::interesting_region().unwrap_or(false)
    }

    fn set_current_tag(tag: Option<&str>) -> Result<(), String> {
        config::set_tag(tag).map_err(|error| error.to_string())
    }

    fn current_tag() -> String {
        config::tag()
    }

    fn set_enable_cpu_backup(value: bool) {
        config::set_cpu_backup(value);
    }

    fn enable_cpu_backup() -> bool {
        config::cpu_backup().unwrap_or(false)
    }

    fn set_cpu_backup_backend(backend: Option<&str>) -> Result<(), String> {
        config::set_backend(backend).map_err(|error| error.to_string())
    }

    fn cpu_backup_backend() -> String {
        config::backend()
    }

    fn set_enable_disk_backup(value: bool) {
        config::set_disk_backup(value);
    }

    fn enable_disk_backup() -> bool {
        config::disk_backup().unwrap_or(false)
    }

    fn set_disk_backup_dir(dir: Option<&str>) -> Result<(), String> {
        let dir = dir.ok_or_else(|| crate::TorchError::NoDiskDir.to_string())?;
        saver()?
            .set_disk_dir(PathBuf::from(dir))
            .map_err(|error| error.to_string())
    }

    fn set_memory_margin_bytes(value: u64) {
        if let Ok(saver) = saver() {
            saver.set_margin(value);
        }
    }

    fn set_retain_cpu_backup(value: bool) {
        if let Ok(saver) = saver() {
            saver.set_retain(value);
        }
    }

    fn retain_cpu_backup() -> bool {
        saver().is_ok_and(Saver::retain)
    }

    fn pause(tag: Option<&str>) -> Result<(), String> {
        keeping_current(|saver| saver.pause(tag).map_err(|error| error.to_string()))
    }

    fn resume(tag: Option<&str>) -> Result<(), String> {
        keeping_current(|saver| saver.resume(tag).map_err(|error| error.to_string()))
    }

    fn prepare_cpu_backup(tag: &str) -> Result<(), String> {
        keeping_current(|saver| {
            saver
                .prepare_cpu_backup(tag)
                .map(drop)
                .map_err(|error| error.to_string())
        })
    }

    fn cpu_backup_address(address: DeviceAddress, len: u64) -> Option<usize> {
        saver().ok()?.cpu_backup_address(address, len)
    }

    fn torch_malloc(len: usize, device: i32) -> Result<DeviceAddress, String> {
        let saver = saver()?;
        let outcome = match config::current() {
            Ok(Some(region)) => saver.alloc(device, len, &region),
            Ok(None) => saver.plain_alloc(device, len),
            Err(error) => Err(error),
        };
        outcome.map_err(|error| error.to_string())
    }

    fn torch_free(address: DeviceAddress, _len: usize, device: i32) -> Result<(), String> {
        let saver = saver()?;
        let freed = saver.free(address).map_err(|error| error.to_string())?;
        if freed {
            return Ok(());
        }
        saver
            .plain_free(device, address)
            .map_err(|error| error.to_string())
    }

    fn cuda_malloc(len: usize) -> Result<MallocOutcome, String> {
        match config::current().map_err(|error| error.to_string())? {
            None => Ok(MallocOutcome::Plain),
            Some(region) => saver()?
                .alloc(current_gpu(), len, &region)
                .map(MallocOutcome::Tagged)
                .map_err(|error| error.to_string()),
        }
    }

    fn cuda_free(address: DeviceAddress) -> Result<FreeOutcome, String> {
        if address == 0 {
            return Ok(FreeOutcome::NotOurs);
        }
        let Ok(saver) = saver() else {
            return Ok(FreeOutcome::NotOurs);
        };
        match saver.free(address) {
            Ok(true) => Ok(FreeOutcome::Freed),
            Ok(false) => Ok(FreeOutcome::NotOurs),
            Err(error) => Err(error.to_string()),
        }
    }
}
