//! The switch from training to rollout: the trainer sleeps and wakes, and the weights go from
//! the trainer to the engine, through the host or, on one device, by a device copy.
//!
//! Where the device holds both phases with the margin ([`Orchestrator::holds_both`]), the
//! actor's moves run behind other work on the mover's thread ([`super::mover`]): its offload
//! while the engine's weights and KV cache come in and the next rollout starts, its onload while
//! the rollout runs; the loop waits for them only where it needs the actor, and that wait is
//! what the step's `onload_train` seconds count. With `--offload-when-needed` nothing moves
//! there at all.

use std::time::Instant;

use super::Orchestrator;
use super::mover::Moved;
use crate::backend::BackendError;
use crate::backend::EngineError;
use crate::metrics::{MoveSpan, Phase, StepMetrics};
use crate::orchestrator::OrchestratorError;

/// The tail of DESIGN section 8: the trainer sleeps, then the weights cross the host link into
/// the engine.
const HOST_TAIL: [Phase; 4] = [
    Phase::OffloadTrain,
    Phase::OnloadWeights,
    Phase::Sync,
    Phase::OnloadKv,
];

/// The tail when trainer and engine share a device: the engine's weights come back and copy the
/// trainer's on the device before the trainer sleeps.
const DEVICE_TAIL: [Phase; 4] = [
    Phase::OnloadWeights,
    Phase::Sync,
    Phase::OffloadTrain,
    Phase::OnloadKv,
];

impl Orchestrator {
    /// Picks the order of the phases after training: [`DEVICE_TAIL`] when the actor shows its
    /// bf16 weights on a device and the engine takes them from there (no export, nothing
    /// crosses the host link), else [`HOST_TAIL`].
    pub(super) fn tail(&mut self) -> Result<[Phase; 4], OrchestratorError> {
        let weights = self
            .actor
            .get()?
            .device_weights()
            .map_err(OrchestratorError::train("actor", "show its device weights"))?;
        self.device_sync = weights.is_some_and(|w| self.engine.accepts_device_weights(&w));
        Ok(if self.device_sync {
            DEVICE_TAIL
        } else {
            HOST_TAIL
        })
    }

    /// Puts a move that ran behind other work on the memory timeline.
    pub(super) fn record_move(&mut self, moved: &Moved) {
        let start = moved
            .started
            .saturating_duration_since(self.started)
            .as_secs_f64();
        self.timeline.record_move(MoveSpan {
            name: format!("{} behind", moved.phase.name()),
            start,
            end: start + moved.seconds,
        });
    }

    /// Wakes actor, critic and reference: waits for the actor's moves in flight (counted into
    /// `metrics` with their own seconds, [`StepMetrics::add_behind`]), then onloads what is
    /// still offloaded; returns the bytes moved here.
    pub(super) fn onload_train(
        &mut self,
        metrics: &mut StepMetrics,
    ) -> Result<u64, OrchestratorError> {
        for moved in self.actor.wait()? {
            metrics.add_behind(moved.phase, moved.seconds, moved.bytes);
            self.record_move(&moved);
        }
        let mut bytes = 0;
        if self.actor.get()?.is_offloaded() {
            bytes += self.actor.onload()?.bytes();
        }
        if let Some(critic) = &mut self.critic
            && critic.is_offloaded()
        {
            let stats = critic
                .onload()
                .map_err(OrchestratorError::train("critic", "onload"))?;
            bytes += stats.bytes();
        }
        if let Some(reference) = &mut self.reference
            && reference.is_offloaded()
        {
            bytes += reference.onload()?.bytes;
        }
        Ok(bytes)
    }

    /// Starts the actor's onload behind the rollout when its moves run behind work and it is
    /// (or is about to be) offloaded.
    pub(super) fn onload_train_behind(&mut self) {
        if self.config.offload_train && self.moves_behind() && self.actor.will_be_offloaded() {
            self.actor.start(Phase::OnloadTrain);
        }
    }

    /// Whether the shared device holds both phases' peaks with the margin to spare, as
    /// [`decide_fit`](Self::decide_fit) last decided (said once in the log).
    pub(super) fn holds_both(&self) -> bool {
        self.fits
    }

    /// Decides [`holds_both`](Self::holds_both) from the peaks so far, with the other ranks
    /// where they agree ([`with_fit_agreement`](Orchestrator::with_fit_agreement)): both
    /// phases fit only where they fit on every rank.
    ///
    /// # Errors
    /// [`OrchestratorError::Agreement`] when the ranks cannot agree.
    pub(super) fn decide_fit(&mut self) -> Result<(), OrchestratorError> {
        let (train, rollout) = self.peaks;
        let here = self.config.device_bytes.is_some_and(|total| {
            train > 0 && rollout > 0 && train + rollout + self.config.margin_bytes <= total
        });
        self.fits = match &mut self.fit_agreement {
            Some(agree) => agree(here).map_err(|source| OrchestratorError::Agreement {
                about: "whether their devices hold both phases",
                source,
            })?,
            None => here,
        };
        Ok(())
    }

    /// Whether `--offload-when-needed` keeps both phases resident.
    pub(super) fn keep_resident(&self) -> bool {
        self.config.offload_when_needed && self.holds_both()
    }

    /// Says once what the device holds and what the loop does about it.
    pub(super) fn tell_fit(&mut self) {
        if self.told_fit || !(self.config.offload_train || self.config.offload_rollout) {
            return;
        }
        let what = match (self.holds_both(), self.config.offload_when_needed) {
            (true, true) => {
                "holds both phases with the margin: --offload-when-needed keeps them resident, nothing moves"
            }
            (true, false) if self.moves_behind() => {
                "holds both phases with the margin: the trainer's moves run behind the switch and the rollout (--offload-when-needed would keep them resident)"
            }
            (true, false) => {
                "holds both phases with the margin: with a critic the moves run one after another (--offload-when-needed would keep them resident)"
            }
            (false, true) if self.config.device_bytes.is_some() => {
                "does not hold both phases with the margin: --offload-when-needed moves what it must, one move after another"
            }
            (false, _) => return,
        };
        self.told_fit = true;
        let (train, rollout) = self.peaks;
        tracing::info!(
            train,
            rollout,
            margin = self.config.margin_bytes,
            total = self.config.device_bytes.unwrap_or_default(),
            "the device {what}"
        );
    }

    /// Whether the actor's moves run behind other work: the device holds both phases with the
    /// margin, and there is no critic (whose moves stay in line).
    pub(super) fn moves_behind(&self) -> bool {
        self.critic.is_none() && self.holds_both()
    }

    /// Stages the weights for the coming sync unless the actor exports while offloaded or the
    /// weights were copied on the device already, then offloads actor and critic to the target
    /// (the actor behind the rest of the switch where [`moves_behind`](Self::moves_behind)).
    pub(super) fn offload_train(&mut self) -> Result<u64, OrchestratorError> {
        if !self.config.export_while_offloaded && !self.device_sync {
            let started = Instant::now();
            let mut staged = Vec::new();
            self.actor
                .get()?
                .export_weights(self.config.bucket_bytes, &mut |bucket| {
                    staged.push(bucket);
                    Ok(())
                })
                .map_err(OrchestratorError::train("actor", "export weights"))?;
            self.staged = Some(staged);
            self.export_seconds = started.elapsed().as_secs_f64();
        }
        let mut bytes = 0;
        if self.moves_behind() {
            self.actor.start(Phase::OffloadTrain);
        } else {
            let stats = self
                .actor
                .get()?
                .offload()
                .map_err(OrchestratorError::train("actor", "offload"))?;
            bytes += stats.bytes();
        }
        if let Some(critic) = &mut self.critic {
            let stats = critic
                .offload()
                .map_err(OrchestratorError::train("critic", "offload"))?;
            bytes += stats.bytes();
        }
        if let Some(reference) = &mut self.reference
            && !reference.is_offloaded()
        {
            bytes += reference.offload()?.bytes;
        }
        Ok(bytes)
    }

    /// Sends the trainer's weights to the engine in buckets: the staged ones when the trainer
    /// is asleep, else straight from the trainer.
    pub(super) fn sync(&mut self) -> Result<u64, OrchestratorError> {
        let mut bytes = 0u64;
        if let Some(staged) = self.staged.take() {
            for bucket in staged {
                self.engine.update_weights(&bucket)?;
                bytes += bucket.bytes() as u64;
            }
            return Ok(bytes);
        }
        let engine = &mut self.engine;
        let mut failure: Option<EngineError> = None;
        let exported = self
            .actor
            .get()?
            .export_weights(self.config.bucket_bytes, &mut |bucket| match engine
                .update_weights(&bucket)
            {
                Ok(()) => {
                    bytes += bucket.bytes() as u64;
                    Ok(())
                }
                Err(error) => {
                    let message = error.to_string();
                    failure = Some(error);
                    Err(BackendError::Sink(message))
                }
            });
        if let Some(error) = failure {
            return Err(error.into());
        }
        exported.map_err(OrchestratorError::train("actor", "export weights"))?;
        Ok(bytes)
    }

    /// Copies the actor's bf16 weights into the engine's on the device; returns the bytes
    /// copied. Should the actor or the engine decline now, after [`tail`](Self::tail) chose the
    /// device, the weights go through the host from the trainer, which is still awake.
    pub(super) fn sync_on_device(&mut self) -> Result<u64, OrchestratorError> {
        let weights = self
            .actor
            .get()?
            .device_weights()
            .map_err(OrchestratorError::train("actor", "show its device weights"))?;
        if let Some(weights) = weights
            && let Some(bytes) = self.engine.copy_device_weights(&weights)?
        {
            return Ok(bytes);
        }
        tracing::warn!(
            "the device weight copy was declined after it was chosen; syncing through the host"
        );
        self.sync()
    }
}
