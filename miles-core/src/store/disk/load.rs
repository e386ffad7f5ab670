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
//! verifier copies to the device once it has checksummed the part. Either way a chunk's earlier
//! parts reach the device before its checksum is complete; a mismatch fails the load, and the
//! caller keeps the tag paused.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::ErrorKind;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError, mpsc};

use crate::device::{AddressRange, Device, HostBuffer, HostView, ViewAccess};

use super::{DIRECT_ALIGN, chunk_span, io_error, lock, pieces};
use crate::store::{HostPool, StoreError};

/// Threads reading at once. With two, a reader that stalls (faulting in pages the prefault has
/// not reached, or waiting for a core) left one request in flight, and some resumes fell to
/// half speed; three kept every measured resume near the disk's speed.
pub(super) const READ_THREADS: usize = 3;

/// Largest read: chunks are read in parts of this size so that the verifier follows the reads
/// closely and little is left to checksum after the last read (32 MiB: about 3 ms); 8 and 16 MiB
/// parts measured slightly slower on a virtio disk.
pub(super) const READ_PART_BYTES: usize = 32 << 20;

/// Staging buffers per reader on a device without host views: one being read into, one waiting
/// for the verifier.
pub(super) const STAGING_PER_READER: usize = 2;

/// A data file being read back into the device ranges it was saved from.
pub(super) struct Load<'a> {
    pub(super) device: &'a dyn Device,
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

impl Load<'_> {
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
        let first_error: Mutex<Option<StoreError>> = Mutex::new(None);
        let readers = READ_THREADS.min(parts.len());
        let (read_tx, read_rx) = mpsc::channel::<ReadPart>();
        let (return_txs, return_rxs): (Vec<_>, Vec<_>) =
            (0..readers).map(|_| mpsc::channel::<HostBuffer>()).unzip();
        let fail = |error: StoreError| {
            stop.store(true, Ordering::Relaxed);
            lock(&first_error).get_or_insert(error);
        };
        let verified = std::thread::scope(|scope| {
            let workers: Vec<_> = return_rxs
                .into_iter()
                .enumerate()
                .map(|(reader, returned)| {
                    let read_tx = read_tx.clone();
                    let (parts, next_part, stop, fail) = (&parts, &next_part, &stop, &fail);
                    scope.spawn(move || {
                        let mut staging = Staging::default();
                        loop {
                            let index = next_part.fetch_add(1, Ordering::Relaxed);
                            if index >= parts.len() || stop.load(Ordering::Relaxed) {
                                break;
                            }
                            match self.read(parts[index], &mut staging, &returned) {
                                Ok(landed) => {
                                    let part = ReadPart {
                                        index,
                                        reader,
                                        landed,
                                    };
                                    if read_tx.send(part).is_err() {
                                        break;
                                    }
                                }
                                Err(error) => {
                                    fail(error);
                                    break;
                                }
                            }
                        }
                        staging.idle.into_iter().for_each(|b| self.pool.put(b));
                        returned
                    })
                })
                .collect();
            drop(read_tx);
            let verified = self.verify(&parts, read_rx, return_txs, &stop, &fail);
            for worker in workers {
                match worker.join() {
                    Ok(returned) => returned.try_iter().for_each(|b| self.pool.put(b)),
                    Err(_) => tracing::error!(
                        "an offload reader thread panicked; its staging buffers are lost"
                    ),
                }
            }
            verified
        });
        if let Some(error) = first_error
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner)
        {
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
    /// handing their buffers back; returns how many parts were verified. After a failure it only
    /// hands buffers back, until every reader has stopped. Dropping `return_txs` on the way out
    /// wakes a reader still waiting for a buffer.
    fn verify(
        &self,
        parts: &[Part],
        read_rx: mpsc::Receiver<ReadPart>,
        return_txs: Vec<mpsc::Sender<HostBuffer>>,
        stop: &AtomicBool,
        fail: &impl Fn(StoreError),
    ) -> usize {
        let give_back = |reader: usize, landed: Landed| {
            if let Landed::Staged(buffer) = landed
                && let Err(mpsc::SendError(buffer)) = return_txs[reader].send(buffer)
            {
                self.pool.put(buffer);
            }
        };
        let mut waiting: BTreeMap<usize, ReadPart> = BTreeMap::new();
        let mut verified = 0;
        let mut crc = 0u32;
        for read in read_rx {
            if stop.load(Ordering::Relaxed) {
                give_back(read.reader, read.landed);
                continue;
            }
            waiting.insert(read.index, read);
            while let Some(mut read) = waiting.remove(&verified) {
                let part = parts[verified];
                let checked = self.check(part, &mut read.landed, &mut crc);
                give_back(read.reader, read.landed);
                if let Err(error) = checked {
                    fail(error);
                    break;
                }
                verified += 1;
            }
            if stop.load(Ordering::Relaxed) {
                std::mem::take(&mut waiting)
                    .into_values()
                    .for_each(|read| give_back(read.reader, read.landed));
            }
        }
        verified
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
            for (range, at) in pieces(self.runs, part.offset, part.len) {
                self.device.copy_from_host(buffer, at, range)?.wait()?;
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
    /// when the device has no host views or a range does not suit O_DIRECT.
    fn views(&self, part: Part) -> Result<Option<Vec<(HostView, usize)>>, StoreError> {
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
            match self.device.host_view(range, ViewAccess::Write)? {
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
