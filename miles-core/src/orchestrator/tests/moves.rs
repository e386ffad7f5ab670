//! The actor's moves behind other work where the device holds both phases, and
//! `--offload-when-needed`.

use super::*;
use crate::memory::RegionState;

/// A colocated run of `steps` on a device of `device_bytes`; returns the calls, the metrics and
/// the outcome.
fn run_on(
    steps: u64,
    device_bytes: Option<u64>,
    when_needed: bool,
    fail_offload_at_step: Option<u64>,
) -> (
    Vec<String>,
    Vec<StepMetrics>,
    Result<RunSummary, OrchestratorError>,
) {
    let log = Log::default();
    let mut config = colocated(steps);
    config.device_bytes = device_bytes;
    config.margin_bytes = MIB as u64;
    config.offload_when_needed = when_needed;
    let mut actor = FakeActor::new(&log);
    actor.fail_offload_at_step = fail_offload_at_step;
    let mut o = Orchestrator::new(
        config,
        Box::new(actor),
        Box::new(FakeEngine::new(&log)),
        tokenizer(),
    );
    let mut metrics = Vec::new();
    let outcome = o.run(&mut |m| metrics.push(m.clone()));
    (calls(&log), metrics, outcome)
}

fn count(calls: &[String], call: &str) -> usize {
    calls.iter().filter(|c| *c == call).count()
}

fn losses(metrics: &[StepMetrics]) -> Vec<u32> {
    metrics.iter().map(|m| m.loss.to_bits()).collect()
}

/// Room for both phases (10 MiB of trainer, 11 of engine) and the 1 MiB margin.
const ROOMY: Option<u64> = Some(64 * MIB as u64);

#[test]
fn moves_behind_other_work_train_as_the_moves_in_line_and_count_their_own_time() {
    let (in_line_calls, in_line, outcome) = run_on(3, None, false, None);
    outcome.unwrap();
    let (behind_calls, behind, outcome) = run_on(3, ROOMY, false, None);
    outcome.unwrap();
    assert_eq!(
        losses(&behind),
        losses(&in_line),
        "the same training either way"
    );
    for call in ["actor.offload", "actor.onload", "engine.offload_kv"] {
        assert_eq!(
            count(&behind_calls, call),
            count(&in_line_calls, call),
            "{call}"
        );
    }
    for m in &in_line {
        assert_eq!(m.behind_seconds, [0.0; 9], "step {}", m.step);
    }
    for (m, line) in behind.iter().zip(&in_line) {
        assert!(m.behind(Phase::OnloadTrain) > 0.0, "step {}: {m:?}", m.step);
        assert!(
            m.behind(Phase::OffloadTrain) > 0.0,
            "step {}: {m:?}",
            m.step
        );
        // The previous tail's offload and this step's onload, joined before training, move
        // what one step's moves in line do.
        for phase in [Phase::OnloadTrain, Phase::OffloadTrain] {
            assert_eq!(
                m.bytes(phase),
                line.bytes(phase),
                "step {} {phase:?}",
                m.step
            );
        }
        assert!(m.bytes(Phase::OnloadTrain) > 0);
    }
}

#[test]
fn moves_behind_release_the_engine_s_memory_only_once_the_trainer_s_onload_is_done() {
    let (calls, _, outcome) = run_on(3, ROOMY, false, None);
    outcome.unwrap();
    // The onload starts on the mover's thread just before the rollout, so it may be logged on
    // either side of `engine.generate`; what must hold is that each step's release of the
    // engine's memory comes after that step's onload.
    let (mut generates, mut onloads, mut releases) = (0, 0, 0);
    for call in &calls {
        match call.as_str() {
            "engine.generate" => generates += 1,
            "actor.onload" => onloads += 1,
            "engine.offload_kv" if generates > 0 => {
                releases += 1;
                assert_eq!(
                    onloads, generates,
                    "the onload behind the rollout comes before the release: {calls:?}"
                );
            }
            _ => {}
        }
    }
    assert_eq!((generates, onloads, releases), (3, 3, 3), "{calls:?}");
}

#[test]
fn offload_when_needed_moves_nothing_where_the_device_holds_both_phases() {
    let (_, in_line, outcome) = run_on(3, None, false, None);
    outcome.unwrap();
    let (calls, resident, outcome) = run_on(3, ROOMY, true, None);
    outcome.unwrap();
    assert_eq!(losses(&resident), losses(&in_line));
    for call in [
        "actor.offload",
        "actor.onload",
        "engine.offload_kv",
        "engine.offload_weights",
    ] {
        assert_eq!(count(&calls, call), 0, "{call}: {calls:?}");
    }
    assert_eq!(
        count(&calls, "engine.update_weights"),
        2 * 4,
        "the weights still sync"
    );
    // A device too small for both: the flag moves what it must, in line.
    let (calls, small, outcome) = run_on(3, Some(16 * MIB as u64), true, None);
    outcome.unwrap();
    assert_eq!(count(&calls, "actor.offload"), 4, "{calls:?}");
    assert!(small.iter().all(|m| m.behind_seconds == [0.0; 9]));
}

#[test]
fn ranks_that_agree_the_phases_do_not_fit_everywhere_move_although_this_device_holds_both() {
    let log = Log::default();
    let mut config = colocated(3);
    config.device_bytes = ROOMY;
    config.margin_bytes = MIB as u64;
    config.offload_when_needed = true;
    let asked = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = std::sync::Arc::clone(&asked);
    let mut o = Orchestrator::new(
        config,
        Box::new(FakeActor::new(&log)),
        Box::new(FakeEngine::new(&log)),
        tokenizer(),
    )
    .with_fit_agreement(Box::new(move |fits| {
        // Another rank's device is too small.
        seen.lock().unwrap().push(fits);
        Ok(false)
    }));
    o.run(&mut |_| {}).unwrap();
    let calls = calls(&log);
    assert_eq!(count(&calls, "actor.offload"), 4, "{calls:?}");
    assert_eq!(count(&calls, "engine.offload_kv"), 4, "{calls:?}");
    // At the start (before and after the warm-up) and at each step's start; this device holds
    // both once the first peaks are in.
    let asked = asked.lock().unwrap().clone();
    assert_eq!(asked.len(), 5, "{asked:?}");
    assert!(asked[2..].iter().all(|&fits| fits), "{asked:?}");
}

#[test]
fn an_offload_that_fails_behind_the_rollout_fails_the_next_use_of_the_actor_with_its_cause() {
    let (calls, metrics, outcome) = run_on(3, ROOMY, false, Some(1));
    let err = outcome.unwrap_err();
    let mut text = err.to_string();
    let mut source = std::error::Error::source(&err);
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    assert!(
        text.contains("actor cannot offload") && text.contains("injected offload fault"),
        "{text}"
    );
    assert_eq!(
        metrics.len(),
        1,
        "step 1 finished; step 2 stopped at the failed move"
    );
    assert_eq!(count(&calls, "actor.train_step"), 1, "{calls:?}");
}

/// A colocated run of 2 steps, moves in line, whose actor's device is taken by another holder
/// after the actor's first offload (all but 4 MiB of its 256 MiB, for `held`, or for good).
fn run_short_of_memory(
    held: Option<std::time::Duration>,
    retries: u64,
) -> (Result<RunSummary, OrchestratorError>, Arc<MemoryManager>) {
    let log = Log::default();
    let mut config = colocated(2);
    config.patience = Patience {
        retries,
        wait: std::time::Duration::from_millis(50),
    };
    let mut actor = FakeActor::new(&log);
    actor.hog_after_offload = Some((252 * MIB, held));
    let memory = Arc::clone(&actor.memory);
    let mut o = Orchestrator::new(
        config,
        Box::new(actor),
        Box::new(FakeEngine::new(&log)),
        tokenizer(),
    );
    (o.run(&mut |_| {}), memory)
}

#[test]
fn an_onload_short_of_memory_waits_for_the_other_holder_and_goes_on() {
    let held = Some(std::time::Duration::from_millis(300));
    let (outcome, memory) = run_short_of_memory(held, 40);
    assert_eq!(outcome.unwrap().steps, 2);
    assert_eq!(
        memory.state(&MemoryTag::Params).unwrap(),
        RegionState::Paused
    );
    // Without retries the same holder (kept longer, so that a slow machine still meets it)
    // stops the run: the wait above is what carried it.
    let (outcome, _) = run_short_of_memory(Some(std::time::Duration::from_secs(5)), 0);
    assert!(
        matches!(
            outcome,
            Err(OrchestratorError::NoMemoryToResume { attempts: 1, .. })
        ),
        "{outcome:?}"
    );
}

#[test]
fn an_onload_that_never_finds_the_memory_fails_naming_the_bytes_and_keeps_every_tag_paused() {
    let (outcome, memory) = run_short_of_memory(None, 2);
    let err = outcome.unwrap_err();
    let OrchestratorError::NoMemoryToResume {
        missing, attempts, ..
    } = &err
    else {
        panic!("{err}");
    };
    assert_eq!(*attempts, 3);
    assert!(*missing > 0, "{err}");
    let text = err.to_string();
    for words in [
        "bytes of device memory missing",
        "nothing is lost",
        "--train-memory-margin-bytes",
    ] {
        assert!(text.contains(words), "{words:?} in {text}");
    }
    for tag in TRAIN_TAGS {
        assert_eq!(memory.state(&tag).unwrap(), RegionState::Paused, "{tag}");
    }
}

#[test]
fn the_trainer_s_state_comes_back_bit_exact_after_moves_behind_the_engine_s() {
    let log = Log::default();
    let mut config = colocated(3);
    config.device_bytes = ROOMY;
    let actor = FakeActor::new(&log);
    let (memory, params) = (Arc::clone(&actor.memory), actor.buffers[0].range());
    let mut rng = ChaCha8Rng::seed_from_u64(91);
    let bytes: Vec<u8> = (0..params.len).map(|_| rng.random()).collect();
    memory.device().write(&bytes, params).unwrap();
    let mut o = Orchestrator::new(
        config,
        Box::new(actor),
        Box::new(FakeEngine::new(&log)),
        tokenizer(),
    );
    let (_, metrics) = run(&mut o);
    assert!(
        metrics
            .iter()
            .all(|m| m.behind_seconds.iter().sum::<f64>() > 0.0)
    );
    // The run ends with the trainer asleep: wake its parameters and read them.
    memory.resume(&MemoryTag::Params).unwrap();
    let mut back = vec![0u8; params.len];
    memory.device().read(params, &mut back).unwrap();
    assert!(
        back == bytes,
        "the parameters changed across four cycles behind the engine"
    );
}

#[test]
fn the_memory_timeline_shows_each_move_that_ran_behind_other_work() {
    for (device_bytes, behind) in [(ROOMY, true), (None, false)] {
        let log = Log::default();
        let mut config = colocated(3);
        config.device_bytes = device_bytes;
        config.margin_bytes = MIB as u64;
        let mut o = Orchestrator::new(
            config,
            Box::new(FakeActor::new(&log)),
            Box::new(FakeEngine::new(&log)),
            tokenizer(),
        );
        o.run(&mut |_| {}).unwrap();
        let moves = o.timeline().moves();
        let named = |name: &str| moves.iter().filter(|m| m.name == name).count();
        if behind {
            assert!(named("offload_train behind") >= 2, "{moves:?}");
            assert!(named("onload_train behind") >= 2, "{moves:?}");
            // The run's last offload ends after its last sample: spans may reach past it.
            for span in moves {
                assert!(0.0 <= span.start && span.start <= span.end, "{span:?}");
            }
            let starts: Vec<f64> = moves.iter().map(|m| m.start).collect();
            assert!(
                starts.windows(2).all(|w| w[0] <= w[1]),
                "recorded in the order they ran: {moves:?}"
            );
        } else {
            assert!(moves.is_empty(), "moves in line are phases: {moves:?}");
        }
    }
}
