//! The disk store: a paused region's bytes in one file per rank and tag, written and read in
//! chunks through a pipeline of staging buffers, each chunk checksummed with CRC32C, described by
//! a manifest written last and atomically.
//!
//! Pause: the calling thread copies chunk k+1 from the device into a staging buffer and
//! checksums it while writer threads write chunks k and k-1 (O_DIRECT where the filesystem
//! allows). Resume (`disk/load.rs`): reader threads keep reads of the file in flight while the
//! calling thread verifies what has landed; on a device the host addresses (the CPU device) the
//! bytes are read straight into device memory, elsewhere through staging buffers.
//!
//! The files live in `<dir>/offload/rank-<N>/<tag directory>/` (see [`RankDir`]), each opened
//! relative to its directory's handle without following links, created `0600`.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Barrier, Mutex, PoisonError};

use rustix::fs::{AtFlags, FileType, Mode, OFlags};
use rustix::io::Errno;
use serde::{Deserialize, Serialize};

use crate::device::{AddressRange, Device, HostBuffer};
use crate::memory::MemoryTag;

use self::load::{Destination, Load};
use super::error::Unsafe;
use super::rank_dir::{
    DATA_FILE, MANIFEST_FILE, MANIFEST_TMP, RankDir, errno_error, io_error, read_bounded, refused,
};
use super::{HostPool, StoreError};

mod load;

/// O_DIRECT needs file offsets, lengths and buffers aligned to the logical block; 4096 covers
/// every common filesystem.
const DIRECT_ALIGN: usize = 4096;

/// Threads writing chunks at once during a pause: two requests in flight keep a virtio or NVMe
/// queue busier than one.
const WRITE_THREADS: usize = 2;

/// A chunk is written in pieces of this many bytes, a stop checked before each, so a stopped
/// write ends within one piece per writer (a multiple of [`DIRECT_ALIGN`]).
const WRITE_PIECE: usize = 4 << 20;

/// Staging buffers of a pause: one per writer, one being filled, one spare.
const PIPELINE_DEPTH: usize = WRITE_THREADS + 2;

static BUFFERED_WARNED: AtomicBool = AtomicBool::new(false);

/// Where and how a rank's paused regions go to disk.
#[derive(Debug)]
pub struct DiskStore {
    rank_dir: Arc<RankDir>,
    /// Appended to this store's tag directory names (see [`RankDir`]).
    suffix: String,
    chunk_bytes: usize,
    pool: Arc<HostPool>,
    /// The tag directories holding this store's backups, each with whether its last load
    /// failed (its files are kept then); the store removes the others when it drops.
    backups: Mutex<HashMap<String, bool>>,
    /// Sends the names of moved-away directories to the thread that unlinks them.
    janitor: Mutex<Option<mpsc::Sender<String>>>,
    janitor_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    fail_write_at: Option<usize>,
    /// A writer meets this barrier twice before chunk `.0` (tests of a write cut short).
    hold_write_at: Option<(usize, Arc<Barrier>)>,
    fail_read_at: Option<usize>,
}

/// A region saved to disk: its directory and manifest.
#[derive(Debug)]
pub struct DiskBackup {
    /// The tag directory's name in the rank directory (opened again at each load, relative to
    /// the rank directory's handle: holding a handle per backup would take a descriptor per
    /// streamed optimizer bucket).
    name: String,
    path: PathBuf,
    manifest: Manifest,
    /// Bytes of the manifest as written: a larger file on disk is not it.
    manifest_len: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Manifest {
    tag: String,
    total_bytes: u64,
    chunk_bytes: usize,
    /// Device ranges saved, in stream order: (start address, length).
    runs: Vec<(u64, usize)>,
    /// CRC32C of each chunk.
    crc32c: Vec<u32>,
}

impl DiskBackup {
    /// Bytes saved.
    pub fn bytes(&self) -> u64 {
        self.manifest.total_bytes
    }

    /// The directory holding the data file and the manifest.
    pub fn dir(&self) -> &Path {
        &self.path
    }
}

/// A staging buffer back from a writer, with the outcome of its write.
type ChunkDone = (HostBuffer, Result<(), StoreError>);

/// The data file a save writes.
#[derive(Clone, Copy)]
struct Target<'a> {
    file: &'a File,
    path: &'a Path,
    /// Opened with `O_DIRECT`: writes are padded to [`DIRECT_ALIGN`].
    direct: bool,
}

/// Where the bytes of a save come from: the device ranges themselves, or a host copy of them
/// laid end to end.
#[derive(Clone, Copy)]
enum Source<'a> {
    Device(&'a dyn Device),
    Host(&'a [u8]),
}

impl Source<'_> {
    /// Fill `buffer[..len]` with the bytes `offset..offset + len` of `runs` laid end to end.
    fn stage(
        self,
        runs: &[AddressRange],
        offset: u64,
        len: usize,
        buffer: &mut HostBuffer,
    ) -> Result<(), StoreError> {
        match self {
            Source::Device(device) => {
                for (range, at) in pieces(runs, offset, len) {
                    device.copy_to_host(range, buffer, at)?.wait()?;
                }
            }
            Source::Host(bytes) => {
                let at = offset as usize;
                buffer.as_mut_slice()?[..len].copy_from_slice(&bytes[at..at + len]);
            }
        }
        Ok(())
    }
}

impl DiskStore {
    /// A store writing under `dir/offload/rank-<rank>/<tag directory>/` in chunks of
    /// `chunk_bytes`, staging through buffers of `pool`. The rank directory is opened, locked
    /// and cleaned of an earlier job's leftovers as [`RankDir::open`] says; the stores of one
    /// process share it, each writing its own tag directories (`params`, `params.1`, ...).
    /// When the store drops, it removes the backups it wrote that are still there, but those
    /// whose last load failed.
    ///
    /// # Errors
    /// [`StoreError::ChunkSize`] for a chunk size that is zero or not a multiple of 4096;
    /// [`RankDir::open`]'s errors.
    pub fn new(
        dir: &Path,
        rank: usize,
        chunk_bytes: usize,
        pool: Arc<HostPool>,
    ) -> Result<DiskStore, StoreError> {
        if chunk_bytes == 0 || !chunk_bytes.is_multiple_of(DIRECT_ALIGN) {
            return Err(StoreError::ChunkSize { chunk_bytes });
        }
        let rank_dir = RankDir::open(dir, rank)?;
        let suffix = rank_dir.store_suffix();
        let (janitor, trash) = mpsc::channel::<String>();
        let janitor_dir = Arc::clone(&rank_dir);
        let janitor_thread = std::thread::Builder::new()
            .name("miles-offload-janitor".to_string())
            .spawn(move || {
                trash
                    .iter()
                    .for_each(|name| remove_tree(&janitor_dir, &name))
            });
        let (janitor, janitor_thread) = match janitor_thread {
            Ok(handle) => (Some(janitor), Some(handle)),
            Err(error) => {
                tracing::warn!(%error, "no janitor thread: offload files are removed inline");
                (None, None)
            }
        };
        Ok(DiskStore {
            rank_dir,
            suffix,
            chunk_bytes,
            pool,
            backups: Mutex::new(HashMap::new()),
            janitor: Mutex::new(janitor),
            janitor_thread: Mutex::new(janitor_thread),
            fail_write_at: None,
            hold_write_at: None,
            fail_read_at: None,
        })
    }

    /// The rank's directory.
    pub fn root(&self) -> &Path {
        self.rank_dir.path()
    }

    /// Save the device ranges `runs` (committed) of region `tag`, verified: every chunk written
    /// and checksummed, the data fsynced, the manifest written, fsynced and renamed into place.
    ///
    /// # Errors
    /// [`StoreError::Io`] naming the file on a failed write (disk full, I/O error); the files of
    /// the attempt are removed then. [`StoreError::UnsafePath`] for a tag name that is not one
    /// path component, or a link or foreign file where the tag's files go (nothing is written
    /// through it). [`StoreError::Device`] on a failed device copy.
    pub fn save(
        &self,
        device: &dyn Device,
        tag: &MemoryTag,
        runs: &[AddressRange],
    ) -> Result<DiskBackup, StoreError> {
        self.save_from(Source::Device(device), tag, runs, &AtomicBool::new(false))
    }

    /// As [`save`](Self::save), from `bytes`, a host copy of the ranges `runs` laid end to end
    /// (the write behind a pause that copied them out first). Stops between chunks once `stop`
    /// is set, removing what it wrote: `Ok(None)` then.
    ///
    /// # Errors
    /// As [`save`](Self::save).
    pub fn save_host(
        &self,
        tag: &MemoryTag,
        bytes: &[u8],
        runs: &[AddressRange],
        stop: &AtomicBool,
    ) -> Result<Option<DiskBackup>, StoreError> {
        let total: usize = runs.iter().map(|r| r.len).sum();
        if bytes.len() < total {
            return Err(StoreError::Manifest {
                path: self.root().join(tag.dir_name().as_ref()),
                reason: format!("a host copy of {} bytes cannot hold {total}", bytes.len()),
            });
        }
        match self.save_from(Source::Host(bytes), tag, runs, stop) {
            Err(StoreError::Stopped) => Ok(None),
            saved => saved.map(Some),
        }
    }

    fn save_from(
        &self,
        source: Source<'_>,
        tag: &MemoryTag,
        runs: &[AddressRange],
        stop: &AtomicBool,
    ) -> Result<DiskBackup, StoreError> {
        let base = tag.dir_name();
        let name = format!("{base}{}", self.suffix);
        let path = self.root().join(&name);
        let plain = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-';
        if base.is_empty() || !base.bytes().all(plain) {
            return Err(refused(path, Unsafe::TagName));
        }
        let dir = self.rank_dir.tag_dir(&name)?;
        match self.save_in(source, &dir, &path, tag, runs, stop) {
            Ok((manifest, manifest_len)) => {
                lock(&self.backups).insert(name.clone(), false);
                Ok(DiskBackup {
                    name,
                    path,
                    manifest,
                    manifest_len,
                })
            }
            Err(error) => {
                for file in [DATA_FILE, MANIFEST_TMP, MANIFEST_FILE] {
                    remove_if_present(&dir, &path, file);
                }
                // The tag directory goes when the store drops, unless a save fills it again;
                // left behind, the next job on the directory would take it for a dead one's.
                lock(&self.backups).entry(name).or_insert(false);
                Err(error)
            }
        }
    }

    /// Write the data file and the manifest; returns the manifest and its length in bytes.
    fn save_in(
        &self,
        source: Source<'_>,
        dir: &OwnedFd,
        path: &Path,
        tag: &MemoryTag,
        runs: &[AddressRange],
        stop: &AtomicBool,
    ) -> Result<(Manifest, u64), StoreError> {
        let data_path = path.join(DATA_FILE);
        let (file, direct) = open_data(dir, &data_path, true)?;
        let total: u64 = runs.iter().map(|r| r.len as u64).sum();
        let chunks = chunk_count(total, self.chunk_bytes);
        let target = Target {
            file: &file,
            path: &data_path,
            direct,
        };
        let crc32c = self.write_chunks(source, target, runs, total, chunks, stop)?;
        if stop.load(Ordering::SeqCst) {
            return Err(StoreError::Stopped);
        }
        file.sync_all().map_err(io_error("fsync", &data_path))?;
        let manifest = Manifest {
            tag: tag.name().to_string(),
            total_bytes: total,
            chunk_bytes: self.chunk_bytes,
            runs: runs.iter().map(|r| (r.start, r.len)).collect(),
            crc32c,
        };
        let manifest_len = write_manifest(dir, path, &manifest)?;
        Ok((manifest, manifest_len))
    }

    /// The pipelined copy-out: this thread fills staging buffers from `source` and checksums
    /// them, [`WRITE_THREADS`] writer threads write them; it stops before a chunk once `stop`
    /// is set ([`StoreError::Stopped`]). Returns each chunk's CRC32C.
    fn write_chunks(
        &self,
        source: Source<'_>,
        target: Target<'_>,
        runs: &[AddressRange],
        total: u64,
        chunks: usize,
        stop: &AtomicBool,
    ) -> Result<Vec<u32>, StoreError> {
        let path = target.path;
        let mut free = self.take_staging(chunks.min(PIPELINE_DEPTH))?;
        let staged = free.len();
        let mut crcs = vec![0u32; chunks];
        let mut first_error: Option<StoreError> = None;
        let (job_tx, job_rx) = mpsc::channel::<(usize, HostBuffer, usize)>();
        let job_rx = Mutex::new(job_rx);
        let (done_tx, done_rx) = mpsc::channel::<ChunkDone>();
        let chunk_bytes = self.chunk_bytes;
        let fail_at = self.fail_write_at;
        let hold_at = self.hold_write_at.as_ref();
        std::thread::scope(|scope| {
            for _ in 0..WRITE_THREADS {
                let done_tx = done_tx.clone();
                let job_rx = &job_rx;
                scope.spawn(move || {
                    loop {
                        let job = lock(job_rx).recv();
                        let Ok((index, mut buffer, len)) = job else {
                            return;
                        };
                        if let Some((_, barrier)) = hold_at.filter(|(at, _)| *at == index) {
                            barrier.wait();
                            barrier.wait();
                        }
                        let result = if fail_at == Some(index) {
                            Err(StoreError::Io {
                                action: format!("write chunk {index} of"),
                                path: path.to_path_buf(),
                                source: std::io::Error::other("injected write fault"),
                            })
                        } else {
                            write_chunk(target, index, chunk_bytes, &mut buffer, len, stop)
                        };
                        if done_tx.send((buffer, result)).is_err() {
                            return;
                        }
                    }
                });
            }
            drop(done_tx);
            let mut in_flight = 0usize;
            for (index, crc_slot) in crcs.iter_mut().enumerate() {
                let mut buffer = match free.pop() {
                    Some(buffer) => buffer,
                    None => match done_rx.recv() {
                        Ok((buffer, result)) => {
                            in_flight -= 1;
                            if let Err(error) = result {
                                first_error.get_or_insert(error);
                            }
                            buffer
                        }
                        Err(_) => break,
                    },
                };
                if stop.load(Ordering::SeqCst) {
                    first_error.get_or_insert(StoreError::Stopped);
                }
                if first_error.is_some() {
                    free.push(buffer);
                    break;
                }
                let (offset, len) = chunk_span(index, chunk_bytes, total);
                let staged = source
                    .stage(runs, offset, len, &mut buffer)
                    .and_then(|()| Ok(crc32c::crc32c(&buffer.as_slice()?[..len])));
                match staged {
                    Ok(crc) => {
                        *crc_slot = crc;
                        if let Err(mpsc::SendError((_, buffer, _))) =
                            job_tx.send((index, buffer, len))
                        {
                            free.push(buffer);
                            break;
                        }
                        in_flight += 1;
                    }
                    Err(error) => {
                        first_error.get_or_insert(error);
                        free.push(buffer);
                        break;
                    }
                }
            }
            drop(job_tx);
            while in_flight > 0 {
                let Ok((buffer, result)) = done_rx.recv() else {
                    break;
                };
                in_flight -= 1;
                if let Err(error) = result {
                    first_error.get_or_insert(error);
                }
                free.push(buffer);
            }
        });
        debug_assert_eq!(free.len(), staged, "every staging buffer comes back");
        free.into_iter().for_each(|buffer| self.pool.put(buffer));
        match first_error {
            Some(error) => Err(error),
            None => Ok(crcs),
        }
    }

    /// Read `backup` back into the device ranges `runs` (committed, the same ranges it was saved
    /// from), verifying every chunk's checksum.
    ///
    /// # Errors
    /// [`StoreError::Manifest`] when the manifest on disk is missing, larger than the one
    /// written or does not match; [`StoreError::ChecksumMismatch`] naming the file and chunk;
    /// [`StoreError::Io`] on a failed read; [`StoreError::UnsafePath`] for a link in place of a
    /// file. The files are kept in every case, and [`remove`](Self::remove) keeps them too,
    /// until a later load succeeds; the device ranges hold unspecified bytes then.
    pub fn load(
        &self,
        device: &dyn Device,
        backup: &DiskBackup,
        runs: &[AddressRange],
    ) -> Result<(), StoreError> {
        let result = self.load_verified(Destination::Device(device), backup, runs);
        lock(&self.backups).insert(backup.name.clone(), result.is_err());
        result
    }

    /// As [`load`](Self::load), into `bytes`, host memory holding the ranges `runs` laid end
    /// to end (the ranges are the ones the backup was saved from; no device memory is
    /// touched).
    ///
    /// # Errors
    /// As [`load`](Self::load); [`StoreError::Manifest`] when `bytes` cannot hold the backup.
    pub fn load_host(
        &self,
        backup: &DiskBackup,
        runs: &[AddressRange],
        bytes: &mut [u8],
    ) -> Result<(), StoreError> {
        if (bytes.len() as u64) < backup.bytes() {
            return Err(StoreError::Manifest {
                path: backup.path.join(MANIFEST_FILE),
                reason: format!(
                    "a host buffer of {} bytes cannot hold its {}",
                    bytes.len(),
                    backup.bytes()
                ),
            });
        }
        let result = self.load_verified(Destination::Host(Mutex::new(bytes)), backup, runs);
        lock(&self.backups).insert(backup.name.clone(), result.is_err());
        result
    }

    fn load_verified(
        &self,
        dest: Destination<'_>,
        backup: &DiskBackup,
        runs: &[AddressRange],
    ) -> Result<(), StoreError> {
        let manifest_path = backup.path.join(MANIFEST_FILE);
        let dir = self.rank_dir.existing_tag_dir(&backup.name)?;
        let on_disk = read_manifest(&dir, &manifest_path, backup.manifest_len)?;
        let expected_runs: Vec<(u64, usize)> = runs.iter().map(|r| (r.start, r.len)).collect();
        if on_disk != backup.manifest || on_disk.runs != expected_runs {
            return Err(StoreError::Manifest {
                path: manifest_path,
                reason: "it does not describe the region being resumed".to_string(),
            });
        }
        let data_path = backup.path.join(DATA_FILE);
        let (file, direct) = open_data(&dir, &data_path, false)?;
        let chunk_bytes = on_disk.chunk_bytes;
        let total = on_disk.total_bytes;
        let chunks = on_disk.crc32c.len();
        if chunks != chunk_count(total, chunk_bytes) {
            return Err(StoreError::Manifest {
                path: manifest_path,
                reason: format!("{chunks} checksums for {total} bytes in chunks of {chunk_bytes}"),
            });
        }
        Load {
            dest,
            pool: &self.pool,
            file: &file,
            path: &data_path,
            direct,
            runs,
            chunk_bytes,
            total,
            crc32c: &on_disk.crc32c,
            fail_read_at: self.fail_read_at,
        }
        .run()
    }

    /// Remove a backup's files and directory (after a verified resume); a backup whose last
    /// load failed is kept instead, for the user to look at, and the log says where (the next
    /// job on this offload directory removes it).
    ///
    /// The directory is renamed out of the way at once, so the tag can be saved again right
    /// away; unlinking the data file (a tenth of a second per GiB on ext4) happens on a
    /// background thread, off the resume's critical path, and is complete when the store drops.
    ///
    /// # Errors
    /// [`StoreError::Io`] naming the directory that could not be moved away.
    pub fn remove(&self, backup: DiskBackup) -> Result<(), StoreError> {
        if lock(&self.backups).remove(&backup.name) == Some(true) {
            tracing::warn!(
                dir = %backup.path.display(),
                tag = %backup.manifest.tag,
                "keeping the offload files of a failed resume; the next job on this offload directory removes them"
            );
            return Ok(());
        }
        let trash = self.rank_dir.move_away(&backup.name)?;
        let queued = match &*lock(&self.janitor) {
            Some(janitor) => janitor.send(trash.clone()).is_ok(),
            None => false,
        };
        if !queued {
            remove_tree(&self.rank_dir, &trash);
        }
        Ok(())
    }

    /// Make the writer fail with an I/O error on chunk `index` (tests of the failure path).
    #[cfg(test)]
    pub(crate) fn inject_write_fault(&mut self, index: usize) {
        self.fail_write_at = Some(index);
    }

    /// Make a writer wait at `barrier` twice before it writes chunk `index`: the test sees
    /// the files of a write cut short between the two waits.
    #[cfg(test)]
    pub(crate) fn inject_write_hold(&mut self, index: usize, barrier: Arc<Barrier>) {
        self.hold_write_at = Some((index, barrier));
    }

    /// Make the readers fail with an I/O error on chunk `index` (tests of the failure path).
    #[cfg(test)]
    pub(crate) fn inject_read_fault(&mut self, index: usize) {
        self.fail_read_at = Some(index);
    }

    fn take_staging(&self, count: usize) -> Result<Vec<HostBuffer>, StoreError> {
        let mut staging = Vec::new();
        for _ in 0..count {
            match self.pool.take(self.chunk_bytes) {
                Ok(buffer) => staging.push(buffer),
                Err(error) => {
                    staging.into_iter().for_each(|b| self.pool.put(b));
                    return Err(error);
                }
            }
        }
        Ok(staging)
    }
}

impl Drop for DiskStore {
    fn drop(&mut self) {
        lock(&self.janitor).take();
        if let Some(handle) = lock(&self.janitor_thread).take()
            && handle.join().is_err()
        {
            tracing::error!("the offload janitor thread panicked");
        }
        for (name, kept) in lock(&self.backups).drain() {
            if kept {
                tracing::warn!(
                    dir = %self.root().join(&name).display(),
                    "keeping the offload files of a failed resume; the next job on this offload directory removes them"
                );
            } else {
                remove_tree(&self.rank_dir, &name);
            }
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Remove a moved-away backup directory, logging what cannot be removed.
fn remove_tree(rank_dir: &RankDir, name: &str) {
    if let Err(error) = rank_dir.remove_tag_dir(name) {
        tracing::error!(%error, "cannot remove offload files");
    }
}

fn chunk_count(total: u64, chunk_bytes: usize) -> usize {
    total.div_ceil(chunk_bytes as u64) as usize
}

/// Stream offset and length of chunk `index`.
fn chunk_span(index: usize, chunk_bytes: usize, total: u64) -> (u64, usize) {
    let offset = (index * chunk_bytes) as u64;
    (offset, (total - offset).min(chunk_bytes as u64) as usize)
}

/// The device pieces of stream bytes `[offset, offset + len)` of `runs` laid end to end, each
/// with its offset in the chunk.
fn pieces(runs: &[AddressRange], offset: u64, len: usize) -> Vec<(AddressRange, usize)> {
    let end = offset + len as u64;
    let mut out = Vec::new();
    let mut run_offset = 0u64;
    for run in runs {
        let run_end = run_offset + run.len as u64;
        if run_end > offset && run_offset < end {
            let from = run_offset.max(offset);
            let to = run_end.min(end);
            let range = AddressRange {
                start: run.start + (from - run_offset),
                len: (to - from) as usize,
            };
            out.push((range, (from - offset) as usize));
        }
        run_offset = run_end;
    }
    out
}

fn write_chunk(
    target: Target<'_>,
    index: usize,
    chunk_bytes: usize,
    buffer: &mut HostBuffer,
    len: usize,
    stop: &AtomicBool,
) -> Result<(), StoreError> {
    let bytes = buffer.as_mut_slice()?;
    let padded = if target.direct {
        len.next_multiple_of(DIRECT_ALIGN)
    } else {
        len
    };
    bytes[len..padded].fill(0);
    let start = index * chunk_bytes;
    for offset in (0..padded).step_by(WRITE_PIECE) {
        if stop.load(Ordering::SeqCst) {
            return Err(StoreError::Stopped);
        }
        let piece = &bytes[offset..padded.min(offset + WRITE_PIECE)];
        target
            .file
            .write_all_at(piece, (start + offset) as u64)
            .map_err(io_error(&format!("write chunk {index} of"), target.path))?;
    }
    Ok(())
}

/// Open the data file `path` in `dir` with O_DIRECT, or buffered where the filesystem refuses
/// O_DIRECT (tmpfs), never following a link; returns the file and whether it is direct. A new
/// file is created `0600` in place of the one a failed save or an older backup left.
fn open_data(dir: &OwnedFd, path: &Path, create: bool) -> Result<(File, bool), StoreError> {
    let (flags, action) = if create {
        (OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL, "create")
    } else {
        (OFlags::RDONLY, "open")
    };
    let flags = flags | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    if create {
        match rustix::fs::statat(dir, DATA_FILE, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(stat) if FileType::from_raw_mode(stat.st_mode).is_file() => {
                remove_if_present(dir, path, DATA_FILE);
            }
            Ok(_) => return Err(open_error(dir, path, DATA_FILE, action, Errno::EXIST)),
            Err(_) => {}
        }
    }
    let open = |flags: OFlags| {
        rustix::fs::openat(dir, DATA_FILE, flags, Mode::RUSR | Mode::WUSR)
            .map_err(|errno| open_error(dir, path, DATA_FILE, action, errno))
    };
    match rustix::fs::openat(
        dir,
        DATA_FILE,
        flags | OFlags::DIRECT,
        Mode::RUSR | Mode::WUSR,
    ) {
        Ok(fd) => Ok((File::from(fd), true)),
        Err(Errno::INVAL) => {
            if !BUFFERED_WARNED.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    path = %path.display(),
                    "the filesystem refuses O_DIRECT; offload files use buffered I/O and fsync"
                );
            }
            Ok((File::from(open(flags)?), false))
        }
        Err(errno) => Err(open_error(dir, path, DATA_FILE, action, errno)),
    }
}

/// The error of a failed open of `name` in `dir` (at `path`): a link or another foreign entry
/// in its place is [`StoreError::UnsafePath`].
fn open_error(dir: &OwnedFd, path: &Path, name: &str, action: &str, errno: Errno) -> StoreError {
    let foreign = rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW)
        .ok()
        .map(|stat| FileType::from_raw_mode(stat.st_mode))
        .and_then(|kind| match kind {
            kind if kind.is_symlink() => Some(Unsafe::Symlink),
            kind if !kind.is_file() => Some(Unsafe::Foreign),
            _ => None,
        });
    match foreign {
        Some(reason) if matches!(errno, Errno::LOOP | Errno::EXIST | Errno::ISDIR) => {
            refused(path.to_path_buf(), reason)
        }
        _ => errno_error(action, path)(errno),
    }
}

/// Write `manifest` into tag directory `dir` (at `path`) atomically: a temporary file, fsynced,
/// renamed into place, the directory fsynced. Returns the manifest's length in bytes.
fn write_manifest(dir: &OwnedFd, path: &Path, manifest: &Manifest) -> Result<u64, StoreError> {
    let tmp = path.join(MANIFEST_TMP);
    let json = serde_json::to_vec_pretty(manifest).map_err(|error| StoreError::Manifest {
        path: tmp.clone(),
        reason: error.to_string(),
    })?;
    let fd = rustix::fs::openat(
        dir,
        MANIFEST_TMP,
        OFlags::WRONLY | OFlags::CREATE | OFlags::TRUNC | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::RUSR | Mode::WUSR,
    )
    .map_err(|errno| open_error(dir, &tmp, MANIFEST_TMP, "create", errno))?;
    let file = File::from(fd);
    file.write_all_at(&json, 0)
        .map_err(io_error("write", &tmp))?;
    file.sync_all().map_err(io_error("fsync", &tmp))?;
    let target = path.join(MANIFEST_FILE);
    rustix::fs::renameat(dir, MANIFEST_TMP, dir, MANIFEST_FILE)
        .map_err(errno_error("rename into place", &target))?;
    rustix::fs::fsync(dir).map_err(errno_error("fsync", path))?;
    Ok(json.len() as u64)
}

/// Read the manifest `path` of tag directory `dir`, refusing one larger than `limit` bytes
/// (the manifest written) before reading it.
fn read_manifest(dir: &OwnedFd, path: &Path, limit: u64) -> Result<Manifest, StoreError> {
    let fd = rustix::fs::openat(
        dir,
        MANIFEST_FILE,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|errno| open_error(dir, path, MANIFEST_FILE, "read", errno))?;
    let bytes = read_bounded(&fd, path, limit)?;
    serde_json::from_slice(&bytes).map_err(|error| StoreError::Manifest {
        path: path.to_path_buf(),
        reason: error.to_string(),
    })
}

/// Remove regular file `name` of tag directory `dir` (at `path`) when it is there; a link is
/// unlinked, never followed.
fn remove_if_present(dir: &OwnedFd, path: &Path, name: &str) {
    if let Err(errno) = rustix::fs::unlinkat(dir, name, AtFlags::empty())
        && errno != Errno::NOENT
    {
        let error = std::io::Error::from(errno);
        let path = path.join(name);
        tracing::error!(%error, path = %path.display(), "cannot remove a partial offload file");
    }
}

#[cfg(test)]
mod tests;
