//! How the CUDA device gives physical memory back: per mapping, `cuMemUnmap` then `cuMemRelease`
//! of its handle, on the calling thread. The memory is free when `release` returns.
//!
//! Measured on an H200 (`bench/RESULTS.md`, rounds 8, 13 and 14), nothing else was faster: one
//! `cuMemUnmap` over adjacent mappings with the handles released after it, on up to 8 threads, or
//! handles released at map time so that the unmap frees the memory, all took as long or longer.
//! A release's time is the driver's own work on the calling thread (its CPU time equals its wall
//! time), which the driver's locks keep from running in parallel.

use std::time::{Duration, Instant};

use super::ranges::{Mapping, Reservations};
use super::{CudaDevice, driver};
use crate::device::{AddressRange, DeviceError};

/// Where the time of one release went, for the debug log.
#[derive(Debug, Default)]
struct Spent {
    unmap: Duration,
    release: Duration,
}

impl CudaDevice {
    /// Unmap and release one mapping no copy uses any more, and forget it once unmapped.
    pub(super) fn unmap(
        &self,
        book: &mut Reservations,
        mapping: Mapping,
    ) -> Result<(), DeviceError> {
        self.unmap_timed(book, mapping, &mut Spent::default())
    }

    fn unmap_timed(
        &self,
        book: &mut Reservations,
        mapping: Mapping,
        spent: &mut Spent,
    ) -> Result<(), DeviceError> {
        let started = Instant::now();
        // SAFETY: the mapping is one whole `cuMemMap` of ours; the caller holds the state lock
        // taken by `quiet`, so no queued copy uses it.
        unsafe { driver::mem_unmap(mapping.start, mapping.len) }?;
        book.forget(mapping);
        let unmapped = Instant::now();
        spent.unmap += unmapped - started;
        // SAFETY: the handle is ours, now unmapped and forgotten, so it is released once.
        let released = unsafe { driver::mem_release(mapping.handle) };
        spent.release += unmapped.elapsed();
        released
    }

    /// Release every byte of `range` that is mapped, with the state lock of `quiet(range)`.
    pub(super) fn release_locked(
        &self,
        book: &mut Reservations,
        range: AddressRange,
    ) -> Result<(), DeviceError> {
        let (inside, cut): (Vec<Mapping>, Vec<Mapping>) =
            book.overlapping(range).into_iter().partition(|mapping| {
                range.start <= mapping.start && mapping.range().end() <= range.end()
            });
        cut.into_iter()
            .try_for_each(|mapping| self.split(book, mapping, range))?;
        if inside.is_empty() {
            return Ok(());
        }
        let mut spent = Spent::default();
        let released = inside
            .iter()
            .try_for_each(|mapping| self.unmap_timed(book, *mapping, &mut spent));
        if let Some(collector) = &self.collector {
            collector.released();
        }
        tracing::debug!(
            mappings = inside.len(),
            bytes = inside.iter().map(|mapping| mapping.len).sum::<usize>(),
            unmap_ms = spent.unmap.as_secs_f64() * 1e3,
            release_ms = spent.release.as_secs_f64() * 1e3,
            "released device memory"
        );
        released
    }
}
