//! Pinned host memory behind a [`HostBuffer`](crate::device::HostBuffer): portable, cached for
//! CPU reads (never write-combined).
//!
//! Two ways to pin, chosen by [`CudaOptions::pin_threads`](super::CudaOptions::pin_threads):
//! `cuMemHostAlloc(PORTABLE)`, where the driver faults the pages in on one thread; or an
//! anonymous `mmap` whose pages `pin_threads` threads fault in at once (asking for huge pages),
//! then `cuMemHostRegister(PORTABLE)`. Pinning is bound by faulting fresh pages in, so the
//! second is faster on many cores.

use std::ptr::NonNull;
use std::sync::Arc;

use super::context::Context;
use super::driver;
use crate::device::{DeviceError, HostAllocation};

/// How the memory was pinned, which says how to free it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Backing {
    /// Nothing allocated (an empty buffer).
    Empty,
    /// `cuMemHostAlloc`; freed with `cuMemFreeHost`.
    HostAlloc,
    /// `mmap` + `cuMemHostRegister`; freed with `cuMemHostUnregister` + `munmap`.
    Registered,
}

/// Page-locked host memory every context can copy with; freed on drop.
#[derive(Debug)]
pub(crate) struct PinnedMemory {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
    context: Arc<Context>,
}

// SAFETY: the memory is owned by this value alone; moving it between threads moves that ownership.
unsafe impl Send for PinnedMemory {}
// SAFETY: shared access only reads (`as_slice`); writes need `&mut`.
unsafe impl Sync for PinnedMemory {}

fn host_error(len: usize, reason: impl ToString) -> DeviceError {
    DeviceError::HostOutOfMemory {
        requested: len,
        reason: reason.to_string(),
    }
}

impl PinnedMemory {
    /// Pin `len` bytes: with `cuMemHostAlloc` when `pin_threads` is 0, else faulted in by
    /// `pin_threads` threads and registered. An empty allocation pins nothing.
    pub(crate) fn new(
        context: &Arc<Context>,
        len: usize,
        pin_threads: usize,
    ) -> Result<PinnedMemory, DeviceError> {
        let (ptr, backing) = if len == 0 {
            (NonNull::dangling(), Backing::Empty)
        } else if pin_threads == 0 {
            context.bind()?;
            let raw = driver::mem_host_alloc(len).map_err(|error| host_error(len, error))?;
            let ptr =
                NonNull::new(raw).ok_or_else(|| host_error(len, "cuMemHostAlloc returned null"))?;
            (ptr, Backing::HostAlloc)
        } else {
            context.bind()?;
            (map_and_register(len, pin_threads)?, Backing::Registered)
        };
        Ok(PinnedMemory {
            ptr,
            len,
            backing,
            context: Arc::clone(context),
        })
    }
}

/// An anonymous mapping of `len` bytes, faulted in by `threads` threads, then registered.
fn map_and_register(len: usize, threads: usize) -> Result<NonNull<u8>, DeviceError> {
    // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return Err(host_error(len, std::io::Error::last_os_error()));
    }
    // Huge pages make the faulting 512 times fewer; where the kernel refuses, small pages do.
    // SAFETY: advice on the mapping just made.
    unsafe { libc::madvise(raw, len, libc::MADV_HUGEPAGE) };
    let base = raw as usize;
    let page = 4096;
    // A thread per 64 MiB at most: small buffers are not worth a thread each.
    let threads = threads.min(len.div_ceil(64 << 20)).max(1);
    let per_thread = len.div_ceil(threads).next_multiple_of(page);
    std::thread::scope(|scope| {
        for first in (0..len).step_by(per_thread) {
            let end = (first + per_thread).min(len);
            scope.spawn(move || {
                for offset in (first..end).step_by(page) {
                    // SAFETY: `offset < len`, inside the private mapping, which no one else
                    // reads or writes until registration; each thread touches its own pages.
                    unsafe { std::ptr::write_volatile((base + offset) as *mut u8, 0) };
                }
            });
        }
    });
    // SAFETY: the mapping is ours, page-aligned, and stays until `Drop` unregisters it first.
    let registered = unsafe { driver::mem_host_register(raw.cast(), len) };
    if let Err(error) = registered {
        // SAFETY: undoes the mapping made above, which nothing uses.
        unsafe { libc::munmap(raw, len) };
        return Err(host_error(len, error));
    }
    NonNull::new(raw.cast()).ok_or_else(|| host_error(len, "mmap returned null"))
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
        // The HostBuffer around this memory waited for its copies before dropping it.
        let freed = match self.backing {
            Backing::Empty => Ok(()),
            Backing::HostAlloc => self
                .context
                .bind()
                // SAFETY: from cuMemHostAlloc, freed once, no copy uses it.
                .and_then(|()| unsafe { driver::mem_free_host(self.ptr.as_ptr()) }),
            Backing::Registered => {
                let unregistered = self
                    .context
                    .bind()
                    // SAFETY: registered by `map_and_register`, unregistered once, no copy uses it.
                    .and_then(|()| unsafe { driver::mem_host_unregister(self.ptr.as_ptr()) });
                // SAFETY: the mapping of `map_and_register`, unmapped once, after unpinning.
                if unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) } != 0 {
                    tracing::error!(error = %std::io::Error::last_os_error(), "cannot unmap pinned host memory");
                }
                unregistered
            }
        };
        if let Err(error) = freed {
            tracing::error!(%error, len = self.len, "cannot free pinned host memory");
        }
    }
}
