//! The generation loop: admit samples while blocks allow, decode the running ones one token per
//! step, preempt the newest when the cache is full and recompute it later from its tokens.
//!
//! A sample's prompt is prefilled once per prompt into a prefix sequence that its samples fork
//! (sharing the prompt's blocks); the prompts of the samples admitted together are prefilled in
//! one [`Step::prefill`] call. A preempted sample comes back by forking the prefix again (or
//! prefilling it again if it was evicted) and replaying its generated tokens through decode
//! steps, which recomputes the keys and values it had (exactly on the CPU, whose decoding is
//! batch-invariant; within rounding on the GPU, whose matrix products may pick other kernels
//! for other batch sizes). Every draw is keyed by its sample and token index
//! ([`DrawKey`]), so a replayed sample draws what it would have drawn without the preemption.
//!
//! The step draws the tokens itself ([`Step::queue_decode`], [`Step::draw`]): on the GPU only
//! the ids and log-probs come back, never a row of logits per step.
//!
//! One step runs ahead. While a step is on the device, the loop queues the next behind it and
//! only then collects the first: the samples drawing in the first are fed its draws on the
//! device ([`Feed::Drawn`]), so the device never waits for the host between steps. It does so
//! where nothing needs the first step's draws on the host: no sample can be admitted (none
//! waits, or the batch is full) and every sample going on has its next slot without evicting
//! or preempting; a sample whose draw surely ends it (its last new token, the engine's last
//! position) is left out. One that draws a stop token runs the step behind for nothing, and its
//! draw there is dropped. Otherwise the loop collects first and schedules as before.

use std::collections::VecDeque;
use std::time::Instant;

use crate::paged::BlockTables;
use crate::sampling::DrawKey;
use crate::{InferError, SamplingParams};

/// Why a sample ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// It drew a stop token (the last token of its output).
    Stop,
    /// It reached `max_new_tokens`.
    Length,
    /// Prompt and output fill the engine's positions (`EngineConfig::max_positions`, at most
    /// the model's `max_position_embeddings`).
    ContextLimit,
}

/// One sample's output.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Completion {
    /// Index of its prompt in the request.
    pub prompt_index: usize,
    /// Index among its prompt's `n` samples.
    pub sample_index: usize,
    /// The generated tokens.
    pub tokens: Vec<u32>,
    /// Log-prob of each generated token under the temperature-scaled distribution.
    pub logprobs: Vec<f32>,
    /// Why it ended.
    pub finish: FinishReason,
}

/// Counters and timings of one generate call.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct GenerationStats {
    /// Prompt tokens run through prefill (a prompt counts again when its prefix was evicted).
    pub prefill_tokens: usize,
    /// Decode steps.
    pub decode_steps: usize,
    /// Tokens sampled.
    pub generated_tokens: usize,
    /// Tokens decoded again to rebuild preempted samples.
    pub replayed_tokens: usize,
    /// Decode steps queued while the step before them was still running (fed its draws on the
    /// device).
    pub overlapped_steps: usize,
    /// Samples preempted because the cache was full.
    pub preemptions: usize,
    /// Prompt prefixes dropped to make room.
    pub prefix_evictions: usize,
    /// Most blocks in use at once.
    pub peak_blocks: usize,
    /// Decode graphs captured during the call (a bucket's graph is captured once per engine).
    pub graph_captures: usize,
    /// Seconds in prefill.
    pub prefill_seconds: f64,
    /// Seconds in decode steps: the loop's wall time outside admission (planning, queueing,
    /// waiting for and recording the steps).
    pub decode_seconds: f64,
    /// Seconds of the whole call.
    pub seconds: f64,
}

/// The model over the paged cache, as the loop calls it: on the CPU or on the GPU.
pub(crate) trait Step {
    /// Runs `prompts[i]` through the empty sequence `seqs[i]`, whose blocks are reserved
    /// ([`BlockTables::reserve`]), caching every position; returns each prompt's last-position
    /// logits `(V)`. At most `max_batch` prompts come at once.
    fn prefill(
        &mut self,
        tables: &mut BlockTables,
        seqs: &[usize],
        prompts: &[&[u32]],
    ) -> Result<Vec<Vec<f32>>, InferError>;

    /// Appends `tokens[b]` to `seqs[b]` (each one's next slot prepared) and returns the
    /// next-token logits `(B, V)`.
    fn decode_logits(
        &mut self,
        tables: &mut BlockTables,
        seqs: &[usize],
        tokens: &[u32],
    ) -> Result<Vec<f32>, InferError>;

    /// Queues a decode step: appends the token of `feeds[b]` to `seqs[b]` (each one's next
    /// slot prepared) and, for each `b` with a key in `draws`, draws sequence `b`'s next token
    /// under `params`. Returns once the step is queued; [`collect`](Self::collect) returns its
    /// draws. At most two steps are queued at once, and a [`Feed::Drawn`] names a row of the
    /// step queued just before, still uncollected.
    fn queue_decode(
        &mut self,
        tables: &mut BlockTables,
        seqs: &[usize],
        feeds: &[Feed],
        draws: &[Option<DrawKey>],
        params: &SamplingParams,
    ) -> Result<(), InferError>;

    /// The draws of the oldest queued decode step, once it is done: each row's id and
    /// log-prob, `None` where no draw was asked.
    fn collect(&mut self) -> Result<Vec<Option<(u32, f32)>>, InferError>;

    /// Draws a token from each of `rows` (logits `(V)` held on the host, a prompt's, with the
    /// draw's key) under `params`.
    fn draw(
        &mut self,
        rows: &[(&[f32], DrawKey)],
        params: &SamplingParams,
    ) -> Result<Vec<(u32, f32)>, InferError>;

    /// Copies cache block `from` over block `to` (copy-on-write of a shared block).
    fn copy_block(&mut self, from: usize, to: usize) -> Result<(), InferError>;
}

/// Where a decode step's input token comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Feed {
    /// A token the host holds (a replayed one, or one collected already).
    Token(u32),
    /// The token the step queued just before draws in its row `row`: on the GPU it goes from
    /// that step's draws to this step's input on the device, never read back in between.
    Drawn(usize),
}

impl Feed {
    /// The refusal of a [`Feed::Drawn`] naming a row where the step before drew nothing.
    pub(crate) fn undrawn(row: usize) -> InferError {
        InferError::Internal(format!(
            "a decode step fed from row {row} of a step before it that drew none there"
        ))
    }
}

/// What the loop computes with, borrowed from the engine for one call.
pub(crate) struct Compute<'a> {
    pub step: &'a mut dyn Step,
    pub tables: &'a mut BlockTables,
    pub max_positions: usize,
    pub max_batch: usize,
    pub share_prompt_blocks: bool,
}

/// A prompt's prefilled prefix: its sequence and the logits of its last position (empty until
/// the prefill of the admission round that created it has run).
struct Prefix {
    seq: usize,
    logits: Vec<f32>,
}

/// A prefill an admission round asks for: the sequence, its group, and the sample that owns it
/// when prompt blocks are not shared.
struct Pending {
    seq: usize,
    group: usize,
    owner: Option<usize>,
}

/// Where a new sample's first token is drawn from: its group's prefix, or the prefill row it
/// owns (index into the prefill's own rows).
#[derive(Clone, Copy)]
enum FirstRow {
    Prefix(usize),
    Own(usize),
}

/// The key of `sample`'s next draw.
fn key(sample: &Sample) -> DrawKey {
    // The request was checked to hold fewer than 2^32 prompts and samples; a sample never
    // outgrows the model's positions.
    DrawKey {
        prompt: sample.group as u32,
        sample: sample.index as u32,
        token: sample.tokens.len() as u32,
    }
}

struct Group<'p> {
    prompt: &'p [u32],
    prefix: Option<Prefix>,
    unfinished: usize,
    running: usize,
}

struct Sample {
    group: usize,
    index: usize,
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    seq: Option<usize>,
    finish: Option<FinishReason>,
}

/// A decode step queued and not yet collected: its samples in row order, and which of them
/// draw (the others replay a token they had).
struct Flight {
    batch: Vec<usize>,
    draws: Vec<bool>,
}

/// A decode step being planned: its samples, their sequences, inputs and draw keys by row.
struct StepPlan {
    batch: Vec<usize>,
    seqs: Vec<usize>,
    feeds: Vec<Feed>,
    keys: Vec<Option<DrawKey>>,
}

impl StepPlan {
    fn with_capacity(n: usize) -> StepPlan {
        StepPlan {
            batch: Vec::with_capacity(n),
            seqs: Vec::with_capacity(n),
            feeds: Vec::with_capacity(n),
            keys: Vec::with_capacity(n),
        }
    }

    fn push(&mut self, sample: usize, seq: usize, feed: Feed, key: Option<DrawKey>) {
        self.batch.push(sample);
        self.seqs.push(seq);
        self.feeds.push(feed);
        self.keys.push(key);
    }
}

struct Loop<'a, 'p> {
    c: Compute<'a>,
    params: &'p SamplingParams,
    groups: Vec<Group<'p>>,
    samples: Vec<Sample>,
    waiting: VecDeque<usize>,
    running: Vec<usize>,
    stats: GenerationStats,
}

/// Runs every sample of every prompt to its end.
pub(crate) fn run(
    c: Compute<'_>,
    prompts: &[Vec<u32>],
    params: &SamplingParams,
) -> Result<(Vec<Completion>, GenerationStats), InferError> {
    let start = Instant::now();
    if u32::try_from(prompts.len()).is_err() || u32::try_from(params.n).is_err() {
        return Err(InferError::BadParameter {
            what: "request",
            reason: format!(
                "{} prompts of {} samples: both must stay below 2^32",
                prompts.len(),
                params.n
            ),
        });
    }
    let mut samples = Vec::with_capacity(prompts.len() * params.n);
    for group in 0..prompts.len() {
        for index in 0..params.n {
            samples.push(Sample {
                group,
                index,
                tokens: Vec::new(),
                logprobs: Vec::new(),
                seq: None,
                finish: None,
            });
        }
    }
    let mut l = Loop {
        c,
        params,
        groups: prompts
            .iter()
            .map(|p| Group {
                prompt: p,
                prefix: None,
                unfinished: params.n,
                running: 0,
            })
            .collect(),
        waiting: (0..samples.len()).collect(),
        samples,
        running: Vec::new(),
        stats: GenerationStats::default(),
    };
    let mut ahead: Option<Flight> = None;
    loop {
        // Decode time is the loop's wall time outside admission: planning, queueing, waiting
        // and recording.
        if let Some(flight) = ahead.take() {
            let t0 = Instant::now();
            let behind = l.queue_behind(&flight)?;
            l.collect(flight)?;
            ahead = behind;
            l.stats.decode_seconds += t0.elapsed().as_secs_f64();
            continue;
        }
        if l.waiting.is_empty() && l.running.is_empty() {
            break;
        }
        l.admit()?;
        if l.running.is_empty() && !l.waiting.is_empty() {
            return Err(InferError::Internal(format!(
                "no sample could start with {} of {} blocks free",
                l.c.tables.free_blocks(),
                l.c.tables.num_blocks()
            )));
        }
        if !l.running.is_empty() {
            let t0 = Instant::now();
            l.reserve_slots()?;
            ahead = Some(l.queue_step()?);
            l.stats.decode_seconds += t0.elapsed().as_secs_f64();
        }
    }
    l.stats.seconds = start.elapsed().as_secs_f64();
    let completions = l
        .samples
        .into_iter()
        .map(|s| {
            let finish = s.finish.ok_or_else(|| {
                InferError::Internal(format!("sample {} ended unfinished", s.index))
            })?;
            Ok(Completion {
                prompt_index: s.group,
                sample_index: s.index,
                tokens: s.tokens,
                logprobs: s.logprobs,
                finish,
            })
        })
        .collect::<Result<_, InferError>>()?;
    Ok((completions, l.stats))
}

impl Loop<'_, '_> {
    fn note_blocks(&mut self) {
        let used = self.c.tables.num_blocks() - self.c.tables.free_blocks();
        self.stats.peak_blocks = self.stats.peak_blocks.max(used);
    }

    /// Moves waiting samples into the batch while there is room in it and blocks to spare: the
    /// prompt's blocks if its prefix must be prefilled, plus one per running sequence for its
    /// next step. The prompts of the admitted samples are prefilled together, then each new
    /// sample draws its first token.
    fn admit(&mut self) -> Result<(), InferError> {
        let mut started = Vec::new();
        let mut pending = Vec::new();
        while self.running.len() < self.c.max_batch {
            let Some(&s) = self.waiting.front() else {
                break;
            };
            let g = self.samples[s].group;
            let prompt_len = self.groups[g].prompt.len();
            let prompt_blocks = if self.c.share_prompt_blocks && self.groups[g].prefix.is_some() {
                0
            } else {
                self.c.tables.blocks_for(prompt_len)
            };
            let need = prompt_blocks + self.running.len() + 1;
            if self.c.tables.free_blocks() < need {
                self.evict_idle_prefixes(Some(g))?;
            }
            if self.c.tables.free_blocks() < need {
                break;
            }
            self.waiting.pop_front();
            if prompt_blocks > 0 {
                let seq = self.c.tables.add_seq();
                if !self.c.tables.reserve(seq, prompt_len)? {
                    return Err(InferError::Internal(format!(
                        "{} free blocks could not hold a prompt of {prompt_len} positions",
                        self.c.tables.free_blocks()
                    )));
                }
                let owner = if self.c.share_prompt_blocks {
                    self.groups[g].prefix = Some(Prefix {
                        seq,
                        logits: Vec::new(),
                    });
                    None
                } else {
                    self.samples[s].seq = Some(seq);
                    Some(s)
                };
                pending.push(Pending {
                    seq,
                    group: g,
                    owner,
                });
            }
            self.groups[g].running += 1;
            self.running.push(s);
            started.push(s);
        }
        let own_logits = self.prefill(&pending)?;
        let mut first = Vec::new();
        for s in started {
            if let Some(row) = self.start(s, &own_logits)? {
                first.push((s, row));
            }
        }
        self.draw_first(&first, &own_logits)?;
        self.note_blocks();
        Ok(())
    }

    /// Draws the first token of each new sample of `first` from its prompt's logits.
    fn draw_first(
        &mut self,
        first: &[(usize, FirstRow)],
        own_logits: &[(usize, Vec<f32>)],
    ) -> Result<(), InferError> {
        if first.is_empty() {
            return Ok(());
        }
        let vanished = || InferError::Internal("prefix vanished".into());
        let mut rows = Vec::with_capacity(first.len());
        for &(s, row) in first {
            let logits = match row {
                FirstRow::Prefix(g) => self.groups[g]
                    .prefix
                    .as_ref()
                    .map(|p| p.logits.as_slice())
                    .ok_or_else(vanished)?,
                FirstRow::Own(i) => own_logits[i].1.as_slice(),
            };
            rows.push((logits, key(&self.samples[s])));
        }
        let drawn = self.c.step.draw(&rows, self.params)?;
        if drawn.len() != first.len() {
            return Err(InferError::Internal(format!(
                "{} draws returned {} tokens",
                first.len(),
                drawn.len()
            )));
        }
        for (&(s, _), (token, logprob)) in first.iter().zip(drawn) {
            self.record(s, token, logprob)?;
        }
        Ok(())
    }

    /// Gives the admitted sample `s` its sequence (a fork of its prompt's prefix when blocks are
    /// shared); for a new sample, returns the row of logits its first token comes from.
    fn start(
        &mut self,
        s: usize,
        own_logits: &[(usize, Vec<f32>)],
    ) -> Result<Option<FirstRow>, InferError> {
        let g = self.samples[s].group;
        let vanished = || InferError::Internal("prefix vanished".into());
        if self.c.share_prompt_blocks {
            let prefix = self.groups[g].prefix.as_ref().ok_or_else(vanished)?;
            let seq = self.c.tables.fork(prefix.seq)?;
            self.samples[s].seq = Some(seq);
        }
        if !self.samples[s].tokens.is_empty() {
            return Ok(None);
        }
        if self.c.share_prompt_blocks {
            return Ok(Some(FirstRow::Prefix(g)));
        }
        own_logits
            .iter()
            .position(|(owner, _)| *owner == s)
            .map(|i| Some(FirstRow::Own(i)))
            .ok_or_else(vanished)
    }

    /// Prefills the prompts an admission round asked for, in one call; prefixes get their
    /// logits, and the logits of samples that own their prompt's sequence come back.
    fn prefill(&mut self, pending: &[Pending]) -> Result<Vec<(usize, Vec<f32>)>, InferError> {
        if pending.is_empty() {
            return Ok(Vec::new());
        }
        let t0 = Instant::now();
        let seqs: Vec<usize> = pending.iter().map(|p| p.seq).collect();
        let prompts: Vec<&[u32]> = pending
            .iter()
            .map(|p| self.groups[p.group].prompt)
            .collect();
        let logits = self.c.step.prefill(self.c.tables, &seqs, &prompts)?;
        if logits.len() != pending.len() {
            return Err(InferError::Internal(format!(
                "prefill of {} prompts returned {} rows of logits",
                pending.len(),
                logits.len()
            )));
        }
        self.stats.prefill_tokens += prompts.iter().map(|p| p.len()).sum::<usize>();
        self.stats.prefill_seconds += t0.elapsed().as_secs_f64();
        let mut own = Vec::new();
        for (p, logits) in pending.iter().zip(logits) {
            match (p.owner, self.groups[p.group].prefix.as_mut()) {
                (Some(s), _) => own.push((s, logits)),
                (None, Some(prefix)) => prefix.logits = logits,
                (None, None) => return Err(InferError::Internal("prefix vanished".into())),
            }
        }
        Ok(own)
    }

    /// Appends the drawn `token` to `s` and ends the sample when it is done.
    fn record(&mut self, s: usize, token: u32, logprob: f32) -> Result<(), InferError> {
        let p = self.params;
        let sample = &mut self.samples[s];
        sample.tokens.push(token);
        sample.logprobs.push(logprob);
        self.stats.generated_tokens += 1;
        let total = self.groups[sample.group].prompt.len() + sample.tokens.len();
        let finish = if p.stop_tokens.contains(&token) {
            Some(FinishReason::Stop)
        } else if sample.tokens.len() >= p.max_new_tokens {
            Some(FinishReason::Length)
        } else if total >= self.c.max_positions {
            Some(FinishReason::ContextLimit)
        } else {
            None
        };
        if let Some(reason) = finish {
            sample.finish = Some(reason);
            self.stop(s)?;
            let g = self.samples[s].group;
            self.groups[g].unfinished -= 1;
            if self.groups[g].unfinished == 0
                && let Some(prefix) = self.groups[g].prefix.take()
            {
                self.c.tables.free_seq(prefix.seq)?;
            }
        }
        Ok(())
    }

    /// Takes `s` out of the batch and frees its sequence.
    fn stop(&mut self, s: usize) -> Result<(), InferError> {
        if let Some(seq) = self.samples[s].seq.take() {
            self.c.tables.free_seq(seq)?;
        }
        self.running.retain(|&r| r != s);
        self.groups[self.samples[s].group].running -= 1;
        Ok(())
    }

    /// Frees the prefixes of groups with no running sample (except `keep`'s); returns whether
    /// any was freed.
    fn evict_idle_prefixes(&mut self, keep: Option<usize>) -> Result<bool, InferError> {
        let mut evicted = false;
        for g in 0..self.groups.len() {
            if Some(g) == keep || self.groups[g].running > 0 {
                continue;
            }
            if let Some(prefix) = self.groups[g].prefix.take() {
                self.c.tables.free_seq(prefix.seq)?;
                self.stats.prefix_evictions += 1;
                evicted = true;
            }
        }
        Ok(evicted)
    }

    /// Makes every running sample's next slot writable, preempting the newest samples (and
    /// evicting idle prefixes first) until the rest fit.
    fn reserve_slots(&mut self) -> Result<(), InferError> {
        let mut i = 0;
        while i < self.running.len() {
            let s = self.running[i];
            let seq = self.samples[s]
                .seq
                .ok_or_else(|| InferError::Internal("running sample without a sequence".into()))?;
            let step = &mut *self.c.step;
            if self
                .c
                .tables
                .prepare_append_with(seq, |from, to| step.copy_block(from, to))?
            {
                i += 1;
                continue;
            }
            if self.evict_idle_prefixes(None)? {
                continue;
            }
            if self.running.len() > 1 {
                // The newest sample goes back to the front of the queue, its blocks freed.
                let victim = self.running[self.running.len() - 1];
                tracing::debug!(
                    sample = self.samples[victim].index,
                    prompt = self.samples[victim].group,
                    free = self.c.tables.free_blocks(),
                    "kv cache full: preempting the newest sample"
                );
                self.stop(victim)?;
                self.waiting.push_front(victim);
                self.stats.preemptions += 1;
                continue;
            }
            // Alone and still short: its own prefix holds the prompt's partial block.
            let g = self.samples[s].group;
            match self.groups[g].prefix.take() {
                Some(prefix) => {
                    self.c.tables.free_seq(prefix.seq)?;
                    self.stats.prefix_evictions += 1;
                }
                None => {
                    return Err(InferError::Internal(format!(
                        "one sequence of {} blocks does not fit a cache of {}",
                        self.c.tables.num_blocks() - self.c.tables.free_blocks(),
                        self.c.tables.num_blocks()
                    )));
                }
            }
        }
        self.note_blocks();
        Ok(())
    }

    /// Queues a decode step over the running samples, each fed its next known token; a sample
    /// that has caught up with its tokens draws a new one from its logits.
    fn queue_step(&mut self) -> Result<Flight, InferError> {
        let batch = self.running.clone();
        let mut step = StepPlan::with_capacity(batch.len());
        for &s in &batch {
            let sample = &self.samples[s];
            let seq = sample
                .seq
                .ok_or_else(|| InferError::Internal("running sample without a sequence".into()))?;
            let fed = self.c.tables.seq_len(seq)? - self.groups[sample.group].prompt.len();
            let draws = fed + 1 == sample.tokens.len();
            step.push(
                s,
                seq,
                Feed::Token(sample.tokens[fed]),
                draws.then(|| key(sample)),
            );
        }
        self.queue(step)
    }

    /// Queues the step after `flight` before collecting it (the module's "one step runs
    /// ahead"), or returns `None` where it needs the flight's draws on the host.
    fn queue_behind(&mut self, flight: &Flight) -> Result<Option<Flight>, InferError> {
        // A sample waiting for a place in the batch is admitted first (the draws it needs
        // would overwrite the ones a step behind is fed).
        if !self.waiting.is_empty() && self.running.len() < self.c.max_batch {
            return Ok(None);
        }
        let mut step = StepPlan::with_capacity(flight.batch.len());
        for (row, (&s, &drawing)) in flight.batch.iter().zip(&flight.draws).enumerate() {
            let sample = &self.samples[s];
            // Ended on a stop token the step before the flight drew.
            let Some(seq) = sample.seq else {
                continue;
            };
            let prompt = self.groups[sample.group].prompt.len();
            let fed = self.c.tables.seq_len(seq)? - prompt;
            let known = sample.tokens.len();
            let (feed, draws) = if drawing {
                // Its tokens once the flight's draw is in: the draw surely ends it here.
                let total = known + 1;
                if total >= self.params.max_new_tokens || prompt + total >= self.c.max_positions {
                    continue;
                }
                if fed != known {
                    return Err(InferError::Internal(format!(
                        "a sample drawing its token {known} had {fed} tokens cached"
                    )));
                }
                (Feed::Drawn(row), true)
            } else {
                (Feed::Token(sample.tokens[fed]), fed + 1 == known)
            };
            // The token it draws is its (fed + 1)th, whether or not the flight's is in yet.
            let key = DrawKey {
                token: (fed + 1) as u32,
                ..key(sample)
            };
            let steps = &mut *self.c.step;
            if !self
                .c
                .tables
                .prepare_append_with(seq, |from, to| steps.copy_block(from, to))?
            {
                return Ok(None);
            }
            step.push(s, seq, feed, draws.then_some(key));
        }
        if step.batch.is_empty() {
            return Ok(None);
        }
        self.note_blocks();
        self.stats.overlapped_steps += 1;
        self.queue(step).map(Some)
    }

    fn queue(&mut self, step: StepPlan) -> Result<Flight, InferError> {
        self.c.step.queue_decode(
            self.c.tables,
            &step.seqs,
            &step.feeds,
            &step.keys,
            self.params,
        )?;
        Ok(Flight {
            draws: step.keys.iter().map(Option::is_some).collect(),
            batch: step.batch,
        })
    }

    /// Collects the draws of `flight` and records them. A sample that ended meanwhile (on a
    /// stop token of the step before) drops its draw.
    fn collect(&mut self, flight: Flight) -> Result<(), InferError> {
        let drawn = self.c.step.collect()?;
        if drawn.len() != flight.batch.len() {
            return Err(InferError::Internal(format!(
                "decode of {} sequences returned {} draws",
                flight.batch.len(),
                drawn.len()
            )));
        }
        self.stats.decode_steps += 1;
        for ((&s, &draws), drawn) in flight.batch.iter().zip(&flight.draws).zip(drawn) {
            match (draws, drawn) {
                (true, Some((token, logprob))) => {
                    if self.samples[s].finish.is_none() {
                        self.record(s, token, logprob)?;
                    }
                }
                (false, None) => self.stats.replayed_tokens += 1,
                _ => {
                    return Err(InferError::Internal(
                        "a decode step drew for the wrong sequences".into(),
                    ));
                }
            }
        }
        Ok(())
    }
}
