//! Devices: where tensors live, and the one contract every device implements.
//!
//! The [`Device`] trait is shaped after the CUDA driver's virtual-memory API so that the CUDA device
//! maps onto it one call to one call: an address range is *reserved* once (`cuMemAddressReserve`),
//! physical memory is *committed* into it and *released* from it in granules (`cuMemCreate` +
//! `cuMemMap` + `cuMemSetAccess`, and `cuMemUnmap` + `cuMemRelease`), and copies between a device
//! range and host memory are asynchronous, each completed by a [`Fence`]. The CPU device implements
//! the same calls with an anonymous `mmap` range and `madvise(MADV_DONTNEED)`.
//!
//! All `unsafe` code of miles lives under this module.

pub mod c_abi;
mod cpu;
mod cpu_gemm;
mod cuda;
mod error;
#[cfg(test)]
mod faulty;
mod mapped;
mod open;
pub mod probe;
mod view;

pub use cpu::CpuDevice;
pub use cpu_gemm::{GemmShapeError, MatrixView, sgemm};
pub use cuda::compute::{
    Collectives, Gemm, GemmAlgo, GemmOutput, Gpu, GpuElement, GpuGraph, GpuSlice, ID_BYTES,
    KernelProgram, LaunchConfig, Mailbox, NcclComm, TILE_COLUMNS, TensorMap, Transpose, compile,
};
pub use cuda::{CudaDevice, CudaOptions};
pub use error::DeviceError;
#[cfg(test)]
pub(crate) use faulty::FaultyDevice;
pub use mapped::MappedFile;
pub use open::{OpenedDevice, open, open_on, open_test_device, open_with, resolve};
pub use view::{HostView, Pod, ViewAccess, ViewClaim};

use std::fmt;
use std::sync::{Arc, Mutex};

/// An address in a device's address space (a CUDA `CUdeviceptr`, or a host address on the CPU
/// device).
pub type DeviceAddress = u64;

/// A contiguous range of device addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AddressRange {
    /// First address of the range.
    pub start: DeviceAddress,
    /// Length in bytes.
    pub len: usize,
}

impl AddressRange {
    /// The range one past the end of this one would start at; `u64::MAX` for a range whose
    /// end does not fit (so that it lies inside no reservation and every check refuses it).
    pub fn end(&self) -> DeviceAddress {
        self.start.saturating_add(self.len as u64)
    }

    /// The sub-range `[offset, offset + len)` of this range.
    ///
    /// # Errors
    /// [`DeviceError::OutOfRange`] when the sub-range does not lie inside this range.
    pub fn slice(&self, offset: usize, len: usize) -> Result<AddressRange, DeviceError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(AddressRange {
                start: self.start + offset as u64,
                len,
            }),
            _ => Err(DeviceError::OutOfRange {
                offset,
                len,
                range_len: self.len,
            }),
        }
    }
}

/// Which kind of device a [`Device`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    /// Host memory standing in for device memory (CI, machines without a GPU).
    Cpu,
    /// An NVIDIA GPU through the CUDA driver.
    Cuda,
}

impl fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
        })
    }
}

/// Device memory, free and total, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryInfo {
    /// Bytes that can still be committed.
    pub free: u64,
    /// Capacity of the device.
    pub total: u64,
}

/// Completion of an asynchronous device operation; cheap to clone.
///
/// A fence from a device whose operations complete synchronously is already signalled.
#[derive(Clone)]
pub struct Fence {
    pending: Option<Arc<dyn PendingWork>>,
}

/// Work a [`Fence`] waits for; implemented by each asynchronous device (a CUDA event, say).
pub trait PendingWork: Send + Sync {
    /// Block until the work is done.
    ///
    /// # Errors
    /// The device's error if the work failed.
    fn wait(&self) -> Result<(), DeviceError>;

    /// Whether the work is done, without blocking.
    ///
    /// # Errors
    /// The device's error if the work failed.
    fn is_done(&self) -> Result<bool, DeviceError>;

    /// The work as [`Any`](std::any::Any), for the device that made it to recognise its own
    /// kind of work (the CUDA device makes a stream wait on its events this way, with no host
    /// wait); `None` for work no device needs to look into.
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        None
    }
}

impl Fence {
    /// A fence that is already signalled.
    pub fn signalled() -> Fence {
        Fence { pending: None }
    }

    /// A fence that completes when `work` does.
    pub fn pending(work: Arc<dyn PendingWork>) -> Fence {
        Fence {
            pending: Some(work),
        }
    }

    /// Block until the fenced work is done.
    ///
    /// # Errors
    /// The device's error if the work failed.
    pub fn wait(&self) -> Result<(), DeviceError> {
        match &self.pending {
            Some(work) => work.wait(),
            None => Ok(()),
        }
    }

    /// Whether the fenced work is done, without blocking.
    ///
    /// # Errors
    /// The device's error if the work failed.
    pub fn is_done(&self) -> Result<bool, DeviceError> {
        match &self.pending {
            Some(work) => work.is_done(),
            None => Ok(true),
        }
    }

    /// The work this fence waits for; `None` for a signalled fence.
    pub fn work(&self) -> Option<&Arc<dyn PendingWork>> {
        self.pending.as_ref()
    }
}

impl fmt::Debug for Fence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fence")
            .field("pending", &self.pending.is_some())
            .finish()
    }
}

/// The bytes behind a [`HostBuffer`]: pinned on CUDA (page-locked, portable, not write-combined),
/// plain page-aligned memory on the CPU device. Implemented by each device's host allocation; the
/// memory stays valid and at the same address until the value drops.
pub trait HostAllocation: Send + Sync {
    /// The bytes.
    fn as_slice(&self) -> &[u8];

    /// The bytes, writable.
    fn as_mut_slice(&mut self) -> &mut [u8];

    /// Whether the memory is page-locked for direct device access.
    fn is_pinned(&self) -> bool;
}

/// Host memory that asynchronous device copies read and write.
///
/// The buffer remembers the copies in flight on it and waits for them before it hands out its
/// bytes or frees them, so no copy can touch memory that is read, written or gone.
pub struct HostBuffer {
    memory: Box<dyn HostAllocation>,
    in_flight: Mutex<Vec<Fence>>,
}

impl HostBuffer {
    /// Wrap a device's host allocation.
    pub fn new(memory: Box<dyn HostAllocation>) -> HostBuffer {
        HostBuffer {
            memory,
            in_flight: Mutex::new(Vec::new()),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.memory.as_slice().len()
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the memory is page-locked for direct device access.
    pub fn is_pinned(&self) -> bool {
        self.memory.is_pinned()
    }

    /// The bytes, once every copy in flight on the buffer is done.
    ///
    /// # Errors
    /// The device's error if a copy in flight failed.
    pub fn as_slice(&self) -> Result<&[u8], DeviceError> {
        self.wait()?;
        Ok(self.memory.as_slice())
    }

    /// The bytes, writable, once every copy in flight on the buffer is done.
    ///
    /// # Errors
    /// The device's error if a copy in flight failed.
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8], DeviceError> {
        self.wait()?;
        Ok(self.memory.as_mut_slice())
    }

    /// Block until every copy in flight on the buffer is done.
    ///
    /// # Errors
    /// The device's error if a copy in flight failed.
    pub fn wait(&self) -> Result<(), DeviceError> {
        let fences = std::mem::take(&mut *lock(&self.in_flight));
        fences.iter().try_for_each(Fence::wait)
    }

    /// The address and length of the bytes, for a device that starts an asynchronous copy on
    /// them; it must then [`record_copy`](Self::record_copy) the copy's fence before it returns.
    /// For [`Device`] implementations only.
    pub fn raw_parts_for_copy(&mut self) -> (*mut u8, usize) {
        let bytes = self.memory.as_mut_slice();
        (bytes.as_mut_ptr(), bytes.len())
    }

    /// Record a copy in flight on the buffer; readers, writers and the drop wait for it.
    pub fn record_copy(&self, fence: Fence) {
        lock(&self.in_flight).push(fence);
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if let Err(error) = self.wait() {
            tracing::error!(%error, "a copy into a dropped host buffer failed");
        }
    }
}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuffer")
            .field("len", &self.len())
            .field("pinned", &self.is_pinned())
            .finish()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A device: reserved address ranges, physical memory committed and released in granules inside
/// them, and asynchronous copies to and from host memory.
///
/// Implementations are thread-safe: one range may be released while another is copied.
pub trait Device: Send + Sync + fmt::Debug {
    /// Which kind of device this is.
    fn kind(&self) -> DeviceKind;

    /// A human-readable name, e.g. `NVIDIA H200 (cuda:0)` or `cpu`.
    fn name(&self) -> String;

    /// The granule, in bytes, of reservations, commits and releases (2 MiB on an H200).
    fn granularity(&self) -> usize;

    /// Reserve `len` bytes of address space (a multiple of the granularity) with no physical
    /// memory behind it.
    ///
    /// # Errors
    /// [`DeviceError::Unaligned`] for a length off the granularity; the device's error when no
    /// address space is left.
    fn reserve(&self, len: usize) -> Result<AddressRange, DeviceError>;

    /// Give a reserved range back. Any memory still committed in it is released first.
    ///
    /// # Errors
    /// The device's error.
    fn unreserve(&self, range: AddressRange) -> Result<(), DeviceError>;

    /// Back `range` (granule-aligned, inside a reservation) with new physical memory, readable
    /// and writable at exactly these addresses. Its contents are unspecified.
    ///
    /// # Errors
    /// [`DeviceError::OutOfMemory`] when the device cannot hold it; nothing is committed then.
    fn commit(&self, range: AddressRange) -> Result<(), DeviceError>;

    /// Release the physical memory behind `range` (granule-aligned, committed); the addresses
    /// stay reserved. The caller has waited for every operation that uses the range.
    ///
    /// # Errors
    /// The device's error.
    fn release(&self, range: AddressRange) -> Result<(), DeviceError>;

    /// The committed `range` cut where the device's own pieces of physical memory meet, in
    /// address order, so that releasing the parts one by one splits no piece: on CUDA the
    /// `cuMemCreate` pieces a commit made; on a device without pieces, `range` whole.
    fn release_parts(&self, range: AddressRange) -> Vec<AddressRange> {
        vec![range]
    }

    /// Free and total device memory.
    ///
    /// # Errors
    /// The device's error.
    fn memory_info(&self) -> Result<MemoryInfo, DeviceError>;

    /// Allocate `len` bytes of host memory suited to this device's copies (pinned on CUDA).
    ///
    /// # Errors
    /// [`DeviceError::HostOutOfMemory`] when the host cannot provide it.
    fn alloc_host(&self, len: usize) -> Result<HostBuffer, DeviceError>;

    /// Start copying the committed device range `src` into `dst[offset..offset + src.len]`.
    ///
    /// The copy is recorded on `dst`, which waits for it before handing out its bytes.
    ///
    /// # Errors
    /// [`DeviceError::OutOfRange`] when the bytes do not fit `dst`; the device's error.
    fn copy_to_host(
        &self,
        src: AddressRange,
        dst: &mut HostBuffer,
        offset: usize,
    ) -> Result<Fence, DeviceError>;

    /// Start copying `src[offset..offset + dst.len]` into the committed device range `dst`.
    ///
    /// The copy is recorded on `src`, which waits for it before it can be written or dropped.
    ///
    /// # Errors
    /// [`DeviceError::OutOfRange`] when the bytes do not fit `src`; the device's error.
    fn copy_from_host(
        &self,
        src: &mut HostBuffer,
        offset: usize,
        dst: AddressRange,
    ) -> Result<Fence, DeviceError>;

    /// Copy the committed device range `src` into ordinary host memory and wait for it.
    ///
    /// # Errors
    /// [`DeviceError::LengthMismatch`] when the lengths differ; the device's error.
    fn read(&self, src: AddressRange, dst: &mut [u8]) -> Result<(), DeviceError>;

    /// Copy ordinary host memory into the committed device range `dst` and wait for it.
    ///
    /// # Errors
    /// [`DeviceError::LengthMismatch`] when the lengths differ; the device's error.
    fn write(&self, src: &[u8], dst: AddressRange) -> Result<(), DeviceError>;

    /// Borrow the committed range as host memory, on a device whose memory the host addresses
    /// (the CPU device); `None` on a device whose memory it does not (CUDA).
    ///
    /// While the view lives the device refuses to release, unreserve or write into the range,
    /// and to hand out a view that conflicts with it (any overlap with a writable one).
    ///
    /// # Errors
    /// [`DeviceError::BadRange`] for a range that is not committed or that a conflicting view
    /// or copy holds.
    fn host_view(
        &self,
        range: AddressRange,
        access: ViewAccess,
    ) -> Result<Option<HostView>, DeviceError> {
        let _ = (range, access);
        Ok(None)
    }

    /// Bytes of physical device memory in use now, as the device itself counts them: resident
    /// pages of the reserved ranges on the CPU device, used memory on CUDA.
    ///
    /// # Errors
    /// The device's error.
    fn resident_bytes(&self) -> Result<u64, DeviceError> {
        let info = self.memory_info()?;
        Ok(info.total.saturating_sub(info.free))
    }
}
