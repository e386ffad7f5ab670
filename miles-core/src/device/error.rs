//! Errors of the devices.

use super::DeviceKind;

/// What went wrong on a device.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// The device cannot hold the memory asked for.
    #[error(
        "out of device memory on {device}: asked for {requested} bytes, {free} free; pause a tag or lower the sizes"
    )]
    OutOfMemory {
        /// The device that refused.
        device: DeviceKind,
        /// Bytes asked for.
        requested: u64,
        /// Bytes free when asked.
        free: u64,
    },
    /// The host cannot provide the host memory asked for.
    #[error("cannot allocate {requested} bytes of host memory: {reason}")]
    HostOutOfMemory {
        /// Bytes asked for.
        requested: usize,
        /// What the host said.
        reason: String,
    },
    /// A length or address off the device's granularity.
    #[error("{what} {value:#x} is not a multiple of the device granularity {granularity}")]
    Unaligned {
        /// Which value (`length`, `address`).
        what: &'static str,
        /// The value.
        value: u64,
        /// The granularity it must be a multiple of.
        granularity: usize,
    },
    /// A sub-range outside its range, or bytes that do not fit a buffer.
    #[error("bytes {offset}..{offset}+{len} lie outside a range of {range_len} bytes")]
    OutOfRange {
        /// Start of the sub-range.
        offset: usize,
        /// Its length.
        len: usize,
        /// Length of the range it must lie in.
        range_len: usize,
    },
    /// Source and destination of a copy differ in length.
    #[error("copy of {src} bytes into {dst} bytes: lengths must match")]
    LengthMismatch {
        /// Source length.
        src: usize,
        /// Destination length.
        dst: usize,
    },
    /// A range that was not reserved, committed or released as the call requires.
    #[error("range {start:#x}+{len} is not {expected} on this device")]
    BadRange {
        /// First address.
        start: u64,
        /// Length in bytes.
        len: usize,
        /// What it should have been (`reserved`, `committed`, `released`).
        expected: &'static str,
    },
    /// The operating system refused a call.
    #[error("{call} failed: {source}")]
    Os {
        /// The system call.
        call: &'static str,
        /// The error it returned.
        #[source]
        source: std::io::Error,
    },
    /// The CUDA driver or a CUDA library returned an error.
    #[error("{call} failed: {message}")]
    Cuda {
        /// The driver or library call.
        call: &'static str,
        /// The driver's description of the error.
        message: String,
    },
    /// A tensor handed to a GPU op holds the wrong number of elements.
    #[error("{what} holds {actual} elements where the op needs {expected}; check the shapes")]
    ShapeMismatch {
        /// Which tensor.
        what: &'static str,
        /// Elements the op needs.
        expected: usize,
        /// Elements it holds.
        actual: usize,
    },
    /// A rank outside its communicator's group, or a group of no rank.
    #[error("{what} {rank} is outside a group of {world} ranks; pick a rank below {world}")]
    BadRank {
        /// Which rank (`rank`, `broadcast root`).
        what: &'static str,
        /// The rank given.
        rank: usize,
        /// The group's size.
        world: usize,
    },
    /// A collective on a communicator whose device buffers are released for the other phase.
    #[error("{call} on a suspended nccl communicator; resume it first (the trainer's onload does)")]
    CommSuspended {
        /// The collective.
        call: &'static str,
    },
    /// No CUDA driver or GPU could be used.
    #[error(
        "cuda is not available: {0}; use --device cpu, or run `miles doctor` to see what is missing"
    )]
    CudaUnavailable(String),
}
