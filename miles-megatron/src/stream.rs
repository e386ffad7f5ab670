//! Optimizer-state streaming (`--stream-optimizer-state-to-disk`): the Adam moments of a rank's
//! shard live on disk, bucket by bucket, in the core disk store's checksummed chunk files; a step
//! walks the buckets, prefetching bucket k+1 and writing back bucket k-1 on their own threads
//! while bucket k is updated.
//!
//! Each bucket is staged through one of three device buffers (bucket k always uses slot k % 3, so
//! it is read back into the range it was saved from, as the disk store checks). A bucket holds
//! `m` then `v`, each in the chosen moment dtype.

use std::ops::Range;
use std::sync::Arc;
use std::thread;

use half::{bf16, f16};
use miles_core::config::MomentDtype;
use miles_core::ops::{AdamWConfig, adamw_update};
use miles_core::{BackendError, Buffer, Device, DiskBackup, DiskStore, MemoryManager, MemoryTag};

/// Staging slots: the bucket being updated, the one being prefetched, the one being written.
const SLOTS: usize = 3;

/// The staging tag of the streamed moments.
pub(crate) fn stream_tag() -> MemoryTag {
    MemoryTag::Named("optimizer-stream".to_string())
}

/// Bytes per stored moment element.
pub(crate) fn dtype_bytes(dtype: MomentDtype) -> usize {
    match dtype {
        MomentDtype::Fp32 => 4,
        MomentDtype::Bf16 | MomentDtype::Fp16 => 2,
    }
}

fn encode(dtype: MomentDtype, src: &[f32], dst: &mut [u8]) {
    match dtype {
        MomentDtype::Fp32 => {
            for (x, d) in src.iter().zip(dst.chunks_exact_mut(4)) {
                d.copy_from_slice(&x.to_le_bytes());
            }
        }
        MomentDtype::Bf16 => {
            for (x, d) in src.iter().zip(dst.chunks_exact_mut(2)) {
                d.copy_from_slice(&bf16::from_f32(*x).to_le_bytes());
            }
        }
        MomentDtype::Fp16 => {
            for (x, d) in src.iter().zip(dst.chunks_exact_mut(2)) {
                d.copy_from_slice(&f16::from_f32(*x).to_le_bytes());
            }
        }
    }
}

fn decode(dtype: MomentDtype, src: &[u8], dst: &mut [f32]) {
    match dtype {
        MomentDtype::Fp32 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            }
        }
        MomentDtype::Bf16 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = bf16::from_le_bytes([s[0], s[1]]).to_f32();
            }
        }
        MomentDtype::Fp16 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = f16::from_le_bytes([s[0], s[1]]).to_f32();
            }
        }
    }
}

/// Bytes of one staging slot for buckets of `bucket_elems` over a shard of `shard_len`.
fn slot_bytes(dtype: MomentDtype, shard_len: usize, bucket_elems: usize) -> usize {
    2 * bucket_elems.min(shard_len).max(1) * dtype_bytes(dtype)
}

/// Bytes the [`stream_tag`] region needs (slots plus the allocator's alignment).
pub(crate) fn arena_bytes(dtype: MomentDtype, shard_len: usize, bucket_elems: usize) -> usize {
    SLOTS * (slot_bytes(dtype, shard_len, bucket_elems) + 256)
}

/// One rank's Adam moments on disk.
#[derive(Debug)]
pub(crate) struct StreamedMoments {
    store: Arc<DiskStore>,
    device: Arc<dyn Device>,
    dtype: MomentDtype,
    /// Element ranges of the shard, one per bucket.
    buckets: Vec<Range<usize>>,
    slots: Vec<Buffer>,
    backups: Vec<Option<DiskBackup>>,
}

impl StreamedMoments {
    /// Moments of a shard of `shard_len` elements in buckets of `bucket_elems`, all zero,
    /// written to `store`; staging buffers come from `manager`'s [`stream_tag`] region.
    pub(crate) fn new(
        manager: &MemoryManager,
        store: Arc<DiskStore>,
        dtype: MomentDtype,
        shard_len: usize,
        bucket_elems: usize,
    ) -> Result<StreamedMoments, BackendError> {
        let bucket_elems = bucket_elems.max(1);
        let buckets: Vec<Range<usize>> = (0..shard_len)
            .step_by(bucket_elems)
            .map(|s| s..(s + bucket_elems).min(shard_len))
            .collect();
        let slot_bytes = slot_bytes(dtype, shard_len, bucket_elems);
        let slots = (0..SLOTS.min(buckets.len().max(1)))
            .map(|_| manager.alloc(&stream_tag(), slot_bytes))
            .collect::<Result<Vec<_>, _>>()?;
        let mut moments = StreamedMoments {
            store,
            device: Arc::clone(manager.device()),
            dtype,
            backups: buckets.iter().map(|_| None).collect(),
            buckets,
            slots,
        };
        let zeros = vec![0.0f32; bucket_elems];
        for k in 0..moments.buckets.len() {
            let n = moments.buckets[k].len();
            moments.fill_slot(k, &zeros[..n], &zeros[..n])?;
            moments.write_back(k)?;
        }
        Ok(moments)
    }

    fn slot_of(&self, bucket: usize) -> usize {
        bucket % self.slots.len()
    }

    fn bucket_bytes(&self, bucket: usize) -> usize {
        2 * self.buckets[bucket].len() * dtype_bytes(self.dtype)
    }

    fn slot_range(&self, bucket: usize) -> miles_core::AddressRange {
        let mut range = self.slots[self.slot_of(bucket)].range();
        range.len = self.bucket_bytes(bucket);
        range
    }

    fn fill_slot(&mut self, bucket: usize, m: &[f32], v: &[f32]) -> Result<(), BackendError> {
        let (half, dtype) = (m.len() * dtype_bytes(self.dtype), self.dtype);
        let slot = self.slot_of(bucket);
        let mut view = self.slots[slot].view_mut::<u8>()?;
        encode(dtype, m, &mut view[..half]);
        encode(dtype, v, &mut view[half..2 * half]);
        Ok(())
    }

    fn read_slot(&self, bucket: usize, m: &mut [f32], v: &mut [f32]) -> Result<(), BackendError> {
        let half = m.len() * dtype_bytes(self.dtype);
        let view = self.slots[self.slot_of(bucket)].view::<u8>()?;
        decode(self.dtype, &view[..half], m);
        decode(self.dtype, &view[half..2 * half], v);
        Ok(())
    }

    fn write_back(&mut self, bucket: usize) -> Result<(), BackendError> {
        let backup = save(&self.store, &*self.device, bucket, self.slot_range(bucket))?;
        self.backups[bucket] = Some(backup);
        Ok(())
    }

    fn prefetch(&self, bucket: usize) -> Result<(), BackendError> {
        load(
            &self.store,
            &*self.device,
            &self.backups[bucket],
            self.slot_range(bucket),
        )
    }

    /// AdamW step `step` over `params` and `grads` (the rank's shard), streaming the moments
    /// bucket by bucket.
    pub(crate) fn update(
        &mut self,
        params: &mut [f32],
        grads: &[f32],
        step: u64,
        adamw: &AdamWConfig,
        clip_scale: f32,
    ) -> Result<(), BackendError> {
        let n = self.buckets.len();
        if n == 0 {
            return Ok(());
        }
        let widest = self.buckets.iter().map(Range::len).max().unwrap_or(0);
        let (mut m, mut v) = (vec![0.0f32; widest], vec![0.0f32; widest]);
        self.prefetch(0)?;
        let mut pending_write: Option<usize> = None;
        for k in 0..n {
            let range = self.buckets[k].clone();
            let len = range.len();
            let next = (k + 1 < n).then(|| (self.slot_range(k + 1), k + 1));
            let written = pending_write.map(|w| (self.slot_range(w), w));
            let (store, device) = (&self.store, &self.device);
            let backups = &self.backups;
            let (prefetched, saved) = thread::scope(|scope| {
                let reader = next.map(|(range, b)| {
                    scope.spawn(move || load(store, &**device, &backups[b], range))
                });
                let writer = written.map(|(range, b)| {
                    scope.spawn(move || save(store, &**device, b, range).map(|bk| (b, bk)))
                });
                let update = self.read_slot(k, &mut m[..len], &mut v[..len]).map(|()| {
                    adamw_update(
                        &mut params[range.clone()],
                        &grads[range.clone()],
                        &mut m[..len],
                        &mut v[..len],
                        step,
                        adamw,
                        clip_scale,
                    );
                });
                (update.and(Ok(join(store, reader))), join(store, writer))
            });
            if let Some(saved) = saved {
                let (b, backup) = saved?;
                self.backups[b] = Some(backup);
            }
            prefetched?.transpose()?;
            self.fill_slot(k, &m[..len], &v[..len])?;
            pending_write = Some(k);
        }
        if let Some(last) = pending_write {
            self.write_back(last)?;
        }
        Ok(())
    }

    /// Both moments of the whole shard, decoded to fp32 (for checkpoints).
    pub(crate) fn read_all(
        &mut self,
        shard_len: usize,
    ) -> Result<(Vec<f32>, Vec<f32>), BackendError> {
        let (mut m, mut v) = (vec![0.0f32; shard_len], vec![0.0f32; shard_len]);
        for k in 0..self.buckets.len() {
            let range = self.buckets[k].clone();
            self.prefetch(k)?;
            self.read_slot(k, &mut m[range.clone()], &mut v[range])?;
        }
        Ok((m, v))
    }

    /// Replaces both moments of the whole shard (from a checkpoint).
    pub(crate) fn write_all(&mut self, m: &[f32], v: &[f32]) -> Result<(), BackendError> {
        for k in 0..self.buckets.len() {
            let range = self.buckets[k].clone();
            self.fill_slot(k, &m[range.clone()], &v[range])?;
            self.write_back(k)?;
        }
        Ok(())
    }
}

/// Waits for a streaming thread, turning a panic into an error.
fn join<T>(
    store: &DiskStore,
    handle: Option<thread::ScopedJoinHandle<'_, Result<T, BackendError>>>,
) -> Option<Result<T, BackendError>> {
    handle.map(|h| h.join().unwrap_or_else(|_| Err(lost(store))))
}

fn lost(store: &DiskStore) -> BackendError {
    BackendError::Io {
        action: "stream optimizer state in",
        path: store.root().to_path_buf(),
        source: std::io::Error::other("an optimizer-streaming thread panicked"),
    }
}

fn save(
    store: &DiskStore,
    device: &dyn Device,
    bucket: usize,
    range: miles_core::AddressRange,
) -> Result<DiskBackup, BackendError> {
    let tag = MemoryTag::Named(format!("optimizer-bucket-{bucket:05}"));
    Ok(store.save(device, &tag, &[range])?)
}

fn load(
    store: &DiskStore,
    device: &dyn Device,
    backup: &Option<DiskBackup>,
    range: miles_core::AddressRange,
) -> Result<(), BackendError> {
    match backup {
        Some(backup) => Ok(store.load(device, backup, &[range])?),
        None => Err(BackendError::Io {
            action: "read optimizer state from",
            path: store.root().to_path_buf(),
            source: std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "a bucket's last write failed; rebuild the trainer",
            ),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp32_moments_round_trip_exactly_and_half_types_within_their_precision() {
        let src: Vec<f32> = (0..64).map(|i| (i as f32 - 31.5) * 1.37e-3).collect();
        for (dtype, tol) in [
            (MomentDtype::Fp32, 0.0),
            (MomentDtype::Bf16, 1.0 / 256.0),
            (MomentDtype::Fp16, 1.0 / 2048.0),
        ] {
            let mut bytes = vec![0u8; src.len() * dtype_bytes(dtype)];
            encode(dtype, &src, &mut bytes);
            let mut back = vec![0.0f32; src.len()];
            decode(dtype, &bytes, &mut back);
            let worst = src
                .iter()
                .zip(&back)
                .map(|(a, b)| ((a - b) / a).abs())
                .fold(0.0f32, f32::max);
            assert!(
                worst <= tol,
                "{dtype:?}: worst relative difference {worst} > {tol}"
            );
        }
    }
}
