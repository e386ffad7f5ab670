//! State that lives on disk and streams through the device bucket by bucket (optimizer-state
//! streaming, `--stream-optimizer-state-to-disk`): each bucket is one tag of the disk store
//! (checksummed chunks, O_DIRECT where the filesystem allows), staged through one of a few
//! device slots.
//!
//! A walk over the buckets keeps the disk busy while the device computes: a reader thread
//! loads bucket k+1 (disk → pinned staging → its slot) while the caller updates bucket k on
//! the device and a writer thread waits for bucket k-1's update and writes it back. Bucket k
//! always uses slot `k % slots`, so it is read back into the range it was saved from (as the
//! store checks), and a slot is read into only once the bucket it held last is written.

use std::sync::Arc;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use crate::device::{AddressRange, Device, Fence};
use crate::memory::MemoryTag;

use super::{DiskBackup, DiskStore, StoreError};

/// Device slots a walk keeps busy: the bucket being read, the one being updated, the one being
/// written.
pub const STREAM_SLOTS: usize = 3;

/// What one walk moved and how long its caller waited for the disk.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StreamStats {
    /// Bytes read from disk (verified).
    pub bytes_read: u64,
    /// Bytes written to disk.
    pub bytes_written: u64,
    /// Seconds the walk waited for a read or a write to finish.
    pub wait_seconds: f64,
}

impl StreamStats {
    /// Adds `other`'s bytes and seconds to these.
    pub fn add(&mut self, other: &StreamStats) {
        self.bytes_read += other.bytes_read;
        self.bytes_written += other.bytes_written;
        self.wait_seconds += other.wait_seconds;
    }
}

/// Buckets of state on disk, each staged through a device slot when read or written.
#[derive(Debug)]
pub struct BucketStream {
    store: Arc<DiskStore>,
    device: Arc<dyn Device>,
    /// Committed device ranges, each at least as long as the longest bucket.
    slots: Vec<AddressRange>,
    /// Bytes of each bucket.
    sizes: Vec<usize>,
    /// The last write of each bucket; `None` before the first or after a failed one.
    backups: Vec<Option<DiskBackup>>,
}

/// A read job: the bucket, its slot, its backup (handed back with the outcome).
type ReadJob = (usize, AddressRange, Option<DiskBackup>);
/// A write job: the bucket, its slot, the fence of its update.
type WriteJob = (usize, AddressRange, Fence);

impl BucketStream {
    /// Buckets of `sizes` bytes written to `store`, staged through the device ranges `slots`
    /// of `device`. Nothing is on disk until each bucket is [`write`](Self::write)n once.
    pub fn new(
        store: Arc<DiskStore>,
        device: Arc<dyn Device>,
        slots: Vec<AddressRange>,
        sizes: Vec<usize>,
    ) -> BucketStream {
        BucketStream {
            store,
            device,
            slots,
            backups: sizes.iter().map(|_| None).collect(),
            sizes,
        }
    }

    /// Number of buckets.
    pub fn buckets(&self) -> usize {
        self.sizes.len()
    }

    /// The device range staging `bucket`: the first bytes of its slot.
    ///
    /// # Errors
    /// [`StoreError::Device`] when the slot is shorter than the bucket;
    /// [`StoreError::StreamBucketLost`] when there is no slot.
    pub fn slot(&self, bucket: usize) -> Result<AddressRange, StoreError> {
        let Some(slot) = self.slots.get(bucket % self.slots.len().max(1)) else {
            return Err(lost(&self.store, bucket, "no device slot stages it"));
        };
        Ok(slot.slice(0, self.sizes[bucket])?)
    }

    /// Writes `bucket` from its slot to disk and waits for it; returns the bytes written.
    ///
    /// # Errors
    /// As [`DiskStore::save`]; the bucket is not on disk then.
    pub fn write(&mut self, bucket: usize) -> Result<u64, StoreError> {
        let slot = self.slot(bucket)?;
        self.backups[bucket] = None;
        let backup = save(&self.store, &*self.device, bucket, slot)?;
        let bytes = backup.bytes();
        self.backups[bucket] = Some(backup);
        Ok(bytes)
    }

    /// Reads `bucket` from disk into its slot, verified, and waits for it.
    ///
    /// # Errors
    /// [`StoreError::StreamBucketLost`] for a bucket not on disk; as [`DiskStore::load`].
    pub fn read(&self, bucket: usize) -> Result<(), StoreError> {
        load(
            &self.store,
            &*self.device,
            bucket,
            self.slot(bucket)?,
            self.backups[bucket].as_ref(),
        )
    }

    /// Walks every bucket in order: reads it into its slot, calls `update(bucket, slot)` (which
    /// queues its work on the device and returns a fence after it), then writes the slot back
    /// once the fence signals, with the next read and the previous write in flight meanwhile.
    ///
    /// On the first failure the walk stops: no later bucket is updated, the writes of the
    /// buckets updated so far finish (so what is on disk matches what was updated), and the
    /// error is returned. A bucket whose read fails keeps its files (see [`DiskStore::load`]);
    /// one whose write fails is lost (its next read fails with
    /// [`StoreError::StreamBucketLost`]).
    ///
    /// # Errors
    /// The first error of a read, an update or a write.
    pub fn walk<E: From<StoreError>>(
        &mut self,
        mut update: impl FnMut(usize, AddressRange) -> Result<Fence, E>,
    ) -> Result<StreamStats, E> {
        let n = self.sizes.len();
        let mut stats = StreamStats::default();
        if n == 0 {
            return Ok(stats);
        }
        let slots = (0..n)
            .map(|k| self.slot(k))
            .collect::<Result<Vec<_>, _>>()?;
        let depth = self.slots.len().max(1);
        let (store, device) = (&*self.store, &*self.device);
        let mut backups = std::mem::take(&mut self.backups);
        let mut first_error: Option<E> = None;
        thread::scope(|scope| {
            let (read_tx, read_rx) = mpsc::channel::<ReadJob>();
            let (read_done_tx, read_done) = mpsc::channel();
            let (write_tx, write_rx) = mpsc::channel::<WriteJob>();
            let (write_done_tx, write_done) = mpsc::channel();
            let reader = scope.spawn(move || {
                for (k, slot, backup) in read_rx {
                    let result = load(store, device, k, slot, backup.as_ref());
                    if read_done_tx.send((k, backup, result)).is_err() {
                        return;
                    }
                }
            });
            let writer = scope.spawn(move || {
                for (k, slot, fence) in write_rx {
                    let result = fence
                        .wait()
                        .map_err(StoreError::from)
                        .and_then(|()| save(store, device, k, slot));
                    if write_done_tx.send((k, result)).is_err() {
                        return;
                    }
                }
            });
            let mut waited = Duration::ZERO;
            let (mut reads_sent, mut writes_sent, mut writes_done) = (0usize, 0usize, 0usize);
            // Takes write completions in order until `count` writes are done.
            let mut finish_writes = |count: usize,
                                     backups: &mut Vec<Option<DiskBackup>>,
                                     stats: &mut StreamStats,
                                     waited: &mut Duration|
             -> Result<(), StoreError> {
                let mut first = None;
                while writes_done < count {
                    let started = Instant::now();
                    let done = write_done.recv();
                    *waited += started.elapsed();
                    let Ok((k, result)) = done else {
                        first.get_or_insert(lost(store, writes_done, "its writer thread died"));
                        break;
                    };
                    writes_done += 1;
                    match result {
                        Ok(backup) => {
                            stats.bytes_written += backup.bytes();
                            backups[k] = Some(backup);
                        }
                        Err(error) => {
                            first.get_or_insert(error);
                        }
                    }
                }
                first.map_or(Ok(()), Err)
            };
            let mut send_read = |k: usize, backups: &mut Vec<Option<DiskBackup>>| {
                reads_sent += 1;
                read_tx.send((k, slots[k], backups[k].take())).is_ok()
            };
            send_read(0, &mut backups);
            for k in 0..n {
                let started = Instant::now();
                let done = read_done.recv();
                waited += started.elapsed();
                let read = match done {
                    Ok((bucket, backup, result)) => {
                        debug_assert_eq!(bucket, k, "reads finish in order");
                        backups[bucket] = backup;
                        result
                    }
                    Err(_) => Err(lost(store, k, "its reader thread died")),
                };
                if let Err(error) = read {
                    first_error = Some(error.into());
                    break;
                }
                stats.bytes_read += self.sizes[k] as u64;
                let fence = match update(k, slots[k]) {
                    Ok(fence) => fence,
                    Err(error) => {
                        first_error = Some(error);
                        break;
                    }
                };
                backups[k] = None;
                writes_sent += 1;
                if write_tx.send((k, slots[k], fence)).is_err() {
                    first_error = Some(lost(store, k, "its writer thread died").into());
                    break;
                }
                if k + 1 < n {
                    // Slot of k + 1 held bucket k + 1 - depth last: it must be on disk first.
                    let due = (k + 1).saturating_sub(depth - 1).min(writes_sent);
                    if let Err(error) = finish_writes(due, &mut backups, &mut stats, &mut waited) {
                        first_error = Some(error.into());
                        break;
                    }
                    if !send_read(k + 1, &mut backups) {
                        first_error = Some(lost(store, k + 1, "its reader thread died").into());
                        break;
                    }
                }
            }
            drop(read_tx);
            drop(write_tx);
            if let Err(error) = finish_writes(writes_sent, &mut backups, &mut stats, &mut waited)
                && first_error.is_none()
            {
                first_error = Some(error.into());
            }
            // A read sent but not waited for (the walk stopped early) hands its backup back.
            for (bucket, backup, _) in read_done.iter() {
                backups[bucket] = backup;
            }
            for handle in [reader, writer] {
                if handle.join().is_err() && first_error.is_none() {
                    let bucket = reads_sent.saturating_sub(1);
                    first_error = Some(lost(store, bucket, "a streaming thread panicked").into());
                }
            }
            stats.wait_seconds = waited.as_secs_f64();
        });
        self.backups = backups;
        match first_error {
            Some(error) => Err(error),
            None => Ok(stats),
        }
    }
}

fn bucket_tag(bucket: usize) -> MemoryTag {
    MemoryTag::Named(format!("optimizer-bucket-{bucket:05}"))
}

fn lost(store: &DiskStore, bucket: usize, reason: &'static str) -> StoreError {
    StoreError::StreamBucketLost {
        dir: store.root().to_path_buf(),
        bucket,
        reason,
    }
}

fn save(
    store: &DiskStore,
    device: &dyn Device,
    bucket: usize,
    slot: AddressRange,
) -> Result<DiskBackup, StoreError> {
    store.save(device, &bucket_tag(bucket), &[slot])
}

fn load(
    store: &DiskStore,
    device: &dyn Device,
    bucket: usize,
    slot: AddressRange,
    backup: Option<&DiskBackup>,
) -> Result<(), StoreError> {
    match backup {
        Some(backup) => store.load(device, backup, &[slot]),
        None => Err(lost(store, bucket, "its last write failed")),
    }
}

#[cfg(test)]
mod tests {
    use rand::{RngExt, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::device::CpuDevice;
    use crate::store::HostPool;

    const BUCKET: usize = 8192;

    /// Seven buckets (the last one short) over three slots of a CPU device, each written once
    /// with seeded bytes.
    struct Bench {
        stream: BucketStream,
        device: Arc<dyn Device>,
        expected: Vec<Vec<u8>>,
        dir: tempfile::TempDir,
    }

    impl Bench {
        fn new(seed: u64) -> Bench {
            let device: Arc<dyn Device> = Arc::new(CpuDevice::new(16 << 20));
            let arena = device.reserve(2 << 20).unwrap();
            device.commit(arena).unwrap();
            let slots = (0..STREAM_SLOTS)
                .map(|i| arena.slice(i * BUCKET, BUCKET).unwrap())
                .collect();
            let sizes: Vec<usize> = (0..7).map(|k| if k == 6 { 4096 } else { BUCKET }).collect();
            let dir = tempfile::tempdir().unwrap();
            let pool = Arc::new(HostPool::new(Arc::clone(&device)));
            let store = Arc::new(DiskStore::new(dir.path(), 0, BUCKET, pool).unwrap());
            let mut stream = BucketStream::new(store, Arc::clone(&device), slots, sizes.clone());
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let mut expected = Vec::new();
            for (k, &size) in sizes.iter().enumerate() {
                let bytes: Vec<u8> = (0..size).map(|_| rng.random()).collect();
                device.write(&bytes, stream.slot(k).unwrap()).unwrap();
                assert_eq!(stream.write(k).unwrap(), size as u64);
                expected.push(bytes);
            }
            Bench {
                stream,
                device,
                expected,
                dir,
            }
        }

        /// One walk that adds `k + 1` to every byte of bucket `k`; returns the buckets it
        /// updated.
        fn walk(&mut self) -> (Result<StreamStats, StoreError>, Vec<usize>) {
            let device = Arc::clone(&self.device);
            let mut updated = Vec::new();
            let result = self.stream.walk(|k, slot| -> Result<Fence, StoreError> {
                let mut bytes = vec![0u8; slot.len];
                device.read(slot, &mut bytes)?;
                bytes
                    .iter_mut()
                    .for_each(|b| *b = b.wrapping_add(k as u8 + 1));
                device.write(&bytes, slot)?;
                updated.push(k);
                Ok(Fence::signalled())
            });
            (result, updated)
        }

        fn check_on_disk(&self) {
            for (k, want) in self.expected.iter().enumerate() {
                self.stream.read(k).unwrap();
                let mut got = vec![0u8; want.len()];
                self.device
                    .read(self.stream.slot(k).unwrap(), &mut got)
                    .unwrap();
                assert!(got == *want, "bucket {k} differs from what was written");
            }
        }

        fn bump(&mut self, buckets: std::ops::Range<usize>) {
            for k in buckets {
                let add = k as u8 + 1;
                self.expected[k]
                    .iter_mut()
                    .for_each(|b| *b = b.wrapping_add(add));
            }
        }
    }

    #[test]
    fn walks_update_every_bucket_once_and_write_it_back_over_several_steps() {
        let mut bench = Bench::new(71);
        let total: u64 = bench.expected.iter().map(|b| b.len() as u64).sum();
        for _ in 0..3 {
            let (stats, updated) = bench.walk();
            let stats = stats.unwrap();
            assert_eq!(updated, (0..7).collect::<Vec<_>>());
            assert_eq!((stats.bytes_read, stats.bytes_written), (total, total));
            assert!(stats.wait_seconds >= 0.0);
            bench.bump(0..7);
        }
        bench.check_on_disk();
    }

    #[test]
    fn a_corrupted_bucket_stops_the_walk_before_its_update_and_keeps_the_others_consistent() {
        let mut bench = Bench::new(72);
        let data = bench
            .dir
            .path()
            .join("offload/rank-0/named-optimizer-bucket-00003/data.bin");
        let mut bytes = std::fs::read(&data).unwrap();
        bytes[100] ^= 0x40;
        std::fs::write(&data, bytes).unwrap();
        let (result, updated) = bench.walk();
        let err = result.unwrap_err();
        assert!(matches!(err, StoreError::ChecksumMismatch { .. }), "{err}");
        assert!(err.to_string().contains("checksum mismatch"), "{err}");
        assert_eq!(
            updated,
            [0, 1, 2],
            "no bucket from the corrupted one on is updated"
        );
        // The buckets before it were written back updated; the corrupted one's files are kept.
        bench.bump(0..3);
        for k in [0, 1, 2, 4, 5, 6] {
            bench.stream.read(k).unwrap();
            let mut got = vec![0u8; bench.expected[k].len()];
            bench
                .device
                .read(bench.stream.slot(k).unwrap(), &mut got)
                .unwrap();
            assert!(got == bench.expected[k], "bucket {k} differs");
        }
        assert!(data.exists(), "the corrupted bucket's file is kept");
        assert!(matches!(
            bench.stream.read(3),
            Err(StoreError::ChecksumMismatch { .. })
        ));
    }

    #[test]
    fn a_bucket_never_written_is_reported_lost_by_name() {
        let device: Arc<dyn Device> = Arc::new(CpuDevice::new(4 << 20));
        let arena = device.reserve(2 << 20).unwrap();
        device.commit(arena).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let pool = Arc::new(HostPool::new(Arc::clone(&device)));
        let store = Arc::new(DiskStore::new(dir.path(), 0, BUCKET, pool).unwrap());
        let slots = vec![arena.slice(0, BUCKET).unwrap()];
        let mut stream = BucketStream::new(store, device, slots, vec![BUCKET, BUCKET]);
        let err = stream
            .walk(|_, _| -> Result<Fence, StoreError> { Ok(Fence::signalled()) })
            .unwrap_err();
        assert!(
            matches!(err, StoreError::StreamBucketLost { bucket: 0, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("--load"), "{err}");
    }
}
