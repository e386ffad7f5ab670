//! State that lives on disk and streams through the device bucket by bucket (optimizer-state
//! streaming, `--stream-optimizer-state-to-disk`): each bucket is one tag of the disk store
//! (checksummed chunks, O_DIRECT where the filesystem allows), staged in a pinned host buffer
//! between the disk and the device, and in one of a few device slots while it is updated.
//!
//! One disk thread per stream does every read and write, one at a time: the writes queued
//! first, in order, then the reads. On the H200 machine's virtio disk a read and a write
//! running at once moved 0.77-0.86x of what a plain write then read does (2026-12-04), so the
//! thread never mixes them.
//!
//! A walk takes each bucket's host copy as it lands, copies it into the bucket's slot, lets the
//! caller update it there, copies it back and queues its write; it returns with its last writes
//! still queued (written behind). The host buffers are the read-ahead: at least
//! [`MIN_HOST_BUCKETS`], more within a host budget. [`BucketStream::prefetch`], called before the
//! step's forward pass, lets the thread read the next walk's buckets while the device computes,
//! and each buffer a finished write frees takes the next read. With a budget that holds the
//! whole state, a step's disk work overlaps its compute.
//!
//! Bucket k always uses slot `k % slots`, so it is saved from, and read back for, the same
//! device range (as the store checks).

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::device::{AddressRange, Device, Fence, HostBuffer};
use crate::memory::MemoryTag;

use super::{DiskBackup, DiskStore, HostPool, StoreError};

/// Device slots a walk uses: the bucket being copied in, the one being updated, the one being
/// copied out.
pub const STREAM_SLOTS: usize = 3;

/// Host buffers a stream holds at the least: one landed ahead of the walk, one being read, one
/// being updated, one being written.
pub const MIN_HOST_BUCKETS: usize = 4;

/// The disk store's chunk for buckets of `bucket_bytes`: a quarter of a bucket (a multiple of
/// 4096 bytes), so that a bucket's save and load overlap their checksums and copies with the
/// disk's transfers.
pub fn stream_chunk_bytes(bucket_bytes: usize) -> usize {
    (bucket_bytes / 4).next_multiple_of(4096).max(4096)
}

/// What one walk moved and how long its caller waited for the disk.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StreamStats {
    /// Bytes read from disk (verified) for the walk.
    pub bytes_read: u64,
    /// Bytes the walk queued for writing (written behind it; a failed write fails the next
    /// walk).
    pub bytes_written: u64,
    /// Seconds the walk waited for a read to land (or, after a failure, for the writes).
    pub wait_seconds: f64,
    /// Seconds the disk thread spent reading and writing since the walk before returned: with
    /// the writes behind one walk and the reads ahead of the next, one step's disk time.
    pub disk_seconds: f64,
}

impl StreamStats {
    /// Adds `other`'s bytes and seconds to these.
    pub fn add(&mut self, other: &StreamStats) {
        self.bytes_read += other.bytes_read;
        self.bytes_written += other.bytes_written;
        self.wait_seconds += other.wait_seconds;
        self.disk_seconds += other.disk_seconds;
    }
}

/// Buckets of state on disk, read and written by a disk thread of their own, each staged
/// through host memory and a device slot.
#[derive(Debug)]
pub struct BucketStream {
    device: Arc<dyn Device>,
    /// The rank directory, for errors.
    root: PathBuf,
    /// Committed device ranges, each at least as long as the longest bucket.
    slots: Vec<AddressRange>,
    /// Bytes of each bucket.
    sizes: Vec<usize>,
    jobs: mpsc::Sender<Job>,
    shared: Arc<Shared>,
    main: Mutex<Main>,
    thread: Option<JoinHandle<()>>,
}

/// What the disk thread and the stream share.
#[derive(Debug, Default)]
struct Shared {
    /// Nanoseconds the thread has spent reading and writing.
    busy_nanos: AtomicU64,
    /// Set when the stream drops: queued work is abandoned and a write in progress stops.
    stop: AtomicBool,
}

/// The stream's side of the conversation with its disk thread.
#[derive(Debug)]
struct Main {
    replies: mpsc::Receiver<Reply>,
    written: mpsc::Receiver<(usize, Result<u64, StoreError>)>,
    /// Whether the thread reads ahead for the next walk.
    reading: bool,
    /// The first write behind that failed since the last walk.
    failed: Option<StoreError>,
    /// The thread's busy nanoseconds when the last walk returned.
    busy_mark: u64,
}

/// Work for the disk thread.
enum Job {
    /// Read every bucket in order into host buffers, as the budget allows, for the next walk.
    ReadAhead,
    /// Stop reading ahead; answered by [`Reply::ReadingStopped`] after the last read landed.
    StopReading,
    /// Write `bucket` from `buffer` (a walk's update), then reuse the buffer.
    Write { bucket: usize, buffer: HostBuffer },
    /// Write `bucket` from its slot; answered by [`Reply::SlotWritten`].
    WriteSlot(usize),
    /// Read `bucket` into its slot; answered by [`Reply::Read`].
    Read(usize),
    /// The buffer of `bucket`'s read that the walk did not use.
    Return { bucket: usize, buffer: HostBuffer },
    /// Answer [`Reply::Flushed`] once every write queued before is done.
    Flush,
    /// Fail the next write of a bucket (tests of the failure path).
    #[cfg(test)]
    FailWrite(usize),
    /// End the thread, abandoning queued work.
    Shutdown,
}

/// What the disk thread tells the stream (finished writes behind a walk go on their own
/// channel).
enum Reply {
    Landed {
        bucket: usize,
        result: Result<HostBuffer, StoreError>,
    },
    Read {
        bucket: usize,
        result: Result<(), StoreError>,
    },
    SlotWritten {
        bucket: usize,
        result: Result<u64, StoreError>,
    },
    ReadingStopped,
    Flushed,
}

impl BucketStream {
    /// Buckets of `sizes` bytes written to `store`, staged through the device ranges `slots`
    /// of `device` and through host buffers: [`MIN_HOST_BUCKETS`], or as many buckets as
    /// `host_budget_bytes` holds. Nothing is on disk until each bucket is
    /// [`write`](Self::write)n once.
    ///
    /// # Errors
    /// [`StoreError::Io`] when the disk thread cannot start.
    pub fn new(
        store: Arc<DiskStore>,
        device: Arc<dyn Device>,
        slots: Vec<AddressRange>,
        sizes: Vec<usize>,
        host_budget_bytes: u64,
    ) -> Result<BucketStream, StoreError> {
        let root = store.root().to_path_buf();
        let widest = sizes.iter().copied().max().unwrap_or(0);
        let limit = usize::try_from(host_budget_bytes / widest.max(1) as u64)
            .unwrap_or(usize::MAX)
            .max(MIN_HOST_BUCKETS);
        let runs = (0..sizes.len())
            .map(|k| slot_of(&slots, &sizes, &root, k))
            .collect::<Result<Vec<_>, _>>()?;
        let (jobs, job_rx) = mpsc::channel();
        let (reply_tx, replies) = mpsc::channel();
        let (written_tx, written) = mpsc::channel();
        let shared = Arc::new(Shared::default());
        let disk = DiskThread {
            pool: HostPool::new(Arc::clone(&device)),
            backups: sizes.iter().map(|_| None).collect(),
            store,
            device: Arc::clone(&device),
            runs,
            limit,
            widest,
            kept: BTreeMap::new(),
            held: 0,
            cursor: None,
            writes: VecDeque::new(),
            reads: VecDeque::new(),
            flush: false,
            replies: reply_tx,
            written: written_tx,
            shared: Arc::clone(&shared),
            #[cfg(test)]
            fail_write: None,
        };
        let thread = std::thread::Builder::new()
            .name("miles-stream-disk".to_string())
            .spawn(move || disk.run(job_rx))
            .map_err(|source| StoreError::Io {
                action: "start the disk thread of the streamed state under".to_string(),
                path: root.clone(),
                source,
            })?;
        tracing::debug!(
            buckets = sizes.len(),
            host_buckets = limit,
            "bucket stream ready"
        );
        Ok(BucketStream {
            device,
            root,
            slots,
            sizes,
            jobs,
            shared,
            main: Mutex::new(Main {
                replies,
                written,
                reading: false,
                failed: None,
                busy_mark: 0,
            }),
            thread: Some(thread),
        })
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
        slot_of(&self.slots, &self.sizes, &self.root, bucket)
    }

    /// Writes `bucket` from its slot to disk (after the writes queued before) and waits for
    /// it; returns the bytes written.
    ///
    /// # Errors
    /// As [`DiskStore::save`]; the bucket is not on disk then.
    pub fn write(&self, bucket: usize) -> Result<u64, StoreError> {
        match self.ask(Job::WriteSlot(bucket), bucket)? {
            Reply::SlotWritten { bucket: b, result } if b == bucket => result,
            _ => Err(out_of_order(&self.root, bucket)),
        }
    }

    /// Reads `bucket` from disk into its slot, verified (after the writes queued before), and
    /// waits for it. A bucket whose write behind failed is read from its host copy.
    ///
    /// # Errors
    /// [`StoreError::StreamBucketLost`] for a bucket not on disk; as [`DiskStore::load`].
    pub fn read(&self, bucket: usize) -> Result<(), StoreError> {
        match self.ask(Job::Read(bucket), bucket)? {
            Reply::Read { bucket: b, result } if b == bucket => result,
            _ => Err(out_of_order(&self.root, bucket)),
        }
    }

    /// Lets the disk thread read the next walk's buckets ahead (after the writes queued
    /// before), as far as the host buffers allow; the walk takes them as they land. Call it
    /// before the work that precedes the walk (the forward and backward passes).
    ///
    /// # Errors
    /// [`StoreError::StreamBucketLost`] when the disk thread is gone.
    pub fn prefetch(&self) -> Result<(), StoreError> {
        let mut main = self.lock();
        self.start_reading(&mut main)
    }

    /// Walks every bucket in order: takes its host copy as it lands, copies it into its slot,
    /// calls `update(bucket, slot)` (which queues its work on the device and returns a fence
    /// after it), copies the slot back once the fence signals and queues its write; returns
    /// with the last writes still queued.
    ///
    /// A failed write behind the walk before fails this walk before any update (the bucket's
    /// host copy is kept, and this walk's successor updates and writes it again). On the first
    /// failure of a read, an update or a device copy the walk stops: no later bucket is
    /// updated, the writes of the buckets updated so far finish (so what is on disk matches
    /// what was updated), and the error is returned. A bucket whose read fails keeps its files
    /// (see [`DiskStore::load`]).
    ///
    /// # Errors
    /// [`StoreError::StreamWriteFailed`] for a failed write behind; the first error of a read,
    /// an update or a device copy.
    pub fn walk<E: From<StoreError>>(
        &mut self,
        mut update: impl FnMut(usize, AddressRange) -> Result<Fence, E>,
    ) -> Result<StreamStats, E> {
        let mut main = self.lock();
        let mut stats = StreamStats::default();
        let mut waited = Duration::ZERO;
        self.start_reading(&mut main)?;
        let mut outcome: Result<(), E> = Ok(());
        for k in 0..self.sizes.len() {
            let landed = match self.reply(&mut main, k, &mut waited) {
                Ok(Reply::Landed { bucket, result }) if bucket == k => result,
                Ok(_) => Err(out_of_order(&self.root, k)),
                Err(error) => Err(error),
            };
            let mut buffer = match landed {
                Ok(buffer) => buffer,
                Err(error) => {
                    outcome = Err(error.into());
                    break;
                }
            };
            // The thread writes before it reads, so every write behind the walk before is done
            // once the first bucket lands: a failed one fails this walk before any update.
            if k == 0
                && let Some(error) = main.failed.take()
            {
                self.send(Job::Return { bucket: k, buffer }, k)?;
                outcome = Err(error.into());
                break;
            }
            stats.bytes_read += self.sizes[k] as u64;
            if let Err(error) = self.update_in_slot(k, &mut buffer, &mut update) {
                self.send(Job::Return { bucket: k, buffer }, k)?;
                outcome = Err(error);
                break;
            }
            self.send(Job::Write { bucket: k, buffer }, k)?;
            stats.bytes_written += self.sizes[k] as u64;
        }
        if outcome.is_ok() {
            // The thread's reads ended with the last bucket.
            main.reading = false;
        } else {
            // The reads ahead of the failure are given back; what was updated reaches disk.
            let last = self.sizes.len().saturating_sub(1);
            self.stop_reading(&mut main, last)?;
            self.flush(&mut main, &mut waited)?;
        }
        let busy = self.shared.busy_nanos.load(Ordering::Relaxed);
        stats.disk_seconds = busy.saturating_sub(main.busy_mark) as f64 * 1e-9;
        main.busy_mark = busy;
        stats.wait_seconds = waited.as_secs_f64();
        outcome.map(|()| stats)
    }

    /// Copies `buffer` into bucket `k`'s slot, runs `update` there and copies the slot back.
    fn update_in_slot<E: From<StoreError>>(
        &self,
        k: usize,
        buffer: &mut HostBuffer,
        update: &mut impl FnMut(usize, AddressRange) -> Result<Fence, E>,
    ) -> Result<(), E> {
        let slot = self.slot(k)?;
        let copied_in = self.device.copy_from_host(buffer, 0, slot);
        copied_in
            .and_then(|fence| fence.wait())
            .map_err(StoreError::from)?;
        update(k, slot)?.wait().map_err(StoreError::from)?;
        let copied_out = self.device.copy_to_host(slot, buffer, 0);
        copied_out
            .and_then(|fence| fence.wait())
            .map_err(StoreError::from)?;
        Ok(())
    }

    /// Stops the reads ahead, sends `job` about `bucket` and waits for its reply.
    fn ask(&self, job: Job, bucket: usize) -> Result<Reply, StoreError> {
        let mut main = self.lock();
        self.stop_reading(&mut main, bucket)?;
        self.send(job, bucket)?;
        self.reply(&mut main, bucket, &mut Duration::default())
    }

    fn lock(&self) -> MutexGuard<'_, Main> {
        self.main.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn send(&self, job: Job, bucket: usize) -> Result<(), StoreError> {
        self.jobs
            .send(job)
            .map_err(|_| lost(&self.root, bucket, "its disk thread stopped"))
    }

    /// The thread's next reply (finished writes behind a walk are noted meanwhile).
    fn reply(
        &self,
        main: &mut Main,
        bucket: usize,
        waited: &mut Duration,
    ) -> Result<Reply, StoreError> {
        let started = Instant::now();
        let reply = main.replies.recv();
        *waited += started.elapsed();
        main.note_written();
        reply.map_err(|_| lost(&self.root, bucket, "its disk thread stopped"))
    }

    fn start_reading(&self, main: &mut Main) -> Result<(), StoreError> {
        if !main.reading {
            self.send(Job::ReadAhead, 0)?;
            main.reading = true;
        }
        Ok(())
    }

    /// Stops the reads ahead and gives back the buffers of those that landed.
    fn stop_reading(&self, main: &mut Main, bucket: usize) -> Result<(), StoreError> {
        if !main.reading {
            return Ok(());
        }
        self.send(Job::StopReading, bucket)?;
        loop {
            match self.reply(main, bucket, &mut Duration::default())? {
                Reply::Landed {
                    bucket: landed,
                    result: Ok(buffer),
                } => self.send(
                    Job::Return {
                        bucket: landed,
                        buffer,
                    },
                    bucket,
                )?,
                Reply::ReadingStopped => break,
                _ => {}
            }
        }
        main.reading = false;
        Ok(())
    }

    /// Waits until every write queued so far is done.
    fn flush(&self, main: &mut Main, waited: &mut Duration) -> Result<(), StoreError> {
        let last = self.sizes.len().saturating_sub(1);
        self.send(Job::Flush, last)?;
        while !matches!(self.reply(main, last, waited)?, Reply::Flushed) {}
        main.note_written();
        Ok(())
    }

    /// Makes the next write of `bucket` fail (tests of the failure path).
    #[cfg(test)]
    fn fail_next_write(&self, bucket: usize) {
        self.send(Job::FailWrite(bucket), bucket).unwrap();
    }
}

impl Main {
    /// Takes the outcomes of the writes behind that finished; keeps the first failure.
    fn note_written(&mut self) {
        while let Ok((bucket, result)) = self.written.try_recv() {
            if let Err(error) = result {
                self.failed.get_or_insert(StoreError::StreamWriteFailed {
                    bucket,
                    source: Box::new(error),
                });
            }
        }
    }
}

impl Drop for BucketStream {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // A thread that is gone needs no notice.
        let _ = self.jobs.send(Job::Shutdown);
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            tracing::error!(dir = %self.root.display(), "the stream's disk thread panicked");
        }
    }
}

/// The disk thread's state.
struct DiskThread {
    store: Arc<DiskStore>,
    device: Arc<dyn Device>,
    pool: HostPool,
    /// Each bucket's device range (its slot's first bytes), as its manifest records it.
    runs: Vec<AddressRange>,
    /// Host buffers the reads ahead may hold.
    limit: usize,
    /// Bytes of the largest bucket: every buffer's length.
    widest: usize,
    /// The last write of each bucket; `None` before the first or after a failed one.
    backups: Vec<Option<DiskBackup>>,
    /// Host copies of buckets whose write behind failed: their newest bytes.
    kept: BTreeMap<usize, HostBuffer>,
    /// Buffers out of the pool for reads ahead and writes behind.
    held: usize,
    /// The next bucket to read ahead, while reading ahead.
    cursor: Option<usize>,
    /// Writes in the order queued: a walk's (bucket and buffer) or a slot's (bucket).
    writes: VecDeque<(usize, Option<HostBuffer>)>,
    /// Reads into a slot, in the order asked.
    reads: VecDeque<usize>,
    /// A flush waits for the writes queued before it.
    flush: bool,
    replies: mpsc::Sender<Reply>,
    written: mpsc::Sender<(usize, Result<u64, StoreError>)>,
    shared: Arc<Shared>,
    #[cfg(test)]
    fail_write: Option<usize>,
}

impl DiskThread {
    fn run(mut self, jobs: mpsc::Receiver<Job>) {
        loop {
            let job = if self.has_work() {
                match jobs.try_recv() {
                    Ok(job) => Some(job),
                    Err(mpsc::TryRecvError::Empty) => None,
                    Err(mpsc::TryRecvError::Disconnected) => return,
                }
            } else {
                match jobs.recv() {
                    Ok(job) => Some(job),
                    Err(_) => return,
                }
            };
            if self.shared.stop.load(Ordering::SeqCst) {
                return;
            }
            let sent = match job {
                Some(Job::Shutdown) => return,
                Some(job) => self.accept(job),
                None => self.work(),
            };
            if sent.is_err() {
                return;
            }
        }
    }

    /// Whether a write, a read or a read ahead can go now.
    fn has_work(&self) -> bool {
        !self.writes.is_empty()
            || !self.reads.is_empty()
            || (self.cursor.is_some() && self.held < self.limit)
    }

    /// Takes a job; `Err` once the stream is gone.
    fn accept(&mut self, job: Job) -> Result<(), ()> {
        match job {
            Job::ReadAhead => self.cursor = (!self.runs.is_empty()).then_some(0),
            Job::StopReading => {
                self.cursor = None;
                self.replies.send(Reply::ReadingStopped).map_err(drop)?;
            }
            Job::Write { bucket, buffer } => self.writes.push_back((bucket, Some(buffer))),
            Job::WriteSlot(bucket) => self.writes.push_back((bucket, None)),
            Job::Read(bucket) => self.reads.push_back(bucket),
            Job::Return { bucket, buffer } => self.take_back(bucket, buffer),
            Job::Flush => self.flush = true,
            #[cfg(test)]
            Job::FailWrite(bucket) => self.fail_write = Some(bucket),
            Job::Shutdown => {}
        }
        self.answer_flush()
    }

    /// Does the next piece of work: a write, else a read into a slot, else a read ahead.
    fn work(&mut self) -> Result<(), ()> {
        if let Some((bucket, buffer)) = self.writes.pop_front() {
            match buffer {
                Some(buffer) => self.write_behind(bucket, buffer)?,
                None => {
                    let result = self.write_slot(bucket);
                    self.replies
                        .send(Reply::SlotWritten { bucket, result })
                        .map_err(drop)?;
                }
            }
            return self.answer_flush();
        }
        if let Some(bucket) = self.reads.pop_front() {
            let result = self.read_slot(bucket);
            return self
                .replies
                .send(Reply::Read { bucket, result })
                .map_err(drop);
        }
        if let Some(bucket) = self.cursor {
            self.cursor = (bucket + 1 < self.runs.len()).then_some(bucket + 1);
            let result = self.read_ahead(bucket);
            return self
                .replies
                .send(Reply::Landed { bucket, result })
                .map_err(drop);
        }
        Ok(())
    }

    fn answer_flush(&mut self) -> Result<(), ()> {
        if self.flush && self.writes.is_empty() {
            self.flush = false;
            self.replies.send(Reply::Flushed).map_err(drop)?;
        }
        Ok(())
    }

    fn take(&mut self) -> Result<HostBuffer, StoreError> {
        let buffer = self.pool.take(self.widest)?;
        self.held += 1;
        Ok(buffer)
    }

    fn give_back(&mut self, buffer: HostBuffer) {
        self.held -= 1;
        self.pool.put(buffer);
    }

    /// Takes back the buffer of `bucket`'s read that a walk did not use: a bucket whose last
    /// write failed has no copy on disk, so the buffer (its kept host copy) is kept again.
    fn take_back(&mut self, bucket: usize, buffer: HostBuffer) {
        if self.backups[bucket].is_none() {
            self.held -= 1;
            self.kept.insert(bucket, buffer);
        } else {
            self.give_back(buffer);
        }
    }

    /// Bucket `bucket` in a host buffer: its kept host copy, or read from disk.
    fn read_ahead(&mut self, bucket: usize) -> Result<HostBuffer, StoreError> {
        if let Some(kept) = self.kept.remove(&bucket) {
            self.held += 1;
            return Ok(kept);
        }
        let mut buffer = self.take()?;
        match self.load(bucket, &mut buffer) {
            Ok(()) => Ok(buffer),
            Err(error) => {
                self.give_back(buffer);
                Err(error)
            }
        }
    }

    fn read_slot(&mut self, bucket: usize) -> Result<(), StoreError> {
        let slot = self.runs[bucket];
        if let Some(kept) = self.kept.get_mut(&bucket) {
            return Ok(self.device.copy_from_host(kept, 0, slot)?.wait()?);
        }
        let mut buffer = self.take()?;
        let result = self.load(bucket, &mut buffer).and_then(|()| {
            let copied = self.device.copy_from_host(&mut buffer, 0, slot);
            Ok(copied.and_then(|fence| fence.wait())?)
        });
        self.give_back(buffer);
        result
    }

    /// Writes a walk's update of `bucket` and tells the stream; a failed write keeps the
    /// buffer as the bucket's host copy.
    fn write_behind(&mut self, bucket: usize, buffer: HostBuffer) -> Result<(), ()> {
        let result = self.save(bucket, &buffer);
        self.held -= 1;
        match &result {
            Ok(_) => self.pool.put(buffer),
            Err(_) => {
                self.kept.insert(bucket, buffer);
            }
        }
        self.written.send((bucket, result)).map_err(drop)
    }

    fn write_slot(&mut self, bucket: usize) -> Result<u64, StoreError> {
        let mut buffer = self.take()?;
        let copied = self.device.copy_to_host(self.runs[bucket], &mut buffer, 0);
        let result = copied
            .and_then(|fence| fence.wait())
            .map_err(StoreError::from)
            .and_then(|()| self.save(bucket, &buffer));
        self.give_back(buffer);
        // The slot's bytes are newer than a kept copy, written or not.
        self.kept.remove(&bucket);
        result
    }

    fn load(&mut self, bucket: usize, buffer: &mut HostBuffer) -> Result<(), StoreError> {
        let Some(backup) = &self.backups[bucket] else {
            return Err(lost(self.store.root(), bucket, "its last write failed"));
        };
        let started = Instant::now();
        let run = self.runs[bucket];
        let result = buffer
            .as_mut_slice()
            .map_err(StoreError::from)
            .and_then(|bytes| self.store.load_host(backup, &[run], bytes));
        self.count(started);
        result
    }

    fn save(&mut self, bucket: usize, buffer: &HostBuffer) -> Result<u64, StoreError> {
        self.backups[bucket] = None;
        #[cfg(test)]
        if self.fail_write.take_if(|b| *b == bucket).is_some() {
            return Err(StoreError::Io {
                action: format!("write bucket {bucket} of"),
                path: self.store.root().to_path_buf(),
                source: std::io::Error::other("injected write fault"),
            });
        }
        let started = Instant::now();
        let run = self.runs[bucket];
        let saved = buffer
            .as_slice()
            .map_err(StoreError::from)
            .and_then(|bytes| {
                self.store
                    .save_host(&bucket_tag(bucket), bytes, &[run], &self.shared.stop)
            });
        self.count(started);
        match saved? {
            Some(backup) => {
                let bytes = backup.bytes();
                self.backups[bucket] = Some(backup);
                Ok(bytes)
            }
            None => Err(StoreError::Stopped),
        }
    }

    fn count(&self, started: Instant) {
        let nanos = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.shared.busy_nanos.fetch_add(nanos, Ordering::Relaxed);
    }
}

fn slot_of(
    slots: &[AddressRange],
    sizes: &[usize],
    root: &Path,
    bucket: usize,
) -> Result<AddressRange, StoreError> {
    let Some(slot) = slots.get(bucket % slots.len().max(1)) else {
        return Err(lost(root, bucket, "no device slot stages it"));
    };
    Ok(slot.slice(0, sizes[bucket])?)
}

fn bucket_tag(bucket: usize) -> MemoryTag {
    MemoryTag::Named(format!("optimizer-bucket-{bucket:05}"))
}

fn out_of_order(root: &Path, bucket: usize) -> StoreError {
    lost(root, bucket, "its disk thread answered out of order")
}

fn lost(root: &Path, bucket: usize, reason: &'static str) -> StoreError {
    StoreError::StreamBucketLost {
        dir: root.to_path_buf(),
        bucket,
        reason,
    }
}

#[cfg(test)]
mod tests {
    use rand::{RngExt, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::device::CpuDevice;

    const BUCKET: usize = 8192;
    const BUCKETS: usize = 7;

    /// Seven buckets (the last one short) over three slots of a CPU device, each written once
    /// with seeded bytes, read ahead within `host_budget_bytes`.
    struct Bench {
        stream: BucketStream,
        device: Arc<dyn Device>,
        expected: Vec<Vec<u8>>,
        dir: tempfile::TempDir,
    }

    impl Bench {
        fn new(seed: u64, host_budget_bytes: u64) -> Bench {
            let device: Arc<dyn Device> = Arc::new(CpuDevice::new(16 << 20));
            let arena = device.reserve(2 << 20).unwrap();
            device.commit(arena).unwrap();
            let slots = (0..STREAM_SLOTS)
                .map(|i| arena.slice(i * BUCKET, BUCKET).unwrap())
                .collect();
            let sizes: Vec<usize> = (0..BUCKETS)
                .map(|k| if k == BUCKETS - 1 { 4096 } else { BUCKET })
                .collect();
            let dir = tempfile::tempdir().unwrap();
            let pool = Arc::new(HostPool::new(Arc::clone(&device)));
            let store = Arc::new(DiskStore::new(dir.path(), 0, BUCKET, pool).unwrap());
            let stream = BucketStream::new(
                store,
                Arc::clone(&device),
                slots,
                sizes.clone(),
                host_budget_bytes,
            )
            .unwrap();
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

        /// One walk that must update every bucket; its figures.
        fn walk_every_bucket(&mut self) -> StreamStats {
            let (stats, updated) = self.walk();
            let stats = stats.unwrap();
            assert_eq!(updated, (0..BUCKETS).collect::<Vec<_>>());
            self.bump(0..BUCKETS);
            stats
        }

        /// Reads bucket `k` back through its slot.
        fn read_back(&self, k: usize) -> Vec<u8> {
            self.stream.read(k).unwrap();
            let mut got = vec![0u8; self.expected[k].len()];
            self.device
                .read(self.stream.slot(k).unwrap(), &mut got)
                .unwrap();
            got
        }

        fn check_on_disk(&self, buckets: impl IntoIterator<Item = usize>) {
            for k in buckets {
                assert!(
                    self.read_back(k) == self.expected[k],
                    "bucket {k} differs from what was written"
                );
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

        fn data_file(&self, bucket: usize) -> std::path::PathBuf {
            self.dir.path().join(format!(
                "offload/rank-0/named-optimizer-bucket-{bucket:05}/data.bin"
            ))
        }
    }

    #[test]
    fn walks_update_every_bucket_once_and_write_it_back_with_any_read_ahead() {
        let total = (6 * BUCKET + 4096) as u64;
        // The fewest host buffers, three more, and the whole state.
        for budget in [0, (MIN_HOST_BUCKETS as u64 + 3) * BUCKET as u64, 1 << 30] {
            let mut bench = Bench::new(71, budget);
            for step in 0..3 {
                if step > 0 {
                    bench.stream.prefetch().unwrap();
                }
                let stats = bench.walk_every_bucket();
                assert_eq!((stats.bytes_read, stats.bytes_written), (total, total));
                assert!(stats.wait_seconds >= 0.0 && stats.disk_seconds > 0.0);
            }
            bench.check_on_disk(0..BUCKETS);
        }
    }

    #[test]
    fn reads_and_writes_of_single_buckets_stop_the_read_ahead_and_keep_the_walk_right() {
        let mut bench = Bench::new(73, 1 << 30);
        bench.stream.prefetch().unwrap();
        assert!(bench.read_back(3) == bench.expected[3]);
        bench.stream.prefetch().unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(74);
        let fresh: Vec<u8> = (0..BUCKET).map(|_| rng.random()).collect();
        bench
            .device
            .write(&fresh, bench.stream.slot(5).unwrap())
            .unwrap();
        bench.stream.write(5).unwrap();
        bench.expected[5] = fresh;
        bench.walk_every_bucket();
        bench.check_on_disk(0..BUCKETS);
    }

    #[test]
    fn a_failed_write_behind_keeps_the_bucket_in_host_memory_and_fails_the_next_walk() {
        let mut bench = Bench::new(75, 0);
        bench.stream.fail_next_write(2);
        // The failure lands behind the walk.
        bench.walk_every_bucket();
        let (result, updated) = bench.walk();
        let err = result.unwrap_err();
        assert!(
            matches!(&err, StoreError::StreamWriteFailed { bucket: 2, .. }),
            "{err}"
        );
        let text = err.to_string();
        assert!(
            text.contains("injected write fault") && text.contains("kept in host memory"),
            "{text}"
        );
        assert!(updated.is_empty(), "no bucket is updated: {updated:?}");
        // Nothing is lost: the bucket reads from its host copy, and the next walk goes on
        // and writes it again.
        assert!(bench.read_back(2) == bench.expected[2]);
        bench.walk_every_bucket();
        bench.check_on_disk(0..BUCKETS);
    }

    #[test]
    fn a_kept_host_copy_read_ahead_by_a_walk_that_fails_stays_kept() {
        let mut bench = Bench::new(76, 0);
        bench.stream.fail_next_write(2);
        bench.walk_every_bucket();
        // The reads ahead take bucket 2's kept copy before the walk finds the failed write
        // and gives back what it read.
        bench.stream.prefetch().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(200));
        let (result, _) = bench.walk();
        assert!(matches!(
            result,
            Err(StoreError::StreamWriteFailed { bucket: 2, .. })
        ));
        assert!(bench.read_back(2) == bench.expected[2], "bucket 2 was lost");
        bench.walk_every_bucket();
        bench.check_on_disk(0..BUCKETS);
    }

    #[test]
    fn a_corrupted_bucket_stops_the_walk_before_its_update_and_keeps_the_others_consistent() {
        let mut bench = Bench::new(72, 1 << 30);
        let data = bench.data_file(3);
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
        bench.check_on_disk([0, 1, 2, 4, 5, 6]);
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
        let mut stream = BucketStream::new(store, device, slots, vec![BUCKET, BUCKET], 0).unwrap();
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
