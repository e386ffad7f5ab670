//! A run's life past its steps: checkpoints and resuming, stops (the flag, a non-finite loss),
//! outputs refused up front, PPO's critic, the supervised warm-up.

use super::*;

#[test]
fn resume_from_a_checkpoint_repeats_the_uninterrupted_run() {
    let dir = tempfile::tempdir().unwrap();
    let full_log = Log::default();
    let (_, full) = run(&mut orchestrator(colocated(4), &full_log));

    let mut first = colocated(2);
    first.save = Some(dir.path().to_path_buf());
    let log = Log::default();
    run(&mut orchestrator(first, &log));

    let mut second = colocated(4);
    second.load = Some(dir.path().to_path_buf());
    let log = Log::default();
    let mut resumed = orchestrator(second, &log);
    let (summary, rest) = run(&mut resumed);
    assert_eq!(calls(&log)[0], "actor.load");
    assert_eq!(summary.steps, 4);
    assert_eq!(rest.iter().map(|m| m.step).collect::<Vec<_>>(), [3, 4]);
    for (a, b) in full[2..].iter().zip(&rest) {
        assert_eq!(
            (a.reward_mean, a.reward_std, a.loss),
            (b.reward_mean, b.reward_std, b.loss)
        );
    }
    assert_eq!(
        summary.reward_means,
        full.iter().map(|m| m.reward_mean).collect::<Vec<_>>()
    );
}

#[test]
fn stop_flag_ends_the_loop_after_the_phase_in_progress() {
    let log = Log::default();
    let actor = FakeActor::new(&log);
    let mut engine = FakeEngine::new(&log);
    // The engine raises the flag mid-generation, as Ctrl-C would.
    let flag = Arc::new(AtomicBool::new(false));
    engine.stop_during_generate = Some(Arc::clone(&flag));
    let mut o = Orchestrator::new(colocated(3), Box::new(actor), Box::new(engine), tokenizer())
        .with_stop_flag(flag);
    let mut seen = 0;
    let summary = o.run(&mut |_| seen += 1).unwrap();
    assert!(summary.interrupted);
    assert_eq!((seen, summary.steps), (0, 0));
    let calls = calls(&log);
    assert_eq!(calls[START.len()..], ["engine.generate"]);
}

/// An agreement that records each rank's flag it is given and answers `peer(call)` or the flag.
fn agreement(
    seen: &Arc<std::sync::Mutex<Vec<bool>>>,
    peer: fn(usize) -> Result<bool, crate::comm::CommError>,
) -> super::super::StopAgreement {
    let seen = Arc::clone(seen);
    Box::new(move |flag| {
        let mut seen = seen.lock().unwrap();
        seen.push(flag);
        Ok(peer(seen.len())? || flag)
    })
}

#[test]
fn with_a_stop_agreement_the_flag_stops_the_loop_after_the_step_in_progress() {
    let log = Log::default();
    let mut engine = FakeEngine::new(&log);
    let flag = Arc::new(AtomicBool::new(false));
    engine.stop_during_generate = Some(Arc::clone(&flag));
    let asked = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut o = Orchestrator::new(
        colocated(3),
        Box::new(FakeActor::new(&log)),
        Box::new(engine),
        tokenizer(),
    )
    .with_stop_flag(flag)
    .with_stop_agreement(agreement(&asked, |_| Ok(false)));
    let (summary, steps) = run(&mut o);
    assert!(summary.interrupted);
    assert_eq!((summary.steps, steps.len()), (1, 1));
    // Once after the start sequence, once after step 1, where the flag was up.
    assert_eq!(*asked.lock().unwrap(), [false, true]);
    let calls = calls(&log);
    assert!(calls.contains(&"actor.train_step".to_string()), "{calls:?}");
}

#[test]
fn a_peer_s_stop_ends_every_rank_after_the_same_step() {
    let log = Log::default();
    let asked = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut o = orchestrator(colocated(5), &log)
        .with_stop_agreement(agreement(&asked, |call| Ok(call == 3)));
    let (summary, steps) = run(&mut o);
    assert!(summary.interrupted);
    assert_eq!((summary.steps, steps.len()), (2, 2));
    assert_eq!(*asked.lock().unwrap(), [false, false, false]);
}

#[test]
fn ranks_that_cannot_agree_end_the_run_with_the_cause() {
    let log = Log::default();
    let asked = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut o = orchestrator(colocated(5), &log).with_stop_agreement(agreement(&asked, |call| {
        if call == 2 {
            Err(crate::comm::CommError::PeerGone {
                op: "gather",
                rank: 0,
                peer: 1,
            })
        } else {
            Ok(false)
        }
    }));
    let error = o.run(&mut |_| {}).unwrap_err();
    assert!(
        matches!(error, OrchestratorError::Agreement { .. }),
        "{error}"
    );
    assert!(error.to_string().contains("whether to stop"), "{error}");
    // Whether both phases fit is agreed too, and a peer gone there ends the run alike.
    let log = Log::default();
    let mut o = orchestrator(colocated(5), &log).with_fit_agreement(Box::new(|_| {
        Err(crate::comm::CommError::PeerGone {
            op: "max",
            rank: 0,
            peer: 1,
        })
    }));
    let error = o.run(&mut |_| {}).unwrap_err();
    assert!(error.to_string().contains("hold both phases"), "{error}");
}

/// The lines of a metrics file.
fn metrics_lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The step of `save`'s latest checkpoint, checking that no save in progress is left.
fn latest_step(save: &Path) -> u64 {
    for entry in std::fs::read_dir(save).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        assert!(name == "latest" || name.starts_with("step-"), "{name} left");
    }
    let dir = super::state::resolve_checkpoint(save).unwrap();
    LoopState::read(&dir).unwrap().step
}

#[test]
fn a_stop_after_training_writes_that_step_s_metrics_and_saves_it() {
    let dir = tempfile::tempdir().unwrap();
    let log = Log::default();
    let flag = Arc::new(AtomicBool::new(false));
    let mut actor = FakeActor::new(&log);
    actor.stop_during_train = Some(Arc::clone(&flag));
    let config = LoopConfig {
        save: Some(dir.path().join("ckpt")),
        metrics: Some(dir.path().join("m.jsonl")),
        ..colocated(5)
    };
    let mut o = Orchestrator::new(
        config,
        Box::new(actor),
        Box::new(FakeEngine::new(&log)),
        tokenizer(),
    )
    .with_stop_flag(flag);
    let (summary, steps) = run(&mut o);
    assert!(summary.interrupted);
    assert_eq!((summary.steps, steps.len()), (1, 1));
    let lines = metrics_lines(&dir.path().join("m.jsonl"));
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(
        (lines[1]["step"].as_u64(), lines[1]["interrupted"].as_bool()),
        (Some(1), Some(true))
    );
    assert_eq!(latest_step(&dir.path().join("ckpt")), 1);
}

#[test]
fn a_stop_while_the_trainer_sleeps_wakes_it_to_save_the_last_step() {
    let dir = tempfile::tempdir().unwrap();
    let log = Log::default();
    let flag = Arc::new(AtomicBool::new(false));
    let mut engine = FakeEngine::new(&log);
    engine.stop_during_generate = Some(Arc::clone(&flag));
    let config = LoopConfig {
        save: Some(dir.path().join("ckpt")),
        ..colocated(5)
    };
    let mut o = Orchestrator::new(
        config,
        Box::new(FakeActor::new(&log)),
        Box::new(engine),
        tokenizer(),
    )
    .with_stop_flag(flag);
    let (summary, steps) = run(&mut o);
    assert!(summary.interrupted && steps.is_empty());
    assert_eq!(latest_step(&dir.path().join("ckpt")), 0);
    let calls = calls(&log);
    assert_eq!(
        calls[START.len()..],
        ["engine.generate", "actor.onload", "actor.save"]
    );
}

#[test]
fn a_non_finite_loss_stops_the_run_naming_the_step_and_saves_nothing_of_it() {
    let dir = tempfile::tempdir().unwrap();
    let log = Log::default();
    let mut actor = FakeActor::new(&log);
    actor.nan_from_step = Some(3);
    let config = LoopConfig {
        save: Some(dir.path().join("ckpt")),
        save_interval: Some(1),
        metrics: Some(dir.path().join("m.jsonl")),
        ..colocated(5)
    };
    let mut o = Orchestrator::new(
        config,
        Box::new(actor),
        Box::new(FakeEngine::new(&log)),
        tokenizer(),
    );
    let error = o.run(&mut |_| {}).unwrap_err();
    assert!(
        matches!(
            error,
            OrchestratorError::NonFinite {
                step: 3,
                what: "loss",
                ..
            }
        ),
        "{error}"
    );
    assert!(error.to_string().contains("step 3 is NaN"), "{error}");
    assert_eq!(latest_step(&dir.path().join("ckpt")), 2);
    let lines = metrics_lines(&dir.path().join("m.jsonl"));
    assert_eq!(lines.len(), 3, "a header and the two finite steps");
}

#[test]
fn output_locations_that_cannot_be_written_are_refused_before_anything_runs() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, "x").unwrap();
    std::fs::write(dir.path().join("notes"), "my notes\n").unwrap();
    let log = Log::default();
    let config = LoopConfig {
        save: Some(file.join("ckpt")),
        metrics: Some(dir.path().join("notes")),
        memory_timeline: Some(dir.path().to_path_buf()),
        ..colocated(2)
    };
    let error = orchestrator(config, &log).run(&mut |_| {}).unwrap_err();
    match &error {
        OrchestratorError::Outputs { problems } => assert_eq!(problems.len(), 3, "{error}"),
        other => panic!("want outputs, got {other}"),
    }
    assert!(calls(&log).is_empty(), "work ran: {:?}", calls(&log));
}

#[test]
fn ppo_trains_and_offloads_the_critic_with_the_actor() {
    let log = Log::default();
    let critic = FakeCritic::new(&log);
    let config = LoopConfig {
        advantage_estimator: AdvantageEstimator::Ppo,
        ..colocated(1)
    };
    let mut o = orchestrator(config, &log).with_critic(Box::new(critic));
    run(&mut o);
    let calls = calls(&log);
    let pos = |c: &str| {
        calls
            .iter()
            .rposition(|x| x == c)
            .unwrap_or_else(|| panic!("{c} missing"))
    };
    assert!(pos("actor.onload") < pos("critic.onload"));
    assert!(pos("critic.onload") < pos("critic.values"));
    assert!(pos("critic.values") < pos("actor.train_step"));
    assert!(pos("actor.train_step") < pos("critic.train_values"));
    assert!(pos("actor.offload") < pos("critic.offload"));
    assert_eq!(calls.iter().filter(|c| *c == "critic.offload").count(), 2);
    let sample = o
        .timeline()
        .samples()
        .iter()
        .find(|s| s.label == "step 1 after_offload_train")
        .unwrap();
    assert!(
        sample
            .tags
            .iter()
            .any(|(n, b)| n == "critic/params" && *b == 0)
    );
}

#[test]
fn ppo_without_a_critic_is_refused_before_anything_runs() {
    let log = Log::default();
    let config = LoopConfig {
        advantage_estimator: AdvantageEstimator::Ppo,
        ..colocated(1)
    };
    let error = orchestrator(config, &log).run(&mut |_| {}).unwrap_err();
    assert!(error.to_string().contains("critic"), "{error}");
    assert!(calls(&log).is_empty());
}

#[test]
fn warmup_trains_on_answers_before_the_trainer_first_sleeps() {
    let log = Log::default();
    let config = LoopConfig {
        sft_warmup_steps: 2,
        ..colocated(1)
    };
    let mut o = orchestrator(config, &log);
    run(&mut o);
    assert_eq!(
        &calls(&log)[..6],
        [
            "engine.flush_cache",
            "engine.offload_kv",
            "engine.offload_weights",
            "actor.train_step",
            "actor.train_step",
            "actor.export_weights",
        ]
    );
    assert_eq!(o.state().warmup_steps, 2);
}

#[test]
fn a_rank_that_assists_saves_takes_part_where_the_writer_saves_and_writes_nothing() {
    let log = Log::default();
    let critic = FakeCritic::new(&log);
    let save = tempfile::tempdir().unwrap();
    let config = LoopConfig {
        advantage_estimator: AdvantageEstimator::Ppo,
        // The writer's directory, on its host: this rank neither writes nor creates it.
        save: Some(save.path().join("on-rank-0")),
        save_interval: Some(1),
        ..colocated(2)
    };
    let mut o = orchestrator(config, &log)
        .with_critic(Box::new(critic))
        .assist_saves();
    run(&mut o);
    let calls = calls(&log);
    let count = |c: &str| calls.iter().filter(|x| *x == c).count();
    assert_eq!(count("actor.assist_save"), 2, "{calls:?}");
    assert_eq!(count("critic.assist_save"), 2, "{calls:?}");
    assert_eq!(count("actor.save") + count("critic.save"), 0, "{calls:?}");
    let first = |c: &str| calls.iter().position(|x| x == c).unwrap();
    assert!(first("actor.assist_save") < first("critic.assist_save"));
    let written: Vec<_> = std::fs::read_dir(save.path()).unwrap().collect();
    assert!(written.is_empty(), "the assisting rank wrote {written:?}");
}

#[test]
fn a_writer_that_cannot_prepare_its_save_sends_its_part_to_the_other_ranks_then_fails() {
    let log = Log::default();
    let save = tempfile::tempdir().unwrap();
    // A file where a killed save's directory would be: the writer cannot clear it away.
    std::fs::write(save.path().join(".step-00000009.partial"), b"in the way").unwrap();
    let config = LoopConfig {
        save: Some(save.path().to_path_buf()),
        save_interval: Some(1),
        ..colocated(2)
    };
    let mut o = orchestrator(config, &log);
    let error = o.run(&mut |_| {}).unwrap_err();
    assert!(matches!(error, OrchestratorError::Io { .. }), "{error}");
    let calls = calls(&log);
    assert!(
        calls.contains(&"actor.assist_save".to_string()),
        "the other ranks would wait in the save's gathers: {calls:?}"
    );
    assert!(!calls.contains(&"actor.save".to_string()), "{calls:?}");
}

#[test]
fn a_writer_whose_actor_files_fail_still_sends_the_critic_s_part_then_fails() {
    let log = Log::default();
    let critic = FakeCritic::new(&log);
    let save = tempfile::tempdir().unwrap();
    let config = LoopConfig {
        advantage_estimator: AdvantageEstimator::Ppo,
        save: Some(save.path().to_path_buf()),
        save_interval: Some(1),
        ..colocated(2)
    };
    let mut actor = FakeActor::new(&log);
    actor.fail_save = true;
    let mut o = Orchestrator::new(
        config,
        Box::new(actor),
        Box::new(FakeEngine::new(&log)),
        tokenizer(),
    )
    .with_critic(Box::new(critic));
    let error = o.run(&mut |_| {}).unwrap_err();
    assert!(error.to_string().contains("save"), "{error}");
    let calls = calls(&log);
    let at = |c: &str| calls.iter().position(|x| x == c);
    assert!(
        at("actor.save").is_some() && at("actor.save") < at("critic.assist_save"),
        "the other ranks would wait in the critic's gathers: {calls:?}"
    );
    assert!(!calls.contains(&"critic.save".to_string()), "{calls:?}");
    assert!(
        !calls.contains(&"actor.assist_save".to_string()),
        "{calls:?}"
    );
}

#[test]
fn a_rank_that_shares_its_groups_rollout_trains_as_the_first_rank_does() {
    // Rank 0's rollouts as they leave it, one a step.
    let sent = Arc::new(std::sync::Mutex::new(Vec::<Vec<u8>>::new()));
    let log = Log::default();
    let first = Arc::clone(&sent);
    let mut rank_0 = orchestrator(colocated(3), &log).with_rollout_share(
        Box::new(move |own| {
            first.lock().unwrap().push(own.clone());
            Ok(own)
        }),
        true,
    );
    let (_, at_0) = run(&mut rank_0);
    let other_seed = LoopConfig {
        seed: 18,
        ..colocated(3)
    };
    let (_, alone) = run(&mut orchestrator(other_seed.clone(), &Log::default()));
    let taken = Arc::clone(&sent);
    let log_1 = Log::default();
    let mut rank_1 = orchestrator(other_seed, &log_1).with_rollout_share(
        Box::new(move |own| {
            assert!(own.is_empty(), "a rank that takes the rollout sent one");
            Ok(taken.lock().unwrap().remove(0))
        }),
        false,
    );
    let (_, at_1) = run(&mut rank_1);
    assert!(
        !calls(&log_1).contains(&"engine.generate".to_string()),
        "a rank that takes its group's rollout generated one"
    );
    let seen = |steps: &[StepMetrics]| {
        steps
            .iter()
            .map(|m| (m.reward_mean, m.reward_std, m.loss))
            .collect::<Vec<_>>()
    };
    assert_ne!(
        seen(&alone),
        seen(&at_0),
        "the seeds gave the same rollouts"
    );
    assert_eq!(seen(&at_1), seen(&at_0));
    assert!(sent.lock().unwrap().is_empty());
    // A share that does not parse ends the run naming it.
    let mut garbled = orchestrator(colocated(1), &Log::default())
        .with_rollout_share(Box::new(|_| Ok(b"{".to_vec())), false);
    let error = garbled.run(&mut |_| {}).unwrap_err();
    assert!(
        matches!(error, OrchestratorError::SharedRollout(_)),
        "{error}"
    );
}
