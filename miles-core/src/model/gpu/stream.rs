//! The GPU trainer's AdamW moments on disk (`--stream-optimizer-state-to-disk`): the flat
//! parameter buffer cut into buckets, each bucket's `m` then `v` in the moment dtype (then,
//! with `--stream-optimizer-master-weights`, its fp32 master weights) one tag of the disk
//! store, staged through [`STREAM_SLOTS`] device slots of the
//! [`stream_tag`](StreamedMoments::tag) region. The disk reads a step's buckets ahead into host
//! memory from the start of its forward pass ([`BucketStream::prefetch`]); the optimizer step
//! walks them ([`BucketStream::walk`]), the AdamW kernel updating each in its slot, and their
//! writes go on behind it; the device never holds more than the slots.

use std::ops::Range;
use std::sync::Arc;

use half::bf16;

use super::sizing::BLOCK_SLACK;
use crate::choice::MomentDtype;
use crate::device::{AddressRange, Device, Gpu, GpuElement, GpuSlice};
use crate::memory::{BackupPolicy, Buffer, DiskSettings, MemoryManager, MemoryTag};
use crate::model::ModelError;
use crate::ops::gpu::{AdamWStep, GpuMoments};
use crate::ops::{decode_moments, encode_moments, moment_bytes};
use crate::store::{
    BucketStream, DiskStore, HostPool, STREAM_SLOTS, StreamStats, stream_chunk_bytes,
};

/// Where and how the moments stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MomentStream {
    /// Storage type of the moments on disk (and in the slots).
    pub dtype: MomentDtype,
    /// The fp32 master weights stream with the moments, the device keeping none.
    pub master_weights: bool,
    /// The rank's disk store; its chunk size is the bucket's size (all of a bucket's state
    /// fills at most one chunk), its host budget the stream's read-ahead.
    pub disk: DiskSettings,
}

/// The moments (and master weights) of a parameter buffer of `len` elements, on disk.
#[derive(Debug)]
pub(super) struct StreamedMoments {
    dtype: MomentDtype,
    /// Whether each bucket holds its master weights after its moments.
    master_weights: bool,
    /// Element ranges of the parameter buffer, one per bucket.
    buckets: Vec<Range<usize>>,
    /// The device slots (held for the stream's ranges).
    slots: Vec<Buffer>,
    device: Arc<dyn Device>,
    stream: BucketStream,
}

/// The parts of a bucket to replace: `None` keeps what the bucket holds.
struct BucketParts<'a> {
    moments: Option<(&'a [f32], &'a [f32])>,
    master: Option<&'a [f32]>,
}

impl StreamedMoments {
    /// The region of the slots: dropped on offload (the state is on disk between steps).
    pub(super) fn tag() -> MemoryTag {
        MemoryTag::Named("optimizer-stream".to_string())
    }

    /// Zero moments for the `master.len()` parameters (and, with
    /// [`MomentStream::master_weights`], the master weights `master`), written to the disk
    /// store `spec` names; the slots come from a new [`tag`](Self::tag) region of `memory`.
    pub(super) fn new(
        memory: &MemoryManager,
        spec: &MomentStream,
        master: &[f32],
    ) -> Result<StreamedMoments, ModelError> {
        let len = master.len();
        let per_element = 2 * moment_bytes(spec.dtype) + 4 * usize::from(spec.master_weights);
        let bucket_elems = (spec.disk.chunk_bytes / per_element).max(1);
        let buckets: Vec<Range<usize>> = (0..len)
            .step_by(bucket_elems)
            .map(|start| start..(start + bucket_elems).min(len))
            .collect();
        let slot_bytes = per_element * bucket_elems.min(len).max(1);
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
        let chunk = stream_chunk_bytes(spec.disk.chunk_bytes);
        let store = DiskStore::new(&spec.disk.dir, spec.disk.rank, chunk, pool)?;
        let sizes = buckets.iter().map(|b| per_element * b.len()).collect();
        let ranges = slots.iter().map(Buffer::range).collect();
        let stream = BucketStream::new(
            Arc::new(store),
            Arc::clone(&device),
            ranges,
            sizes,
            spec.disk.host_budget_bytes,
        )?;
        let mut moments = StreamedMoments {
            dtype: spec.dtype,
            master_weights: spec.master_weights,
            stream,
            device,
            buckets,
            slots,
        };
        let zeros = vec![0.0f32; bucket_elems.min(len)];
        for k in 0..moments.buckets.len() {
            let r = moments.buckets[k].clone();
            let zeros = &zeros[..r.len()];
            let parts = BucketParts {
                moments: Some((zeros, zeros)),
                master: spec.master_weights.then(|| &master[r]),
            };
            moments.rewrite(k, &parts)?;
        }
        tracing::info!(
            buckets = moments.buckets.len(),
            slot_bytes,
            dtype = %spec.dtype,
            master_weights = spec.master_weights,
            "gpu optimizer state streams through the disk"
        );
        Ok(moments)
    }

    /// Lets the disk read the next step's buckets ahead while the device computes.
    pub(super) fn prefetch(&self) -> Result<(), ModelError> {
        Ok(self.stream.prefetch()?)
    }

    /// Whether the master weights stream with the moments.
    pub(super) fn holds_master(&self) -> bool {
        self.master_weights
    }

    /// The device slots, for the trainer's fences.
    pub(super) fn slots(&self) -> &[Buffer] {
        &self.slots
    }

    /// Bytes of device memory the slots take.
    pub(super) fn slot_bytes(&self) -> usize {
        self.slots.iter().map(Buffer::len).sum()
    }

    /// AdamW step `s` over bf16 `params` and `grads` (the whole flat buffer) and the master
    /// weights (`master` on the device, or each bucket's own when they stream), the moments
    /// streamed bucket by bucket; returns what the walk moved.
    ///
    /// On a failed read the buckets before it are updated and written back, the failing one
    /// and those after it are not (their parameters, master weights and moments are as they
    /// were).
    pub(super) fn update(
        &mut self,
        gpu: &Gpu,
        master: Option<GpuSlice<f32>>,
        params: GpuSlice<bf16>,
        grads: GpuSlice<f32>,
        s: AdamWStep,
    ) -> Result<StreamStats, ModelError> {
        let (dtype, buckets) = (self.dtype, &self.buckets);
        self.stream.walk(|k, slot| -> Result<_, ModelError> {
            let r = &buckets[k];
            let (moments, streamed_master) = slot_parts(dtype, slot, r.len())?;
            let master = match (streamed_master, master) {
                (Some(own), _) => own,
                (None, Some(master)) => master.sub(r.start, r.len())?,
                // The trainer keeps master weights on the device unless they stream.
                (None, None) => {
                    return Err(ModelError::BufferLength {
                        buffer: "master weights",
                        len: 0,
                        need: r.len(),
                    });
                }
            };
            gpu.adamw_update(
                master,
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
        for k in 0..self.buckets.len() {
            let r = self.buckets[k].clone();
            let bytes = self.read_bucket(k)?;
            let half = r.len() * element;
            decode_moments(self.dtype, &bytes[..half], &mut m[r.clone()]);
            decode_moments(self.dtype, &bytes[half..2 * half], &mut v[r]);
        }
        Ok((m, v))
    }

    /// The streamed master weights of the whole buffer.
    pub(super) fn read_master(&self, len: usize) -> Result<Vec<f32>, ModelError> {
        let mut master = vec![0.0f32; len];
        let moments = 2 * moment_bytes(self.dtype);
        for k in 0..self.buckets.len() {
            let r = self.buckets[k].clone();
            let bytes = self.read_bucket(k)?;
            decode_moments(
                MomentDtype::Fp32,
                &bytes[moments * r.len()..],
                &mut master[r],
            );
        }
        Ok(master)
    }

    /// Replaces both moments of the whole buffer (from a checkpoint), rounded to the dtype;
    /// streamed master weights stay.
    pub(super) fn write_all(&mut self, m: &[f32], v: &[f32]) -> Result<(), ModelError> {
        for k in 0..self.buckets.len() {
            let r = self.buckets[k].clone();
            let parts = BucketParts {
                moments: Some((&m[r.clone()], &v[r])),
                master: None,
            };
            self.rewrite(k, &parts)?;
        }
        Ok(())
    }

    /// Replaces the streamed master weights of the whole buffer; the moments stay.
    pub(super) fn write_master(&mut self, master: &[f32]) -> Result<(), ModelError> {
        for k in 0..self.buckets.len() {
            let r = self.buckets[k].clone();
            let parts = BucketParts {
                moments: None,
                master: Some(&master[r]),
            };
            self.rewrite(k, &parts)?;
        }
        Ok(())
    }

    /// Bucket `k` read from disk through its slot.
    fn read_bucket(&self, k: usize) -> Result<Vec<u8>, ModelError> {
        self.stream.read(k)?;
        let slot = self.stream.slot(k)?;
        let mut bytes = vec![0u8; slot.len];
        self.device.read(slot, &mut bytes)?;
        Ok(bytes)
    }

    /// Writes bucket `k` through its slot to disk with `parts` replaced, reading it first when
    /// a part is kept.
    fn rewrite(&mut self, k: usize, parts: &BucketParts<'_>) -> Result<(), ModelError> {
        let keeps = parts.moments.is_none() || (self.master_weights && parts.master.is_none());
        let mut bytes = if keeps {
            self.read_bucket(k)?
        } else {
            vec![0u8; self.stream.slot(k)?.len]
        };
        let n = self.buckets[k].len();
        let half = n * moment_bytes(self.dtype);
        if let Some((m, v)) = parts.moments {
            encode_moments(self.dtype, m, &mut bytes[..half]);
            encode_moments(self.dtype, v, &mut bytes[half..2 * half]);
        }
        if let (true, Some(master)) = (self.master_weights, parts.master) {
            encode_moments(MomentDtype::Fp32, master, &mut bytes[2 * half..]);
        }
        self.device.write(&bytes, self.stream.slot(k)?)?;
        self.stream.write(k)?;
        Ok(())
    }
}

/// The moments of a bucket of `len` elements in `slot` (`m` then `v`, in `dtype`), and its
/// master weights after them when the slot holds them.
fn slot_parts(
    dtype: MomentDtype,
    slot: AddressRange,
    len: usize,
) -> Result<(GpuMoments, Option<GpuSlice<f32>>), ModelError> {
    fn part<T: GpuElement>(
        slot: AddressRange,
        at: usize,
        len: usize,
    ) -> Result<GpuSlice<T>, ModelError> {
        Ok(GpuSlice::of(slot.slice(at, len * size_of::<T>())?)?)
    }
    let half = len * moment_bytes(dtype);
    let moments = match dtype {
        MomentDtype::Fp32 => GpuMoments::Fp32(part(slot, 0, len)?, part(slot, half, len)?),
        MomentDtype::Bf16 => GpuMoments::Bf16(part(slot, 0, len)?, part(slot, half, len)?),
        MomentDtype::Fp16 => GpuMoments::Fp16(part(slot, 0, len)?, part(slot, half, len)?),
    };
    let master = if slot.len > 2 * half {
        Some(part(slot, 2 * half, len)?)
    } else {
        None
    };
    Ok((moments, master))
}
