//! [`HostGroup`]: the processes of a multi-process job joined over plain TCP, for what the GPUs'
//! communicator does not carry: handing out its id, lining the ranks up (a barrier), and
//! gathering small reports on rank 0.
//!
//! Rank 0 listens on `MASTER_ADDR:MASTER_PORT`; every other rank connects, says who it is in a
//! small framed handshake (magic, world size, rank) and stays connected: a star around rank 0.
//! Every message after the handshake is a frame: its kind (one byte), its length (u32, little
//! endian) and its bytes.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::{CommError, LaunchEnv};

/// Opens every handshake frame and reply: `MLI` and the protocol version.
const MAGIC: [u8; 4] = *b"MLI2";

/// Reply status: the rank is accepted.
const ACCEPTED: u8 = 0;
/// Reply status: the rank is refused, a reason (u32 length, UTF-8) follows.
const REFUSED: u8 = 1;

/// The longest refusal reason read back, in bytes.
const MAX_REASON: usize = 4096;

/// How long a rank waits between attempts to reach rank 0.
const RETRY_PAUSE: Duration = Duration::from_millis(50);

/// How long a collective waits for its peers unless [`HostGroup::set_timeout`] says otherwise.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// The frames after the handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// A rank reached a barrier.
    Arrived = 1,
    /// Rank 0 lets a barrier go.
    Go = 2,
    /// A rank's part of a gather.
    Part = 3,
    /// Rank 0's bytes of a broadcast.
    Broadcast = 4,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Arrived | Kind::Go => "barrier",
            Kind::Part => "gather",
            Kind::Broadcast => "broadcast",
        }
    }
}

/// The ranks of one job, connected to rank 0 over TCP.
///
/// Every rank calls the same collectives in the same order; a rank whose peer calls another
/// gets [`CommError::Mismatch`], and one whose peer died gets [`CommError::PeerGone`] as soon
/// as the connection closes.
#[derive(Debug)]
pub struct HostGroup {
    rank: usize,
    world: usize,
    /// Rank 0: the connection of rank `r` at `r - 1`. Other ranks: the one to rank 0.
    links: Vec<TcpStream>,
    timeout: Duration,
}

impl HostGroup {
    /// Joins `env`'s job: rank 0 listens and returns once every other rank has connected;
    /// the others connect, retrying until rank 0 listens. Bounded by `timeout`. A world of one
    /// connects nothing.
    ///
    /// # Errors
    /// [`CommError::Rendezvous`] when rank 0 cannot listen, a peer's handshake carries another
    /// world size, a rank outside the world or a rank that already connected (both sides
    /// fail), or the connection breaks; [`CommError::RendezvousTimeout`] when the peers or
    /// rank 0 do not show up in time.
    pub fn connect(env: &LaunchEnv, timeout: Duration) -> Result<HostGroup, CommError> {
        let deadline = Instant::now() + timeout;
        let links = match env.rank {
            _ if env.world_size == 1 => Vec::new(),
            0 => accept_ranks(env, deadline, timeout)?,
            _ => vec![join_rank_0(env, deadline, timeout)?],
        };
        let mut group = HostGroup {
            rank: env.rank,
            world: env.world_size,
            links,
            timeout: DEFAULT_TIMEOUT,
        };
        group.set_timeout(DEFAULT_TIMEOUT)?;
        Ok(group)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the job.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// How long each later collective waits for its peers (default 600 s).
    ///
    /// # Errors
    /// [`CommError::Setup`] when a connection refuses the timeout.
    pub fn set_timeout(&mut self, timeout: Duration) -> Result<(), CommError> {
        let timeout = timeout.max(Duration::from_millis(1));
        for link in &self.links {
            link.set_read_timeout(Some(timeout))
                .and_then(|()| link.set_write_timeout(Some(timeout)))
                .map_err(|error| CommError::Setup(format!("cannot set a timeout: {error}")))?;
        }
        self.timeout = timeout;
        Ok(())
    }

    /// Returns once every rank has called it.
    ///
    /// # Errors
    /// [`CommError::Mismatch`], [`CommError::PeerGone`] or [`CommError::Timeout`].
    pub fn barrier(&mut self) -> Result<(), CommError> {
        if self.rank == 0 {
            for peer in 1..self.world {
                self.receive(peer, Kind::Arrived)?;
            }
            for peer in 1..self.world {
                self.send(peer, Kind::Go, &[])?;
            }
        } else {
            self.send(0, Kind::Arrived, &[])?;
            self.receive(0, Kind::Go)?;
        }
        Ok(())
    }

    /// Every rank's `part`, in rank order, on rank 0 (`None` on the others).
    ///
    /// # Errors
    /// As [`barrier`](Self::barrier); [`CommError::BadLength`] for a part over 4 GiB.
    pub fn gather(&mut self, part: &[u8]) -> Result<Option<Vec<Vec<u8>>>, CommError> {
        if self.rank != 0 {
            self.send(0, Kind::Part, part)?;
            return Ok(None);
        }
        let mut parts = Vec::with_capacity(self.world);
        parts.push(part.to_vec());
        for peer in 1..self.world {
            parts.push(self.receive(peer, Kind::Part)?);
        }
        Ok(Some(parts))
    }

    /// Rank 0's `bytes` on every rank: rank 0 sends its own, the others' are replaced.
    ///
    /// # Errors
    /// As [`gather`](Self::gather).
    pub fn broadcast(&mut self, bytes: &mut Vec<u8>) -> Result<(), CommError> {
        if self.rank == 0 {
            for peer in 1..self.world {
                self.send(peer, Kind::Broadcast, bytes)?;
            }
        } else {
            *bytes = self.receive(0, Kind::Broadcast)?;
        }
        Ok(())
    }

    /// The connection to `peer`: rank 0 has one per rank, the others one to rank 0.
    fn link(&mut self, peer: usize) -> &mut TcpStream {
        let index = if self.rank == 0 { peer - 1 } else { 0 };
        &mut self.links[index]
    }

    fn send(&mut self, peer: usize, kind: Kind, bytes: &[u8]) -> Result<(), CommError> {
        let (rank, len) = (self.rank, bytes.len());
        let len32 = u32::try_from(len).map_err(|_| CommError::BadLength {
            op: kind.name(),
            rank,
            what: format!("{len} bytes do not fit a frame of at most 4 GiB"),
        })?;
        let mut frame = Vec::with_capacity(5 + len);
        frame.push(kind as u8);
        frame.extend_from_slice(&len32.to_le_bytes());
        frame.extend_from_slice(bytes);
        let sent = self.link(peer).write_all(&frame);
        sent.map_err(|error| self.failure(kind, peer, &error))
    }

    fn receive(&mut self, peer: usize, want: Kind) -> Result<Vec<u8>, CommError> {
        let mut head = [0u8; 5];
        let read = self.link(peer).read_exact(&mut head);
        read.map_err(|error| self.failure(want, peer, &error))?;
        let len = u32::from_le_bytes([head[1], head[2], head[3], head[4]]) as usize;
        if head[0] != want as u8 {
            let other_op = [Kind::Arrived, Kind::Go, Kind::Part, Kind::Broadcast]
                .into_iter()
                .find(|kind| *kind as u8 == head[0])
                .map_or("an unknown frame", Kind::name);
            return Err(CommError::Mismatch {
                rank: self.rank,
                op: want.name(),
                len: 0,
                other_rank: peer,
                other_op,
                other_len: len,
            });
        }
        let mut bytes = vec![0u8; len];
        let read = self.link(peer).read_exact(&mut bytes);
        read.map_err(|error| self.failure(want, peer, &error))?;
        Ok(bytes)
    }

    /// The error of a failed read or write on `peer`'s connection.
    fn failure(&self, kind: Kind, peer: usize, error: &std::io::Error) -> CommError {
        use std::io::ErrorKind;
        match error.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => CommError::Timeout {
                op: kind.name(),
                rank: self.rank,
                seconds: self.timeout.as_secs(),
            },
            _ => CommError::PeerGone {
                op: kind.name(),
                rank: self.rank,
                peer,
            },
        }
    }
}

/// Rank 0: accept every other rank once; their connections by rank.
fn accept_ranks(
    env: &LaunchEnv,
    deadline: Instant,
    timeout: Duration,
) -> Result<Vec<TcpStream>, CommError> {
    let rendezvous = |problem: String| CommError::Rendezvous {
        rank: 0,
        endpoint: env.endpoint(),
        problem,
    };
    let address = resolve(env).map_err(rendezvous)?;
    let listener = TcpListener::bind(address).map_err(|error| {
        rendezvous(format!(
            "cannot listen ({error}); pick a free MASTER_PORT (under torchrun the agent's store may hold it)"
        ))
    })?;
    listener
        .set_nonblocking(true)
        .map_err(|error| rendezvous(format!("cannot poll the listener: {error}")))?;
    let mut joined: Vec<Option<TcpStream>> = (0..env.world_size).map(|_| None).collect();
    let mut missing = env.world_size - 1;
    while missing > 0 {
        let (mut stream, peer) = match listener.accept() {
            Ok(accepted) => accepted,
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let waiting: Vec<String> = (1..env.world_size)
                        .filter(|&r| joined[r].is_none())
                        .map(|r| r.to_string())
                        .collect();
                    return Err(CommError::RendezvousTimeout {
                        rank: 0,
                        endpoint: env.endpoint(),
                        seconds: timeout.as_secs_f64(),
                        waiting_for: format!("ranks {}", waiting.join(", ")),
                    });
                }
                std::thread::sleep(RETRY_PAUSE);
                continue;
            }
            Err(error) => return Err(rendezvous(format!("accept failed: {error}"))),
        };
        let io = |error: std::io::Error| rendezvous(format!("connection from {peer}: {error}"));
        stream.set_nonblocking(false).map_err(io)?;
        stream.set_nodelay(true).map_err(io)?;
        let remaining = deadline
            .saturating_duration_since(Instant::now())
            .max(RETRY_PAUSE);
        stream.set_read_timeout(Some(remaining)).map_err(io)?;
        stream.set_write_timeout(Some(remaining)).map_err(io)?;
        let mut hello = [0u8; 12];
        if let Err(error) = stream.read_exact(&mut hello) {
            tracing::warn!(%peer, %error, "ignored a connection that sent no handshake");
            continue;
        }
        if hello[..4] != MAGIC {
            tracing::warn!(%peer, "ignored a connection that is not a miles rank");
            continue;
        }
        let world = u32::from_le_bytes([hello[4], hello[5], hello[6], hello[7]]) as usize;
        let rank = u32::from_le_bytes([hello[8], hello[9], hello[10], hello[11]]) as usize;
        let refusal = if world != env.world_size {
            Some(format!(
                "rank {rank} at {peer} says the world has {world} ranks, rank 0 says {}; launch every rank with the same world size",
                env.world_size
            ))
        } else if rank == 0 || rank >= env.world_size {
            Some(format!(
                "{peer} claims rank {rank}, outside 1..{}; fix that process's rank",
                env.world_size
            ))
        } else if joined[rank].is_some() {
            Some(format!(
                "rank {rank} connected twice (again from {peer}); give every process its own rank"
            ))
        } else {
            None
        };
        if let Some(reason) = refusal {
            let mut reply = Vec::with_capacity(9 + reason.len());
            reply.extend_from_slice(&MAGIC);
            reply.push(REFUSED);
            reply.extend_from_slice(&(reason.len() as u32).to_le_bytes());
            reply.extend_from_slice(reason.as_bytes());
            if let Err(error) = stream.write_all(&reply) {
                tracing::warn!(%peer, %error, "could not tell a refused rank why");
            }
            return Err(rendezvous(reason));
        }
        let mut reply = MAGIC.to_vec();
        reply.push(ACCEPTED);
        stream.write_all(&reply).map_err(io)?;
        joined[rank] = Some(stream);
        missing -= 1;
        tracing::debug!(rank, %peer, missing, "a rank joined");
    }
    Ok(joined.into_iter().skip(1).flatten().collect())
}

/// A rank above 0: connect to rank 0 (retrying until `deadline`) and introduce itself.
fn join_rank_0(
    env: &LaunchEnv,
    deadline: Instant,
    timeout: Duration,
) -> Result<TcpStream, CommError> {
    let rendezvous = |problem: String| CommError::Rendezvous {
        rank: env.rank,
        endpoint: env.endpoint(),
        problem,
    };
    let mut last_error = String::from("no attempt");
    let mut stream = loop {
        let now = Instant::now();
        if now >= deadline {
            return Err(CommError::RendezvousTimeout {
                rank: env.rank,
                endpoint: env.endpoint(),
                seconds: timeout.as_secs_f64(),
                waiting_for: format!("rank 0 to listen (last attempt: {last_error})"),
            });
        }
        let attempt = resolve(env).and_then(|address| {
            TcpStream::connect_timeout(&address, deadline - now).map_err(|e| e.to_string())
        });
        match attempt {
            Ok(stream) => break stream,
            Err(error) => {
                last_error = error;
                std::thread::sleep(RETRY_PAUSE);
            }
        }
    };
    let io = |error: std::io::Error| rendezvous(format!("talking to rank 0: {error}"));
    stream.set_nodelay(true).map_err(io)?;
    let remaining = deadline
        .saturating_duration_since(Instant::now())
        .max(RETRY_PAUSE);
    stream.set_read_timeout(Some(remaining)).map_err(io)?;
    stream.set_write_timeout(Some(remaining)).map_err(io)?;
    let mut hello = Vec::with_capacity(12);
    hello.extend_from_slice(&MAGIC);
    hello.extend_from_slice(&to_u32(env.world_size)?.to_le_bytes());
    hello.extend_from_slice(&to_u32(env.rank)?.to_le_bytes());
    stream.write_all(&hello).map_err(io)?;
    let mut head = [0u8; 5];
    stream.read_exact(&mut head).map_err(io)?;
    if head[..4] != MAGIC {
        return Err(rendezvous(
            "the listener is not a miles rank 0 of this version; check MASTER_ADDR and MASTER_PORT, and run the same miles on every rank".into(),
        ));
    }
    match head[4] {
        ACCEPTED => Ok(stream),
        REFUSED => {
            let mut len = [0u8; 4];
            stream.read_exact(&mut len).map_err(io)?;
            let len = (u32::from_le_bytes(len) as usize).min(MAX_REASON);
            let mut reason = vec![0u8; len];
            stream.read_exact(&mut reason).map_err(io)?;
            Err(rendezvous(format!(
                "rank 0 refused this rank: {}",
                String::from_utf8_lossy(&reason)
            )))
        }
        other => Err(rendezvous(format!(
            "rank 0 replied with unknown status {other}; run the same miles version on every rank"
        ))),
    }
}

/// The first socket address `MASTER_ADDR:MASTER_PORT` resolves to.
fn resolve(env: &LaunchEnv) -> Result<SocketAddr, String> {
    (env.master_addr.as_str(), env.master_port)
        .to_socket_addrs()
        .map_err(|error| format!("cannot resolve MASTER_ADDR ({error}); check the host name"))?
        .next()
        .ok_or_else(|| "MASTER_ADDR resolves to no address; check the host name".to_owned())
}

/// A rank or size as the handshake's u32.
fn to_u32(value: usize) -> Result<u32, CommError> {
    u32::try_from(value).map_err(|_| {
        CommError::Setup(format!(
            "{value} does not fit the handshake's 32 bits; use fewer ranks"
        ))
    })
}

#[cfg(test)]
#[allow(clippy::panic)]
mod tests {
    use super::*;
    use crate::comm::testing::{free_port, local};

    /// Runs `body` on `world` threads, each with its rank's group; their results by rank.
    fn on_ranks<T: Send + 'static>(
        world: usize,
        body: fn(&mut HostGroup) -> Result<T, CommError>,
    ) -> Vec<Result<T, CommError>> {
        let port = free_port();
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                std::thread::spawn(move || {
                    let mut group =
                        HostGroup::connect(&local(rank, world, port), Duration::from_secs(20))?;
                    body(&mut group)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn gather_brings_every_part_to_rank_0_in_rank_order() {
        let results = on_ranks(4, |group| {
            group.barrier()?;
            let part = vec![group.rank() as u8; group.rank() * 3];
            let gathered = group.gather(&part)?;
            group.barrier()?;
            Ok(gathered)
        });
        let mut results = results.into_iter();
        let at_0 = results.next().unwrap().unwrap().unwrap();
        let want: Vec<Vec<u8>> = (0..4).map(|r| vec![r as u8; r * 3]).collect();
        assert_eq!(at_0, want);
        for other in results {
            assert_eq!(other.unwrap(), None);
        }
    }

    #[test]
    fn broadcast_gives_every_rank_the_bytes_of_rank_0() {
        let results = on_ranks(3, |group| {
            let mut bytes = if group.rank() == 0 {
                b"rank zero".to_vec()
            } else {
                Vec::new()
            };
            group.broadcast(&mut bytes)?;
            Ok(bytes)
        });
        for result in results {
            assert_eq!(result.unwrap(), b"rank zero");
        }
    }

    #[test]
    fn a_peer_that_calls_another_collective_is_a_mismatch() {
        let results = on_ranks(2, |group| {
            if group.rank() == 0 {
                group.barrier()
            } else {
                group.gather(b"x").map(|_| ())
            }
        });
        match &results[0] {
            Err(CommError::Mismatch { op, other_op, .. }) => {
                assert_eq!((*op, *other_op), ("barrier", "gather"));
            }
            other => panic!("rank 0 gave {other:?}, want a mismatch"),
        }
    }

    #[test]
    fn a_peer_that_leaves_is_reported_gone_not_waited_for() {
        let results = on_ranks(2, |group| {
            if group.rank() == 0 {
                group.set_timeout(Duration::from_secs(30))?;
                let started = Instant::now();
                let result = group.barrier();
                assert!(started.elapsed() < Duration::from_secs(10));
                result
            } else {
                Ok(())
            }
        });
        assert!(
            matches!(results[0], Err(CommError::PeerGone { peer: 1, .. })),
            "{:?}",
            results[0]
        );
    }

    #[test]
    fn a_stuck_peer_times_out() {
        let results = on_ranks(2, |group| {
            group.set_timeout(Duration::from_millis(200))?;
            if group.rank() == 0 {
                group.barrier()
            } else {
                std::thread::sleep(Duration::from_millis(800));
                Ok(())
            }
        });
        assert!(
            matches!(results[0], Err(CommError::Timeout { op: "barrier", .. })),
            "{:?}",
            results[0]
        );
    }
}
