//! The CPU device's prefault threads: they fault committed ranges in (`MADV_POPULATE_WRITE`) ahead
//! of the first copies into them, a piece at a time each, at a low priority, and stay off ranges
//! being released.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use super::overlaps;
use crate::device::AddressRange;

/// Piece of a committed range a prefault thread populates at a time: small, so that a release
/// waits at most a millisecond or two for the pieces in progress.
const PREFAULT_PIECE_BYTES: usize = 8 << 20;

/// Threads populating at once. Faulting pages in (the kernel zeroes each one) is most of the CPU
/// work of a resume from disk; two threads halve the time until the last page is in, so the
/// readers rarely fault pages themselves (measured on 2 cores: disk resume 0.90x -> 0.95x of a
/// plain O_DIRECT read).
const PREFAULT_THREADS: usize = 2;

/// Nice value of the prefault threads (Linux applies it per thread): lower priority than the
/// default 0, so that readers, copies and checksums take a core the moment they need one and
/// prefaulting uses the cycles they leave.
const PREFAULT_NICE: i32 = 10;

/// The prefault threads and their queue.
#[derive(Debug)]
pub(super) struct Prefault {
    prefaulter: Arc<Prefaulter>,
    /// Empty when no thread could be started (pages then fault on first use) or once stopped.
    threads: Vec<JoinHandle<()>>,
}

impl Prefault {
    /// Start the threads.
    pub(super) fn start() -> Prefault {
        let prefaulter = Arc::new(Prefaulter {
            supported: AtomicBool::new(true),
            ..Prefaulter::default()
        });
        let threads: Vec<_> = (0..PREFAULT_THREADS)
            .map_while(|_| {
                let worker = Arc::clone(&prefaulter);
                std::thread::Builder::new()
                    .name("miles-cpu-prefault".to_string())
                    .spawn(move || worker.run())
                    .map_err(|error| tracing::warn!(%error, "cannot start a prefault thread"))
                    .ok()
            })
            .collect();
        if threads.is_empty() {
            tracing::warn!("no prefault thread: pages fault on first use");
        }
        Prefault {
            prefaulter,
            threads,
        }
    }

    /// Queue a committed range for populating.
    pub(super) fn push(&self, range: AddressRange) {
        if !self.threads.is_empty() {
            self.prefaulter.push(range);
        }
    }

    /// Make sure nothing populates `range` once this returns (before its pages are released or
    /// unmapped).
    pub(super) fn cancel(&self, range: AddressRange) {
        self.prefaulter.cancel(range);
    }

    /// Stop the threads and wait for them (before the device unmaps its reservations).
    pub(super) fn stop(&mut self) {
        self.prefaulter.stop();
        for thread in self.threads.drain(..) {
            if thread.join().is_err() {
                tracing::error!("a cpu device prefault thread panicked");
            }
        }
    }
}

/// Committed ranges whose pages the prefault thread is to fault in.
#[derive(Debug, Default)]
struct Prefaulter {
    queue: Mutex<PrefaultQueue>,
    /// Signalled when work arrives, when a piece is done and on shutdown.
    changed: Condvar,
    /// Cleared when the kernel lacks `MADV_POPULATE_WRITE` (before Linux 5.14).
    supported: AtomicBool,
}

#[derive(Debug, Default)]
struct PrefaultQueue {
    pending: VecDeque<AddressRange>,
    /// The pieces being populated now; releases of ranges overlapping one wait for it.
    current: Vec<AddressRange>,
    stopping: bool,
}

impl Prefaulter {
    /// Queue a committed range for populating.
    fn push(&self, range: AddressRange) {
        if self.supported.load(Ordering::Relaxed) {
            lock(&self.queue).pending.push_back(range);
            self.changed.notify_all();
        }
    }

    /// Drop `range` from the queue and wait for a piece of it in progress, so that nothing
    /// populates it once this returns (before its pages are released or unmapped).
    fn cancel(&self, range: AddressRange) {
        let mut queue = lock(&self.queue);
        let pending = std::mem::take(&mut queue.pending);
        for queued in pending {
            let before = AddressRange {
                start: queued.start,
                len: range
                    .start
                    .saturating_sub(queued.start)
                    .min(queued.len as u64) as usize,
            };
            let after_start = range.end().clamp(queued.start, queued.end());
            let after = AddressRange {
                start: after_start,
                len: (queued.end() - after_start) as usize,
            };
            queue
                .pending
                .extend([before, after].into_iter().filter(|part| part.len > 0));
        }
        while queue.current.iter().any(|piece| overlaps(*piece, range)) {
            queue = self
                .changed
                .wait(queue)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Tell the threads to stop after the pieces in progress; the queue is dropped.
    fn stop(&self) {
        let mut queue = lock(&self.queue);
        queue.stopping = true;
        queue.pending.clear();
        self.changed.notify_all();
    }

    /// A prefault thread: populate queued ranges a piece at a time until stopped.
    fn run(&self) {
        lower_priority(PREFAULT_NICE);
        let mut queue = lock(&self.queue);
        loop {
            if queue.stopping {
                return;
            }
            let Some(front) = queue.pending.front_mut() else {
                queue = self
                    .changed
                    .wait(queue)
                    .unwrap_or_else(PoisonError::into_inner);
                continue;
            };
            let piece = AddressRange {
                start: front.start,
                len: front.len.min(PREFAULT_PIECE_BYTES),
            };
            front.start += piece.len as u64;
            front.len -= piece.len;
            if front.len == 0 {
                queue.pending.pop_front();
            }
            queue.current.push(piece);
            drop(queue);
            self.populate(piece);
            queue = lock(&self.queue);
            if let Some(at) = queue.current.iter().position(|p| *p == piece) {
                queue.current.swap_remove(at);
            }
            self.changed.notify_all();
        }
    }

    fn populate(&self, piece: AddressRange) {
        // SAFETY: the piece is committed in a mapping of this device, and stays mapped while it
        // is in `current`: release and unreserve cancel it and wait, and the device's drop joins
        // the prefault threads before it unmaps. Populating faults pages in and changes no byte.
        let rc = unsafe {
            libc::madvise(
                piece.start as usize as *mut libc::c_void,
                piece.len,
                libc::MADV_POPULATE_WRITE,
            )
        };
        if rc != 0 {
            let error = std::io::Error::last_os_error();
            if error.raw_os_error() == Some(libc::EINVAL) {
                self.supported.store(false, Ordering::Relaxed);
                lock(&self.queue).pending.clear();
            }
            tracing::debug!(%error, "cannot prefault device pages; they fault on first use");
        }
    }
}

/// Lower the calling thread's priority to `nice`.
fn lower_priority(nice: i32) {
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::gettid() };
    // SAFETY: setpriority on this thread's own id touches no memory; raising the nice value
    // needs no privilege.
    let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice) };
    if rc != 0 {
        let error = std::io::Error::last_os_error();
        tracing::debug!(%error, "a prefault thread keeps its priority");
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::cpu::GRANULE;

    #[test]
    fn cancelling_a_range_keeps_the_queued_parts_around_it() {
        let prefaulter = Prefaulter::default();
        let queued = AddressRange {
            start: 1 << 30,
            len: 10 * GRANULE,
        };
        prefaulter.supported.store(true, Ordering::Relaxed);
        prefaulter.push(queued);
        prefaulter.cancel(queued.slice(3 * GRANULE, 4 * GRANULE).unwrap());
        prefaulter.cancel(AddressRange {
            start: queued.end(),
            len: GRANULE,
        });
        let pending: Vec<AddressRange> = lock(&prefaulter.queue).pending.iter().copied().collect();
        assert_eq!(
            pending,
            vec![
                queued.slice(0, 3 * GRANULE).unwrap(),
                queued.slice(7 * GRANULE, 3 * GRANULE).unwrap()
            ]
        );
    }
}
