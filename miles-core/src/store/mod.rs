//! Backup stores for paused regions: a pool of reusable host buffers and a chunked, checksummed
//! disk store.

mod disk;
mod error;
mod host_pool;

pub use disk::{DiskBackup, DiskStore};
pub use error::StoreError;
pub use host_pool::HostPool;
