//! The rollout engine and its controller on the CPU device (issue 5): identical generation
//! across offload cycles, shared prompt blocks, preemption, freed memory, and every error path;
//! and the weight sync on one GPU (`MILES_TEST_DEVICE=cuda`, else it skips): a device copy from
//! the GPU trainer gives the engine what the host path gives it.

// Helpers of a test crate are test code: they may unwrap and panic.
#![allow(clippy::unwrap_used, clippy::panic)]

use std::sync::Arc;

use half::bf16;
use miles_core::backend::RolloutEngine as LoopEngine;
use miles_core::backend::{BackendError, Batch, DeviceWeights};
use miles_core::device::{GpuSlice, OpenedDevice, open_test_device};
use miles_core::model::{LlamaConfig, ParamLayout, init_params};
use miles_core::{
    AddressRange, BackupPolicy, CpuDevice, Device, Fence, ManagerSettings, MemoryManager,
    MemoryTag, RegionState, RolloutOffload, RolloutOffloadLevel, Settings,
};
use miles_infer::{
    Completion, Dtype, Engine, EngineConfig, InferError, InferenceController, KvCapacity,
    NamedTensor, SamplingParams, TensorData,
};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

const MIB: u64 = 1 << 20;

/// The tiny preset with sharp enough distributions that samples differ from each other.
fn config() -> LlamaConfig {
    LlamaConfig::preset("tiny")
        .unwrap()
        .with_initializer_range(0.2)
}

fn params_of(config: &LlamaConfig, seed: u64) -> Vec<f32> {
    let layout = ParamLayout::new(config);
    let mut params = vec![0.0; layout.len()];
    init_params(&layout, config, seed, &mut params).unwrap();
    params
}

struct Setup {
    device: Arc<CpuDevice>,
    controller: InferenceController,
    params: Vec<f32>,
}

fn engine_config(policy: BackupPolicy, kv: KvCapacity) -> EngineConfig {
    EngineConfig {
        block_size: 4,
        max_batch: 16,
        kv_capacity: kv,
        weights_policy: policy,
        share_prompt_blocks: true,
        cuda_graphs: true,
        max_positions: None,
    }
}

fn setup_with(cfg: EngineConfig, levels: &[RolloutOffloadLevel], bucket: u64) -> Setup {
    let device = Arc::new(CpuDevice::new(256 * MIB));
    let dyn_device: Arc<dyn Device> = device.clone();
    let settings = ManagerSettings {
        margin_bytes: 0,
        disk: None,
    };
    let memory = Arc::new(MemoryManager::new(dyn_device, settings).unwrap());
    let config = config();
    let params = params_of(&config, 7);
    let engine = Engine::new(memory, config, cfg).unwrap();
    let layout = engine.layout().clone();
    let tensors = named(&layout, &params);
    let mut controller =
        InferenceController::new(engine, RolloutOffload::from_levels(levels), bucket);
    controller.update_weights(&tensors).unwrap();
    Setup {
        device,
        controller,
        params,
    }
}

fn setup(policy: BackupPolicy, levels: &[RolloutOffloadLevel]) -> Setup {
    setup_with(
        engine_config(policy, KvCapacity::Blocks(256)),
        levels,
        64 * MIB,
    )
}

fn named<'a>(layout: &'a ParamLayout, params: &'a [f32]) -> Vec<NamedTensor<'a>> {
    layout
        .specs()
        .iter()
        .map(|s| NamedTensor::f32(&s.name, &s.shape, &params[s.range()]))
        .collect()
}

fn prompts() -> Vec<Vec<u32>> {
    ["hello world", "the cat sat", "a"]
        .iter()
        .map(|p| {
            let mut ids = vec![256];
            ids.extend(p.bytes().map(u32::from));
            ids
        })
        .collect()
}

fn sampling() -> SamplingParams {
    SamplingParams {
        n: 4,
        temperature: 1.0,
        top_p: 0.95,
        top_k: 0,
        max_new_tokens: 24,
        stop_tokens: vec![257],
        seed: 11,
    }
}

fn generate(controller: &mut InferenceController) -> Vec<Completion> {
    controller
        .generate(&prompts(), &sampling())
        .unwrap()
        .completions
}

#[test]
fn generation_is_identical_after_an_offload_cycle_at_every_level() {
    use RolloutOffloadLevel::{KvCache, Weight};
    for levels in [vec![KvCache], vec![Weight], vec![KvCache, Weight]] {
        let mut s = setup(BackupPolicy::Host, &levels);
        let before = generate(&mut s.controller);
        let distinct: std::collections::HashSet<_> = before.iter().map(|c| &c.tokens).collect();
        assert!(distinct.len() > 6, "samples should differ: {before:?}");
        let reports = s.controller.offload().unwrap();
        assert_eq!(reports.len(), levels.len(), "{levels:?}");
        for (tag, level) in [(MemoryTag::KvCache, KvCache), (MemoryTag::Weights, Weight)] {
            let want = if levels.contains(&level) {
                RegionState::Paused
            } else {
                RegionState::Active
            };
            assert_eq!(s.controller.state(&tag).unwrap(), want, "{levels:?}");
        }
        let back = s.controller.onload(None).unwrap();
        assert_eq!(back.len(), levels.len());
        assert_eq!(generate(&mut s.controller), before, "{levels:?}");
    }
}

#[test]
fn dropped_weights_must_be_resent_by_name_and_then_generate_identically() {
    let levels = [RolloutOffloadLevel::KvCache, RolloutOffloadLevel::Weight];
    let mut s = setup_with(
        engine_config(BackupPolicy::None, KvCapacity::Blocks(256)),
        &levels,
        // Small buckets: the tiny model's tensors go in several of them.
        16 * 1024,
    );
    let before = generate(&mut s.controller);
    s.controller.offload().unwrap();
    s.controller.onload_weights().unwrap();
    s.controller.onload_kv().unwrap();
    let err = s.controller.generate(&prompts(), &sampling()).unwrap_err();
    assert!(
        matches!(&err, InferError::WeightsMissing { missing, total, .. } if missing == total),
        "{err}"
    );
    assert!(err.to_string().contains("update_weights"), "{err}");
    let layout = s.controller.engine().layout().clone();
    let tensors = named(&layout, &s.params);
    let (first, rest) = tensors.split_at(3);
    s.controller.update_weights(first).unwrap();
    let err = s.controller.generate(&prompts(), &sampling()).unwrap_err();
    assert!(
        matches!(&err, InferError::WeightsMissing { missing, .. } if *missing == rest.len()),
        "{err}"
    );
    let report = s.controller.update_weights(rest).unwrap();
    assert!(report.buckets > 1, "{report:?}");
    assert_eq!(generate(&mut s.controller), before);
}

#[test]
fn weights_sent_as_bf16_widen_exactly() {
    let mut s = setup(BackupPolicy::Host, &[]);
    let layout = s.controller.engine().layout().clone();
    let rounded: Vec<f32> = s
        .params
        .iter()
        .map(|&x| half::bf16::from_f32(x).to_f32())
        .collect();
    s.controller
        .update_weights(&named(&layout, &rounded))
        .unwrap();
    let from_f32 = generate(&mut s.controller);
    let bytes: Vec<Vec<u8>> = layout
        .specs()
        .iter()
        .map(|spec| {
            rounded[spec.range()]
                .iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect()
        })
        .collect();
    let tensors: Vec<NamedTensor<'_>> = layout
        .specs()
        .iter()
        .zip(&bytes)
        .map(|(spec, b)| NamedTensor {
            name: &spec.name,
            shape: &spec.shape,
            dtype: Dtype::BF16,
            data: TensorData::Raw(b),
        })
        .collect();
    s.controller.update_weights(&tensors).unwrap();
    assert_eq!(generate(&mut s.controller), from_f32);
}

#[test]
fn shared_prompt_blocks_give_the_tokens_of_samples_computed_alone() {
    let shared = setup(BackupPolicy::Host, &[]);
    let mut alone_cfg = engine_config(BackupPolicy::Host, KvCapacity::Blocks(256));
    alone_cfg.share_prompt_blocks = false;
    alone_cfg.max_batch = 1;
    let alone = setup_with(alone_cfg, &[], 64 * MIB);
    let (mut shared, mut alone) = (shared.controller, alone.controller);
    let a = shared.generate(&prompts(), &sampling()).unwrap();
    let b = alone.generate(&prompts(), &sampling()).unwrap();
    assert_eq!(a.completions, b.completions);
    assert!(
        a.stats.prefill_tokens < b.stats.prefill_tokens,
        "shared prefill {} vs alone {}",
        a.stats.prefill_tokens,
        b.stats.prefill_tokens
    );
    let prompt_tokens: usize = prompts().iter().map(Vec::len).sum();
    assert_eq!(
        a.stats.prefill_tokens, prompt_tokens,
        "one prefill per prompt"
    );
    assert_eq!(a.stats.preemptions + b.stats.preemptions, 0);
}

#[test]
fn more_work_than_the_cache_holds_completes_with_the_same_tokens() {
    let mut roomy = setup(BackupPolicy::Host, &[]);
    // 12 samples of up to 36 positions in blocks of 4: 10 blocks each, 14 in the cache.
    let mut tight = setup_with(
        engine_config(BackupPolicy::Host, KvCapacity::Blocks(14)),
        &[],
        64 * MIB,
    );
    let want = roomy.controller.generate(&prompts(), &sampling()).unwrap();
    let got = tight.controller.generate(&prompts(), &sampling()).unwrap();
    assert_eq!(got.completions, want.completions);
    assert!(got.stats.preemptions > 0, "{:?}", got.stats);
    assert!(got.stats.peak_blocks <= 14, "{:?}", got.stats);
    assert_eq!(tight.controller.engine().used_blocks(), 0);
}

#[test]
fn offload_leaves_almost_nothing_resident_in_either_arena() {
    let mut s = setup(BackupPolicy::Host, &[]);
    generate(&mut s.controller);
    let memory = Arc::clone(s.controller.engine().memory());
    let resident = |tag: &MemoryTag| {
        s.device
            .resident_bytes_in(memory.arena(tag).unwrap())
            .unwrap()
    };
    let weights_before = resident(&MemoryTag::Weights);
    let kv_before = resident(&MemoryTag::KvCache);
    assert!(weights_before > 0 && kv_before > 0);
    let kv = s.controller.offload_kv().unwrap();
    let weights = s.controller.offload_weights().unwrap();
    assert!(kv.free_after > kv.free_before && weights.free_after > weights.free_before);
    let (w, k) = (resident(&MemoryTag::Weights), resident(&MemoryTag::KvCache));
    // Near zero: at most one 4 KiB page left per tag.
    assert!(w <= 4096, "weights resident {weights_before} -> {w} bytes");
    assert!(k <= 4096, "kv cache resident {kv_before} -> {k} bytes");
}

#[test]
fn generating_while_offloaded_names_what_is_missing() {
    let mut s = setup(BackupPolicy::Host, &[]);
    let message = |c: &mut InferenceController| {
        let err = c.generate(&prompts(), &sampling()).unwrap_err();
        assert!(matches!(err, InferError::Offloaded { .. }), "{err}");
        err.to_string()
    };
    s.controller.offload_kv().unwrap();
    let m = message(&mut s.controller);
    assert!(
        m.contains("kv cache is offloaded") && m.contains("onload_kv"),
        "{m}"
    );
    s.controller.offload_weights().unwrap();
    let m = message(&mut s.controller);
    assert!(
        m.contains("weights and the kv cache are") && m.contains("onload_weights and onload_kv"),
        "{m}"
    );
    s.controller.onload_kv().unwrap();
    let m = message(&mut s.controller);
    assert!(
        m.contains("weights are offloaded") && !m.contains("kv"),
        "{m}"
    );
    let layout = s.controller.engine().layout().clone();
    let err = s
        .controller
        .update_weights(&named(&layout, &s.params))
        .unwrap_err();
    assert!(err.to_string().contains("cannot update weights"), "{err}");
    let err = s.controller.offload_weights().unwrap_err();
    assert!(matches!(err, InferError::Memory { .. }), "{err}");
    let err = s.controller.onload_kv().unwrap_err();
    assert!(matches!(err, InferError::Memory { .. }), "{err}");
}

#[test]
fn mismatched_weight_updates_change_nothing_and_list_every_problem() {
    let mut s = setup(BackupPolicy::Host, &[]);
    let before = generate(&mut s.controller);
    let layout = s.controller.engine().layout().clone();
    let shifted: Vec<f32> = s.params.iter().map(|x| x + 0.25).collect();
    let mut tensors = named(&layout, &shifted);
    let wrong_shape = [7usize, 3];
    let raw = [0u8; 6];
    tensors[1].shape = &wrong_shape;
    tensors[2].dtype = Dtype::I64;
    tensors[2].data = TensorData::Raw(&raw);
    tensors[3].data = TensorData::F32(&shifted[..5]);
    tensors[4].name = "model.layers.9.mlp.up_proj.weight";
    tensors.push(tensors[0]);
    let err = s.controller.update_weights(&tensors).unwrap_err();
    let InferError::WeightMismatch { problems } = &err else {
        panic!("{err}");
    };
    assert_eq!(problems.len(), 5, "{problems:#?}");
    let text = err.to_string();
    for needle in [
        "shape [7, 3]",
        "I64",
        "5 elements",
        "no such tensor",
        "sent twice",
    ] {
        assert!(text.contains(needle), "{needle} missing from: {text}");
    }
    assert_eq!(
        generate(&mut s.controller),
        before,
        "a refused update changed the weights"
    );
}

#[test]
fn bad_requests_are_refused_naming_the_fault() {
    let mut s = setup(BackupPolicy::Host, &[]);
    let max = config().max_position_embeddings;
    for (prompt, needle) in [
        (vec![], "is empty"),
        (vec![256; max], "needs room"),
        (vec![256, 9999], "outside the vocabulary"),
    ] {
        let err = s
            .controller
            .generate(&[prompts()[0].clone(), prompt], &sampling())
            .unwrap_err();
        assert!(
            matches!(&err, InferError::BadPrompt { index: 1, reason } if reason.contains(needle)),
            "{err}"
        );
    }
    let params = SamplingParams {
        top_p: 1.5,
        top_k: 0,
        ..sampling()
    };
    let err = s.controller.generate(&prompts(), &params).unwrap_err();
    assert!(
        matches!(err, InferError::BadParameter { what: "top_p", .. }),
        "{err}"
    );

    let mut small = setup_with(
        engine_config(BackupPolicy::Host, KvCapacity::Blocks(3)),
        &[],
        64 * MIB,
    );
    let err = small
        .controller
        .generate(&prompts(), &sampling())
        .unwrap_err();
    assert!(
        matches!(err, InferError::CacheTooSmall { have: 3, .. }),
        "{err}"
    );
}

#[test]
fn a_fresh_engine_refuses_to_generate_until_weights_arrive() {
    let device: Arc<dyn Device> = Arc::new(CpuDevice::new(64 * MIB));
    let settings = ManagerSettings {
        margin_bytes: 0,
        disk: None,
    };
    let memory = Arc::new(MemoryManager::new(device, settings).unwrap());
    let cfg = engine_config(BackupPolicy::Host, KvCapacity::MemFraction(0.5));
    let mut engine = Engine::new(Arc::clone(&memory), config(), cfg.clone()).unwrap();
    assert!(engine.kv_blocks() > 0);
    let err = engine.generate(&prompts(), &sampling()).unwrap_err();
    assert!(matches!(err, InferError::WeightsMissing { .. }), "{err}");
    let err = Engine::new(memory, config(), cfg).unwrap_err();
    assert!(
        matches!(err, InferError::Memory { .. }),
        "a second engine on the same tags: {err}"
    );

    let device: Arc<dyn Device> = Arc::new(CpuDevice::new(64 * MIB));
    let memory = Arc::new(
        MemoryManager::new(
            device,
            ManagerSettings {
                margin_bytes: 0,
                disk: None,
            },
        )
        .unwrap(),
    );
    let zero = engine_config(BackupPolicy::Host, KvCapacity::Blocks(0));
    let err = Engine::new(memory, config(), zero).unwrap_err();
    assert!(matches!(err, InferError::BadParameter { .. }), "{err}");
}

#[test]
fn stop_tokens_and_lengths_end_samples_and_log_probs_are_log_probabilities() {
    let mut s = setup(BackupPolicy::Host, &[]);
    let params = SamplingParams {
        n: 8,
        temperature: 0.7,
        max_new_tokens: 40,
        // Common bytes as stop tokens, so some samples stop early.
        stop_tokens: (97..123).collect(),
        ..sampling()
    };
    let out = s.controller.generate(&prompts(), &params).unwrap();
    let mut stops = 0;
    for c in &out.completions {
        assert_eq!(c.tokens.len(), c.logprobs.len());
        assert!(c.logprobs.iter().all(|&lp| lp <= 0.0 && lp.is_finite()));
        match c.finish {
            miles_infer::FinishReason::Stop => {
                stops += 1;
                assert!(params.stop_tokens.contains(c.tokens.last().unwrap()));
            }
            miles_infer::FinishReason::Length => assert_eq!(c.tokens.len(), 40),
            miles_infer::FinishReason::ContextLimit => panic!("{c:?}"),
        }
    }
    assert!(stops > 0, "no sample drew one of 26 stop tokens");
}

#[test]
fn steps_queued_one_ahead_give_each_sample_its_tokens_whatever_the_batch() {
    // Both engines queue each step behind the one before it: the roomy one over every sample
    // at once, the other one sample at a time (its batch full while the others wait), draining
    // at each admission. Stop tokens end samples while the step behind is queued (its draw
    // dropped), at other rows in the two; a prompt that nearly fills the context ends on its
    // position, left out of the step behind.
    let mut ahead = setup(BackupPolicy::Host, &[]);
    let mut alone_cfg = engine_config(BackupPolicy::Host, KvCapacity::Blocks(256));
    alone_cfg.max_batch = 1;
    let mut alone = setup_with(alone_cfg, &[], 64 * MIB);
    let max = config().max_position_embeddings;
    let mut long = vec![256];
    long.extend((0..max - 6).map(|i| 97 + (i % 26) as u32));
    let mut prompts = prompts();
    prompts.push(long);
    let params = SamplingParams {
        n: 6,
        temperature: 0.8,
        max_new_tokens: 30,
        stop_tokens: (97..110).collect(),
        ..sampling()
    };
    let got = ahead.controller.generate(&prompts, &params).unwrap();
    let want = alone.controller.generate(&prompts, &params).unwrap();
    assert_eq!(got.completions, want.completions);
    let finishes = |reason| {
        got.completions
            .iter()
            .filter(|c| c.finish == reason)
            .count()
    };
    assert!(
        finishes(miles_infer::FinishReason::Stop) > 0
            && finishes(miles_infer::FinishReason::Length) > 0
            && finishes(miles_infer::FinishReason::ContextLimit) > 0,
        "{:?}",
        got.completions
    );
    assert!(
        got.stats.overlapped_steps * 2 > got.stats.decode_steps,
        "{:?}",
        got.stats
    );
    assert!(
        want.stats.overlapped_steps * 2 > want.stats.decode_steps,
        "{:?}",
        want.stats
    );
    assert_eq!(ahead.controller.engine().used_blocks(), 0);
}

#[test]
fn a_sample_that_fills_the_context_ends_with_context_limit() {
    let mut s = setup(BackupPolicy::Host, &[]);
    let max = config().max_position_embeddings;
    let mut prompt = vec![256];
    prompt.extend((0..max - 4).map(|i| 97 + (i % 26) as u32));
    let params = SamplingParams {
        stop_tokens: Vec::new(),
        ..sampling()
    };
    let out = s.controller.generate(&[prompt], &params).unwrap();
    for c in &out.completions {
        assert_eq!(c.finish, miles_infer::FinishReason::ContextLimit, "{c:?}");
        assert_eq!(c.tokens.len(), 3, "prompt {} + 3 fill {max}", max - 3);
    }
}

#[test]
fn an_engine_for_shorter_sequences_refuses_longer_prompts_and_cuts_at_its_positions() {
    let cfg = |positions| EngineConfig {
        max_positions: Some(positions),
        ..engine_config(BackupPolicy::Host, KvCapacity::Blocks(256))
    };
    let mut s = setup_with(cfg(12), &[], 64 * MIB);
    let err = s
        .controller
        .generate(&[vec![256; 12]], &sampling())
        .unwrap_err();
    assert!(
        matches!(&err, InferError::BadPrompt { index: 0, reason } if reason.contains("sequences of 12 positions")),
        "{err}"
    );
    let params = SamplingParams {
        stop_tokens: Vec::new(),
        ..sampling()
    };
    let out = s.controller.generate(&[vec![256; 8]], &params).unwrap();
    for c in &out.completions {
        assert_eq!(c.finish, miles_infer::FinishReason::ContextLimit, "{c:?}");
        assert_eq!(c.tokens.len(), 4, "prompt 8 + 4 fill the engine's 12");
    }
    // Within the positions an engine sized for them generates what the model's own does.
    let (mut short, mut whole) = (
        setup_with(cfg(40), &[], 64 * MIB),
        setup(BackupPolicy::Host, &[]),
    );
    assert_eq!(
        generate(&mut short.controller),
        generate(&mut whole.controller)
    );
    // A larger value is the model's own; fewer than 2 cannot hold a prompt and a new token.
    let max = config().max_position_embeddings;
    let mut roomy = setup_with(cfg(10 * max), &[], 64 * MIB);
    assert_eq!(
        generate(&mut roomy.controller),
        generate(&mut whole.controller)
    );
    let memory = Arc::new(
        MemoryManager::new(
            Arc::new(CpuDevice::new(256 * MIB)),
            ManagerSettings {
                margin_bytes: 0,
                disk: None,
            },
        )
        .unwrap(),
    );
    let err = Engine::new(memory, config(), cfg(1)).unwrap_err();
    assert!(
        matches!(
            err,
            InferError::BadParameter {
                what: "engine max positions",
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn a_cpu_engine_refuses_device_weights_and_keeps_its_own() {
    let mut s = setup(BackupPolicy::Host, &[]);
    let before = generate(&mut s.controller);
    let len = s.controller.engine().layout().len();
    let weights = DeviceWeights {
        device: s.device.clone(),
        params: GpuSlice::<bf16>::of(AddressRange {
            start: 0,
            len: len * 2,
        })
        .unwrap(),
        ready: Fence::signalled(),
    };
    assert!(!s.controller.accepts_device_weights(&weights));
    assert_eq!(s.controller.copy_device_weights(&weights).unwrap(), None);
    let error = s
        .controller
        .engine_mut()
        .copy_device_weights(&weights)
        .unwrap_err();
    assert!(error.to_string().contains("update_weights"), "{error}");
    assert_eq!(generate(&mut s.controller), before);
}

/// A seeded batch of `b` sequences of `t` tokens of the tiny vocabulary, every target counted.
fn train_batch(b: usize, t: usize, seed: u64) -> Batch {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let ids: Vec<u32> = (0..b * (t + 1))
        .map(|_| rng.random_range(0..256u32))
        .collect();
    let rows: Vec<&[u32]> = ids.chunks(t + 1).collect();
    Batch {
        batch: b,
        seq: t,
        inputs: rows.iter().flat_map(|r| &r[..t]).copied().collect(),
        targets: rows.iter().flat_map(|r| &r[1..]).copied().collect(),
        weights: vec![1.0; b * t],
        normaliser: (b * t) as f32,
        entropy_mask: None,
        entropy_coef: 0.0,
    }
}

#[test]
fn a_gpu_trainer_step_copied_on_the_device_generates_what_the_host_sync_gives() {
    let device = match open_test_device(4 << 30).unwrap() {
        OpenedDevice::Cuda(device) => device,
        OpenedDevice::Cpu(_) => {
            eprintln!("skipping: set MILES_TEST_DEVICE=cuda to run it on a gpu");
            return;
        }
    };
    let gpu = Arc::new(miles_core::ops::gpu::open_gpu(Arc::clone(&device)).unwrap());
    let settings = Settings {
        preset: "tiny".into(),
        seed: 11,
        lr: 1e-2,
        train_memory_margin_bytes: 0,
        ..Settings::default()
    };
    let mut trainer =
        miles_megatron::gpu_trainer(Arc::clone(&gpu), &settings, 0, None, (None, None)).unwrap();
    trainer.train_step(&train_batch(4, 32, 5)).unwrap();
    let model = trainer.config().clone();
    let engine = || {
        let shared: Arc<dyn Device> = device.clone();
        let memory = Arc::new(
            MemoryManager::new(
                shared,
                ManagerSettings {
                    margin_bytes: 0,
                    disk: None,
                },
            )
            .unwrap(),
        );
        let cfg = engine_config(BackupPolicy::Host, KvCapacity::Blocks(256));
        let engine = Engine::on_gpu(memory, Arc::clone(&gpu), model.clone(), cfg).unwrap();
        InferenceController::new(engine, RolloutOffload::default(), 64 * MIB)
    };

    let mut host = engine();
    trainer
        .export_weights(64 << 20, &mut |bucket| {
            LoopEngine::update_weights(&mut host, &bucket)
                .map_err(|error| BackendError::Sink(error.to_string()))
        })
        .unwrap();

    let mut copied = engine();
    let weights = trainer.device_weights().unwrap().unwrap();
    let len = copied.engine().layout().len();
    assert_eq!(
        weights.params.len(),
        len,
        "the trainer's bf16 params fill the engine's table"
    );
    assert!(copied.accepts_device_weights(&weights));
    let bytes = copied.copy_device_weights(&weights).unwrap();
    assert_eq!(bytes, Some(len as u64 * 2));
    // The copy is complete: the trainer may sleep before the engine generates.
    trainer.offload().unwrap();
    assert!(trainer.device_weights().unwrap().is_none());

    let greedy = SamplingParams {
        temperature: 0.0,
        top_p: 1.0,
        top_k: 0,
        ..sampling()
    };
    let want = host.generate(&prompts(), &greedy).unwrap().completions;
    let got = copied.generate(&prompts(), &greedy).unwrap().completions;
    assert!(want.iter().any(|c| !c.tokens.is_empty()));
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g.tokens, w.tokens, "tokens of prompt {}", g.prompt_index);
        let bits = |c: &Completion| c.logprobs.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(g), bits(w), "log-probs of prompt {}", g.prompt_index);
    }
    assert_eq!(got.len(), want.len());
}
