//! Collective communication between the ranks of a training job.
//!
//! [`Communicator`] is the contract: all-reduce, all-gather, reduce-scatter, broadcast and
//! barrier over f32 buffers, plus [`Communicator::split`] to cut a world into tensor- and
//! data-parallel groups. [`LocalComm`] runs ranks as threads of one process (the CPU device);
//! NCCL implements the same trait for CUDA. [`LaunchEnv`] reads a multi-process job's layout
//! from its launcher, [`HostGroup`] joins its processes over TCP (barrier, gather, broadcast), and
//! [`exchange_id`] hands rank 0's communicator id to every rank over it.

mod error;
mod group;
mod launch;
mod local;
#[cfg(test)]
mod testing;

pub use error::CommError;
pub use group::HostGroup;
pub use launch::{
    DEFAULT_MASTER_PORT, ID_BYTES, JobSecret, LaunchEnv, MAX_SECRET_LEN, MIN_SECRET_LEN,
    PORT_FILE_VAR, SECRET_VAR, exchange_id,
};
pub use local::LocalComm;

/// One rank's handle on a group of ranks.
///
/// Every collective is called by every rank of the group, in the same order, with matching
/// lengths; each blocks until the whole group has joined it. Reductions are deterministic: every
/// rank gets the same bits, summed in rank order, whatever the thread timing.
pub trait Communicator: Send + std::fmt::Debug {
    /// This rank within the group, `0..world_size()`.
    fn rank(&self) -> usize;

    /// The number of ranks in the group.
    fn world_size(&self) -> usize;

    /// Replaces `buf` on every rank with the element-wise sum over the ranks.
    ///
    /// # Errors
    /// [`CommError::Mismatch`] when the ranks disagree on the call, [`CommError::PeerGone`] or
    /// [`CommError::Timeout`] when a peer never arrives.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CommError>;

    /// Concatenates every rank's `send` in rank order into `recv` (`world_size * send.len()`).
    ///
    /// # Errors
    /// [`CommError::BadLength`] for a `recv` of the wrong length; as
    /// [`all_reduce_sum`](Self::all_reduce_sum).
    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError>;

    /// Sums `send` (`world_size * recv.len()`) over the ranks and leaves block `rank` of the
    /// sum in `recv`.
    ///
    /// # Errors
    /// [`CommError::BadLength`] for a `send` of the wrong length; as
    /// [`all_reduce_sum`](Self::all_reduce_sum).
    fn reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError>;

    /// Copies `buf` of rank `root` into `buf` of every rank.
    ///
    /// # Errors
    /// [`CommError::BadRoot`]; as [`all_reduce_sum`](Self::all_reduce_sum).
    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<(), CommError>;

    /// Returns once every rank of the group has called it.
    ///
    /// # Errors
    /// As [`all_reduce_sum`](Self::all_reduce_sum).
    fn barrier(&self) -> Result<(), CommError>;

    /// Splits the group: ranks that pass the same `color` form a new group, ordered by `key`
    /// then by their rank here (MPI's `comm_split`, NCCL's `ncclCommSplit`). Collective.
    ///
    /// # Errors
    /// As [`all_reduce_sum`](Self::all_reduce_sum).
    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Communicator>, CommError>;
}
