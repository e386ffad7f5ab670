//! Transfers of the compute stream that stay off the copy engines.
//!
//! The memory manager's pauses and resumes queue gigabytes of copies on the copy engines. A
//! copy of the compute stream queued behind them waited for all of them: on an H200 a rollout's
//! prefill took 0.22 s instead of 2 ms while the trainer's 12.5 GB went to host memory behind
//! it, and its decode steps 0.23 s longer while the trainer came back (`bench/RESULTS.md`,
//! round 24). So the compute stream's uploads and downloads of up to [`STAGED_MAX_BYTES`] go
//! through a pinned host buffer mapped into the device's address space, copied by a kernel
//! ([`COPY_KERNEL`]), and its device-to-device copies are that kernel too.

use std::sync::Arc;

use cudarc::driver::{CudaContext, LaunchConfig};

use super::super::driver;
use crate::device::{DeviceError, Fence};

/// The largest upload or download staged through mapped host memory; larger ones are copies on
/// a copy engine (the trainer's start-up uploads of whole parameter tables, say).
pub(super) const STAGED_MAX_BYTES: usize = 64 << 20;

/// The copy kernel's name in [`COPY_SOURCE`].
pub(super) const COPY_KERNEL: &str = "miles_copy_bytes";

/// `dst[i] = src[i]` for `n` bytes; either side may be mapped host memory. Where the two
/// addresses sit at the same offset within 16 bytes (every staged transfer: the data is placed
/// so, [`ALIGN`]), the bytes up to the first 16-byte boundary go one a thread, then 16 at a
/// time, then the tail one a thread; otherwise every byte goes alone.
pub(super) const COPY_SOURCE: &str = r#"
extern "C" __global__ void miles_copy_bytes(
    unsigned char* __restrict__ dst, const unsigned char* __restrict__ src, unsigned long long n) {
    grid_begin();
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long head = 0;
    unsigned long long words = 0;
    if ((((unsigned long long)dst ^ (unsigned long long)src) & 15) == 0) {
        head = (16 - ((unsigned long long)dst & 15)) & 15;
        if (head > n) head = n;
        words = (n - head) / 16;
        const uint4* s = (const uint4*)(src + head);
        uint4* d = (uint4*)(dst + head);
        for (unsigned long long w = i; w < words; w += stride) d[w] = s[w];
    }
    for (unsigned long long b = i; b < head; b += stride) dst[b] = src[b];
    for (unsigned long long b = head + words * 16 + i; b < n; b += stride) dst[b] = src[b];
}
"#;

/// The alignment the copy kernel moves whole words at: a staged transfer's bytes start at the
/// device address's offset within it, and a buffer holds that much more than its transfers.
pub(super) const ALIGN: usize = 16;

/// Where a transfer to or from device address `address` starts in the staging buffer: at the
/// same offset within [`ALIGN`] bytes, so the kernel copies whole words.
pub(super) fn staged_offset(address: u64) -> usize {
    (address % ALIGN as u64) as usize
}

/// Threads a block of the copy kernel.
const COPY_THREADS: u32 = 256;

/// The copy kernel's launch for `bytes`: one 16-byte word a thread, at most 4096 blocks (the
/// kernel strides over the rest).
pub(super) fn copy_launch(bytes: usize) -> LaunchConfig {
    let words = bytes.div_ceil(16).max(1);
    LaunchConfig {
        grid_dim: (words.div_ceil(COPY_THREADS as usize).min(4096) as u32, 1, 1),
        block_dim: (COPY_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The staging buffer of a `Gpu`, made at its first transfer and grown as transfers need.
#[derive(Debug, Default)]
pub(super) struct StagingSlot(Option<Staging>);

impl StagingSlot {
    /// The buffer, holding at least `bytes` at any offset below [`ALIGN`] (made or grown here
    /// in `context`, which is current; no kernel uses the old buffer).
    pub(super) fn at_least(
        &mut self,
        bytes: usize,
        context: &Arc<CudaContext>,
    ) -> Result<&mut Staging, DeviceError> {
        let staging = match self.0.take() {
            Some(staging) if staging.len >= bytes + ALIGN => staging,
            _ => {
                let len = bytes.next_power_of_two().clamp(1 << 20, STAGED_MAX_BYTES) + ALIGN;
                Staging::new(len, Arc::clone(context))?
            }
        };
        Ok(self.0.insert(staging))
    }
}

/// Pinned host memory mapped into the device's address space for transfers that return before
/// their copy runs ([`Gpu::upload_queued`](super::Gpu::upload_queued),
/// [`Gpu::download_queued`](super::Gpu::download_queued)): one transfer at a time, each waiting
/// for the copy of the one before it.
#[derive(Debug)]
pub struct Mailbox {
    pub(super) staging: Staging,
    /// After the last copy into or out of it.
    pub(super) fence: Option<Fence>,
    /// Where the bytes of a queued download start, and how many there are.
    pub(super) held: Option<(usize, usize)>,
}

impl Mailbox {
    /// Bytes one transfer through it may move.
    pub fn capacity(&self) -> usize {
        self.staging.len - ALIGN
    }

    /// Waits for the last copy into or out of the mailbox.
    pub(super) fn settle(&mut self) -> Result<(), DeviceError> {
        match self.fence.take() {
            Some(fence) => fence.wait(),
            None => Ok(()),
        }
    }

    /// The bytes of the download queued last, once its copy is done, into `dst`.
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`] where no download is held or `dst` is not its length;
    /// the device's error, or the first error of the work queued before the copy.
    pub fn read<T: crate::device::GpuElement>(&mut self, dst: &mut [T]) -> Result<(), DeviceError> {
        let bytes = std::mem::size_of_val(dst);
        let (offset, held) = self.held.take().unwrap_or((0, 0));
        if held != bytes || bytes == 0 {
            return Err(DeviceError::ShapeMismatch {
                what: "mailbox read (bytes of the queued download)",
                expected: held,
                actual: bytes,
            });
        }
        self.settle()?;
        // SAFETY: `dst` is `bytes` bytes of plain data (a `GpuElement`), every bit pattern of
        // which the copied bytes of the same type are.
        let dst = unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<u8>(), bytes) };
        // SAFETY: the copy that filled these bytes is done (settled) and no other is queued: a
        // transfer through the mailbox needs `&mut self`; `offset + bytes` is within the buffer
        // (checked when the download was queued).
        unsafe { self.staging.drain(offset, dst) };
        Ok(())
    }
}

impl Drop for Mailbox {
    fn drop(&mut self) {
        // The buffer is freed after this: no copy may still write or read it.
        if let Err(error) = self.settle() {
            tracing::error!(%error, "a queued transfer failed before its mailbox was dropped");
        }
    }
}

/// Pinned host memory mapped into the device's address space, reused by one transfer at a time.
#[derive(Debug)]
pub(super) struct Staging {
    host: *mut u8,
    device: u64,
    len: usize,
    /// The context it was made in, kept alive and made current to free it.
    context: Arc<CudaContext>,
}

// SAFETY: the buffer is plain pinned host memory owned by this value; `Gpu` lends it to one
// transfer at a time (under a mutex, or a `Mailbox`'s `&mut`), and its copy is waited for before
// the buffer is filled, drained, reused or freed.
// The raw pointer is what keeps the type from being `Send` by itself.
unsafe impl Send for Staging {}

impl Staging {
    /// `len` bytes in `context` (current on this thread).
    pub(super) fn new(len: usize, context: Arc<CudaContext>) -> Result<Staging, DeviceError> {
        let (host, device) = driver::mem_host_alloc_mapped(len)?;
        Ok(Staging {
            host,
            device,
            len,
            context,
        })
    }

    /// The device address of the buffer's byte `offset`, for the copy kernel.
    pub(super) fn device_at(&self, offset: usize) -> u64 {
        self.device + offset as u64
    }

    /// Copies `src` into the buffer from byte `offset` on.
    ///
    /// # Safety
    /// No kernel reads or writes the buffer meanwhile; `offset + src.len()` is within the
    /// buffer.
    pub(super) unsafe fn fill(&mut self, offset: usize, src: &[u8]) {
        // SAFETY: the caller keeps kernels off the buffer and the bytes within it; the buffer
        // and `src` are distinct allocations.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.host.add(offset), src.len()) }
    }

    /// Copies the buffer's bytes from `offset` on into `dst`.
    ///
    /// # Safety
    /// No kernel writes the buffer meanwhile, the one that filled it is done;
    /// `offset + dst.len()` is within the buffer.
    pub(super) unsafe fn drain(&self, offset: usize, dst: &mut [u8]) {
        // SAFETY: as in `fill`, the other way round.
        unsafe { std::ptr::copy_nonoverlapping(self.host.add(offset), dst.as_mut_ptr(), dst.len()) }
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let freed = self
            .context
            .bind_to_thread()
            .map_err(|error| DeviceError::Cuda {
                call: "cuCtxSetCurrent",
                message: error.to_string(),
            })
            // SAFETY: allocated by `new`, freed once here; every transfer waited for its kernel.
            .and_then(|()| unsafe { driver::mem_free_host(self.host) });
        if let Err(error) = freed {
            tracing::error!(%error, "cannot free the compute stream's staging buffer");
        }
    }
}
