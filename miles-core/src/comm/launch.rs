//! Multi-process launch: where this process stands in the job, read from the variables that the
//! usual launchers set (torchrun, Slurm's `srun`, Open MPI's `mpirun`), and the hand-out of the
//! communicator's 128-byte id from rank 0 to every other rank over the job's [`HostGroup`].
//!
//! One process drives one GPU; the id then opens the NCCL communicator on every rank.
//!
//! A job of several processes carries a secret ([`SECRET_VAR`]): every rank presents it to rank 0
//! when it joins, so that a process that can reach rank 0's port but was not given the secret
//! cannot claim a rank. `miles ... --nproc-per-node N` generates one per job; under torchrun,
//! srun or mpirun the user sets the same value on every rank.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use super::{CommError, HostGroup};

pub use crate::device::ID_BYTES;

/// The port rank 0 listens on when `MASTER_PORT` is unset (torchrun's default).
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// The variable that holds the job's secret: the same value, at least [`MIN_SECRET_LEN`]
/// characters, on every rank of a job of several processes.
pub const SECRET_VAR: &str = "MILES_JOB_SECRET";

/// The variable naming a file through which rank 0 publishes the port it bound (any free one);
/// set by `--nproc-per-node`, which then sets no `MASTER_PORT`.
pub const PORT_FILE_VAR: &str = "MILES_PORT_FILE";

/// The shortest secret accepted, in characters.
pub const MIN_SECRET_LEN: usize = 16;

/// The longest secret accepted, in bytes (it travels in the handshake).
pub const MAX_SECRET_LEN: usize = 256;

/// A job's secret; never printed.
#[derive(Clone, Default)]
pub struct JobSecret(String);

impl JobSecret {
    /// A secret from its text.
    pub fn new(text: impl Into<String>) -> JobSecret {
        JobSecret(text.into())
    }

    /// Its bytes, as the handshake carries them.
    pub fn as_bytes(&self) -> &[u8] {
        self.0.as_bytes()
    }

    /// Whether `bytes` are this secret, compared in time independent of where they differ.
    pub fn matches(&self, bytes: &[u8]) -> bool {
        let own = self.0.as_bytes();
        own.len() == bytes.len()
            && own.iter().zip(bytes).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }
}

impl PartialEq for JobSecret {
    fn eq(&self, other: &JobSecret) -> bool {
        self.matches(other.as_bytes())
    }
}

impl Eq for JobSecret {}

impl fmt::Debug for JobSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JobSecret(..)")
    }
}

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
    /// The port rank 0 listens on (0 with [`port_file`](Self::port_file): any free one).
    pub master_port: u16,
    /// The job's secret ([`SECRET_VAR`]); empty in a world of one.
    pub secret: JobSecret,
    /// Where rank 0 publishes the port it bound and the other ranks read it ([`PORT_FILE_VAR`]),
    /// instead of a fixed `MASTER_PORT`.
    pub port_file: Option<PathBuf>,
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
    /// and `MASTER_PORT` (default [`DEFAULT_MASTER_PORT`], or the port rank 0 publishes in
    /// [`PORT_FILE_VAR`]'s file when that is set); the job's secret from [`SECRET_VAR`]. `None`
    /// when no launcher variable is set: a single process. A world of one needs no
    /// `MASTER_ADDR` (it defaults to `127.0.0.1`) and no secret.
    ///
    /// # Errors
    /// [`CommError::Launch`] naming the variable for a value that does not parse, a rank
    /// without a world size (or the reverse), a world size of 0, a rank or local rank not
    /// below the world size, a port of 0, a missing `MASTER_ADDR` in a world above one, or a
    /// secret missing, shorter than [`MIN_SECRET_LEN`] or longer than [`MAX_SECRET_LEN`] in a
    /// world above one.
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
        let port_file = set(PORT_FILE_VAR).map(PathBuf::from);
        let master_port = match set("MASTER_PORT") {
            _ if port_file.is_some() => 0,
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
        let secret = match var(SECRET_VAR) {
            _ if world_size == 1 => JobSecret::default(),
            Some(text) => check_secret(text)?,
            None => {
                return Err(CommError::Launch {
                    variable: SECRET_VAR,
                    problem: format!(
                        "is unset in a world of {world_size}; set it to the same random value on every rank (for example `export {SECRET_VAR}=$(openssl rand -hex 32)` before the launcher)"
                    ),
                });
            }
        };
        Ok(Some(LaunchEnv {
            rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
            secret,
            port_file,
        }))
    }

    /// `MASTER_ADDR:MASTER_PORT`, for messages.
    pub(super) fn endpoint(&self) -> String {
        match (&self.port_file, self.master_port) {
            (Some(file), 0) => format!("{}:(port in {})", self.master_addr, file.display()),
            _ => format!("{}:{}", self.master_addr, self.master_port),
        }
    }
}

/// The secret of [`SECRET_VAR`], if long enough and short enough.
fn check_secret(text: String) -> Result<JobSecret, CommError> {
    let chars = text.chars().count();
    if chars < MIN_SECRET_LEN || text.len() > MAX_SECRET_LEN {
        return Err(CommError::Launch {
            variable: SECRET_VAR,
            problem: format!(
                "holds {chars} characters; use {MIN_SECRET_LEN} to {MAX_SECRET_LEN} random ones, the same on every rank (for example `openssl rand -hex 32`)"
            ),
        });
    }
    Ok(JobSecret::new(text))
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
/// Rank 0 passes `Some(id)` (from `NcclComm::unique_id`), the others `None`; every rank joins
/// the job's [`HostGroup`] (bounded by `timeout`) and rank 0 broadcasts the id over it. A world
/// of one returns `id` at once.
///
/// # Errors
/// [`CommError::Setup`] for an `id` on the wrong rank; as [`HostGroup::connect`] and
/// [`HostGroup::broadcast`].
pub fn exchange_id(
    env: &LaunchEnv,
    id: Option<[u8; ID_BYTES]>,
    timeout: Duration,
) -> Result<[u8; ID_BYTES], CommError> {
    match (env.rank, id) {
        (0, Some(id)) if env.world_size == 1 => return Ok(id),
        (0, None) => {
            return Err(CommError::Setup(
                "rank 0 must pass its communicator id to exchange_id; create it with NcclComm::unique_id".into(),
            ));
        }
        (rank, Some(_)) if rank != 0 => {
            return Err(CommError::Setup(format!(
                "rank {rank} passed a communicator id to exchange_id; only rank 0 creates one, the others pass None"
            )));
        }
        _ => {}
    }
    let mut group = HostGroup::connect(env, timeout)?;
    group.set_timeout(timeout)?;
    let mut bytes = id.map_or_else(Vec::new, |id| id.to_vec());
    group.broadcast(&mut bytes)?;
    let len = bytes.len();
    bytes.try_into().map_err(|_| CommError::BadLength {
        op: "broadcast",
        rank: env.rank,
        what: format!("rank 0 sent a communicator id of {len} bytes, not {ID_BYTES}"),
    })
}

#[cfg(test)]
#[allow(clippy::panic)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::comm::testing::{LocalJob, SECRET, free_port, local};

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
            (SECRET_VAR, SECRET),
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
                secret: JobSecret::new(SECRET),
                port_file: None,
            }
        );
    }

    #[test]
    fn a_world_above_one_needs_a_long_enough_secret() {
        let layout = [
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "head"),
        ];
        let (variable, problem) = launch_error(&layout);
        assert_eq!(variable, SECRET_VAR);
        assert!(problem.contains("same random value"), "{problem}");
        let mut short = layout.to_vec();
        short.push((SECRET_VAR, "0123456789"));
        let (variable, problem) = launch_error(&short);
        assert_eq!(variable, SECRET_VAR);
        assert!(problem.contains("10 characters"), "{problem}");
        assert_eq!(
            read(&[("RANK", "0"), ("WORLD_SIZE", "1")])
                .unwrap()
                .unwrap()
                .secret,
            JobSecret::default(),
            "a world of one needs none"
        );
    }

    #[test]
    fn a_secret_never_shows_in_debug_output() {
        let env = local(1, 2, 29500);
        let shown = format!("{env:?}");
        assert!(!shown.contains(SECRET), "{shown}");
        assert!(env.secret.matches(SECRET.as_bytes()));
        assert!(!env.secret.matches(b"a-test-secret-of-the-rendezvouS"));
    }

    #[test]
    fn a_port_file_replaces_master_port_and_every_rank_meets_through_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("port");
        let world = 3;
        let id = seeded_id(21);
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let env = LaunchEnv {
                    master_port: 0,
                    port_file: Some(file.clone()),
                    ..local(rank, world, 0)
                };
                std::thread::spawn(move || {
                    exchange_id(&env, (rank == 0).then_some(id), Duration::from_secs(20))
                })
            })
            .collect();
        for handle in handles {
            assert_eq!(handle.join().unwrap().unwrap(), id);
        }
        let published: u16 = std::fs::read_to_string(&file)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(published > 0);
        let env = read(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29611"),
            (SECRET_VAR, SECRET),
            (PORT_FILE_VAR, "/run/port"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(env.master_port, 0, "the port file wins over MASTER_PORT");
    }

    #[test]
    fn slurm_and_open_mpi_fill_in_rank_size_and_local_rank() {
        let slurm = read(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_LOCALID", "1"),
            ("MASTER_ADDR", "head"),
            (SECRET_VAR, SECRET),
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
            (SECRET_VAR, SECRET),
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
            (SECRET_VAR, SECRET),
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
        let base = [
            ("MASTER_ADDR", "head"),
            ("LOCAL_RANK", "0"),
            (SECRET_VAR, SECRET),
        ];
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
        let job = LocalJob::new();
        let world = 4;
        let id = seeded_id(11);
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let env = job.rank(rank, world);
                std::thread::spawn(move || {
                    let mine = (rank == 0).then_some(id);
                    exchange_id(&env, mine, Duration::from_secs(20))
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
        let job = LocalJob::new();
        let env = job.rank(0, 2);
        let server = std::thread::spawn(move || {
            exchange_id(&env, Some(seeded_id(5)), Duration::from_secs(20))
        });
        let client = exchange_id(&job.rank(1, 3), None, Duration::from_secs(20));
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
        let job = LocalJob::new();
        let env = job.rank(0, 3);
        let server = std::thread::spawn(move || {
            exchange_id(&env, Some(seeded_id(9)), Duration::from_secs(20))
        });
        // Two connections as rank 1: whichever rank 0 accepts second is refused, and rank 0
        // gives up, so the other fails too.
        let twins: Vec<_> = (0..2)
            .map(|_| {
                let env = job.rank(1, 3);
                std::thread::spawn(move || exchange_id(&env, None, Duration::from_secs(20)))
            })
            .collect();
        let results: Vec<_> = twins.into_iter().map(|t| t.join().unwrap()).collect();
        let twice = |r: &Result<_, CommError>| matches!(r, Err(CommError::Rendezvous { problem, .. }) if problem.contains("connected twice"));
        assert!(
            results.iter().filter(|r| twice(r)).count() == 1 && results.iter().all(Result::is_err),
            "{results:?}"
        );
        assert!(matches!(
            server.join().unwrap(),
            Err(CommError::Rendezvous { .. })
        ));
    }

    #[test]
    fn a_rank_without_rank_0_times_out_with_a_clear_error() {
        let port = free_port();
        // A secret of its own: should another test's rank 0 take the port, this rank is not
        // one of its job.
        let env = LaunchEnv {
            secret: JobSecret::new("a-secret-of-the-rank-without-its-rank-0"),
            ..local(2, 3, port)
        };
        let result = exchange_id(&env, None, Duration::from_millis(300));
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
        let job = LocalJob::new();
        let result = exchange_id(
            &job.rank(0, 3),
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
