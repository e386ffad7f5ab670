//! The generation loop: admit samples while blocks allow, decode the running ones one token per
//! step, preempt the newest when the cache is full and recompute it later from its tokens.
//!
//! A sample's prompt is prefilled once per prompt into a prefix sequence that its samples fork
//! (sharing the prompt's blocks). A preempted sample comes back by forking the prefix again (or
//! prefilling it again if it was evicted) and replaying its generated tokens through decode
//! steps, which recomputes exactly the keys and values it had, since decoding is
//! batch-invariant; its generator was never rewound, so it continues where it stopped.

use std::collections::VecDeque;
use std::time::Instant;

use miles_core::model::{DecodeScratch, Transformer};
use rand_chacha::ChaCha20Rng;

use crate::paged::{BlockTables, PagedKv};
use crate::sampling::{sample_rng, sample_token};
use crate::{InferError, SamplingParams};

/// Why a sample ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// It drew a stop token (the last token of its output).
    Stop,
    /// It reached `max_new_tokens`.
    Length,
    /// Prompt and output fill the model's positions (`max_position_embeddings`).
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
    /// Samples preempted because the cache was full.
    pub preemptions: usize,
    /// Prompt prefixes dropped to make room.
    pub prefix_evictions: usize,
    /// Most blocks in use at once.
    pub peak_blocks: usize,
    /// Seconds in prefill.
    pub prefill_seconds: f64,
    /// Seconds in decode steps.
    pub decode_seconds: f64,
    /// Seconds of the whole call.
    pub seconds: f64,
}

/// What the loop computes with, borrowed from the engine for one call.
pub(crate) struct Compute<'a> {
    pub model: &'a Transformer,
    pub params: &'a [f32],
    pub tables: &'a mut BlockTables,
    pub storage: &'a mut [f32],
    pub scratch: &'a mut DecodeScratch,
    pub max_batch: usize,
    pub share_prompt_blocks: bool,
}

/// A prompt's prefilled prefix: its sequence and the logits of its last position.
struct Prefix {
    seq: usize,
    logits: Vec<f32>,
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
    rng: ChaCha20Rng,
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    seq: Option<usize>,
    finish: Option<FinishReason>,
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
    let mut samples = Vec::with_capacity(prompts.len() * params.n);
    for group in 0..prompts.len() {
        for index in 0..params.n {
            samples.push(Sample {
                group,
                index,
                rng: sample_rng(params.seed, group, index),
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
    while !l.waiting.is_empty() || !l.running.is_empty() {
        l.admit()?;
        if l.running.is_empty() && !l.waiting.is_empty() {
            return Err(InferError::Internal(format!(
                "no sample could start with {} of {} blocks free",
                l.c.tables.free_blocks(),
                l.c.tables.num_blocks()
            )));
        }
        if !l.running.is_empty() {
            l.reserve_slots()?;
            l.decode()?;
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
    fn kv(&mut self) -> PagedKv<'_> {
        PagedKv {
            tables: &mut *self.c.tables,
            storage: &mut *self.c.storage,
        }
    }

    fn note_blocks(&mut self) {
        let used = self.c.tables.num_blocks() - self.c.tables.free_blocks();
        self.stats.peak_blocks = self.stats.peak_blocks.max(used);
    }

    /// Moves waiting samples into the batch while there is room in it and blocks to spare: the
    /// prompt's blocks if its prefix must be prefilled, plus one per running sequence for its
    /// next step.
    fn admit(&mut self) -> Result<(), InferError> {
        while self.running.len() < self.c.max_batch {
            let Some(&s) = self.waiting.front() else {
                return Ok(());
            };
            let g = self.samples[s].group;
            let prompt_blocks = if self.c.share_prompt_blocks && self.groups[g].prefix.is_some() {
                0
            } else {
                self.c.tables.blocks_for(self.groups[g].prompt.len())
            };
            let need = prompt_blocks + self.running.len() + 1;
            if self.c.tables.free_blocks() < need {
                self.evict_idle_prefixes(Some(g))?;
            }
            if self.c.tables.free_blocks() < need {
                return Ok(());
            }
            self.waiting.pop_front();
            self.start(s)?;
        }
        Ok(())
    }

    /// Gives sample `s` a sequence holding its prompt and, for a new sample, draws its first
    /// token from the prompt's logits.
    fn start(&mut self, s: usize) -> Result<(), InferError> {
        let g = self.samples[s].group;
        let (seq, logits) = if self.c.share_prompt_blocks {
            if self.groups[g].prefix.is_none() {
                let prefix = self.prefill(g)?;
                self.groups[g].prefix = Some(prefix);
            }
            let prefix = self.groups[g]
                .prefix
                .as_ref()
                .ok_or_else(|| InferError::Internal("prefix vanished".into()))?;
            let seq = self.c.tables.fork(prefix.seq)?;
            (seq, None)
        } else {
            let prefix = self.prefill(g)?;
            (prefix.seq, Some(prefix.logits))
        };
        self.samples[s].seq = Some(seq);
        self.groups[g].running += 1;
        self.running.push(s);
        if self.samples[s].tokens.is_empty() {
            let logits = match logits {
                Some(own) => own,
                None => self.groups[g]
                    .prefix
                    .as_ref()
                    .map(|p| p.logits.clone())
                    .ok_or_else(|| InferError::Internal("prefix vanished".into()))?,
            };
            self.draw(s, &logits)?;
        }
        self.note_blocks();
        Ok(())
    }

    /// Prefills group `g`'s prompt into a new sequence.
    fn prefill(&mut self, g: usize) -> Result<Prefix, InferError> {
        let t0 = Instant::now();
        let prompt = self.groups[g].prompt;
        let seq = self.c.tables.add_seq();
        let mut logits = vec![0.0; self.c.model.config().vocab_size];
        let (model, params) = (self.c.model, self.c.params);
        model.prefill(params, &mut self.kv(), seq, prompt, &mut logits)?;
        self.stats.prefill_tokens += prompt.len();
        self.stats.prefill_seconds += t0.elapsed().as_secs_f64();
        Ok(Prefix { seq, logits })
    }

    /// Samples the next token of `s` from `logits` and ends the sample when it is done.
    fn draw(&mut self, s: usize, logits: &[f32]) -> Result<(), InferError> {
        let p = self.params;
        let sample = &mut self.samples[s];
        let (token, logprob) = sample_token(logits, p, &mut sample.rng);
        sample.tokens.push(token);
        sample.logprobs.push(logprob);
        self.stats.generated_tokens += 1;
        let total = self.groups[sample.group].prompt.len() + sample.tokens.len();
        let finish = if p.stop_tokens.contains(&token) {
            Some(FinishReason::Stop)
        } else if sample.tokens.len() >= p.max_new_tokens {
            Some(FinishReason::Length)
        } else if total >= self.c.model.config().max_position_embeddings {
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
            if self.c.tables.prepare_append(seq, self.c.storage)? {
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

    /// One decode step over the running samples: feeds each its next known token; a sample that
    /// has caught up with its tokens draws a new one from its logits.
    fn decode(&mut self) -> Result<(), InferError> {
        let t0 = Instant::now();
        let batch = self.running.clone();
        let mut seqs = Vec::with_capacity(batch.len());
        let mut tokens = Vec::with_capacity(batch.len());
        let mut fresh = Vec::with_capacity(batch.len());
        for &s in &batch {
            let sample = &self.samples[s];
            let seq = sample
                .seq
                .ok_or_else(|| InferError::Internal("running sample without a sequence".into()))?;
            let cached = self.c.tables.seq_len(seq)?;
            let fed = cached - self.groups[sample.group].prompt.len();
            tokens.push(sample.tokens[fed]);
            seqs.push(seq);
            fresh.push(fed + 1 == sample.tokens.len());
        }
        let v = self.c.model.config().vocab_size;
        let mut logits = vec![0.0; batch.len() * v];
        let (model, params) = (self.c.model, self.c.params);
        let mut kv = PagedKv {
            tables: &mut *self.c.tables,
            storage: &mut *self.c.storage,
        };
        model.decode_step(params, &mut kv, &seqs, &tokens, &mut logits, self.c.scratch)?;
        self.stats.decode_steps += 1;
        self.stats.decode_seconds += t0.elapsed().as_secs_f64();
        for (b, &s) in batch.iter().enumerate() {
            if fresh[b] {
                self.draw(s, &logits[b * v..(b + 1) * v])?;
            } else {
                self.stats.replayed_tokens += 1;
            }
        }
        Ok(())
    }
}
