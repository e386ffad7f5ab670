//! The disk store's resume pipeline: reader threads read the data file in parts while the
//! calling thread checksums the parts in stream order, chunk by chunk.
//!
//! Why readers never checksum: a thread that reads a chunk and then checksums it leaves the disk
//! idle meanwhile, and since parallel reads share the disk they finish together, so every thread
//! checksummed at once and the disk idled for several milliseconds per round (a tenth of a
//! resume, measured). Here the readers go straight on to the next part, and only the checksums of
//! the last parts are left when the last read lands; parts are small so that they are short.
//!
//! On a device the host addresses (the CPU device), a part is read straight into its device ranges
//! and checksummed there; elsewhere it is read into one of its reader's staging buffers, which the
//! verifier copies to the device (or, for a load into host memory, to its place there) once it
//! has checksummed the part. Either way a chunk's earlier parts reach their destination before
//! its checksum is complete; a mismatch fails the load, and the caller keeps the tag paused.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::ErrorKind;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError, mpsc};

use crate::device::{AddressRange, Device, HostBuffer, HostView, ViewAccess};

use super::{DIRECT_ALIGN, chunk_span, pieces};
use crate::store::rank_dir::io_error;
use crate::store::{HostPool, StoreError};

/// Threads reading at once. With two, a reader that stalls (faulting in pages the prefault has
/// not reached, or waiting for a core) left one request in flight, and some resumes fell to
/// half speed; three kept every measured resume near the disk's speed.
const READ_THREADS: usize = 3;

/// Largest read: chunks are read in parts of this size so that the verifier follows the reads
/// closely and little is left to checksum after the last read (32 MiB: about 3 ms); 8 and 16 MiB
/// parts measured slightly slower on a virtio disk.
const READ_PART_BYTES: usize = 32 << 20;

/// Staging buffers per reader on a device without host views: one being read into, one waiting
/// for the verifier.
const STAGING_PER_READER: usize = 2;

/// Where a load puts the bytes.
pub(super) enum Destination<'a> {
    /// The device ranges the backup was saved from.
    Device(&'a dyn Device),
    /// Host memory holding those ranges laid end to end (the verifier alone writes it).
    Host(Mutex<&'a mut [u8]>),
}

/// A data file being read back into the device ranges it was saved from, or into host memory.
pub(super) struct Load<'a, 'd> {
    pub(super) dest: Destination<'d>,
    pub(super) pool: &'a HostPool,
    pub(super) file: &'a File,
    pub(super) path: &'a Path,
    /// Whether the file is open with O_DIRECT (offsets, lengths and buffers aligned).
    pub(super) direct: bool,
    pub(super) runs: &'a [AddressRange],
    pub(super) chunk_bytes: usize,
    pub(super) total: u64,
    /// CRC32C of each chunk, from the manifest.
    pub(super) crc32c: &'a [u32],
    /// Chunk whose reads fail with an injected I/O error (tests of the failure path).
    pub(super) fail_read_at: Option<usize>,
}

/// A read: stream bytes `[offset, offset + len)`, inside chunk `chunk`.
#[derive(Debug, Clone, Copy)]
struct Part {
    chunk: usize,
    offset: u64,
    len: usize,
    /// Whether the part ends its chunk (its checksum is complete then).
    ends_chunk: bool,
}

/// Where a part's bytes were read to.
enum Landed {
    /// Its device ranges, through host views.
    InPlace(Vec<HostView>),
    /// A staging buffer of the reader, still to be copied to the device.
    Staged(HostBuffer),
}

/// A part read, from reader `reader`, for the verifier.
struct ReadPart {
    index: usize,
    reader: usize,
    landed: Landed,
}

/// What a reader tells the verifier.
enum FromReader {
    /// A part has landed.
    Read(ReadPart),
    /// The reader failed (or is unwinding) and stops. The verifier then hands every waiting
    /// buffer back at once: a reader waiting for one must not wait for a part that will not come.
    Failed(StoreError),
}

/// Reports its reader's unwinding to the verifier.
struct UnwindNotice<'a> {
    read_tx: &'a mpsc::Sender<FromReader>,
    path: &'a Path,
}

impl Drop for UnwindNotice<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let error = StoreError::Io {
                action: "read".to_string(),
                path: self.path.to_path_buf(),
                source: std::io::Error::other("an offload reader thread panicked; resume again"),
            };
            // A verifier that is gone needs no notice.
            let _ = self.read_tx.send(FromReader::Failed(error));
        }
    }
}

impl Load<'_, '_> {
    /// Read every chunk into the device ranges and verify its checksum.
    ///
    /// # Errors
    /// [`StoreError::ChecksumMismatch`] naming the file and chunk; [`StoreError::Io`] on a failed
    /// read; [`StoreError::Device`] on a failed device copy. The device ranges hold unspecified
    /// bytes then.
    pub(super) fn run(&self) -> Result<(), StoreError> {
        let parts = self.parts();
        let next_part = AtomicUsize::new(0);
        let stop = AtomicBool::new(false);
        let readers = READ_THREADS.min(parts.len());
        let (read_tx, read_rx) = mpsc::channel::<FromReader>();
        let (return_txs, return_rxs): (Vec<_>, Vec<_>) =
            (0..readers).map(|_| mpsc::channel::<HostBuffer>()).unzip();
        let (verified, first_error) = std::thread::scope(|scope| {
            let workers: Vec<_> = return_rxs
                .into_iter()
                .enumerate()
                .map(|(reader, returned)| {
                    let read_tx = read_tx.clone();
                    let (parts, next_part, stop) = (&parts, &next_part, &stop);
                    scope.spawn(move || {
                        let _unwind = UnwindNotice {
                            read_tx: &read_tx,
                            path: self.path,
                        };
                        let mut staging = Staging::default();
                        loop {
                            let index = next_part.fetch_add(1, Ordering::Relaxed);
                            if index >= parts.len() || stop.load(Ordering::Relaxed) {
                                break;
                            }
                            let sent = match self.read(parts[index], &mut staging, &returned) {
                                Ok(landed) => read_tx.send(FromReader::Read(ReadPart {
                                    index,
                                    reader,
                                    landed,
                                })),
                                Err(error) => {
                                    stop.store(true, Ordering::Relaxed);
                                    // Stops this reader whether or not the verifier hears it.
                                    let _ = read_tx.send(FromReader::Failed(error));
                                    break;
                                }
                            };
                            if sent.is_err() {
                                break;
                            }
                        }
                        staging.idle.into_iter().for_each(|b| self.pool.put(b));
                        returned
                    })
                })
                .collect();
            drop(read_tx);
            let outcome = self.verify(&parts, read_rx, return_txs, &stop);
            for worker in workers {
                match worker.join() {
                    Ok(returned) => returned.try_iter().for_each(|b| self.pool.put(b)),
                    Err(_) => tracing::error!(
                        "an offload reader thread panicked; its staging buffers are lost"
                    ),
                }
            }
            outcome
        });
        if let Some(error) = first_error {
            return Err(error);
        }
        if verified < parts.len() {
            let chunk = parts[verified].chunk;
            return Err(StoreError::Io {
                action: format!("read chunk {chunk} of"),
                path: self.path.to_path_buf(),
                source: std::io::Error::other("its reader thread stopped; resume again"),
            });
        }
        Ok(())
    }

    /// The reads of every chunk, in stream order.
    fn parts(&self) -> Vec<Part> {
        let chunks = self.crc32c.len();
        let part_bytes = READ_PART_BYTES.min(self.chunk_bytes);
        let mut parts = Vec::new();
        for chunk in 0..chunks {
            let (offset, len) = chunk_span(chunk, self.chunk_bytes, self.total);
            let mut done = 0;
            while done < len {
                let part_len = part_bytes.min(len - done);
                parts.push(Part {
                    chunk,
                    offset: offset + done as u64,
                    len: part_len,
                    ends_chunk: done + part_len == len,
                });
                done += part_len;
            }
        }
        parts
    }

    /// Checksum the parts the readers send in stream order, copying staged ones to the device and
    /// handing their buffers back; returns how many parts were verified and the first failure.
    /// After a failure it sets `stop` and only hands buffers back, until every reader has
    /// stopped. Dropping `return_txs` on the way out wakes a reader still waiting for a buffer.
    fn verify(
        &self,
        parts: &[Part],
        read_rx: mpsc::Receiver<FromReader>,
        return_txs: Vec<mpsc::Sender<HostBuffer>>,
        stop: &AtomicBool,
    ) -> (usize, Option<StoreError>) {
        let give_back = |read: ReadPart| {
            if let Landed::Staged(buffer) = read.landed
                && let Err(mpsc::SendError(buffer)) = return_txs[read.reader].send(buffer)
            {
                self.pool.put(buffer);
            }
        };
        let mut first_error = None;
        let mut waiting: BTreeMap<usize, ReadPart> = BTreeMap::new();
        let mut verified = 0;
        let mut crc = 0u32;
        for message in read_rx {
            match message {
                FromReader::Failed(error) => {
                    first_error.get_or_insert(error);
                }
                FromReader::Read(read) if first_error.is_some() => give_back(read),
                FromReader::Read(read) => {
                    waiting.insert(read.index, read);
                    while let Some(mut read) = waiting.remove(&verified) {
                        let checked = self.check(parts[verified], &mut read.landed, &mut crc);
                        give_back(read);
                        if let Err(error) = checked {
                            first_error = Some(error);
                            break;
                        }
                        verified += 1;
                    }
                }
            }
            if first_error.is_some() {
                stop.store(true, Ordering::Relaxed);
                std::mem::take(&mut waiting)
                    .into_values()
                    .for_each(give_back);
            }
        }
        (verified, first_error)
    }

    /// Add `landed`'s bytes to the running checksum of its chunk, compare it with the manifest's
    /// at the chunk's end, and copy staged bytes to the device.
    fn check(&self, part: Part, landed: &mut Landed, crc: &mut u32) -> Result<(), StoreError> {
        match landed {
            Landed::InPlace(views) => {
                for view in views.iter() {
                    *crc = crc32c::crc32c_append(*crc, view.as_slice::<u8>()?);
                }
            }
            Landed::Staged(buffer) => {
                *crc = crc32c::crc32c_append(*crc, &buffer.as_slice()?[..part.len]);
            }
        }
        if part.ends_chunk {
            let expected = self.crc32c[part.chunk];
            let found = std::mem::take(crc);
            if found != expected {
                return Err(StoreError::ChecksumMismatch {
                    path: self.path.to_path_buf(),
                    chunk: part.chunk,
                    expected,
                    found,
                });
            }
        }
        if let Landed::Staged(buffer) = landed {
            match &self.dest {
                Destination::Device(device) => {
                    for (range, at) in pieces(self.runs, part.offset, part.len) {
                        device.copy_from_host(buffer, at, range)?.wait()?;
                    }
                }
                Destination::Host(bytes) => {
                    let mut bytes = bytes.lock().unwrap_or_else(PoisonError::into_inner);
                    let at = part.offset as usize;
                    bytes[at..at + part.len].copy_from_slice(&buffer.as_slice()?[..part.len]);
                }
            }
        }
        Ok(())
    }

    /// Read `part` straight into its device ranges where the device lets the host address them
    /// and they suit the file's alignment, else into a staging buffer.
    fn read(
        &self,
        part: Part,
        staging: &mut Staging,
        returned: &mpsc::Receiver<HostBuffer>,
    ) -> Result<Landed, StoreError> {
        if self.fail_read_at == Some(part.chunk) {
            return Err(StoreError::Io {
                action: format!("read chunk {} of", part.chunk),
                path: self.path.to_path_buf(),
                source: std::io::Error::other("injected read fault"),
            });
        }
        if let Some(mut views) = self.views(part)? {
            for (view, at) in &mut views {
                let bytes = view.as_mut_slice::<u8>()?;
                let len = bytes.len();
                self.read_into(part.chunk, part.offset + *at as u64, bytes, len)?;
            }
            return Ok(Landed::InPlace(
                views.into_iter().map(|(view, _)| view).collect(),
            ));
        }
        let part_bytes = READ_PART_BYTES.min(self.chunk_bytes);
        let mut buffer = staging.take(self.pool, part_bytes, returned, self.path)?;
        let bytes = match buffer.as_mut_slice() {
            Ok(bytes) => bytes,
            Err(error) => {
                staging.idle.push(buffer);
                return Err(error.into());
            }
        };
        let padded = part.len.next_multiple_of(DIRECT_ALIGN).min(bytes.len());
        match self.read_into(part.chunk, part.offset, &mut bytes[..padded], part.len) {
            Ok(()) => Ok(Landed::Staged(buffer)),
            Err(error) => {
                staging.idle.push(buffer);
                Err(error)
            }
        }
    }

    /// Writable host views of `part`'s device ranges, each with its offset in the part; `None`
    /// for a load into host memory, or when the device has no host views or a range does not
    /// suit O_DIRECT.
    fn views(&self, part: Part) -> Result<Option<Vec<(HostView, usize)>>, StoreError> {
        let Destination::Device(device) = &self.dest else {
            return Ok(None);
        };
        let ranges = pieces(self.runs, part.offset, part.len);
        let aligned = |range: &AddressRange| {
            (range.start as usize).is_multiple_of(DIRECT_ALIGN)
                && range.len.is_multiple_of(DIRECT_ALIGN)
        };
        if self.direct && !ranges.iter().all(|(range, _)| aligned(range)) {
            return Ok(None);
        }
        let mut views = Vec::with_capacity(ranges.len());
        for (range, at) in ranges {
            match device.host_view(range, ViewAccess::Write)? {
                Some(view) => views.push((view, at)),
                None => return Ok(None),
            }
        }
        Ok(Some(views))
    }

    /// Read file bytes of chunk `chunk` from `offset` into `bytes` until `len` of them are in
    /// (`bytes` may be longer, padded to the O_DIRECT alignment).
    fn read_into(
        &self,
        chunk: usize,
        offset: u64,
        bytes: &mut [u8],
        len: usize,
    ) -> Result<(), StoreError> {
        let action = || format!("read chunk {chunk} of");
        let mut done = 0;
        while done < len {
            match self.file.read_at(&mut bytes[done..], offset + done as u64) {
                Ok(0) => {
                    return Err(StoreError::Io {
                        action: action(),
                        path: self.path.to_path_buf(),
                        source: std::io::Error::from(ErrorKind::UnexpectedEof),
                    });
                }
                Ok(n) => done += n,
                Err(error) if error.kind() == ErrorKind::Interrupted => {}
                Err(error) => return Err(io_error(&action(), self.path)(error)),
            }
        }
        Ok(())
    }
}

/// A reader's staging buffers, on a device without host views: taken from the pool when first
/// needed, handed back by the verifier through the reader's channel.
#[derive(Default)]
struct Staging {
    /// Buffers on hand.
    idle: Vec<HostBuffer>,
    /// Buffers taken from the pool so far.
    taken: usize,
}

impl Staging {
    /// A buffer of at least `len` bytes: one on hand, one handed back, a new one from the pool,
    /// or, with [`STAGING_PER_READER`] out already, the next one handed back.
    ///
    /// Waiting cannot deadlock: the buffers a reader waits for hold parts it took before its
    /// current one, so the verifier reaches them without it, and the part the verifier waits for
    /// belongs to a reader that is reading it, or has failed and said so.
    fn take(
        &mut self,
        pool: &HostPool,
        len: usize,
        returned: &mpsc::Receiver<HostBuffer>,
        path: &Path,
    ) -> Result<HostBuffer, StoreError> {
        if let Some(buffer) = self.idle.pop() {
            return Ok(buffer);
        }
        if let Ok(buffer) = returned.try_recv() {
            return Ok(buffer);
        }
        if self.taken < STAGING_PER_READER {
            let buffer = pool.take(len)?;
            self.taken += 1;
            return Ok(buffer);
        }
        returned.recv().map_err(|_| StoreError::Io {
            action: "stage a read of".to_string(),
            path: path.to_path_buf(),
            source: std::io::Error::other("the verifier stopped; resume again"),
        })
    }
}

#[cfg(test)]
mod tests {
    use rand::{RngExt, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use std::fs::OpenOptions;
    use std::os::unix::fs::FileExt;
    use std::sync::Arc;

    use super::super::{DATA_FILE, DiskBackup, DiskStore, PIPELINE_DEPTH};
    use super::*;
    use crate::device::{CpuDevice, FaultyDevice};

    const MIB: usize = 1 << 20;

    /// The CPU device with its host views hidden, as on CUDA: loads go through staging buffers.
    fn no_views(capacity: usize) -> Arc<dyn Device> {
        Arc::new(FaultyDevice::over(
            Arc::new(CpuDevice::new(capacity as u64)),
            0,
        ))
    }

    /// Two runs of an arena, in chunks of `chunk_bytes`, filled with seeded random bytes and
    /// saved.
    struct Saved {
        device: Arc<dyn Device>,
        pool: Arc<HostPool>,
        store: DiskStore,
        backup: DiskBackup,
        runs: [AddressRange; 2],
        expected: Vec<Vec<u8>>,
        _dir: tempfile::TempDir,
    }

    impl Saved {
        /// `runs` are (offset, length) in an arena of `arena` bytes, granule-aligned.
        fn new(
            device: Arc<dyn Device>,
            chunk_bytes: usize,
            arena: usize,
            runs: [(usize, usize); 2],
        ) -> Saved {
            let dir = tempfile::tempdir().unwrap();
            let pool = Arc::new(HostPool::new(Arc::clone(&device)));
            let store = DiskStore::new(dir.path(), 0, chunk_bytes, Arc::clone(&pool)).unwrap();
            let arena = device.reserve(arena).unwrap();
            let runs = runs.map(|(offset, len)| arena.slice(offset, len).unwrap());
            let mut rng = ChaCha8Rng::seed_from_u64(7);
            let mut expected = Vec::new();
            for run in runs {
                device.commit(run).unwrap();
                let bytes: Vec<u8> = (0..run.len).map(|_| rng.random()).collect();
                device.write(&bytes, run).unwrap();
                expected.push(bytes);
            }
            let backup = store
                .save(device.as_ref(), &crate::memory::MemoryTag::Weights, &runs)
                .unwrap();
            Saved {
                device,
                pool,
                store,
                backup,
                runs,
                expected,
                _dir: dir,
            }
        }

        /// Release and re-commit the runs (as a resume does), then load the backup into them.
        fn reload(&self) -> Result<(), StoreError> {
            for run in self.runs {
                self.device.release(run).unwrap();
                self.device.commit(run).unwrap();
            }
            self.store
                .load(self.device.as_ref(), &self.backup, &self.runs)
        }

        fn assert_restored(&self) {
            for (run, bytes) in self.runs.iter().zip(&self.expected) {
                let mut back = vec![0u8; run.len];
                self.device.read(*run, &mut back).unwrap();
                assert!(
                    back == *bytes,
                    "run at {:#x} differs after the load",
                    run.start
                );
            }
        }

        fn data_file(&self) -> OpenOptions {
            let mut options = OpenOptions::new();
            options.read(true).write(true);
            options
        }

        /// Flip one bit of the byte at stream offset `at` on disk.
        fn flip(&self, at: usize) {
            let file = self
                .data_file()
                .open(self.backup.dir().join(DATA_FILE))
                .unwrap();
            let mut byte = [0u8; 1];
            file.read_exact_at(&mut byte, at as u64).unwrap();
            file.write_all_at(&[byte[0] ^ 0x10], at as u64).unwrap();
            file.sync_all().unwrap();
        }
    }

    /// Load a backup back, then flip the byte at `flip_at` on disk and load again: the load
    /// fails naming the chunk, and the files are kept.
    fn round_trip_then_corrupt(saved: &Saved, flip_at: usize) {
        saved.reload().unwrap();
        saved.assert_restored();
        saved.flip(flip_at);
        let err = saved.reload().unwrap_err();
        let chunk = flip_at / saved.backup.manifest.chunk_bytes;
        assert!(
            matches!(err, StoreError::ChecksumMismatch { chunk: c, .. } if c == chunk),
            "expected a mismatch in chunk {chunk}: {err}"
        );
        assert!(
            saved.backup.dir().join(DATA_FILE).exists(),
            "the files are kept after a failed load"
        );
    }

    /// 3 MiB chunks over runs of 4 and 6 MiB, so chunks straddle them.
    fn small_chunks(device: Arc<dyn Device>) -> Saved {
        Saved::new(
            device,
            3 * MIB,
            16 * MIB,
            [(0, 4 * MIB), (8 * MIB, 6 * MIB)],
        )
    }

    /// Chunks of two reads each over runs of 40 and 30 MiB, so reads straddle them.
    fn chunks_of_several_reads(device: Arc<dyn Device>) -> Saved {
        let chunk = 2 * READ_PART_BYTES;
        Saved::new(
            device,
            chunk,
            96 * MIB,
            [(0, 40 * MIB), (48 * MIB, 30 * MIB)],
        )
    }

    #[test]
    fn loads_into_host_addressable_memory_restore_every_byte_and_catch_a_flipped_one() {
        let saved = small_chunks(Arc::new(CpuDevice::new(64 * MIB as u64)));
        round_trip_then_corrupt(&saved, 5 * MIB + 17);
    }

    #[test]
    fn staged_loads_restore_every_byte_and_catch_a_flipped_one() {
        let saved = small_chunks(no_views(64 * MIB));
        round_trip_then_corrupt(&saved, 5 * MIB + 17);
    }

    #[test]
    fn chunks_read_in_several_parts_are_checked_whole_in_place_and_staged() {
        let in_place = chunks_of_several_reads(Arc::new(CpuDevice::new(128 * MIB as u64)));
        round_trip_then_corrupt(&in_place, 50 * MIB + 17);
        let staged = chunks_of_several_reads(no_views(128 * MIB));
        round_trip_then_corrupt(&staged, 50 * MIB + 17);
    }

    #[test]
    fn loads_into_host_memory_restore_every_byte_catch_a_flipped_one_and_refuse_a_short_buffer() {
        let saved = chunks_of_several_reads(Arc::new(CpuDevice::new(128 * MIB as u64)));
        let total: usize = saved.runs.iter().map(|r| r.len).sum();
        let mut bytes = vec![0u8; total];
        saved
            .store
            .load_host(&saved.backup, &saved.runs, &mut bytes)
            .unwrap();
        assert!(
            bytes == saved.expected.concat(),
            "the host copy holds the runs end to end"
        );
        let err = saved
            .store
            .load_host(&saved.backup, &saved.runs, &mut bytes[..total - 1])
            .unwrap_err();
        assert!(matches!(err, StoreError::Manifest { .. }), "{err}");
        saved.flip(50 * MIB + 17);
        let err = saved
            .store
            .load_host(&saved.backup, &saved.runs, &mut bytes)
            .unwrap_err();
        assert!(
            matches!(err, StoreError::ChecksumMismatch { chunk: 0, .. }),
            "{err}"
        );
    }

    /// Staged loads (1 MiB chunks, so many more reads than staging buffers) over runs of 8 MiB.
    fn many_staged_chunks() -> Saved {
        let device = no_views(64 * MIB);
        Saved::new(device, MIB, 32 * MIB, [(0, 8 * MIB), (10 * MIB, 8 * MIB)])
    }

    /// The pool holds no more than the staging buffers of one pause and one load, and every one
    /// of them is back in it (taking them all allocates nothing).
    fn assert_every_staging_buffer_back(saved: &Saved) {
        let granule = saved.device.granularity() as u64;
        let allocated = saved.pool.allocated_bytes();
        let staging = PIPELINE_DEPTH + READ_THREADS * STAGING_PER_READER;
        let bound = staging as u64 * granule;
        assert!(
            allocated <= bound,
            "the pool grew to {allocated} bytes, more than {bound}: buffers are lost or not reused"
        );
        let taken: Vec<HostBuffer> = (0..allocated / granule)
            .map(|_| saved.pool.take(MIB).unwrap())
            .collect();
        assert_eq!(
            saved.pool.allocated_bytes(),
            allocated,
            "every staging buffer is back in the pool"
        );
        taken.into_iter().for_each(|buffer| saved.pool.put(buffer));
    }

    #[test]
    fn staged_loads_of_many_chunks_recycle_a_few_buffers_and_stop_at_a_short_file() {
        let saved = many_staged_chunks();
        for _ in 0..3 {
            saved.reload().unwrap();
            saved.assert_restored();
        }
        assert_every_staging_buffer_back(&saved);
        let data = saved.data_file().open(saved.backup.dir().join(DATA_FILE));
        data.unwrap().set_len((5 * MIB + MIB / 2) as u64).unwrap();
        let err = saved.reload().unwrap_err();
        assert!(
            matches!(&err, StoreError::Io { action, .. } if action.starts_with("read chunk")),
            "{err}"
        );
        assert_every_staging_buffer_back(&saved);
    }

    #[test]
    fn a_read_failing_mid_file_stops_the_load_and_gives_every_staging_buffer_back() {
        let mut saved = many_staged_chunks();
        saved.reload().unwrap();
        for round in 0..20 {
            let chunk = 1 + round % 15;
            saved.store.inject_read_fault(chunk);
            let err = saved.reload().unwrap_err();
            let action = format!("read chunk {chunk} of");
            assert!(
                matches!(&err, StoreError::Io { action: a, source, .. }
                    if *a == action && source.to_string() == "injected read fault"),
                "expected the injected fault of the {action}: {err}"
            );
        }
        assert_every_staging_buffer_back(&saved);
    }
}
