//! `miles train`: the colocated RL loop (DESIGN section 8) on the backend named by
//! `--train-backend` and the rollout engine, with a progress bar on a terminal and log lines
//! otherwise. Every output location (`--save`, `--metrics`, `--memory-timeline`) is checked
//! before any work. Ctrl-C (SIGINT) or SIGTERM stops it after the phase in progress: the last
//! step's metrics are written, a checkpoint is saved with `--save`, and the exit status is 130
//! (143 for SIGTERM); a second one stops it at once.
//!
//! Over several GPUs (`--nproc-per-node N`, or a launcher's ranks) every process runs the whole
//! loop on its GPU: its own rollout engine and prompts (the loop's seed plus its data-parallel
//! index), and one data-parallel rank of the trainer (`--data-parallel-size N`, either backend;
//! under PPO its critic is another, with a communicator of its own) whose gradients NCCL
//! reduce-scatters over the ranks, each rank updating its block of the optimizer state. With
//! Megatron's `--tensor-model-parallel-size T` the job is T x N processes: each run of T
//! consecutive ranks is a tensor-parallel group training one shard of the model each, on the
//! rollout of the group's first rank, which alone generates and scores it (shared over the host
//! group; the group's ranks share a seed), and the ranks holding the same shard are its
//! data-parallel ranks (the shard's optimizer state split over them, Megatron's distributed
//! optimizer); the engines get the full weights, gathered over the group. Rank 0 reports, writes
//! metrics and saves (the others send it their blocks). A signal there stops every rank after the
//! same step: at the end of each step the ranks agree over the job's host group whether any was
//! asked to stop, and each exits with the status of the signal one of them received.

use std::cell::{Cell, RefCell};
use std::io::{IsTerminal, Write};
use std::rc::Rc;

use anyhow::Context;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use miles_core::backend::{Critic, RolloutEngine};
use miles_core::config::{AdvantageEstimator, Settings};
use miles_core::model::{ByteTokenizer, LlamaConfig, Tokenizer};
use miles_core::orchestrator::{LmCritic, LoopConfig, Orchestrator, PromptDataset};
use miles_core::{DeviceKind, LaunchEnv, StepMetrics, backend::TrainBackend};

use crate::backends::RankComms;
use crate::settings_args::{BadSettings, SettingsArgs};
use crate::signals::{Interrupted, StopSignal};

/// How long a rank waits for its peers at a step's end before the run fails (rank 0 may be
/// saving a checkpoint meanwhile); a peer that exits is noticed at once.
const AGREEMENT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(6 * 3600);

/// `miles train`.
#[derive(Args, Debug)]
pub struct TrainArgs {
    /// Every setting, as flags or from `--config`.
    #[command(flatten)]
    pub settings: SettingsArgs,
    /// Start this many processes on this machine, one per GPU, each running the loop with one
    /// rank of the trainer (`--device cuda`, tensor parallel x data parallel ranks: either
    /// backend's `--data-parallel-size N`, Megatron's `--tensor-model-parallel-size` too). Under
    /// torchrun, srun or mpirun leave it out.
    #[arg(long, default_value_t = 1)]
    pub nproc_per_node: usize,
}

/// Runs the loop and prints where its metrics went.
///
/// # Errors
/// Bad settings or an output location that cannot be written (exit status 2);
/// [`Interrupted`](crate::signals::Interrupted) when a signal stopped the run (after it saved
/// and wrote its metrics); what the loop hit otherwise.
pub fn run(args: TrainArgs) -> anyhow::Result<()> {
    if args.nproc_per_node == 0 {
        return Err(BadSettings("--nproc-per-node must be at least 1".into()).into());
    }
    let env = crate::launch::rank_env(args.nproc_per_node)?;
    let settings = args.settings.load()?;
    if env.is_none() && args.nproc_per_node > 1 {
        return crate::launch::run_local(args.nproc_per_node, settings.device);
    }
    if let Some(env) = &env {
        check_ranks(&settings, env)?;
    }
    let rank = env.as_ref().map_or(0, |env| env.rank);
    // The ranks of a tensor-parallel group are one data-parallel rank: one seed, one rollout.
    let tp = settings.tensor_model_parallel_size.max(1);
    let mut loop_config = LoopConfig::from_settings(&settings);
    loop_config.seed += (rank / tp) as u64;
    if rank > 0 {
        // Rank 0 writes the checkpoints; the others take part where the state is split, and
        // keep `save` only to know when.
        loop_config.metrics = None;
        loop_config.memory_timeline = None;
    }
    loop_config
        .check_outputs(rank == 0)
        .map_err(|error| BadSettings(error.to_string()))?;
    let signal = StopSignal::install()?;
    let model = crate::model_cmd::model_config(&settings)?;
    let tokenizer = match &settings.hf_checkpoint {
        Some(dir) => Tokenizer::from_dir(dir, &model).map_err(crate::model_cmd::bad_model(dir))?,
        None => ByteTokenizer::from_config(&model)?.into(),
    };
    crate::train_data::check_device(&settings)?;
    let prompt_data = crate::train_data::load_prompt_data(
        settings.prompt_data.as_deref(),
        &settings,
        &tokenizer,
    )?;
    let eval_data = crate::train_data::load_prompt_data(
        settings.eval_prompt_data.as_deref(),
        &settings,
        &tokenizer,
    )?;
    let reward = crate::train_data::build_reward(
        &settings,
        tokenizer.clone(),
        &[prompt_data.as_ref(), eval_data.as_ref()],
    )?;
    let positions = longest_sequence(
        loop_config.rl.data_response_len(),
        prompt_data.as_ref(),
        eval_data.as_ref(),
    );
    let job = match &env {
        Some(env) => {
            let Some(gpu) = crate::gpu::training_gpu_for(settings.device)? else {
                return Err(BadSettings(
                    "several processes train on gpus; add --device cuda".into(),
                )
                .into());
            };
            let mut group = crate::gpu::connect(env)?;
            let comms = crate::gpu::rank_comms(&mut group, &gpu, tp, settings.overlap_grad_reduce)?;
            Some((group, comms))
        }
        None => None,
    };
    let (group, comms) = job.map_or((None, None), |(group, comms)| {
        (Some(Rc::new(RefCell::new(group))), Some(comms))
    });
    let actor = build_actor(&settings, comms)?;
    // PPO's critic is one more data-parallel trainer over every rank (tensor parallel or not),
    // with a communicator of its own.
    let critic_comms = match (&group, settings.advantage_estimator) {
        (Some(group), AdvantageEstimator::Ppo) => {
            let gpu = crate::gpu::training_gpu_for(settings.device)?
                .context("several processes train on gpus")?;
            let mut group = group.borrow_mut();
            Some(crate::backends::RankComms {
                rank,
                tensor: None,
                data: Some(crate::gpu::open_comm(&mut group, &gpu)?),
                behind: None,
            })
        }
        _ => None,
    };
    let critic = build_critic(&settings, tokenizer.pad(), critic_comms)?;
    // The engine last: its cache takes `--rollout-mem-fraction` of what the trainers left free.
    // Built first, its cache would take that share of the whole device and leave the trainers
    // too little to be built beside it (a 1B run on an 80 GB GPU, bench/RESULTS.md round 32).
    let engine = build_engine(&settings, &model, positions)?;
    if let Some(gpu) = crate::gpu::gpu_for(settings.device)? {
        // What this process may hold on its gpu: what is free and what its trainer and engine
        // hold already (another process's memory does not count).
        let mut tags = actor.device_memory();
        tags.extend(engine.resident_bytes());
        if let Some(critic) = &critic {
            tags.extend(critic.device_memory());
        }
        let held: u64 = tags.iter().map(|(_, bytes)| bytes).sum();
        loop_config.device_bytes =
            Some(miles_core::Device::memory_info(&**gpu.device())?.free + held);
    }
    let mut orchestrator =
        Orchestrator::new(loop_config, actor, engine, tokenizer).with_stop_flag(signal.flag());
    if let Some(critic) = critic {
        orchestrator = orchestrator.with_critic(critic);
    }
    if rank > 0 {
        orchestrator = orchestrator.assist_saves().without_evaluation();
    }
    orchestrator = orchestrator.with_reward(reward);
    if let Some(dataset) = prompt_data {
        orchestrator = orchestrator.with_prompt_data(dataset);
    }
    if let Some(dataset) = eval_data {
        orchestrator = orchestrator.with_eval_data(dataset);
    }
    // The largest signal number any rank received, agreed at each step's end (0: none).
    let agreed = Rc::new(Cell::new(0u32));
    if let Some(group) = &group {
        // Rank 0 may save a checkpoint while the others wait for the step's agreement: a peer
        // that leaves is noticed at once, only a stuck one waits this long.
        group.borrow_mut().set_timeout(AGREEMENT_TIMEOUT)?;
        let (group, agreed, signal) = (Rc::clone(group), Rc::clone(&agreed), signal.clone());
        orchestrator = orchestrator.with_stop_agreement(Box::new(move |flag| {
            // This rank's signal number, 0 for none (at least 1 once asked to stop).
            let mine = match (flag, signal.received()) {
                (false, _) => 0,
                (true, received) => {
                    let number = received.map_or(crate::signals::SIGINT, |s| s.signal);
                    u32::try_from(number).unwrap_or(1).max(1)
                }
            };
            let all = group.borrow_mut().max(mine)?;
            agreed.set(all);
            Ok(all != 0)
        }));
    }
    if let Some(group) = &group
        && tp > 1
    {
        // Every rank of a tensor-parallel group trains on its first rank's rollout.
        let (group, first) = (Rc::clone(group), rank - rank % tp);
        orchestrator = orchestrator.with_rollout_share(
            Box::new(move |own| group.borrow_mut().route(&own, |r| r - r % tp)),
            rank == first,
        );
    }
    if let Some(group) = &group {
        let group = Rc::clone(group);
        orchestrator = orchestrator.with_fit_agreement(Box::new(move |fits| {
            // Both phases fit only where no rank says they do not.
            Ok(group.borrow_mut().max(u32::from(!fits))? == 0)
        }));
    }
    // A rank a peer's signal stopped exits as that peer does.
    let stopped = || {
        signal.received().or_else(|| {
            let peers = i32::try_from(agreed.get()).unwrap_or(0);
            (peers != 0).then_some(Interrupted { signal: peers })
        })
    };
    let summary = if rank == 0 {
        let mut progress = Progress::new(settings.steps);
        let summary = orchestrator.run(&mut |m| progress.step(m))?;
        progress.finish();
        summary
    } else {
        orchestrator.run(&mut |_| {})?
    };
    if let Some(group) = &group {
        group.borrow_mut().barrier()?;
    }
    if rank > 0 {
        return stopped().map_or(Ok(()), |stopped| Err(stopped.into()));
    }
    let mut out = std::io::stdout().lock();
    let (first, last) = (
        summary.reward_means.first().copied().unwrap_or_default(),
        summary.reward_means.last().copied().unwrap_or_default(),
    );
    writeln!(
        out,
        "{} after step {} of {}: mean reward {first:.3} at step 1, {last:.3} at the last",
        if summary.interrupted {
            "stopped"
        } else {
            "finished"
        },
        summary.steps,
        settings.steps
    )?;
    if let Some(path) = &settings.metrics {
        writeln!(out, "metrics: {}", path.display())?;
    }
    if let Some(path) = &settings.memory_timeline {
        writeln!(out, "memory timeline: {}", path.display())?;
    }
    stopped().map_or(Ok(()), |stopped| Err(stopped.into()))
}

/// The positions a rollout of the run fills at most, where the prompts are a dataset: its
/// longest prompt (of the evaluation rows too) and `response_len`; `None` for the task's
/// prompts (the engine then takes the model's positions).
fn longest_sequence(
    response_len: usize,
    prompt_data: Option<&PromptDataset>,
    eval_data: Option<&PromptDataset>,
) -> Option<usize> {
    let prompt_data = prompt_data?;
    let longest = [Some(prompt_data), eval_data]
        .into_iter()
        .flatten()
        .flat_map(|dataset| dataset.rows.iter().map(|row| row.tokens))
        .max()?;
    Some(longest + response_len)
}

/// The rollout engine of `model` on the device `settings` name, for sequences of at most
/// `positions` positions (`None`: the model's), behind its controller.
///
/// # Errors
/// The GPU cannot be opened, or what the engine hit allocating.
fn build_engine(
    settings: &Settings,
    model: &LlamaConfig,
    positions: Option<usize>,
) -> anyhow::Result<Box<dyn RolloutEngine>> {
    // Every onload of the weights is followed by a full weight sync: backing them up on offload
    // would only carry stale bytes across the host link.
    let config = miles_infer::EngineConfig {
        weights_policy: miles_core::BackupPolicy::None,
        max_positions: positions,
        ..miles_infer::EngineConfig::from_settings(settings)
    };
    let engine = crate::generate::build_engine(settings, model, config)?;
    Ok(Box::new(miles_infer::InferenceController::from_settings(
        engine, settings,
    )))
}

/// What one rank of several processes cannot run, as bad settings naming the flag.
fn check_ranks(settings: &Settings, env: &LaunchEnv) -> anyhow::Result<()> {
    let refuse = |reason: String| Err(BadSettings(reason).into());
    if miles_core::device::resolve(settings.device) != DeviceKind::Cuda {
        return refuse(format!(
            "{} processes train one gpu each; add --device cuda (the cpu device runs its ranks as threads of one process: drop --nproc-per-node)",
            env.world_size
        ));
    }
    miles_core::backend::check_job_ranks(settings, env.world_size).or_else(refuse)
}

/// The actor: the `--train-backend` backend, built without `--load` (the loop resolves the
/// checkpoint it names and restores the actor itself); with `group`, one rank of a job.
///
/// # Errors
/// As [`build_backend`](crate::backends::build_backend).
fn build_actor(
    settings: &Settings,
    comms: Option<RankComms>,
) -> anyhow::Result<Box<dyn TrainBackend>> {
    let fresh = Settings {
        load: None,
        ..settings.clone()
    };
    crate::backends::build_backend(&fresh, comms)
}

/// The PPO critic (none under GRPO): a second backend of the same kind, its language model
/// read as the value head; with `comms`, one data-parallel rank of a job over all its ranks
/// (where the actor is tensor parallel, the critic is not: its replicas in one
/// tensor-parallel group train on the same rollout).
///
/// # Errors
/// As [`build_actor`].
fn build_critic(
    settings: &Settings,
    pad: u32,
    comms: Option<RankComms>,
) -> anyhow::Result<Option<Box<dyn Critic>>> {
    match settings.advantage_estimator {
        AdvantageEstimator::Grpo | AdvantageEstimator::ReinforcePlusPlus => Ok(None),
        AdvantageEstimator::Ppo => {
            let settings = match &comms {
                Some(RankComms {
                    data: Some(data), ..
                }) => Settings {
                    tensor_model_parallel_size: 1,
                    data_parallel_size: data.world_size(),
                    ..settings.clone()
                },
                _ => settings.clone(),
            };
            let backend = build_actor(&settings, comms).context("cannot build the critic")?;
            Ok(Some(Box::new(LmCritic::new(backend, pad))))
        }
    }
}

/// A progress bar on a terminal, one log line per step otherwise.
struct Progress {
    bar: Option<ProgressBar>,
}

impl Progress {
    fn new(steps: u64) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new(steps);
            if let Ok(style) =
                ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}")
            {
                bar.set_style(style.progress_chars("=> "));
            }
            bar
        });
        Self { bar }
    }

    fn step(&mut self, m: &StepMetrics) {
        match &self.bar {
            Some(bar) => {
                bar.set_position(m.step);
                bar.set_message(m.summary());
            }
            None => tracing::info!(step = m.step, "rl step: {}", m.summary()),
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish();
        }
    }
}

#[cfg(test)]
mod tests {
    use miles_core::{DeviceChoice, TrainBackendKind};

    use super::*;

    fn rank(world_size: usize) -> LaunchEnv {
        LaunchEnv {
            rank: 1,
            world_size,
            local_rank: 1,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
            secret: miles_core::comm::JobSecret::new("a-test-secret-of-the-rendezvous"),
            port_file: None,
        }
    }

    #[test]
    fn ranks_refuse_what_they_cannot_run_naming_the_flag() {
        let cuda = Settings {
            device: DeviceChoice::Cuda,
            train_backend: TrainBackendKind::Fsdp,
            data_parallel_size: 2,
            ..Settings::default()
        };
        check_ranks(&cuda, &rank(2)).unwrap();
        let cases = [
            (
                Settings {
                    device: DeviceChoice::Cpu,
                    ..cuda.clone()
                },
                "--device cuda",
            ),
            (
                Settings {
                    tensor_model_parallel_size: 2,
                    data_parallel_size: 1,
                    ..cuda.clone()
                },
                "--train-backend megatron",
            ),
            (
                Settings {
                    train_backend: TrainBackendKind::Megatron,
                    tensor_model_parallel_size: 2,
                    data_parallel_size: 2,
                    ..cuda.clone()
                },
                "--data-parallel-size 1",
            ),
        ];
        let megatron = Settings {
            train_backend: TrainBackendKind::Megatron,
            ..cuda.clone()
        };
        check_ranks(&megatron, &rank(2)).unwrap();
        let tensor_parallel = Settings {
            tensor_model_parallel_size: 2,
            data_parallel_size: 1,
            ..megatron.clone()
        };
        check_ranks(&tensor_parallel, &rank(2)).unwrap();
        let ppo = Settings {
            advantage_estimator: AdvantageEstimator::Ppo,
            ..cuda.clone()
        };
        check_ranks(&ppo, &rank(2)).unwrap();
        for (settings, flag) in cases {
            let error = check_ranks(&settings, &rank(2)).unwrap_err();
            assert!(
                crate::settings_args::is_bad_settings(&error),
                "{flag}: {error}"
            );
            assert!(error.to_string().contains(flag), "{flag}: {error}");
        }
    }

    #[test]
    fn an_engine_is_sized_for_the_longest_prompt_of_the_data_and_the_response() {
        let dataset = |lengths: &[usize]| PromptDataset {
            path: "prompts.jsonl".into(),
            rows: lengths
                .iter()
                .enumerate()
                .map(|(i, &tokens)| miles_core::orchestrator::PromptRow {
                    line: i + 1,
                    problem: miles_core::orchestrator::Problem {
                        text: "x".repeat(tokens),
                        answer: String::new(),
                        metadata: serde_json::Value::Null,
                    },
                    tokens,
                })
                .collect(),
            bad: Vec::new(),
            too_long: 0,
        };
        let (train, eval) = (dataset(&[5, 9]), dataset(&[12]));
        let responses = LoopConfig::from_settings(&Settings {
            rollout_max_response_len: Some(20),
            ..Settings::default()
        })
        .rl
        .data_response_len();
        assert_eq!(longest_sequence(responses, Some(&train), None), Some(29));
        assert_eq!(
            longest_sequence(responses, Some(&train), Some(&eval)),
            Some(32)
        );
        let default = LoopConfig::from_settings(&Settings::default())
            .rl
            .data_response_len();
        assert_eq!(
            longest_sequence(default, Some(&train), None),
            Some(9 + miles_core::orchestrator::DATA_RESPONSE_LEN)
        );
        // The task's prompts are not known here: the engine takes the model's positions.
        assert_eq!(longest_sequence(responses, None, Some(&eval)), None);
    }
}
