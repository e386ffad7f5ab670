//! A pool of host buffers for backups and disk staging, allocated once and reused.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::device::{Device, HostBuffer};

use super::StoreError;

/// Host buffers from [`Device::alloc_host`] (pinned on CUDA), reused across pause/resume
/// cycles.
///
/// The pool grows to the high-water mark of what is taken at once and keeps its buffers until
/// [`release`](Self::release): pinning is slow, so it happens once, not per pause.
#[derive(Debug)]
pub struct HostPool {
    device: Arc<dyn Device>,
    inner: Mutex<PoolInner>,
}

#[derive(Debug, Default)]
struct PoolInner {
    free: Vec<HostBuffer>,
    allocated_bytes: u64,
}

impl HostPool {
    /// An empty pool allocating from `device`.
    pub fn new(device: Arc<dyn Device>) -> HostPool {
        HostPool {
            device,
            inner: Mutex::new(PoolInner::default()),
        }
    }

    /// A buffer of at least `len` bytes: the smallest free one that fits, or a new one (rounded
    /// up to the device granularity) when none does.
    ///
    /// # Errors
    /// [`StoreError::Device`] when the host cannot provide a new buffer.
    pub fn take(&self, len: usize) -> Result<HostBuffer, StoreError> {
        {
            let mut inner = self.lock();
            let best = inner
                .free
                .iter()
                .enumerate()
                .filter(|(_, b)| b.len() >= len)
                .min_by_key(|(_, b)| b.len())
                .map(|(i, _)| i);
            if let Some(index) = best {
                return Ok(inner.free.swap_remove(index));
            }
        }
        let rounded = len.next_multiple_of(self.device.granularity().max(4096));
        let buffer = self.device.alloc_host(rounded)?;
        self.lock().allocated_bytes += rounded as u64;
        tracing::debug!(bytes = rounded, "host pool grew");
        Ok(buffer)
    }

    /// Give a buffer back for reuse.
    pub fn put(&self, buffer: HostBuffer) {
        self.lock().free.push(buffer);
    }

    /// Bytes of host memory the pool has allocated and not released (taken or free).
    pub fn allocated_bytes(&self) -> u64 {
        self.lock().allocated_bytes
    }

    /// Free every buffer not taken now; returns the bytes freed.
    pub fn release(&self) -> u64 {
        let mut inner = self.lock();
        let freed: u64 = inner.free.iter().map(|b| b.len() as u64).sum();
        inner.free.clear();
        inner.allocated_bytes -= freed;
        freed
    }

    fn lock(&self) -> MutexGuard<'_, PoolInner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::CpuDevice;

    #[test]
    fn buffers_are_reused_and_released_only_on_request() {
        let pool = HostPool::new(Arc::new(CpuDevice::new(1 << 30)));
        let a = pool.take(3 << 20).unwrap();
        let size = pool.allocated_bytes();
        assert!(size >= 3 << 20);
        pool.put(a);
        for _ in 0..10 {
            let b = pool.take(1 << 20).unwrap();
            pool.put(b);
        }
        assert_eq!(pool.allocated_bytes(), size);
        let held = pool.take(1 << 20).unwrap();
        let second = pool.take(1 << 20).unwrap();
        let grown = pool.allocated_bytes() - size;
        assert!(grown >= 1 << 20, "a second buffer must be allocated");
        pool.put(second);
        assert_eq!(pool.release(), grown);
        assert_eq!(pool.allocated_bytes(), size);
        drop(held);
    }
}
