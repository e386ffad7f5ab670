//! The weight sync's two paths: through the host (exported before or while the trainer sleeps)
//! and, when actor and engine share a device, a device copy before the trainer sleeps.

use half::bf16;

use super::*;
use crate::device::{Fence, GpuSlice};

/// Makes the fake actor offer device weights: a view of the first 1024 bf16 elements of its
/// params buffer, ready at once (a signalled fence).
fn on_device(actor: &mut FakeActor) {
    let params = GpuSlice::<bf16>::of(actor.buffers[0].range())
        .and_then(|all| all.sub(0, 1024))
        .unwrap();
    actor.device_weights = Some(DeviceWeights {
        device: Arc::clone(actor.memory.device()),
        params,
        ready: Fence::signalled(),
    });
}

/// A colocated run of `steps` whose actor shows device weights when `actor_shows` and whose
/// engine takes them when `engine_takes`; returns the calls, the metrics and the loop.
fn run_with(
    steps: u64,
    actor_shows: bool,
    engine_takes: bool,
) -> (Vec<String>, Vec<StepMetrics>, Orchestrator) {
    let log = Log::default();
    let mut actor = FakeActor::new(&log);
    if actor_shows {
        on_device(&mut actor);
    }
    let mut engine = FakeEngine::new(&log);
    engine.takes_device_weights = engine_takes;
    let mut o = Orchestrator::new(
        colocated(steps),
        Box::new(actor),
        Box::new(engine),
        tokenizer(),
    );
    let (_, metrics) = run(&mut o);
    (calls(&log), metrics, o)
}

fn held(o: &Orchestrator, label: &str, tag: &str) -> u64 {
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
}

#[test]
fn on_one_device_the_engine_copies_the_weights_before_the_trainer_sleeps() {
    let (calls, steps, o) = run_with(2, true, true);
    let start = [
        "engine.flush_cache",
        "engine.offload_kv",
        "engine.offload_weights",
        "engine.onload_weights",
        "engine.copy_device_weights",
        "actor.offload",
        "engine.onload_kv",
    ];
    let step = [
        "engine.generate",
        "engine.flush_cache",
        "engine.offload_kv",
        "engine.offload_weights",
        "actor.onload",
        "actor.train_step",
        "engine.onload_weights",
        "engine.copy_device_weights",
        "actor.offload",
        "engine.onload_kv",
    ];
    let expected: Vec<&str> = start.iter().chain(&step).chain(&step).copied().collect();
    assert_eq!(calls, expected);
    for m in &steps {
        assert_eq!(
            m.bytes(Phase::Sync),
            1024 * 2,
            "sync bytes of step {}",
            m.step
        );
        assert!(m.bytes(Phase::OffloadTrain) >= 6 * MIB as u64);
        assert!(m.bytes(Phase::OnloadWeights) >= 3 * MIB as u64);
    }
    // During the copy both weights are on the device, the kv cache is not.
    let full =
        |tag| held(&o, "step 2 after_generate", tag).max(held(&o, "step 2 after_train", tag));
    for tag in ["train/params", "rollout/weights"] {
        assert!(full(tag) > 0, "{tag}");
        assert_eq!(held(&o, "step 2 after_sync", tag), full(tag), "{tag}");
    }
    assert_eq!(held(&o, "step 2 after_sync", "rollout/kv_cache"), 0);
    assert_eq!(held(&o, "step 2 after_offload_train", "train/params"), 0);
    let start_weights = held(&o, "start after trainer sleep", "rollout/weights");
    assert_eq!(start_weights, full("rollout/weights"));
}

#[test]
fn without_both_sides_on_the_device_the_host_order_and_path_stay() {
    let (host, host_steps, _) = run_with(2, false, false);
    assert!(host.iter().any(|c| c == "actor.export_weights"));
    for (actor_shows, engine_takes) in [(true, false), (false, true)] {
        let (calls, steps, _) = run_with(2, actor_shows, engine_takes);
        assert_eq!(
            calls, host,
            "actor shows {actor_shows}, engine takes {engine_takes}"
        );
        for (m, h) in steps.iter().zip(&host_steps) {
            assert_eq!(m.bytes(Phase::Sync), h.bytes(Phase::Sync));
            assert_eq!(m.reward_mean, h.reward_mean);
        }
    }
}

#[test]
fn a_backend_that_exports_while_offloaded_syncs_after_it_sleeps() {
    let log = Log::default();
    let mut actor = FakeActor::new(&log);
    actor.exports_offloaded = true;
    let config = LoopConfig {
        export_while_offloaded: true,
        ..colocated(1)
    };
    let mut o = Orchestrator::new(
        config,
        Box::new(actor),
        Box::new(FakeEngine::new(&log)),
        tokenizer(),
    );
    run(&mut o);
    let tail = [
        "actor.offload",
        "engine.onload_weights",
        "actor.export_weights",
        "engine.update_weights",
        "engine.update_weights",
        "engine.onload_kv",
    ];
    let calls = calls(&log);
    assert_eq!(calls[calls.len() - tail.len()..], tail);
    assert_eq!(calls[3..9], tail);
}

#[test]
fn the_actor_memory_is_read_from_the_backend_from_the_start() {
    let log = Log::default();
    let mut o = orchestrator(colocated(2), &log);
    run(&mut o);
    let held = |label: &str| {
        let sample = o
            .timeline()
            .samples()
            .iter()
            .find(|s| s.label == label)
            .unwrap_or_else(|| panic!("no sample {label}"));
        ["train/params", "train/grads"].map(|tag| {
            sample
                .tags
                .iter()
                .find(|(n, _)| n == tag)
                .map_or(0, |(_, b)| *b)
        })
    };
    // Before the trainer ever offloads, its memory is already known.
    assert_eq!(held("start"), [6 * MIB as u64, 4 * MIB as u64]);
    assert_eq!(held("start after trainer sleep"), [0, 0]);
    assert_eq!(held("step 2 after_train"), [6 * MIB as u64, 4 * MIB as u64]);
    assert_eq!(held("step 2 after_onload_kv"), [0, 0]);
}
