//! Errors of the memory manager.

use crate::device::{DeviceError, DeviceKind};
use crate::store::StoreError;

use super::{Buffer, MemoryTag, RegionState};

/// What went wrong in the memory manager.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// No region was created for the tag.
    #[error("no region for tag {tag}; create it with create_region first")]
    UnknownTag {
        /// The tag.
        tag: MemoryTag,
    },
    /// A region for the tag exists already.
    #[error("a region for tag {tag} exists already; each tag has one region")]
    RegionExists {
        /// The tag.
        tag: MemoryTag,
    },
    /// A named tag that cannot serve as a directory name.
    #[error("tag name {name:?} is invalid: use 1 to 64 lowercase letters, digits, `_` or `-`")]
    InvalidTagName {
        /// The name.
        name: String,
    },
    /// A buffer of a paused tag was used.
    #[error("tag {tag} is paused; resume it before using its buffers")]
    TagPaused {
        /// The tag.
        tag: MemoryTag,
    },
    /// The tag is being paused or resumed.
    #[error("tag {tag} is {state}; wait until that finishes")]
    TagBusy {
        /// The tag.
        tag: MemoryTag,
        /// What it is doing.
        state: RegionState,
    },
    /// Pause of a tag by a thread that holds a view of it: the view could never drop while
    /// the pause waits for it.
    #[error(
        "cannot pause {tag}: this thread holds {views} view(s) of it; drop them before pausing"
    )]
    ViewHeld {
        /// The tag.
        tag: MemoryTag,
        /// Views the calling thread holds.
        views: usize,
    },
    /// A size whose arithmetic overflows (a length near `usize::MAX`); nothing was allocated.
    #[error(
        "{what} of tag {tag} is {value} bytes, which overflows the size arithmetic; ask for less"
    )]
    SizeOverflow {
        /// The tag.
        tag: MemoryTag,
        /// Which size (`buffer length`, `arena size`).
        what: &'static str,
        /// The size asked for.
        value: u64,
    },
    /// Pause of a tag that is paused.
    #[error("tag {tag} is paused already")]
    AlreadyPaused {
        /// The tag.
        tag: MemoryTag,
    },
    /// Resume of a tag that is not paused.
    #[error("tag {tag} is not paused; only a paused tag can resume")]
    NotPaused {
        /// The tag.
        tag: MemoryTag,
    },
    /// Too little free device memory to resume; nothing changed.
    #[error(
        "cannot resume {tag}: needs {need} bytes, {free} free (margin {margin}); pause another tag first or lower --train-memory-margin-bytes"
    )]
    InsufficientMemory {
        /// The tag.
        tag: MemoryTag,
        /// Bytes the tag needs.
        need: u64,
        /// Free device bytes.
        free: u64,
        /// Margin that must stay free.
        margin: u64,
    },
    /// The tag's arena has no free block large enough.
    #[error(
        "arena of tag {tag} has no free block of {requested} bytes (arena {arena_bytes} bytes); create the region with a larger arena"
    )]
    ArenaFull {
        /// The tag.
        tag: MemoryTag,
        /// Bytes asked for.
        requested: usize,
        /// Size of the arena.
        arena_bytes: usize,
    },
    /// A disk-policy region on a manager without a disk directory.
    #[error(
        "tag {tag} has backup policy disk but no disk directory is set; pass --offload-train-disk-dir"
    )]
    NoDiskStore {
        /// The tag.
        tag: MemoryTag,
    },
    /// Host views of a device whose memory the host cannot address.
    #[error(
        "buffers of tag {tag} live on a {device} device, which the host cannot address; use device copies"
    )]
    NotHostAddressable {
        /// The tag.
        tag: MemoryTag,
        /// The device.
        device: DeviceKind,
    },
    /// The disk store could not be set up.
    #[error("cannot set up the offload disk store: {0}")]
    DiskStore(#[source] StoreError),
    /// The device failed.
    #[error("device error on tag {tag}: {source}")]
    Device {
        /// The tag.
        tag: MemoryTag,
        /// The device's error.
        #[source]
        source: DeviceError,
    },
    /// The backup store failed; the tag keeps its data (active after a failed pause, paused
    /// with its backup after a failed resume).
    #[error("backup of tag {tag} failed: {source}")]
    Store {
        /// The tag.
        tag: MemoryTag,
        /// The store's error.
        #[source]
        source: StoreError,
    },
    /// The disk write behind a pause failed. The tag's bytes are whole in host memory and it
    /// stays paused; the next resume brings them back from there.
    #[error(
        "the background disk write of tag {tag} failed: {source}; its bytes are kept in host memory and the tag stays paused (a resume brings them back); free the disk or fix the offload directory"
    )]
    BackgroundWrite {
        /// The tag.
        tag: MemoryTag,
        /// The store's error (boxed: it is rare, and the error stays small).
        #[source]
        source: Box<StoreError>,
    },
}

/// A buffer that could not be freed, handed back with the reason.
#[derive(Debug, thiserror::Error)]
#[error("cannot free a buffer: {error}")]
pub struct FreeError {
    /// The buffer, still allocated.
    pub buffer: Buffer,
    /// Why.
    #[source]
    pub error: MemoryError,
}
