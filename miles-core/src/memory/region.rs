//! One region: a tag's arena, its blocks, its state machine and its backup.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::ThreadId;
use std::time::Instant;

use crate::device::{AddressRange, Device, DeviceError, Fence, HostBuffer};
use crate::store::{DiskBackup, DiskStore, HostPool, StoreError};

use super::arena::Arena;
pub(crate) use super::staged::Staging;
use super::staged::{Staged, Write};
use super::{BackupPolicy, MemoryError, MemoryTag, OffloadReport, RegionState};

/// The backup stores a region may use, and what the manager's regions share.
#[derive(Debug)]
pub(crate) struct Stores {
    pub(crate) pool: Arc<HostPool>,
    pub(crate) disk: Option<DiskStore>,
    /// Regions of the manager resuming now.
    pub(crate) resuming: AtomicUsize,
    /// The host budget of writes behind pauses to disk.
    pub(crate) staging: Staging,
}

/// One count in [`Stores::resuming`] while it lives.
struct Resuming<'a>(&'a AtomicUsize);

impl<'a> Resuming<'a> {
    fn start(count: &'a AtomicUsize) -> Resuming<'a> {
        count.fetch_add(1, Ordering::SeqCst);
        Resuming(count)
    }
}

impl Drop for Resuming<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
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
    /// Live views by the thread that made them, with their count.
    views: Vec<(ThreadId, usize)>,
    /// Device work in flight on the region's buffers (kernels, copies), recorded by its users.
    fences: Vec<Fence>,
    arena: Arena,
    backup: Backup,
    /// Committed runs saved by the last pause (the backup's layout, end to end), and the
    /// ranges inside them actually released, in address order.
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
    /// A host copy being written to disk behind the pause.
    Staged(Staged),
}

/// How often [`Region::finish_write`] looks at a running write.
const WRITE_POLL: std::time::Duration = std::time::Duration::from_millis(5);

/// What a pause's backup left: the backup, the ranges released, the error that stopped it.
type BackedUp = (Backup, Vec<AddressRange>, Option<MemoryError>);

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
                views: Vec::new(),
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
        let size = Arena::block_size(len).ok_or_else(|| MemoryError::SizeOverflow {
            tag: self.tag.clone(),
            what: "buffer length",
            value: len as u64,
        })?;
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

    /// Count a view of the region made by the calling thread; it must be active.
    pub(crate) fn enter_view(&self) -> Result<ThreadId, MemoryError> {
        let mut core = self.lock();
        self.usable(core.state)?;
        let thread = std::thread::current().id();
        match core.views.iter_mut().find(|(t, _)| *t == thread) {
            Some((_, count)) => *count += 1,
            None => core.views.push((thread, 1)),
        }
        Ok(thread)
    }

    /// Record device work in flight on the region; a pause waits for it before copying.
    pub(crate) fn record_use(&self, fence: Fence) {
        let mut core = self.lock();
        core.fences.retain(|f| !matches!(f.is_done(), Ok(true)));
        core.fences.push(fence);
    }

    /// A view that `thread` made ended.
    pub(crate) fn exit_view(&self, thread: ThreadId) {
        let mut core = self.lock();
        if let Some(at) = core.views.iter().position(|(t, _)| *t == thread) {
            core.views[at].1 -= 1;
            if core.views[at].1 == 0 {
                core.views.swap_remove(at);
            }
        }
        if core.views.is_empty() {
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

    /// Wait for every view to drop (a view the calling thread holds is an error: it could never
    /// drop while this thread waits), back the committed memory up per the policy, then release
    /// it. A host backup releases each part of the memory as soon as its own copy is done, so
    /// that the driver's scrub of the freed memory overlaps the rest of the copy instead of the
    /// next resume; while another region of the manager resumes, whose copy in the scrub would
    /// slow, the rest is released once the whole copy is done (`bench/RESULTS.md`, round 13).
    /// A disk backup is complete before anything is released.
    ///
    /// On an error before anything is released the tag stays active with its bytes; after a
    /// part is released it is paused with what was released (every released byte is in the
    /// backup), and a resume brings that back.
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
            let thread = std::thread::current().id();
            if let Some(&(_, views)) = core.views.iter().find(|(t, _)| *t == thread) {
                return Err(MemoryError::ViewHeld {
                    tag: self.tag.clone(),
                    views,
                });
            }
            core.state = RegionState::Pausing;
            while !core.views.is_empty() {
                core = self.idle.wait(core).unwrap_or_else(PoisonError::into_inner);
            }
            (
                self.runs(&core.arena.committed()),
                std::mem::take(&mut core.fences),
            )
        };
        let free_before = self.device.memory_info().map_err(self.device_error());
        let started = Instant::now();
        let backed_up = free_before.and_then(|info| {
            fences
                .iter()
                .try_for_each(Fence::wait)
                .map_err(self.device_error())?;
            Ok((info.free, self.back_up(&runs)?))
        });
        let (free_before, (backup, released, failure)) = match backed_up {
            Ok(done) => done,
            Err(error) => {
                self.settle(RegionState::Active);
                return Err(error);
            }
        };
        let bytes = released.iter().map(|r| r.len as u64).sum();
        {
            let mut core = self.lock();
            core.backup = backup;
            core.saved = runs;
            core.released = released;
        }
        self.settle(RegionState::Paused);
        let seconds = started.elapsed().as_secs_f64();
        if let Some(error) = failure {
            return Err(error);
        }
        let free_after = self.device.memory_info().map_err(self.device_error())?.free;
        tracing::debug!(tag = %self.tag, policy = %self.policy, bytes, seconds, "paused");
        Ok(OffloadReport::new(
            self.tag.clone(),
            self.policy,
            bytes,
            seconds,
            free_before,
            free_after,
        ))
    }

    /// Back `runs` up per the policy and release them: the backup, the ranges released (in
    /// address order) and the error that stopped the releases, if one did. An error before
    /// anything was released is returned as such, with no backup kept.
    fn back_up(&self, runs: &[AddressRange]) -> Result<BackedUp, MemoryError> {
        if runs.is_empty() {
            // Nothing committed: no host buffer is taken from the pool (the smallest free one
            // would be held for nothing while paused) and no file is written.
            return Ok((Backup::Nothing, Vec::new(), None));
        }
        let backup = match self.policy {
            BackupPolicy::None => Backup::Nothing,
            BackupPolicy::Host => {
                let total = runs.iter().map(|r| r.len).sum();
                let pool = &self.stores.pool;
                let mut buffer = pool.take(total).map_err(self.store_error())?;
                let early = || self.stores.resuming.load(Ordering::SeqCst) == 0;
                let (released, copied) =
                    copy_out_releasing(self.device.as_ref(), runs, &mut buffer, early);
                return match copied {
                    Ok(()) => Ok((Backup::Host(buffer), released, None)),
                    Err(error) if released.is_empty() => {
                        pool.put(buffer);
                        Err(self.device_error()(error))
                    }
                    Err(error) => Ok((
                        Backup::Host(buffer),
                        released,
                        Some(self.device_error()(error)),
                    )),
                };
            }
            BackupPolicy::Disk => {
                let disk = self.disk()?;
                if let Some(buffer) = self.staging_buffer(runs) {
                    return self.copy_out_then_write(runs, buffer);
                }
                let backup = disk
                    .save(self.device.as_ref(), &self.tag, runs)
                    .map_err(self.store_error())?;
                Backup::Disk(backup)
            }
        };
        let mut released = Vec::with_capacity(runs.len());
        for run in runs {
            if let Err(error) = self.device.release(*run) {
                return Ok((backup, released, Some(self.device_error()(error))));
            }
            released.push(*run);
        }
        Ok((backup, released, None))
    }

    /// A host buffer for `runs`' bytes within the host budget, or `None` (the pause then
    /// writes to disk in line) when the budget is off, too small or the host has no memory.
    fn staging_buffer(&self, runs: &[AddressRange]) -> Option<HostBuffer> {
        let staging = &self.stores.staging;
        let total: usize = runs.iter().map(|r| r.len).sum();
        if !staging.enabled() {
            return None;
        }
        if !staging.hold(total as u64) {
            if staging.first_shortfall() {
                tracing::info!(
                    tag = %self.tag,
                    bytes = total,
                    budget = staging.budget(),
                    "the host budget (--offload-train-host-budget-gb) cannot hold this tag's copy next to the others: it and any other that does not fit go to disk in line, at disk speed"
                );
            }
            return None;
        }
        match self.stores.pool.take(total) {
            Ok(buffer) => Some(buffer),
            Err(error) => {
                staging.give_back(total as u64);
                tracing::warn!(tag = %self.tag, %error, "no host memory for the copy: the pause writes to disk in line");
                None
            }
        }
    }

    /// Copies `runs` into `buffer`, releasing them as their copies land (as a host backup
    /// does), then starts the write of the copy to disk on a thread of its own.
    fn copy_out_then_write(
        &self,
        runs: &[AddressRange],
        mut buffer: HostBuffer,
    ) -> Result<BackedUp, MemoryError> {
        let bytes = runs.iter().map(|r| r.len as u64).sum();
        let early = || self.stores.resuming.load(Ordering::SeqCst) == 0;
        let (released, copied) = copy_out_releasing(self.device.as_ref(), runs, &mut buffer, early);
        let host = Arc::new(buffer);
        let failure = copied.err().map(self.device_error());
        // A copy that failed part way leaves the released parts' bytes in the buffer: they
        // come back from there, and nothing goes to disk.
        let write = if failure.is_some() {
            Write::Absent
        } else {
            self.write_behind(&host, runs)
        };
        let staged = Staged { host, bytes, write };
        if released.is_empty()
            && let Some(error) = failure
        {
            self.discard(Backup::Staged(staged));
            return Err(error);
        }
        Ok((Backup::Staged(staged), released, failure))
    }

    /// Starts writing `host` (the bytes of `runs` end to end) to the disk store.
    fn write_behind(&self, host: &Arc<HostBuffer>, runs: &[AddressRange]) -> Write {
        let stop = Arc::new(AtomicBool::new(false));
        let (stores, tag, runs) = (Arc::clone(&self.stores), self.tag.clone(), runs.to_vec());
        let (copy, stopping) = (Arc::clone(host), Arc::clone(&stop));
        let spawned = std::thread::Builder::new()
            .name("miles-write-behind".to_string())
            .spawn(move || {
                let Some(disk) = stores.disk.as_ref() else {
                    return Ok(None);
                };
                disk.save_host(&tag, copy.as_slice()?, &runs, &stopping)
            });
        match spawned {
            Ok(thread) => Write::Running { stop, thread },
            Err(source) => Write::Failed(StoreError::Io {
                action: "start the background write of".to_string(),
                path: self.tag.name().into(),
                source,
            }),
        }
    }

    /// Waits for the disk write behind this region's pause, if one runs, and reports its
    /// failure once ([`MemoryError::BackgroundWrite`]; the region keeps its host copy).
    pub(crate) fn finish_write(&self) -> Result<(), MemoryError> {
        // Polled, not joined under the lock: the lock is held only for a look at a time, so
        // the region's other users do not wait for the disk.
        loop {
            {
                let mut core = self.lock();
                let Backup::Staged(staged) = &mut core.backup else {
                    return Ok(());
                };
                staged.write.poll();
                if !matches!(staged.write, Write::Running { .. }) {
                    return self.report_write(staged);
                }
            }
            std::thread::sleep(WRITE_POLL);
        }
    }

    /// Reports, once, a disk write behind this region's pause that has failed by now
    /// ([`MemoryError::BackgroundWrite`]); a running one is left running.
    pub(crate) fn check_write(&self) -> Result<(), MemoryError> {
        let mut core = self.lock();
        let Backup::Staged(staged) = &mut core.backup else {
            return Ok(());
        };
        staged.write.poll();
        self.report_write(staged)
    }

    /// Asks the disk write behind this region's pause to stop, without waiting: the region is
    /// about to resume from its host copy, so the writes of several regions wind down together.
    pub(crate) fn request_write_stop(&self) {
        if let Backup::Staged(staged) = &self.lock().backup {
            staged.write.request_stop();
        }
    }

    fn report_write(&self, staged: &mut Staged) -> Result<(), MemoryError> {
        match staged.write.take_failure() {
            Some(source) => Err(MemoryError::BackgroundWrite {
                tag: self.tag.clone(),
                source: Box::new(source),
            }),
            None => Ok(()),
        }
    }

    fn disk(&self) -> Result<&DiskStore, MemoryError> {
        self.stores.disk.as_ref().ok_or(MemoryError::NoDiskStore {
            tag: self.tag.clone(),
        })
    }

    /// The host address where the host backup of `range` (inside one range the pause backed
    /// up) begins, while the region is paused with a host backup; `None` otherwise. The bytes
    /// stay there until the region resumes.
    pub(crate) fn host_backup_address(&self, range: AddressRange) -> Option<usize> {
        let core = self.lock();
        let Backup::Host(buffer) = &core.backup else {
            return None;
        };
        if core.state != RegionState::Paused {
            return None;
        }
        let offset = backup_offset(&core.saved, range).ok()?;
        let bytes = buffer.as_slice().ok()?;
        (offset + range.len <= bytes.len()).then(|| bytes.as_ptr() as usize + offset)
    }

    /// Check room for the region (need + margin), commit the memory the pause released at the
    /// same addresses and copy its bytes back; on any failure the region stays paused with its
    /// backup.
    pub(crate) fn resume(&self, margin: u64) -> Result<OffloadReport, MemoryError> {
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
            if let Backup::Staged(staged) = &mut core.backup {
                staged.write.poll();
                self.report_write(staged)?;
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
        let resuming = Resuming::start(&self.stores.resuming);
        let restored = self.commit_all(&released).and_then(|()| {
            self.restore(&saved, &released, &mut backup)
                .inspect_err(|_| released.iter().for_each(|run| self.release_logged(*run)))
        });
        drop(resuming);
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
        let seconds = started.elapsed().as_secs_f64();
        let bytes = released.iter().map(|r| r.len as u64).sum();
        let free_after = self.device.memory_info().map_err(self.device_error())?.free;
        tracing::debug!(tag = %self.tag, policy = %self.policy, bytes, seconds, "resumed");
        Ok(OffloadReport::new(
            self.tag.clone(),
            self.policy,
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

    /// Bring the bytes of the `released` ranges back from the backup of `saved` (the ranges
    /// still resident kept theirs).
    fn restore(
        &self,
        saved: &[AddressRange],
        released: &[AddressRange],
        backup: &mut Backup,
    ) -> Result<(), MemoryError> {
        match backup {
            Backup::Nothing => Ok(()),
            Backup::Host(buffer) => {
                copy_in(self.device.as_ref(), saved, released, buffer).map_err(self.device_error())
            }
            Backup::Disk(disk_backup) => self
                .disk()?
                .load(self.device.as_ref(), disk_backup, saved)
                .map_err(self.store_error()),
            Backup::Staged(staged) => {
                // The host copy is read here, so the write stops (removing what it wrote) or
                // has ended; a failure then loses nothing: the bytes come back from the copy.
                staged.write.stop();
                if let Some(error) = staged.write.take_failure() {
                    tracing::warn!(tag = %self.tag, %error, "the background disk write failed; the tag resumes from its host copy");
                }
                let buffer = Arc::get_mut(&mut staged.host)
                    .ok_or_else(|| self.store_error()(StoreError::Stopped))?;
                copy_in(self.device.as_ref(), saved, released, buffer).map_err(self.device_error())
            }
        }
    }

    /// Drop a backup that has been restored: host buffers go back to the pool, files are
    /// removed.
    fn discard(&self, backup: Backup) {
        match backup {
            Backup::Nothing => {}
            Backup::Host(buffer) => self.stores.pool.put(buffer),
            Backup::Disk(disk_backup) => self.remove_files(disk_backup),
            Backup::Staged(mut staged) => {
                staged.write.stop();
                if let Write::Written(disk_backup) =
                    std::mem::replace(&mut staged.write, Write::Absent)
                {
                    self.remove_files(disk_backup);
                }
                let host = Arc::try_unwrap(staged.host);
                debug_assert!(host.is_ok(), "the write's thread has ended");
                if let Ok(buffer) = host {
                    self.stores.pool.put(buffer);
                }
                self.stores.staging.give_back(staged.bytes);
            }
        }
    }

    fn remove_files(&self, disk_backup: DiskBackup) {
        if let Ok(disk) = self.disk()
            && let Err(error) = disk.remove(disk_backup)
        {
            tracing::error!(tag = %self.tag, %error, "cannot remove offload files");
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

/// Copy `runs` end to end into `buffer` and release each of their parts (as
/// [`Device::release_parts`] cuts them) once its own copy is done, for as long as `early()`,
/// asked before each release, says so; the parts left are released, in order, once every copy
/// is done. Returns the parts
/// released, in order, and the first error; after an error nothing more is released, and every
/// queued copy has been waited for either way.
fn copy_out_releasing(
    device: &dyn Device,
    runs: &[AddressRange],
    buffer: &mut HostBuffer,
    early: impl Fn() -> bool,
) -> (Vec<AddressRange>, Result<(), DeviceError>) {
    let mut queued = Vec::new();
    let mut released = Vec::new();
    let mut release = |part: AddressRange| -> Result<(), DeviceError> {
        device.release(part)?;
        released.push(part);
        Ok(())
    };
    let copied = queue_copies_out(device, runs, buffer, &mut queued).and_then(|()| {
        let mut early_parts = 0;
        for (part, fence) in &queued {
            fence.wait()?;
            if !early() {
                break;
            }
            release(*part)?;
            early_parts += 1;
        }
        let late = &queued[early_parts..];
        late.iter().try_for_each(|(_, fence)| fence.wait())?;
        late.iter().try_for_each(|(part, _)| release(*part))
    });
    let waited = buffer.wait();
    (released, copied.and(waited))
}

/// Queue the copy of every part of `runs` into `buffer`, end to end, recording each part with
/// its copy's fence.
fn queue_copies_out(
    device: &dyn Device,
    runs: &[AddressRange],
    buffer: &mut HostBuffer,
    queued: &mut Vec<(AddressRange, Fence)>,
) -> Result<(), DeviceError> {
    let mut offset = 0;
    for run in runs {
        for part in device.release_parts(*run) {
            let at = offset + (part.start - run.start) as usize;
            queued.push((part, device.copy_to_host(part, buffer, at)?));
        }
        offset += run.len;
    }
    Ok(())
}

/// Where the bytes of `part` (inside one of `saved`) lie in a backup that holds `saved` end to
/// end.
fn backup_offset(saved: &[AddressRange], part: AddressRange) -> Result<usize, DeviceError> {
    let mut offset = 0;
    for run in saved {
        if run.start <= part.start && part.end() <= run.end() {
            return Ok(offset + (part.start - run.start) as usize);
        }
        offset += run.len;
    }
    Err(DeviceError::BadRange {
        start: part.start,
        len: part.len,
        expected: "inside a range the pause backed up",
    })
}

/// Copy the bytes of the `released` ranges back from `buffer` (which holds `saved` end to end)
/// and wait for every copy.
fn copy_in(
    device: &dyn Device,
    saved: &[AddressRange],
    released: &[AddressRange],
    buffer: &mut HostBuffer,
) -> Result<(), DeviceError> {
    let mut fences: Vec<Fence> = Vec::with_capacity(released.len());
    for range in released {
        let offset = backup_offset(saved, *range)?;
        fences.push(device.copy_from_host(buffer, offset, *range)?);
    }
    fences.iter().try_for_each(Fence::wait)?;
    buffer.wait()
}

#[cfg(test)]
mod tests;
