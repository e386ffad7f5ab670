//! The colocated RL loop end to end (issue 8): each training backend and the rollout engine on
//! CPU devices, driven by the orchestrator on the tiny preset.

// Helpers of a test crate are test code: they may unwrap and panic.
#![allow(clippy::unwrap_used, clippy::panic)]

use std::sync::Arc;

use miles_core::backend::TrainBackend;
use miles_core::config::TrainBackendKind as BackendChoice;
use miles_core::model::{ByteTokenizer, LlamaConfig};
use miles_core::orchestrator::{LmCritic, LoopConfig, Orchestrator, RunSummary};
use miles_core::{
    AdvantageEstimator, BackupPolicy, CpuDevice, ManagerSettings, MemoryManager, OffloadTarget,
    Phase, RolloutOffloadLevel, Settings, StepMetrics, Task,
};
use miles_infer::{Engine, EngineConfig, InferenceController};

const BACKENDS: [BackendChoice; 2] = [BackendChoice::Megatron, BackendChoice::Fsdp];

/// The CPU demo's recipe, smaller: 8 prompts x 8 samples, one optimizer step per rollout.
fn settings(
    backend: BackendChoice,
    colocate: bool,
    target: OffloadTarget,
    levels: &[RolloutOffloadLevel],
) -> Settings {
    Settings {
        train_backend: backend,
        colocate,
        offload_train: colocate,
        offload_rollout: colocate,
        offload_rollout_level: levels.to_vec(),
        offload_train_target: target,
        train_memory_margin_bytes: 0,
        device_memory_gib: 1.0,
        preset: "tiny".into(),
        steps: 3,
        rollout_batch_size: 8,
        n_samples_per_prompt: 8,
        global_batch_size: 64,
        lr: 5e-3,
        seed: 42,
        task: Task::Repeat,
        sft_warmup_steps: 4,
        ..Settings::default()
    }
}

fn tiny() -> LlamaConfig {
    LlamaConfig::preset("tiny").unwrap()
}

/// A fresh backend: the loop, not the backend, restores `--load`.
fn trainer(s: &Settings) -> Box<dyn TrainBackend> {
    let s = &Settings {
        load: None,
        ..s.clone()
    };
    match s.train_backend {
        BackendChoice::Megatron => {
            Box::new(miles_megatron::MegatronTrainer::from_settings(s).unwrap())
        }
        BackendChoice::Fsdp => Box::new(miles_fsdp::FsdpBackend::from_settings(s).unwrap()),
    }
}

fn engine(s: &Settings) -> (InferenceController, Arc<MemoryManager>) {
    let device = Arc::new(CpuDevice::new(s.device_memory_bytes()));
    let settings = ManagerSettings {
        margin_bytes: 0,
        disk: None,
    };
    let memory = Arc::new(MemoryManager::new(device, settings).unwrap());
    // As `miles train` builds it: weights dropped on offload, since a full sync follows.
    let config = EngineConfig {
        weights_policy: BackupPolicy::None,
        ..EngineConfig::from_settings(s)
    };
    let engine = Engine::new(Arc::clone(&memory), tiny(), config).unwrap();
    (InferenceController::from_settings(engine, s), memory)
}

fn orchestrator(s: &Settings) -> Orchestrator {
    let (engine, _) = engine(s);
    let tokenizer = ByteTokenizer::from_config(&tiny()).unwrap();
    Orchestrator::new(
        LoopConfig::from_settings(s),
        trainer(s),
        Box::new(engine),
        tokenizer,
    )
}

fn run(o: &mut Orchestrator) -> (RunSummary, Vec<StepMetrics>) {
    let mut steps = Vec::new();
    let summary = o.run(&mut |m| steps.push(m.clone())).unwrap();
    (summary, steps)
}

fn rewards_and_losses(steps: &[StepMetrics]) -> Vec<(u32, u32, u32)> {
    steps
        .iter()
        .map(|m| {
            (
                m.reward_mean.to_bits(),
                m.reward_std.to_bits(),
                m.loss.to_bits(),
            )
        })
        .collect()
}

/// Colocated, both rollout levels, training state to the host.
fn colocated(backend: BackendChoice) -> Settings {
    use RolloutOffloadLevel::{KvCache, Weight};
    settings(backend, true, OffloadTarget::Host, &[KvCache, Weight])
}

#[test]
fn offload_changes_no_reward_and_no_loss_for_every_backend_target_and_level() {
    use RolloutOffloadLevel::{KvCache, Weight};
    let disk = tempfile::tempdir().unwrap();
    for backend in BACKENDS {
        let plain = settings(backend, false, OffloadTarget::Host, &[KvCache, Weight]);
        let (_, baseline) = run(&mut orchestrator(&plain));
        for target in [OffloadTarget::Host, OffloadTarget::Disk] {
            for levels in [&[KvCache][..], &[KvCache, Weight][..]] {
                let mut s = settings(backend, true, target, levels);
                if target == OffloadTarget::Disk {
                    s.offload_train_disk_dir = Some(disk.path().join(backend.as_str()));
                }
                let (_, steps) = run(&mut orchestrator(&s));
                let case = format!("{backend} target {target} levels {levels:?}");
                assert_eq!(
                    rewards_and_losses(&steps),
                    rewards_and_losses(&baseline),
                    "{case}"
                );
                for m in &steps {
                    assert!(m.bytes(Phase::OffloadTrain) > 0, "{case}");
                    assert!(m.bytes(Phase::OffloadRollout) > 0, "{case}");
                }
            }
        }
    }
}

#[test]
fn offloaded_tags_hold_no_device_memory_and_the_peak_stays_below_both_phases() {
    for backend in BACKENDS {
        let mut o = orchestrator(&colocated(backend));
        let (_, steps) = run(&mut o);
        let (mut rollout_need, mut train_need) = (0, 0);
        for sample in o.timeline().samples() {
            let held = |owner: &str| -> u64 {
                sample
                    .tags
                    .iter()
                    .filter(|(tag, _)| tag.starts_with(owner))
                    .map(|(_, bytes)| bytes)
                    .sum()
            };
            if sample.label.ends_with("after_offload_rollout") {
                assert_eq!(held("rollout/"), 0, "{backend}: {:?}", sample.tags);
            }
            if sample.label.ends_with("after_offload_train") {
                assert_eq!(held("train/"), 0, "{backend}: {:?}", sample.tags);
            }
            rollout_need = rollout_need.max(held("rollout/"));
            train_need = train_need.max(held("train/"));
        }
        assert!(rollout_need > 0 && train_need > 0, "{backend}");
        for m in &steps {
            assert!(
                m.peak_device_memory_bytes < rollout_need + train_need,
                "{backend}: peak {} not below {rollout_need} + {train_need}",
                m.peak_device_memory_bytes
            );
        }
    }
}

#[test]
fn metrics_hold_the_trainer_memory_read_from_the_backend_at_every_boundary() {
    for backend in BACKENDS {
        let mut o = orchestrator(&colocated(backend));
        let (_, steps) = run(&mut o);
        let samples = o.timeline().samples();
        // Known before the trainer first moves anything.
        let start: u64 = samples[0]
            .tags
            .iter()
            .filter(|(tag, _)| tag.starts_with("train/"))
            .map(|(_, bytes)| bytes)
            .sum();
        assert!(
            start > 1 << 20,
            "{backend}: {start} at {}",
            samples[0].label
        );
        for m in &steps {
            let at = |boundary: &str| {
                let label = format!("step {} {boundary}", m.step);
                let sample = samples
                    .iter()
                    .find(|s| s.label == label)
                    .unwrap_or_else(|| panic!("{backend}: no sample {label}"));
                let reported = m
                    .device_memory_bytes
                    .iter()
                    .find(|(name, _)| name == boundary)
                    .map(|(_, bytes)| *bytes);
                assert_eq!(reported, Some(sample.total()), "{backend}: {label}");
                let held = |owner: &str| -> u64 {
                    sample
                        .tags
                        .iter()
                        .filter(|(tag, _)| tag.starts_with(owner))
                        .map(|(_, bytes)| bytes)
                        .sum()
                };
                (held("train/"), held("rollout/"))
            };
            let (trained, _) = at("after_train");
            let (onloaded, _) = at("after_onload_train");
            // Parameters, optimizer state and gradients of the tiny preset: over 1 MiB.
            assert!(trained > 1 << 20, "{backend}: {trained} after train");
            assert!(onloaded > 1 << 20, "{backend}: {onloaded} after onload");
            // Near zero: whatever the trainer keeps on the device while asleep stays under 1%.
            let (asleep, _) = at("after_offload_train");
            assert!(
                asleep * 100 < trained,
                "{backend}: {asleep} of {trained} asleep"
            );
            let (_, rollout) = at("after_offload_rollout");
            let (_, generating) = at("after_generate");
            assert!(generating > 0, "{backend}");
            assert!(
                rollout * 100 < generating,
                "{backend}: {rollout} of {generating}"
            );
            let most = m.device_memory_bytes.iter().map(|(_, b)| *b).max();
            assert_eq!(Some(m.peak_device_memory_bytes), most, "{backend}");
        }
    }
}

#[test]
fn the_ci_sized_run_raises_the_mean_reward() {
    for backend in BACKENDS {
        let mut s = colocated(backend);
        s.steps = 20;
        s.rollout_batch_size = 16;
        s.global_batch_size = 128;
        s.sft_warmup_steps = 24;
        let (summary, _) = run(&mut orchestrator(&s));
        let r = &summary.reward_means;
        let window = |range: std::ops::Range<usize>| {
            r[range.clone()].iter().sum::<f32>() / range.len() as f32
        };
        let (start, end) = (window(0..5), window(15..20));
        assert!(
            end > start + 0.1,
            "{backend}: reward {start} -> {end}: {r:?}"
        );
    }
}

#[test]
fn resume_from_a_checkpoint_repeats_the_uninterrupted_run() {
    for backend in BACKENDS {
        let dir = tempfile::tempdir().unwrap();
        let mut s = colocated(backend);
        s.steps = 4;
        let (_, full) = run(&mut orchestrator(&s));
        let mut first = s.clone();
        first.steps = 2;
        first.save = Some(dir.path().to_path_buf());
        run(&mut orchestrator(&first));
        assert!(dir.path().join("latest").exists(), "{backend}");
        let mut second = s.clone();
        second.load = Some(dir.path().to_path_buf());
        let (summary, rest) = run(&mut orchestrator(&second));
        assert_eq!(summary.steps, 4, "{backend}");
        assert_eq!(rest.iter().map(|m| m.step).collect::<Vec<_>>(), [3, 4]);
        assert_eq!(
            rewards_and_losses(&rest),
            rewards_and_losses(&full[2..]),
            "{backend}"
        );
    }
}

#[test]
fn ppo_trains_and_offloads_the_critic_with_the_actor() {
    let tokenizer = ByteTokenizer::from_config(&tiny()).unwrap();
    for backend in BACKENDS {
        let (_, grpo) = run(&mut orchestrator(&colocated(backend)));
        let mut s = colocated(backend);
        s.advantage_estimator = AdvantageEstimator::Ppo;
        let critic = LmCritic::new(trainer(&s), tokenizer.pad);
        let mut o = orchestrator(&s).with_critic(Box::new(critic));
        let (summary, steps) = run(&mut o);
        assert_eq!(summary.steps, 3, "{backend}");
        for (ppo, grpo) in steps.iter().zip(&grpo) {
            assert!(ppo.loss.is_finite(), "{backend}");
            // The critic moves its own state too.
            assert!(
                ppo.bytes(Phase::OffloadTrain) > grpo.bytes(Phase::OffloadTrain),
                "{backend}"
            );
            assert!(
                ppo.bytes(Phase::OnloadTrain) > grpo.bytes(Phase::OnloadTrain),
                "{backend}"
            );
        }
    }
}
