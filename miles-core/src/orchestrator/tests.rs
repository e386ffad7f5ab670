//! The loop against in-test fakes of the trainer, the critic and the engine that record every
//! call and keep their tensors in real memory-manager regions, so that the order of DESIGN
//! section 8, the offload switches, residency, metrics, resume and stop are all checked.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::backend::{
    BackendError, Batch, Critic, DeviceWeights, EngineError, NamedTensor, OffloadStats,
    RankOffload, RolloutEngine, Sample, Sampling, StepStats, TrainBackend, WeightBucket,
    WeightSink,
};
use crate::config::{AdvantageEstimator, OffloadTarget, Task};
use crate::device::CpuDevice;
use crate::memory::{
    BackupPolicy, Buffer, ManagerSettings, MemoryManager, MemoryTag, OffloadReport,
};
use crate::metrics::{Phase, StepMetrics};
use crate::model::{ByteTokenizer, LlamaConfig};

mod lifecycle;
mod moves;
mod sync;

type Log = Arc<Mutex<Vec<String>>>;

fn note(log: &Log, what: &str) {
    log.lock().unwrap().push(what.to_owned());
}

const MIB: usize = 1 << 20;

/// A manager on its own CPU device with one region per `(tag, policy, bytes)`, each filled.
fn memory(regions: &[(MemoryTag, BackupPolicy, usize)]) -> (Arc<MemoryManager>, Vec<Buffer>) {
    let m = MemoryManager::new(
        Arc::new(CpuDevice::new(256 << 20)),
        ManagerSettings {
            margin_bytes: 0,
            disk: None,
        },
    )
    .unwrap();
    let buffers = regions
        .iter()
        .map(|(tag, policy, bytes)| {
            m.create_region(tag.clone(), *policy, *bytes).unwrap();
            m.alloc(tag, *bytes).unwrap()
        })
        .collect();
    (Arc::new(m), buffers)
}

fn pause(m: &MemoryManager, tags: &[MemoryTag]) -> Vec<OffloadReport> {
    tags.iter().map(|t| m.pause(t).unwrap()).collect()
}

fn resume(m: &MemoryManager, tags: &[MemoryTag]) -> Vec<OffloadReport> {
    tags.iter().map(|t| m.resume(t).unwrap()).collect()
}

fn stats(reports: Vec<OffloadReport>) -> OffloadStats {
    OffloadStats {
        target: OffloadTarget::Host,
        ranks: vec![RankOffload::new(0, 0.0, reports)],
        seconds: 0.0,
    }
}

/// A trainer whose "model" is four small tensors updated by a fixed rule from each batch.
struct FakeActor {
    log: Log,
    config: LlamaConfig,
    memory: Arc<MemoryManager>,
    buffers: Vec<Buffer>,
    tensors: Vec<Vec<f32>>,
    step: u64,
    offloaded: bool,
    /// Exports from its backup while offloaded, as a backend with host-pool export would.
    exports_offloaded: bool,
    /// Shows these as its weights on the device while awake, as a GPU backend would.
    device_weights: Option<DeviceWeights>,
    /// Raised during every optimizer step, as Ctrl-C would.
    stop_during_train: Option<Arc<AtomicBool>>,
    /// The optimizer step from which the loss is NaN, as broken weights give.
    nan_from_step: Option<u64>,
    /// The offload after this many optimizer steps fails, as a full disk would.
    fail_offload_at_step: Option<u64>,
    /// Its saves fail writing their files (after a backend's gathers), as a full disk would.
    fail_save: bool,
    /// After its first offload, another holder takes this many bytes of its device, and gives
    /// them back after the delay (never without one).
    hog_after_offload: Option<(usize, Option<std::time::Duration>)>,
}

const TRAIN_TAGS: [MemoryTag; 2] = [MemoryTag::Params, MemoryTag::Grads];

impl FakeActor {
    fn new(log: &Log) -> Self {
        let (memory, buffers) = memory(&[
            (MemoryTag::Params, BackupPolicy::Host, 6 * MIB),
            (MemoryTag::Grads, BackupPolicy::None, 4 * MIB),
        ]);
        Self {
            log: Arc::clone(log),
            config: LlamaConfig::preset("tiny").unwrap(),
            memory,
            buffers,
            tensors: (0..4)
                .map(|t| (0..256).map(|i| (t * 256 + i) as f32 * 1e-3).collect())
                .collect(),
            step: 0,
            offloaded: false,
            exports_offloaded: false,
            device_weights: None,
            stop_during_train: None,
            nan_from_step: None,
            fail_offload_at_step: None,
            fail_save: false,
            hog_after_offload: None,
        }
    }

    fn checksum(&self) -> f32 {
        self.tensors.iter().flatten().sum()
    }
}

impl TrainBackend for FakeActor {
    fn name(&self) -> &'static str {
        "fake"
    }
    fn config(&self) -> &LlamaConfig {
        &self.config
    }
    fn step(&self) -> u64 {
        self.step
    }
    fn is_offloaded(&self) -> bool {
        self.offloaded
    }
    fn device_memory(&self) -> Vec<(MemoryTag, u64)> {
        self.memory.resident_bytes()
    }
    fn train_step(&mut self, batch: &Batch) -> Result<StepStats, BackendError> {
        note(&self.log, "actor.train_step");
        if self.is_offloaded() {
            return Err(BackendError::Offloaded { op: "train" });
        }
        batch.check(1)?;
        let signal: f32 = batch
            .weights
            .iter()
            .zip(&batch.targets)
            .map(|(w, t)| w * (*t % 7) as f32)
            .sum::<f32>()
            / batch.normaliser;
        for (t, tensor) in self.tensors.iter_mut().enumerate() {
            for (i, v) in tensor.iter_mut().enumerate() {
                *v += 1e-3 * signal * ((t + i) % 5) as f32;
            }
        }
        self.step += 1;
        if let Some(flag) = &self.stop_during_train {
            flag.store(true, Ordering::SeqCst);
        }
        let broken = self.nan_from_step.is_some_and(|from| self.step >= from);
        Ok(StepStats {
            step: self.step,
            loss: if broken {
                f32::NAN
            } else {
                signal + self.checksum() * 1e-3
            },
            grad_norm: signal.abs(),
            entropy: None,
            tokens: (batch.batch * batch.seq) as u64,
            seconds: 0.0,
            optimizer_stream: None,
        })
    }
    fn logprobs(&mut self, batch: &Batch) -> Result<(Vec<f32>, f32), BackendError> {
        Ok((vec![-1.0; batch.inputs.len()], 1.0))
    }
    fn offload(&mut self) -> Result<OffloadStats, BackendError> {
        note(&self.log, "actor.offload");
        if self.is_offloaded() {
            return Err(BackendError::Offloaded { op: "offload" });
        }
        if self.fail_offload_at_step == Some(self.step) {
            return Err(BackendError::Settings {
                backend: "fake",
                reason: "injected offload fault".into(),
            });
        }
        self.offloaded = true;
        let reports = pause(&self.memory, &TRAIN_TAGS);
        if let Some((bytes, release_after)) = self.hog_after_offload.take() {
            let device = Arc::clone(self.memory.device());
            let taken = device.reserve(bytes).unwrap();
            device.commit(taken).unwrap();
            if let Some(delay) = release_after {
                std::thread::spawn(move || {
                    std::thread::sleep(delay);
                    device.release(taken).unwrap();
                    device.unreserve(taken).unwrap();
                });
            }
        }
        Ok(stats(reports))
    }
    fn onload(&mut self) -> Result<OffloadStats, BackendError> {
        note(&self.log, "actor.onload");
        if !self.offloaded {
            return Err(BackendError::NotOffloaded);
        }
        let reports = self.memory.resume_all(&TRAIN_TAGS)?;
        self.offloaded = false;
        Ok(stats(reports))
    }
    fn export_weights(
        &mut self,
        bucket_bytes: usize,
        sink: &mut WeightSink<'_>,
    ) -> Result<(), BackendError> {
        note(&self.log, "actor.export_weights");
        if self.is_offloaded() && !self.exports_offloaded {
            return Err(BackendError::Offloaded {
                op: "export weights",
            });
        }
        let mut bucket = WeightBucket::default();
        for (t, data) in self.tensors.iter().enumerate() {
            if !bucket.tensors.is_empty() && bucket.bytes() + data.len() * 4 > bucket_bytes {
                sink(std::mem::take(&mut bucket))?;
            }
            bucket.tensors.push(NamedTensor {
                name: format!("t{t}"),
                shape: vec![data.len()],
                data: data.clone(),
            });
        }
        sink(bucket)
    }
    fn device_weights(&self) -> Result<Option<DeviceWeights>, BackendError> {
        Ok(self.device_weights.clone().filter(|_| !self.is_offloaded()))
    }
    fn save(&mut self, dir: &Path) -> Result<(), BackendError> {
        note(&self.log, "actor.save");
        if self.fail_save {
            return Err(BackendError::Io {
                action: "write",
                path: dir.to_path_buf(),
                source: std::io::Error::from(std::io::ErrorKind::StorageFull),
            });
        }
        let text = serde_json::to_string(&(self.step, &self.tensors)).unwrap();
        std::fs::write(dir.join("fake.json"), text).unwrap();
        Ok(())
    }
    fn assist_save(&mut self) -> Result<(), BackendError> {
        note(&self.log, "actor.assist_save");
        Ok(())
    }
    fn load(&mut self, dir: &Path) -> Result<(), BackendError> {
        note(&self.log, "actor.load");
        let text = std::fs::read_to_string(dir.join("fake.json")).unwrap();
        (self.step, self.tensors) = serde_json::from_str(&text).unwrap();
        Ok(())
    }
}

/// A critic holding one learned value.
struct FakeCritic {
    log: Log,
    memory: Arc<MemoryManager>,
    _buffers: Vec<Buffer>,
    value: f32,
    offloaded: bool,
}

impl FakeCritic {
    /// A critic of 2 MiB of parameters valuing every prompt at 0.25.
    fn new(log: &Log) -> Self {
        let (memory, buffers) = memory(&[(MemoryTag::Params, BackupPolicy::Host, 2 * MIB)]);
        FakeCritic {
            log: Arc::clone(log),
            memory,
            _buffers: buffers,
            value: 0.25,
            offloaded: false,
        }
    }
}

impl Critic for FakeCritic {
    fn name(&self) -> &'static str {
        "fake-critic"
    }
    fn device_memory(&self) -> Vec<(MemoryTag, u64)> {
        self.memory.resident_bytes()
    }
    fn values(&mut self, prompts: &[Vec<u32>]) -> Result<Vec<f32>, BackendError> {
        note(&self.log, "critic.values");
        assert!(!self.offloaded, "values asked of an offloaded critic");
        Ok(vec![self.value; prompts.len()])
    }
    fn train_values(&mut self, prompts: &[Vec<u32>], targets: &[f32]) -> Result<f32, BackendError> {
        note(&self.log, "critic.train_values");
        assert!(!self.offloaded && prompts.len() == targets.len());
        let (mean, _) = mean_std(targets);
        let loss = (mean - self.value).powi(2);
        self.value += 0.5 * (mean - self.value);
        Ok(loss)
    }
    fn is_offloaded(&self) -> bool {
        self.offloaded
    }
    fn offload(&mut self) -> Result<OffloadStats, BackendError> {
        note(&self.log, "critic.offload");
        self.offloaded = true;
        Ok(stats(pause(&self.memory, &[MemoryTag::Params])))
    }
    fn onload(&mut self) -> Result<OffloadStats, BackendError> {
        note(&self.log, "critic.onload");
        self.offloaded = false;
        Ok(stats(resume(&self.memory, &[MemoryTag::Params])))
    }
    fn assist_save(&mut self) -> Result<(), BackendError> {
        note(&self.log, "critic.assist_save");
        Ok(())
    }
    fn save(&mut self, dir: &Path) -> Result<(), BackendError> {
        note(&self.log, "critic.save");
        std::fs::write(dir.join("value"), self.value.to_string()).unwrap();
        Ok(())
    }
    fn load(&mut self, dir: &Path) -> Result<(), BackendError> {
        note(&self.log, "critic.load");
        self.value = std::fs::read_to_string(dir.join("value"))
            .unwrap()
            .parse()
            .unwrap();
        Ok(())
    }
}

/// An engine that samples digits and EOS from a generator keyed by the seed, the prompt, the
/// sample and the weights it was sent, so a change of weights changes the rollout.
struct FakeEngine {
    log: Log,
    memory: Arc<MemoryManager>,
    _buffers: Vec<Buffer>,
    weights: f32,
    kv_offloaded: bool,
    weights_offloaded: bool,
    tokenizer: ByteTokenizer,
    stop_during_generate: Option<Arc<AtomicBool>>,
    /// The stop tokens of every generate call.
    stop_tokens: Arc<Mutex<Vec<Vec<u32>>>>,
    /// Takes the trainer's weights on the device, as a GPU engine on the trainer's device would.
    takes_device_weights: bool,
}

impl FakeEngine {
    fn new(log: &Log) -> Self {
        let (memory, buffers) = memory(&[
            (MemoryTag::Weights, BackupPolicy::Host, 3 * MIB),
            (MemoryTag::KvCache, BackupPolicy::None, 8 * MIB),
        ]);
        Self {
            log: Arc::clone(log),
            memory,
            _buffers: buffers,
            weights: 0.0,
            kv_offloaded: false,
            weights_offloaded: false,
            tokenizer: tokenizer(),
            stop_during_generate: None,
            stop_tokens: Arc::default(),
            takes_device_weights: false,
        }
    }
}

fn failure(action: &'static str, reason: &str) -> EngineError {
    EngineError::Engine {
        action,
        source: reason.to_owned().into(),
    }
}

impl RolloutEngine for FakeEngine {
    fn generate(
        &mut self,
        prompts: &[Vec<u32>],
        n: usize,
        sampling: &Sampling,
    ) -> Result<Vec<Vec<Sample>>, EngineError> {
        note(&self.log, "engine.generate");
        if self.kv_offloaded || self.weights_offloaded {
            return Err(failure("generate", "offloaded"));
        }
        if let Some(flag) = &self.stop_during_generate {
            flag.store(true, Ordering::SeqCst);
        }
        self.stop_tokens
            .lock()
            .unwrap()
            .push(sampling.stop_tokens.clone());
        let eos = self.tokenizer.eos;
        Ok((0..prompts.len())
            .map(|i| {
                (0..n)
                    .map(|j| {
                        let key = sampling.seed
                            ^ (i * 131 + j) as u64
                            ^ u64::from(self.weights.to_bits());
                        let mut rng = ChaCha8Rng::seed_from_u64(key);
                        let mut tokens = Vec::new();
                        while tokens.len() < sampling.max_new_tokens && tokens.last() != Some(&eos)
                        {
                            let pick = rng.random_range(0..11u32);
                            tokens.push(if pick == 10 {
                                eos
                            } else {
                                u32::from(b'0') + pick
                            });
                        }
                        Sample {
                            logprobs: vec![-2.0; tokens.len()],
                            stopped: tokens.last() == Some(&eos),
                            tokens,
                        }
                    })
                    .collect()
            })
            .collect())
    }
    fn flush_cache(&mut self) -> Result<(), EngineError> {
        note(&self.log, "engine.flush_cache");
        Ok(())
    }
    fn offload_kv(&mut self) -> Result<Vec<OffloadReport>, EngineError> {
        note(&self.log, "engine.offload_kv");
        self.kv_offloaded = true;
        Ok(pause(&self.memory, &[MemoryTag::KvCache]))
    }
    fn offload_weights(&mut self) -> Result<Vec<OffloadReport>, EngineError> {
        note(&self.log, "engine.offload_weights");
        self.weights_offloaded = true;
        Ok(pause(&self.memory, &[MemoryTag::Weights]))
    }
    fn onload_weights(&mut self) -> Result<Vec<OffloadReport>, EngineError> {
        note(&self.log, "engine.onload_weights");
        self.weights_offloaded = false;
        Ok(resume(&self.memory, &[MemoryTag::Weights]))
    }
    fn onload_kv(&mut self) -> Result<Vec<OffloadReport>, EngineError> {
        note(&self.log, "engine.onload_kv");
        self.kv_offloaded = false;
        Ok(resume(&self.memory, &[MemoryTag::KvCache]))
    }
    fn update_weights(&mut self, bucket: &WeightBucket) -> Result<(), EngineError> {
        note(&self.log, "engine.update_weights");
        if self.weights_offloaded {
            return Err(failure("update the weights", "weights are offloaded"));
        }
        if bucket.tensors.first().is_some_and(|t| t.name == "t0") {
            self.weights = 0.0;
        }
        self.weights += bucket.tensors.iter().flat_map(|t| &t.data).sum::<f32>();
        Ok(())
    }
    fn accepts_device_weights(&self, _: &DeviceWeights) -> bool {
        self.takes_device_weights
    }
    fn copy_device_weights(&mut self, weights: &DeviceWeights) -> Result<Option<u64>, EngineError> {
        note(&self.log, "engine.copy_device_weights");
        if self.weights_offloaded {
            return Err(failure("copy the weights", "weights are offloaded"));
        }
        Ok(self.takes_device_weights.then(|| weights.bytes()))
    }
    fn resident_bytes(&self) -> Vec<(MemoryTag, u64)> {
        self.memory.resident_bytes()
    }
}

fn tokenizer() -> ByteTokenizer {
    ByteTokenizer::from_config(&LlamaConfig::preset("tiny").unwrap()).unwrap()
}

/// Colocated, both offloads on at both levels, 2 prompts x 4 samples, one optimizer step per
/// rollout, buckets of two of the actor's four tensors.
fn colocated(steps: u64) -> LoopConfig {
    LoopConfig {
        steps,
        rollout_batch_size: 2,
        n_samples_per_prompt: 4,
        global_batch_size: 8,
        seed: 17,
        task: Task::Reverse,
        sft_warmup_steps: 0,
        temperature: 1.0,
        offload_train: true,
        offload_rollout: true,
        offload_kv: true,
        offload_weights: true,
        offload_graphs: false,
        bucket_bytes: 2 * 256 * 4,
        device_bytes: None,
        margin_bytes: 0,
        offload_when_needed: false,
        patience: Patience {
            retries: 0,
            wait: std::time::Duration::ZERO,
        },
        export_while_offloaded: false,
        advantage_estimator: AdvantageEstimator::Grpo,
        save: None,
        save_interval: None,
        load: None,
        metrics: None,
        memory_timeline: None,
        save_options: None,
        rl: RlOptions::default(),
    }
}

fn orchestrator(config: LoopConfig, log: &Log) -> Orchestrator {
    Orchestrator::new(
        config,
        Box::new(FakeActor::new(log)),
        Box::new(FakeEngine::new(log)),
        tokenizer(),
    )
}

fn run(o: &mut Orchestrator) -> (RunSummary, Vec<StepMetrics>) {
    let mut steps = Vec::new();
    let summary = o.run(&mut |m| steps.push(m.clone())).unwrap();
    (summary, steps)
}

fn calls(log: &Log) -> Vec<String> {
    log.lock().unwrap().clone()
}

const START: [&str; 9] = [
    "engine.flush_cache",
    "engine.offload_kv",
    "engine.offload_weights",
    "actor.export_weights",
    "actor.offload",
    "engine.onload_weights",
    "engine.update_weights",
    "engine.update_weights",
    "engine.onload_kv",
];

#[test]
fn colocated_loop_runs_design_section_8_in_order() {
    let log = Log::default();
    let save = tempfile::tempdir().unwrap();
    let mut config = colocated(2);
    config.save = Some(save.path().to_path_buf());
    config.save_interval = Some(1);
    let mut o = orchestrator(config, &log);
    let (summary, steps) = run(&mut o);
    assert_eq!(summary.steps, 2);
    assert!(!summary.interrupted);
    assert_eq!(steps.len(), 2);
    let step = [
        "engine.generate",
        "engine.flush_cache",
        "engine.offload_kv",
        "engine.offload_weights",
        "actor.onload",
        "actor.train_step",
        "actor.save",
        "actor.export_weights",
        "actor.offload",
        "engine.onload_weights",
        "engine.update_weights",
        "engine.update_weights",
        "engine.onload_kv",
    ];
    let expected: Vec<&str> = START.iter().chain(&step).chain(&step).copied().collect();
    assert_eq!(calls(&log), expected);
}

#[test]
fn disabled_offloads_are_never_called() {
    let log = Log::default();
    let config = LoopConfig {
        offload_train: false,
        offload_rollout: false,
        offload_kv: false,
        offload_weights: false,
        offload_graphs: false,
        ..colocated(2)
    };
    let (_, steps) = run(&mut orchestrator(config, &log));
    let step = [
        "engine.generate",
        "actor.train_step",
        "actor.export_weights",
        "engine.update_weights",
        "engine.update_weights",
    ];
    let start = [
        "actor.export_weights",
        "engine.update_weights",
        "engine.update_weights",
    ];
    let expected: Vec<&str> = start.iter().chain(&step).chain(&step).copied().collect();
    assert_eq!(calls(&log), expected);
    for m in &steps {
        for phase in [
            Phase::OffloadRollout,
            Phase::OnloadTrain,
            Phase::OffloadTrain,
        ] {
            assert_eq!(m.bytes(phase), 0, "{phase:?} moved bytes with offload off");
        }
    }
}

#[test]
fn kv_cache_level_offloads_only_the_kv_cache_after_each_rollout() {
    let log = Log::default();
    let config = LoopConfig {
        offload_weights: false,
        offload_graphs: false,
        ..colocated(1)
    };
    run(&mut orchestrator(config, &log));
    let step_calls: Vec<String> = calls(&log).split_off(START.len());
    assert_eq!(
        step_calls,
        [
            "engine.generate",
            "engine.flush_cache",
            "engine.offload_kv",
            "actor.onload",
            "actor.train_step",
            "actor.export_weights",
            "actor.offload",
            "engine.update_weights",
            "engine.update_weights",
            "engine.onload_kv",
        ]
    );
}

#[test]
fn offloaded_tags_hold_no_device_memory_and_the_peak_stays_below_both_phases() {
    let log = Log::default();
    let mut o = orchestrator(colocated(2), &log);
    let (_, steps) = run(&mut o);
    let held = |label: &str, tag: &str| {
        let sample = o
            .timeline()
            .samples()
            .iter()
            .find(|s| s.label == label)
            .unwrap_or_else(|| panic!("no sample {label}"));
        sample
            .tags
            .iter()
            .find(|(n, _)| n == tag)
            .map_or(0, |(_, b)| *b)
    };
    for tag in ["rollout/kv_cache", "rollout/weights"] {
        assert_eq!(held("step 2 after_offload_rollout", tag), 0, "{tag}");
        assert!(held("step 2 after_generate", tag) > 0, "{tag}");
    }
    for tag in ["train/params", "train/grads"] {
        assert_eq!(held("step 2 after_offload_train", tag), 0, "{tag}");
        assert!(held("step 2 after_train", tag) > 0, "{tag}");
    }
    let train: u64 = (6 + 4) * MIB as u64;
    let rollout: u64 = (3 + 8) * MIB as u64;
    for m in &steps {
        assert!(
            m.peak_device_memory_bytes < train + rollout,
            "peak {} not below {}",
            m.peak_device_memory_bytes,
            train + rollout
        );
        assert!(m.bytes(Phase::OffloadTrain) >= 6 * MIB as u64);
        assert!(m.bytes(Phase::OnloadWeights) >= 3 * MIB as u64);
        assert_eq!(m.bytes(Phase::Sync), 4 * 256 * 4);
        assert_eq!(m.device_memory_bytes.len(), 10);
    }
}

/// One JSON value per line of `path`.
fn json_lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn stop_strings_cut_the_samples_the_reward_sees_and_stop_ids_join_the_eos() {
    let dir = tempfile::tempdir().unwrap();
    // One step: its rollout depends on the seed and the starting weights alone, so both runs
    // sample the same completions (digits, some ended by EOS) before any cut.
    let rollout = |stops: &[&str], name: &str| {
        let mut config = colocated(1);
        config.rollout_batch_size = 8;
        config.global_batch_size = 32;
        config.rl.stop_strings = stops.iter().map(|s| (*s).to_owned()).collect();
        config.rl.stop_token_ids = vec![5];
        config.rl.dump_rollouts = Some(dir.path().join(name));
        let log = Log::default();
        let engine = FakeEngine::new(&log);
        let seen = Arc::clone(&engine.stop_tokens);
        let mut o = Orchestrator::new(
            config,
            Box::new(FakeActor::new(&log)),
            Box::new(engine),
            tokenizer(),
        );
        let (_, steps) = run(&mut o);
        let seen = seen.lock().unwrap().clone();
        (
            json_lines(&dir.path().join(name)),
            steps[0].rl.clone(),
            seen,
        )
    };
    let (plain, plain_rl, seen) = rollout(&[], "plain.jsonl");
    let (cut, cut_rl, _) = rollout(&["7", "34"], "cut.jsonl");
    let eos = tokenizer().eos;
    assert_eq!(
        seen,
        [vec![eos, 5]],
        "the stop ids join the tokenizer's EOS"
    );
    let (mut cuts, mut truncated, mut tokens) = (0, 0, 0);
    for (p, c) in plain.iter().zip(&cut) {
        let text = p["response"].as_str().unwrap();
        let first = ["7", "34"]
            .iter()
            .filter_map(|s| text.find(s).map(|i| i + s.len()))
            .min();
        let (response, len, stopped) = match first {
            Some(end) => {
                cuts += 1;
                let stop = if text[..end].ends_with('7') { 1 } else { 2 };
                (&text[..end - stop], end, true)
            }
            None => (
                text,
                p["tokens"].as_u64().unwrap() as usize,
                p["stopped"].as_bool().unwrap(),
            ),
        };
        assert_eq!(c["response"], response, "{p} cut to {c}");
        assert_eq!(
            c["tokens"].as_u64().unwrap() as usize,
            len,
            "{p} cut to {c}"
        );
        assert_eq!(c["stopped"], stopped, "{p} cut to {c}");
        truncated += usize::from(!stopped);
        tokens += len;
    }
    let count = plain.len() as f32;
    assert!(
        cuts > 0 && cuts < plain.len() && truncated > 0,
        "{cuts} cut, {truncated} truncated of {count}"
    );
    assert_eq!(
        cut_rl.truncated_fraction,
        truncated as f32 / count,
        "a cut sample stopped"
    );
    assert!(cut_rl.truncated_fraction < plain_rl.truncated_fraction);
    assert_eq!(cut_rl.response_len_mean, tokens as f32 / count);
}

#[test]
fn metrics_file_has_a_line_per_step_and_the_timeline_is_drawn() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = colocated(3);
    config.metrics = Some(dir.path().join("metrics.jsonl"));
    config.memory_timeline = Some(dir.path().join("timeline.svg"));
    let log = Log::default();
    let (_, steps) = run(&mut orchestrator(config, &log));
    let text = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 4, "a header and three steps");
    assert!(lines[0]["header"]["run_id"].is_string(), "{}", lines[0]);
    for (line, m) in lines[1..].iter().zip(&steps) {
        assert_eq!(line["step"], m.step);
        assert!(
            line.get("entropy").is_none(),
            "an actor that does not measure the entropy gets no entropy key, not a 0: {line}"
        );
        assert_eq!(line["reward_mean"].as_f64().unwrap() as f32, m.reward_mean);
        assert!(
            line["device_memory_bytes"]["after_onload_kv"]
                .as_u64()
                .unwrap()
                > 0
        );
    }
    let svg = std::fs::read_to_string(dir.path().join("timeline.svg")).unwrap();
    assert!(svg.contains("rollout/kv_cache") && svg.contains("train/params"));
}
