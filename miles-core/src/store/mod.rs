//! Backup stores for paused regions: a pool of reusable host buffers and a chunked, checksummed
//! disk store in one directory per rank.

mod disk;
mod error;
mod host_pool;
mod rank_dir;
mod stream;

pub use disk::{DiskBackup, DiskStore};
pub use error::{StoreError, Unsafe};
pub use host_pool::HostPool;
pub use rank_dir::RankDir;
pub use stream::{BucketStream, MIN_HOST_BUCKETS, STREAM_SLOTS, StreamStats, stream_chunk_bytes};
