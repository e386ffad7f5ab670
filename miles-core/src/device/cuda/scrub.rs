//! Collecting the driver's records of scrubbed memory while nothing waits on it.
//!
//! The driver scrubs the memory a release frees on a copy engine, in the background, and keeps one
//! record per scrubbed page until its next physical allocation collects them. A release that finds
//! the records of an earlier one still uncollected collects them itself: on an H200 that made a
//! release of 8 GiB take 4.5-8.5 ms instead of about 3 (`bench/RESULTS.md`, round 13). So after
//! each release, and once when the device opens (for the releases of a process before), a
//! [`Collector`] thread waits [`CudaOptions::collect_after`], then twice as long, and so on
//! [`PASSES`] times, in case the scrub runs long (it shares the copy engines with copies); each
//! time it creates and releases one granule of physical memory: an allocation, which collects the
//! records. That granule is outside the device's own accounting for the moment it is held: on a GPU
//! that is exactly full, another allocation at that instant could fail, and a collection that finds
//! no room only logs at debug level.
//!
//! [`CudaOptions::collect_after`]: super::CudaOptions::collect_after

use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::sys;

use super::context::Context;
use super::driver;
use crate::device::DeviceError;

/// Collections after each release: at `collect_after`, 2, 4, .. 32 times that after it.
const PASSES: u32 = 6;

/// When the last release happened, and how many collections have run since.
#[derive(Debug, Default)]
struct Schedule {
    released_at: Option<Instant>,
    passes_done: u32,
    stop: bool,
}

#[derive(Debug)]
struct Shared {
    schedule: Mutex<Schedule>,
    wake: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Schedule> {
        self.schedule.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The thread that collects scrub records after releases; stopped and joined on drop.
#[derive(Debug)]
pub(super) struct Collector {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Collector {
    /// Start the thread for `device`, which allocates `granularity` bytes per collection, with
    /// a first round of collections scheduled from now.
    pub(super) fn start(
        context: &Arc<Context>,
        device: sys::CUdevice,
        granularity: usize,
        after: Duration,
    ) -> Result<Collector, DeviceError> {
        let shared = Arc::new(Shared {
            schedule: Mutex::new(Schedule {
                released_at: Some(Instant::now()),
                ..Schedule::default()
            }),
            wake: Condvar::new(),
        });
        let context = Arc::clone(context);
        let thread = std::thread::Builder::new()
            .name("miles-cuda-collect".to_string())
            .spawn({
                let shared = Arc::clone(&shared);
                move || run(&shared, &context, device, granularity, after)
            })
            .map_err(|error| DeviceError::Cuda {
                call: "collector thread",
                message: error.to_string(),
            })?;
        Ok(Collector {
            shared,
            thread: Some(thread),
        })
    }

    /// A release just freed memory: collect after it (the schedule restarts from now).
    pub(super) fn released(&self) {
        let mut schedule = self.shared.lock();
        schedule.released_at = Some(Instant::now());
        schedule.passes_done = 0;
        self.shared.wake.notify_one();
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.wake.notify_one();
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            tracing::error!("the scrub collector thread panicked");
        }
    }
}

fn run(
    shared: &Shared,
    context: &Context,
    device: sys::CUdevice,
    granularity: usize,
    after: Duration,
) {
    let mut schedule = shared.lock();
    loop {
        if schedule.stop {
            return;
        }
        let due = match schedule.released_at {
            Some(released_at) if schedule.passes_done < PASSES => {
                released_at + after * 2u32.pow(schedule.passes_done)
            }
            _ => {
                schedule = shared
                    .wake
                    .wait(schedule)
                    .unwrap_or_else(PoisonError::into_inner);
                continue;
            }
        };
        let now = Instant::now();
        if now < due {
            schedule = shared
                .wake
                .wait_timeout(schedule, due - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
            continue;
        }
        schedule.passes_done += 1;
        drop(schedule);
        if let Err(error) = collect(context, device, granularity) {
            tracing::debug!(%error, "cannot collect the driver's scrub records");
        }
        schedule = shared.lock();
    }
}

/// One physical allocation of `granularity` bytes, released at once.
fn collect(
    context: &Context,
    device: sys::CUdevice,
    granularity: usize,
) -> Result<(), DeviceError> {
    context.bind()?;
    let prop = driver::device_allocation_prop(device);
    let handle = driver::mem_create(granularity, &prop)?;
    // SAFETY: the handle was just created here, is never mapped, and is released once.
    unsafe { driver::mem_release(handle) }
}
