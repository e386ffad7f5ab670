//! Helpers of the rendezvous tests: ranks of a job on this machine.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::{JobSecret, LaunchEnv};

/// The secret of every test job.
pub(super) const SECRET: &str = "a-test-secret-of-the-rendezvous";

/// A port that was free a moment ago, for a rank 0 that is never started (a port handed to a
/// rank 0 that binds it could be taken in between by another test's connection: those jobs
/// are [`LocalJob`]s).
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

/// A job of ranks on this machine that meet through a port file, as under `--nproc-per-node`:
/// rank 0 binds a free port itself and publishes it.
pub(super) struct LocalJob {
    dir: tempfile::TempDir,
}

impl LocalJob {
    pub(super) fn new() -> LocalJob {
        LocalJob {
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn port_file(&self) -> PathBuf {
        self.dir.path().join("port")
    }

    /// Rank `rank` of this job of `world_size` ranks.
    pub(super) fn rank(&self, rank: usize, world_size: usize) -> LaunchEnv {
        LaunchEnv {
            port_file: Some(self.port_file()),
            ..local(rank, world_size, 0)
        }
    }

    /// The port rank 0 published, once it has (rank 0 must be starting).
    pub(super) fn port(&self) -> u16 {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let port = std::fs::read_to_string(self.port_file())
                .ok()
                .and_then(|text| text.trim().parse::<u16>().ok());
            match port {
                Some(port) if port > 0 => return port,
                _ if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
                _ => panic!("rank 0 never published its port"),
            }
        }
    }
}
