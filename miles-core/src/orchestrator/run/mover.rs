//! The actor behind a lock, so that its offload and onload can run on a thread of their own
//! while the loop goes on with the engine: the trainer's state leaves the device while the
//! engine's weights come in, and comes back while the rollout runs. Any other use of the actor
//! waits for the move in flight and fails with its error.
//!
//! An onload that finds too little free device memory (another process took it) waits and
//! tries again ([`Patience`]); the backend's resume is all or nothing, so every tag stays paused
//! with its backup meanwhile, and after the last attempt the error names the bytes missing.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crate::backend::{BackendError, OffloadStats, TrainBackend};
use crate::memory::{MemoryError, MemoryTag};
use crate::metrics::Phase;
use crate::model::ModelError;
use crate::orchestrator::OrchestratorError;

/// How long an onload waits for device memory: `retries` more attempts, `wait` apart
/// (`--train-resume-retries`, `--train-resume-wait-seconds`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Patience {
    /// Attempts after the first.
    pub retries: u64,
    /// Time between attempts.
    pub wait: Duration,
}

/// Onloads `backend`, trying again while the device lacks the memory.
///
/// # Errors
/// [`OrchestratorError::NoMemoryToResume`] once the attempts are spent; the backend's other
/// errors at once.
fn onload_patiently(
    backend: &mut dyn TrainBackend,
    patience: Patience,
) -> Result<OffloadStats, OrchestratorError> {
    let started = Instant::now();
    let mut attempt = 0;
    loop {
        let error = match backend.onload() {
            Ok(stats) => return Ok(stats),
            Err(error) => error,
        };
        let Some((tag, missing, margin)) = missing_memory(&error) else {
            return Err(OrchestratorError::train("actor", "onload")(error));
        };
        if attempt == patience.retries {
            return Err(OrchestratorError::NoMemoryToResume {
                tag,
                missing,
                margin,
                attempts: attempt + 1,
                seconds: started.elapsed().as_secs_f64(),
            });
        }
        attempt += 1;
        tracing::warn!(
            %tag,
            missing,
            margin,
            attempt,
            of = patience.retries,
            "the trainer cannot resume for lack of device memory; its tags stay paused with their backups, trying again after {:?}",
            patience.wait
        );
        thread::sleep(patience.wait);
    }
}

/// The tag, the bytes missing and the margin of an onload refused for lack of free memory.
fn missing_memory(error: &BackendError) -> Option<(MemoryTag, u64, u64)> {
    let memory = match error {
        BackendError::Memory(memory) | BackendError::Model(ModelError::Memory(memory)) => memory,
        _ => return None,
    };
    match memory {
        MemoryError::InsufficientMemory {
            tag,
            need,
            free,
            margin,
        } => Some((tag.clone(), (need + margin).saturating_sub(*free), *margin)),
        _ => None,
    }
}

/// A move that ran on the mover's thread: [`Phase::OffloadTrain`] or [`Phase::OnloadTrain`],
/// its bytes, when it started and its own seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Moved {
    pub phase: Phase,
    pub bytes: u64,
    pub started: Instant,
    pub seconds: f64,
}

type MoveThread = JoinHandle<Result<Vec<Moved>, OrchestratorError>>;

/// The actor's backend and the moves of its state in flight.
pub(super) struct Actor {
    backend: Arc<Mutex<Box<dyn TrainBackend>>>,
    name: &'static str,
    /// How long an onload waits for device memory.
    patience: Patience,
    /// The moves started and not yet waited for, in order (each thread waits for the one before).
    moving: Option<MoveThread>,
    /// Moves finished by a [`get`](Self::get), for the next [`wait`](Self::wait) to return.
    done: Vec<Moved>,
    /// Where the moves in flight leave the state: offloaded or not.
    offloaded_after: Option<bool>,
    /// The backend's device memory when last read without waiting.
    memory: Vec<(MemoryTag, u64)>,
}

impl Actor {
    pub(super) fn new(backend: Box<dyn TrainBackend>, patience: Patience) -> Actor {
        let (memory, name) = (backend.device_memory(), backend.name());
        Actor {
            backend: Arc::new(Mutex::new(backend)),
            name,
            patience,
            moving: None,
            done: Vec::new(),
            offloaded_after: None,
            memory,
        }
    }

    /// The backend, once the moves in flight are done.
    ///
    /// # Errors
    /// The first failed move's error (the backend documents the state a failed move leaves).
    pub(super) fn get(
        &mut self,
    ) -> Result<MutexGuard<'_, Box<dyn TrainBackend>>, OrchestratorError> {
        self.finish()?;
        Ok(lock(&self.backend))
    }

    /// Waits for the moves in flight; returns the moves finished since the last call.
    ///
    /// # Errors
    /// As [`get`](Self::get).
    pub(super) fn wait(&mut self) -> Result<Vec<Moved>, OrchestratorError> {
        self.finish()?;
        Ok(std::mem::take(&mut self.done))
    }

    /// Onloads the backend here, once the moves in flight are done, waiting for device memory
    /// as [`Patience`] allows.
    ///
    /// # Errors
    /// As [`get`](Self::get); [`OrchestratorError::NoMemoryToResume`].
    pub(super) fn onload(&mut self) -> Result<OffloadStats, OrchestratorError> {
        let patience = self.patience;
        onload_patiently(&mut **self.get()?, patience)
    }

    /// Joins the moves in flight, keeping what they moved for [`wait`](Self::wait).
    fn finish(&mut self) -> Result<(), OrchestratorError> {
        self.offloaded_after = None;
        if let Some(thread) = self.moving.take() {
            self.done.extend(join(thread, self.name)?);
        }
        Ok(())
    }

    /// Whether the state is offloaded once the moves in flight are done.
    pub(super) fn will_be_offloaded(&self) -> bool {
        self.offloaded_after
            .unwrap_or_else(|| lock(&self.backend).is_offloaded())
    }

    /// Starts `phase` ([`Phase::OffloadTrain`] or [`Phase::OnloadTrain`]) on a thread of its
    /// own, after the moves in flight; [`wait`](Self::wait) returns it.
    pub(super) fn start(&mut self, phase: Phase) {
        let (before, patience) = (self.moving.take(), self.patience);
        let (backend, name) = (Arc::clone(&self.backend), self.name);
        self.offloaded_after = Some(phase == Phase::OffloadTrain);
        self.moving = Some(thread::spawn(move || {
            let mut moved = match before {
                Some(thread) => join(thread, name)?,
                None => Vec::new(),
            };
            let started = Instant::now();
            let mut backend = lock(&backend);
            let stats = if phase == Phase::OffloadTrain {
                backend
                    .offload()
                    .map_err(OrchestratorError::train("actor", "offload"))?
            } else {
                onload_patiently(&mut **backend, patience)?
            };
            moved.push(Moved {
                phase,
                bytes: stats.bytes(),
                started,
                seconds: started.elapsed().as_secs_f64(),
            });
            Ok(moved)
        }));
    }

    /// Device bytes per tag now, or, while a move holds the backend, when last read.
    pub(super) fn device_memory(&mut self) -> Vec<(MemoryTag, u64)> {
        if let Ok(backend) = self.backend.try_lock() {
            self.memory = backend.device_memory();
        }
        self.memory.clone()
    }
}

fn join(thread: MoveThread, backend: &'static str) -> Result<Vec<Moved>, OrchestratorError> {
    thread.join().unwrap_or_else(|_| {
        Err(OrchestratorError::Train {
            role: "actor",
            action: "move its state",
            source: BackendError::RankLost { backend, rank: 0 },
        })
    })
}

fn lock<T: ?Sized>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
