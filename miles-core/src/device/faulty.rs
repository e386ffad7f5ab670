//! A device over another that injects faults, for tests.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::{AddressRange, Device, DeviceError, DeviceKind, Fence, HostBuffer, MemoryInfo};

/// Another device with faults, for tests: its `fail_commit_in`-th commit from now fails as
/// out of memory and its `fail_release_in`-th release as a driver error (0: none fails), it
/// cuts ranges into parts of `part_len` bytes for a pause to release one by one (0: whole),
/// and it hides host views, as the CUDA device has none.
#[derive(Debug)]
pub(crate) struct FaultyDevice {
    inner: Arc<dyn Device>,
    /// Counts down to the commit that fails (0: none).
    pub(crate) fail_commit_in: AtomicUsize,
    /// Counts down to the release that fails (0: none).
    pub(crate) fail_release_in: AtomicUsize,
    part_len: usize,
}

/// Count `counter` down; true when this call is the one that fails.
fn fails_now(counter: &AtomicUsize) -> bool {
    let left = counter.load(Ordering::SeqCst);
    if left > 0 {
        counter.store(left - 1, Ordering::SeqCst);
    }
    left == 1
}

impl Device for FaultyDevice {
    fn kind(&self) -> DeviceKind {
        self.inner.kind()
    }
    fn name(&self) -> String {
        self.inner.name()
    }
    fn granularity(&self) -> usize {
        self.inner.granularity()
    }
    fn reserve(&self, len: usize) -> Result<AddressRange, DeviceError> {
        self.inner.reserve(len)
    }
    fn unreserve(&self, range: AddressRange) -> Result<(), DeviceError> {
        self.inner.unreserve(range)
    }
    fn commit(&self, range: AddressRange) -> Result<(), DeviceError> {
        if fails_now(&self.fail_commit_in) {
            return Err(DeviceError::OutOfMemory {
                device: self.kind(),
                requested: range.len as u64,
                free: 0,
            });
        }
        self.inner.commit(range)
    }
    fn release(&self, range: AddressRange) -> Result<(), DeviceError> {
        if fails_now(&self.fail_release_in) {
            return Err(DeviceError::Cuda {
                call: "cuMemRelease",
                message: "injected".to_string(),
            });
        }
        self.inner.release(range)
    }
    fn release_parts(&self, range: AddressRange) -> Vec<AddressRange> {
        if self.part_len == 0 {
            return vec![range];
        }
        (0..range.len.div_ceil(self.part_len))
            .map(|index| {
                let at = index * self.part_len;
                range.slice(at, self.part_len.min(range.len - at)).unwrap()
            })
            .collect()
    }
    fn memory_info(&self) -> Result<MemoryInfo, DeviceError> {
        self.inner.memory_info()
    }
    fn alloc_host(&self, len: usize) -> Result<HostBuffer, DeviceError> {
        self.inner.alloc_host(len)
    }
    fn copy_to_host(
        &self,
        src: AddressRange,
        dst: &mut HostBuffer,
        offset: usize,
    ) -> Result<Fence, DeviceError> {
        self.inner.copy_to_host(src, dst, offset)
    }
    fn copy_from_host(
        &self,
        src: &mut HostBuffer,
        offset: usize,
        dst: AddressRange,
    ) -> Result<Fence, DeviceError> {
        self.inner.copy_from_host(src, offset, dst)
    }
    fn read(&self, src: AddressRange, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.inner.read(src, dst)
    }
    fn write(&self, src: &[u8], dst: AddressRange) -> Result<(), DeviceError> {
        self.inner.write(src, dst)
    }
}

impl FaultyDevice {
    /// `inner` with no fault armed, cutting releases into parts of `part_len` bytes (0: whole).
    pub(crate) fn over(inner: Arc<dyn Device>, part_len: usize) -> FaultyDevice {
        FaultyDevice {
            inner,
            fail_commit_in: AtomicUsize::new(0),
            fail_release_in: AtomicUsize::new(0),
            part_len,
        }
    }
}
