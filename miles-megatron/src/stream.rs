//! Optimizer-state streaming (`--stream-optimizer-state-to-disk`): the Adam moments of a rank's
//! shard live on disk, bucket by bucket, in the core disk store's checksummed chunk files; a step
//! walks the buckets through core's [`BucketStream`], whose disk thread reads them ahead (from
//! the start of the step, within the host budget) and writes them back behind the walk.
//!
//! Each bucket is staged through one of three device buffers (bucket k always uses slot k % 3, so
//! it is read back into the range it was saved from, as the disk store checks). A bucket holds
//! `m` then `v`, each in the chosen moment dtype.

use std::ops::Range;
use std::sync::Arc;

use miles_core::config::MomentDtype;
use miles_core::ops::{AdamWConfig, adamw_update, decode_moments, encode_moments, moment_bytes};
use miles_core::store::{BucketStream, STREAM_SLOTS};
use miles_core::{BackendError, Buffer, DiskStore, Fence, MemoryManager, MemoryTag};

/// The staging tag of the streamed moments.
pub(crate) fn stream_tag() -> MemoryTag {
    MemoryTag::Named("optimizer-stream".to_string())
}

/// Bytes of one staging slot for buckets of `bucket_elems` over a shard of `shard_len`.
fn slot_bytes(dtype: MomentDtype, shard_len: usize, bucket_elems: usize) -> usize {
    2 * bucket_elems.min(shard_len).max(1) * moment_bytes(dtype)
}

/// Bytes the [`stream_tag`] region needs (slots plus the allocator's alignment).
pub(crate) fn arena_bytes(dtype: MomentDtype, shard_len: usize, bucket_elems: usize) -> usize {
    STREAM_SLOTS * (slot_bytes(dtype, shard_len, bucket_elems) + 256)
}

/// One rank's Adam moments on disk.
#[derive(Debug)]
pub(crate) struct StreamedMoments {
    stream: BucketStream,
    dtype: MomentDtype,
    /// Element ranges of the shard, one per bucket.
    buckets: Vec<Range<usize>>,
    slots: Vec<Buffer>,
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
        host_budget_bytes: u64,
    ) -> Result<StreamedMoments, BackendError> {
        let bucket_elems = bucket_elems.max(1);
        let buckets: Vec<Range<usize>> = (0..shard_len)
            .step_by(bucket_elems)
            .map(|s| s..(s + bucket_elems).min(shard_len))
            .collect();
        let slot_bytes = slot_bytes(dtype, shard_len, bucket_elems);
        let slots = (0..STREAM_SLOTS.min(buckets.len().max(1)))
            .map(|_| manager.alloc(&stream_tag(), slot_bytes))
            .collect::<Result<Vec<_>, _>>()?;
        let sizes = buckets
            .iter()
            .map(|b| 2 * b.len() * moment_bytes(dtype))
            .collect();
        let ranges = slots.iter().map(Buffer::range).collect();
        let device = Arc::clone(manager.device());
        let mut moments = StreamedMoments {
            stream: BucketStream::new(store, device, ranges, sizes, host_budget_bytes)?,
            dtype,
            buckets,
            slots,
        };
        let zeros = vec![0.0f32; bucket_elems];
        for k in 0..moments.buckets.len() {
            let n = moments.buckets[k].len();
            fill_slot(moments.slot_of(k), dtype, &zeros[..n], &zeros[..n])?;
            moments.stream.write(k)?;
        }
        Ok(moments)
    }

    /// Lets the disk read the next step's buckets ahead while the passes run.
    pub(crate) fn prefetch(&self) -> Result<(), BackendError> {
        Ok(self.stream.prefetch()?)
    }

    fn slot_of(&mut self, bucket: usize) -> &mut Buffer {
        let count = self.slots.len();
        &mut self.slots[bucket % count]
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
        let widest = self.buckets.iter().map(Range::len).max().unwrap_or(0);
        let (mut m, mut v) = (vec![0.0f32; widest], vec![0.0f32; widest]);
        let StreamedMoments {
            stream,
            dtype,
            buckets,
            slots,
        } = self;
        let (dtype, count) = (*dtype, slots.len());
        stream.walk(|k, _| -> Result<Fence, BackendError> {
            let range = buckets[k].clone();
            let len = range.len();
            let slot = &mut slots[k % count];
            read_slot(slot, dtype, &mut m[..len], &mut v[..len])?;
            adamw_update(
                &mut params[range.clone()],
                &grads[range],
                &mut m[..len],
                &mut v[..len],
                step,
                adamw,
                clip_scale,
            );
            fill_slot(slot, dtype, &m[..len], &v[..len])?;
            Ok(Fence::signalled())
        })?;
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
            self.stream.read(k)?;
            let dtype = self.dtype;
            read_slot(self.slot_of(k), dtype, &mut m[range.clone()], &mut v[range])?;
        }
        Ok((m, v))
    }

    /// Replaces both moments of the whole shard (from a checkpoint).
    pub(crate) fn write_all(&mut self, m: &[f32], v: &[f32]) -> Result<(), BackendError> {
        for k in 0..self.buckets.len() {
            let range = self.buckets[k].clone();
            let dtype = self.dtype;
            fill_slot(self.slot_of(k), dtype, &m[range.clone()], &v[range])?;
            self.stream.write(k)?;
        }
        Ok(())
    }
}

fn fill_slot(
    slot: &mut Buffer,
    dtype: MomentDtype,
    m: &[f32],
    v: &[f32],
) -> Result<(), BackendError> {
    let half = m.len() * moment_bytes(dtype);
    let mut view = slot.view_mut::<u8>()?;
    encode_moments(dtype, m, &mut view[..half]);
    encode_moments(dtype, v, &mut view[half..2 * half]);
    Ok(())
}

fn read_slot(
    slot: &Buffer,
    dtype: MomentDtype,
    m: &mut [f32],
    v: &mut [f32],
) -> Result<(), BackendError> {
    let half = m.len() * moment_bytes(dtype);
    let view = slot.view::<u8>()?;
    decode_moments(dtype, &view[..half], m);
    decode_moments(dtype, &view[half..2 * half], v);
    Ok(())
}
