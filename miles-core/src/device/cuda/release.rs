//! How the CUDA device gives physical memory back: the [`ReleaseMode`]s, and the unmapping of
//! mappings that no queued copy uses any more.
//!
//! Every mode frees the memory before `release` returns (the driver frees a piece once it is
//! unmapped and its handle released); none defers work behind the caller's back. They differ in
//! how many driver calls a release makes and on how many threads (`bench/RESULTS.md`, round 8).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::context::Context;
use super::ranges::{Mapping, Reservations};
use super::{CudaDevice, driver};
use crate::device::{AddressRange, DeviceError};

/// How a release gives physical memory back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ReleaseMode {
    /// Per mapping, one after the other: `cuMemUnmap`, then `cuMemRelease` of its handle.
    #[default]
    EachMapping,
    /// One `cuMemUnmap` over each run of adjacent mappings, then `cuMemRelease` of their
    /// handles on [`CudaOptions::release_threads`](super::CudaOptions::release_threads)
    /// threads.
    UnmapThenRelease,
    /// A commit releases each handle as soon as it is mapped, so that the mapping alone holds
    /// the memory (as NVIDIA's `vectorAddMMAP` sample does); a release is then one
    /// `cuMemUnmap` over each run of adjacent mappings, which frees the memory.
    MappingOwns,
}

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
        let released = release_handles(&self.context, mapping.handle.as_slice(), 1);
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
        let released = match self.options.release {
            ReleaseMode::EachMapping => inside
                .iter()
                .try_for_each(|mapping| self.unmap_timed(book, *mapping, &mut spent)),
            ReleaseMode::UnmapThenRelease | ReleaseMode::MappingOwns => {
                self.unmap_runs(book, &inside, &mut spent)
            }
        };
        if let Some(collector) = &self.collector {
            collector.released();
        }
        tracing::debug!(
            mode = ?self.options.release,
            mappings = inside.len(),
            bytes = inside.iter().map(|mapping| mapping.len).sum::<usize>(),
            unmap_ms = spent.unmap.as_secs_f64() * 1e3,
            release_ms = spent.release.as_secs_f64() * 1e3,
            "released device memory"
        );
        released
    }

    /// One `cuMemUnmap` per run of adjacent `mappings` (address order), then `cuMemRelease`
    /// of the handles they still hold. Handles of the runs unmapped before a failing unmap are
    /// still released.
    fn unmap_runs(
        &self,
        book: &mut Reservations,
        mappings: &[Mapping],
        spent: &mut Spent,
    ) -> Result<(), DeviceError> {
        let started = Instant::now();
        let mut handles = Vec::with_capacity(mappings.len());
        let mut failure = None;
        for run in adjacent_runs(mappings) {
            let hull = AddressRange {
                start: run[0].start,
                len: run.iter().map(|mapping| mapping.len).sum(),
            };
            // SAFETY: `hull` covers whole mappings of ours and nothing else (the run is
            // adjacent), which the driver unmaps in one call; the caller holds the state lock
            // taken by `quiet`, so no queued copy uses them.
            match unsafe { driver::mem_unmap(hull.start, hull.len) } {
                Ok(()) => {
                    for mapping in run {
                        book.forget(*mapping);
                        handles.extend(mapping.handle);
                    }
                }
                Err(error) => {
                    failure = Some(error);
                    break;
                }
            }
        }
        let unmapped = Instant::now();
        spent.unmap += unmapped - started;
        let released = release_handles(&self.context, &handles, self.options.release_threads);
        spent.release += unmapped.elapsed();
        match failure {
            Some(error) => Err(error),
            None => released,
        }
    }

    /// After a commit mapped `created` and granted access, with [`ReleaseMode::MappingOwns`]:
    /// release each handle so that the mapping alone holds its memory. A handle the driver
    /// refuses to release stays with its mapping and is released with it later.
    pub(super) fn hand_memory_to_mappings(&self, created: &mut [Mapping]) {
        if self.options.release != ReleaseMode::MappingOwns {
            return;
        }
        for mapping in created {
            let Some(handle) = mapping.handle else {
                continue;
            };
            // SAFETY: the handle is ours and mapped, so the memory stays until the mapping is
            // unmapped; it is released once, here, and forgotten.
            match unsafe { driver::mem_release(handle) } {
                Ok(()) => mapping.handle = None,
                Err(error) => {
                    tracing::warn!(%error, "cannot hand a piece's memory to its mapping; it is released on unmap instead");
                }
            }
        }
    }
}

/// `mappings` (address order) cut into runs where each mapping starts where the previous ends.
fn adjacent_runs(mappings: &[Mapping]) -> Vec<&[Mapping]> {
    let mut runs = Vec::new();
    let mut first = 0;
    for index in 1..=mappings.len() {
        let ends_run =
            index == mappings.len() || mappings[index - 1].range().end() != mappings[index].start;
        if ends_run {
            runs.push(&mappings[first..index]);
            first = index;
        }
    }
    runs
}

/// `cuMemRelease` every handle, spread over up to `threads` threads (1: this thread); the first
/// error is returned once every handle has been tried.
fn release_handles(
    context: &Arc<Context>,
    handles: &[u64],
    threads: usize,
) -> Result<(), DeviceError> {
    let release_all = |part: &[u64]| {
        let mut first_error = None;
        for &handle in part {
            // SAFETY: each handle is ours, unmapped (or never mapped again), and appears once
            // in `handles`, so it is released once.
            if let Err(error) = unsafe { driver::mem_release(handle) } {
                first_error.get_or_insert(error);
            }
        }
        first_error.map_or(Ok(()), Err)
    };
    let threads = threads.clamp(1, handles.len().max(1));
    if threads == 1 {
        return release_all(handles);
    }
    let per_thread = handles.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let workers: Vec<_> = handles
            .chunks(per_thread)
            .map(|part| scope.spawn(move || context.bind().and_then(|()| release_all(part))))
            .collect();
        let mut first_error = None;
        for worker in workers {
            let released = worker.join().unwrap_or_else(|_| {
                Err(DeviceError::Cuda {
                    call: "cuMemRelease",
                    message: "a release thread panicked; the handles it held may leak".to_string(),
                })
            });
            if let Err(error) = released {
                first_error.get_or_insert(error);
            }
        }
        first_error.map_or(Ok(()), Err)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mapping(start: u64, len: usize, handle: u64) -> Mapping {
        Mapping {
            start,
            len,
            handle: Some(handle),
        }
    }

    #[test]
    fn adjacent_runs_split_where_a_gap_lies_between_mappings() {
        let mib = 1 << 20;
        let base = 0x7000_0000_u64;
        let mappings = [
            mapping(base, 2 * mib, 1),
            mapping(base + 2 * mib as u64, 4 * mib, 2),
            mapping(base + 8 * mib as u64, 2 * mib, 3),
            mapping(base + 10 * mib as u64, 2 * mib, 4),
            mapping(base + 14 * mib as u64, 2 * mib, 5),
        ];
        let runs: Vec<Vec<u64>> = adjacent_runs(&mappings)
            .iter()
            .map(|run| run.iter().filter_map(|m| m.handle).collect())
            .collect();
        assert_eq!(runs, vec![vec![1, 2], vec![3, 4], vec![5]]);
        assert!(adjacent_runs(&[]).is_empty());
        assert_eq!(adjacent_runs(&mappings[..1]).len(), 1);
    }
}
