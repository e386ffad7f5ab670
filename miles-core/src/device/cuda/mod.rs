//! The CUDA device: the [`Device`] trait on an NVIDIA GPU through the driver's virtual-memory API.
//!
//! - `reserve` is `cuMemAddressReserve`; `unreserve` releases what is still committed and frees
//!   the addresses.
//! - `commit` creates physical memory in pieces of [`CudaOptions::commit_chunk`] bytes
//!   (`cuMemCreate`), maps each at its place (`cuMemMap`) and grants access to the whole range in
//!   one `cuMemSetAccess`. Fewer, larger pieces make commit and release cheaper; the granularity
//!   (2 MiB on an H200) only bounds what a caller may ask for.
//! - `release` waits for the copies still queued on the range (their events), then unmaps and
//!   releases its pieces one after the other (`release.rs`). A release that cuts a
//!   piece in two keeps the bytes of the parts that stay committed by moving them into new
//!   pieces (a device-to-device copy); releasing whole commits never does this, nor does
//!   releasing the parts `release_parts` names one by one, as a pause to host memory does.
//! - After a release, a collector thread makes the driver collect its records of the memory it
//!   scrubbed, off the critical path (`scrub.rs`, [`CudaOptions::collect_after`]).
//! - `copy_to_host` / `copy_from_host` cut a copy into [`CudaOptions::copy_chunk`] pieces spread
//!   over [`CudaOptions::streams_per_direction`] streams, one stream set per direction so that one
//!   tag goes out while another comes in. A copy runs after earlier copies it conflicts with
//!   (device-side waits, no host blocking) and its [`Fence`] is a set of CUDA events.
//! - Compute that uses a tag hands the memory manager a fence from
//!   [`CudaDevice::record_fence`], recorded on the compute stream after the last use, to wait on
//!   before a pause.
//!
//! Nothing here touches cudarc before a libloading probe has found the driver library and every
//! symbol it needs: cudarc panics otherwise. Every driver call runs with the device's primary
//! context made current on the calling thread, so the device can be used from any thread.

pub mod compute;
mod context;
mod copies;
mod driver;
mod pinned;
mod ranges;
mod release;
mod scrub;

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use cudarc::driver::sys;

use self::context::{Context, Event, EventWork};
use self::copies::{CopyEngine, Direction, InFlightCopies};
use self::pinned::PinnedMemory;
use self::ranges::{Mapping, Reservations};
use self::scrub::Collector;
use super::{
    AddressRange, Device, DeviceAddress, DeviceError, DeviceKind, Fence, HostBuffer, MemoryInfo,
    PendingWork,
};

/// How a [`CudaDevice`] cuts its work; the defaults are the fastest measured on an H200 (see
/// `bench/RESULTS.md`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaOptions {
    /// Bytes of physical memory per `cuMemCreate` handle when committing (rounded up to the
    /// granularity); a commit's last piece may be shorter.
    pub commit_chunk: usize,
    /// Bytes per queued `cuMemcpy*Async` of a copy.
    pub copy_chunk: usize,
    /// Streams per copy direction that a copy's chunks are spread over.
    pub streams_per_direction: usize,
    /// Host memory: 0 pins with `cuMemHostAlloc`; n > 0 maps it, faults it in on n threads,
    /// then pins it with `cuMemHostRegister` (faster for large buffers on many cores).
    pub pin_threads: usize,
    /// At most this many bytes committed at once (`None`: the whole GPU). A commit past it is
    /// [`DeviceError::OutOfMemory`] and `memory_info` reports the limit as the total, as on a
    /// GPU shared with another process that holds the rest; tests use it to make out-of-memory
    /// real at small sizes.
    pub memory_limit: Option<u64>,
    /// How long after a release a background thread first makes the driver collect its records
    /// of the memory it scrubbed, then again at doubling waits (`scrub.rs`), so that the next
    /// release does not (`None`: never).
    pub collect_after: Option<Duration>,
}

impl Default for CudaOptions {
    fn default() -> CudaOptions {
        CudaOptions {
            commit_chunk: 1 << 30,
            copy_chunk: 64 << 20,
            streams_per_direction: 2,
            pin_threads: std::thread::available_parallelism().map_or(1, |n| n.get().min(16)),
            memory_limit: None,
            collect_after: Some(Duration::from_millis(100)),
        }
    }
}

/// Reservations and queued copies, under one lock so that a release and a copy on the same
/// range cannot interleave.
#[derive(Debug, Default)]
struct State {
    book: Reservations,
    copies: InFlightCopies,
}

/// An NVIDIA GPU as a [`Device`].
pub struct CudaDevice {
    ordinal: i32,
    name: String,
    device: sys::CUdevice,
    granularity: usize,
    options: CudaOptions,
    prop: sys::CUmemAllocationProp,
    state: Mutex<State>,
    engine: CopyEngine,
    collector: Option<Collector>,
    context: Arc<Context>,
}

// SAFETY: `prop` is a plain C struct read by value (its one pointer field is null and never
// followed); the other fields are Send + Sync.
unsafe impl Send for CudaDevice {}
// SAFETY: as above; all mutable state sits behind `state`'s mutex.
unsafe impl Sync for CudaDevice {}

impl CudaDevice {
    /// Open GPU `ordinal` with the default [`CudaOptions`].
    ///
    /// # Errors
    /// [`DeviceError::CudaUnavailable`] when the driver library, a symbol of it, or the GPU is
    /// missing; the driver's error otherwise.
    pub fn open(ordinal: i32) -> Result<CudaDevice, DeviceError> {
        CudaDevice::open_with(ordinal, CudaOptions::default())
    }

    /// Open GPU `ordinal` with the given options.
    ///
    /// # Errors
    /// As [`CudaDevice::open`].
    pub fn open_with(ordinal: i32, options: CudaOptions) -> Result<CudaDevice, DeviceError> {
        super::probe::cudarc_driver_ready().map_err(DeviceError::CudaUnavailable)?;
        driver::init().map_err(|error| DeviceError::CudaUnavailable(error.to_string()))?;
        let count = driver::device_get_count()?;
        if ordinal < 0 || ordinal >= count {
            return Err(DeviceError::CudaUnavailable(format!(
                "no gpu cuda:{ordinal} ({count} found)"
            )));
        }
        let device = driver::device_get(ordinal)?;
        let context = Context::retain(device)?;
        context.bind()?;
        let prop = driver::device_allocation_prop(device);
        let granularity = driver::mem_get_allocation_granularity(&prop)?;
        let options = CudaOptions {
            commit_chunk: options.commit_chunk.max(1).next_multiple_of(granularity),
            copy_chunk: options.copy_chunk.max(1),
            streams_per_direction: options.streams_per_direction.max(1),
            ..options
        };
        let engine = CopyEngine::new(&context, options.streams_per_direction, options.copy_chunk)?;
        let collector = options
            .collect_after
            .map(|after| Collector::start(&context, device, granularity, after))
            .transpose()?;
        let name = driver::device_get_name(device)?;
        tracing::info!(ordinal, %name, granularity, ?options, "opened cuda device");
        Ok(CudaDevice {
            ordinal,
            name,
            device,
            granularity,
            options,
            prop,
            state: Mutex::new(State::default()),
            engine,
            collector,
            context,
        })
    }

    /// The GPU's ordinal (`cuda:N`).
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// The options in effect (after rounding).
    pub fn options(&self) -> CudaOptions {
        self.options
    }

    /// Wait until every stream of the GPU's primary context is idle: the fence for work the
    /// memory manager cannot see (another library's kernels on memory of a tag, say), which
    /// a pause or a free of that memory waits for first.
    ///
    /// # Errors
    /// The driver's error, or the error of the work waited for.
    pub fn synchronize(&self) -> Result<(), DeviceError> {
        self.context.bind()?;
        driver::ctx_synchronize()
    }

    /// Make this GPU's primary context current on the calling thread, as a caller that shares
    /// the thread with another CUDA library (PyTorch) leaves it after working on another GPU.
    ///
    /// # Errors
    /// The driver's error.
    pub fn make_current(&self) -> Result<(), DeviceError> {
        self.context.bind()
    }

    /// The ordinal of the GPU whose context is current on the calling thread, `None` when no
    /// context is current.
    ///
    /// # Errors
    /// [`DeviceError::CudaUnavailable`] when the driver library or a symbol of it is missing;
    /// the driver's error.
    pub fn current_ordinal() -> Result<Option<i32>, DeviceError> {
        super::probe::cudarc_driver_ready().map_err(DeviceError::CudaUnavailable)?;
        let Some(current) = driver::ctx_get_device()? else {
            return Ok(None);
        };
        for ordinal in 0..driver::device_get_count()? {
            if driver::device_get(ordinal)? == current {
                return Ok(Some(ordinal));
            }
        }
        Ok(None)
    }

    /// `len` bytes of ordinary device memory (`cuMemAlloc`), outside every reservation of the
    /// device: the plain path for memory no tag holds.
    ///
    /// # Errors
    /// [`DeviceError::OutOfMemory`] when the GPU cannot hold it; the driver's error.
    pub fn plain_alloc(&self, len: usize) -> Result<DeviceAddress, DeviceError> {
        self.context.bind()?;
        driver::mem_alloc(len.max(1)).map_err(|error| {
            if driver::is_out_of_memory(&error) {
                DeviceError::OutOfMemory {
                    device: DeviceKind::Cuda,
                    requested: len as u64,
                    free: driver::mem_get_info().map_or(0, |(free, _)| free as u64),
                }
            } else {
                error
            }
        })
    }

    /// Free memory from [`plain_alloc`](Self::plain_alloc), once the GPU is idle.
    ///
    /// # Errors
    /// The driver's error (for an address `plain_alloc` did not return, say).
    pub fn plain_free(&self, address: DeviceAddress) -> Result<(), DeviceError> {
        self.synchronize()?;
        // SAFETY: the driver checks that `address` is a live `cuMemAlloc` allocation of this
        // context and fails otherwise; the GPU is idle, so no queued work uses it.
        unsafe { driver::mem_free(address) }
    }

    /// A fence that completes when the work queued so far on `stream` does: record it after the
    /// last kernel that uses a tag and give it to the memory manager as the tag's last use, which
    /// a pause waits for. `stream` must belong to this GPU's primary context (cudarc's
    /// `CudaContext::new(ordinal)` uses it).
    ///
    /// # Errors
    /// The driver's error.
    pub fn record_fence(&self, stream: &cudarc::driver::CudaStream) -> Result<Fence, DeviceError> {
        self.context.bind()?;
        // SAFETY: the `CudaStream` borrow keeps the stream alive; the context is current.
        let event = unsafe { Event::record(&self.context, stream.cu_stream()) }?;
        Ok(Fence::pending(Arc::new(EventWork::new(vec![event]))))
    }

    /// Make the work queued later on `stream` wait, on the device, for `fence` (a resume's fence,
    /// say): no host thread blocks. A fence of this device's copies becomes `cuStreamWaitEvent`
    /// calls on its events; a signalled fence needs nothing; any other fence is waited for on
    /// the host (logged at debug level), as nothing else can order a stream after it.
    ///
    /// # Errors
    /// The driver's error; the fenced work's error when it is waited for on the host.
    pub fn stream_wait(
        &self,
        stream: &cudarc::driver::CudaStream,
        fence: &Fence,
    ) -> Result<(), DeviceError> {
        let Some(work) = fence.work() else {
            return Ok(());
        };
        let Some(events) = work
            .as_any()
            .and_then(|any| any.downcast_ref::<EventWork>())
        else {
            tracing::debug!("a fence of other work: waiting for it on the host");
            return fence.wait();
        };
        self.context.bind()?;
        events.events().iter().try_for_each(|event| {
            // SAFETY: the `CudaStream` borrow keeps the stream alive; it belongs to this GPU's
            // primary context, which the events were recorded in.
            unsafe { event.make_raw_wait(stream.cu_stream()) }
        })
    }

    /// One plain synchronous `cuMemcpyDtoH` of the committed range `src` into
    /// `dst[offset..]`: the baseline that benchmarks put next to [`Device::copy_to_host`].
    ///
    /// # Errors
    /// As [`Device::copy_to_host`].
    pub fn plain_copy_to_host(
        &self,
        src: AddressRange,
        dst: &mut HostBuffer,
        offset: usize,
    ) -> Result<(), DeviceError> {
        dst.wait()?;
        let host = self.host_window(dst, offset, src.len)?;
        let state = self.quiet(src)?;
        state.book.check_committed(src)?;
        // SAFETY: `src` is committed and no copy on it is queued (held lock); the host window
        // lies inside `dst`, whose copies are done, and the call returns after the copy.
        unsafe { driver::memcpy_dtoh(host, src.start, src.len) }
    }

    /// One plain synchronous `cuMemcpyHtoD` of `src[offset..]` into the committed range `dst`:
    /// the baseline that benchmarks put next to [`Device::copy_from_host`].
    ///
    /// # Errors
    /// As [`Device::copy_from_host`].
    pub fn plain_copy_from_host(
        &self,
        src: &mut HostBuffer,
        offset: usize,
        dst: AddressRange,
    ) -> Result<(), DeviceError> {
        src.wait()?;
        let host = self.host_window(src, offset, dst.len)?;
        let state = self.quiet(dst)?;
        state.book.check_committed(dst)?;
        // SAFETY: as in `plain_copy_to_host`, the other way round.
        unsafe { driver::memcpy_htod(dst.start, host, dst.len) }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The state lock, taken once no queued copy touches `range` or the pieces mapped over it;
    /// waits for such copies without holding the lock. Makes the context current.
    fn quiet(&self, range: AddressRange) -> Result<MutexGuard<'_, State>, DeviceError> {
        self.context.bind()?;
        loop {
            let mut state = self.lock();
            let hull = hull(&state.book.overlapping(range)).unwrap_or(range);
            let pending = state.copies.pending_on(hull)?;
            if pending.is_empty() {
                return Ok(state);
            }
            drop(state);
            pending.iter().try_for_each(|work| work.wait())?;
        }
    }

    fn check_aligned(&self, range: AddressRange) -> Result<(), DeviceError> {
        let unaligned = |what, value: u64| DeviceError::Unaligned {
            what,
            value,
            granularity: self.granularity,
        };
        if !range.start.is_multiple_of(self.granularity as u64) {
            return Err(unaligned("address", range.start));
        }
        if !range.len.is_multiple_of(self.granularity) {
            return Err(unaligned("length", range.len as u64));
        }
        Ok(())
    }

    /// The host address `buffer[offset..offset + len]`, which must fit.
    fn host_window(
        &self,
        buffer: &mut HostBuffer,
        offset: usize,
        len: usize,
    ) -> Result<*mut u8, DeviceError> {
        let (base, buffer_len) = buffer.raw_parts_for_copy();
        match offset.checked_add(len) {
            // SAFETY: `offset <= buffer_len`, so the pointer stays inside (or one past) the buffer.
            Some(end) if end <= buffer_len => Ok(unsafe { base.add(offset) }),
            _ => Err(DeviceError::OutOfRange {
                offset,
                len,
                range_len: buffer_len,
            }),
        }
    }

    /// Map the handle `handle` of `range.len` bytes at `range` and grant access.
    fn map(&self, range: AddressRange, handle: u64) -> Result<(), DeviceError> {
        // SAFETY: `range` lies in a reservation of ours with nothing mapped there (checked by the
        // callers under the state lock, or a fresh temporary reservation).
        unsafe { driver::mem_map(range.start, range.len, handle) }?;
        // SAFETY: the range was just mapped whole.
        let access = unsafe { driver::mem_set_access(range.start, range.len, self.device) };
        if access.is_err() {
            // SAFETY: undoes the mapping just made.
            if let Err(error) = unsafe { driver::mem_unmap(range.start, range.len) } {
                tracing::error!(%error, "cannot undo a mapping after a failed access grant");
            }
        }
        access
    }

    /// A new handle holding a copy of the committed bytes of `part`, for a mapping cut in two.
    fn copy_into_new_handle(&self, part: AddressRange) -> Result<u64, DeviceError> {
        let handle = driver::mem_create(part.len, &self.prop)?;
        let copied = driver::mem_address_reserve(part.len, self.granularity).and_then(|temp| {
            let scratch = AddressRange {
                start: temp,
                len: part.len,
            };
            let result = self.map(scratch, handle).and_then(|()| {
                // SAFETY: both ranges are mapped; no queued copy touches `part` (state lock).
                let copy = unsafe { driver::memcpy_dtod(temp, part.start, part.len) }
                    // SAFETY: the null stream is the one the copy was queued on; waiting for
                    // the event recorded after it means the copy is done, so neither range is
                    // unmapped under it (unmapping under a running copy is an illegal address).
                    .and_then(|()| unsafe { Event::record(&self.context, std::ptr::null_mut()) })
                    .and_then(|event| EventWork::new(vec![event]).wait());
                // SAFETY: undoes the temporary mapping made above, once the copy is done (or
                // failed to start).
                copy.and(unsafe { driver::mem_unmap(temp, part.len) })
            });
            // SAFETY: the temporary reservation is ours and nothing is mapped there any more.
            result.and(unsafe { driver::mem_address_free(temp, part.len) })
        });
        match copied {
            Ok(()) => Ok(handle),
            Err(error) => {
                // SAFETY: the fresh handle is ours, unmapped, and released once.
                if let Err(undo) = unsafe { driver::mem_release(handle) } {
                    tracing::error!(error = %undo, "cannot release a handle after a failed split");
                }
                Err(error)
            }
        }
    }

    /// Release the part of `mapping` inside `cut`, keeping the bytes of the rest.
    fn split(
        &self,
        book: &mut Reservations,
        mapping: Mapping,
        cut: AddressRange,
    ) -> Result<(), DeviceError> {
        let whole = mapping.range();
        let kept: Vec<AddressRange> = [
            (whole.start < cut.start).then(|| AddressRange {
                start: whole.start,
                len: (cut.start - whole.start) as usize,
            }),
            (cut.end() < whole.end()).then(|| AddressRange {
                start: cut.end(),
                len: (whole.end() - cut.end()) as usize,
            }),
        ]
        .into_iter()
        .flatten()
        .collect();
        let mut fresh = Vec::with_capacity(kept.len());
        for part in &kept {
            match self.copy_into_new_handle(*part) {
                Ok(handle) => fresh.push((*part, handle)),
                Err(error) => {
                    for (_, handle) in fresh {
                        // SAFETY: fresh handles are ours, unmapped, released once.
                        if let Err(undo) = unsafe { driver::mem_release(handle) } {
                            tracing::error!(error = %undo, "cannot release a handle after a failed split");
                        }
                    }
                    return Err(error);
                }
            }
        }
        tracing::debug!(
            start = whole.start,
            len = whole.len,
            "split a mapping to release part of it"
        );
        self.unmap(book, mapping)?;
        for (part, handle) in fresh {
            self.map(part, handle)?;
            book.add(Mapping {
                start: part.start,
                len: part.len,
                handle,
            })?;
        }
        Ok(())
    }

    /// Undo the pieces of a commit that failed.
    fn undo_commit(&self, created: &[Mapping], unmapped: Option<u64>) {
        for mapping in created {
            // SAFETY: these pieces were mapped by the failed commit and nothing uses them yet.
            let unmapped = unsafe { driver::mem_unmap(mapping.start, mapping.len) };
            // SAFETY: the handle is ours, now unmapped, and released once.
            let undone = unmapped.and(unsafe { driver::mem_release(mapping.handle) });
            if let Err(error) = undone {
                tracing::error!(%error, "cannot undo part of a failed commit");
            }
        }
        if let Some(handle) = unmapped {
            // SAFETY: a handle created by the failed commit and never mapped.
            if let Err(error) = unsafe { driver::mem_release(handle) } {
                tracing::error!(%error, "cannot undo part of a failed commit");
            }
        }
    }

    /// Queue a copy and record it on the host buffer.
    fn queue_copy(
        &self,
        direction: Direction,
        device: AddressRange,
        buffer: &mut HostBuffer,
        offset: usize,
    ) -> Result<Fence, DeviceError> {
        let host = self.host_window(buffer, offset, device.len)?;
        if device.len == 0 {
            return Ok(Fence::signalled());
        }
        self.context.bind()?;
        let mut state = self.lock();
        state.book.check_committed(device)?;
        // SAFETY: `device` is committed, and a release waits for this copy (it is remembered in
        // `state.copies`); the host window lies in `buffer`, which waits for the fence recorded
        // on it below before its bytes are handed out or freed.
        let work = unsafe {
            self.engine
                .queue(&mut state.copies, direction, device, host)
        }?;
        let fence = Fence::pending(work);
        buffer.record_copy(fence.clone());
        Ok(fence)
    }
}

/// The smallest range covering every mapping in `mappings` (in address order).
fn hull(mappings: &[Mapping]) -> Option<AddressRange> {
    let first = mappings.first()?;
    let last = mappings.last()?;
    Some(AddressRange {
        start: first.start,
        len: (last.range().end() - first.start) as usize,
    })
}

impl Device for CudaDevice {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Cuda
    }

    fn name(&self) -> String {
        format!("{} (cuda:{})", self.name, self.ordinal)
    }

    fn granularity(&self) -> usize {
        self.granularity
    }

    fn reserve(&self, len: usize) -> Result<AddressRange, DeviceError> {
        if len == 0 || !len.is_multiple_of(self.granularity) {
            return Err(DeviceError::Unaligned {
                what: "length",
                value: len as u64,
                granularity: self.granularity,
            });
        }
        self.context.bind()?;
        let start = driver::mem_address_reserve(len, self.granularity)?;
        let range = AddressRange { start, len };
        self.lock().book.insert(range);
        Ok(range)
    }

    fn unreserve(&self, range: AddressRange) -> Result<(), DeviceError> {
        let mut state = self.quiet(range)?;
        if !state.book.is_reservation(range) {
            return Err(DeviceError::BadRange {
                start: range.start,
                len: range.len,
                expected: "reserved",
            });
        }
        self.release_locked(&mut state.book, range)?;
        state.book.remove(range)?;
        // SAFETY: `range` is exactly one reservation of ours and nothing is mapped in it.
        unsafe { driver::mem_address_free(range.start, range.len) }
    }

    fn commit(&self, range: AddressRange) -> Result<(), DeviceError> {
        self.check_aligned(range)?;
        if range.len == 0 {
            return Ok(());
        }
        self.context.bind()?;
        let mut state = self.lock();
        state.book.check_uncommitted(range)?;
        if let Some(limit) = self.options.memory_limit {
            let committed = state.book.committed_bytes();
            if committed + range.len as u64 > limit {
                return Err(DeviceError::OutOfMemory {
                    device: DeviceKind::Cuda,
                    requested: range.len as u64,
                    free: limit.saturating_sub(committed),
                });
            }
        }
        let mut created: Vec<Mapping> = Vec::new();
        let mut offset = 0;
        let mut failure = None;
        let (mut create_time, mut map_time) = (Duration::ZERO, Duration::ZERO);
        while offset < range.len {
            let len = self.options.commit_chunk.min(range.len - offset);
            let start = range.start + offset as u64;
            let started = Instant::now();
            let handle = match driver::mem_create(len, &self.prop) {
                Ok(handle) => handle,
                Err(error) => {
                    failure = Some((error, None));
                    break;
                }
            };
            let created_at = Instant::now();
            create_time += created_at - started;
            // SAFETY: `[start, start + len)` lies in a reservation of ours with nothing mapped
            // (checked under the held lock).
            let mapped = unsafe { driver::mem_map(start, len, handle) };
            map_time += created_at.elapsed();
            if let Err(error) = mapped {
                failure = Some((error, Some(handle)));
                break;
            }
            created.push(Mapping { start, len, handle });
            offset += len;
        }
        let started = Instant::now();
        if failure.is_none() {
            // SAFETY: the whole range was just mapped by this commit.
            let access = unsafe { driver::mem_set_access(range.start, range.len, self.device) };
            failure = access.err().map(|error| (error, None));
        }
        tracing::debug!(
            pieces = created.len(),
            bytes = range.len,
            create_ms = create_time.as_secs_f64() * 1e3,
            map_ms = map_time.as_secs_f64() * 1e3,
            access_ms = started.elapsed().as_secs_f64() * 1e3,
            "committed device memory"
        );
        if let Some((error, unmapped)) = failure {
            self.undo_commit(&created, unmapped);
            if driver::is_out_of_memory(&error) {
                let free = driver::mem_get_info().map_or(0, |(free, _)| free as u64);
                return Err(DeviceError::OutOfMemory {
                    device: DeviceKind::Cuda,
                    requested: range.len as u64,
                    free,
                });
            }
            return Err(error);
        }
        created
            .into_iter()
            .try_for_each(|mapping| state.book.add(mapping))
    }

    fn release(&self, range: AddressRange) -> Result<(), DeviceError> {
        self.check_aligned(range)?;
        if range.len == 0 {
            return Ok(());
        }
        let mut state = self.quiet(range)?;
        state.book.check_committed(range)?;
        self.release_locked(&mut state.book, range)
    }

    fn release_parts(&self, range: AddressRange) -> Vec<AddressRange> {
        let parts: Vec<AddressRange> = self
            .lock()
            .book
            .overlapping(range)
            .iter()
            .map(|mapping| {
                let start = mapping.start.max(range.start);
                let end = mapping.range().end().min(range.end());
                AddressRange {
                    start,
                    len: (end - start) as usize,
                }
            })
            .collect();
        let covered: usize = parts.iter().map(|part| part.len).sum();
        if covered == range.len {
            parts
        } else {
            vec![range]
        }
    }

    fn memory_info(&self) -> Result<MemoryInfo, DeviceError> {
        self.context.bind()?;
        let (free, total) = driver::mem_get_info()?;
        let (free, total) = (free as u64, total as u64);
        Ok(match self.options.memory_limit {
            None => MemoryInfo { free, total },
            Some(limit) => MemoryInfo {
                free: free.min(limit.saturating_sub(self.lock().book.committed_bytes())),
                total: total.min(limit),
            },
        })
    }

    fn alloc_host(&self, len: usize) -> Result<HostBuffer, DeviceError> {
        let memory = PinnedMemory::new(&self.context, len, self.options.pin_threads)?;
        Ok(HostBuffer::new(Box::new(memory)))
    }

    fn copy_to_host(
        &self,
        src: AddressRange,
        dst: &mut HostBuffer,
        offset: usize,
    ) -> Result<Fence, DeviceError> {
        self.queue_copy(Direction::ToHost, src, dst, offset)
    }

    fn copy_from_host(
        &self,
        src: &mut HostBuffer,
        offset: usize,
        dst: AddressRange,
    ) -> Result<Fence, DeviceError> {
        self.queue_copy(Direction::FromHost, dst, src, offset)
    }

    fn read(&self, src: AddressRange, dst: &mut [u8]) -> Result<(), DeviceError> {
        if src.len != dst.len() {
            return Err(DeviceError::LengthMismatch {
                src: src.len,
                dst: dst.len(),
            });
        }
        if src.len == 0 {
            return Ok(());
        }
        self.context.bind()?;
        let work = {
            let mut state = self.lock();
            state.book.check_committed(src)?;
            // SAFETY: `src` is committed and a release waits for this copy; `dst` is borrowed
            // mutably until the wait below returns.
            unsafe {
                self.engine
                    .queue(&mut state.copies, Direction::ToHost, src, dst.as_mut_ptr())
            }?
        };
        work.wait()
    }

    fn write(&self, src: &[u8], dst: AddressRange) -> Result<(), DeviceError> {
        if src.len() != dst.len {
            return Err(DeviceError::LengthMismatch {
                src: src.len(),
                dst: dst.len,
            });
        }
        if dst.len == 0 {
            return Ok(());
        }
        self.context.bind()?;
        let work = {
            let mut state = self.lock();
            state.book.check_committed(dst)?;
            // SAFETY: as in `read`; the copy only reads the host bytes (the cast to `*mut` is
            // for the shared signature of `queue`, which never writes through it this way).
            unsafe {
                self.engine.queue(
                    &mut state.copies,
                    Direction::FromHost,
                    dst,
                    src.as_ptr().cast_mut(),
                )
            }?
        };
        work.wait()
    }
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("granularity", &self.granularity)
            .field("options", &self.options)
            .finish()
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        let cleaned = self.context.bind().and_then(|()| {
            let mut state = self.lock();
            state.copies.all().iter().try_for_each(|work| work.wait())?;
            for range in state.book.reserved() {
                self.release_locked(&mut state.book, range)?;
                state.book.remove(range)?;
                // SAFETY: a reservation of ours with nothing mapped in it any more.
                unsafe { driver::mem_address_free(range.start, range.len) }?;
            }
            Ok(())
        });
        if let Err(error) = cleaned {
            tracing::error!(%error, device = %self.name, "cannot clean up the cuda device");
        }
    }
}

#[cfg(test)]
#[allow(clippy::panic, clippy::print_stderr)]
mod tests;
