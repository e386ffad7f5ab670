//! The drop-in's memory: one memory manager per GPU, each torch_memory_saver tag a set of
//! regions of it (one per backup policy the tag's allocations asked for), so that a tag's
//! blocks live in address arenas no other tag shares.
//!
//! An allocation in a region is a buffer of the tag's region, rounded up to the device
//! granularity so that no two allocations share a granule of physical memory; the buffer is
//! kept by its device address until PyTorch frees it. A pause waits until the GPU is idle
//! (PyTorch's kernels are invisible to the manager), then pauses each region of the tag; a
//! resume first checks that the GPU has room for all of them plus the margin.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use miles_core::{
    AddressRange, BackupPolicy, Buffer, CudaDevice, CudaOptions, Device, DeviceAddress,
    DiskSettings, ManagerSettings, MemoryManager, MemoryTag, RegionState,
};

use crate::TorchError;
use crate::config::RegionConfig;

/// The device of one GPU, as the opener gives it.
pub struct Opened {
    /// The device the memory manager runs on.
    pub device: Arc<dyn Device>,
    /// The same device as a GPU, for synchronising with PyTorch's work (`None` on the CPU
    /// device of the tests).
    pub cuda: Option<Arc<CudaDevice>>,
}

/// Opens the device of a GPU ordinal.
pub type Opener = Box<dyn Fn(i32) -> Result<Opened, TorchError> + Send + Sync>;

/// Open GPU `ordinal` through the CUDA driver, with the default options but no scrub
/// collector: its thread allocates a granule now and then, and a driver allocation from
/// another thread while PyTorch captures a CUDA graph (capture mode `global`) can invalidate
/// the capture; PyTorch's own allocations during a capture run in relaxed mode.
///
/// # Errors
/// [`TorchError::Open`] when the driver or the GPU is missing.
pub fn open_cuda(ordinal: i32) -> Result<Opened, TorchError> {
    let options = CudaOptions {
        collect_after: None,
        ..CudaOptions::default()
    };
    let opened = CudaDevice::open_with(ordinal, options);
    let cuda = Arc::new(opened.map_err(|source| TorchError::Open { ordinal, source })?);
    Ok(Opened {
        device: Arc::clone(&cuda) as Arc<dyn Device>,
        cuda: Some(cuda),
    })
}

/// How a [`Saver`] starts, from torch_memory_saver's environment variables.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SaverSettings {
    /// Where disk backups go (`TMS_DISK_BACKUP_DIR`); each process writes under
    /// `rank-<pid>/`.
    pub disk_dir: PathBuf,
    /// Bytes per disk chunk (`TMS_DISK_BACKUP_CHUNK_MB` MiB).
    pub chunk_bytes: usize,
    /// Whether host backups stay pinned for reuse after a resume (`TMS_RETAIN_CPU_BACKUP`).
    pub retain_cpu_backup: bool,
}

/// Disk chunk size when `TMS_DISK_BACKUP_CHUNK_MB` is unset: miles' default
/// (`--offload-train-disk-chunk-mb`).
const DEFAULT_CHUNK_MB: usize = 64;

impl SaverSettings {
    /// The settings the environment gives: `TMS_DISK_BACKUP_DIR` (default
    /// `$TMPDIR/miles_memory_saver`), `TMS_DISK_BACKUP_CHUNK_MB` (default 64) and
    /// `TMS_RETAIN_CPU_BACKUP` (default on: the pinned pool is what makes a pause fast).
    ///
    /// # Errors
    /// [`TorchError::BadEnv`] for a value a variable cannot have.
    pub fn from_env() -> Result<SaverSettings, TorchError> {
        let disk_dir = match std::env::var("TMS_DISK_BACKUP_DIR") {
            Ok(dir) if !dir.is_empty() => PathBuf::from(dir),
            _ => std::env::temp_dir().join("miles_memory_saver"),
        };
        let chunk_mb = match std::env::var("TMS_DISK_BACKUP_CHUNK_MB") {
            Err(_) => DEFAULT_CHUNK_MB,
            Ok(value) => match value.trim().parse::<usize>() {
                Ok(mb) if mb > 0 && mb <= 1 << 20 => mb,
                _ => {
                    return Err(TorchError::BadEnv {
                        var: "TMS_DISK_BACKUP_CHUNK_MB",
                        value,
                        expected: "a whole number of MiB from 1 to 1048576",
                    });
                }
            },
        };
        Ok(SaverSettings {
            disk_dir,
            chunk_bytes: chunk_mb << 20,
            retain_cpu_backup: crate::config::env_bool("TMS_RETAIN_CPU_BACKUP", true)?,
        })
    }
}

/// Every GPU's tagged memory of the process.
pub struct Saver {
    opener: Opener,
    gpus: Mutex<BTreeMap<i32, Arc<Gpu>>>,
    disk_dir: Mutex<PathBuf>,
    chunk_bytes: usize,
    margin: AtomicU64,
    retain: AtomicBool,
}

/// One GPU's memory manager and what the drop-in keeps of it.
struct Gpu {
    memory: MemoryManager,
    cuda: Option<Arc<CudaDevice>>,
    /// Why the disk store is missing: its directory and the error.
    disk: Result<(), (PathBuf, String)>,
    regions: Mutex<Vec<TagRegion>>,
    /// Live allocations by device address.
    allocations: Mutex<BTreeMap<DeviceAddress, Buffer>>,
}

/// One region of a torch_memory_saver tag.
#[derive(Clone, Debug)]
struct TagRegion {
    tag: String,
    policy: BackupPolicy,
    region: MemoryTag,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Saver {
    /// A saver opening GPUs with `opener` when first used.
    pub fn new(settings: SaverSettings, opener: Opener) -> Saver {
        Saver {
            opener,
            gpus: Mutex::new(BTreeMap::new()),
            disk_dir: Mutex::new(settings.disk_dir),
            chunk_bytes: settings.chunk_bytes,
            margin: AtomicU64::new(0),
            retain: AtomicBool::new(settings.retain_cpu_backup),
        }
    }

    /// Set the device memory that must stay free after an allocation in a region or a resume.
    pub fn set_margin(&self, bytes: u64) {
        self.margin.store(bytes, Ordering::SeqCst);
    }

    /// Keep host backups pinned for reuse after a resume (`true`), or give the host memory
    /// back after each resume.
    pub fn set_retain(&self, retain: bool) {
        self.retain.store(retain, Ordering::SeqCst);
    }

    /// See [`set_retain`](Self::set_retain).
    pub fn retain(&self) -> bool {
        self.retain.load(Ordering::SeqCst)
    }

    /// Set the directory of disk backups.
    ///
    /// # Errors
    /// [`TorchError::DiskDirFixed`] for another directory once a GPU holds memory (its disk
    /// store is set up with the directory of then).
    pub fn set_disk_dir(&self, dir: PathBuf) -> Result<(), TorchError> {
        let gpus = lock(&self.gpus);
        let mut current = lock(&self.disk_dir);
        if !gpus.is_empty() && *current != dir {
            return Err(TorchError::DiskDirFixed {
                current: current.display().to_string(),
            });
        }
        *current = dir;
        Ok(())
    }

    fn gpu(&self, ordinal: i32) -> Result<Arc<Gpu>, TorchError> {
        let mut gpus = lock(&self.gpus);
        if let Some(gpu) = gpus.get(&ordinal) {
            return Ok(Arc::clone(gpu));
        }
        let opened = (self.opener)(ordinal)?;
        let dir = lock(&self.disk_dir).clone();
        let disk = DiskSettings {
            dir: dir.clone(),
            rank: std::process::id() as usize,
            chunk_bytes: self.chunk_bytes,
            host_budget_bytes: 0,
        };
        let with_disk = ManagerSettings {
            margin_bytes: 0,
            disk: Some(disk),
        };
        let (memory, disk) = match MemoryManager::new(Arc::clone(&opened.device), with_disk) {
            Ok(memory) => (memory, Ok(())),
            Err(error) => {
                let without_disk = ManagerSettings {
                    margin_bytes: 0,
                    disk: None,
                };
                let memory = MemoryManager::new(opened.device, without_disk)?;
                (memory, Err((dir, error.to_string())))
            }
        };
        let gpu = Arc::new(Gpu {
            memory,
            cuda: opened.cuda,
            disk,
            regions: Mutex::new(Vec::new()),
            allocations: Mutex::new(BTreeMap::new()),
        });
        gpus.insert(ordinal, Arc::clone(&gpu));
        Ok(gpu)
    }

    fn opened(&self) -> Vec<(i32, Arc<Gpu>)> {
        lock(&self.gpus)
            .iter()
            .map(|(ordinal, gpu)| (*ordinal, Arc::clone(gpu)))
            .collect()
    }

    /// Allocate `len` bytes on GPU `ordinal` for `region`; returns the device address.
    ///
    /// # Errors
    /// [`TorchError::Margin`] when the margin would not stay free; [`TorchError::NoDiskStore`];
    /// [`TorchError::Memory`] (the tag is paused, the GPU is out of memory).
    pub fn alloc(
        &self,
        ordinal: i32,
        len: usize,
        region: &RegionConfig,
    ) -> Result<DeviceAddress, TorchError> {
        let gpu = self.gpu(ordinal)?;
        let device = gpu.memory.device();
        let margin = self.margin.load(Ordering::SeqCst);
        if margin > 0 {
            let free = device
                .memory_info()
                .map_err(|source| TorchError::Device { ordinal, source })?
                .free;
            if free < (len as u64).saturating_add(margin) {
                return Err(TorchError::Margin {
                    tag: region.tag.clone(),
                    len,
                    free,
                    margin,
                });
            }
        }
        let tag = gpu.region_of(region)?;
        let rounded = len.max(1).next_multiple_of(device.granularity());
        let buffer = gpu.memory.alloc(&tag, rounded)?;
        let address = buffer.address();
        lock(&gpu.allocations).insert(address, buffer);
        Ok(address)
    }

    /// `len` bytes of ordinary memory on GPU `ordinal`, outside every tag: PyTorch's
    /// allocator asking outside a region.
    ///
    /// # Errors
    /// [`TorchError::Device`] (out of memory, or a device that is no GPU).
    pub fn plain_alloc(&self, ordinal: i32, len: usize) -> Result<DeviceAddress, TorchError> {
        let cuda = self.gpu(ordinal)?.plain(ordinal)?;
        cuda.plain_alloc(len)
            .map_err(|source| TorchError::Device { ordinal, source })
    }

    /// Free memory of [`plain_alloc`](Self::plain_alloc).
    ///
    /// # Errors
    /// [`TorchError::Device`] for an address `plain_alloc` did not return.
    pub fn plain_free(&self, ordinal: i32, address: DeviceAddress) -> Result<(), TorchError> {
        let cuda = self.gpu(ordinal)?.plain(ordinal)?;
        cuda.plain_free(address)
            .map_err(|source| TorchError::Device { ordinal, source })
    }

    /// Make GPU `ordinal`'s context current on the calling thread, if the saver opened it
    /// (a failure is logged: the caller has nothing to report it to).
    pub fn make_current(&self, ordinal: i32) {
        let gpu = lock(&self.gpus).get(&ordinal).cloned();
        if let Some(cuda) = gpu.and_then(|gpu| gpu.cuda.clone())
            && let Err(error) = cuda.make_current()
        {
            tracing::error!(%error, ordinal, "cannot make the gpu current again");
        }
    }

    /// Free the allocation at `address` once the GPU is idle (when its tag is paused, once it
    /// resumes); `false` when no tag holds it.
    ///
    /// # Errors
    /// [`TorchError::Device`] when the GPU cannot be synchronised; the allocation is kept.
    pub fn free(&self, address: DeviceAddress) -> Result<bool, TorchError> {
        for (ordinal, gpu) in self.opened() {
            if !lock(&gpu.allocations).contains_key(&address) {
                continue;
            }
            gpu.synchronize(ordinal)?;
            let buffer = lock(&gpu.allocations).remove(&address);
            drop(buffer);
            return Ok(true);
        }
        Ok(false)
    }

    /// Pause `tag` (every tag for `None`) on every GPU: wait until the GPU is idle, then
    /// back each of the tag's regions up per its policy and release its memory.
    ///
    /// # Errors
    /// [`TorchError::State`] when `tag` is paused already; [`TorchError::Memory`] when a
    /// backup fails (that region stays active and intact).
    pub fn pause(&self, tag: Option<&str>) -> Result<(), TorchError> {
        for (ordinal, gpu) in self.opened() {
            let regions = gpu.matching(tag);
            if regions.is_empty() {
                continue;
            }
            let active = gpu.in_state(&regions, RegionState::Active)?;
            if let Some(tag) = tag
                && active.is_empty()
            {
                return Err(TorchError::State {
                    tag: tag.to_string(),
                    state: "paused already",
                    hint: "resume it before pausing it again",
                });
            }
            gpu.synchronize(ordinal)?;
            for region in &active {
                gpu.memory.pause(region)?;
            }
        }
        Ok(())
    }

    /// Resume `tag` (every paused tag for `None`) on every GPU: check that the GPU has room
    /// for all of the tag's regions plus the margin, then bring each back at its addresses.
    ///
    /// # Errors
    /// [`TorchError::InsufficientMemory`] (nothing changes); [`TorchError::State`] when `tag`
    /// is not paused; [`TorchError::Memory`] when a restore fails (that region stays paused
    /// with its backup).
    pub fn resume(&self, tag: Option<&str>) -> Result<(), TorchError> {
        let margin = self.margin.load(Ordering::SeqCst);
        for (ordinal, gpu) in self.opened() {
            let regions = gpu.matching(tag);
            if regions.is_empty() {
                continue;
            }
            let paused = gpu.in_state(&regions, RegionState::Paused)?;
            if paused.is_empty() {
                if let Some(tag) = tag {
                    return Err(TorchError::State {
                        tag: tag.to_string(),
                        state: "not paused",
                        hint: "only a paused tag can resume",
                    });
                }
                continue;
            }
            let mut need = 0u64;
            for region in &paused {
                need += gpu.memory.region_bytes(region)?;
            }
            let free = gpu
                .memory
                .device()
                .memory_info()
                .map_err(|source| TorchError::Device { ordinal, source })?
                .free;
            if free < need.saturating_add(margin) {
                return Err(TorchError::InsufficientMemory {
                    tag: tag.unwrap_or("every tag").to_string(),
                    need,
                    free,
                    margin,
                });
            }
            for region in &paused {
                gpu.memory.resume(region)?;
            }
            if !self.retain() {
                gpu.memory.release_host_pool();
            }
        }
        Ok(())
    }

    /// Pin now, in the host pool of every GPU, one buffer per CPU-backed region of `tag` as
    /// large as its allocations, so that the first pause copies at the link's speed instead of
    /// pinning as it goes; returns the bytes the pools grew by (none when they already hold
    /// such buffers).
    ///
    /// # Errors
    /// [`TorchError::Memory`] when the host cannot provide a buffer; the pools keep what they
    /// had.
    pub fn prepare_cpu_backup(&self, tag: &str) -> Result<u64, TorchError> {
        let mut grown = 0;
        for (_, gpu) in self.opened() {
            let active = gpu.in_state(&gpu.matching(Some(tag)), RegionState::Active)?;
            grown += gpu.memory.prepare_host_backups(&active)?;
        }
        Ok(grown)
    }

    /// The host address of the CPU backup of `[address, address + len)` while its tag is
    /// paused with a CPU backup; `None` otherwise.
    pub fn cpu_backup_address(&self, address: DeviceAddress, len: u64) -> Option<usize> {
        let range = AddressRange {
            start: address,
            len: usize::try_from(len).ok()?,
        };
        self.opened().into_iter().find_map(|(_, gpu)| {
            let tag = {
                let allocations = lock(&gpu.allocations);
                let (_, buffer) = allocations.range(..=address).next_back()?;
                let inside = buffer.address() <= range.start && range.end() <= buffer.range().end();
                inside.then(|| buffer.tag().clone())?
            };
            gpu.memory.host_backup_address(&tag, range).ok().flatten()
        })
    }
}

impl Gpu {
    fn synchronize(&self, ordinal: i32) -> Result<(), TorchError> {
        match &self.cuda {
            Some(cuda) => cuda
                .synchronize()
                .map_err(|source| TorchError::Device { ordinal, source }),
            None => Ok(()),
        }
    }

    fn plain(&self, ordinal: i32) -> Result<Arc<CudaDevice>, TorchError> {
        self.cuda.clone().ok_or(TorchError::Device {
            ordinal,
            source: miles_core::DeviceError::CudaUnavailable(
                "memory outside a region is plain cuda memory, and this device is no gpu"
                    .to_string(),
            ),
        })
    }

    /// The region of `config`'s tag and policy, created with an arena as large as the device
    /// the first time.
    fn region_of(&self, config: &RegionConfig) -> Result<MemoryTag, TorchError> {
        let mut regions = lock(&self.regions);
        if let Some(found) = regions
            .iter()
            .find(|r| r.tag == config.tag && r.policy == config.policy)
        {
            return Ok(found.region.clone());
        }
        if config.policy == BackupPolicy::Disk
            && let Err((dir, reason)) = &self.disk
        {
            return Err(TorchError::NoDiskStore {
                tag: config.tag.clone(),
                dir: dir.display().to_string(),
                reason: reason.clone(),
            });
        }
        let region = MemoryTag::Named(region_name(config, regions.len()));
        let device = self.memory.device();
        let arena = device
            .memory_info()
            .map_err(|source| miles_core::MemoryError::Device {
                tag: region.clone(),
                source,
            })?
            .total as usize;
        self.memory
            .create_region(region.clone(), config.policy, arena)?;
        regions.push(TagRegion {
            tag: config.tag.clone(),
            policy: config.policy,
            region: region.clone(),
        });
        Ok(region)
    }

    /// The regions of `tag` (of every tag for `None`), in creation order.
    fn matching(&self, tag: Option<&str>) -> Vec<MemoryTag> {
        lock(&self.regions)
            .iter()
            .filter(|r| tag.is_none_or(|tag| r.tag == tag))
            .map(|r| r.region.clone())
            .collect()
    }

    fn in_state(
        &self,
        regions: &[MemoryTag],
        state: RegionState,
    ) -> Result<Vec<MemoryTag>, TorchError> {
        let mut found = Vec::new();
        for region in regions {
            if self.memory.state(region)? == state {
                found.push(region.clone());
            }
        }
        Ok(found)
    }
}

/// The manager's name for the region of `config`: the tag in the characters region names
/// allow (lowercase letters, digits, `_`, `-`), its policy, and the region's index, which
/// keeps names of tags that differ only in other characters apart.
fn region_name(config: &RegionConfig, index: usize) -> String {
    let tag: String = config
        .tag
        .chars()
        .take(40)
        .map(|c| match c.to_ascii_lowercase() {
            c @ ('a'..='z' | '0'..='9' | '_' | '-') => c,
            _ => '_',
        })
        .collect();
    format!("{tag}-{}-{index}", config.policy)
}

#[cfg(test)]
mod tests;
