//! The memory manager: tagged device memory that pauses to a backup and resumes bit-exact at
//! the same addresses.
//!
//! Every buffer lives in a region: a [`MemoryTag`] with its own reserved address arena and a
//! [`BackupPolicy`]. [`MemoryManager::pause`] waits until no view of the tag is alive, copies the
//! tag's committed memory to its backup (a reused host buffer or checksummed disk files),
//! verifies it, and only then releases the physical memory; [`MemoryManager::resume`] checks
//! that the device has room (need + margin), commits memory at the same addresses and copies
//! the bytes back. Each tag pauses and resumes on its own: no manager-wide lock is held while
//! bytes move.

mod arena;
mod buffer;
mod error;
mod manager;
mod region;
mod staged;
mod tag;

pub use crate::choice::BackupPolicy;
pub use buffer::{Buffer, BufferView, BufferViewMut};
pub use error::{FreeError, MemoryError};
pub use manager::{DiskSettings, ManagerSettings, MemoryManager};
pub use tag::{MemoryTag, OffloadReport, RegionState};
