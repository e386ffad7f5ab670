//! The in-process communicator: ranks are threads sharing one rendezvous per group.
//!
//! Every collective is one round of a rendezvous: each rank deposits a copy of its input, the
//! last to arrive seals the round, and every rank reads all inputs from the sealed round and
//! computes its own result. Sums run over the ranks in rank order, so every rank gets the same
//! bits whatever order the threads arrived in.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::{CommError, Communicator};

/// How long a rank waits for its peers by default before [`CommError::Timeout`].
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// One rank's input to a round.
#[derive(Debug)]
struct Contribution {
    op: &'static str,
    data: Vec<f32>,
    /// The element count the op is checked on (the send length).
    len: usize,
    root: usize,
    color: usize,
    key: usize,
}

/// A sealed round: every rank's input, and for a split, each rank's new group and rank.
#[derive(Debug)]
struct Round {
    inputs: Vec<Contribution>,
    split: Vec<Option<(Arc<Group>, usize)>>,
}

#[derive(Debug)]
struct State {
    generation: u64,
    pending: Vec<Option<Contribution>>,
    arrived: usize,
    last: Option<Arc<Round>>,
    departed: Vec<bool>,
}

#[derive(Debug)]
struct Group {
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
    ready: Condvar,
}

impl Group {
    fn new(world: usize, timeout: Duration) -> Arc<Group> {
        Arc::new(Group {
            world,
            timeout,
            state: Mutex::new(State {
                generation: 0,
                pending: (0..world).map(|_| None).collect(),
                arrived: 0,
                last: None,
                departed: vec![false; world],
            }),
            ready: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Round {
    fn seal(inputs: Vec<Contribution>, timeout: Duration) -> Round {
        let mut split: Vec<Option<(Arc<Group>, usize)>> = inputs.iter().map(|_| None).collect();
        if inputs.iter().all(|c| c.op == "split") {
            let mut colors: Vec<usize> = inputs.iter().map(|c| c.color).collect();
            colors.sort_unstable();
            colors.dedup();
            for color in colors {
                let mut members: Vec<usize> = (0..inputs.len())
                    .filter(|&r| inputs[r].color == color)
                    .collect();
                members.sort_by_key(|&r| (inputs[r].key, r));
                let group = Group::new(members.len(), timeout);
                for (new_rank, &r) in members.iter().enumerate() {
                    split[r] = Some((Arc::clone(&group), new_rank));
                }
            }
        }
        Round { inputs, split }
    }
}

/// One rank of a group whose ranks are threads of this process.
///
/// Build a world with [`LocalComm::world`] and move one handle into each rank's thread.
/// Dropping a handle tells the peers that this rank left, so a rank that fails does not leave
/// the others waiting forever: their next collective returns [`CommError::PeerGone`].
#[derive(Debug)]
pub struct LocalComm {
    group: Arc<Group>,
    rank: usize,
}

impl LocalComm {
    /// The handles of a world of `world_size` ranks, rank 0 first.
    ///
    /// # Errors
    /// [`CommError::Setup`] for an empty world.
    pub fn world(world_size: usize) -> Result<Vec<LocalComm>, CommError> {
        LocalComm::world_with_timeout(world_size, DEFAULT_TIMEOUT)
    }

    /// As [`world`](Self::world), with how long a rank waits for its peers in one collective.
    ///
    /// # Errors
    /// [`CommError::Setup`] for an empty world or a zero timeout.
    pub fn world_with_timeout(
        world_size: usize,
        timeout: Duration,
    ) -> Result<Vec<LocalComm>, CommError> {
        if world_size == 0 {
            return Err(CommError::Setup(
                "a world needs at least one rank".to_string(),
            ));
        }
        if timeout.is_zero() {
            return Err(CommError::Setup(
                "the collective timeout must be positive".to_string(),
            ));
        }
        let group = Group::new(world_size, timeout);
        Ok((0..world_size)
            .map(|rank| LocalComm {
                group: Arc::clone(&group),
                rank,
            })
            .collect())
    }

    /// Deposits `input`, waits for the round to be sealed, and checks that the ranks agree.
    fn exchange(&self, input: Contribution) -> Result<Arc<Round>, CommError> {
        let group = &self.group;
        let op = input.op;
        let mut state = group.lock();
        let generation = state.generation;
        state.pending[self.rank] = Some(input);
        state.arrived += 1;
        let round = if state.arrived == group.world {
            let inputs: Vec<Contribution> =
                state.pending.iter_mut().filter_map(Option::take).collect();
            let round = Arc::new(Round::seal(inputs, group.timeout));
            state.last = Some(Arc::clone(&round));
            state.arrived = 0;
            state.generation += 1;
            group.ready.notify_all();
            round
        } else {
            let deadline = Instant::now() + group.timeout;
            loop {
                if state.generation != generation
                    && let Some(round) = &state.last
                {
                    break Arc::clone(round);
                }
                if let Some(peer) = state.departed.iter().position(|&gone| gone) {
                    return Err(CommError::PeerGone {
                        op,
                        rank: self.rank,
                        peer,
                    });
                }
                let now = Instant::now();
                if now >= deadline {
                    return Err(CommError::Timeout {
                        op,
                        rank: self.rank,
                        seconds: group.timeout.as_secs(),
                    });
                }
                state = group
                    .ready
                    .wait_timeout(state, deadline - now)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
        };
        drop(state);
        self.check_agreement(&round)?;
        Ok(round)
    }

    fn check_agreement(&self, round: &Round) -> Result<(), CommError> {
        let mine = &round.inputs[self.rank];
        let differs =
            |c: &Contribution| c.op != mine.op || c.len != mine.len || c.root != mine.root;
        match round.inputs.iter().position(differs) {
            None => Ok(()),
            Some(other_rank) => {
                let other = &round.inputs[other_rank];
                Err(CommError::Mismatch {
                    rank: self.rank,
                    op: mine.op,
                    len: mine.len,
                    other_rank,
                    other_op: other.op,
                    other_len: other.len,
                })
            }
        }
    }

    fn contribution(op: &'static str, data: &[f32]) -> Contribution {
        Contribution {
            op,
            data: data.to_vec(),
            len: data.len(),
            root: 0,
            color: 0,
            key: 0,
        }
    }

    /// Writes the rank-ordered sum of `inputs[..].data[range]` into `out`.
    fn sum_into(out: &mut [f32], inputs: &[Contribution], start: usize) {
        let end = start + out.len();
        out.copy_from_slice(&inputs[0].data[start..end]);
        for input in &inputs[1..] {
            for (o, x) in out.iter_mut().zip(&input.data[start..end]) {
                *o += x;
            }
        }
    }
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.group.world
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CommError> {
        let round = self.exchange(LocalComm::contribution("all_reduce_sum", buf))?;
        LocalComm::sum_into(buf, &round.inputs, 0);
        Ok(())
    }

    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        let world = self.group.world;
        if recv.len() != send.len() * world {
            return Err(CommError::BadLength {
                op: "all_gather",
                rank: self.rank,
                what: format!(
                    "recv has {} elements, {world} ranks x send {} need {}",
                    recv.len(),
                    send.len(),
                    send.len() * world
                ),
            });
        }
        let round = self.exchange(LocalComm::contribution("all_gather", send))?;
        for (block, input) in recv.chunks_exact_mut(send.len().max(1)).zip(&round.inputs) {
            block.copy_from_slice(&input.data);
        }
        Ok(())
    }

    fn reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        let world = self.group.world;
        if send.len() != recv.len() * world {
            return Err(CommError::BadLength {
                op: "reduce_scatter_sum",
                rank: self.rank,
                what: format!(
                    "send has {} elements, {world} ranks x recv {} need {}",
                    send.len(),
                    recv.len(),
                    recv.len() * world
                ),
            });
        }
        let round = self.exchange(LocalComm::contribution("reduce_scatter_sum", send))?;
        LocalComm::sum_into(recv, &round.inputs, self.rank * recv.len());
        Ok(())
    }

    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        let world = self.group.world;
        if root >= world {
            return Err(CommError::BadRoot {
                op: "broadcast",
                root,
                world,
            });
        }
        let data = if self.rank == root {
            buf.to_vec()
        } else {
            Vec::new()
        };
        let round = self.exchange(Contribution {
            op: "broadcast",
            data,
            len: buf.len(),
            root,
            color: 0,
            key: 0,
        })?;
        buf.copy_from_slice(&round.inputs[root].data);
        Ok(())
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.exchange(LocalComm::contribution("barrier", &[]))
            .map(drop)
    }

    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Communicator>, CommError> {
        let round = self.exchange(Contribution {
            op: "split",
            data: Vec::new(),
            len: 0,
            root: 0,
            color,
            key,
        })?;
        match &round.split[self.rank] {
            Some((group, rank)) => Ok(Box::new(LocalComm {
                group: Arc::clone(group),
                rank: *rank,
            })),
            None => Err(CommError::Setup(format!(
                "rank {} found no group of color {color} after a split",
                self.rank
            ))),
        }
    }
}

impl Drop for LocalComm {
    fn drop(&mut self) {
        let mut state = self.group.lock();
        state.departed[self.rank] = true;
        self.group.ready.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use std::thread;

    use rand::{RngExt, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;

    /// Runs `f` on every rank of a world of `n` in its own thread; results in rank order.
    fn on_ranks<T: Send + 'static>(
        n: usize,
        f: impl Fn(LocalComm) -> T + Send + Sync + Clone + 'static,
    ) -> Vec<T> {
        let comms = LocalComm::world(n).unwrap();
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let f = f.clone();
                thread::spawn(move || f(comm))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    fn seeded(seed: u64, len: usize) -> Vec<f32> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    #[test]
    fn all_reduce_gives_every_rank_the_rank_ordered_sum_bit_for_bit() {
        let n = 4;
        let len = 1000;
        let mut expected = seeded(0, len);
        for r in 1..n {
            for (e, x) in expected.iter_mut().zip(seeded(r as u64, len)) {
                *e += x;
            }
        }
        for _ in 0..3 {
            let results = on_ranks(n, move |comm| {
                let mut buf = seeded(comm.rank() as u64, len);
                comm.all_reduce_sum(&mut buf).unwrap();
                buf
            });
            for buf in results {
                assert!(
                    buf.iter()
                        .zip(&expected)
                        .all(|(a, b)| a.to_bits() == b.to_bits())
                );
            }
        }
    }

    #[test]
    fn all_gather_concatenates_in_rank_order() {
        let results = on_ranks(3, |comm| {
            let send = seeded(10 + comm.rank() as u64, 5);
            let mut recv = vec![0.0; 15];
            comm.all_gather(&send, &mut recv).unwrap();
            recv
        });
        let expected: Vec<f32> = (0..3).flat_map(|r| seeded(10 + r, 5)).collect();
        for recv in results {
            assert_eq!(recv, expected);
        }
    }

    #[test]
    fn reduce_scatter_leaves_each_rank_its_block_of_the_sum() {
        let n = 4;
        let block = 7;
        let results = on_ranks(n, move |comm| {
            let send = seeded(20 + comm.rank() as u64, n * block);
            let mut recv = vec![0.0; block];
            comm.reduce_scatter_sum(&send, &mut recv).unwrap();
            recv
        });
        let mut sum = seeded(20, n * block);
        for r in 1..n {
            for (s, x) in sum.iter_mut().zip(seeded(20 + r as u64, n * block)) {
                *s += x;
            }
        }
        for (rank, recv) in results.iter().enumerate() {
            assert_eq!(recv[..], sum[rank * block..(rank + 1) * block]);
        }
    }

    #[test]
    fn broadcast_copies_the_root_buffer_everywhere() {
        let results = on_ranks(3, |comm| {
            let mut buf = seeded(30 + comm.rank() as u64, 9);
            comm.broadcast(&mut buf, 2).unwrap();
            comm.barrier().unwrap();
            buf
        });
        for buf in results {
            assert_eq!(buf, seeded(32, 9));
        }
    }

    #[test]
    fn split_builds_tensor_and_data_parallel_groups() {
        // 4 ranks as TP=2 x DP=2: rank = dp * 2 + tp.
        let results = on_ranks(4, |comm| {
            let (tp, dp) = (comm.rank() % 2, comm.rank() / 2);
            let tp_group = comm.split(dp, tp).unwrap();
            let dp_group = comm.split(tp, dp).unwrap();
            let mut tp_sum = [comm.rank() as f32 + 1.0];
            tp_group.all_reduce_sum(&mut tp_sum).unwrap();
            let mut dp_sum = [comm.rank() as f32 + 1.0];
            dp_group.all_reduce_sum(&mut dp_sum).unwrap();
            (
                tp_group.rank(),
                tp_group.world_size(),
                dp_group.rank(),
                tp_sum[0],
                dp_sum[0],
            )
        });
        assert_eq!(results[0], (0, 2, 0, 3.0, 4.0));
        assert_eq!(results[1], (1, 2, 0, 3.0, 6.0));
        assert_eq!(results[2], (0, 2, 1, 7.0, 4.0));
        assert_eq!(results[3], (1, 2, 1, 7.0, 6.0));
    }

    #[test]
    fn ranks_calling_different_collectives_get_a_mismatch_error() {
        let results = on_ranks(2, |comm| {
            let mut buf = seeded(40, 4);
            if comm.rank() == 0 {
                comm.all_reduce_sum(&mut buf).err()
            } else {
                comm.broadcast(&mut buf, 0).err()
            }
        });
        for err in results {
            let err = err.unwrap();
            assert!(matches!(err, CommError::Mismatch { .. }), "{err}");
        }
    }

    #[test]
    fn a_rank_that_leaves_fails_its_waiting_peers_instead_of_hanging() {
        let results = on_ranks(2, |comm| {
            if comm.rank() == 1 {
                drop(comm);
                return None;
            }
            comm.barrier().err()
        });
        let err = results[0].as_ref().unwrap();
        assert!(matches!(err, CommError::PeerGone { peer: 1, .. }), "{err}");
    }

    #[test]
    fn wrong_lengths_and_roots_are_errors_before_any_exchange() {
        let comm = LocalComm::world(1).unwrap().pop().unwrap();
        let err = comm.all_gather(&[1.0, 2.0], &mut [0.0; 3]).unwrap_err();
        assert!(matches!(err, CommError::BadLength { .. }), "{err}");
        let err = comm
            .reduce_scatter_sum(&[1.0; 3], &mut [0.0; 2])
            .unwrap_err();
        assert!(matches!(err, CommError::BadLength { .. }), "{err}");
        let err = comm.broadcast(&mut [1.0], 1).unwrap_err();
        assert!(matches!(err, CommError::BadRoot { .. }), "{err}");
        assert!(LocalComm::world(0).is_err());
    }
}
