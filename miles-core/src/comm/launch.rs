//! Multi-process launch: where this process stands in the job, read from the variables that the
//! usual launchers set (torchrun, Slurm's `srun`, Open MPI's `mpirun`), and the exchange of the
//! communicator's 128-byte id from rank 0 to every other rank over plain TCP.
//!
//! One process drives one GPU; miles starts no processes of its own here. Rank 0 listens on
//! `MASTER_ADDR:MASTER_PORT`; every other rank connects, says who it is in a small framed
//! handshake (magic, world size, rank), and receives the id, which then opens the NCCL
//! communicator on every rank.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::CommError;

/// Bytes of a communicator id (NCCL's `ncclUniqueId`).
pub const ID_BYTES: usize = 128;

/// The port rank 0 listens on when `MASTER_PORT` is unset (torchrun's default).
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Opens every handshake frame and reply: `MLI` and the protocol version.
const MAGIC: [u8; 4] = *b"MLI1";

/// Reply status: the rank is accepted, the id follows.
const ACCEPTED: u8 = 0;
/// Reply status: the rank is refused, a reason (u32 length, UTF-8) follows.
const REFUSED: u8 = 1;

/// The longest refusal reason read back, in bytes.
const MAX_REASON: usize = 4096;

/// How long a rank waits between attempts to reach rank 0.
const RETRY_PAUSE: Duration = Duration::from_millis(50);

/// The variables of one launcher, in the order they are tried.
struct Launcher {
    name: &'static str,
    rank: &'static str,
    world_size: &'static str,
    local_rank: &'static str,
}

const LAUNCHERS: [Launcher; 3] = [
    Launcher {
        name: "torchrun",
        rank: "RANK",
        world_size: "WORLD_SIZE",
        local_rank: "LOCAL_RANK",
    },
    Launcher {
        name: "slurm",
        rank: "SLURM_PROCID",
        world_size: "SLURM_NTASKS",
        local_rank: "SLURM_LOCALID",
    },
    Launcher {
        name: "open mpi",
        rank: "OMPI_COMM_WORLD_RANK",
        world_size: "OMPI_COMM_WORLD_SIZE",
        local_rank: "OMPI_COMM_WORLD_LOCAL_RANK",
    },
];

/// Where this process stands in a multi-process job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// Processes in the job.
    pub world_size: usize,
    /// This process's rank on its node: the GPU ordinal it drives.
    pub local_rank: usize,
    /// The host rank 0 listens on.
    pub master_addr: String,
    /// The port rank 0 listens on.
    pub master_port: u16,
}

impl LaunchEnv {
    /// Reads the process environment; see [`LaunchEnv::from_vars`].
    ///
    /// # Errors
    /// As [`LaunchEnv::from_vars`].
    pub fn from_process_env() -> Result<Option<LaunchEnv>, CommError> {
        LaunchEnv::from_vars(&|name| std::env::var(name).ok())
    }

    /// Reads the job's layout through `var` (a variable's value, `None` when unset): rank and
    /// world size from torchrun's `RANK` / `WORLD_SIZE`, else Slurm's `SLURM_PROCID` /
    /// `SLURM_NTASKS`, else Open MPI's `OMPI_COMM_WORLD_RANK` / `OMPI_COMM_WORLD_SIZE`; the
    /// local rank from the same launcher's variable, else another launcher's; `MASTER_ADDR`
    /// and `MASTER_PORT` (default [`DEFAULT_MASTER_PORT`]). `None` when no launcher variable
    /// is set: a single process. A world of one needs no `MASTER_ADDR` (it defaults to
    /// `127.0.0.1`).
    ///
    /// # Errors
    /// [`CommError::Launch`] naming the variable for a value that does not parse, a rank
    /// without a world size (or the reverse), a world size of 0, a rank or local rank not
    /// below the world size, a port of 0, or a missing `MASTER_ADDR` in a world above one.
    pub fn from_vars(var: &dyn Fn(&str) -> Option<String>) -> Result<Option<LaunchEnv>, CommError> {
        let set = |name: &str| var(name).filter(|value| !value.trim().is_empty());
        let Some(launcher) = LAUNCHERS
            .iter()
            .find(|l| set(l.rank).is_some() || set(l.world_size).is_some())
        else {
            return Ok(None);
        };
        let required = |name: &'static str, other: &'static str| {
            set(name).ok_or_else(|| CommError::Launch {
                variable: name,
                problem: format!(
                    "is unset while {other} is set ({} launch); set both or neither",
                    launcher.name
                ),
            })
        };
        let rank = parse_count(
            launcher.rank,
            &required(launcher.rank, launcher.world_size)?,
        )?;
        let world_size = parse_count(
            launcher.world_size,
            &required(launcher.world_size, launcher.rank)?,
        )?;
        if world_size == 0 {
            return Err(CommError::Launch {
                variable: launcher.world_size,
                problem: "is 0; a job has at least one process".into(),
            });
        }
        if rank >= world_size {
            return Err(CommError::Launch {
                variable: launcher.rank,
                problem: format!(
                    "is {rank}, not below the world size {world_size} ({}); every rank must lie in 0..{world_size}",
                    launcher.world_size
                ),
            });
        }
        let local = std::iter::once(launcher.local_rank)
            .chain(LAUNCHERS.iter().map(|l| l.local_rank))
            .find_map(|name| set(name).map(|value| (name, value)));
        let local_rank = match local {
            Some((name, value)) => {
                let local = parse_count(name, &value)?;
                if local >= world_size {
                    return Err(CommError::Launch {
                        variable: name,
                        problem: format!(
                            "is {local}, not below the world size {world_size}; a node runs at most the whole job"
                        ),
                    });
                }
                local
            }
            None if world_size == 1 => 0,
            None => {
                return Err(CommError::Launch {
                    variable: launcher.local_rank,
                    problem: format!(
                        "is unset in a world of {world_size}; set it to this process's gpu on its node"
                    ),
                });
            }
        };
        let master_addr = match set("MASTER_ADDR") {
            Some(addr) => addr.trim().to_owned(),
            None if world_size == 1 => "127.0.0.1".to_owned(),
            None => {
                return Err(CommError::Launch {
                    variable: "MASTER_ADDR",
                    problem: format!(
                        "is unset in a world of {world_size}; set it to the host of rank 0 on every rank"
                    ),
                });
            }
        };
        let master_port = match set("MASTER_PORT") {
            Some(port) => match port.trim().parse::<u16>() {
                Ok(port) if port > 0 => port,
                _ => {
                    return Err(CommError::Launch {
                        variable: "MASTER_PORT",
                        problem: format!(
                            "is {port:?}; set it to a free tcp port between 1 and 65535, the same on every rank"
                        ),
                    });
                }
            },
            None => DEFAULT_MASTER_PORT,
        };
        Ok(Some(LaunchEnv {
            rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
        }))
    }

    /// `MASTER_ADDR:MASTER_PORT`, for messages.
    fn endpoint(&self) -> String {
        format!("{}:{}", self.master_addr, self.master_port)
    }
}

/// A non-negative integer launch variable.
fn parse_count(name: &'static str, value: &str) -> Result<usize, CommError> {
    value
        .trim()
        .parse::<usize>()
        .map_err(|_| CommError::Launch {
            variable: name,
            problem: format!("is {value:?}, not a non-negative integer; fix the launch script"),
        })
}

/// Hands rank 0's communicator id to every rank of `env`'s job and returns it.
///
/// Rank 0 passes `Some(id)` (from `NcclComm::unique_id`), listens on `MASTER_ADDR:MASTER_PORT`
/// and returns once each of the other `world_size - 1` ranks has its copy; the others pass
/// `None` and connect, retrying until rank 0 listens. Everything is bounded by `timeout`.
/// A world of one returns `id` at once.
///
/// # Errors
/// [`CommError::Setup`] for an `id` on the wrong rank; [`CommError::Rendezvous`] when rank 0
/// cannot listen, a peer's handshake carries another world size, a rank outside the world or a
/// rank that already connected (both sides fail), or the connection breaks;
/// [`CommError::RendezvousTimeout`] when the peers or rank 0 do not show up in time.
pub fn exchange_id(
    env: &LaunchEnv,
    id: Option<[u8; ID_BYTES]>,
    timeout: Duration,
) -> Result<[u8; ID_BYTES], CommError> {
    let deadline = Instant::now() + timeout;
    match (env.rank, id) {
        (0, Some(id)) if env.world_size == 1 => Ok(id),
        (0, Some(id)) => serve_id(env, id, deadline, timeout).map(|()| id),
        (0, None) => Err(CommError::Setup(
            "rank 0 must pass its communicator id to exchange_id; create it with NcclComm::unique_id".into(),
        )),
        (_, None) => fetch_id(env, deadline, timeout),
        (rank, Some(_)) => Err(CommError::Setup(format!(
            "rank {rank} passed a communicator id to exchange_id; only rank 0 creates one, the others pass None"
        ))),
    }
}

/// Rank 0: accept every other rank once and send it the id.
fn serve_id(
    env: &LaunchEnv,
    id: [u8; ID_BYTES],
    deadline: Instant,
    timeout: Duration,
) -> Result<(), CommError> {
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
    let mut joined = vec![false; env.world_size];
    joined[0] = true;
    let mut missing = env.world_size - 1;
    while missing > 0 {
        let (mut stream, peer) = match listener.accept() {
            Ok(accepted) => accepted,
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let waiting: Vec<String> = (0..env.world_size)
                        .filter(|&r| !joined[r])
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
        } else if joined[rank] {
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
        let mut reply = Vec::with_capacity(5 + ID_BYTES);
        reply.extend_from_slice(&MAGIC);
        reply.push(ACCEPTED);
        reply.extend_from_slice(&id);
        stream.write_all(&reply).map_err(io)?;
        joined[rank] = true;
        missing -= 1;
        tracing::debug!(rank, %peer, missing, "sent the communicator id");
    }
    Ok(())
}

/// A rank above 0: connect to rank 0 (retrying until `deadline`), introduce itself, read the id.
fn fetch_id(
    env: &LaunchEnv,
    deadline: Instant,
    timeout: Duration,
) -> Result<[u8; ID_BYTES], CommError> {
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
            "the listener is not a miles rank 0; check MASTER_ADDR and MASTER_PORT".into(),
        ));
    }
    match head[4] {
        ACCEPTED => {
            let mut id = [0u8; ID_BYTES];
            stream.read_exact(&mut id).map_err(io)?;
            Ok(id)
        }
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
    use std::collections::HashMap;

    use super::*;

    fn read(vars: &[(&str, &str)]) -> Result<Option<LaunchEnv>, CommError> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        LaunchEnv::from_vars(&|name| map.get(name).cloned())
    }

    fn launch_error(vars: &[(&str, &str)]) -> (&'static str, String) {
        match read(vars) {
            Err(CommError::Launch { variable, problem }) => (variable, problem),
            other => panic!("{vars:?} gave {other:?}, want a launch error"),
        }
    }

    /// A port that was free a moment ago.
    fn free_port() -> u16 {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    }

    fn local(rank: usize, world_size: usize, port: u16) -> LaunchEnv {
        LaunchEnv {
            rank,
            world_size,
            local_rank: rank,
            master_addr: "127.0.0.1".into(),
            master_port: port,
        }
    }

    fn seeded_id(seed: u8) -> [u8; ID_BYTES] {
        std::array::from_fn(|i| (i as u8).wrapping_mul(37).wrapping_add(seed))
    }

    #[test]
    fn no_launcher_variables_mean_a_single_process() {
        assert_eq!(read(&[]).unwrap(), None);
        assert_eq!(read(&[("MASTER_ADDR", "10.0.0.1")]).unwrap(), None);
    }

    #[test]
    fn torchrun_variables_give_the_whole_layout() {
        let env = read(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "3"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29611"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            env,
            LaunchEnv {
                rank: 3,
                world_size: 8,
                local_rank: 3,
                master_addr: "node0".into(),
                master_port: 29611,
            }
        );
    }

    #[test]
    fn slurm_and_open_mpi_fill_in_rank_size_and_local_rank() {
        let slurm = read(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_LOCALID", "1"),
            ("MASTER_ADDR", "head"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((slurm.rank, slurm.world_size, slurm.local_rank), (5, 16, 1));
        assert_eq!(slurm.master_port, DEFAULT_MASTER_PORT);
        let mpi = read(&[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "2"),
            ("MASTER_ADDR", "head"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((mpi.rank, mpi.world_size, mpi.local_rank), (2, 4, 2));
    }

    #[test]
    fn torchrun_variables_win_over_slurm_and_borrow_its_local_rank() {
        let env = read(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("SLURM_PROCID", "7"),
            ("SLURM_NTASKS", "9"),
            ("SLURM_LOCALID", "1"),
            ("MASTER_ADDR", "head"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((env.rank, env.world_size, env.local_rank), (1, 2, 1));
    }

    #[test]
    fn a_world_of_one_needs_no_master_address() {
        let env = read(&[("RANK", "0"), ("WORLD_SIZE", "1")])
            .unwrap()
            .unwrap();
        assert_eq!(env.master_addr, "127.0.0.1");
        assert_eq!(env.local_rank, 0);
    }

    #[test]
    fn bad_values_name_their_variable_and_the_fix() {
        let base = [("MASTER_ADDR", "head"), ("LOCAL_RANK", "0")];
        let with = |extra: &[(&'static str, &'static str)]| {
            let mut vars = base.to_vec();
            vars.extend_from_slice(extra);
            launch_error(&vars)
        };
        let (variable, problem) = with(&[("RANK", "4"), ("WORLD_SIZE", "4")]);
        assert_eq!(variable, "RANK");
        assert!(problem.contains("not below the world size 4"), "{problem}");
        assert_eq!(with(&[("RANK", "one"), ("WORLD_SIZE", "4")]).0, "RANK");
        assert_eq!(with(&[("RANK", "0"), ("WORLD_SIZE", "-2")]).0, "WORLD_SIZE");
        assert_eq!(with(&[("RANK", "0"), ("WORLD_SIZE", "0")]).0, "WORLD_SIZE");
        assert_eq!(with(&[("RANK", "0")]).0, "WORLD_SIZE");
        assert_eq!(with(&[("WORLD_SIZE", "2")]).0, "RANK");
        let (variable, _) = with(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "x")]);
        assert_eq!(variable, "MASTER_PORT");
        assert_eq!(
            with(&[
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "2"),
                ("SLURM_LOCALID", "2")
            ])
            .0,
            "SLURM_LOCALID"
        );
    }

    #[test]
    fn a_world_above_one_without_master_addr_says_to_set_it() {
        let (variable, problem) =
            launch_error(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1")]);
        assert_eq!(variable, "MASTER_ADDR");
        assert!(problem.contains("set it"), "{problem}");
        let (variable, _) = launch_error(&[("RANK", "1"), ("WORLD_SIZE", "2")]);
        assert_eq!(variable, "LOCAL_RANK");
    }

    #[test]
    fn every_rank_gets_the_id_of_rank_0() {
        let port = free_port();
        let world = 4;
        let id = seeded_id(11);
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                std::thread::spawn(move || {
                    let mine = (rank == 0).then_some(id);
                    exchange_id(&local(rank, world, port), mine, Duration::from_secs(20))
                })
            })
            .collect();
        for (rank, handle) in handles.into_iter().enumerate() {
            let got = handle.join().unwrap().unwrap();
            assert_eq!(got, id, "rank {rank} got another id");
        }
    }

    #[test]
    fn a_world_of_one_returns_its_own_id_without_listening() {
        let id = seeded_id(3);
        let got = exchange_id(&local(0, 1, 1), Some(id), Duration::from_millis(10)).unwrap();
        assert_eq!(got, id);
    }

    #[test]
    fn a_handshake_with_another_world_size_fails_on_both_sides() {
        let port = free_port();
        let server = std::thread::spawn(move || {
            exchange_id(
                &local(0, 2, port),
                Some(seeded_id(5)),
                Duration::from_secs(20),
            )
        });
        let client = exchange_id(&local(1, 3, port), None, Duration::from_secs(20));
        let served = server.join().unwrap();
        for (side, result) in [
            ("rank 1", client),
            ("rank 0", served.map(|_| [0; ID_BYTES])),
        ] {
            match result {
                Err(CommError::Rendezvous { problem, .. }) => {
                    assert!(problem.contains("3 ranks"), "{side}: {problem}");
                    assert!(problem.contains("same world size"), "{side}: {problem}");
                }
                other => panic!("{side} gave {other:?}, want a rendezvous error"),
            }
        }
    }

    #[test]
    fn a_rank_that_connects_twice_is_refused() {
        let port = free_port();
        let server = std::thread::spawn(move || {
            exchange_id(
                &local(0, 3, port),
                Some(seeded_id(9)),
                Duration::from_secs(20),
            )
        });
        let first = exchange_id(&local(1, 3, port), None, Duration::from_secs(20)).unwrap();
        assert_eq!(first, seeded_id(9));
        let second = exchange_id(&local(1, 3, port), None, Duration::from_secs(20));
        assert!(
            matches!(&second, Err(CommError::Rendezvous { problem, .. }) if problem.contains("connected twice")),
            "{second:?}"
        );
        assert!(matches!(
            server.join().unwrap(),
            Err(CommError::Rendezvous { .. })
        ));
    }

    #[test]
    fn a_rank_without_rank_0_times_out_with_a_clear_error() {
        let port = free_port();
        let result = exchange_id(&local(2, 3, port), None, Duration::from_millis(300));
        match result {
            Err(error @ CommError::RendezvousTimeout { .. }) => {
                let text = error.to_string();
                assert!(text.contains("rank 0 to listen"), "{text}");
                assert!(text.contains(&port.to_string()), "{text}");
            }
            other => panic!("want a timeout, got {other:?}"),
        }
    }

    #[test]
    fn rank_0_without_its_peers_times_out_naming_them() {
        let port = free_port();
        let result = exchange_id(
            &local(0, 3, port),
            Some(seeded_id(1)),
            Duration::from_millis(300),
        );
        match result {
            Err(error @ CommError::RendezvousTimeout { .. }) => {
                assert!(error.to_string().contains("ranks 1, 2"), "{error}");
            }
            other => panic!("want a timeout, got {other:?}"),
        }
    }

    #[test]
    fn an_id_on_the_wrong_rank_is_refused() {
        let port = free_port();
        assert!(matches!(
            exchange_id(&local(0, 2, port), None, Duration::from_millis(10)),
            Err(CommError::Setup(_))
        ));
        assert!(matches!(
            exchange_id(
                &local(1, 2, port),
                Some(seeded_id(0)),
                Duration::from_millis(10)
            ),
            Err(CommError::Setup(_))
        ));
    }
}
