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
        "checksum mismatch in {path} chunk {chunk}: expected crc32c {expected:#010x}, found {found:#010x}; the tag stays paused and its files are kept"
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
    /// The device failed a copy or a host allocation.
    #[error(transparent)]
    Device(#[from] DeviceError),
}
