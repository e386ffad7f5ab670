//! The rollout engine: the model's weights in one `weights`-tagged buffer, the paged KV cache in
//! one `kv_cache`-tagged buffer, and batched generation over them, on the CPU (fp32, host
//! views) or on the GPU (bf16, kernels; see the `gpu` module).

use std::path::Path;
use std::sync::Arc;

use miles_core::device::Gpu;
use miles_core::model::{
    DecodeScratch, LlamaConfig, ParamLayout, Transformer, load_config, load_hf_params,
};
use miles_core::{
    BackupPolicy, Buffer, DeviceKind, DeviceWeights, MemoryManager, MemoryTag, RegionState,
    Settings,
};

use crate::gpu::{self, GpuBuffers, GpuModel, Limits};
use crate::host::HostStep;
use crate::paged::BlockTables;
use crate::schedule::{self, Completion, GenerationStats, Step};
use crate::{InferError, SamplingParams};

/// How much of the device the KV cache takes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KvCapacity {
    /// This fraction of the device memory free once the weights are allocated
    /// (`--rollout-mem-fraction`), less the GPU's scratch, capped at what `max_batch`
    /// sequences of the model's full context, and as many prompts, can ever hold.
    MemFraction(f64),
    /// Exactly this many blocks (tests and benchmarks that force a small cache).
    Blocks(usize),
}

/// How a [`Engine`] is built.
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
    /// On the GPU: decode steps run as CUDA graphs captured once per batch bucket (off: as
    /// queued kernels, `--rollout-disable-cuda-graph`).
    pub cuda_graphs: bool,
    /// Positions one sequence fills at most, its prompt and what it generates; `None` for the
    /// model's `max_position_embeddings` (a larger value is lowered to it). What is sized per
    /// sequence follows it: on the GPU the prefill's scratch (a prompt is prefilled whole), the
    /// block table of each sequence a decode step uploads and the rotary tables; the cache
    /// blocks worth holding. A prompt that leaves no room for a new token within it is
    /// refused.
    pub max_positions: Option<usize>,
}

impl EngineConfig {
    /// The engine settings of a run: KV cache at `--rollout-mem-fraction`, host backup of the
    /// weights, blocks of 16 positions, up to 256 sequences per step, shared prompt blocks,
    /// CUDA graphs unless `--rollout-disable-cuda-graph`, sequences as long as the model
    /// takes (a caller that knows its prompts and response length sets `max_positions`).
    pub fn from_settings(settings: &Settings) -> Self {
        Self {
            block_size: 16,
            max_batch: 256,
            kv_capacity: KvCapacity::MemFraction(settings.rollout_mem_fraction),
            weights_policy: BackupPolicy::Host,
            share_prompt_blocks: true,
            cuda_graphs: !settings.rollout_disable_cuda_graph,
            max_positions: None,
        }
    }
}

/// Blocks of `block_bytes` the cache gets under `config`, with `reserved` bytes of the same
/// budget going to the GPU's scratch.
fn kv_blocks(
    memory: &MemoryManager,
    config: &EngineConfig,
    positions: usize,
    block_bytes: usize,
    reserved: usize,
) -> Result<usize, InferError> {
    let num_blocks = match config.kv_capacity {
        KvCapacity::Blocks(n) => n,
        KvCapacity::MemFraction(fraction) => {
            if !(fraction > 0.0 && fraction <= 1.0) {
                return Err(InferError::BadParameter {
                    what: "rollout memory fraction",
                    reason: format!("{fraction} must lie in (0, 1]"),
                });
            }
            let free = memory
                .device()
                .memory_info()
                .map_err(InferError::device("read the device's free memory"))?
                .free;
            let useful = 2 * config.max_batch * positions.div_ceil(config.block_size);
            (((free as f64 * fraction) as usize).saturating_sub(reserved) / block_bytes).min(useful)
        }
    };
    if num_blocks == 0 {
        return Err(InferError::BadParameter {
            what: "kv cache capacity",
            reason: format!(
                "no block of {block_bytes} bytes fits beside {reserved} bytes of scratch; raise --rollout-mem-fraction or the device memory"
            ),
        });
    }
    Ok(num_blocks)
}

/// What one [`Engine::generate`] call returns.
#[derive(Clone, Debug)]
pub struct Generation {
    /// One completion per sample, ordered by prompt, then sample.
    pub completions: Vec<Completion>,
    /// Counters and timings of the call.
    pub stats: GenerationStats,
}

/// The rollout engine: weights under tag `weights`, a paged KV cache under `kv_cache`.
///
/// Built with [`new`](Self::new) on a memory manager of the CPU device, it computes in fp32 from
/// host views of both buffers. Built with [`on_gpu`](Self::on_gpu) on a memory manager of a CUDA
/// device, it keeps the weights and the cache in bf16 and runs every step as GPU kernels; the
/// `kv_cache` region then also holds the prefill's scratch, and the `cuda_graph` region the
/// decode step's (the static buffers of its CUDA graphs), so offloading the three tags frees
/// all of the engine's device memory. Weights start missing: load a checkpoint or send every tensor
/// with [`write_tensors`](Self::write_tensors) before generating.
#[derive(Debug)]
pub struct Engine {
    memory: Arc<MemoryManager>,
    model: Transformer,
    config: EngineConfig,
    /// Positions one sequence fills at most ([`EngineConfig::max_positions`] resolved).
    positions: usize,
    backend: Backend,
    tables: BlockTables,
    loaded: Vec<bool>,
}

/// Where the engine computes, and the buffers it computes on.
#[derive(Debug)]
enum Backend {
    /// fp32 weights and cache read through host views.
    Host {
        weights: Buffer,
        kv: Buffer,
        scratch: Box<DecodeScratch>,
    },
    /// bf16 weights, cache and scratch on a GPU.
    Gpu(Box<GpuModel>),
}

impl Engine {
    /// An engine for `model_config` on the CPU device: creates the `weights` and `kv_cache`
    /// regions in `memory` and allocates both buffers.
    ///
    /// # Errors
    /// [`InferError::BadParameter`] for a zero block size or batch, a cache of no block, or a
    /// memory manager on a CUDA device (build that engine with [`on_gpu`](Self::on_gpu));
    /// [`InferError::Memory`] when a region exists or the device is out of memory;
    /// [`InferError::Model`] for a model the engine cannot compute.
    pub fn new(
        memory: Arc<MemoryManager>,
        model_config: LlamaConfig,
        config: EngineConfig,
    ) -> Result<Self, InferError> {
        if memory.device().kind() != DeviceKind::Cpu {
            return Err(InferError::BadParameter {
                what: "engine device",
                reason: format!(
                    "the memory manager allocates on {}; build the engine with Engine::on_gpu and a Gpu of that device",
                    memory.device().name()
                ),
            });
        }
        Self::build(memory, model_config, config, None)
    }

    /// An engine for `model_config` computing on `gpu`, whose device is the one `memory`
    /// allocates from: bf16 weights in the `weights` region; the bf16 cache and the prefill's
    /// scratch in the `kv_cache` region; the decode step's scratch in the `cuda_graph` region.
    ///
    /// # Errors
    /// As [`new`](Self::new); [`InferError::BadParameter`] when `gpu` and `memory` are not on
    /// the same CUDA device or the head dim does not fit the attention kernel.
    pub fn on_gpu(
        memory: Arc<MemoryManager>,
        gpu: Arc<Gpu>,
        model_config: LlamaConfig,
        config: EngineConfig,
    ) -> Result<Self, InferError> {
        gpu::check_fit(&memory, &gpu, &model_config)?;
        Self::build(memory, model_config, config, Some(gpu))
    }

    fn build(
        memory: Arc<MemoryManager>,
        model_config: LlamaConfig,
        config: EngineConfig,
        gpu: Option<Arc<Gpu>>,
    ) -> Result<Self, InferError> {
        let bad = |what, reason: String| InferError::BadParameter { what, reason };
        if config.block_size == 0 || config.max_batch == 0 {
            return Err(bad(
                "engine config",
                "block_size and max_batch must be at least 1".into(),
            ));
        }
        let model = Transformer::new(model_config);
        let c = model.config();
        let positions = match config.max_positions {
            Some(p @ (0 | 1)) => {
                return Err(bad(
                    "engine max positions",
                    format!("{p} leaves no room for a prompt token and a new one; give at least 2"),
                ));
            }
            Some(p) => p.min(c.max_position_embeddings),
            None => c.max_position_embeddings,
        };
        // fp32 on the CPU, bf16 on the GPU.
        let element = if gpu.is_some() { gpu::ELEMENT_BYTES } else { 4 };
        let weight_bytes = model.layout().len() * element;
        memory
            .create_region(MemoryTag::Weights, config.weights_policy, weight_bytes)
            .map_err(InferError::memory("create the weights region"))?;
        let weights = memory
            .alloc(&MemoryTag::Weights, weight_bytes)
            .map_err(InferError::memory("allocate the weights"))?;
        let limits = Limits::new(positions, config.max_batch, config.block_size);
        let [prefill_bytes, step_bytes] = match gpu {
            Some(_) => gpu::scratch_bytes(c, limits)?,
            None => [0, 0],
        };
        let block_bytes = BlockTables::block_floats(c, config.block_size) * element;
        // On the GPU the cache holds one spare block (the graphs' padding rows write there).
        let spare = usize::from(gpu.is_some());
        let reserved = prefill_bytes + step_bytes + spare * block_bytes;
        let num_blocks = kv_blocks(&memory, &config, positions, block_bytes, reserved)?;
        // Buffers of a region start at multiples of 256 bytes.
        let cache_bytes = (num_blocks + spare) * block_bytes;
        memory
            .create_region(
                MemoryTag::KvCache,
                BackupPolicy::None,
                cache_bytes.next_multiple_of(256) + prefill_bytes,
            )
            .map_err(InferError::memory("create the kv cache region"))?;
        let kv = memory
            .alloc(&MemoryTag::KvCache, cache_bytes)
            .map_err(InferError::memory("allocate the kv cache"))?;
        let backend = match gpu {
            None => Backend::Host {
                weights,
                kv,
                scratch: Box::new(DecodeScratch::new(c, config.max_batch, positions)),
            },
            Some(gpu) => {
                let prefill = memory
                    .alloc(&MemoryTag::KvCache, prefill_bytes)
                    .map_err(InferError::memory("allocate the prefill scratch"))?;
                memory
                    .create_region(MemoryTag::CudaGraph, BackupPolicy::None, step_bytes)
                    .map_err(InferError::memory("create the cuda graph region"))?;
                let step = memory
                    .alloc(&MemoryTag::CudaGraph, step_bytes)
                    .map_err(InferError::memory("allocate the decode step's scratch"))?;
                let buffers = GpuBuffers {
                    weights,
                    cache: kv,
                    prefill,
                    step,
                };
                Backend::Gpu(Box::new(GpuModel::new(
                    gpu,
                    c,
                    model.layout(),
                    limits,
                    (num_blocks, config.block_size),
                    buffers,
                    config.cuda_graphs,
                )?))
            }
        };
        tracing::info!(
            blocks = num_blocks,
            block_size = config.block_size,
            positions,
            kv_bytes = cache_bytes,
            prefill_bytes,
            step_bytes,
            weight_bytes,
            device = %memory.device().name(),
            "rollout engine ready"
        );
        Ok(Self {
            tables: BlockTables::new(c, num_blocks, config.block_size),
            loaded: vec![false; model.layout().specs().len()],
            memory,
            model,
            config,
            positions,
            backend,
        })
    }

    /// An engine on the CPU device whose weights come from the Hugging Face checkpoint
    /// directory `dir`.
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

    /// An engine on `gpu` whose weights come from the Hugging Face checkpoint directory `dir`.
    ///
    /// # Errors
    /// As [`on_gpu`](Self::on_gpu) and [`load_checkpoint`](Self::load_checkpoint).
    pub fn from_checkpoint_on_gpu(
        memory: Arc<MemoryManager>,
        gpu: Arc<Gpu>,
        dir: &Path,
        config: EngineConfig,
    ) -> Result<Self, InferError> {
        let mut engine = Self::on_gpu(memory, gpu, load_config(dir)?, config)?;
        engine.load_checkpoint(dir)?;
        Ok(engine)
    }

    /// Reads every tensor of checkpoint `dir` into the weights buffer (on the GPU, through a
    /// host copy in fp32 that is cast to bf16).
    ///
    /// # Errors
    /// [`InferError::Memory`] while the weights are offloaded; [`InferError::Model`] for a
    /// checkpoint that does not match the model.
    pub fn load_checkpoint(&mut self, dir: &Path) -> Result<(), InferError> {
        match &mut self.backend {
            Backend::Host { weights, .. } => {
                let mut view = weights
                    .view_mut::<f32>()
                    .map_err(InferError::memory("write the weights"))?;
                load_hf_params(dir, self.model.layout(), &mut view)?;
            }
            Backend::Gpu(_) => {
                let mut params = vec![0.0; self.model.layout().len()];
                load_hf_params(dir, self.model.layout(), &mut params)?;
                let all: Vec<(usize, &[f32])> = self
                    .model
                    .layout()
                    .specs()
                    .iter()
                    .enumerate()
                    .map(|(i, spec)| (i, &params[spec.range()]))
                    .collect();
                self.write_tensors(&all)?;
            }
        }
        self.loaded.fill(true);
        Ok(())
    }

    /// Writes tensors of the parameter table, each given as its index and its elements in
    /// order, into the weights buffer (one bucket of a weight update); on the GPU they are
    /// rounded to bf16.
    ///
    /// # Errors
    /// [`InferError::Memory`] while the weights are offloaded; [`InferError::Internal`] for an
    /// index or length that does not match the table (callers check against
    /// [`layout`](Self::layout) first); nothing is written then; [`InferError::Device`] when the
    /// GPU failed.
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
        match &mut self.backend {
            Backend::Host { weights, .. } => {
                let mut view = weights
                    .view_mut::<f32>()
                    .map_err(InferError::memory("write the weights"))?;
                for (&(_, data), range) in tensors.iter().zip(ranges) {
                    view[range].copy_from_slice(data);
                }
            }
            Backend::Gpu(model) => {
                model.idle()?;
                for (&(_, data), range) in tensors.iter().zip(ranges) {
                    model.write_weights(range.start, data)?;
                }
            }
        }
        for &(index, _) in tensors {
            self.loaded[index] = true;
        }
        Ok(())
    }

    /// Whether [`copy_device_weights`](Self::copy_device_weights) takes `weights`: the engine
    /// computes on the GPU of their device and they fill its parameter table.
    pub fn takes_device_weights(&self, weights: &DeviceWeights) -> bool {
        match &self.backend {
            Backend::Gpu(model) => {
                model.is_on(&weights.device) && weights.params.len() == self.layout().len()
            }
            Backend::Host { .. } => false,
        }
    }

    /// Copies a trainer's bf16 weights, on the engine's device and in its parameter table's
    /// order, into the weights after `weights.ready`, and waits for the copy: the same bytes a
    /// weight update with their fp32 masters writes, without crossing the host link. Returns
    /// the bytes copied.
    ///
    /// # Errors
    /// [`InferError::Offloaded`] while the weights are offloaded; [`InferError::BadParameter`]
    /// for weights [`takes_device_weights`](Self::takes_device_weights) refuses (nothing is
    /// written then); [`InferError::Device`] when the copy fails.
    pub fn copy_device_weights(&mut self, weights: &DeviceWeights) -> Result<u64, InferError> {
        self.check_resident("copy the weights on the device", false)?;
        let model = match &self.backend {
            Backend::Gpu(model) if self.takes_device_weights(weights) => model,
            _ => {
                return Err(InferError::BadParameter {
                    what: "device weights",
                    reason: format!(
                        "{} bf16 elements on {} do not fit this engine ({} elements on {}); copy them only into a gpu engine of the same device and model, else send them with update_weights",
                        weights.params.len(),
                        weights.device.name(),
                        self.layout().len(),
                        self.memory.device().name()
                    ),
                });
            }
        };
        model.copy_weights(weights.params, &weights.ready)?;
        self.loaded.fill(true);
        Ok(weights.bytes())
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
            } else if prompt.len() >= self.positions {
                Some(format!(
                    "has {} tokens, the engine serves sequences of {} positions (the model's {} at most) and needs room for one new token",
                    prompt.len(),
                    self.positions,
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
            longest = longest.max((prompt.len() + params.max_new_tokens).min(self.positions) - 1);
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
        let (max_batch, share_prompt_blocks) =
            (self.config.max_batch, self.config.share_prompt_blocks);
        let max_positions = self.positions;
        let captured_before = self.graph_captures();
        let outcome = self.with_step(|step, tables| {
            schedule::run(
                schedule::Compute {
                    step,
                    tables,
                    max_positions,
                    max_batch,
                    share_prompt_blocks,
                },
                prompts,
                params,
            )
        });
        self.tables.clear();
        let (completions, mut stats) = outcome?;
        stats.graph_captures = self.graph_captures() - captured_before;
        Ok(Generation { completions, stats })
    }

    /// Runs `f` with the engine's [`Step`] and block tables (borrowing host views of the
    /// buffers on the CPU, uploading the rotary tables on the GPU).
    pub(crate) fn with_step<R>(
        &mut self,
        f: impl FnOnce(&mut dyn Step, &mut BlockTables) -> Result<R, InferError>,
    ) -> Result<R, InferError> {
        match &mut self.backend {
            Backend::Host {
                weights,
                kv,
                scratch,
            } => {
                let params = weights
                    .view::<f32>()
                    .map_err(InferError::memory("read the weights"))?;
                let mut kv_view = kv
                    .view_mut::<f32>()
                    .map_err(InferError::memory("use the kv cache"))?;
                let mut step = HostStep {
                    model: &self.model,
                    params: &params,
                    storage: &mut kv_view[..self.tables.storage_floats()],
                    scratch,
                    block_floats: BlockTables::block_floats(
                        self.model.config(),
                        self.config.block_size,
                    ),
                    queued: Default::default(),
                };
                f(&mut step, &mut self.tables)
            }
            Backend::Gpu(model) => {
                model.begin()?;
                f(model.as_mut(), &mut self.tables)
            }
        }
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
        if kv && self.has_graph_region() && state(&MemoryTag::CudaGraph)? != RegionState::Active {
            what.push("the cuda graphs");
            fix.push("onload_graphs");
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

    /// Whether the engine has a `cuda_graph` region: the GPU engine's decode scratch, where its
    /// graphs read and write.
    pub fn has_graph_region(&self) -> bool {
        matches!(self.backend, Backend::Gpu(_))
    }

    /// Decode graphs captured in the engine's life (0 on the CPU device or with graphs off).
    pub fn graph_captures(&self) -> usize {
        match &self.backend {
            Backend::Gpu(model) => model.graph_captures(),
            Backend::Host { .. } => 0,
        }
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
