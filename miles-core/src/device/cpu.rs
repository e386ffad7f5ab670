//! The CPU device: host memory standing in for device memory.
//!
//! Each reservation is an anonymous `mmap` range (`MAP_NORESERVE`, aligned to the 2 MiB granule
//! and advised for transparent huge pages). Committing accounts the bytes against the device's
//! capacity, so out-of-memory is real, and queues the range for prefault threads that fault its
//! pages in (`MADV_POPULATE_WRITE`) ahead of the first copies into it; releasing is
//! `madvise(MADV_DONTNEED)`, so the range's resident pages really drop while its addresses stay
//! reserved. Copies are `memcpy`s, split over the rayon pool when large, and complete before they
//! return.
//!
//! Why prefault: pages released a moment ago are still warm in the kernel, but on a VM with free
//! page reporting (e.g. `page_reporting_order` 9) they go back to the hypervisor within a fraction
//! of a second, and faulting them in again then costs about ten times as much. A resume that
//! copies 1 GiB from disk at 3 GB/s would reach its last chunks too late; two low-priority
//! prefault threads fault the whole committed range in at ~15 GB/s while the first chunks are
//! read.
//!
//! The device tracks every committed granule, every host view and every copy in flight, so a
//! call on a range that is not reserved or committed, or that conflicts with a view, is an error
//! rather than undefined behaviour.

mod prefault;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use rayon::prelude::{IndexedParallelIterator, ParallelIterator, ParallelSlice, ParallelSliceMut};

use self::prefault::Prefault;
use super::view::{HostView, ViewAccess, ViewClaim};
use super::{
    AddressRange, Device, DeviceError, DeviceKind, Fence, HostAllocation, HostBuffer, MemoryInfo,
};

/// Granule of reservations, commits and releases: 2 MiB, as on an H200 and as a huge page.
const GRANULE: usize = 2 << 20;

/// Copies at least this large are split over the rayon pool.
const PARALLEL_COPY_BYTES: usize = 8 << 20;

/// Piece of a parallel copy handed to one worker at a time.
const COPY_PIECE_BYTES: usize = 4 << 20;

/// The CPU device: reservations are anonymous `mmap` ranges, release drops their pages.
#[derive(Debug)]
pub struct CpuDevice {
    capacity: u64,
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<HostState>,
    prefault: Prefault,
}

#[derive(Debug, Default)]
struct HostState {
    /// Reservations by start address.
    reservations: BTreeMap<u64, Reservation>,
    committed_bytes: u64,
    /// Live host views and copies in flight, each with the access it holds.
    claims: Vec<Claim>,
    next_claim: u64,
}

#[derive(Debug)]
struct Reservation {
    len: usize,
    /// One flag per granule: whether it is committed.
    committed: Vec<bool>,
}

#[derive(Debug, Clone, Copy)]
struct Claim {
    id: u64,
    range: AddressRange,
    access: ViewAccess,
}

impl CpuDevice {
    /// A CPU device that can commit up to `capacity_bytes` at once.
    pub fn new(capacity_bytes: u64) -> CpuDevice {
        CpuDevice {
            capacity: capacity_bytes,
            shared: Arc::new(Shared {
                state: Mutex::new(HostState::default()),
                prefault: Prefault::start(),
            }),
        }
    }

    /// Bytes of `range` (inside a reservation) whose pages are resident in RAM, measured with
    /// `mincore`.
    ///
    /// # Errors
    /// [`DeviceError::BadRange`] for a range outside every reservation; the `mincore` error.
    pub fn resident_bytes_in(&self, range: AddressRange) -> Result<u64, DeviceError> {
        let state = self.shared.lock();
        state.reservation_of(range)?;
        resident_pages(range)
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, HostState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl HostState {
    /// The reservation holding `range`, with its start address.
    fn reservation_of(&self, range: AddressRange) -> Result<(u64, &Reservation), DeviceError> {
        self.reservations
            .range(..=range.start)
            .next_back()
            .filter(|(start, reservation)| range.end() <= **start + reservation.len as u64)
            .map(|(start, reservation)| (*start, reservation))
            .ok_or(DeviceError::BadRange {
                start: range.start,
                len: range.len,
                expected: "reserved",
            })
    }

    /// Granule indices `[first, last)` of a granule-aligned `range`, within its reservation.
    fn granules(&self, range: AddressRange) -> Result<(u64, usize, usize), DeviceError> {
        check_aligned("address", range.start)?;
        check_aligned("length", range.len as u64)?;
        let (start, _) = self.reservation_of(range)?;
        let first = ((range.start - start) as usize) / GRANULE;
        Ok((start, first, first + range.len / GRANULE))
    }

    /// Whether every byte of `range` lies in committed granules.
    fn check_committed(&self, range: AddressRange) -> Result<(), DeviceError> {
        let (start, reservation) = self.reservation_of(range)?;
        if range.len == 0 {
            return Ok(());
        }
        let first = ((range.start - start) as usize) / GRANULE;
        let last = ((range.end() - start) as usize).div_ceil(GRANULE);
        if reservation.committed[first..last].iter().all(|&c| c) {
            Ok(())
        } else {
            Err(DeviceError::BadRange {
                start: range.start,
                len: range.len,
                expected: "committed",
            })
        }
    }

    /// Claim `range` for `access` unless a live claim conflicts with it.
    fn claim(&mut self, range: AddressRange, access: ViewAccess) -> Result<u64, DeviceError> {
        self.check_committed(range)?;
        self.check_unclaimed(range, access)?;
        self.next_claim += 1;
        let id = self.next_claim;
        self.claims.push(Claim { id, range, access });
        Ok(id)
    }

    /// Fail when a live claim conflicts with `access` to `range`.
    fn check_unclaimed(&self, range: AddressRange, access: ViewAccess) -> Result<(), DeviceError> {
        let conflict = self.claims.iter().any(|claim| {
            overlaps(claim.range, range)
                && (access == ViewAccess::Write || claim.access == ViewAccess::Write)
        });
        if conflict {
            Err(DeviceError::BadRange {
                start: range.start,
                len: range.len,
                expected: "free of conflicting host views and copies",
            })
        } else {
            Ok(())
        }
    }

    fn unclaim(&mut self, id: u64) {
        self.claims.retain(|claim| claim.id != id);
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.prefault.stop();
        let state = self.lock();
        for (&start, reservation) in &state.reservations {
            if let Err(error) = unmap(start, reservation.len) {
                tracing::error!(%error, start, "cannot unmap a cpu device reservation");
            }
        }
    }
}

/// A claim held by a [`HostView`] or a copy; dropping it ends the claim.
struct ClaimGuard {
    shared: Arc<Shared>,
    id: u64,
}

impl ViewClaim for ClaimGuard {}

impl Drop for ClaimGuard {
    fn drop(&mut self) {
        self.shared.lock().unclaim(self.id);
    }
}

impl CpuDevice {
    /// Claim `range` for the duration of a copy.
    fn claim(&self, range: AddressRange, access: ViewAccess) -> Result<ClaimGuard, DeviceError> {
        let id = self.shared.lock().claim(range, access)?;
        Ok(ClaimGuard {
            shared: Arc::clone(&self.shared),
            id,
        })
    }
}

impl Device for CpuDevice {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Cpu
    }

    fn name(&self) -> String {
        "cpu".to_string()
    }

    fn granularity(&self) -> usize {
        GRANULE
    }

    fn reserve(&self, len: usize) -> Result<AddressRange, DeviceError> {
        check_aligned("length", len as u64)?;
        let start = map_aligned(len)?;
        let mut state = self.shared.lock();
        state.reservations.insert(
            start,
            Reservation {
                len,
                committed: vec![false; len / GRANULE],
            },
        );
        Ok(AddressRange { start, len })
    }

    fn unreserve(&self, range: AddressRange) -> Result<(), DeviceError> {
        let mut state = self.shared.lock();
        let matches = state
            .reservations
            .get(&range.start)
            .is_some_and(|r| r.len == range.len);
        if !matches {
            return Err(DeviceError::BadRange {
                start: range.start,
                len: range.len,
                expected: "a whole reservation",
            });
        }
        state.check_unclaimed(range, ViewAccess::Write)?;
        self.shared.prefault.cancel(range);
        unmap(range.start, range.len)?;
        if let Some(reservation) = state.reservations.remove(&range.start) {
            let granules = reservation.committed.iter().filter(|&&c| c).count();
            state.committed_bytes -= (granules * GRANULE) as u64;
        }
        Ok(())
    }

    fn commit(&self, range: AddressRange) -> Result<(), DeviceError> {
        let mut state = self.shared.lock();
        let (start, first, last) = state.granules(range)?;
        let free = self.capacity.saturating_sub(state.committed_bytes);
        if range.len as u64 > free {
            return Err(DeviceError::OutOfMemory {
                device: DeviceKind::Cpu,
                requested: range.len as u64,
                free,
            });
        }
        let reservation = state
            .reservations
            .get_mut(&start)
            .ok_or(DeviceError::BadRange {
                start: range.start,
                len: range.len,
                expected: "reserved",
            })?;
        if reservation.committed[first..last].iter().any(|&c| c) {
            return Err(DeviceError::BadRange {
                start: range.start,
                len: range.len,
                expected: "released",
            });
        }
        reservation.committed[first..last].fill(true);
        state.committed_bytes += range.len as u64;
        self.shared.prefault.push(range);
        Ok(())
    }

    fn release(&self, range: AddressRange) -> Result<(), DeviceError> {
        let mut state = self.shared.lock();
        let (start, first, last) = state.granules(range)?;
        state.check_committed(range)?;
        state.check_unclaimed(range, ViewAccess::Write)?;
        self.shared.prefault.cancel(range);
        drop_pages(range)?;
        if let Some(reservation) = state.reservations.get_mut(&start) {
            reservation.committed[first..last].fill(false);
        }
        state.committed_bytes -= range.len as u64;
        Ok(())
    }

    fn memory_info(&self) -> Result<MemoryInfo, DeviceError> {
        let state = self.shared.lock();
        Ok(MemoryInfo {
            free: self.capacity.saturating_sub(state.committed_bytes),
            total: self.capacity,
        })
    }

    fn alloc_host(&self, len: usize) -> Result<HostBuffer, DeviceError> {
        let memory = HostMemory::new(len).map_err(|error| DeviceError::HostOutOfMemory {
            requested: len,
            reason: error.to_string(),
        })?;
        Ok(HostBuffer::new(Box::new(memory)))
    }

    fn copy_to_host(
        &self,
        src: AddressRange,
        dst: &mut HostBuffer,
        offset: usize,
    ) -> Result<Fence, DeviceError> {
        let bytes = dst.as_mut_slice()?;
        let dst_range = AddressRange {
            start: 0,
            len: bytes.len(),
        }
        .slice(offset, src.len)?;
        let dst_bytes = &mut bytes[offset..dst_range.end() as usize];
        self.read(src, dst_bytes)?;
        Ok(Fence::signalled())
    }

    fn copy_from_host(
        &self,
        src: &mut HostBuffer,
        offset: usize,
        dst: AddressRange,
    ) -> Result<Fence, DeviceError> {
        let bytes = src.as_slice()?;
        let src_range = AddressRange {
            start: 0,
            len: bytes.len(),
        }
        .slice(offset, dst.len)?;
        self.write(&bytes[offset..src_range.end() as usize], dst)?;
        Ok(Fence::signalled())
    }

    fn read(&self, src: AddressRange, dst: &mut [u8]) -> Result<(), DeviceError> {
        if src.len != dst.len() {
            return Err(DeviceError::LengthMismatch {
                src: src.len,
                dst: dst.len(),
            });
        }
        let _claim = self.claim(src, ViewAccess::Read)?;
        // SAFETY: the range is committed inside a live mapping (checked by `claim`), and the
        // read claim keeps it mapped and keeps every writer (views, copies, releases) out until
        // the copy is done.
        let device =
            unsafe { std::slice::from_raw_parts(src.start as usize as *const u8, src.len) };
        copy_bytes(dst, device);
        Ok(())
    }

    fn write(&self, src: &[u8], dst: AddressRange) -> Result<(), DeviceError> {
        if src.len() != dst.len {
            return Err(DeviceError::LengthMismatch {
                src: src.len(),
                dst: dst.len,
            });
        }
        let _claim = self.claim(dst, ViewAccess::Write)?;
        // SAFETY: the range is committed inside a live mapping (checked by `claim`), and the
        // write claim keeps it mapped and excludes every other access until the copy is done.
        let device =
            unsafe { std::slice::from_raw_parts_mut(dst.start as usize as *mut u8, dst.len) };
        copy_bytes(device, src);
        Ok(())
    }

    fn host_view(
        &self,
        range: AddressRange,
        access: ViewAccess,
    ) -> Result<Option<HostView>, DeviceError> {
        let claim = self.claim(range, access)?;
        // SAFETY: the range is committed inside a live mapping; the claim keeps it mapped (the
        // `Shared` it holds unmaps only when dropped) and keeps out releases, writes and
        // conflicting views until the view drops.
        Ok(Some(unsafe {
            HostView::new(range, access, Box::new(claim))
        }))
    }

    fn resident_bytes(&self) -> Result<u64, DeviceError> {
        let state = self.shared.lock();
        state
            .reservations
            .iter()
            .map(|(&start, r)| resident_pages(AddressRange { start, len: r.len }))
            .sum()
    }
}

/// Copy `src` into `dst` (same length), over the rayon pool when large.
fn copy_bytes(dst: &mut [u8], src: &[u8]) {
    if src.len() < PARALLEL_COPY_BYTES {
        dst.copy_from_slice(src);
    } else {
        dst.par_chunks_mut(COPY_PIECE_BYTES)
            .zip(src.par_chunks(COPY_PIECE_BYTES))
            .for_each(|(d, s)| d.copy_from_slice(s));
    }
}

fn overlaps(a: AddressRange, b: AddressRange) -> bool {
    a.start < b.end() && b.start < a.end()
}

fn check_aligned(what: &'static str, value: u64) -> Result<(), DeviceError> {
    if value.is_multiple_of(GRANULE as u64) {
        Ok(())
    } else {
        Err(DeviceError::Unaligned {
            what,
            value,
            granularity: GRANULE,
        })
    }
}

fn os_error(call: &'static str) -> DeviceError {
    DeviceError::Os {
        call,
        source: std::io::Error::last_os_error(),
    }
}

/// Map `len` bytes of address space (no memory behind it until touched) at a granule-aligned
/// address, advised for transparent huge pages.
fn map_aligned(len: usize) -> Result<u64, DeviceError> {
    let padded = len
        .checked_add(GRANULE)
        .ok_or_else(|| DeviceError::HostOutOfMemory {
            requested: len,
            reason: "a reservation this large and its alignment overflow the address space".into(),
        })?;
    // SAFETY: an anonymous private mapping at an address of the kernel's choosing touches no
    // existing memory.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            padded,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(os_error("mmap"));
    }
    let base = base as usize;
    let start = base.next_multiple_of(GRANULE);
    let head = start - base;
    let tail = padded - head - len;
    if head > 0 {
        unmap(base as u64, head)?;
    }
    if tail > 0 {
        unmap((start + len) as u64, tail)?;
    }
    // SAFETY: `[start, start + len)` is the mapping made above; advice does not change contents.
    if unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE) } != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "no transparent huge pages");
    }
    Ok(start as u64)
}

fn unmap(start: u64, len: usize) -> Result<(), DeviceError> {
    // SAFETY: callers pass (part of) a mapping this module made and that nothing borrows: the
    // device refuses to unreserve claimed ranges.
    if unsafe { libc::munmap(start as usize as *mut libc::c_void, len) } != 0 {
        return Err(os_error("munmap"));
    }
    Ok(())
}

/// Drop the pages of a granule-aligned range; later reads see zeros.
fn drop_pages(range: AddressRange) -> Result<(), DeviceError> {
    // SAFETY: the range lies in a private anonymous mapping of this device and no claim (view
    // or copy) holds it, so no Rust reference observes its contents changing.
    let rc = unsafe {
        libc::madvise(
            range.start as usize as *mut libc::c_void,
            range.len,
            libc::MADV_DONTNEED,
        )
    };
    if rc != 0 {
        return Err(os_error("madvise(MADV_DONTNEED)"));
    }
    Ok(())
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size).unwrap_or(4096)
}

/// Resident bytes of a page-aligned range inside a mapping.
fn resident_pages(range: AddressRange) -> Result<u64, DeviceError> {
    let page = page_size();
    let mut flags = vec![0u8; range.len.div_ceil(page)];
    if flags.is_empty() {
        return Ok(0);
    }
    // SAFETY: the range is mapped (callers hold the state lock that keeps it so) and `flags`
    // has one byte per page of it, as mincore requires.
    let rc = unsafe {
        libc::mincore(
            range.start as usize as *mut libc::c_void,
            range.len,
            flags.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(os_error("mincore"));
    }
    Ok(flags.iter().filter(|&&f| f & 1 == 1).count() as u64 * page as u64)
}

/// Page-aligned host memory of the CPU device (an anonymous mapping).
struct HostMemory {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: `HostMemory` owns its mapping; access goes through `&self`/`&mut self`.
unsafe impl Send for HostMemory {}
// SAFETY: as above; `&HostMemory` hands out only shared slices.
unsafe impl Sync for HostMemory {}

impl HostMemory {
    fn new(len: usize) -> Result<HostMemory, std::io::Error> {
        if len == 0 {
            return Ok(HostMemory {
                ptr: std::ptr::NonNull::dangling().as_ptr(),
                len,
            });
        }
        // SAFETY: an anonymous private mapping at an address of the kernel's choosing touches
        // no existing memory.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: the mapping just made; advice does not change contents.
        unsafe { libc::madvise(ptr, len, libc::MADV_HUGEPAGE) };
        Ok(HostMemory {
            ptr: ptr.cast(),
            len,
        })
    }
}

impl HostAllocation for HostMemory {
    fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is a live mapping of `len` bytes owned by `self` (or dangling with
        // `len` 0).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes this the only borrow.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    fn is_pinned(&self) -> bool {
        false
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        if self.len > 0
            && let Err(error) = unmap(self.ptr as u64, self.len)
        {
            tracing::error!(%error, "cannot unmap a cpu host buffer");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    fn device() -> CpuDevice {
        CpuDevice::new(64 * MIB as u64)
    }

    #[test]
    fn commit_beyond_capacity_is_out_of_memory_and_commits_nothing() {
        let device = device();
        let range = device.reserve(128 * MIB).unwrap();
        let err = device.commit(range).unwrap_err();
        assert!(matches!(err, DeviceError::OutOfMemory { .. }), "{err}");
        assert_eq!(device.memory_info().unwrap().free, 64 * MIB as u64);
        device.commit(range.slice(0, 64 * MIB).unwrap()).unwrap();
        assert_eq!(device.memory_info().unwrap().free, 0);
    }

    #[test]
    fn release_drops_resident_pages_and_keeps_the_range_reserved() {
        let device = device();
        let range = device.reserve(16 * MIB).unwrap();
        device.commit(range).unwrap();
        let pattern: Vec<u8> = (0..range.len).map(|i| (i % 251) as u8 + 1).collect();
        device.write(&pattern, range).unwrap();
        assert_eq!(device.resident_bytes_in(range).unwrap(), range.len as u64);
        device.release(range).unwrap();
        assert_eq!(device.resident_bytes_in(range).unwrap(), 0);
        device.commit(range).unwrap();
        let mut back = vec![1u8; range.len];
        device.read(range, &mut back).unwrap();
        assert!(back.iter().all(|&b| b == 0));
    }

    #[test]
    fn touching_uncommitted_or_unreserved_memory_is_an_error() {
        let device = device();
        let range = device.reserve(4 * MIB).unwrap();
        let mut bytes = vec![0u8; 16];
        assert!(
            device
                .read(range.slice(0, 16).unwrap(), &mut bytes)
                .is_err()
        );
        assert!(device.release(range).is_err());
        let elsewhere = AddressRange {
            start: range.end() + GRANULE as u64 * 1000,
            len: 16,
        };
        assert!(device.write(&bytes, elsewhere).is_err());
        assert!(device.commit(range.slice(4096, GRANULE).unwrap()).is_err());
        device.commit(range).unwrap();
        assert!(device.commit(range).is_err(), "double commit must fail");
    }

    #[test]
    fn a_range_whose_end_overflows_is_refused_not_wrapped() {
        let device = device();
        let range = device.reserve(4 * MIB).unwrap();
        device.commit(range).unwrap();
        let huge = AddressRange {
            start: range.start,
            len: usize::MAX,
        };
        assert!(matches!(
            device.host_view(huge, ViewAccess::Read),
            Err(DeviceError::BadRange { .. })
        ));
        assert!(device.release(huge).is_err());
        assert!(matches!(
            device.reserve(usize::MAX - GRANULE + 1),
            Err(DeviceError::HostOutOfMemory { .. })
        ));
    }

    #[test]
    fn views_exclude_conflicting_access() {
        let device = device();
        let range = device.reserve(4 * MIB).unwrap();
        device.commit(range).unwrap();
        let part = range.slice(0, 1024).unwrap();
        let mut view = device.host_view(part, ViewAccess::Write).unwrap().unwrap();
        view.as_mut_slice::<f32>().unwrap()[3] = 2.5;
        assert!(device.host_view(part, ViewAccess::Read).is_err());
        assert!(device.write(&[7u8; 1024], part).is_err());
        assert!(device.release(range).is_err());
        let other = range.slice(1024, 1024).unwrap();
        assert!(device.host_view(other, ViewAccess::Write).is_ok());
        drop(view);
        let read = device.host_view(part, ViewAccess::Read).unwrap().unwrap();
        assert_eq!(read.as_slice::<f32>().unwrap()[3], 2.5);
        assert!(device.host_view(part, ViewAccess::Read).is_ok());
    }

    #[test]
    fn large_copies_round_trip_through_a_host_buffer() {
        let device = device();
        let range = device.reserve(32 * MIB).unwrap();
        device.commit(range).unwrap();
        let len = 20 * MIB + 13;
        let part = range.slice(5, len).unwrap();
        let pattern: Vec<u8> = (0..len).map(|i| (i * 7 % 253) as u8 + 1).collect();
        let mut host = device.alloc_host(len + 100).unwrap();
        host.as_mut_slice().unwrap()[100..].copy_from_slice(&pattern);
        device
            .copy_from_host(&mut host, 100, part)
            .unwrap()
            .wait()
            .unwrap();
        let mut back = device.alloc_host(len).unwrap();
        device.copy_to_host(part, &mut back, 0).unwrap();
        assert!(back.as_slice().unwrap() == pattern.as_slice());
    }

    #[test]
    fn a_release_right_after_a_commit_leaves_nothing_resident_while_prefaulting() {
        let device = device();
        let range = device.reserve(64 * MIB).unwrap();
        for _ in 0..20 {
            device.commit(range).unwrap();
            device.release(range).unwrap();
            assert_eq!(device.resident_bytes_in(range).unwrap(), 0);
        }
    }
}
