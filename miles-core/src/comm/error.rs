//! Errors of collective communication.

/// A collective that failed.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// The ranks of a group called different collectives, or the same one with different lengths.
    #[error(
        "rank {rank} called {op} with {len} elements while rank {other_rank} called {other_op} with {other_len}; every rank of a group must issue the same collectives in the same order"
    )]
    Mismatch {
        /// This rank.
        rank: usize,
        /// The collective this rank called.
        op: &'static str,
        /// Its element count.
        len: usize,
        /// The first rank that disagreed.
        other_rank: usize,
        /// The collective that rank called.
        other_op: &'static str,
        /// Its element count.
        other_len: usize,
    },
    /// A buffer's length does not fit the collective.
    #[error("{op} on rank {rank}: {what}; fix the buffer lengths")]
    BadLength {
        /// The collective.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// What is wrong, with the lengths.
        what: String,
    },
    /// A root or rank outside the group.
    #[error("{op}: rank {root} is outside a group of {world}; pick a rank below {world}")]
    BadRoot {
        /// The collective.
        op: &'static str,
        /// The rank given.
        root: usize,
        /// The group's size.
        world: usize,
    },
    /// A peer left the group (its handle was dropped, usually because its thread failed) while
    /// this rank waited for it.
    #[error(
        "{op} on rank {rank} cannot finish: rank {peer} left the group; look for that rank's own error"
    )]
    PeerGone {
        /// The collective.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// The rank that left.
        peer: usize,
    },
    /// The peers did not all arrive in time.
    #[error(
        "{op} on rank {rank} timed out after {seconds} s waiting for its peers; a rank is stuck or skipped a collective"
    )]
    Timeout {
        /// The collective.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// How long it waited.
        seconds: u64,
    },
    /// A world that cannot be built.
    #[error("cannot build a communicator: {0}")]
    Setup(String),
    /// A launch variable that is missing, unparsable or inconsistent.
    #[error("launch environment: {variable} {problem}")]
    Launch {
        /// The variable at fault.
        variable: &'static str,
        /// What is wrong with it, and the fix.
        problem: String,
    },
    /// The exchange of the communicator id failed.
    #[error("rank {rank}, communicator id exchange at {endpoint}: {problem}")]
    Rendezvous {
        /// This rank.
        rank: usize,
        /// `MASTER_ADDR:MASTER_PORT`.
        endpoint: String,
        /// What failed, and the fix.
        problem: String,
    },
    /// The exchange of the communicator id did not complete in time.
    #[error(
        "rank {rank}, communicator id exchange at {endpoint}: timed out after {seconds:.1} s waiting for {waiting_for}; start every rank with the same MASTER_ADDR and MASTER_PORT, or raise the timeout"
    )]
    RendezvousTimeout {
        /// This rank.
        rank: usize,
        /// `MASTER_ADDR:MASTER_PORT`.
        endpoint: String,
        /// How long it waited.
        seconds: f64,
        /// Who never showed up.
        waiting_for: String,
    },
}
