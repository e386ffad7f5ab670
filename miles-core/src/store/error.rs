//! Errors of the backup stores.

use std::path::PathBuf;

use crate::device::DeviceError;

/// What went wrong in a backup store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A file operation failed; nothing was released, the files of the attempt were removed.
    #[error(
        "cannot {action} {path}: {source}; check free space and permissions of the offload directory"
    )]
    Io {
        /// What was being done (`write chunk 3 of`, `fsync`, ...).
        action: String,
        /// The file or directory.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// A chunk read back does not match the checksum written with it.
    #[error(
        "checksum mismatch in {path} chunk {chunk}: expected crc32c {expected:#010x}, found {found:#010x}; the tag stays paused and its files are kept there (the next job on this offload directory removes them)"
    )]
    ChecksumMismatch {
        /// The data file.
        path: PathBuf,
        /// Index of the chunk.
        chunk: usize,
        /// Checksum in the manifest.
        expected: u32,
        /// Checksum of the bytes read.
        found: u32,
    },
    /// The manifest is missing, unreadable or does not describe the region being resumed.
    #[error("bad offload manifest {path}: {reason}")]
    Manifest {
        /// The manifest file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A chunk size the store cannot use.
    #[error(
        "offload chunk size {chunk_bytes} bytes must be a positive multiple of 4096; set --offload-train-disk-chunk-mb to 1 or more"
    )]
    ChunkSize {
        /// The size asked for.
        chunk_bytes: usize,
    },
    /// A write behind a pause was stopped (its tag resumed first); its files are removed.
    #[error("the background write was stopped before it finished; its files are removed")]
    Stopped,
    /// The device failed a copy or a host allocation.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// A path under the offload directory that the store will not write through or remove: a
    /// symbolic link, something other than what the store writes, a directory of another user
    /// or one every user may write to. Nothing was written through it and nothing was removed.
    #[error("refusing offload path {path}: {reason}")]
    UnsafePath {
        /// The path.
        path: PathBuf,
        /// What is wrong with it, and the fix.
        reason: Unsafe,
    },
    /// A streamed bucket whose last write failed (or whose streaming thread died): its state is
    /// not on disk.
    #[error(
        "bucket {bucket} of the streamed optimizer state under {dir} is not on disk ({reason}); restart from a checkpoint (--load)"
    )]
    StreamBucketLost {
        /// The rank directory.
        dir: PathBuf,
        /// Index of the bucket.
        bucket: usize,
        /// What happened to it.
        reason: &'static str,
    },
    /// A streamed bucket's write behind a walk failed; its host copy is kept, so nothing is
    /// lost, and the bucket's next walk writes it again.
    #[error(
        "the write behind of bucket {bucket} of the streamed optimizer state failed: {source}; its updated bytes are kept in host memory and the next step writes them again"
    )]
    StreamWriteFailed {
        /// Index of the bucket.
        bucket: usize,
        /// Why the write failed.
        #[source]
        source: Box<StoreError>,
    },
    /// Another job holds the lock of the rank directory.
    #[error(
        "offload directory {dir} is in use by another job (pid {}); give each job its own --offload-train-disk-dir, or wait for that job to end",
        pid.map_or_else(|| "unknown".to_string(), |pid| pid.to_string())
    )]
    Locked {
        /// The rank directory.
        dir: PathBuf,
        /// The process holding the lock, as it wrote in the lock file.
        pid: Option<u32>,
    },
}

/// Why the store refuses a path under the offload directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unsafe {
    /// A symbolic link where the store writes a file or a directory.
    #[error("it is a symbolic link; {REMOVE_IT}")]
    Symlink,
    /// Something else than a directory where the store keeps one.
    #[error("it is not a directory; {REMOVE_IT}")]
    NotADirectory,
    /// An entry the store does not write (a device, a pipe, an unknown name).
    #[error("it is not a file that miles writes; {REMOVE_IT}")]
    Foreign,
    /// A directory of another user.
    #[error(
        "it belongs to uid {owner}, not to this user (uid {me}); give an --offload-train-disk-dir of your own"
    )]
    OtherOwner {
        /// The directory's owner.
        owner: u32,
        /// This process's effective user.
        me: u32,
    },
    /// A directory every user may write to (and so plant links in).
    #[error(
        "every user may write to it; give an --offload-train-disk-dir of your own (or chmod o-w it)"
    )]
    WorldWritable,
    /// A tag name that is not a plain path component.
    #[error("a tag name holds lowercase letters, digits, `_` or `-` only; rename the tag")]
    TagName,
}

/// The fix for what should not be in the offload directory.
const REMOVE_IT: &str = "remove it: the offload directory holds only what miles writes there";

impl StoreError {
    /// Whether the error comes from the settings or the files a user gave (an offload directory
    /// refused as not ours or in use), not from a failure while running: such a job exits with
    /// status 2 before any work.
    pub fn is_bad_settings(&self) -> bool {
        matches!(
            self,
            StoreError::UnsafePath { .. } | StoreError::Locked { .. }
        )
    }
}
