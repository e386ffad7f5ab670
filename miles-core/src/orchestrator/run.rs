//! The colocated RL loop of DESIGN section 8, phase by phase.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use crate::backend::{TrainBackend, WeightBucket};
use crate::config::{AdvantageEstimator, RmType};
use crate::memory::OffloadReport;
use crate::metrics::{
    MemoryTimeline, MetricsWriter, Phase, RunHeader, StepMetrics, TimelineSample,
};
use crate::model::Tokenizer;

use super::OrchestratorError;
use super::advantage::{grpo_advantages, mean_std, ppo_advantages, reinforce_plus_plus_advantages};
use super::batch::{Sequence, build_batch};
use super::data::{PromptDataset, PromptSource};
use super::reference::ReferenceModel;
use super::reward::{BuiltinReward, Reward, RewardError, RewardRequest};
use super::state::LoopState;
use super::stop::cut_at_stop_strings;
use super::task::{Problem, ProblemSource, Stream, stream_seed};
use crate::backend::{Critic, RolloutEngine, Sample, Sampling};

mod checkpoint;
mod eval;
mod loop_config;
pub use loop_config::LoopConfig;
mod mover;
pub use mover::Patience;
mod policy;
mod share;
pub use share::RolloutShare;
mod sync;

/// How a run ended.
#[derive(Clone, Debug, PartialEq)]
pub struct RunSummary {
    /// RL steps finished, counting those of the run it resumed.
    pub steps: u64,
    /// Whether the stop flag (Ctrl-C) ended it early.
    pub interrupted: bool,
    /// Mean reward of every finished step, in order.
    pub reward_means: Vec<f32>,
}

/// One rollout: problems, prompts and samples, and the rewards by prompt then sample.
struct Rollout {
    problems: Vec<Problem>,
    prompts: Vec<Vec<u32>>,
    samples: Vec<Vec<Sample>>,
    rewards: Vec<f32>,
    /// Each sample's text without its stop token, by prompt then sample.
    responses: Vec<String>,
}

/// A step's phases up to the checkpoint.
const HEAD: [Phase; 5] = [
    Phase::Generate,
    Phase::OffloadRollout,
    Phase::OnloadTrain,
    Phase::Train,
    Phase::Save,
];

/// The same where the actor's moves run behind other work: the loop waits for the onload
/// behind the rollout before the engine releases its memory, since a release while the onload
/// copies slows the copies (the driver scrubs freed memory on the copy engines: on an H200 a
/// 12.5 GB onload took 0.41 s next to the release of a 71 GB KV cache, 0.24 s alone).
const HEAD_BEHIND: [Phase; 5] = [
    Phase::Generate,
    Phase::OnloadTrain,
    Phase::OffloadRollout,
    Phase::Train,
    Phase::Save,
];

/// How the ranks of a multi-process job agree on stopping: called with this rank's stop flag at
/// the same points on every rank, it returns whether any rank asked to stop.
pub type StopAgreement = Box<dyn FnMut(bool) -> Result<bool, crate::comm::CommError>>;

/// How the ranks of a multi-process job agree whether their devices hold both phases: called
/// with whether this rank's does, at the same points on every rank, it returns whether every
/// rank's does. Ranks that decided apart would move their trainers apart, and a move may hold
/// a collective (a split state's export, NCCL's buffers released).
pub type FitAgreement = Box<dyn FnMut(bool) -> Result<bool, crate::comm::CommError>>;

/// Whether the loop goes on after a phase.
enum Next {
    Continue,
    Stop,
}

/// The colocated RL loop: drives a training backend (the actor, and a critic under PPO) and a
/// rollout engine in the order of DESIGN section 8, honouring every offload switch.
pub struct Orchestrator {
    config: LoopConfig,
    actor: mover::Actor,
    critic: Option<Box<dyn Critic>>,
    reference: Option<ReferenceModel>,
    eval: Option<PromptDataset>,
    dump: Option<eval::RolloutDump>,
    engine: Box<dyn RolloutEngine>,
    tokenizer: Tokenizer,
    problems: PromptSource,
    reward: Box<dyn Reward>,
    stop: Arc<AtomicBool>,
    /// With several ranks, how they agree on stopping ([`with_stop_agreement`](Self::with_stop_agreement)).
    agreement: Option<StopAgreement>,
    /// Another rank writes the checkpoints; this one takes part ([`assist_saves`](Self::assist_saves)).
    assists_saves: bool,
    /// Another rank reports the evaluation; this one does not run it ([`without_evaluation`](Self::without_evaluation)).
    skips_evaluation: bool,
    /// With several ranks, how they agree whether both phases fit ([`with_fit_agreement`](Self::with_fit_agreement)).
    fit_agreement: Option<FitAgreement>,
    /// In a tensor-parallel group, how its ranks share one rollout ([`with_rollout_share`](Self::with_rollout_share)).
    sharing: Option<share::Sharing>,
    /// Whether the device holds both phases with the margin, as last decided
    /// ([`decide_fit`](Self::decide_fit)).
    fits: bool,
    state: LoopState,
    timeline: MemoryTimeline,
    started: Instant,
    /// Weights exported before the trainer slept, for the coming sync.
    staged: Option<Vec<WeightBucket>>,
    kv_offloaded: bool,
    graphs_offloaded: bool,
    weights_offloaded: bool,
    /// Seconds the last weight export before an offload took.
    export_seconds: f64,
    /// The tail in progress syncs on the device ([`DEVICE_TAIL`]).
    device_sync: bool,
    /// The step of the newest checkpoint in `config.save`, once one is there.
    saved_step: Option<u64>,
    /// The most device memory the trainer side (actor, critic, reference) and the engine have
    /// held at a boundary.
    peaks: (u64, u64),
    /// Whether the log said that the device holds both phases.
    told_fit: bool,
}

impl Orchestrator {
    /// A loop over `actor` and `engine`; the tokenizer formats prompts and answers. Nothing
    /// runs until [`run`](Self::run).
    ///
    /// Device memory in the metrics is what the tags of engine, actor and critic hold now, as
    /// each reports it ([`RolloutEngine::resident_bytes`],
    /// [`TrainBackend::device_memory`], [`Critic::device_memory`]).
    pub fn new(
        config: LoopConfig,
        actor: Box<dyn TrainBackend>,
        engine: Box<dyn RolloutEngine>,
        tokenizer: impl Into<Tokenizer>,
    ) -> Self {
        let tokenizer: Tokenizer = tokenizer.into();
        let patience = config.patience;
        let problems = PromptSource::Task(ProblemSource::new(config.task, config.seed));
        let state = LoopState {
            seed: config.seed,
            task: Some(config.task),
            ..LoopState::default()
        };
        Self {
            config,
            actor: mover::Actor::new(actor, patience),
            critic: None,
            reference: None,
            eval: None,
            dump: None,
            engine,
            tokenizer: tokenizer.clone(),
            problems,
            reward: Box::new(BuiltinReward::new(RmType::Task, tokenizer)),
            stop: Arc::new(AtomicBool::new(false)),
            agreement: None,
            assists_saves: false,
            skips_evaluation: false,
            fit_agreement: None,
            sharing: None,
            fits: false,
            state,
            timeline: MemoryTimeline::default(),
            started: Instant::now(),
            staged: None,
            kv_offloaded: false,
            graphs_offloaded: false,
            weights_offloaded: false,
            export_seconds: 0.0,
            device_sync: false,
            saved_step: None,
            peaks: (0, 0),
            told_fit: false,
        }
    }

    /// Adds the PPO critic, trained and offloaded alongside the actor.
    pub fn with_critic(mut self, critic: Box<dyn Critic>) -> Self {
        self.critic = Some(critic);
        self
    }

    /// Draws the prompts from `dataset` (in epochs shuffled with the loop's seed) instead of the
    /// task.
    pub fn with_prompt_data(mut self, dataset: PromptDataset) -> Self {
        self.problems = PromptSource::Data {
            dataset,
            seed: self.config.seed,
        };
        self
    }

    /// Scores completions with `reward` instead of the task's reward.
    pub fn with_reward(mut self, reward: Box<dyn Reward>) -> Self {
        self.reward = reward;
        self
    }

    /// Uses `flag` as the stop flag (one a Ctrl-C handler already sets).
    pub fn with_stop_flag(mut self, flag: Arc<AtomicBool>) -> Self {
        self.stop = flag;
        self
    }

    /// Makes the ranks of a multi-process job stop together: the stop flag no longer ends the
    /// loop after a phase; instead, at the end of every step (and of every supervised warm-up
    /// step, and of the start sequence) the loop passes it to `agreement`, and stops when any
    /// rank asked to. Every rank then stops after the same step, so none is left waiting in a
    /// collective of the next.
    pub fn with_stop_agreement(mut self, agreement: StopAgreement) -> Self {
        self.agreement = Some(agreement);
        self
    }

    /// Makes the ranks of a multi-process job decide together whether their devices hold both
    /// phases (at the start, after the warm-up and at each step's start): every rank moves its
    /// trainer, or none does. Give the job a [stop agreement](Self::with_stop_agreement) too:
    /// a rank that stops alone leaves the others waiting in the next step's agreement.
    pub fn with_fit_agreement(mut self, agreement: FitAgreement) -> Self {
        self.fit_agreement = Some(agreement);
        self
    }

    /// Makes this rank train on the rollout `share` returns at every step (before its rewards
    /// count in the metrics): in a job with tensor parallelism, the ranks of a tensor-parallel
    /// group must train on the same batches, so each takes its group's first rank's. The rank
    /// that `generates` generates and scores it and passes it to `share`; the others pass
    /// nothing, and neither generate nor call the reward. Give such ranks the same loop seed,
    /// so that their supervised warm-up draws the same problems too.
    pub fn with_rollout_share(mut self, share: RolloutShare, generates: bool) -> Self {
        self.sharing = Some(share::Sharing { share, generates });
        self
    }

    /// Makes this rank of a multi-process job one that does not write the checkpoints: where
    /// the writing rank saves (`save` set alike on every rank), this one calls the actor's
    /// [`assist_save`](crate::backend::TrainBackend::assist_save) instead (a state split over
    /// the ranks is gathered to the writer) and writes nothing.
    pub fn assist_saves(mut self) -> Self {
        self.assists_saves = true;
        self
    }

    /// Makes this rank of a multi-process job one that does not evaluate (`--eval-interval`):
    /// the rank that reports runs the evaluation, and nothing here waits for it.
    pub fn without_evaluation(mut self) -> Self {
        self.skips_evaluation = true;
        self
    }

    /// The flag that stops the loop after the phase in progress, or with a stop agreement after
    /// the step in progress (set it from a Ctrl-C handler).
    pub fn stop_flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.stop)
    }

    /// Where the loop stands.
    pub fn state(&self) -> &LoopState {
        &self.state
    }

    /// Device memory per tag at every phase boundary so far.
    pub fn timeline(&self) -> &MemoryTimeline {
        &self.timeline
    }

    /// Runs the start sequence, then RL steps until `config.steps`; calls `on_step` after each
    /// step with its metrics. Writes the memory timeline at the end, also when stopped.
    ///
    /// When the stop flag ends the run, the phase in progress finishes (with a stop agreement,
    /// the step in progress); a step whose training
    /// finished still gets its metrics line (marked `interrupted`), and with `config.save` the
    /// newest state is saved unless it is saved already.
    ///
    /// # Errors
    /// [`OrchestratorError::Outputs`] before any work for an output location that cannot be
    /// written; [`OrchestratorError::NonFinite`] for a loss or gradient norm that is not finite
    /// (nothing of that step is saved); [`OrchestratorError`] naming the phase that failed
    /// otherwise. The metrics of finished steps are already written.
    pub fn run(
        &mut self,
        on_step: &mut dyn FnMut(&StepMetrics),
    ) -> Result<RunSummary, OrchestratorError> {
        if self.config.advantage_estimator == AdvantageEstimator::Ppo && self.critic.is_none() {
            return Err(OrchestratorError::Settings(
                "--advantage-estimator ppo needs a critic; build one or use grpo".into(),
            ));
        }
        self.config.check_outputs(!self.assists_saves)?;
        self.started = Instant::now();
        let header = RunHeader::new();
        let mut writer = self
            .config
            .metrics
            .as_deref()
            .map(|path| MetricsWriter::append(path, &header))
            .transpose()?;
        if let Some(dir) = self.config.load.clone() {
            self.load(&dir)?;
        }
        self.dump = self
            .config
            .rl
            .dump_rollouts
            .as_deref()
            .map(eval::RolloutDump::append)
            .transpose()?;
        let mut interrupted = matches!(self.start()?, Next::Stop);
        while !interrupted && self.state.step < self.config.steps {
            let step = self.state.step + 1;
            let (mut metrics, next) = self.step(step)?;
            let next = match next {
                Next::Stop => Next::Stop,
                Next::Continue => self.stop_agreed()?,
            };
            interrupted = matches!(next, Next::Stop);
            // A step stopped before its training finished left nothing to report.
            if self.state.step == step {
                metrics.interrupted = interrupted;
                if let Some(w) = writer.as_mut() {
                    w.write(&metrics)?;
                }
                on_step(&metrics);
            }
        }
        if interrupted && self.config.save.is_some() && self.saved_step != Some(self.state.step) {
            self.onload_train(&mut StepMetrics::default())?;
            self.save()?;
        }
        for moved in self.actor.wait()? {
            self.record_move(&moved);
        }
        if let Some(path) = &self.config.memory_timeline {
            self.timeline.write_svg(path)?;
        }
        if interrupted {
            tracing::warn!(step = self.state.step, "stopped on request");
        }
        Ok(RunSummary {
            steps: self.state.step,
            interrupted,
            reward_means: self.state.reward_means.clone(),
        })
    }

    /// Whether the stop flag ends the loop after this phase: never where the ranks agree on
    /// stopping ([`stop_agreed`](Self::stop_agreed) asks at the end of a step instead).
    fn stopped(&self) -> Next {
        if self.agreement.is_none() && self.stop.load(Ordering::SeqCst) {
            Next::Stop
        } else {
            Next::Continue
        }
    }

    /// Whether the loop stops at the end of a step: the stop flag alone, or with several ranks
    /// whether any rank's flag is set.
    ///
    /// # Errors
    /// [`OrchestratorError::Agreement`] when the ranks cannot agree.
    fn stop_agreed(&mut self) -> Result<Next, OrchestratorError> {
        let flag = self.stop.load(Ordering::SeqCst);
        let stop = match &mut self.agreement {
            Some(agree) => agree(flag).map_err(|source| OrchestratorError::Agreement {
                about: "whether to stop after this step",
                source,
            })?,
            None => flag,
        };
        Ok(if stop { Next::Stop } else { Next::Continue })
    }

    /// Start: the engine releases all its memory; after any supervised warm-up, the trainer
    /// sleeps, the engine's weights come back and the weights sync through the host, or (on one
    /// device, see [`tail`](Self::tail)) the engine's weights come back, copy the trainer's and
    /// the trainer sleeps; the KV cache comes back.
    fn start(&mut self) -> Result<Next, OrchestratorError> {
        self.sample_memory("start".into());
        self.decide_fit()?;
        if self.config.offload_rollout && !self.keep_resident() {
            self.engine.flush_cache()?;
            self.engine.offload_kv()?;
            self.engine.offload_graphs()?;
            self.engine.offload_weights()?;
            (
                self.kv_offloaded,
                self.graphs_offloaded,
                self.weights_offloaded,
            ) = (true, true, true);
            self.sample_memory("start after engine release".into());
        }
        while self.state.warmup_steps < self.config.sft_warmup_steps {
            if let Next::Stop = self.stopped() {
                return Ok(Next::Stop);
            }
            self.warmup_step()?;
            if let Next::Stop = self.stop_agreed()? {
                return Ok(Next::Stop);
            }
        }
        if self.config.rl.loss.kl.is_some() && self.reference.is_none() {
            self.reference = Some(ReferenceModel::of_actor(&mut **self.actor.get()?)?);
            tracing::info!(
                "reference model of the kl penalty: the actor's weights at the start of rl, under tag ref"
            );
        }
        self.decide_fit()?;
        let mut ignored = StepMetrics::default();
        for phase in self.tail()? {
            if phase == Phase::OffloadTrain {
                if self.config.offload_train && !self.keep_resident() {
                    self.offload_train()?;
                    // The start sequence keeps no phase timings.
                    self.export_seconds = 0.0;
                    self.sample_memory("start after trainer sleep".into());
                }
                continue;
            }
            if let Next::Stop = self.stopped() {
                return Ok(Next::Stop);
            }
            self.run_phase(phase, &mut ignored, None)?;
            self.sample_memory(format!("start after_{}", phase.name()));
        }
        self.stop_agreed()
    }

    /// One RL step and its metrics; [`Next::Stop`] when the stop flag ended it after a phase
    /// (the metrics then hold the phases that ran).
    fn step(&mut self, step: u64) -> Result<(StepMetrics, Next), OrchestratorError> {
        let mut metrics = StepMetrics {
            step,
            ..StepMetrics::default()
        };
        let total = self.sample_memory(format!("step {step} step_start"));
        metrics.boundary("step_start".into(), total);
        self.decide_fit()?;
        self.tell_fit();
        let mut rollout = None;
        let head = if self.moves_behind() {
            HEAD_BEHIND
        } else {
            HEAD
        };
        for phase in head {
            if let Next::Stop = self.step_phase(phase, &mut metrics, &mut rollout)? {
                return Ok((metrics, Next::Stop));
            }
        }
        for phase in self.tail()? {
            if let Next::Stop = self.step_phase(phase, &mut metrics, &mut rollout)? {
                return Ok((metrics, Next::Stop));
            }
        }
        Ok((metrics, Next::Continue))
    }

    /// Runs one phase of step `metrics.step`, timed, and samples the memory after it.
    fn step_phase(
        &mut self,
        phase: Phase,
        metrics: &mut StepMetrics,
        rollout: &mut Option<Rollout>,
    ) -> Result<Next, OrchestratorError> {
        let started = Instant::now();
        let bytes = match phase {
            Phase::Generate => {
                metrics.rl.eval_reward_mean = self.evaluate_if_due(metrics.step)?;
                self.onload_train_behind();
                let generated = self.rollout(metrics.step)?;
                if let Some(dump) = &mut self.dump {
                    dump.write(metrics.step, &generated)?;
                }
                (metrics.reward_mean, metrics.reward_std) = mean_std(&generated.rewards);
                rollout_metrics(&generated, started.elapsed().as_secs_f64(), &mut metrics.rl);
                *rollout = Some(generated);
                0
            }
            _ => self.run_phase(phase, metrics, rollout.as_ref())?,
        };
        // Exporting the weights before the trainer sleeps belongs to the sync.
        let export = std::mem::take(&mut self.export_seconds);
        metrics.add(phase, started.elapsed().as_secs_f64() - export, bytes);
        metrics.add(Phase::Sync, export, 0);
        let step = metrics.step;
        let total = self.sample_memory(format!("step {step} after_{}", phase.name()));
        metrics.boundary(format!("after_{}", phase.name()), total);
        Ok(self.stopped())
    }

    /// Runs one phase other than generation; returns the bytes it moved.
    fn run_phase(
        &mut self,
        phase: Phase,
        metrics: &mut StepMetrics,
        rollout: Option<&Rollout>,
    ) -> Result<u64, OrchestratorError> {
        let c = &self.config;
        Ok(match phase {
            Phase::Generate => 0,
            Phase::OffloadRollout if self.keep_resident() => 0,
            Phase::OffloadRollout => {
                let mut reports = Vec::new();
                if c.offload_kv {
                    self.engine.flush_cache()?;
                    reports.extend(self.engine.offload_kv()?);
                    self.kv_offloaded = true;
                }
                if c.offload_graphs {
                    reports.extend(self.engine.offload_graphs()?);
                    self.graphs_offloaded = true;
                }
                if c.offload_weights {
                    reports.extend(self.engine.offload_weights()?);
                    self.weights_offloaded = true;
                }
                report_bytes(&reports)
            }
            Phase::OnloadTrain => self.onload_train(metrics)?,
            Phase::Train => {
                if let Some(rollout) = rollout {
                    let stats = self.train(rollout, metrics.step)?;
                    metrics.loss = stats.loss;
                    let rl = &mut metrics.rl;
                    (rl.pg_loss, rl.kl, rl.clip_fraction) =
                        (stats.pg_loss, stats.kl, stats.clip_fraction);
                    rl.entropy = stats.entropy;
                    rl.grad_norm = stats.grad_norm;
                    rl.optimizer_stream = stats.optimizer_stream;
                    rl.lr = stats.lr;
                    rl.train_tokens_per_second = stats.tokens as f64 / stats.seconds.max(1e-9);
                    self.state.step = metrics.step;
                    self.state.reward_means.push(metrics.reward_mean);
                }
                0
            }
            Phase::Save => {
                if self.save_due(metrics.step) {
                    self.save()?;
                }
                0
            }
            Phase::OffloadTrain => {
                if c.offload_train && !self.keep_resident() {
                    self.offload_train()?
                } else {
                    0
                }
            }
            Phase::OnloadWeights => {
                if self.weights_offloaded {
                    let reports = self.engine.onload_weights()?;
                    self.weights_offloaded = false;
                    report_bytes(&reports)
                } else {
                    0
                }
            }
            Phase::Sync if self.device_sync => self.sync_on_device()?,
            Phase::Sync => self.sync()?,
            Phase::OnloadKv => {
                let mut reports = Vec::new();
                if self.graphs_offloaded {
                    reports.extend(self.engine.onload_graphs()?);
                    self.graphs_offloaded = false;
                }
                if self.kv_offloaded {
                    reports.extend(self.engine.onload_kv()?);
                    self.kv_offloaded = false;
                }
                report_bytes(&reports)
            }
        })
    }

    fn generate(&mut self, step: u64) -> Result<Rollout, OrchestratorError> {
        let c = &self.config;
        let problems = self
            .problems
            .problems(Stream::Rollout, step, c.rollout_batch_size);
        let prompts = problems
            .iter()
            .map(|p| p.prompt(&self.tokenizer))
            .collect::<Result<Vec<_>, _>>()?;
        let sampling = self.sampling(step);
        let n = c.n_samples_per_prompt;
        let mut samples = self.engine.generate(&prompts, n, &sampling)?;
        if samples.len() != prompts.len() || samples.iter().any(|s| s.len() != n) {
            return Err(OrchestratorError::Rollout {
                got: format!(
                    "{} groups of sizes {:?}",
                    samples.len(),
                    samples.iter().map(Vec::len).collect::<Vec<_>>()
                ),
                expected: format!("{} prompts x {n} samples", prompts.len()),
            });
        }
        let texts = self.responses(&mut samples);
        let (rewards, responses) = self.score(&problems, &samples, texts)?;
        Ok(Rollout {
            problems,
            prompts,
            samples,
            rewards,
            responses,
        })
    }

    /// How step `step` samples its rollout.
    fn sampling(&self, step: u64) -> Sampling {
        let mut stop_tokens = self.tokenizer.stop_tokens().to_vec();
        stop_tokens.extend(&self.config.rl.stop_token_ids);
        Sampling {
            temperature: self.config.temperature,
            top_p: if self.config.rl.top_p > 0.0 {
                self.config.rl.top_p
            } else {
                1.0
            },
            top_k: self.config.rl.top_k,
            max_new_tokens: self.max_response_len(),
            stop_tokens,
            seed: stream_seed(self.config.seed, Stream::Sampling, step),
        }
    }

    /// The text of every sample, by prompt then sample, each cut at the first stop string
    /// (`--rollout-stop`) with its tokens: without one, the sample's text without its stop
    /// token.
    fn responses(&self, samples: &mut [Vec<Sample>]) -> Vec<Vec<String>> {
        let t = &self.tokenizer;
        let stops = &self.config.rl.stop_strings;
        let decode = |ids: &[u32]| t.decode(ids);
        samples
            .iter_mut()
            .map(|group| {
                group
                    .iter_mut()
                    .map(|s| {
                        cut_at_stop_strings(s, stops, &decode).unwrap_or_else(|| {
                            let end =
                                s.tokens.len() - usize::from(s.stopped && !s.tokens.is_empty());
                            t.decode(&s.tokens[..end])
                        })
                    })
                    .collect()
            })
            .collect()
    }

    /// The reward of every sample with its text `responses` (as [`responses`](Self::responses)
    /// gives them), by prompt then sample; returns the texts flattened alongside.
    fn score(
        &mut self,
        problems: &[Problem],
        samples: &[Vec<Sample>],
        responses: Vec<Vec<String>>,
    ) -> Result<(Vec<f32>, Vec<String>), OrchestratorError> {
        let requests: Vec<RewardRequest<'_>> = problems
            .iter()
            .zip(samples.iter().zip(&responses))
            .flat_map(|(p, (group, texts))| {
                group.iter().zip(texts).map(move |(s, text)| RewardRequest {
                    prompt: &p.text,
                    response: text,
                    label: &p.answer,
                    metadata: &p.metadata,
                    tokens: &s.tokens,
                })
            })
            .collect();
        let rewards = self.reward.score(&requests)?;
        if rewards.len() != requests.len() {
            return Err(RewardError::Count {
                name: self.reward.name().to_owned(),
                got: rewards.len(),
                expected: requests.len(),
            }
            .into());
        }
        let texts = responses.into_iter().flatten().collect();
        Ok((rewards, texts))
    }

    /// Generated tokens per sample at most.
    fn max_response_len(&self) -> usize {
        match &self.problems {
            PromptSource::Task(task) => {
                (self.config.rl.max_response_len).unwrap_or_else(|| task.max_answer_tokens())
            }
            PromptSource::Data { .. } => self.config.rl.data_response_len(),
        }
    }

    /// Advantages, then the actor's optimizer steps over the rollout in global batches (and the
    /// critic's value regression under PPO); returns what the actor's steps measured.
    ///
    /// # Errors
    /// [`OrchestratorError::NonFinite`] for a loss or gradient norm of RL step `step` that is
    /// not finite.
    fn train(
        &mut self,
        rollout: &Rollout,
        step: u64,
    ) -> Result<policy::PolicyStats, OrchestratorError> {
        let n = self.config.n_samples_per_prompt;
        let advantages = match (&mut self.critic, self.config.advantage_estimator) {
            (Some(critic), AdvantageEstimator::Ppo) => {
                let values = critic
                    .values(&rollout.prompts)
                    .map_err(OrchestratorError::train("critic", "compute values"))?;
                ppo_advantages(&rollout.rewards, &values, n)
            }
            (_, AdvantageEstimator::ReinforcePlusPlus) => {
                reinforce_plus_plus_advantages(&rollout.rewards)
            }
            _ => grpo_advantages(&rollout.rewards, n),
        };
        let sequences: Vec<Sequence<'_>> = rollout
            .prompts
            .iter()
            .zip(&rollout.samples)
            .flat_map(|(prompt, group)| group.iter().map(move |s| (prompt, s)))
            .zip(&advantages)
            .map(|((prompt, sample), &weight)| Sequence {
                prompt,
                continuation: &sample.tokens,
                weight,
            })
            .collect();
        let stats = self.train_policy(&sequences, step)?;
        if let Some(critic) = &mut self.critic {
            let prompts: Vec<Vec<u32>> = rollout
                .prompts
                .iter()
                .flat_map(|p| std::iter::repeat_n(p.clone(), n))
                .collect();
            let loss = critic
                .train_values(&prompts, &rollout.rewards)
                .map_err(OrchestratorError::train("critic", "train"))?;
            if !loss.is_finite() {
                return Err(OrchestratorError::NonFinite {
                    role: "critic",
                    what: "loss",
                    phase: "step",
                    step,
                    value: loss,
                });
            }
            tracing::debug!(loss, "critic value regression");
        }
        tracing::debug!(problems = rollout.problems.len(), "trained on the rollout");
        Ok(stats)
    }

    /// One supervised step on correct answers of fresh problems.
    fn warmup_step(&mut self) -> Result<(), OrchestratorError> {
        let index = self.state.warmup_steps + 1;
        let problems =
            self.problems
                .problems(Stream::Warmup, index, self.config.global_batch_size.max(1));
        let pairs: Vec<(Vec<u32>, Vec<u32>)> = problems
            .iter()
            .map(|p| {
                Ok((
                    p.prompt(&self.tokenizer)?,
                    p.answer_tokens(&self.tokenizer)?,
                ))
            })
            .collect::<Result<_, crate::model::ModelError>>()?;
        let sequences: Vec<Sequence<'_>> = pairs
            .iter()
            .map(|(prompt, answer)| Sequence {
                prompt,
                continuation: answer,
                weight: 1.0,
            })
            .collect();
        let batch = build_batch(&sequences, self.tokenizer.pad());
        let stats = self
            .actor
            .get()?
            .train_step(&batch)
            .map_err(OrchestratorError::train("actor", "run a warm-up step"))?;
        check_finite("actor", "warm-up step", index, &stats)?;
        self.state.warmup_steps = index;
        tracing::info!(step = index, loss = stats.loss, "supervised warm-up");
        Ok(())
    }

    /// Records device memory per tag at a boundary; returns the total in use.
    fn sample_memory(&mut self, label: String) -> u64 {
        let mut tags: Vec<(String, u64)> = Vec::new();
        let mut add = |owner: &str, list: Vec<(crate::memory::MemoryTag, u64)>| {
            let bytes = list.iter().map(|(_, bytes)| bytes).sum::<u64>();
            tags.extend(
                list.into_iter()
                    .map(|(tag, bytes)| (format!("{owner}/{tag}"), bytes)),
            );
            bytes
        };
        let mut trainer = add("train", self.actor.device_memory());
        if let Some(critic) = &self.critic {
            trainer += add("critic", critic.device_memory());
        }
        if let Some(reference) = &self.reference {
            trainer += add("ref", reference.device_memory());
        }
        let rollout = add("rollout", self.engine.resident_bytes());
        self.peaks = (self.peaks.0.max(trainer), self.peaks.1.max(rollout));
        let sample = TimelineSample {
            seconds: self.started.elapsed().as_secs_f64(),
            label,
            tags,
        };
        let total = sample.total();
        self.timeline.record(sample);
        total
    }
}

/// The error for a step whose loss or gradient norm is not finite.
fn check_finite(
    role: &'static str,
    phase: &'static str,
    step: u64,
    stats: &crate::backend::StepStats,
) -> Result<(), OrchestratorError> {
    for (what, value) in [("loss", stats.loss), ("gradient norm", stats.grad_norm)] {
        if !value.is_finite() {
            return Err(OrchestratorError::NonFinite {
                role,
                what,
                phase,
                step,
                value,
            });
        }
    }
    Ok(())
}

/// The rollout's lengths, truncated share and throughput.
fn rollout_metrics(rollout: &Rollout, seconds: f64, rl: &mut crate::metrics::RlMetrics) {
    let samples: Vec<&Sample> = rollout.samples.iter().flatten().collect();
    let tokens: usize = samples.iter().map(|s| s.tokens.len()).sum();
    let count = samples.len().max(1) as f32;
    rl.response_len_mean = tokens as f32 / count;
    rl.response_len_max = samples.iter().map(|s| s.tokens.len()).max().unwrap_or(0);
    rl.truncated_fraction = samples.iter().filter(|s| !s.stopped).count() as f32 / count;
    rl.rollout_tokens_per_second = tokens as f64 / seconds.max(1e-9);
}

fn report_bytes(reports: &[OffloadReport]) -> u64 {
    reports.iter().map(|r| r.bytes).sum()
}
