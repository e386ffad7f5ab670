//! Asynchronous copies between device ranges and host memory: chunked, spread over a set of
//! streams per direction, ordered after earlier copies they conflict with, and remembered until
//! done so that a release never unmaps memory a copy still reads or writes.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::context::{Context, Event, EventWork, Stream};
use super::driver;
use crate::device::{AddressRange, DeviceError, PendingWork};

/// Which way bytes move.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Direction {
    /// Device to host (a pause's copy out).
    ToHost,
    /// Host to device (a resume's copy in).
    FromHost,
}

/// A copy queued and maybe not done yet.
#[derive(Debug)]
struct InFlight {
    device: AddressRange,
    host_start: usize,
    host_len: usize,
    direction: Direction,
    work: Arc<EventWork>,
}

impl InFlight {
    fn touches_device(&self, range: AddressRange) -> bool {
        self.device.start < range.end() && range.start < self.device.end()
    }

    /// Whether a new copy must run after this one: they share device bytes and one writes them,
    /// or share host bytes and one writes those.
    fn conflicts(&self, direction: Direction, device: AddressRange, host: (usize, usize)) -> bool {
        let host_overlap =
            self.host_start < host.0 + host.1 && host.0 < self.host_start + self.host_len;
        let device_conflict = self.touches_device(device)
            && (self.direction == Direction::FromHost || direction == Direction::FromHost);
        let host_conflict =
            host_overlap && (self.direction == Direction::ToHost || direction == Direction::ToHost);
        device_conflict || host_conflict
    }
}

/// The copies queued on a device, oldest first. Guarded by the device's state lock together with
/// its reservations, so a release and a new copy on the same range cannot interleave.
#[derive(Debug, Default)]
pub(crate) struct InFlightCopies {
    queue: VecDeque<InFlight>,
}

impl InFlightCopies {
    /// The work of copies on `range` that is not done yet; done copies are forgotten.
    pub(crate) fn pending_on(
        &mut self,
        range: AddressRange,
    ) -> Result<Vec<Arc<EventWork>>, DeviceError> {
        let mut pending = Vec::new();
        let mut kept = VecDeque::with_capacity(self.queue.len());
        for copy in self.queue.drain(..) {
            if copy.touches_device(range) {
                if copy.work.is_done()? {
                    continue;
                }
                pending.push(Arc::clone(&copy.work));
            }
            kept.push_back(copy);
        }
        self.queue = kept;
        Ok(pending)
    }

    /// The work of every copy queued, done or not.
    pub(crate) fn all(&self) -> Vec<Arc<EventWork>> {
        self.queue
            .iter()
            .map(|copy| Arc::clone(&copy.work))
            .collect()
    }

    /// Forget the oldest copies while they are done (cheap: stops at the first that is not).
    fn prune(&mut self) -> Result<(), DeviceError> {
        while let Some(front) = self.queue.front() {
            if !front.work.is_done()? {
                break;
            }
            self.queue.pop_front();
        }
        Ok(())
    }
}

/// Streams for one direction, handed out round-robin so that small copies spread too.
#[derive(Debug)]
struct StreamSet {
    streams: Vec<Stream>,
    next: AtomicUsize,
}

/// The copy engine of a device: a stream set per direction and the chunk size.
#[derive(Debug)]
pub(crate) struct CopyEngine {
    context: Arc<Context>,
    to_host: StreamSet,
    from_host: StreamSet,
    chunk: usize,
}

impl CopyEngine {
    /// `streams` streams per direction, copies cut into `chunk`-byte pieces; the context is
    /// current.
    pub(crate) fn new(
        context: &Arc<Context>,
        streams: usize,
        chunk: usize,
    ) -> Result<CopyEngine, DeviceError> {
        let set = || -> Result<StreamSet, DeviceError> {
            Ok(StreamSet {
                streams: (0..streams.max(1))
                    .map(|_| Stream::new(context))
                    .collect::<Result<_, _>>()?,
                next: AtomicUsize::new(0),
            })
        };
        Ok(CopyEngine {
            context: Arc::clone(context),
            to_host: set()?,
            from_host: set()?,
            chunk: chunk.max(1),
        })
    }

    /// Queue a copy of the committed device range `device` to or from the host bytes at `host`
    /// (`device.len` of them), after every queued copy it conflicts with, and remember it.
    ///
    /// # Safety
    /// `device` is committed and stays so until the returned work is done (a release waits for
    /// the copies remembered in `in_flight`); the `device.len` host bytes at `host` stay valid
    /// (and, for [`Direction::ToHost`], unaliased) until then. The context is current.
    pub(crate) unsafe fn queue(
        &self,
        in_flight: &mut InFlightCopies,
        direction: Direction,
        device: AddressRange,
        host: *mut u8,
    ) -> Result<Arc<EventWork>, DeviceError> {
        in_flight.prune()?;
        let set = match direction {
            Direction::ToHost => &self.to_host,
            Direction::FromHost => &self.from_host,
        };
        let chunks = device.len.div_ceil(self.chunk);
        let used = chunks.min(set.streams.len());
        let first = set.next.fetch_add(used, Ordering::Relaxed);
        let streams: Vec<&Stream> = (0..used)
            .map(|i| &set.streams[(first + i) % set.streams.len()])
            .collect();
        let host_range = (host as usize, device.len);
        for earlier in in_flight
            .queue
            .iter()
            .filter(|copy| copy.conflicts(direction, device, host_range))
        {
            for event in earlier.work.events() {
                streams
                    .iter()
                    .try_for_each(|stream| event.make_wait(stream))?;
            }
        }
        let queued = (0..chunks).try_for_each(|index| {
            let offset = index * self.chunk;
            let len = self.chunk.min(device.len - offset);
            let stream = streams[index % used].raw();
            let address = device.start + offset as u64;
            // SAFETY: the caller keeps the device range mapped and the host bytes valid until
            // the events recorded below complete; `offset + len <= device.len`.
            unsafe {
                let host_at = host.add(offset);
                match direction {
                    Direction::ToHost => driver::memcpy_dtoh_async(host_at, address, len, stream),
                    Direction::FromHost => driver::memcpy_htod_async(address, host_at, len, stream),
                }
            }
        });
        // Even a copy that failed half-way is remembered, so a release waits for its queued part.
        let events = streams
            .iter()
            // SAFETY: the streams are live streams of this engine's context, which is current.
            .map(|stream| unsafe { Event::record(&self.context, stream.raw()) })
            .collect::<Result<Vec<_>, _>>()?;
        let work = Arc::new(EventWork::new(events));
        in_flight.queue.push_back(InFlight {
            device,
            host_start: host_range.0,
            host_len: host_range.1,
            direction,
            work: Arc::clone(&work),
        });
        queued.map(|()| work)
    }
}
