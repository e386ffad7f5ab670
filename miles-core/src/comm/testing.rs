//! Helpers of the rendezvous tests: ranks of a job on this machine.

use super::{JobSecret, LaunchEnv};

/// The secret of every test job.
pub(super) const SECRET: &str = "a-test-secret-of-the-rendezvous";

/// A port that was free a moment ago.
pub(super) fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// Rank `rank` of a job of `world_size` on this machine, rank 0 listening on `port`.
pub(super) fn local(rank: usize, world_size: usize, port: u16) -> LaunchEnv {
    LaunchEnv {
        rank,
        world_size,
        local_rank: rank,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        secret: JobSecret::new(SECRET),
        port_file: None,
    }
}
