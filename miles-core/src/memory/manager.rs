//! The memory manager: one region per tag, each with its own arena and backup policy.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::device::{AddressRange, Device};
use crate::store::{DiskStore, HostPool};

use super::region::{Region, Staging, Stores};
use super::{BackupPolicy, Buffer, MemoryError, MemoryTag, OffloadReport, RegionState};

/// Where disk-policy regions go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskSettings {
    /// The offload directory (`--offload-train-disk-dir`); the store writes under
    /// `offload/rank-<rank>/` (see [`RankDir`](crate::store::RankDir)).
    pub dir: PathBuf,
    /// This process's rank.
    pub rank: usize,
    /// Bytes per chunk (`--offload-train-disk-chunk-mb` MiB).
    pub chunk_bytes: usize,
    /// Host memory a pause to disk may copy into first, so that the device is freed at the
    /// link's speed while the write to disk goes on in the background
    /// (`--offload-train-host-budget-gb`); 0 writes in line.
    pub host_budget_bytes: u64,
}

/// How a [`MemoryManager`] runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ManagerSettings {
    /// Device memory that must stay free after a resume (`--train-memory-margin-bytes`).
    pub margin_bytes: u64,
    /// The disk store, for regions with [`BackupPolicy::Disk`].
    pub disk: Option<DiskSettings>,
}

/// Tagged device memory that pauses to a backup and resumes at the same addresses.
///
/// Thread-safe: each tag has its own lock, and no lock shared by all tags is held while bytes
/// move, so one tag may pause while another is in use or resuming.
#[derive(Debug)]
pub struct MemoryManager {
    device: Arc<dyn Device>,
    margin_bytes: u64,
    stores: Arc<Stores>,
    regions: Mutex<HashMap<MemoryTag, Arc<Region>>>,
}

impl MemoryManager {
    /// A manager of `device` memory.
    ///
    /// # Errors
    /// [`MemoryError::DiskStore`] when the disk directory cannot be created or the chunk size
    /// is unusable.
    pub fn new(
        device: Arc<dyn Device>,
        settings: ManagerSettings,
    ) -> Result<MemoryManager, MemoryError> {
        let pool = Arc::new(HostPool::new(Arc::clone(&device)));
        let host_budget = settings
            .disk
            .as_ref()
            .map_or(0, |disk| disk.host_budget_bytes);
        let disk = settings
            .disk
            .map(|disk| DiskStore::new(&disk.dir, disk.rank, disk.chunk_bytes, Arc::clone(&pool)))
            .transpose()
            .map_err(MemoryError::DiskStore)?;
        Ok(MemoryManager {
            device,
            margin_bytes: settings.margin_bytes,
            stores: Arc::new(Stores {
                pool,
                disk,
                resuming: AtomicUsize::new(0),
                staging: Staging::new(host_budget),
            }),
            regions: Mutex::new(HashMap::new()),
        })
    }

    /// The device.
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    /// The pool of host buffers that host backups and disk staging use.
    pub fn host_pool(&self) -> &HostPool {
        &self.stores.pool
    }

    /// Grows the host pool by one buffer per tag of `tags` backed up to host memory, as large as
    /// the tag's committed bytes now, so that its first pause copies instead of pinning (pinning
    /// runs at about 20 GB/s, a third of the copy); returns the bytes added. Call it after the
    /// tags' buffers are allocated; tags of other policies are skipped.
    ///
    /// # Errors
    /// [`MemoryError::UnknownTag`]; [`MemoryError::Store`] when the host cannot provide a buffer.
    pub fn prepare_host_backups(&self, tags: &[MemoryTag]) -> Result<u64, MemoryError> {
        let mut sizes = Vec::new();
        for tag in tags {
            let region = self.region(tag)?;
            if region.policy == BackupPolicy::Host && region.committed_bytes() > 0 {
                sizes.push((tag, region.committed_bytes() as usize));
            }
        }
        let pool = &self.stores.pool;
        let before = pool.allocated_bytes();
        let mut taken = Vec::with_capacity(sizes.len());
        for (tag, len) in sizes {
            match pool.take(len) {
                Ok(buffer) => taken.push(buffer),
                Err(source) => {
                    taken.into_iter().for_each(|b| pool.put(b));
                    return Err(MemoryError::Store {
                        tag: tag.clone(),
                        source,
                    });
                }
            }
        }
        taken.into_iter().for_each(|b| pool.put(b));
        Ok(pool.allocated_bytes() - before)
    }

    /// Free the pool's host buffers that no paused region holds; returns the bytes freed.
    pub fn release_host_pool(&self) -> u64 {
        self.stores.pool.release()
    }

    /// Create the region of `tag`: reserve an arena of `arena_bytes` (rounded up to the device
    /// granularity) that only this tag's buffers use.
    ///
    /// # Errors
    /// [`MemoryError::RegionExists`], [`MemoryError::InvalidTagName`],
    /// [`MemoryError::NoDiskStore`] for a disk policy without a disk directory,
    /// [`MemoryError::SizeOverflow`] for a size that overflows when rounded up, or the device's
    /// error when the range cannot be reserved.
    pub fn create_region(
        &self,
        tag: MemoryTag,
        policy: BackupPolicy,
        arena_bytes: usize,
    ) -> Result<(), MemoryError> {
        if let MemoryTag::Named(name) = &tag {
            let valid = !name.is_empty()
                && name.len() <= 64
                && name.bytes().all(|b| {
                    b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-'
                });
            if !valid {
                return Err(MemoryError::InvalidTagName { name: name.clone() });
            }
        }
        if policy == BackupPolicy::Disk && self.stores.disk.is_none() {
            return Err(MemoryError::NoDiskStore { tag });
        }
        let mut regions = self.lock();
        if regions.contains_key(&tag) {
            return Err(MemoryError::RegionExists { tag });
        }
        let len = arena_bytes
            .max(1)
            .checked_next_multiple_of(self.device.granularity())
            .ok_or_else(|| MemoryError::SizeOverflow {
                tag: tag.clone(),
                what: "arena size",
                value: arena_bytes as u64,
            })?;
        let range = self
            .device
            .reserve(len)
            .map_err(|source| MemoryError::Device {
                tag: tag.clone(),
                source,
            })?;
        let region = Region::new(
            tag.clone(),
            policy,
            Arc::clone(&self.device),
            range,
            Arc::clone(&self.stores),
        );
        regions.insert(tag, Arc::new(region));
        Ok(())
    }

    /// Allocate a buffer of `len` bytes in the region of `tag` (aligned to 256 bytes).
    ///
    /// # Errors
    /// [`MemoryError::UnknownTag`], [`MemoryError::TagPaused`], [`MemoryError::ArenaFull`],
    /// [`MemoryError::SizeOverflow`] for a length that overflows when rounded up, or
    /// [`MemoryError::Device`] with the device's out-of-memory.
    pub fn alloc(&self, tag: &MemoryTag, len: usize) -> Result<Buffer, MemoryError> {
        let region = self.region(tag)?;
        let (offset, size) = region.alloc(len)?;
        Ok(Buffer::new(region, offset, size, len))
    }

    /// Pause `tag`: wait until no view of it is alive, copy its memory to its backup, verify
    /// the backup, then release the memory. Addresses stay reserved.
    ///
    /// # Errors
    /// [`MemoryError::AlreadyPaused`], [`MemoryError::TagBusy`]; [`MemoryError::ViewHeld`] at
    /// once when the calling thread holds a view of the tag (views of other threads are waited
    /// for); [`MemoryError::Store`] or
    /// [`MemoryError::Device`] when the backup fails, and the tag is then active and intact.
    pub fn pause(&self, tag: &MemoryTag) -> Result<OffloadReport, MemoryError> {
        self.region(tag)?.pause()
    }

    /// Resume `tag`: check that free device memory covers its bytes plus the margin, commit
    /// memory at the same addresses, copy the bytes back (verifying disk checksums).
    ///
    /// # Errors
    /// [`MemoryError::InsufficientMemory`] (nothing changes), [`MemoryError::NotPaused`],
    /// [`MemoryError::TagBusy`]; [`MemoryError::Store`] or [`MemoryError::Device`] when the
    /// restore fails, and the tag then stays paused with its backup.
    pub fn resume(&self, tag: &MemoryTag) -> Result<OffloadReport, MemoryError> {
        self.region(tag)?.resume(self.margin_bytes)
    }

    /// Waits for the disk writes behind the pauses of `tags` (a tag paused with
    /// `host_budget_bytes` of room copies to host memory first and writes to disk on a thread of
    /// its own; other tags have none) and reports the first that failed.
    ///
    /// # Errors
    /// [`MemoryError::UnknownTag`]; [`MemoryError::BackgroundWrite`] for the first failed write
    /// (the others are logged; each is reported once): that tag stays paused with its bytes
    /// whole in host memory, and its resume brings them back.
    pub fn finish_writes(&self, tags: &[MemoryTag]) -> Result<(), MemoryError> {
        let mut first = Ok(());
        for tag in tags {
            match self.region(tag)?.finish_write() {
                Err(error) if first.is_ok() => first = Err(error),
                Err(error) => tracing::error!(%error, "a further background write failed"),
                Ok(()) => {}
            }
        }
        first
    }

    /// Pauses every tag of `tags`, in order, all or nothing: when one fails, the tags paused
    /// before it are resumed (last first) and its error is returned, so every tag is as it was.
    /// Returns each tag's report.
    ///
    /// # Errors
    /// As [`pause`](Self::pause), for the first tag that fails; a tag that cannot be resumed
    /// in the rollback is logged and stays paused with its backup.
    pub fn pause_all(&self, tags: &[MemoryTag]) -> Result<Vec<OffloadReport>, MemoryError> {
        self.all_or_nothing(tags, "pause", Self::pause, Self::resume)
    }

    /// Resumes every tag of `tags`, in order, all or nothing: when one fails, the tags resumed
    /// before it are paused again (last first) and its error is returned, so every tag is
    /// paused again with its bytes intact. Disk writes still running behind the tags' pauses
    /// are asked to stop before the first resume, so they wind down together rather than one
    /// after another: after a failure, a tag whose write was stopped before it ended is
    /// paused with its host copy alone (what the write wrote removed, its share of the host
    /// budget still held) until it resumes. Returns each tag's report.
    ///
    /// # Errors
    /// As [`resume`](Self::resume), for the first tag that fails; a tag that cannot be paused
    /// again in the rollback is logged and stays active.
    pub fn resume_all(&self, tags: &[MemoryTag]) -> Result<Vec<OffloadReport>, MemoryError> {
        // A failed background write fails the call before any tag resumes.
        for tag in tags {
            self.region(tag)?.check_write()?;
        }
        for tag in tags {
            self.region(tag)?.request_write_stop();
        }
        self.all_or_nothing(tags, "resume", Self::resume, Self::pause)
    }

    /// Runs `op` over `tags`, undoing the done ones with `undo` when one fails.
    fn all_or_nothing(
        &self,
        tags: &[MemoryTag],
        what: &'static str,
        op: fn(&Self, &MemoryTag) -> Result<OffloadReport, MemoryError>,
        undo: fn(&Self, &MemoryTag) -> Result<OffloadReport, MemoryError>,
    ) -> Result<Vec<OffloadReport>, MemoryError> {
        let mut reports = Vec::with_capacity(tags.len());
        for tag in tags {
            match op(self, tag) {
                Ok(report) => reports.push(report),
                Err(error) => {
                    for done in reports.iter().rev() {
                        // A resume reports a failed background write once and changes nothing;
                        // the next one brings the host copy back.
                        let undone = match undo(self, &done.tag) {
                            Err(MemoryError::BackgroundWrite { tag, source }) => {
                                tracing::error!(%tag, error = %source, "a background write failed; the undo resumes from the host copy");
                                undo(self, &done.tag)
                            }
                            undone => undone,
                        };
                        if let Err(undo_error) = undone {
                            tracing::error!(
                                tag = %done.tag,
                                error = %undo_error,
                                "cannot undo the {what} of a tag after {} failed",
                                tag
                            );
                        }
                    }
                    return Err(error);
                }
            }
        }
        Ok(reports)
    }

    /// The host address of the backup of `range` (device addresses of a buffer of `tag`, or
    /// part of one) while `tag` is paused with a host backup; `None` while it is active or
    /// backed up elsewhere. The bytes stay at that address until the tag resumes: what
    /// torch_memory_saver's `get_cpu_backup` reads.
    ///
    /// # Errors
    /// [`MemoryError::UnknownTag`].
    pub fn host_backup_address(
        &self,
        tag: &MemoryTag,
        range: AddressRange,
    ) -> Result<Option<usize>, MemoryError> {
        Ok(self.region(tag)?.host_backup_address(range))
    }

    /// Where `tag` stands.
    ///
    /// # Errors
    /// [`MemoryError::UnknownTag`].
    pub fn state(&self, tag: &MemoryTag) -> Result<RegionState, MemoryError> {
        Ok(self.region(tag)?.state())
    }

    /// Device bytes `tag` holds (active) or needs to resume (paused).
    ///
    /// # Errors
    /// [`MemoryError::UnknownTag`].
    pub fn region_bytes(&self, tag: &MemoryTag) -> Result<u64, MemoryError> {
        Ok(self.region(tag)?.committed_bytes())
    }

    /// Device bytes each tag holds now (nothing for a paused tag), sorted by tag name: what a
    /// memory timeline draws.
    pub fn resident_bytes(&self) -> Vec<(MemoryTag, u64)> {
        let mut tags: Vec<(MemoryTag, u64)> = self
            .lock()
            .values()
            .map(|region| {
                let bytes = match region.state() {
                    RegionState::Active | RegionState::Pausing => region.committed_bytes(),
                    RegionState::Paused | RegionState::Resuming => 0,
                };
                (region.tag.clone(), bytes)
            })
            .collect();
        tags.sort_by(|a, b| a.0.name().cmp(b.0.name()));
        tags
    }

    /// The reserved address range of `tag`'s arena.
    ///
    /// # Errors
    /// [`MemoryError::UnknownTag`].
    pub fn arena(&self, tag: &MemoryTag) -> Result<AddressRange, MemoryError> {
        Ok(self.region(tag)?.range)
    }

    fn region(&self, tag: &MemoryTag) -> Result<Arc<Region>, MemoryError> {
        self.lock()
            .get(tag)
            .cloned()
            .ok_or_else(|| MemoryError::UnknownTag { tag: tag.clone() })
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<MemoryTag, Arc<Region>>> {
        self.regions.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
impl MemoryManager {
    /// Make the disk store's writer fail on chunk `index`; call before creating regions.
    fn inject_disk_write_fault(&mut self, index: usize) {
        if let Some(stores) = Arc::get_mut(&mut self.stores)
            && let Some(disk) = stores.disk.as_mut()
        {
            disk.inject_write_fault(index);
        }
    }
}

#[cfg(test)]
impl MemoryManager {
    /// Bytes of host copies waiting for (or holding) a write behind a pause.
    fn staged_bytes(&self) -> u64 {
        self.stores.staging.held()
    }

    /// Make the disk store's writer wait at `barrier` twice before chunk `index`; call before
    /// creating regions.
    fn inject_disk_write_hold(&mut self, index: usize, barrier: Arc<std::sync::Barrier>) {
        if let Some(stores) = Arc::get_mut(&mut self.stores)
            && let Some(disk) = stores.disk.as_mut()
        {
            disk.inject_write_hold(index, barrier);
        }
    }
}

#[cfg(test)]
mod staged_tests;
#[cfg(test)]
mod tests;
