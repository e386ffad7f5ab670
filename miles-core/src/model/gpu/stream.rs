//! The GPU trainer's AdamW moments on disk (`--stream-optimizer-state-to-disk`): the flat
//! parameter buffer cut into buckets, each bucket's `m` then `v` in the moment dtype one tag of
//! the disk store, staged through [`STREAM_SLOTS`] device slots of the
//! [`stream_tag`](StreamedMoments::tag) region. A step walks the buckets
//! ([`BucketStream::walk`]): bucket k+1 is read while the AdamW kernel updates bucket k in its
//! slot and bucket k-1 is written back; the device never holds more than the slots.

use std::ops::Range;
use std::sync::Arc;

use half::{bf16, f16};

use super::sizing::BLOCK_SLACK;
use crate::choice::MomentDtype;
use crate::device::{AddressRange, Device, Gpu, GpuElement, GpuSlice};
use crate::memory::{BackupPolicy, Buffer, DiskSettings, MemoryManager, MemoryTag};
use crate::model::ModelError;
use crate::ops::gpu::{AdamWStep, GpuMoments};
use crate::ops::{decode_moments, encode_moments, moment_bytes};
use crate::store::{BucketStream, DiskStore, HostPool, STREAM_SLOTS, StreamStats};

/// Where and how the moments stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MomentStream {
    /// Storage type of the moments on disk (and in the slots).
    pub dtype: MomentDtype,
    /// The rank's disk store; its chunk size is the bucket's size (both moments of a bucket
    /// fill at most one chunk).
    pub disk: DiskSettings,
}

/// The moments of a parameter buffer of `len` elements, on disk.
#[derive(Debug)]
pub(super) struct StreamedMoments {
    dtype: MomentDtype,
    /// Element ranges of the parameter buffer, one per bucket.
    buckets: Vec<Range<usize>>,
    /// The device slots (held for the stream's ranges).
    slots: Vec<Buffer>,
    device: Arc<dyn Device>,
    stream: BucketStream,
}

impl StreamedMoments {
    /// The region of the slots: dropped on offload (the state is on disk between steps).
    pub(super) fn tag() -> MemoryTag {
        MemoryTag::Named("optimizer-stream".to_string())
    }

    /// Zero moments for `len` parameters, written to the disk store `spec` names; the slots
    /// come from a new [`tag`](Self::tag) region of `memory`.
    pub(super) fn new(
        memory: &MemoryManager,
        spec: &MomentStream,
        len: usize,
    ) -> Result<StreamedMoments, ModelError> {
        let element = moment_bytes(spec.dtype);
        let bucket_elems = (spec.disk.chunk_bytes / (2 * element)).max(1);
        let buckets: Vec<Range<usize>> = (0..len)
            .step_by(bucket_elems)
            .map(|start| start..(start + bucket_elems).min(len))
            .collect();
        let slot_bytes = 2 * element * bucket_elems.min(len).max(1);
        let count = STREAM_SLOTS.min(buckets.len()).max(1);
        memory.create_region(
            StreamedMoments::tag(),
            BackupPolicy::None,
            count * (slot_bytes + BLOCK_SLACK),
        )?;
        let slots = (0..count)
            .map(|_| memory.alloc(&StreamedMoments::tag(), slot_bytes))
            .collect::<Result<Vec<_>, _>>()?;
        let device = Arc::clone(memory.device());
        let pool = Arc::new(HostPool::new(Arc::clone(&device)));
        let store = DiskStore::new(&spec.disk.dir, spec.disk.rank, spec.disk.chunk_bytes, pool)?;
        let sizes = buckets.iter().map(|b| 2 * element * b.len()).collect();
        let ranges = slots.iter().map(Buffer::range).collect();
        let mut moments = StreamedMoments {
            dtype: spec.dtype,
            stream: BucketStream::new(Arc::new(store), Arc::clone(&device), ranges, sizes),
            device,
            buckets,
            slots,
        };
        let zeros = vec![0.0f32; bucket_elems.min(len)];
        for k in 0..moments.buckets.len() {
            let n = moments.buckets[k].len();
            moments.fill(k, &zeros[..n], &zeros[..n])?;
        }
        tracing::info!(
            buckets = moments.buckets.len(),
            slot_bytes,
            dtype = %spec.dtype,
            "gpu optimizer moments stream through the disk"
        );
        Ok(moments)
    }

    /// The device slots, for the trainer's fences.
    pub(super) fn slots(&self) -> &[Buffer] {
        &self.slots
    }

    /// Bytes of device memory the slots take.
    pub(super) fn slot_bytes(&self) -> usize {
        self.slots.iter().map(Buffer::len).sum()
    }

    /// AdamW step `s` over the `master` weights, bf16 `params` and `grads` (the whole flat
    /// buffer), the moments streamed bucket by bucket; returns what the walk moved.
    ///
    /// On a failed read the buckets before it are updated and written back, the failing one
    /// and those after it are not (their parameters, master weights and moments are as they
    /// were).
    pub(super) fn update(
        &mut self,
        gpu: &Gpu,
        master: GpuSlice<f32>,
        params: GpuSlice<bf16>,
        grads: GpuSlice<f32>,
        s: AdamWStep,
    ) -> Result<StreamStats, ModelError> {
        let (dtype, buckets) = (self.dtype, &self.buckets);
        self.stream.walk(|k, slot| -> Result<_, ModelError> {
            let r = &buckets[k];
            let moments = slot_moments(dtype, slot, r.len())?;
            gpu.adamw_update(
                master.sub(r.start, r.len())?,
                params.sub(r.start, r.len())?,
                moments,
                grads.sub(r.start, r.len())?,
                s,
            )?;
            Ok(gpu.record_fence()?)
        })
    }

    /// Both moments of the whole buffer, widened to fp32 (for checkpoints).
    pub(super) fn read_all(&self, len: usize) -> Result<(Vec<f32>, Vec<f32>), ModelError> {
        let (mut m, mut v) = (vec![0.0f32; len], vec![0.0f32; len]);
        let element = moment_bytes(self.dtype);
        let mut bytes = Vec::new();
        for (k, r) in self.buckets.iter().enumerate() {
            self.stream.read(k)?;
            let slot = self.stream.slot(k)?;
            bytes.resize(slot.len, 0);
            self.device.read(slot, &mut bytes)?;
            let half = r.len() * element;
            decode_moments(self.dtype, &bytes[..half], &mut m[r.clone()]);
            decode_moments(self.dtype, &bytes[half..], &mut v[r.clone()]);
        }
        Ok((m, v))
    }

    /// Replaces both moments of the whole buffer (from a checkpoint), rounded to the dtype.
    pub(super) fn write_all(&mut self, m: &[f32], v: &[f32]) -> Result<(), ModelError> {
        for k in 0..self.buckets.len() {
            let r = self.buckets[k].clone();
            self.fill(k, &m[r.clone()], &v[r])?;
        }
        Ok(())
    }

    /// Writes bucket `k`'s moments through its slot to disk.
    fn fill(&mut self, k: usize, m: &[f32], v: &[f32]) -> Result<(), ModelError> {
        let slot = self.stream.slot(k)?;
        let mut bytes = vec![0u8; slot.len];
        let half = m.len() * moment_bytes(self.dtype);
        encode_moments(self.dtype, m, &mut bytes[..half]);
        encode_moments(self.dtype, v, &mut bytes[half..]);
        self.device.write(&bytes, slot)?;
        self.stream.write(k)?;
        Ok(())
    }
}

/// The moments of a bucket of `len` elements in `slot`: `m` then `v`, in `dtype`.
fn slot_moments(
    dtype: MomentDtype,
    slot: AddressRange,
    len: usize,
) -> Result<GpuMoments, ModelError> {
    fn halves<T: GpuElement>(
        slot: AddressRange,
        len: usize,
    ) -> Result<(GpuSlice<T>, GpuSlice<T>), ModelError> {
        let half = len * size_of::<T>();
        Ok((
            GpuSlice::of(slot.slice(0, half)?)?,
            GpuSlice::of(slot.slice(half, half)?)?,
        ))
    }
    Ok(match dtype {
        MomentDtype::Fp32 => {
            let (m, v) = halves::<f32>(slot, len)?;
            GpuMoments::Fp32(m, v)
        }
        MomentDtype::Bf16 => {
            let (m, v) = halves::<bf16>(slot, len)?;
            GpuMoments::Bf16(m, v)
        }
        MomentDtype::Fp16 => {
            let (m, v) = halves::<f16>(slot, len)?;
            GpuMoments::Fp16(m, v)
        }
    })
}
