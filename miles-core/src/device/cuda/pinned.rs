//! Pinned host memory (`cuMemHostAlloc`, portable, not write-combined) behind a
//! [`HostBuffer`](crate::device::HostBuffer).

use std::ptr::NonNull;
use std::sync::Arc;

use super::context::Context;
use super::driver;
use crate::device::{DeviceError, HostAllocation};

/// Page-locked host memory every context can copy with, cached for CPU reads; freed on drop.
#[derive(Debug)]
pub(crate) struct PinnedMemory {
    ptr: NonNull<u8>,
    len: usize,
    context: Arc<Context>,
}

// SAFETY: the memory is owned by this value alone; moving it between threads moves that ownership.
unsafe impl Send for PinnedMemory {}
// SAFETY: shared access only reads (`as_slice`); writes need `&mut`.
unsafe impl Sync for PinnedMemory {}

impl PinnedMemory {
    /// Pin `len` bytes; an empty allocation pins nothing.
    pub(crate) fn new(context: &Arc<Context>, len: usize) -> Result<PinnedMemory, DeviceError> {
        let ptr = if len == 0 {
            NonNull::dangling()
        } else {
            context.bind()?;
            let raw = driver::mem_host_alloc(len).map_err(|error| DeviceError::HostOutOfMemory {
                requested: len,
                reason: error.to_string(),
            })?;
            NonNull::new(raw).ok_or_else(|| DeviceError::HostOutOfMemory {
                requested: len,
                reason: "cuMemHostAlloc returned a null pointer".to_string(),
            })?
        };
        Ok(PinnedMemory {
            ptr,
            len,
            context: Arc::clone(context),
        })
    }
}

impl HostAllocation for PinnedMemory {
    fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` bytes owned by `self` (or is dangling with `len` 0), and
        // `&self` rules out a writer through `as_mut_slice`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, with `&mut self` making the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    fn is_pinned(&self) -> bool {
        true
    }
}

impl Drop for PinnedMemory {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        // The HostBuffer around this memory waited for its copies before dropping it.
        let freed = self
            .context
            .bind()
            // SAFETY: the pointer came from cuMemHostAlloc, is freed once, and no copy uses it.
            .and_then(|()| unsafe { driver::mem_free_host(self.ptr.as_ptr()) });
        if let Err(error) = freed {
            tracing::error!(%error, len = self.len, "cannot free pinned host memory");
        }
    }
}
