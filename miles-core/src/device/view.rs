//! Host views of device memory, on devices whose memory the host addresses (the CPU device).
//!
//! A [`HostView`] borrows a committed device range as host memory. The device that hands it out
//! keeps a claim on the range for as long as the view lives and refuses anything that would
//! break the view's aliasing rules meanwhile: a second view overlapping a writable one, a write
//! or copy into a viewed range, a release or an unreserve of it.

use super::{AddressRange, DeviceError};

/// Plain data that any bit pattern makes valid and that has no padding, so device bytes can be
/// viewed as a slice of it.
///
/// # Safety
/// Implement only for types where every bit pattern of `size_of::<Self>()` bytes is a valid value
/// and that contain no padding bytes.
pub unsafe trait Pod: Copy + Send + Sync + 'static {}

// SAFETY: integers and floats of these widths accept every bit pattern and have no padding.
unsafe impl Pod for u8 {}
// SAFETY: as above.
unsafe impl Pod for i8 {}
// SAFETY: as above.
unsafe impl Pod for u16 {}
// SAFETY: as above.
unsafe impl Pod for i16 {}
// SAFETY: as above.
unsafe impl Pod for u32 {}
// SAFETY: as above.
unsafe impl Pod for i32 {}
// SAFETY: as above.
unsafe impl Pod for u64 {}
// SAFETY: as above.
unsafe impl Pod for i64 {}
// SAFETY: as above.
unsafe impl Pod for f32 {}
// SAFETY: as above.
unsafe impl Pod for f64 {}
// SAFETY: `half::bf16` is a `repr(transparent)` wrapper of a `u16`.
unsafe impl Pod for half::bf16 {}
// SAFETY: `half::f16` is a `repr(transparent)` wrapper of a `u16`.
unsafe impl Pod for half::f16 {}

/// Whether a view may write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ViewAccess {
    /// Shared, read-only; any number may overlap.
    Read,
    /// Exclusive, writable; overlaps nothing else.
    Write,
}

/// The device's claim on a viewed range; dropping it ends the claim.
pub trait ViewClaim: Send + Sync {}

/// A committed device range borrowed as host memory.
///
/// Obtained from [`Device::host_view`](super::Device::host_view); the device keeps the range
/// claimed (no release, no write into it, no conflicting view) until the view drops.
pub struct HostView {
    ptr: *mut u8,
    range: AddressRange,
    access: ViewAccess,
    _claim: Box<dyn ViewClaim>,
}

// SAFETY: the view is the only handle to its bytes that the device lets write them (a writable
// view excludes every other access) and the claim keeps the memory mapped, so moving or sharing
// the view across threads is as safe as moving or sharing a slice.
unsafe impl Send for HostView {}
// SAFETY: as above; `&HostView` only hands out shared slices.
unsafe impl Sync for HostView {}

impl HostView {
    /// Wrap the host memory behind a claimed device range.
    ///
    /// # Safety
    /// `range.start` must be the host address of `range.len` bytes that stay mapped, readable
    /// (and writable for [`ViewAccess::Write`]) while `claim` lives, and that nothing else writes
    /// (nor, for [`ViewAccess::Write`], reads) meanwhile.
    pub unsafe fn new(
        range: AddressRange,
        access: ViewAccess,
        claim: Box<dyn ViewClaim>,
    ) -> HostView {
        HostView {
            ptr: range.start as usize as *mut u8,
            range,
            access,
            _claim: claim,
        }
    }

    /// The viewed device range.
    pub fn range(&self) -> AddressRange {
        self.range
    }

    /// Whether the view may write.
    pub fn access(&self) -> ViewAccess {
        self.access
    }

    /// The bytes as a slice of `T`.
    ///
    /// # Errors
    /// [`DeviceError::Unaligned`] when the address or the length does not fit `T`.
    pub fn as_slice<T: Pod>(&self) -> Result<&[T], DeviceError> {
        let count = self.count_of::<T>()?;
        // SAFETY: `new`'s contract keeps the bytes mapped and unwritten by others while `self`
        // lives; `count_of` checked alignment and length; `T: Pod` accepts every bit pattern.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr as *const T, count) })
    }

    /// The bytes as a writable slice of `T`.
    ///
    /// # Errors
    /// [`DeviceError::BadRange`] for a read-only view; [`DeviceError::Unaligned`] when the
    /// address or the length does not fit `T`.
    pub fn as_mut_slice<T: Pod>(&mut self) -> Result<&mut [T], DeviceError> {
        if self.access != ViewAccess::Write {
            return Err(DeviceError::BadRange {
                start: self.range.start,
                len: self.range.len,
                expected: "viewed for writing",
            });
        }
        let count = self.count_of::<T>()?;
        // SAFETY: a writable view is the only access to its bytes (`new`'s contract) and
        // `&mut self` makes this slice the only borrow of the view; alignment and length were
        // checked; `T: Pod` accepts every bit pattern.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut T, count) })
    }

    fn count_of<T: Pod>(&self) -> Result<usize, DeviceError> {
        let size = std::mem::size_of::<T>();
        let align = std::mem::align_of::<T>();
        if !self.range.start.is_multiple_of(align as u64) {
            return Err(DeviceError::Unaligned {
                what: "view address",
                value: self.range.start,
                granularity: align,
            });
        }
        if self.range.len > isize::MAX as usize {
            return Err(DeviceError::OutOfRange {
                offset: 0,
                len: self.range.len,
                range_len: isize::MAX as usize,
            });
        }
        if !self.range.len.is_multiple_of(size) {
            return Err(DeviceError::Unaligned {
                what: "view length",
                value: self.range.len as u64,
                granularity: size,
            });
        }
        Ok(self.range.len / size)
    }
}

impl std::fmt::Debug for HostView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostView")
            .field("range", &self.range)
            .field("access", &self.access)
            .finish()
    }
}
