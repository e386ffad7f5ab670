//! [`FsdpBackend`]: the fully sharded training backend behind [`TrainBackend`].

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use miles_core::backend::{TrainBackend, WeightSink, export_full_weights, sum_over_ranks};
use miles_core::config::{DeviceChoice, OffloadTarget, Settings, TrainOffload};
use miles_core::model::{
    LlamaConfig, ParamLayout, Transformer, init_params, load_params, save_checkpoint,
};
use miles_core::ops::AdamWConfig;
use miles_core::{
    BackendError, Batch, CommError, Communicator, CpuDevice, Device, LocalComm, MemoryTag,
    OffloadStats, RankOffload, StepStats,
};

use crate::rank::{Rank, RankSetup};
use crate::shards::StatePart;
use crate::units::UnitPlan;
use miles_core::backend::SavedOptimizer;
use miles_core::backend::optimizer::{read_optimizer, write_optimizer};

pub(crate) const NAME: &str = "fsdp";

/// The FSDP-style training backend: every parameter sharded over the data-parallel ranks in
/// flat units (the embedding, each decoder layer, the head), a unit all-gathered just before
/// its forward or backward pass, its gradient reduce-scattered right after, and AdamW on each
/// rank's shard alone.
///
/// Ranks are threads, each with its own device and memory manager, talking through
/// [`LocalComm`]. With native CPU offload (`--fsdp-cpu-offload`, only while `--offload-train`
/// is off: rule 6) the shards and the optimizer state stay in host memory, a unit's shard
/// visits the device to be gathered, and AdamW runs on the CPU; otherwise they live in the
/// device regions `params`, `optimizer` and `grads`, which [`offload`](TrainBackend::offload)
/// moves to the host or to disk between steps.
#[derive(Debug)]
pub struct FsdpBackend {
    model: Transformer,
    plan: UnitPlan,
    adamw: AdamWConfig,
    /// Sequences per forward and backward pass of a rank (`--micro-batch-size`); `None`: a
    /// rank's share in one pass.
    micro_batch_size: Option<usize>,
    ranks: Vec<Rank>,
    native: bool,
    target: OffloadTarget,
    step: u64,
    offloaded: Option<OffloadTarget>,
}

impl FsdpBackend {
    /// The backend the settings describe: the preset model, seeded initialisation, one CPU
    /// device of `--device-memory-gib` per data-parallel rank; loads `--load` when given.
    ///
    /// # Errors
    /// [`BackendError::Settings`] for settings this backend cannot run (tensor parallelism,
    /// the CUDA device); as [`FsdpBackend::new`] and [`TrainBackend::load`].
    pub fn from_settings(settings: &Settings) -> Result<FsdpBackend, BackendError> {
        if settings.device == DeviceChoice::Cuda {
            return Err(BackendError::Settings {
                backend: NAME,
                reason: "from_settings builds the cpu backend; on cuda build it with miles_fsdp::gpu_trainer (the cli does), or run with --device cpu".into(),
            });
        }
        let config = LlamaConfig::from_settings(settings)?;
        let devices = (0..settings.data_parallel_size)
            .map(|_| Arc::new(CpuDevice::new(settings.device_memory_bytes())) as Arc<dyn Device>)
            .collect();
        let mut backend = FsdpBackend::new(config, settings, devices)?;
        if let Some(dir) = &settings.load {
            backend.load(dir)?;
        }
        Ok(backend)
    }

    /// A backend for `config` over `devices` (one per data-parallel rank, as many as
    /// `--data-parallel-size`), initialised from `--seed`.
    ///
    /// Rule 6 holds here too: settings that ask for both `--fsdp-cpu-offload` and
    /// `--offload-train` (validation normally resolved them, with its warning) run without
    /// native offload, warning once.
    ///
    /// # Errors
    /// [`BackendError::Settings`] for a device count that differs from the data-parallel size,
    /// tensor parallelism, optimizer-state streaming, or a disk target without a directory;
    /// [`BackendError::Memory`] when a rank's regions do not fit its device.
    pub fn new(
        config: LlamaConfig,
        settings: &Settings,
        devices: Vec<Arc<dyn Device>>,
    ) -> Result<FsdpBackend, BackendError> {
        let settings_error = |reason: String| BackendError::Settings {
            backend: NAME,
            reason,
        };
        let dp = settings.data_parallel_size;
        if settings.tensor_model_parallel_size != 1 {
            return Err(settings_error(format!(
                "shards every parameter over data-parallel ranks and has no tensor parallelism; set --tensor-model-parallel-size 1 (got {})",
                settings.tensor_model_parallel_size
            )));
        }
        if settings.stream_optimizer_state_to_disk {
            return Err(settings_error(
                "does not stream optimizer state through the disk; drop --stream-optimizer-state-to-disk or use --train-backend megatron".into(),
            ));
        }
        if dp == 0 || devices.len() != dp {
            return Err(settings_error(format!(
                "got {} devices for --data-parallel-size {dp}; give one device per rank",
                devices.len()
            )));
        }
        // Rule 6 (native CPU offload yields to core offload) is settled when the settings resolve.
        let native = settings.fsdp_cpu_offload && !settings.offload_train;
        let offload =
            TrainOffload::of(settings).map_err(|error| settings_error(error.to_string()))?;
        let setup = RankSetup {
            native,
            policy: offload.policy(),
            margin_bytes: settings.train_memory_margin_bytes,
            offload: offload.clone(),
        };
        let model = Transformer::new(config);
        let layout = model.layout().clone();
        let plan = UnitPlan::new(model.config(), &layout, dp);
        let mut full = vec![0.0; layout.len()];
        init_params(&layout, model.config(), settings.seed, &mut full)?;
        let ranks = devices
            .into_iter()
            .enumerate()
            .map(|(rank, device)| Rank::new(rank, device, &plan, &setup, &full))
            .collect::<Result<Vec<_>, _>>()?;
        tracing::info!(
            ranks = dp,
            units = plan.units().len(),
            shard_elements = plan.shard_total(),
            native_cpu_offload = native,
            "fsdp backend ready"
        );
        Ok(FsdpBackend {
            model,
            micro_batch_size: settings.micro_batch_size,
            plan,
            adamw: AdamWConfig {
                lr: settings.lr as f32,
                max_grad_norm: settings.max_grad_norm(),
                ..AdamWConfig::default()
            },
            ranks,
            native,
            target: offload.target(),
            step: 0,
            offloaded: None,
        })
    }

    /// Whether native CPU offload is on (shards and optimizer state in host memory).
    pub fn native_cpu_offload(&self) -> bool {
        self.native
    }

    /// The units and their sharding.
    pub fn plan(&self) -> &UnitPlan {
        &self.plan
    }

    /// The AdamW settings.
    pub fn adamw(&self) -> &AdamWConfig {
        &self.adamw
    }

    /// Device bytes each rank has committed now.
    ///
    /// # Errors
    /// The device's error.
    pub fn device_bytes(&self) -> Result<Vec<u64>, BackendError> {
        self.ranks.iter().map(Rank::device_bytes).collect()
    }

    /// The most device bytes each rank had committed at the points sampled during the last
    /// training step (after each unit's gather and gradient reduction).
    pub fn peak_device_bytes(&self) -> Vec<u64> {
        self.ranks.iter().map(Rank::peak_device_bytes).collect()
    }

    /// Device bytes each rank holds under `tag`.
    ///
    /// # Errors
    /// [`BackendError::Memory`] for a tag the ranks do not have.
    pub fn region_bytes(&self, tag: &miles_core::MemoryTag) -> Result<Vec<u64>, BackendError> {
        self.ranks
            .iter()
            .map(|r| Ok(r.memory().region_bytes(tag)?))
            .collect()
    }

    fn check_onloaded(&self, op: &'static str) -> Result<(), BackendError> {
        match self.offloaded {
            Some(_) => Err(BackendError::Offloaded { op }),
            None => Ok(()),
        }
    }

    /// The full `part` gathered from the shards, laid out as the parameters.
    fn gather_full(&mut self, part: StatePart) -> Result<Vec<f32>, BackendError> {
        let len = self.model.layout().len();
        let plan = &self.plan;
        let mut out = on_ranks(&mut self.ranks, |rank, comm| {
            rank.gather_full(comm, plan, part, len)
        })?;
        Ok(out.swap_remove(0))
    }

    fn scatter_full(&mut self, part: StatePart, full: &[f32]) -> Result<(), BackendError> {
        let plan = &self.plan;
        on_ranks(&mut self.ranks, |rank, comm| {
            rank.scatter_full(plan, comm.rank(), part, full)
        })
        .map(drop)
    }

    fn offload_stats(
        &mut self,
        target: OffloadTarget,
        onload: bool,
    ) -> Result<OffloadStats, BackendError> {
        let started = Instant::now();
        let outcomes = run_ranks(&mut self.ranks, |rank, comm| {
            let t0 = Instant::now();
            let tags = if onload {
                rank.onload()?
            } else {
                rank.offload()?
            };
            Ok(RankOffload::new(
                comm.rank(),
                t0.elapsed().as_secs_f64(),
                tags,
            ))
        })?;
        if !onload && outcomes.iter().any(Result::is_err) {
            // All ranks or none: the ranks that offloaded come back, so the backend stays
            // usable on the device.
            for (rank, outcome) in self.ranks.iter_mut().zip(&outcomes) {
                if outcome.is_ok()
                    && let Err(error) = rank.onload()
                {
                    tracing::error!(%error, "cannot onload a rank after another failed to offload");
                }
            }
        }
        Ok(OffloadStats {
            target,
            ranks: first_error(outcomes)?,
            seconds: started.elapsed().as_secs_f64(),
        })
    }
}

impl TrainBackend for FsdpBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn config(&self) -> &LlamaConfig {
        self.model.config()
    }

    fn step(&self) -> u64 {
        self.step
    }

    fn is_offloaded(&self) -> bool {
        self.offloaded.is_some()
    }

    fn device_memory(&self) -> Vec<(MemoryTag, u64)> {
        sum_over_ranks(self.ranks.iter().map(|r| r.memory().resident_bytes()))
    }

    fn set_lr(&mut self, lr: f32) -> Result<(), BackendError> {
        self.adamw.lr = lr;
        Ok(())
    }

    fn train_step(&mut self, batch: &Batch) -> Result<StepStats, BackendError> {
        self.check_onloaded("train")?;
        let dp = self.ranks.len();
        batch.check(dp)?;
        let started = Instant::now();
        let step = self.step + 1;
        let (model, plan, adamw) = (&self.model, &self.plan, &self.adamw);
        let micro = self.micro_batch_size;
        let results = on_ranks(&mut self.ranks, |rank, comm| {
            let rows = batch.rows(batch.share(comm.rank(), dp));
            rank.train_step(comm, model, plan, &rows, micro, adamw, step)
        })?;
        self.step = step;
        let loss = results.iter().map(|(l, ..)| f64::from(*l)).sum::<f64>() as f32;
        let entropy = results
            .iter()
            .map(|(.., e)| e.map(f64::from))
            .sum::<Option<f64>>()
            .map(|e| e as f32);
        Ok(StepStats {
            step,
            loss,
            grad_norm: results[0].1,
            entropy,
            tokens: (batch.batch * batch.seq) as u64,
            seconds: started.elapsed().as_secs_f64(),
            optimizer_stream: None,
        })
    }

    fn logprobs(&mut self, batch: &Batch) -> Result<(Vec<f32>, f32), BackendError> {
        self.check_onloaded("compute log-probs")?;
        let dp = self.ranks.len();
        batch.check(dp)?;
        let (model, plan, micro) = (&self.model, &self.plan, self.micro_batch_size);
        let results = on_ranks(&mut self.ranks, |rank, comm| {
            let rows = batch.rows(batch.share(comm.rank(), dp));
            rank.logprobs(comm, model, plan, &rows, micro)
        })?;
        let loss = results.iter().map(|(_, l)| f64::from(*l)).sum::<f64>() as f32;
        let logprobs = results.into_iter().flat_map(|(lp, _)| lp).collect();
        Ok((logprobs, loss))
    }

    fn offload(&mut self) -> Result<OffloadStats, BackendError> {
        self.check_onloaded("offload")?;
        let target = self.target;
        let stats = self.offload_stats(target, false)?;
        self.offloaded = Some(target);
        tracing::debug!(%target, bytes = stats.bytes(), seconds = stats.seconds, "fsdp offloaded");
        Ok(stats)
    }

    fn onload(&mut self) -> Result<OffloadStats, BackendError> {
        let Some(target) = self.offloaded else {
            return Err(BackendError::NotOffloaded);
        };
        let stats = self.offload_stats(target, true)?;
        self.offloaded = None;
        tracing::debug!(%target, bytes = stats.bytes(), seconds = stats.seconds, "fsdp onloaded");
        Ok(stats)
    }

    fn export_weights(
        &mut self,
        bucket_bytes: usize,
        sink: &mut WeightSink<'_>,
    ) -> Result<(), BackendError> {
        self.check_onloaded("export weights")?;
        let full = self.gather_full(StatePart::Params)?;
        export_full_weights(self.model.layout(), &full, bucket_bytes, sink)
    }

    fn save(&mut self, dir: &Path) -> Result<(), BackendError> {
        self.check_onloaded("save")?;
        let params = self.gather_full(StatePart::Params)?;
        let state = SavedOptimizer {
            step: self.step,
            m: self.gather_full(StatePart::ExpAvg)?,
            v: self.gather_full(StatePart::ExpAvgSq)?,
        };
        save_checkpoint(dir, self.model.config(), self.model.layout(), &params)?;
        write_optimizer(dir, &state, self.ranks.len())?;
        tracing::info!(dir = %dir.display(), step = self.step, "fsdp checkpoint saved");
        Ok(())
    }

    fn load(&mut self, dir: &Path) -> Result<(), BackendError> {
        self.check_onloaded("load")?;
        let layout: ParamLayout = self.model.layout().clone();
        let mut params = vec![0.0; layout.len()];
        load_params(dir, &layout, &mut params)?;
        let state = read_optimizer(dir, layout.len())?;
        self.scatter_full(StatePart::Params, &params)?;
        let zeros;
        let (m, v, step) = match &state {
            Some(s) => (&s.m, &s.v, s.step),
            None => {
                zeros = vec![0.0; layout.len()];
                (&zeros, &zeros, 0)
            }
        };
        self.scatter_full(StatePart::ExpAvg, m)?;
        self.scatter_full(StatePart::ExpAvgSq, v)?;
        self.step = step;
        tracing::info!(dir = %dir.display(), step, optimizer = state.is_some(), "fsdp checkpoint loaded");
        Ok(())
    }
}

/// Runs `f` on every rank in its own thread, over a fresh in-process world, and returns the
/// results in rank order, or the error that stopped them (see [`first_error`]).
fn on_ranks<T: Send>(
    ranks: &mut [Rank],
    f: impl Fn(&mut Rank, &dyn Communicator) -> Result<T, BackendError> + Sync,
) -> Result<Vec<T>, BackendError> {
    first_error(run_ranks(ranks, f)?)
}

/// Runs `f` on every rank in its own thread, over a fresh in-process world, and returns each
/// rank's outcome in rank order.
///
/// A rank that fails drops its communicator, so its peers stop with
/// [`CommError::PeerGone`] instead of waiting for it.
fn run_ranks<T: Send>(
    ranks: &mut [Rank],
    f: impl Fn(&mut Rank, &dyn Communicator) -> Result<T, BackendError> + Sync,
) -> Result<Vec<Result<T, BackendError>>, BackendError> {
    let comms = LocalComm::world(ranks.len())?;
    let f = &f;
    Ok(std::thread::scope(|scope| {
        let handles: Vec<_> = ranks
            .iter_mut()
            .zip(comms)
            .map(|(rank, comm)| scope.spawn(move || f(rank, &comm)))
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, handle)| {
                handle.join().unwrap_or(Err(BackendError::RankLost {
                    backend: NAME,
                    rank,
                }))
            })
            .collect()
    }))
}

/// The results, or the error that caused the others: the first that is not a peer's departure.
fn first_error<T>(outcomes: Vec<Result<T, BackendError>>) -> Result<Vec<T>, BackendError> {
    let consequence =
        |e: &BackendError| matches!(e, BackendError::Comm(CommError::PeerGone { .. }));
    let cause = outcomes
        .iter()
        .position(|o| matches!(o, Err(e) if !consequence(e)))
        .or_else(|| outcomes.iter().position(Result::is_err));
    match cause {
        None => outcomes.into_iter().collect(),
        Some(rank) => match outcomes.into_iter().nth(rank) {
            Some(Err(e)) => Err(e),
            _ => Err(BackendError::RankLost {
                backend: NAME,
                rank,
            }),
        },
    }
}

#[cfg(test)]
mod tests {
    use miles_core::model::ModelError;

    use super::*;

    fn settings(dp: usize) -> Settings {
        Settings {
            data_parallel_size: dp,
            device_memory_gib: 0.25,
            train_memory_margin_bytes: 0,
            ..Settings::default()
        }
    }

    fn tiny(dp: usize) -> FsdpBackend {
        FsdpBackend::from_settings(&settings(dp)).unwrap()
    }

    fn batch(b: usize, t: usize) -> Batch {
        let n = b * t;
        Batch {
            batch: b,
            seq: t,
            inputs: (0..n as u32).map(|i| (i * 37 + 11) % 256).collect(),
            targets: (0..n as u32).map(|i| (i * 53 + 7) % 256).collect(),
            weights: (0..n).map(|i| 0.5 + (i % 3) as f32).collect(),
            normaliser: n as f32,
            entropy_mask: None,
            entropy_coef: 0.0,
        }
    }

    #[test]
    fn misuse_of_offload_and_onload_is_a_clear_error() {
        let mut fsdp = tiny(2);
        assert!(matches!(fsdp.onload(), Err(BackendError::NotOffloaded)));
        fsdp.offload().unwrap();
        assert!(matches!(
            fsdp.offload(),
            Err(BackendError::Offloaded { .. })
        ));
        let err = fsdp.train_step(&batch(2, 3)).unwrap_err();
        assert!(err.to_string().contains("onload first"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(
            fsdp.save(dir.path()),
            Err(BackendError::Offloaded { .. })
        ));
        fsdp.onload().unwrap();
        fsdp.train_step(&batch(2, 3)).unwrap();
        assert_eq!(fsdp.step(), 1);
    }

    #[test]
    fn settings_the_backend_cannot_run_are_refused_by_name() {
        let mut s = settings(1);
        s.tensor_model_parallel_size = 2;
        let err = FsdpBackend::from_settings(&s).unwrap_err().to_string();
        assert!(err.contains("--tensor-model-parallel-size 1"), "{err}");
        let mut s = settings(1);
        s.stream_optimizer_state_to_disk = true;
        let err = FsdpBackend::from_settings(&s).unwrap_err().to_string();
        assert!(err.contains("--stream-optimizer-state-to-disk"), "{err}");
        let s = settings(2);
        let one: Vec<Arc<dyn Device>> = vec![Arc::new(CpuDevice::new(1 << 28))];
        let err = FsdpBackend::new(LlamaConfig::preset("tiny").unwrap(), &s, one)
            .unwrap_err()
            .to_string();
        assert!(err.contains("one device per rank"), "{err}");
        let err = tiny(2).train_step(&batch(1, 4)).unwrap_err().to_string();
        assert!(err.contains("2 data-parallel"), "{err}");
    }

    #[test]
    fn an_onload_that_fails_half_way_leaves_the_backend_offloaded_and_can_be_retried() {
        let device = Arc::new(CpuDevice::new(64 << 20));
        let devices: Vec<Arc<dyn Device>> = vec![device.clone()];
        let s = Settings {
            offload_train: true,
            ..settings(1)
        };
        let mut fsdp = FsdpBackend::new(LlamaConfig::preset("tiny").unwrap(), &s, devices).unwrap();
        fsdp.train_step(&batch(1, 4)).unwrap();
        let params = fsdp.region_bytes(&MemoryTag::Params).unwrap()[0];
        fsdp.offload().unwrap();
        // Another holder takes the device but for the parameters: the next tag cannot resume.
        let free = device.memory_info().unwrap().free;
        let granule = device.granularity() as u64;
        let taken = (free - params) / granule * granule;
        let held = device.reserve(taken as usize).unwrap();
        device.commit(held).unwrap();
        let err = fsdp.onload().unwrap_err();
        assert!(matches!(err, BackendError::Memory(_)), "{err}");
        assert!(fsdp.is_offloaded());
        device.release(held).unwrap();
        device.unreserve(held).unwrap();
        fsdp.onload().unwrap();
        assert!(!fsdp.is_offloaded());
        fsdp.train_step(&batch(1, 4)).unwrap();
    }

    #[test]
    fn a_rank_failing_alone_fails_the_step_with_its_own_error_and_the_backend_goes_on() {
        let mut fsdp = tiny(2);
        let mut bad = batch(4, 3);
        // Only rank 1's rows (sequences 2 and 3) hold a token outside the vocabulary.
        bad.inputs[10] = 5000;
        let err = fsdp.train_step(&bad).unwrap_err();
        assert!(
            matches!(
                err,
                BackendError::Model(ModelError::TokenOutOfRange { id: 5000, .. })
            ),
            "{err}"
        );
        assert_eq!(fsdp.step(), 0);
        let stats = fsdp.train_step(&batch(4, 3)).unwrap();
        assert!(stats.loss.is_finite() && stats.grad_norm > 0.0, "{stats:?}");
        assert_eq!(stats.step, 1);
    }
}
