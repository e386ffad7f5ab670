//! The write behind a pause to disk: the pause copies the region's bytes into host memory at
//! the link's speed and releases the device, and a thread of its own writes the host copy to
//! the disk store (checksummed, fsynced, manifest last) while other work runs. The host copy
//! is what a resume reads, so it needs no disk read; the disk copy is the durable one, and a
//! job that dies before the write ends leaves a data file without a manifest, which the next
//! job on the directory finds and removes ([`RankDir`](crate::store::RankDir)).
//!
//! Host copies count against a budget (`--offload-train-host-budget-gb`); a region that does
//! not fit goes to disk in line, at disk speed, and the log says so once.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;

use crate::device::HostBuffer;
use crate::store::{DiskBackup, StoreError};

/// The host budget of the writes behind pauses.
#[derive(Debug)]
pub(crate) struct Staging {
    /// Bytes of host copies that may wait for their disk write at once (0: none).
    budget: u64,
    /// Bytes of host copies held now.
    held: AtomicU64,
    /// Whether the log has said that a region did not fit.
    noted: AtomicBool,
}

impl Staging {
    /// A budget of `budget` bytes.
    pub(crate) fn new(budget: u64) -> Staging {
        Staging {
            budget,
            held: AtomicU64::new(0),
            noted: AtomicBool::new(false),
        }
    }

    /// Counts `bytes` against the budget; false, counting nothing, when they do not fit.
    pub(crate) fn hold(&self, bytes: u64) -> bool {
        self.held
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |held| {
                held.checked_add(bytes).filter(|&sum| sum <= self.budget)
            })
            .is_ok()
    }

    /// Gives `bytes` counted by [`hold`](Self::hold) back.
    pub(crate) fn give_back(&self, bytes: u64) {
        self.held.fetch_sub(bytes, Ordering::SeqCst);
    }

    /// Whether pauses to disk may copy to host memory first at all.
    pub(crate) fn enabled(&self) -> bool {
        self.budget > 0
    }

    /// True the first time it is asked: the log says once that the budget fell short.
    pub(crate) fn first_shortfall(&self) -> bool {
        !self.noted.swap(true, Ordering::SeqCst)
    }

    /// The budget in bytes.
    pub(crate) fn budget(&self) -> u64 {
        self.budget
    }

    /// Bytes counted now.
    #[cfg(test)]
    pub(crate) fn held(&self) -> u64 {
        self.held.load(Ordering::SeqCst)
    }
}

/// What a write's thread returns: the backup, or `None` when it was stopped.
pub(crate) type WriteOutcome = Result<Option<DiskBackup>, StoreError>;

/// Where a region's disk write behind its pause stands.
#[derive(Debug)]
pub(crate) enum Write {
    /// On its thread; `stop` asks it to end between chunks.
    Running {
        stop: Arc<AtomicBool>,
        thread: JoinHandle<WriteOutcome>,
    },
    /// Written, verified and fsynced: the disk copy exists beside the host copy.
    Written(DiskBackup),
    /// Failed; reported once, then the host copy is all there is.
    Failed(StoreError),
    /// No disk copy (stopped, reported, or never started).
    Absent,
}

impl Write {
    /// What a thread that ended left.
    fn ended(joined: std::thread::Result<WriteOutcome>) -> Write {
        match joined {
            Ok(Ok(Some(backup))) => Write::Written(backup),
            Ok(Ok(None)) => Write::Absent,
            Ok(Err(error)) => Write::Failed(error),
            Err(_) => Write::Failed(StoreError::Io {
                action: "write behind the pause of".to_string(),
                path: std::path::PathBuf::from("the offload directory"),
                source: std::io::Error::other("the writer thread panicked"),
            }),
        }
    }

    /// Waits for a running write to end.
    pub(crate) fn finish(&mut self) {
        if !matches!(self, Write::Running { .. }) {
            return;
        }
        if let Write::Running { thread, .. } = std::mem::replace(self, Write::Absent) {
            *self = Write::ended(thread.join());
        }
    }

    /// Notes how a write that has ended by now ended; a running one is left running.
    pub(crate) fn poll(&mut self) {
        if matches!(self, Write::Running { thread, .. } if thread.is_finished()) {
            self.finish();
        }
    }

    /// Asks a running write to stop within a piece of a chunk, without waiting for it.
    pub(crate) fn request_stop(&self) {
        if let Write::Running { stop, .. } = self {
            stop.store(true, Ordering::SeqCst);
        }
    }

    /// Stops a running write (it removes what it wrote) and waits for it.
    pub(crate) fn stop(&mut self) {
        self.request_stop();
        self.finish();
    }

    /// The failure, once: the write is [`Write::Absent`] afterwards.
    pub(crate) fn take_failure(&mut self) -> Option<StoreError> {
        match std::mem::replace(self, Write::Absent) {
            Write::Failed(error) => Some(error),
            other => {
                *self = other;
                None
            }
        }
    }
}

/// A paused region's host copy and the write of it to disk.
#[derive(Debug)]
pub(crate) struct Staged {
    /// The host copy, read by the write's thread while it runs.
    pub(crate) host: Arc<HostBuffer>,
    /// Bytes counted against the budget for it.
    pub(crate) bytes: u64,
    pub(crate) write: Write,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_holds_what_fits_and_takes_back_what_is_given() {
        let staging = Staging::new(10);
        assert!(staging.enabled());
        assert!(staging.hold(6));
        assert!(!staging.hold(5), "6 + 5 is over 10: nothing is counted");
        assert!(staging.hold(4));
        staging.give_back(6);
        assert!(staging.hold(5));
        assert!(staging.first_shortfall());
        assert!(!staging.first_shortfall(), "said once");
        assert!(!Staging::new(0).enabled());
    }
}
