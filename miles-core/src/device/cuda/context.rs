//! Owning types over the driver's handles: the primary context, streams, events, and the
//! [`PendingWork`] that CUDA device fences wait on.

use std::sync::Arc;

use cudarc::driver::sys;

use super::driver;
use crate::device::{DeviceError, PendingWork};

/// One retain of a device's primary context (the context cudarc's `CudaContext` and PyTorch use
/// too); released when the last owner drops.
#[derive(Debug)]
pub(crate) struct Context {
    device: sys::CUdevice,
    raw: sys::CUcontext,
}

// SAFETY: a CUDA context handle may be made current and used from any thread; the driver
// serialises what needs it.
unsafe impl Send for Context {}
// SAFETY: as above; `Context` has no interior state of its own.
unsafe impl Sync for Context {}

impl Context {
    /// Retain the primary context of `device`.
    pub(crate) fn retain(device: sys::CUdevice) -> Result<Arc<Context>, DeviceError> {
        let raw = driver::device_primary_ctx_retain(device)?;
        Ok(Arc::new(Context { device, raw }))
    }

    /// Make the context current on the calling thread, as every driver call needs.
    pub(crate) fn bind(&self) -> Result<(), DeviceError> {
        // SAFETY: `self` holds a retain, so the context is live.
        unsafe { driver::ctx_set_current(self.raw) }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: pairs the retain of `Context::retain`; this is the last owner.
        if let Err(error) = unsafe { driver::device_primary_ctx_release(self.device) } {
            tracing::error!(%error, "cannot release the cuda primary context");
        }
    }
}

/// A non-blocking stream, destroyed on drop.
#[derive(Debug)]
pub(crate) struct Stream {
    raw: sys::CUstream,
    context: Arc<Context>,
}

// SAFETY: stream handles may be used from any thread with their context current.
unsafe impl Send for Stream {}
// SAFETY: as above; the driver serialises work queued on one stream.
unsafe impl Sync for Stream {}

impl Stream {
    /// A new non-blocking stream in `context` (which must be current).
    pub(crate) fn new(context: &Arc<Context>) -> Result<Stream, DeviceError> {
        Ok(Stream {
            raw: driver::stream_create()?,
            context: Arc::clone(context),
        })
    }

    /// The raw handle, valid while `self` lives.
    pub(crate) fn raw(&self) -> sys::CUstream {
        self.raw
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let destroyed = self
            .context
            .bind()
            // SAFETY: the stream was created by `Stream::new` and is destroyed once; work still
            // queued on it completes first (the driver defers the release).
            .and_then(|()| unsafe { driver::stream_destroy(self.raw) });
        if let Err(error) = destroyed {
            tracing::error!(%error, "cannot destroy a cuda stream");
        }
    }
}

/// An event, destroyed on drop.
#[derive(Debug)]
pub(crate) struct Event {
    raw: sys::CUevent,
    context: Arc<Context>,
}

// SAFETY: event handles may be recorded, queried and synchronised from any thread.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Event {
    /// Record a new event on `stream`: it completes when the work queued there so far does.
    ///
    /// # Safety
    /// `stream` is a live stream of `context`, which is current.
    pub(crate) unsafe fn record(
        context: &Arc<Context>,
        stream: sys::CUstream,
    ) -> Result<Event, DeviceError> {
        let event = Event {
            raw: driver::event_create()?,
            context: Arc::clone(context),
        };
        // SAFETY: the event was just created; the caller keeps the stream live.
        unsafe { driver::event_record(event.raw, stream) }?;
        Ok(event)
    }

    /// Make later work on `stream` wait, on the device, for this event.
    pub(crate) fn make_wait(&self, stream: &Stream) -> Result<(), DeviceError> {
        // SAFETY: both handles are owned and live.
        unsafe { self.make_raw_wait(stream.raw()) }
    }

    /// Make later work on the raw `stream` wait, on the device, for this event.
    ///
    /// # Safety
    /// `stream` is a live stream of this event's context.
    pub(crate) unsafe fn make_raw_wait(&self, stream: sys::CUstream) -> Result<(), DeviceError> {
        // SAFETY: the event is owned and live; the caller keeps the stream live.
        unsafe { driver::stream_wait_event(stream, self.raw) }
    }

    fn synchronize(&self) -> Result<(), DeviceError> {
        self.context.bind()?;
        // SAFETY: the event is owned and live.
        unsafe { driver::event_synchronize(self.raw) }
    }

    fn query(&self) -> Result<bool, DeviceError> {
        self.context.bind()?;
        // SAFETY: the event is owned and live.
        unsafe { driver::event_query(self.raw) }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let destroyed = self
            .context
            .bind()
            // SAFETY: the event was created by `Event::record` and is destroyed once; the driver
            // defers the release of an event still pending.
            .and_then(|()| unsafe { driver::event_destroy(self.raw) });
        if let Err(error) = destroyed {
            tracing::error!(%error, "cannot destroy a cuda event");
        }
    }
}

/// Work on one or more streams, done when every event is: what a CUDA device's [`Fence`]
/// waits on.
///
/// [`Fence`]: crate::device::Fence
#[derive(Debug)]
pub(crate) struct EventWork {
    events: Vec<Event>,
}

impl EventWork {
    /// Work done when all of `events` are.
    pub(crate) fn new(events: Vec<Event>) -> EventWork {
        EventWork { events }
    }

    /// The events, for streams that must wait on this work.
    pub(crate) fn events(&self) -> &[Event] {
        &self.events
    }
}

impl PendingWork for EventWork {
    fn wait(&self) -> Result<(), DeviceError> {
        self.events.iter().try_for_each(Event::synchronize)
    }

    fn is_done(&self) -> Result<bool, DeviceError> {
        for event in &self.events {
            if !event.query()? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}
