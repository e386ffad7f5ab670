//! One region: a tag's arena, its blocks, its state machine and its backup.

use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use crate::device::{AddressRange, Device, DeviceError, Fence, HostBuffer};
use crate::store::{DiskBackup, DiskStore, HostPool, StoreError};

use super::arena::Arena;
use super::{BackupPolicy, MemoryError, MemoryTag, OffloadReport, RegionState};

/// The backup stores a region may use.
#[derive(Debug)]
pub(crate) struct Stores {
    pub(crate) pool: Arc<HostPool>,
    pub(crate) disk: Option<DiskStore>,
}

/// A tag's region; shared by the manager and the region's buffers.
#[derive(Debug)]
pub(crate) struct Region {
    pub(crate) tag: MemoryTag,
    pub(crate) policy: BackupPolicy,
    pub(crate) device: Arc<dyn Device>,
    /// The reserved address range of the arena.
    pub(crate) range: AddressRange,
    stores: Arc<Stores>,
    core: Mutex<Core>,
    /// Signalled when the last view drops.
    idle: Condvar,
}

#[derive(Debug)]
struct Core {
    state: RegionState,
    views: usize,
    /// Device work in flight on the region's buffers (kernels, copies), recorded by its users.
    fences: Vec<Fence>,
    arena: Arena,
    backup: Backup,
    /// Committed runs saved by the last pause, and those of them actually released.
    saved: Vec<AddressRange>,
    released: Vec<AddressRange>,
    /// Blocks whose buffers were dropped while the tag was not active.
    deferred_frees: Vec<(usize, usize)>,
}

#[derive(Debug)]
enum Backup {
    Nothing,
    Host(HostBuffer),
    Disk(DiskBackup),
}

impl Region {
    pub(crate) fn new(
        tag: MemoryTag,
        policy: BackupPolicy,
        device: Arc<dyn Device>,
        range: AddressRange,
        stores: Arc<Stores>,
    ) -> Region {
        let arena = Arena::new(range.len, device.granularity());
        Region {
            tag,
            policy,
            device,
            range,
            stores,
            core: Mutex::new(Core {
                state: RegionState::Active,
                views: 0,
                fences: Vec::new(),
                arena,
                backup: Backup::Nothing,
                saved: Vec::new(),
                released: Vec::new(),
                deferred_frees: Vec::new(),
            }),
            idle: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn device_error(&self) -> impl FnOnce(DeviceError) -> MemoryError + '_ {
        |source| MemoryError::Device {
            tag: self.tag.clone(),
            source,
        }
    }

    fn store_error(&self) -> impl FnOnce(StoreError) -> MemoryError + '_ {
        |source| MemoryError::Store {
            tag: self.tag.clone(),
            source,
        }
    }

    fn usable(&self, state: RegionState) -> Result<(), MemoryError> {
        match state {
            RegionState::Active => Ok(()),
            RegionState::Paused => Err(MemoryError::TagPaused {
                tag: self.tag.clone(),
            }),
            state => Err(MemoryError::TagBusy {
                tag: self.tag.clone(),
                state,
            }),
        }
    }

    pub(crate) fn state(&self) -> RegionState {
        self.lock().state
    }

    /// Bytes of device memory the region holds (active) or will need (paused).
    pub(crate) fn committed_bytes(&self) -> u64 {
        let core = self.lock();
        let runs = match core.state {
            RegionState::Active | RegionState::Pausing => self.runs(&core.arena.committed()),
            RegionState::Paused | RegionState::Resuming => core.saved.clone(),
        };
        runs.iter().map(|r| r.len as u64).sum()
    }

    fn runs(&self, granules: &[Range<usize>]) -> Vec<AddressRange> {
        let granule = self.device.granularity();
        granules
            .iter()
            .map(|g| AddressRange {
                start: self.range.start + (g.start * granule) as u64,
                len: g.len() * granule,
            })
            .collect()
    }

    /// Take a block of `len` bytes and commit the granules it needs; returns its offset and
    /// block size.
    pub(crate) fn alloc(&self, len: usize) -> Result<(usize, usize), MemoryError> {
        let mut core = self.lock();
        self.usable(core.state)?;
        let size = Arena::block_size(len);
        let offset = core.arena.alloc(size).ok_or(MemoryError::ArenaFull {
            tag: self.tag.clone(),
            requested: len,
            arena_bytes: core.arena.len(),
        })?;
        let fresh = self.runs(&core.arena.pin(offset, size));
        for (done, run) in fresh.iter().enumerate() {
            if let Err(error) = self.device.commit(*run) {
                for committed in &fresh[..done] {
                    self.release_logged(*committed);
                }
                core.arena.unpin(offset, size);
                core.arena.free(offset, size);
                return Err(self.device_error()(error));
            }
        }
        Ok((offset, size))
    }

    /// Free a block of an active region.
    ///
    /// # Errors
    /// [`MemoryError::TagPaused`] or [`MemoryError::TagBusy`] when the region is not active.
    pub(crate) fn free(&self, offset: usize, size: usize) -> Result<(), MemoryError> {
        let mut core = self.lock();
        self.usable(core.state)?;
        self.free_block(&mut core, offset, size);
        Ok(())
    }

    /// Free a block now if the region is active, else once it is active again.
    pub(crate) fn free_or_defer(&self, offset: usize, size: usize) {
        let mut core = self.lock();
        if core.state == RegionState::Active {
            self.free_block(&mut core, offset, size);
        } else {
            core.deferred_frees.push((offset, size));
        }
    }

    fn free_block(&self, core: &mut Core, offset: usize, size: usize) {
        for run in self.runs(&core.arena.unpin(offset, size)) {
            self.release_logged(run);
        }
        core.arena.free(offset, size);
    }

    fn release_logged(&self, run: AddressRange) {
        if let Err(error) = self.device.release(run) {
            tracing::error!(tag = %self.tag, %error, "cannot release device memory");
        }
    }

    /// Count a view of the region; it must be active.
    pub(crate) fn enter_view(&self) -> Result<(), MemoryError> {
        let mut core = self.lock();
        self.usable(core.state)?;
        core.views += 1;
        Ok(())
    }

    /// Record device work in flight on the region; a pause waits for it before copying.
    pub(crate) fn record_use(&self, fence: Fence) {
        let mut core = self.lock();
        core.fences.retain(|f| !matches!(f.is_done(), Ok(true)));
        core.fences.push(fence);
    }

    /// A view ended.
    pub(crate) fn exit_view(&self) {
        let mut core = self.lock();
        core.views -= 1;
        if core.views == 0 {
            self.idle.notify_all();
        }
    }

    /// Set the state and let deferred frees run once active again.
    fn settle(&self, state: RegionState) {
        let mut core = self.lock();
        core.state = state;
        if state == RegionState::Active {
            for (offset, size) in std::mem::take(&mut core.deferred_frees) {
                self.free_block(&mut core, offset, size);
            }
        }
    }

    /// Wait for every view to drop, back the committed memory up per the policy, verify it,
    /// then release it.
    pub(crate) fn pause(&self) -> Result<OffloadReport, MemoryError> {
        let (runs, fences) = {
            let mut core = self.lock();
            match core.state {
                RegionState::Active => {}
                RegionState::Paused => {
                    return Err(MemoryError::AlreadyPaused {
                        tag: self.tag.clone(),
                    });
                }
                state => {
                    return Err(MemoryError::TagBusy {
                        tag: self.tag.clone(),
                        state,
                    });
                }
            }
            core.state = RegionState::Pausing;
            while core.views > 0 {
                core = self.idle.wait(core).unwrap_or_else(PoisonError::into_inner);
            }
            (
                self.runs(&core.arena.committed()),
                std::mem::take(&mut core.fences),
            )
        };
        let started = Instant::now();
        let backed_up = fences
            .iter()
            .try_for_each(Fence::wait)
            .and_then(|()| self.device.memory_info())
            .map_err(self.device_error())
            .and_then(|info| Ok((info.free, self.back_up(&runs)?)));
        let (free_before, backup) = match backed_up {
            Ok(done) => done,
            Err(error) => {
                self.settle(RegionState::Active);
                return Err(error);
            }
        };
        let mut released = Vec::with_capacity(runs.len());
        let mut release_error = None;
        for run in &runs {
            match self.device.release(*run) {
                Ok(()) => released.push(*run),
                Err(error) => {
                    release_error = Some(self.device_error()(error));
                    break;
                }
            }
        }
        let bytes = released.iter().map(|r| r.len as u64).sum();
        {
            let mut core = self.lock();
            core.backup = backup;
            core.saved = runs;
            core.released = released;
        }
        self.settle(RegionState::Paused);
        if let Some(error) = release_error {
            return Err(error);
        }
        let free_after = self.device.memory_info().map_err(self.device_error())?.free;
        let seconds = started.elapsed().as_secs_f64();
        tracing::debug!(tag = %self.tag, policy = %self.policy, bytes, seconds, "paused");
        Ok(OffloadReport::new(
            self.tag.clone(),
            bytes,
            seconds,
            free_before,
            free_after,
        ))
    }

    /// Copy `runs` to the policy's backup and wait until it is complete.
    fn back_up(&self, runs: &[AddressRange]) -> Result<Backup, MemoryError> {
        match self.policy {
            BackupPolicy::None => Ok(Backup::Nothing),
            BackupPolicy::Host => {
                let total = runs.iter().map(|r| r.len).sum();
                let pool = &self.stores.pool;
                let mut buffer = pool.take(total).map_err(self.store_error())?;
                let copied = copy_out(self.device.as_ref(), runs, &mut buffer);
                match copied {
                    Ok(()) => Ok(Backup::Host(buffer)),
                    Err(error) => {
                        pool.put(buffer);
                        Err(self.device_error()(error))
                    }
                }
            }
            BackupPolicy::Disk => {
                let disk = self.disk()?;
                let backup = disk
                    .save(self.device.as_ref(), self.tag.name(), runs)
                    .map_err(self.store_error())?;
                Ok(Backup::Disk(backup))
            }
        }
    }

    fn disk(&self) -> Result<&DiskStore, MemoryError> {
        self.stores.disk.as_ref().ok_or(MemoryError::NoDiskStore {
            tag: self.tag.clone(),
        })
    }

    /// Check room for the region (need + margin), commit its memory at the same addresses and
    /// copy its bytes back; on any failure the region stays paused with its backup. With a host
    /// backup and `piece > 0`, commits and copies go piece by piece (see
    /// [`Region::restore_pipelined`]).
    pub(crate) fn resume(&self, margin: u64, piece: usize) -> Result<OffloadReport, MemoryError> {
        let started = Instant::now();
        let (released, saved, mut backup, free_before) = {
            let mut core = self.lock();
            match core.state {
                RegionState::Paused => {}
                RegionState::Active => {
                    return Err(MemoryError::NotPaused {
                        tag: self.tag.clone(),
                    });
                }
                state => {
                    return Err(MemoryError::TagBusy {
                        tag: self.tag.clone(),
                        state,
                    });
                }
            }
            let need: u64 = core.released.iter().map(|r| r.len as u64).sum();
            let free = self.device.memory_info().map_err(self.device_error())?.free;
            if free < need.saturating_add(margin) {
                return Err(MemoryError::InsufficientMemory {
                    tag: self.tag.clone(),
                    need,
                    free,
                    margin,
                });
            }
            core.state = RegionState::Resuming;
            let backup = std::mem::replace(&mut core.backup, Backup::Nothing);
            (core.released.clone(), core.saved.clone(), backup, free)
        };
        let restored = match &mut backup {
            Backup::Host(buffer) if piece > 0 => {
                self.restore_pipelined(&saved, released.len(), buffer, piece)
            }
            _ => {
                self.commit_all(&released)
                    .and_then(|()| match self.restore(&saved, &mut backup) {
                        Ok(()) => Ok(()),
                        Err(error) => {
                            released.iter().for_each(|run| self.release_logged(*run));
                            Err(error)
                        }
                    })
            }
        };
        if let Err(error) = restored {
            self.lock().backup = backup;
            self.settle(RegionState::Paused);
            return Err(error);
        }
        self.discard(backup);
        {
            let mut core = self.lock();
            core.saved.clear();
            core.released.clear();
        }
        self.settle(RegionState::Active);
        let bytes = released.iter().map(|r| r.len as u64).sum();
        let free_after = self.device.memory_info().map_err(self.device_error())?.free;
        let seconds = started.elapsed().as_secs_f64();
        tracing::debug!(tag = %self.tag, policy = %self.policy, bytes, seconds, "resumed");
        Ok(OffloadReport::new(
            self.tag.clone(),
            bytes,
            seconds,
            free_before,
            free_after,
        ))
    }

    /// Commit every run, or none.
    fn commit_all(&self, runs: &[AddressRange]) -> Result<(), MemoryError> {
        for (done, run) in runs.iter().enumerate() {
            if let Err(error) = self.device.commit(*run) {
                runs[..done].iter().for_each(|r| self.release_logged(*r));
                return Err(self.device_error()(error));
            }
        }
        Ok(())
    }

    /// Commit `runs` and copy `buffer` (laid out by [`copy_out`]) back into them in pieces of
    /// `piece` bytes (rounded up to the granularity), so that each piece's copy runs while the
    /// next piece commits; waits for every copy. Only the first `released` runs were released
    /// by the pause, and only they are committed. On failure the pieces committed here are
    /// released again.
    fn restore_pipelined(
        &self,
        runs: &[AddressRange],
        released: usize,
        buffer: &mut HostBuffer,
        piece: usize,
    ) -> Result<(), MemoryError> {
        let piece = piece.next_multiple_of(self.device.granularity());
        let mut committed = Vec::new();
        let mut fences = Vec::new();
        let queued = queue_pipelined(
            self.device.as_ref(),
            runs,
            released,
            buffer,
            piece,
            &mut committed,
            &mut fences,
        );
        let waited = fences
            .iter()
            .try_for_each(Fence::wait)
            .and_then(|()| buffer.wait());
        queued.and(waited).map_err(|error| {
            committed.iter().for_each(|part| self.release_logged(*part));
            self.device_error()(error)
        })
    }

    fn restore(&self, runs: &[AddressRange], backup: &mut Backup) -> Result<(), MemoryError> {
        match backup {
            Backup::Nothing => Ok(()),
            Backup::Host(buffer) => {
                copy_in(self.device.as_ref(), runs, buffer).map_err(self.device_error())
            }
            Backup::Disk(disk_backup) => self
                .disk()?
                .load(self.device.as_ref(), disk_backup, runs)
                .map_err(self.store_error()),
        }
    }

    /// Drop a backup that has been restored: host buffers go back to the pool, files are
    /// removed.
    fn discard(&self, backup: Backup) {
        match backup {
            Backup::Nothing => {}
            Backup::Host(buffer) => self.stores.pool.put(buffer),
            Backup::Disk(disk_backup) => {
                if let Ok(disk) = self.disk()
                    && let Err(error) = disk.remove(disk_backup)
                {
                    tracing::error!(tag = %self.tag, %error, "cannot remove offload files");
                }
            }
        }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        let backup = std::mem::replace(&mut self.lock().backup, Backup::Nothing);
        self.discard(backup);
        if let Err(error) = self.device.unreserve(self.range) {
            tracing::error!(tag = %self.tag, %error, "cannot unreserve a region's arena");
        }
    }
}

/// Copy `runs` end to end into `buffer` and wait for every copy.
fn copy_out(
    device: &dyn Device,
    runs: &[AddressRange],
    buffer: &mut HostBuffer,
) -> Result<(), DeviceError> {
    let mut fences: Vec<Fence> = Vec::with_capacity(runs.len());
    let mut offset = 0;
    for run in runs {
        fences.push(device.copy_to_host(*run, buffer, offset)?);
        offset += run.len;
    }
    fences.iter().try_for_each(Fence::wait)?;
    buffer.wait()
}

/// Commit (the first `released` runs) and queue the copy back of `runs` piece by piece,
/// recording what was committed and the copies' fences as it goes.
fn queue_pipelined(
    device: &dyn Device,
    runs: &[AddressRange],
    released: usize,
    buffer: &mut HostBuffer,
    piece: usize,
    committed: &mut Vec<AddressRange>,
    fences: &mut Vec<Fence>,
) -> Result<(), DeviceError> {
    let mut offset = 0;
    for (index, run) in runs.iter().enumerate() {
        let mut done = 0;
        while done < run.len {
            let part = run.slice(done, piece.min(run.len - done))?;
            if index < released {
                device.commit(part)?;
                committed.push(part);
            }
            fences.push(device.copy_from_host(buffer, offset + done, part)?);
            done += part.len;
        }
        offset += run.len;
    }
    Ok(())
}

/// Copy `buffer`, laid out by [`copy_out`], back into `runs` and wait for every copy.
fn copy_in(
    device: &dyn Device,
    runs: &[AddressRange],
    buffer: &mut HostBuffer,
) -> Result<(), DeviceError> {
    let mut fences: Vec<Fence> = Vec::with_capacity(runs.len());
    let mut offset = 0;
    for run in runs {
        fences.push(device.copy_from_host(buffer, offset, *run)?);
        offset += run.len;
    }
    fences.iter().try_for_each(Fence::wait)?;
    buffer.wait()
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use crate::device::{DeviceKind, MemoryInfo, open_test_device};
    use crate::memory::{Buffer, ManagerSettings, MemoryManager};

    use super::*;

    const MIB: usize = 1 << 20;

    /// The test device (see [`open_test_device`]) whose `fail_in`-th commit from now fails as
    /// out of memory (0: none fails).
    #[derive(Debug)]
    struct FailingCommit {
        inner: Arc<dyn Device>,
        fail_in: AtomicUsize,
    }

    impl Device for FailingCommit {
        fn kind(&self) -> DeviceKind {
            self.inner.kind()
        }
        fn name(&self) -> String {
            self.inner.name()
        }
        fn granularity(&self) -> usize {
            self.inner.granularity()
        }
        fn reserve(&self, len: usize) -> Result<AddressRange, DeviceError> {
            self.inner.reserve(len)
        }
        fn unreserve(&self, range: AddressRange) -> Result<(), DeviceError> {
            self.inner.unreserve(range)
        }
        fn commit(&self, range: AddressRange) -> Result<(), DeviceError> {
            let left = self.fail_in.load(Ordering::SeqCst);
            if left > 0 {
                self.fail_in.store(left - 1, Ordering::SeqCst);
                if left == 1 {
                    return Err(DeviceError::OutOfMemory {
                        device: self.kind(),
                        requested: range.len as u64,
                        free: 0,
                    });
                }
            }
            self.inner.commit(range)
        }
        fn release(&self, range: AddressRange) -> Result<(), DeviceError> {
            self.inner.release(range)
        }
        fn memory_info(&self) -> Result<MemoryInfo, DeviceError> {
            self.inner.memory_info()
        }
        fn alloc_host(&self, len: usize) -> Result<HostBuffer, DeviceError> {
            self.inner.alloc_host(len)
        }
        fn copy_to_host(
            &self,
            src: AddressRange,
            dst: &mut HostBuffer,
            offset: usize,
        ) -> Result<Fence, DeviceError> {
            self.inner.copy_to_host(src, dst, offset)
        }
        fn copy_from_host(
            &self,
            src: &mut HostBuffer,
            offset: usize,
            dst: AddressRange,
        ) -> Result<Fence, DeviceError> {
            self.inner.copy_from_host(src, offset, dst)
        }
        fn read(&self, src: AddressRange, dst: &mut [u8]) -> Result<(), DeviceError> {
            self.inner.read(src, dst)
        }
        fn write(&self, src: &[u8], dst: AddressRange) -> Result<(), DeviceError> {
            self.inner.write(src, dst)
        }
    }

    /// A manager resuming in pieces of `piece` bytes on a [`FailingCommit`] test device of
    /// `capacity` bytes.
    fn pipelined(capacity: usize, piece: usize) -> (Arc<FailingCommit>, MemoryManager) {
        let device = Arc::new(FailingCommit {
            inner: open_test_device(capacity as u64).unwrap().shared(),
            fail_in: AtomicUsize::new(0),
        });
        let settings = ManagerSettings {
            margin_bytes: 0,
            disk: None,
        };
        let memory = MemoryManager::new(Arc::clone(&device) as Arc<dyn Device>, settings)
            .unwrap()
            .with_resume_pieces(piece);
        (device, memory)
    }

    /// Buffers of several sizes in a host-backed tag, filled with seeded random bytes; their
    /// blocks commit as more than one run.
    fn filled(memory: &MemoryManager, tag: &MemoryTag, seed: u64) -> Vec<(Buffer, Vec<u8>)> {
        memory
            .create_region(tag.clone(), BackupPolicy::Host, 64 * MIB)
            .unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        [5 * MIB + 3, 1, 11 * MIB + 17, 300_001]
            .iter()
            .map(|&len| {
                let mut buffer = memory.alloc(tag, len).unwrap();
                let mut data = vec![0u8; len];
                rng.fill_bytes(&mut data);
                buffer.write(0, &data).unwrap();
                (buffer, data)
            })
            .collect()
    }

    fn first_difference_in(buffers: &[(Buffer, Vec<u8>)]) -> Option<(usize, usize)> {
        buffers
            .iter()
            .enumerate()
            .find_map(|(index, (buffer, data))| {
                let mut back = vec![0u8; buffer.len()];
                buffer.read(0, &mut back).unwrap();
                back.iter()
                    .zip(data)
                    .position(|(x, y)| x != y)
                    .map(|at| (index, at))
            })
    }

    #[test]
    fn a_pipelined_resume_restores_every_byte_at_the_same_addresses() {
        let (_, memory) = pipelined(128 * MIB, 3 * MIB);
        let tag = MemoryTag::Named("pipelined".to_string());
        let buffers = filled(&memory, &tag, 31);
        let addresses: Vec<u64> = buffers.iter().map(|(b, _)| b.address()).collect();
        for cycle in 0..3 {
            let paused = memory.pause(&tag).unwrap();
            assert_eq!(paused.bytes, memory.region_bytes(&tag).unwrap());
            assert!(paused.free_after > paused.free_before, "cycle {cycle}");
            let resumed = memory.resume(&tag).unwrap();
            assert_eq!(resumed.bytes, paused.bytes, "cycle {cycle}");
            let diff = first_difference_in(&buffers);
            assert_eq!(diff, None, "cycle {cycle}: (buffer, byte) differing first");
        }
        let now: Vec<u64> = buffers.iter().map(|(b, _)| b.address()).collect();
        assert_eq!(now, addresses);
    }

    #[test]
    fn a_pipelined_resume_that_fails_half_way_releases_its_pieces_and_stays_paused() {
        let (device, memory) = pipelined(128 * MIB, 2 * MIB);
        let tag = MemoryTag::Named("half-way".to_string());
        let buffers = filled(&memory, &tag, 37);
        memory.pause(&tag).unwrap();
        let free_paused = device.memory_info().unwrap().free;
        device.fail_in.store(3, Ordering::SeqCst);
        let error = memory.resume(&tag).unwrap_err();
        assert!(
            matches!(
                &error,
                MemoryError::Device {
                    source: DeviceError::OutOfMemory { .. },
                    ..
                }
            ),
            "{error}"
        );
        assert_eq!(memory.state(&tag).unwrap(), RegionState::Paused);
        assert_eq!(
            device.memory_info().unwrap().free,
            free_paused,
            "the pieces committed before the failure are released again"
        );
        memory.resume(&tag).unwrap();
        let diff = first_difference_in(&buffers);
        assert_eq!(diff, None, "(buffer, byte) differing first after the retry");
    }
}
