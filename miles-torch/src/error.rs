//! Errors of the drop-in; their messages are what the Python layer raises.

use miles_core::{DeviceError, MemoryError};

/// What went wrong in the drop-in.
#[derive(Debug, thiserror::Error)]
pub enum TorchError {
    /// The GPU could not be opened.
    #[error(
        "cannot open cuda:{ordinal} for the miles memory saver: {source}; it needs an nvidia gpu with its driver"
    )]
    Open {
        /// The GPU asked for.
        ordinal: i32,
        /// The device's error.
        #[source]
        source: DeviceError,
    },
    /// A device call failed outside the memory manager.
    #[error("device error on cuda:{ordinal}: {source}")]
    Device {
        /// The GPU.
        ordinal: i32,
        /// The device's error.
        #[source]
        source: DeviceError,
    },
    /// The memory manager refused or failed.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// A NULL or empty tag.
    #[error("a null or empty tag; pass a tag name such as \"default\" or \"weights\"")]
    NoTag,
    /// A NULL disk backup directory.
    #[error("a null disk backup directory; pass a path")]
    NoDiskDir,
    /// Both backups asked for one region.
    #[error(
        "region {tag} asks for both a cpu and a disk backup; enable_cpu_backup and enable_disk_backup are mutually exclusive"
    )]
    BothBackups {
        /// The tag.
        tag: String,
    },
    /// A CPU backup backend other than the pinned pool.
    #[error(
        "cpu backup backend {backend:?} is not supported: miles keeps cpu backups in a pool of pinned host memory; use \"pinned\" (the default)"
    )]
    Backend {
        /// The backend asked for.
        backend: String,
    },
    /// An environment variable with a value it cannot have.
    #[error("{var}={value:?} is not {expected}")]
    BadEnv {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What it must be.
        expected: &'static str,
    },
    /// An allocation in a region refused by the memory margin.
    #[error(
        "allocation of {len} bytes for tag {tag} refused: {free} bytes free and the memory margin is {margin}; lower memory_margin_bytes or pause a tag"
    )]
    Margin {
        /// The tag.
        tag: String,
        /// Bytes asked for.
        len: usize,
        /// Free device bytes.
        free: u64,
        /// The margin.
        margin: u64,
    },
    /// Too little device memory to resume; nothing changed.
    #[error(
        "cannot resume {tag}: needs {need} bytes, {free} free (margin {margin}); pause another tag, free memory or lower memory_margin_bytes; the tag stays paused with its backup"
    )]
    InsufficientMemory {
        /// The tag (or `every tag`).
        tag: String,
        /// Bytes the resume needs.
        need: u64,
        /// Free device bytes.
        free: u64,
        /// The margin.
        margin: u64,
    },
    /// A disk-backed region without a usable disk store.
    #[error(
        "tag {tag} asks for a disk backup but the disk store in {dir} could not be set up: {reason}; call set_disk_backup_dir (or set TMS_DISK_BACKUP_DIR) with a writable directory before the first allocation"
    )]
    NoDiskStore {
        /// The tag.
        tag: String,
        /// The directory.
        dir: String,
        /// Why.
        reason: String,
    },
    /// The disk directory changed after memory was allocated on a GPU.
    #[error(
        "the disk backup directory is {current} and memory was allocated already; call set_disk_backup_dir before the first allocation in a region"
    )]
    DiskDirFixed {
        /// The directory in use.
        current: String,
    },
    /// A pause or resume of a tag in the wrong state.
    #[error("tag {tag} is {state}; {hint}")]
    State {
        /// The tag.
        tag: String,
        /// Its state.
        state: &'static str,
        /// What to do.
        hint: &'static str,
    },
}
