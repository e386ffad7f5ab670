//! [`HostGroup`]: the processes of a multi-process job joined over plain TCP, for what the GPUs'
//! communicator does not carry: handing out its id, lining the ranks up (a barrier), and
//! gathering small reports on rank 0.
//!
//! Rank 0 listens on `MASTER_ADDR:MASTER_PORT` (or on a free port it publishes in the port
//! file); every other rank connects, says who it is in a small framed handshake (magic, world
//! size, rank, the job's secret) and stays connected: a star around rank 0. Rank 0 reads each
//! handshake on its own thread within [`HANDSHAKE_TIMEOUT`], so a connection that says nothing,
//! or garbage, or carries another secret, is logged and dropped while the ranks keep joining.
//! Every message after the handshake is a frame: its kind (one byte), its length (u32, little
//! endian, at most what its kind carries) and its bytes.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::{CommError, JobSecret, LaunchEnv, MAX_SECRET_LEN};

/// Opens every handshake frame and reply: `MLI` and the protocol version.
const MAGIC: [u8; 4] = *b"MLI3";

/// Bytes of a handshake before the secret: magic, world size, rank, secret length (u16).
const HELLO_HEAD: usize = 14;

/// Reply status: the rank is accepted.
const ACCEPTED: u8 = 0;
/// Reply status: the rank is refused, a reason (u32 length, UTF-8) follows.
const REFUSED: u8 = 1;

/// The longest refusal reason read back, in bytes.
const MAX_REASON: usize = 4096;

/// How long rank 0 waits for one connection's handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Handshakes rank 0 reads at once; connections beyond them are dropped unread.
const MAX_HANDSHAKES: usize = 64;

/// The largest part of a gather, in bytes (a rank's report).
pub const MAX_PART: usize = 1 << 20;

/// The largest broadcast, in bytes (a communicator id is 128).
pub const MAX_BROADCAST: usize = 4 << 10;

/// The largest frame of an all-gather, in bytes: a rank's part, or every part as rank 0 sends
/// them back (the rollouts a tensor-parallel group shares).
pub const MAX_SHARED: usize = 256 << 20;

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
    /// A rank's part of an all-gather, or every part as rank 0 sends them back.
    Shared = 5,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Arrived | Kind::Go => "barrier",
            Kind::Part => "gather",
            Kind::Broadcast => "broadcast",
            Kind::Shared => "all-gather or route",
        }
    }

    /// The largest frame of this kind, in bytes.
    fn max_len(self) -> usize {
        match self {
            Kind::Arrived | Kind::Go => 0,
            Kind::Part => MAX_PART,
            Kind::Broadcast => MAX_BROADCAST,
            Kind::Shared => MAX_SHARED,
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
    /// Joins `env`'s job: rank 0 listens (publishing its port in `env.port_file` when set) and
    /// returns once every other rank has connected with the job's secret; the others connect,
    /// retrying until rank 0 listens. Bounded by `timeout`. A world of one connects nothing.
    ///
    /// Rank 0 reads each handshake on its own thread within [`HANDSHAKE_TIMEOUT`]; a
    /// connection that sends nothing, garbage or another secret is logged and dropped (one
    /// with another secret is told so) and the others keep joining.
    ///
    /// # Errors
    /// [`CommError::Rendezvous`] when rank 0 cannot listen or publish its port, a handshake
    /// with the job's secret carries another world size, a rank outside the world or a rank
    /// that already connected (both sides fail), rank 0 refuses this rank's secret, or the
    /// connection breaks; [`CommError::RendezvousTimeout`] when the peers, rank 0 or its port
    /// do not show up in time.
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
    /// As [`barrier`](Self::barrier); [`CommError::BadLength`] for a part over [`MAX_PART`]
    /// bytes, sent or received.
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
    /// As [`barrier`](Self::barrier); [`CommError::BadLength`] for bytes over
    /// [`MAX_BROADCAST`], sent or received.
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

    /// Every rank's `part`, in rank order, on every rank: a gather to rank 0, which sends
    /// every part back to each rank in one frame.
    ///
    /// # Errors
    /// As [`barrier`](Self::barrier); [`CommError::BadLength`] when the parts together (four
    /// bytes of length each, and four more) exceed [`MAX_SHARED`] bytes, or a frame received
    /// does not parse.
    pub fn all_gather(&mut self, part: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        if self.rank != 0 {
            self.send(0, Kind::Shared, part)?;
            let packed = self.receive(0, Kind::Shared)?;
            return unpack(&packed, self.rank, self.world);
        }
        let mut parts = Vec::with_capacity(self.world);
        parts.push(part.to_vec());
        for peer in 1..self.world {
            parts.push(self.receive(peer, Kind::Shared)?);
        }
        let mut packed = Vec::new();
        for part in &parts {
            let len = u32::try_from(part.len()).unwrap_or(u32::MAX);
            packed.extend_from_slice(&len.to_le_bytes());
            packed.extend_from_slice(part);
        }
        for peer in 1..self.world {
            self.send(peer, Kind::Shared, &packed)?;
        }
        Ok(parts)
    }

    /// Every rank's `part` to rank 0, which sends each rank `r` the part of rank `from(r)`
    /// (`from` the same on every rank): what a rank takes from another of its group, such as
    /// the rollout of its tensor-parallel group's first rank. Only each rank's own part comes
    /// back to it, in a frame of at most [`MAX_SHARED`] bytes.
    ///
    /// # Errors
    /// As [`barrier`](Self::barrier); [`CommError::BadRoot`] where `from` names a rank outside
    /// the group; [`CommError::BadLength`] for a part over [`MAX_SHARED`] bytes.
    pub fn route(
        &mut self,
        part: &[u8],
        from: impl Fn(usize) -> usize,
    ) -> Result<Vec<u8>, CommError> {
        let world = self.world;
        let source = |rank: usize| match from(rank) {
            root if root < world => Ok(root),
            root => Err(CommError::BadRoot {
                op: Kind::Shared.name(),
                root,
                world,
            }),
        };
        source(self.rank)?;
        if self.rank != 0 {
            self.send(0, Kind::Shared, part)?;
            return self.receive(0, Kind::Shared);
        }
        let mut parts = Vec::with_capacity(world);
        parts.push(part.to_vec());
        for peer in 1..world {
            parts.push(self.receive(peer, Kind::Shared)?);
        }
        for peer in 1..world {
            let part = &parts[source(peer)?];
            self.send(peer, Kind::Shared, part)?;
        }
        Ok(std::mem::take(&mut parts[source(0)?]))
    }

    /// The largest of every rank's `value`, on every rank (a gather to rank 0, then its
    /// broadcast).
    ///
    /// # Errors
    /// As [`barrier`](Self::barrier); [`CommError::BadLength`] for a part that is not one u32.
    pub fn max(&mut self, value: u32) -> Result<u32, CommError> {
        let rank = self.rank;
        let read = |part: &[u8], from: usize| {
            let bytes: [u8; 4] = part.try_into().map_err(|_| CommError::BadLength {
                op: "max",
                rank,
                what: format!("rank {from} sent {} bytes, not 4", part.len()),
            })?;
            Ok(u32::from_le_bytes(bytes))
        };
        let mut largest = value.to_le_bytes().to_vec();
        if let Some(parts) = self.gather(&largest)? {
            let mut max = value;
            for (from, part) in parts.iter().enumerate() {
                max = max.max(read(part, from)?);
            }
            largest = max.to_le_bytes().to_vec();
        }
        self.broadcast(&mut largest)?;
        read(&largest, 0)
    }

    /// The connection to `peer`: rank 0 has one per rank, the others one to rank 0.
    fn link(&mut self, peer: usize) -> &mut TcpStream {
        let index = if self.rank == 0 { peer - 1 } else { 0 };
        &mut self.links[index]
    }

    fn send(&mut self, peer: usize, kind: Kind, bytes: &[u8]) -> Result<(), CommError> {
        let (rank, len) = (self.rank, bytes.len());
        let too_long = || CommError::BadLength {
            op: kind.name(),
            rank,
            what: format!(
                "{len} bytes do not fit a {} frame of at most {} bytes; send less",
                kind.name(),
                kind.max_len()
            ),
        };
        if len > kind.max_len() {
            return Err(too_long());
        }
        let len32 = u32::try_from(len).map_err(|_| too_long())?;
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
            let other_op = [
                Kind::Arrived,
                Kind::Go,
                Kind::Part,
                Kind::Broadcast,
                Kind::Shared,
            ]
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
        if len > want.max_len() {
            return Err(CommError::BadLength {
                op: want.name(),
                rank: self.rank,
                what: format!(
                    "rank {peer} sent a frame of {len} bytes, above the {} a {} frame carries; run the same miles on every rank",
                    want.max_len(),
                    want.name()
                ),
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

/// What a connection's handshake said.
enum Handshake {
    /// A rank of this job (its secret matched): world size and rank it claims.
    Rank { world: usize, rank: usize },
    /// A miles rank with another secret: told so, then dropped.
    WrongSecret,
    /// Not a miles rank (silent, garbage, too long): dropped unanswered, for this reason.
    Rejected(String),
}

/// Reads one connection's handshake, waiting at most `limit`.
fn read_hello(stream: &mut TcpStream, limit: Duration, secret: &JobSecret) -> Handshake {
    let prepared = stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_nodelay(true))
        .and_then(|()| stream.set_read_timeout(Some(limit.max(RETRY_PAUSE))))
        .and_then(|()| stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT)));
    if let Err(error) = prepared {
        return Handshake::Rejected(format!("cannot set up the connection: {error}"));
    }
    let mut head = [0u8; HELLO_HEAD];
    if let Err(error) = stream.read_exact(&mut head) {
        return Handshake::Rejected(format!("sent no whole handshake ({error})"));
    }
    if head[..4] != MAGIC {
        return Handshake::Rejected("is not a miles rank of this version".into());
    }
    let word = |at: usize| u32::from_le_bytes([head[at], head[at + 1], head[at + 2], head[at + 3]]);
    let secret_len = usize::from(u16::from_le_bytes([head[12], head[13]]));
    if secret_len > MAX_SECRET_LEN {
        return Handshake::Rejected(format!(
            "announced a secret of {secret_len} bytes, above {MAX_SECRET_LEN}"
        ));
    }
    let mut presented = vec![0u8; secret_len];
    if let Err(error) = stream.read_exact(&mut presented) {
        return Handshake::Rejected(format!("sent no whole secret ({error})"));
    }
    if !secret.matches(&presented) {
        return Handshake::WrongSecret;
    }
    Handshake::Rank {
        world: word(4) as usize,
        rank: word(8) as usize,
    }
}

/// Sends a refusal with its reason; a peer that is gone is only logged.
fn refuse(stream: &mut TcpStream, peer: SocketAddr, reason: &str) {
    let mut reply = Vec::with_capacity(9 + reason.len());
    reply.extend_from_slice(&MAGIC);
    reply.push(REFUSED);
    reply.extend_from_slice(&(reason.len() as u32).to_le_bytes());
    reply.extend_from_slice(reason.as_bytes());
    if let Err(error) = stream.write_all(&reply) {
        tracing::warn!(%peer, %error, "could not tell a refused rank why");
    }
}

/// Rank 0's listener: on `MASTER_ADDR:MASTER_PORT`, or on a free port of `MASTER_ADDR` that it
/// publishes in the port file; and `env` with the port it bound.
fn listen(env: &LaunchEnv) -> Result<(TcpListener, LaunchEnv), CommError> {
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
    let port = listener
        .local_addr()
        .map_err(|error| rendezvous(format!("cannot read the port bound: {error}")))?
        .port();
    if let Some(file) = &env.port_file {
        publish_port(file, port).map_err(|error| {
            rendezvous(format!(
                "cannot publish port {port} in {}: {error}; check that its directory is writable",
                file.display()
            ))
        })?;
    }
    listener
        .set_nonblocking(true)
        .map_err(|error| rendezvous(format!("cannot poll the listener: {error}")))?;
    let bound = LaunchEnv {
        master_port: port,
        ..env.clone()
    };
    Ok((listener, bound))
}

/// Writes `port` into `file` whole (write beside it, then rename), so readers never see a part.
fn publish_port(file: &Path, port: u16) -> std::io::Result<()> {
    let tmp = file.with_extension("tmp");
    std::fs::write(&tmp, format!("{port}\n"))?;
    std::fs::rename(&tmp, file)
}

/// A rank above 0: `env` with the port rank 0 published in the port file (waiting until
/// `deadline`), or `env` itself without one.
fn published(
    env: &LaunchEnv,
    deadline: Instant,
    timeout: Duration,
) -> Result<LaunchEnv, CommError> {
    let Some(file) = &env.port_file else {
        return Ok(env.clone());
    };
    loop {
        let port = std::fs::read_to_string(file)
            .ok()
            .and_then(|text| text.trim().parse::<u16>().ok())
            .filter(|&port| port > 0);
        if let Some(port) = port {
            return Ok(LaunchEnv {
                master_port: port,
                ..env.clone()
            });
        }
        if Instant::now() >= deadline {
            return Err(CommError::RendezvousTimeout {
                rank: env.rank,
                endpoint: env.endpoint(),
                seconds: timeout.as_secs_f64(),
                waiting_for: format!("rank 0 to publish its port in {}", file.display()),
            });
        }
        std::thread::sleep(RETRY_PAUSE);
    }
}

/// A connection whose handshake was read, with what it said.
type Heard = (TcpStream, SocketAddr, Handshake);

/// Accepts every connection waiting on `listener` and reads each handshake on its own thread
/// (at most [`MAX_HANDSHAKES`] at once), sending what it said to `heard`.
fn accept_waiting(
    listener: &TcpListener,
    heard: &mpsc::Sender<Heard>,
    reading: &mut usize,
    deadline: Instant,
    secret: &JobSecret,
) {
    loop {
        let (mut stream, peer) = match listener.accept() {
            Ok(accepted) => accepted,
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => return,
            Err(error) => {
                tracing::warn!(%error, "rank 0 could not accept a connection");
                return;
            }
        };
        if *reading >= MAX_HANDSHAKES {
            tracing::warn!(%peer, "dropped a connection: {MAX_HANDSHAKES} handshakes are being read already");
            continue;
        }
        let limit = HANDSHAKE_TIMEOUT.min(deadline.saturating_duration_since(Instant::now()));
        let (heard, secret) = (heard.clone(), secret.clone());
        let spawned = std::thread::Builder::new()
            .name("miles-handshake".into())
            .spawn(move || {
                let said = read_hello(&mut stream, limit, &secret);
                // The receiver is gone once every rank joined: the connection is then dropped.
                let _ = heard.send((stream, peer, said));
            });
        match spawned {
            Ok(_) => *reading += 1,
            Err(error) => {
                tracing::warn!(%peer, %error, "dropped a connection: cannot start its handshake")
            }
        }
    }
}

/// Rank 0: accept every other rank once; their connections by rank. Connections that are not
/// ranks of this job are logged and dropped.
fn accept_ranks(
    env: &LaunchEnv,
    deadline: Instant,
    timeout: Duration,
) -> Result<Vec<TcpStream>, CommError> {
    let (listener, env) = listen(env)?;
    let rendezvous = |problem: String| CommError::Rendezvous {
        rank: 0,
        endpoint: env.endpoint(),
        problem,
    };
    let (tell, heard) = mpsc::channel::<Heard>();
    let mut reading = 0;
    let mut joined: Vec<Option<TcpStream>> = (0..env.world_size).map(|_| None).collect();
    let mut missing = env.world_size - 1;
    while missing > 0 {
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
        accept_waiting(&listener, &tell, &mut reading, deadline, &env.secret);
        let Ok((mut stream, peer, said)) = heard.recv_timeout(RETRY_PAUSE) else {
            continue;
        };
        reading -= 1;
        let (world, rank) = match said {
            Handshake::Rank { world, rank } => (world, rank),
            Handshake::WrongSecret => {
                tracing::warn!(%peer, "rejected a connection with another job secret");
                refuse(
                    &mut stream,
                    peer,
                    "this rank's job secret differs from rank 0's; set the same MILES_JOB_SECRET on every rank",
                );
                continue;
            }
            Handshake::Rejected(reason) => {
                tracing::warn!(%peer, "rejected a connection that {reason}");
                continue;
            }
        };
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
            refuse(&mut stream, peer, &reason);
            return Err(rendezvous(reason));
        }
        let io = |error: std::io::Error| rendezvous(format!("connection from {peer}: {error}"));
        let remaining = deadline
            .saturating_duration_since(Instant::now())
            .max(RETRY_PAUSE);
        stream.set_read_timeout(Some(remaining)).map_err(io)?;
        stream.set_write_timeout(Some(remaining)).map_err(io)?;
        let mut reply = MAGIC.to_vec();
        reply.push(ACCEPTED);
        stream.write_all(&reply).map_err(io)?;
        joined[rank] = Some(stream);
        missing -= 1;
        tracing::debug!(rank, %peer, missing, "a rank joined");
    }
    Ok(joined.into_iter().skip(1).flatten().collect())
}

/// What rank 0 answered a handshake.
enum Reply {
    /// The rank joined.
    Accepted,
    /// Rank 0 refused it, for this reason.
    Refused(String),
    /// The connection ended before an answer (rank 0 had too many handshakes to read): worth
    /// another attempt.
    Lost(String),
}

/// A rank above 0: connect to rank 0 and introduce itself, retrying until `deadline` while
/// rank 0 does not listen or drops the connection unanswered.
fn join_rank_0(
    env: &LaunchEnv,
    deadline: Instant,
    timeout: Duration,
) -> Result<TcpStream, CommError> {
    let env = &published(env, deadline, timeout)?;
    let rendezvous = |problem: String| CommError::Rendezvous {
        rank: env.rank,
        endpoint: env.endpoint(),
        problem,
    };
    let hello = hello_of(env)?;
    let mut last_error = String::from("no attempt");
    loop {
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
        let mut stream = match attempt {
            Ok(stream) => stream,
            Err(error) => {
                last_error = error;
                std::thread::sleep(RETRY_PAUSE);
                continue;
            }
        };
        match introduce(&mut stream, &hello, deadline).map_err(rendezvous)? {
            Reply::Accepted => return Ok(stream),
            Reply::Refused(reason) => {
                return Err(rendezvous(format!("rank 0 refused this rank: {reason}")));
            }
            Reply::Lost(error) => {
                last_error = error;
                std::thread::sleep(RETRY_PAUSE);
            }
        }
    }
}

/// The handshake of `env`'s rank: magic, world size, rank, the secret's length and the secret.
fn hello_of(env: &LaunchEnv) -> Result<Vec<u8>, CommError> {
    let secret = env.secret.as_bytes();
    let secret_len = u16::try_from(secret.len())
        .ok()
        .filter(|&len| usize::from(len) <= MAX_SECRET_LEN)
        .ok_or_else(|| {
            CommError::Setup(format!(
                "the job secret has {} bytes, above {MAX_SECRET_LEN}; use a shorter one",
                secret.len()
            ))
        })?;
    let mut hello = Vec::with_capacity(HELLO_HEAD + secret.len());
    hello.extend_from_slice(&MAGIC);
    hello.extend_from_slice(&to_u32(env.world_size)?.to_le_bytes());
    hello.extend_from_slice(&to_u32(env.rank)?.to_le_bytes());
    hello.extend_from_slice(&secret_len.to_le_bytes());
    hello.extend_from_slice(secret);
    Ok(hello)
}

/// Sends `hello` on `stream` and reads rank 0's answer; `Err` for a listener that is not a
/// miles rank 0.
fn introduce(stream: &mut TcpStream, hello: &[u8], deadline: Instant) -> Result<Reply, String> {
    let remaining = deadline
        .saturating_duration_since(Instant::now())
        .max(RETRY_PAUSE);
    let prepared = stream
        .set_nodelay(true)
        .and_then(|()| stream.set_read_timeout(Some(remaining)))
        .and_then(|()| stream.set_write_timeout(Some(remaining)));
    if let Err(error) = prepared {
        return Ok(Reply::Lost(format!(
            "cannot set up the connection: {error}"
        )));
    }
    let mut head = [0u8; 5];
    let answered = stream
        .write_all(hello)
        .and_then(|()| stream.read_exact(&mut head));
    if let Err(error) = answered {
        return Ok(Reply::Lost(format!(
            "rank 0 dropped the connection: {error}"
        )));
    }
    if head[..4] != MAGIC {
        return Err(
            "the listener is not a miles rank 0 of this version; check MASTER_ADDR and MASTER_PORT, and run the same miles on every rank".into(),
        );
    }
    match head[4] {
        ACCEPTED => Ok(Reply::Accepted),
        REFUSED => {
            let mut len = [0u8; 4];
            let mut reason = Vec::new();
            let read = stream.read_exact(&mut len).and_then(|()| {
                let len = (u32::from_le_bytes(len) as usize).min(MAX_REASON);
                reason.resize(len, 0);
                stream.read_exact(&mut reason)
            });
            match read {
                Ok(()) => Ok(Reply::Refused(
                    String::from_utf8_lossy(&reason).into_owned(),
                )),
                Err(error) => Ok(Reply::Refused(format!("(its reason was cut off: {error})"))),
            }
        }
        other => Err(format!(
            "rank 0 replied with unknown status {other}; run the same miles version on every rank"
        )),
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
#[path = "group_tests.rs"]
mod tests;

/// The `world` parts rank 0 packed for [`HostGroup::all_gather`] (each a little-endian u32
/// length, then its bytes), on `rank`.
fn unpack(mut packed: &[u8], rank: usize, world: usize) -> Result<Vec<Vec<u8>>, CommError> {
    let bad = |what: String| CommError::BadLength {
        op: Kind::Shared.name(),
        rank,
        what,
    };
    let mut parts = Vec::with_capacity(world);
    while parts.len() < world {
        let Some((head, rest)) = packed.split_first_chunk::<4>() else {
            return Err(bad(format!(
                "rank 0 sent {} parts of the {world}; run the same miles on every rank",
                parts.len()
            )));
        };
        let len = u32::from_le_bytes(*head) as usize;
        if rest.len() < len {
            return Err(bad(format!(
                "part {} of rank 0's frame says {len} bytes, {} are left",
                parts.len(),
                rest.len()
            )));
        }
        parts.push(rest[..len].to_vec());
        packed = &rest[len..];
    }
    if !packed.is_empty() {
        return Err(bad(format!(
            "rank 0's frame holds {} bytes beyond the {world} parts",
            packed.len()
        )));
    }
    Ok(parts)
}
