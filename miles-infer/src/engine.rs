//! The rollout engine: the model's weights in one `weights`-tagged buffer, the paged KV cache in
//! one `kv_cache`-tagged buffer, and batched generation over them.

use std::path::Path;
use std::sync::Arc;

use miles_core::model::{
    ByteTokenizer, DecodeScratch, LlamaConfig, ParamLayout, Transformer, load_config, load_params,
};
use miles_core::{BackupPolicy, Buffer, MemoryManager, MemoryTag, RegionState, Settings};

use crate::paged::BlockTables;
use crate::schedule::{self, Completion, GenerationStats};
use crate::{InferError, SamplingParams};

/// How much of the device the KV cache takes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KvCapacity {
    /// This fraction of the device memory free once the weights are allocated
    /// (`--rollout-mem-fraction`), capped at what `max_batch` sequences of the model's full
    /// context, and as many prompts, can ever hold.
    MemFraction(f64),
    /// Exactly this many blocks (tests and benchmarks that force a small cache).
    Blocks(usize),
}

/// How a [`RolloutEngine`] is built.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineConfig {
    /// Positions per KV block.
    pub block_size: usize,
    /// Sequences decoded together in one step at most.
    pub max_batch: usize,
    /// Size of the KV cache.
    pub kv_capacity: KvCapacity,
    /// Backup of the weights while offloaded: `Host` brings them back from the host pool,
    /// `None` drops them (they must be re-sent with `update_weights`).
    pub weights_policy: BackupPolicy,
    /// Whether the `n` samples of a prompt share its KV blocks (off only to compare against).
    pub share_prompt_blocks: bool,
}

impl EngineConfig {
    /// The engine settings of a run: KV cache at `--rollout-mem-fraction`, host backup of the
    /// weights, blocks of 16 positions, up to 64 sequences per step, shared prompt blocks.
    pub fn from_settings(settings: &Settings) -> Self {
        Self {
            block_size: 16,
            max_batch: 64,
            kv_capacity: KvCapacity::MemFraction(settings.rollout_mem_fraction),
            weights_policy: BackupPolicy::Host,
            share_prompt_blocks: true,
        }
    }
}

/// What one [`RolloutEngine::generate`] call returns.
#[derive(Clone, Debug)]
pub struct Generation {
    /// One completion per sample, ordered by prompt, then sample.
    pub completions: Vec<Completion>,
    /// Counters and timings of the call.
    pub stats: GenerationStats,
}

/// The rollout engine: weights under tag `weights`, a paged KV cache under `kv_cache`.
///
/// Computes on the CPU from host views of both buffers, so its memory manager must run on the
/// CPU device. Weights start missing: load a checkpoint or send every tensor with
/// [`write_tensor`](Self::write_tensor) before generating.
#[derive(Debug)]
pub struct RolloutEngine {
    memory: Arc<MemoryManager>,
    model: Transformer,
    tokenizer: ByteTokenizer,
    config: EngineConfig,
    weights: Buffer,
    kv: Buffer,
    tables: BlockTables,
    scratch: DecodeScratch,
    loaded: Vec<bool>,
}

impl RolloutEngine {
    /// An engine for `model_config`: creates the `weights` and `kv_cache` regions in `memory`
    /// and allocates both buffers.
    ///
    /// # Errors
    /// [`InferError::BadParameter`] for a zero block size or batch, or a cache of no block;
    /// [`InferError::Memory`] when a region exists or the device is out of memory;
    /// [`InferError::Model`] for a config without the byte tokenizer's ids.
    pub fn new(
        memory: Arc<MemoryManager>,
        model_config: LlamaConfig,
        config: EngineConfig,
    ) -> Result<Self, InferError> {
        let bad = |what, reason: String| InferError::BadParameter { what, reason };
        if config.block_size == 0 || config.max_batch == 0 {
            return Err(bad(
                "engine config",
                "block_size and max_batch must be at least 1".into(),
            ));
        }
        let tokenizer = ByteTokenizer::from_config(&model_config)?;
        let model = Transformer::new(model_config);
        let weight_bytes = model.layout().len() * 4;
        memory
            .create_region(MemoryTag::Weights, config.weights_policy, weight_bytes)
            .map_err(InferError::memory("create the weights region"))?;
        let weights = memory
            .alloc(&MemoryTag::Weights, weight_bytes)
            .map_err(InferError::memory("allocate the weights"))?;
        let c = model.config();
        let block_bytes = BlockTables::block_floats(c, config.block_size) * 4;
        let num_blocks = match config.kv_capacity {
            KvCapacity::Blocks(n) => n,
            KvCapacity::MemFraction(fraction) => {
                if !(fraction > 0.0 && fraction <= 1.0) {
                    return Err(bad(
                        "rollout memory fraction",
                        format!("{fraction} must lie in (0, 1]"),
                    ));
                }
                let free = memory
                    .device()
                    .memory_info()
                    .map_err(|source| InferError::Device {
                        action: "read the device's free memory",
                        source,
                    })?
                    .free;
                let useful =
                    2 * config.max_batch * c.max_position_embeddings.div_ceil(config.block_size);
                ((free as f64 * fraction) as usize / block_bytes).min(useful)
            }
        };
        if num_blocks == 0 {
            return Err(bad(
                "kv cache capacity",
                format!(
                    "no block of {block_bytes} bytes fits; raise --rollout-mem-fraction or the device memory"
                ),
            ));
        }
        memory
            .create_region(
                MemoryTag::KvCache,
                BackupPolicy::None,
                num_blocks * block_bytes,
            )
            .map_err(InferError::memory("create the kv cache region"))?;
        let kv = memory
            .alloc(&MemoryTag::KvCache, num_blocks * block_bytes)
            .map_err(InferError::memory("allocate the kv cache"))?;
        tracing::info!(
            blocks = num_blocks,
            block_size = config.block_size,
            kv_bytes = num_blocks * block_bytes,
            weight_bytes,
            "rollout engine ready"
        );
        Ok(Self {
            tables: BlockTables::new(c, num_blocks, config.block_size),
            scratch: DecodeScratch::new(c, config.max_batch, c.max_position_embeddings),
            loaded: vec![false; model.layout().specs().len()],
            memory,
            model,
            tokenizer,
            config,
            weights,
            kv,
        })
    }

    /// An engine whose weights come from the Hugging Face checkpoint directory `dir`.
    ///
    /// # Errors
    /// As [`new`](Self::new) and [`load_checkpoint`](Self::load_checkpoint).
    pub fn from_checkpoint(
        memory: Arc<MemoryManager>,
        dir: &Path,
        config: EngineConfig,
    ) -> Result<Self, InferError> {
        let mut engine = Self::new(memory, load_config(dir)?, config)?;
        engine.load_checkpoint(dir)?;
        Ok(engine)
    }

    /// Reads every tensor of checkpoint `dir` straight into the weights buffer.
    ///
    /// # Errors
    /// [`InferError::Memory`] while the weights are offloaded; [`InferError::Model`] for a
    /// checkpoint that does not match the model.
    pub fn load_checkpoint(&mut self, dir: &Path) -> Result<(), InferError> {
        let mut view = self
            .weights
            .view_mut::<f32>()
            .map_err(InferError::memory("write the weights"))?;
        load_params(dir, self.model.layout(), &mut view)?;
        self.loaded.fill(true);
        Ok(())
    }

    /// Writes tensors of the parameter table, each given as its index and its elements in
    /// order, under one view of the weights buffer (one bucket of a weight update).
    ///
    /// # Errors
    /// [`InferError::Memory`] while the weights are offloaded; [`InferError::Internal`] for an
    /// index or length that does not match the table (callers check against
    /// [`layout`](Self::layout) first); nothing is written then.
    pub fn write_tensors(&mut self, tensors: &[(usize, &[f32])]) -> Result<(), InferError> {
        let specs = self.model.layout().specs();
        let mut ranges = Vec::with_capacity(tensors.len());
        for &(index, data) in tensors {
            let spec = specs
                .get(index)
                .filter(|s| s.numel() == data.len())
                .ok_or_else(|| {
                    InferError::Internal(format!(
                        "tensor {index} with {} elements is not in the parameter table",
                        data.len()
                    ))
                })?;
            ranges.push(spec.range());
        }
        let mut view = self
            .weights
            .view_mut::<f32>()
            .map_err(InferError::memory("write the weights"))?;
        for (&(index, data), range) in tensors.iter().zip(ranges) {
            view[range].copy_from_slice(data);
            self.loaded[index] = true;
        }
        Ok(())
    }

    /// Marks every weight tensor missing (their bytes were dropped).
    pub(crate) fn forget_weights(&mut self) {
        self.loaded.fill(false);
    }

    /// The parameter table: names, shapes and offsets of the weights.
    pub fn layout(&self) -> &ParamLayout {
        self.model.layout()
    }

    /// The model config.
    pub fn model_config(&self) -> &LlamaConfig {
        self.model.config()
    }

    /// The tokenizer of the model.
    pub fn tokenizer(&self) -> &ByteTokenizer {
        &self.tokenizer
    }

    /// The engine's config.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The memory manager holding the engine's regions.
    pub fn memory(&self) -> &Arc<MemoryManager> {
        &self.memory
    }

    /// Blocks of the KV cache.
    pub fn kv_blocks(&self) -> usize {
        self.tables.num_blocks()
    }

    /// Drops every sequence's blocks; the cache is empty afterwards.
    pub fn flush_cache(&mut self) {
        self.tables.clear();
    }

    /// Blocks held by live sequences (none between generate calls).
    pub fn used_blocks(&self) -> usize {
        self.tables.num_blocks() - self.tables.free_blocks()
    }

    /// Generates `params.n` samples for every prompt (token ids).
    ///
    /// Samples are independent of batching, of preemption and of block sharing: each draws from
    /// its own generator seeded by `(seed, prompt index, sample index)`, and decoding is
    /// batch-invariant. When the cache runs out, the newest sequence is preempted (its blocks
    /// freed) and later recomputed from its tokens.
    ///
    /// # Errors
    /// [`InferError::Offloaded`] naming what is offloaded, [`InferError::WeightsMissing`],
    /// [`InferError::BadParameter`], [`InferError::BadPrompt`], [`InferError::CacheTooSmall`]
    /// when one sequence could never fit; [`InferError::Model`] from the model.
    pub fn generate(
        &mut self,
        prompts: &[Vec<u32>],
        params: &SamplingParams,
    ) -> Result<Generation, InferError> {
        self.check_resident("generate", true)?;
        self.check_loaded()?;
        params.validate()?;
        let c = self.model.config();
        let mut longest = 0;
        for (index, prompt) in prompts.iter().enumerate() {
            let reason = if prompt.is_empty() {
                Some("is empty; give at least one token (the BOS id)".to_string())
            } else if prompt.len() >= c.max_position_embeddings {
                Some(format!(
                    "has {} tokens, the model takes {} positions and needs room for one new token",
                    prompt.len(),
                    c.max_position_embeddings
                ))
            } else {
                prompt
                    .iter()
                    .find(|&&id| id as usize >= c.vocab_size)
                    .map(|id| format!("holds id {id}, outside the vocabulary of {}", c.vocab_size))
            };
            if let Some(reason) = reason {
                return Err(InferError::BadPrompt { index, reason });
            }
            longest = longest
                .max((prompt.len() + params.max_new_tokens).min(c.max_position_embeddings) - 1);
        }
        // A sequence's own blocks, plus the prompt's partial block its group keeps.
        let need = self.tables.blocks_for(longest) + 1;
        if need > self.tables.num_blocks() {
            return Err(InferError::CacheTooSmall {
                need,
                have: self.tables.num_blocks(),
                positions: longest,
                block_size: self.config.block_size,
            });
        }
        let params_view = self
            .weights
            .view::<f32>()
            .map_err(InferError::memory("read the weights"))?;
        let mut kv_view = self
            .kv
            .view_mut::<f32>()
            .map_err(InferError::memory("use the kv cache"))?;
        let storage = &mut kv_view[..self.tables.storage_floats()];
        let outcome = schedule::run(
            schedule::Compute {
                model: &self.model,
                params: &params_view,
                tables: &mut self.tables,
                storage,
                scratch: &mut self.scratch,
                max_batch: self.config.max_batch,
                share_prompt_blocks: self.config.share_prompt_blocks,
            },
            prompts,
            params,
        );
        self.tables.clear();
        let (completions, stats) = outcome?;
        Ok(Generation { completions, stats })
    }

    /// Errors naming what `action` needs (the weights, and the kv cache when `kv`) and finds
    /// offloaded.
    pub(crate) fn check_resident(&self, action: &'static str, kv: bool) -> Result<(), InferError> {
        let state = |tag: &MemoryTag| {
            self.memory
                .state(tag)
                .map_err(InferError::memory("read a region's state"))
        };
        let mut what = Vec::new();
        let mut fix = Vec::new();
        if state(&MemoryTag::Weights)? != RegionState::Active {
            what.push("the weights");
            fix.push("onload_weights");
        }
        if kv && state(&MemoryTag::KvCache)? != RegionState::Active {
            what.push("the kv cache");
            fix.push("onload_kv");
        }
        if !what.is_empty() {
            let verb = if what == ["the kv cache"] {
                "is"
            } else {
                "are"
            };
            return Err(InferError::Offloaded {
                action,
                what: format!("{} {verb}", what.join(" and ")),
                fix: fix.join(" and "),
            });
        }
        Ok(())
    }

    /// Errors naming the weight tensors not loaded since the weights were dropped.
    fn check_loaded(&self) -> Result<(), InferError> {
        let missing: Vec<&str> = self
            .layout()
            .specs()
            .iter()
            .zip(&self.loaded)
            .filter(|(_, loaded)| !**loaded)
            .map(|(spec, _)| spec.name.as_str())
            .collect();
        if !missing.is_empty() {
            let mut names = missing
                .iter()
                .take(3)
                .copied()
                .collect::<Vec<_>>()
                .join(", ");
            if missing.len() > 3 {
                names.push_str(", ...");
            }
            return Err(InferError::WeightsMissing {
                missing: missing.len(),
                total: self.loaded.len(),
                names,
            });
        }
        Ok(())
    }
}
