//! Buffers of a region, and typed host views of them.

use std::fmt;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::thread::ThreadId;

use crate::device::{AddressRange, DeviceAddress, Fence, HostView, Pod, ViewAccess};

use super::region::Region;
use super::{FreeError, MemoryError, MemoryTag};

/// A block of device memory in a tag's region, at an address that stays the same across pause
/// and resume.
///
/// Its bytes can be used only while the tag is active: through device copies
/// ([`read`](Self::read), [`write`](Self::write)) on any device, or as typed slices
/// ([`view`](Self::view), [`view_mut`](Self::view_mut)) on a device whose memory the host
/// addresses. A pause of the tag waits until every view of it has dropped and every fence
/// recorded with [`record_use`](Self::record_use) has completed. Dropping a buffer
/// frees it (once the tag is active again, if it is paused).
pub struct Buffer {
    region: Arc<Region>,
    offset: usize,
    size: usize,
    len: usize,
    live: bool,
}

/// A shared typed view of a [`Buffer`]; the tag cannot pause while it lives.
pub struct BufferView<'a, T: Pod> {
    view: HostView,
    _guard: ViewGuard<'a>,
    _elements: PhantomData<&'a [T]>,
}

/// A writable typed view of a [`Buffer`]; the tag cannot pause while it lives.
pub struct BufferViewMut<'a, T: Pod> {
    view: HostView,
    _guard: ViewGuard<'a>,
    _elements: PhantomData<&'a mut [T]>,
}

/// Counts a use of the region by the thread that made it for as long as it lives; declared
/// after the device view in the view types so the device claim ends first.
struct ViewGuard<'a> {
    region: &'a Region,
    thread: ThreadId,
}

impl Drop for ViewGuard<'_> {
    fn drop(&mut self) {
        self.region.exit_view(self.thread);
    }
}

impl Buffer {
    pub(crate) fn new(region: Arc<Region>, offset: usize, size: usize, len: usize) -> Buffer {
        Buffer {
            region,
            offset,
            size,
            len,
            live: true,
        }
    }

    /// The tag of the buffer's region.
    pub fn tag(&self) -> &MemoryTag {
        &self.region.tag
    }

    /// Length in bytes, as allocated.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address of the first byte (a `CUdeviceptr` on CUDA).
    pub fn address(&self) -> DeviceAddress {
        self.region.range.start + self.offset as u64
    }

    /// The buffer's device range.
    pub fn range(&self) -> AddressRange {
        AddressRange {
            start: self.address(),
            len: self.len,
        }
    }

    fn guard(&self) -> Result<ViewGuard<'_>, MemoryError> {
        let thread = self.region.enter_view()?;
        Ok(ViewGuard {
            region: &self.region,
            thread,
        })
    }

    fn host_view(&self, access: ViewAccess) -> Result<HostView, MemoryError> {
        let device_error = |source| MemoryError::Device {
            tag: self.region.tag.clone(),
            source,
        };
        let view = self
            .region
            .device
            .host_view(self.range(), access)
            .map_err(device_error)?
            .ok_or_else(|| MemoryError::NotHostAddressable {
                tag: self.region.tag.clone(),
                device: self.region.device.kind(),
            })?;
        Ok(view)
    }

    /// The bytes as a shared slice of `T`.
    ///
    /// # Errors
    /// [`MemoryError::TagPaused`] (or `TagBusy`) when the tag is not active;
    /// [`MemoryError::NotHostAddressable`] on CUDA; [`MemoryError::Device`] when the length is
    /// not a multiple of `T`'s size.
    pub fn view<T: Pod>(&self) -> Result<BufferView<'_, T>, MemoryError> {
        let guard = self.guard()?;
        let view = self.host_view(ViewAccess::Read)?;
        view.as_slice::<T>().map_err(|source| MemoryError::Device {
            tag: self.region.tag.clone(),
            source,
        })?;
        Ok(BufferView {
            view,
            _guard: guard,
            _elements: PhantomData,
        })
    }

    /// The bytes as a writable slice of `T`.
    ///
    /// # Errors
    /// As [`view`](Self::view).
    pub fn view_mut<T: Pod>(&mut self) -> Result<BufferViewMut<'_, T>, MemoryError> {
        let guard = self.guard()?;
        let mut view = self.host_view(ViewAccess::Write)?;
        view.as_mut_slice::<T>()
            .map_err(|source| MemoryError::Device {
                tag: self.region.tag.clone(),
                source,
            })?;
        Ok(BufferViewMut {
            view,
            _guard: guard,
            _elements: PhantomData,
        })
    }

    /// Copy bytes `[offset, offset + dst.len())` of the buffer into `dst`.
    ///
    /// # Errors
    /// [`MemoryError::TagPaused`] (or `TagBusy`) when the tag is not active;
    /// [`MemoryError::Device`] for bytes outside the buffer or a failed copy.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), MemoryError> {
        let _guard = self.guard()?;
        self.range()
            .slice(offset, dst.len())
            .and_then(|range| self.region.device.read(range, dst))
            .map_err(|source| MemoryError::Device {
                tag: self.region.tag.clone(),
                source,
            })
    }

    /// Copy `src` into bytes `[offset, offset + src.len())` of the buffer.
    ///
    /// # Errors
    /// As [`read`](Self::read).
    pub fn write(&mut self, offset: usize, src: &[u8]) -> Result<(), MemoryError> {
        let _guard = self.guard()?;
        self.range()
            .slice(offset, src.len())
            .and_then(|range| self.region.device.write(src, range))
            .map_err(|source| MemoryError::Device {
                tag: self.region.tag.clone(),
                source,
            })
    }

    /// Record device work in flight that uses the buffer (a kernel, a copy); a pause of the tag
    /// waits for it before it copies or releases anything.
    pub fn record_use(&self, fence: Fence) {
        self.region.record_use(fence);
    }

    /// Free the buffer now.
    ///
    /// # Errors
    /// [`FreeError`] with the buffer, still allocated, when its tag is not active.
    pub fn free(mut self) -> Result<(), FreeError> {
        match self.region.free(self.offset, self.size) {
            Ok(()) => {
                self.live = false;
                Ok(())
            }
            Err(error) => Err(FreeError {
                buffer: self,
                error,
            }),
        }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        if self.live {
            self.region.free_or_defer(self.offset, self.size);
        }
    }
}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer")
            .field("tag", &self.region.tag)
            .field("address", &format_args!("{:#x}", self.address()))
            .field("len", &self.len)
            .finish()
    }
}

impl<T: Pod> Deref for BufferView<'_, T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        // The element type was checked against the view when it was made.
        self.view.as_slice::<T>().unwrap_or_default()
    }
}

impl<T: Pod> Deref for BufferViewMut<'_, T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        // The element type was checked against the view when it was made.
        self.view.as_slice::<T>().unwrap_or_default()
    }
}

impl<T: Pod> DerefMut for BufferViewMut<'_, T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // The element type was checked against the view when it was made.
        self.view.as_mut_slice::<T>().unwrap_or_default()
    }
}
