//! The GPU engine against the CPU engine on the tiny preset, both holding the same bf16-rounded
//! weights: logits step by step along one token path, greedy tokens, copy-on-write of a shared
//! prompt block, offload cycles and preemption. On a GPU machine:
//! `MILES_TEST_DEVICE=cuda cargo test -p miles-infer gpu -- --test-threads=1`; elsewhere they
//! skip.

use std::sync::{Arc, Mutex, PoisonError};

use half::bf16;
use miles_core::device::{Gpu, OpenedDevice, open_test_device};
use miles_core::model::{LlamaConfig, ParamLayout, init_params};
use miles_core::{
    BackupPolicy, CpuDevice, Device, ManagerSettings, MemoryManager, MemoryTag, RolloutOffloadLevel,
};

use crate::paged::BlockTables;
use crate::schedule::{Feed, Step};
use crate::{
    Engine, EngineConfig, InferError, InferenceController, KvCapacity, NamedTensor, SamplingParams,
};

/// Logits of the GPU engine against the CPU engine's on the same bf16 weights: the GPU rounds
/// every activation to bf16 (2^-9 relative per rounding) through two layers, the CPU keeps
/// them fp32. A CPU emulation of those roundings on this preset differs from fp32 by at most
/// 3.2e-3 over 100 positions and three seeds; 1% of `max(1, |logit|)` leaves three times that.
const LOGIT_TOLERANCE: f32 = 1e-2;

/// One engine test on the GPU at a time (each opens the device and compiles the kernels).
static GPU_LOCK: Mutex<()> = Mutex::new(());

/// The tiny preset at its own initialisation scale: larger scales make the random network
/// amplify rounding (an initializer range of 0.2 turns bf16 rounding into logit errors of 0.18).
fn config() -> LlamaConfig {
    LlamaConfig::preset("tiny").unwrap()
}

/// Seeded parameters rounded to bf16, so both engines hold exactly the same weights.
fn params(config: &LlamaConfig) -> Vec<f32> {
    let layout = ParamLayout::new(config);
    let mut params = vec![0.0; layout.len()];
    init_params(&layout, config, 7, &mut params).unwrap();
    params.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
}

fn engine_config(blocks: usize, weights_policy: BackupPolicy) -> EngineConfig {
    EngineConfig {
        block_size: 4,
        max_batch: 8,
        kv_capacity: KvCapacity::Blocks(blocks),
        weights_policy,
        share_prompt_blocks: true,
        cuda_graphs: true,
        max_positions: None,
    }
}

fn manager(device: Arc<dyn Device>) -> Arc<MemoryManager> {
    let settings = ManagerSettings {
        margin_bytes: 0,
        disk: None,
    };
    Arc::new(MemoryManager::new(device, settings).unwrap())
}

fn load(mut engine: Engine, params: &[f32]) -> Engine {
    let layout = engine.layout().clone();
    let tensors: Vec<(usize, &[f32])> = layout
        .specs()
        .iter()
        .enumerate()
        .map(|(i, s)| (i, &params[s.range()]))
        .collect();
    engine.write_tensors(&tensors).unwrap();
    engine
}

fn cpu_engine(cfg: EngineConfig, params: &[f32]) -> Engine {
    let memory = manager(Arc::new(CpuDevice::new(256 << 20)));
    load(Engine::new(memory, config(), cfg).unwrap(), params)
}

/// The GPU of the test run, when `MILES_TEST_DEVICE=cuda`: a memory manager on GPU 0 (capped
/// at 2 GiB) and a `Gpu` on the same device.
struct TestGpu {
    memory_device: Arc<dyn Device>,
    gpu: Arc<Gpu>,
    _lock: std::sync::MutexGuard<'static, ()>,
}

impl TestGpu {
    fn open(test: &str) -> Option<TestGpu> {
        let lock = GPU_LOCK.lock().unwrap_or_else(PoisonError::into_inner);
        match open_test_device(2 << 30).unwrap() {
            OpenedDevice::Cuda(device) => Some(TestGpu {
                memory_device: Arc::clone(&device) as Arc<dyn Device>,
                gpu: Arc::new(miles_core::ops::gpu::open_gpu(device).unwrap()),
                _lock: lock,
            }),
            OpenedDevice::Cpu(_) => {
                eprintln!("skipping {test}: set MILES_TEST_DEVICE=cuda to run it on a gpu");
                None
            }
        }
    }

    /// A GPU engine with its own memory manager on the test's device.
    fn engine(&self, cfg: EngineConfig, params: &[f32]) -> Engine {
        self.engine_of(config(), cfg, params)
    }

    fn engine_of(&self, model: LlamaConfig, cfg: EngineConfig, params: &[f32]) -> Engine {
        let memory = manager(Arc::clone(&self.memory_device));
        let engine = Engine::on_gpu(memory, Arc::clone(&self.gpu), model, cfg).unwrap();
        load(engine, params)
    }
}

/// Prompts of 7, 13, 2 and 30 tokens: none a multiple of the block size 4.
fn prompts() -> Vec<Vec<u32>> {
    [
        "abcdef",
        "the cat sat!",
        "a",
        "a longer prompt of many bytes",
    ]
    .iter()
    .map(|p| {
        let mut ids = vec![256];
        ids.extend(p.bytes().map(u32::from));
        ids
    })
    .collect()
}

fn greedy(n: usize, max_new_tokens: usize) -> SamplingParams {
    SamplingParams {
        n,
        temperature: 0.0,
        top_p: 1.0,
        top_k: 0,
        max_new_tokens,
        stop_tokens: Vec::new(),
        seed: 5,
    }
}

/// Logits along token paths, each decoded in a fork of its prompt's sequence (so each first
/// step copies the prompt's partial last block): `[path][step]`, step 0 the prompt's last
/// position, step `j` after feeding `path[j - 1]`. Every prompt is prefilled in one call and
/// every path decoded in one batch per step.
fn forced_logits(
    engine: &mut Engine,
    prompts: &[Vec<u32>],
    paths: &[(usize, Vec<u32>)],
) -> Vec<Vec<Vec<f32>>> {
    let v = engine.model_config().vocab_size;
    let steps = paths.iter().map(|(_, p)| p.len()).min().unwrap();
    let out = engine
        .with_step(|step: &mut dyn Step, tables: &mut BlockTables| {
            let mut prefixes = Vec::new();
            for p in prompts {
                let seq = tables.add_seq();
                assert!(tables.reserve(seq, p.len())?);
                prefixes.push(seq);
            }
            let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
            let first = step.prefill(tables, &prefixes, &refs)?;
            let mut seqs = Vec::new();
            let mut out = Vec::new();
            for (prompt, _) in paths {
                seqs.push(tables.fork(prefixes[*prompt])?);
                out.push(vec![first[*prompt].clone()]);
            }
            for j in 0..steps {
                for &seq in &seqs {
                    assert!(tables.prepare_append_with(seq, |a, b| step.copy_block(a, b))?);
                }
                let tokens: Vec<u32> = paths.iter().map(|(_, p)| p[j]).collect();
                let logits = step.decode_logits(tables, &seqs, &tokens)?;
                for (row, o) in logits.chunks_exact(v).zip(out.iter_mut()) {
                    o.push(row.to_vec());
                }
            }
            Ok::<_, InferError>(out)
        })
        .unwrap();
    engine.flush_cache();
    out
}

/// Each completion's prompt and tokens, in order.
fn paths_of(completions: &[crate::Completion]) -> Vec<(usize, Vec<u32>)> {
    completions
        .iter()
        .map(|c| (c.prompt_index, c.tokens.clone()))
        .collect()
}

/// The largest `|got - want| / max(1, |want|)` and the largest `|got - want|`.
fn worst(got: &[f32], want: &[f32]) -> (f32, f32) {
    assert_eq!(got.len(), want.len());
    got.iter().zip(want).fold((0.0, 0.0), |(rel, abs), (g, w)| {
        assert!(g.is_finite(), "gpu logit {g} where the cpu has {w}");
        let d = (g - w).abs();
        (rel.max(d / w.abs().max(1.0)), abs.max(d))
    })
}

fn argmax_and_margin(logits: &[f32]) -> (usize, f32) {
    let best = (0..logits.len()).fold(0, |b, i| if logits[i] > logits[b] { i } else { b });
    let second = (0..logits.len())
        .filter(|&i| i != best)
        .map(|i| logits[i])
        .fold(f32::NEG_INFINITY, f32::max);
    (best, logits[best] - second)
}

/// Checks that every greedy token of `paths` is the best, or within the logit tolerance of the
/// best, under the CPU's logits along that path.
fn assert_near_greedy(paths: &[(usize, Vec<u32>)], cpu_logits: &[Vec<Vec<f32>>]) {
    for (i, ((prompt, path), steps)) in paths.iter().zip(cpu_logits).enumerate() {
        for (j, &token) in path.iter().enumerate() {
            let logits = &steps[j];
            let (best, _) = argmax_and_margin(logits);
            let slack = LOGIT_TOLERANCE * logits[best].abs().max(1.0);
            assert!(
                logits[token as usize] >= logits[best] - 2.0 * slack,
                "path {i} (prompt {prompt}) token {j}: the gpu chose {token} at logit {}, the cpu's best is {best} at {}",
                logits[token as usize],
                logits[best]
            );
        }
    }
}

#[test]
fn gpu_greedy_generation_matches_the_cpu_engine_in_tokens_and_logits() {
    let Some(t) =
        TestGpu::open("gpu_greedy_generation_matches_the_cpu_engine_in_tokens_and_logits")
    else {
        return;
    };
    let params = params(&config());
    let cfg = engine_config(128, BackupPolicy::Host);
    let mut cpu = cpu_engine(cfg.clone(), &params);
    let mut gpu = t.engine(cfg, &params);
    let prompts = prompts();
    let want = cpu.generate(&prompts, &greedy(2, 10)).unwrap();
    let got = gpu.generate(&prompts, &greedy(2, 10)).unwrap();

    // Logits step by step along the GPU's greedy paths, two forks of each prompt.
    let paths = paths_of(&got.completions);
    let cpu_logits = forced_logits(&mut cpu, &prompts, &paths);
    let gpu_logits = forced_logits(&mut gpu, &prompts, &paths);
    let mut worst_rel = 0.0f32;
    // The largest absolute difference at each step of each path.
    let mut deltas: Vec<Vec<f32>> = Vec::new();
    for (c, g) in cpu_logits.iter().zip(&gpu_logits) {
        let mut per_step = Vec::new();
        for (cs, gs) in c.iter().zip(g) {
            let (rel, abs) = worst(gs, cs);
            worst_rel = worst_rel.max(rel);
            per_step.push(abs);
        }
        deltas.push(per_step);
    }
    eprintln!(
        "gpu vs cpu logits: worst relative difference {worst_rel:.3e} (tolerance {LOGIT_TOLERANCE:.1e})"
    );
    assert!(worst_rel <= LOGIT_TOLERANCE);
    assert_near_greedy(&paths, &cpu_logits);

    // Greedy tokens are the CPU's wherever the CPU's choice is clear of the GPU's rounding: a
    // top-2 margin over four times the largest logit difference seen at that step. The CPU's
    // logits along the GPU's path are its own while the two paths agree.
    let mut compared = 0;
    for (i, (c, g)) in want.completions.iter().zip(&got.completions).enumerate() {
        assert_eq!(
            (c.prompt_index, c.sample_index),
            (g.prompt_index, g.sample_index)
        );
        for (j, (&cpu_token, &gpu_token)) in c.tokens.iter().zip(&g.tokens).enumerate() {
            let (best, margin) = argmax_and_margin(&cpu_logits[i][j]);
            assert_eq!(best as u32, cpu_token, "the cpu repeats its own choice");
            if margin <= 4.0 * deltas[i][j] {
                break;
            }
            assert_eq!(
                gpu_token, cpu_token,
                "prompt {} sample {} token {j}: cpu margin {margin}",
                c.prompt_index, c.sample_index
            );
            compared += 1;
        }
        if c.tokens[0] == g.tokens[0] {
            let (gl, cl) = (g.logprobs[0], c.logprobs[0]);
            assert!(
                (gl - cl).abs() <= LOGIT_TOLERANCE * cl.abs().max(1.0),
                "first log-prob {gl} on the gpu, {cl} on the cpu"
            );
        }
    }
    eprintln!("greedy tokens compared: {compared}");
    assert!(
        compared >= prompts.len(),
        "too few clear greedy choices to compare ({compared})"
    );
}

#[test]
fn gpu_generation_repeats_after_offload_cycles_and_offload_frees_both_tags() {
    let Some(t) =
        TestGpu::open("gpu_generation_repeats_after_offload_cycles_and_offload_frees_both_tags")
    else {
        return;
    };
    let params = params(&config());
    let sampling = SamplingParams {
        n: 3,
        temperature: 1.0,
        top_p: 0.95,
        top_k: 0,
        max_new_tokens: 16,
        stop_tokens: vec![257],
        seed: 11,
    };
    for policy in [BackupPolicy::Host, BackupPolicy::None] {
        let engine = t.engine(engine_config(128, policy), &params);
        let memory = Arc::clone(engine.memory());
        let layout = engine.layout().clone();
        let levels = [
            RolloutOffloadLevel::KvCache,
            RolloutOffloadLevel::CudaGraph,
            RolloutOffloadLevel::Weight,
        ];
        let mut controller = InferenceController::new(
            engine,
            miles_core::RolloutOffload::from_levels(&levels),
            1 << 20,
        );
        let first = controller.generate(&prompts(), &sampling).unwrap();
        let captured = controller.engine().graph_captures();
        assert!(captured > 0, "the decode steps ran as graphs");
        for cycle in 0..2 {
            controller.offload().unwrap();
            for (tag, bytes) in memory.resident_bytes() {
                assert_eq!(
                    bytes, 0,
                    "{tag} holds {bytes} bytes after offload ({policy})"
                );
            }
            let tensors: Vec<NamedTensor<'_>> = layout
                .specs()
                .iter()
                .map(|s| NamedTensor::f32(&s.name, &s.shape, &params[s.range()]))
                .collect();
            let resend = (policy == BackupPolicy::None).then_some(tensors.as_slice());
            controller.onload(resend).unwrap();
            let again = controller.generate(&prompts(), &sampling).unwrap();
            assert_eq!(
                first.completions, again.completions,
                "cycle {cycle} with weights backup {policy}"
            );
            assert_eq!(
                controller.engine().graph_captures(),
                captured,
                "the graphs replay after the cycle without recapture"
            );
        }
        assert!(
            memory
                .resident_bytes()
                .iter()
                .any(|(tag, bytes)| *tag == MemoryTag::KvCache && *bytes > 0),
            "the kv cache is back"
        );
    }
}

#[test]
fn gpu_generation_with_a_cache_too_small_for_every_sample_preempts_and_stays_greedy() {
    let Some(t) = TestGpu::open(
        "gpu_generation_with_a_cache_too_small_for_every_sample_preempts_and_stays_greedy",
    ) else {
        return;
    };
    let params = params(&config());
    // 9 samples of up to 36 positions in blocks of 4: 10 blocks each, 14 in the cache.
    let prompts = prompts()[..3].to_vec();
    let mut tight = t.engine(engine_config(14, BackupPolicy::Host), &params);
    let got = tight.generate(&prompts, &greedy(3, 24)).unwrap();
    assert!(got.stats.preemptions > 0, "{:?}", got.stats);
    assert!(got.stats.peak_blocks <= 14, "{:?}", got.stats);
    assert_eq!(tight.used_blocks(), 0);
    for c in &got.completions {
        assert_eq!(c.tokens.len(), 24);
        assert!(c.logprobs.iter().all(|l| l.is_finite() && *l <= 0.0));
    }
    // Replayed samples continue as the CPU model would: every token is greedy under the CPU's
    // logits along the sample's own path.
    let roomy = EngineConfig {
        max_batch: 16,
        ..engine_config(128, BackupPolicy::Host)
    };
    let mut cpu = cpu_engine(roomy, &params);
    let paths = paths_of(&got.completions);
    let cpu_logits = forced_logits(&mut cpu, &prompts, &paths);
    assert_near_greedy(&paths, &cpu_logits);
}

#[test]
fn engines_refuse_a_memory_manager_on_another_device() {
    let Some(t) = TestGpu::open("engines_refuse_a_memory_manager_on_another_device") else {
        return;
    };
    let cfg = engine_config(16, BackupPolicy::Host);
    let on_cuda = manager(Arc::clone(&t.memory_device));
    let err = Engine::new(on_cuda, config(), cfg.clone()).unwrap_err();
    assert!(matches!(err, InferError::BadParameter { .. }), "{err}");
    let on_cpu = manager(Arc::new(CpuDevice::new(64 << 20)));
    let err = Engine::on_gpu(on_cpu, Arc::clone(&t.gpu), config(), cfg).unwrap_err();
    assert!(matches!(err, InferError::BadParameter { .. }), "{err}");
}

#[test]
fn gpu_sampling_draws_what_the_host_sampler_draws_on_a_fixed_logit_set() {
    let Some(t) =
        TestGpu::open("gpu_sampling_draws_what_the_host_sampler_draws_on_a_fixed_logit_set")
    else {
        return;
    };
    // Rows of the tiny preset's 259 logits are read one value at a time by the kernel's passes
    // over the whole row; rows of 260, 16 bytes at a time; rows of 4100 give each lane of the
    // walk a piece of 8 ids.
    for vocab_size in [259, 260, 4100] {
        let mut model = config();
        model.vocab_size = vocab_size;
        let mut engine = t.engine_of(
            model.clone(),
            engine_config(16, BackupPolicy::Host),
            &params(&model),
        );
        draws_match_the_host_sampler(&mut engine);
    }
}

/// `engine`'s draws against the host sampler's on two fixed logit rows: five rules on a
/// long-tailed one, and a top-k cut at a tie of +0 and -0, which both keep (`>=` the k-th).
fn draws_match_the_host_sampler(engine: &mut Engine) {
    let v = engine.model_config().vocab_size;
    // A peaked, tied and long-tailed row: logits 8 sin(i^2) / (1 + i / 40), two ids tied.
    let mut logits: Vec<f32> = (0..v)
        .map(|i| {
            let x = i as f32;
            8.0 * (x * x * 1e-3).sin() / (1.0 + x / 40.0)
        })
        .collect();
    logits[7] = logits[3];
    let rule = |temperature, top_p, top_k| SamplingParams {
        temperature,
        top_p,
        top_k,
        seed: 21,
        ..greedy(1, 1)
    };
    for p in [
        rule(0.0, 1.0, 0),
        rule(1.0, 1.0, 0),
        rule(0.7, 0.9, 0),
        rule(1.0, 1.0, 20),
        rule(1.3, 0.8, 50),
    ] {
        draws_match_on(engine, &logits, &p);
    }
    // The third largest logit is +0, tied with a -0: top-k 3 keeps four ids.
    let mut zeros = vec![-30.0f32; v];
    (zeros[5], zeros[40], zeros[90], zeros[200]) = (2.0, 1.0, 0.0, -0.0);
    draws_match_on(engine, &zeros, &rule(1.0, 1.0, 3));
    draws_from_shared_rows_read_their_own(engine, &logits, &zeros, &rule(1.3, 0.8, 50));
}

/// Draws whose rows are the same slice (a prompt's samples) interleaved with other slices, one
/// of them equal in value but held apart: each draw is the host sampler's from its own row.
fn draws_from_shared_rows_read_their_own(
    engine: &mut Engine,
    a: &[f32],
    b: &[f32],
    p: &SamplingParams,
) {
    let a_apart = a.to_vec();
    let slices = [a, b, a, &a_apart, b, b, a];
    let rows: Vec<(&[f32], crate::DrawKey)> = (0..70u32)
        .map(|i| {
            let key = crate::DrawKey {
                prompt: i % 7,
                sample: i / 7,
                token: i,
            };
            (slices[i as usize % slices.len()], key)
        })
        .collect();
    let got = engine
        .with_step(|step: &mut dyn Step, _| step.draw(&rows, p))
        .unwrap();
    let same = rows
        .iter()
        .zip(&got)
        .filter(|&(&(row, key), &(token, _))| crate::sample_token(row, p, key).0 == token)
        .count();
    // As in `draws_match_on`, the fp32 and f64 masses may straddle a boundary: at most once here.
    assert!(same >= 69, "{same} of 70 draws equal to the host's");
}

/// `engine`'s 4,096 draws from `logits` under `p` against the host sampler's.
fn draws_match_on(engine: &mut Engine, logits: &[f32], p: &SamplingParams) {
    let v = logits.len();
    let draws = 4096u32;
    let keys: Vec<crate::DrawKey> = (0..draws)
        .map(|token| crate::DrawKey {
            prompt: token % 5,
            sample: token / 5,
            token,
        })
        .collect();
    let rows: Vec<(&[f32], crate::DrawKey)> = keys.iter().map(|&key| (logits, key)).collect();
    let got = engine
        .with_step(|step: &mut dyn Step, _| step.draw(&rows, p))
        .unwrap();
    let mut same = 0;
    let (mut host_counts, mut gpu_counts) = (vec![0u32; v], vec![0u32; v]);
    for (&key, &(token, logprob)) in keys.iter().zip(&got) {
        let (want, want_lp) = crate::sample_token(logits, p, key);
        same += u32::from(token == want);
        host_counts[want as usize] += 1;
        gpu_counts[token as usize] += 1;
        if token == want {
            // Tolerance: 1e-4 on log-probs, the fp32 exp against the host's f64.
            assert!(
                (logprob - want_lp).abs() < 1e-4,
                "T {} top_p {} top_k {}: log-prob {logprob} vs {want_lp}",
                p.temperature,
                p.top_p,
                p.top_k
            );
        }
    }
    eprintln!(
        "vocab {v}, T {} top_p {} top_k {}: {same} of {draws} draws equal to the host's",
        p.temperature, p.top_p, p.top_k
    );
    // The same uniforms pick the same token but where fp32 and f64 masses straddle a
    // boundary between two tokens: rare, at most 1 in 200 here.
    assert!(same * 200 >= draws * 199, "{same} of {draws}");
    // No token is drawn by one sampler and cut by the other's top-k / top-p.
    let cut =
        |counts: &[u32], other: &[u32]| counts.iter().zip(other).any(|(&c, &o)| c > 3 && o == 0);
    assert!(
        !cut(&host_counts, &gpu_counts) && !cut(&gpu_counts, &host_counts),
        "the kept sets differ"
    );
}

#[test]
fn gpu_decode_graphs_give_the_tokens_of_queued_kernels() {
    let Some(t) = TestGpu::open("gpu_decode_graphs_give_the_tokens_of_queued_kernels") else {
        return;
    };
    let params = params(&config());
    let sampling = SamplingParams {
        temperature: 1.0,
        top_p: 0.9,
        top_k: 40,
        ..greedy(2, 12)
    };
    // 4 prompts x 2 samples fill the bucket of 8 exactly, so both run the same products.
    let run = |cuda_graphs| {
        let cfg = EngineConfig {
            cuda_graphs,
            ..engine_config(128, BackupPolicy::Host)
        };
        let mut engine = t.engine(cfg, &params);
        let out = engine.generate(&prompts(), &sampling).unwrap();
        (out, engine.graph_captures())
    };
    let (graphs, captured) = run(true);
    let (kernels, none) = run(false);
    assert!(captured > 0 && none == 0, "{captured} and {none} captures");
    assert_eq!(graphs.completions, kernels.completions);
    // Fewer sequences than a bucket: padding rows write only the spare block.
    let cfg = engine_config(128, BackupPolicy::Host);
    let mut engine = t.engine(cfg, &params);
    let three = engine.generate(&prompts()[..3], &greedy(1, 12)).unwrap();
    let again = engine.generate(&prompts()[..3], &greedy(1, 12)).unwrap();
    assert_eq!(three.completions, again.completions);
    assert_eq!(again.stats.graph_captures, 0, "{:?}", again.stats);
}

#[test]
fn gpu_steps_queued_ahead_refuse_a_feed_of_no_draw_a_third_step_and_a_host_draw_between() {
    let test = "gpu_steps_queued_ahead_refuse_a_feed_of_no_draw_a_third_step_and_a_host_draw";
    let Some(t) = TestGpu::open(test) else {
        return;
    };
    let params = params(&config());
    let mut engine = t.engine(engine_config(128, BackupPolicy::Host), &params);
    let sampling = greedy(1, 8);
    let key = |token| crate::sampling::DrawKey {
        prompt: 0,
        sample: 0,
        token,
    };
    let refused = |got: Result<(), InferError>, what: &str| {
        assert!(
            matches!(got, Err(InferError::Internal(_))),
            "{what}: {got:?}"
        );
    };
    engine
        .with_step(|step: &mut dyn Step, tables: &mut BlockTables| {
            let prompt = &prompts()[0];
            let seq = tables.add_seq();
            assert!(tables.reserve(seq, prompt.len())?);
            let logits = step.prefill(tables, &[seq], &[prompt.as_slice()])?;
            let mut queue = |tables: &mut BlockTables, feed, draw| {
                assert!(tables.prepare_append_with(seq, |a, b| step.copy_block(a, b))?);
                step.queue_decode(tables, &[seq], &[feed], &[draw], &sampling)
            };
            // Nothing queued: no draw to be fed from.
            refused(
                queue(tables, Feed::Drawn(0), Some(key(1))),
                "a feed with no step before",
            );
            queue(tables, Feed::Token(97), Some(key(1)))?;
            queue(tables, Feed::Drawn(0), None)?;
            // The step before drew nothing in row 0.
            refused(
                queue(tables, Feed::Drawn(0), Some(key(2))),
                "a feed of no draw",
            );
            refused(queue(tables, Feed::Token(98), Some(key(2))), "a third step");
            let drawn = step.draw(&[(logits[0].as_slice(), key(0))], &sampling);
            assert!(matches!(drawn, Err(InferError::Internal(_))), "{drawn:?}");
            assert!(step.collect()?[0].is_some());
            assert!(step.collect()?[0].is_none());
            refused(step.collect().map(drop), "a collect of no step");
            Ok::<_, InferError>(())
        })
        .unwrap();
}

/// The tiny preset as a model of `model_type`: `qwen2` (q/k/v biases, tied head) or `qwen3`
/// (per-head q/k norms, `head_dim` 40 where hidden / heads is 16, an untied head).
fn family_config(model_type: &str) -> LlamaConfig {
    let preset = include_str!("../../../miles-core/presets/tiny.json");
    let mut json = preset.replace(
        "\"model_type\": \"llama\"",
        &format!("\"model_type\": \"{model_type}\""),
    );
    if model_type == "qwen3" {
        json = json
            .replace(
                "\"hidden_size\": 64,",
                "\"head_dim\": 40,\n  \"hidden_size\": 64,",
            )
            .replace(
                "\"tie_word_embeddings\": true",
                "\"tie_word_embeddings\": false",
            );
    }
    let config = LlamaConfig::from_json_str(&json).unwrap();
    assert_eq!(config.family.model_type(), model_type);
    config
}

/// [`params`] of `config` with every bias drawn from ±0.1 and every q/k norm weight from
/// 0.5..1.5 (initialised to zeros and ones, they would leave their kernels untested), rounded
/// to bf16.
fn family_params(config: &LlamaConfig) -> Vec<f32> {
    use miles_core::model::ParamKind;
    use rand::{RngExt, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(13);
    let mut params = params(config);
    for spec in ParamLayout::new(config).specs() {
        let draw: fn(f32) -> f32 = match spec.kind {
            ParamKind::QBias | ParamKind::KBias | ParamKind::VBias => |u| (u * 2.0 - 1.0) * 0.1,
            ParamKind::QNorm | ParamKind::KNorm => |u| 0.5 + u,
            _ => continue,
        };
        for p in &mut params[spec.range()] {
            *p = bf16::from_f32(draw(rng.random::<f32>())).to_f32();
        }
    }
    params
}

#[test]
fn gpu_greedy_generation_matches_the_cpu_engine_with_qwen2_biases_and_qwen3_qk_norms() {
    let test = "gpu_greedy_generation_matches_the_cpu_engine_with_qwen2_biases_and_qwen3_qk_norms";
    let Some(t) = TestGpu::open(test) else {
        return;
    };
    for model_type in ["qwen2", "qwen3"] {
        let model = family_config(model_type);
        let params = family_params(&model);
        let cfg = engine_config(128, BackupPolicy::Host);
        let on_cpu = manager(Arc::new(CpuDevice::new(256 << 20)));
        let mut cpu = load(
            Engine::new(on_cpu, model.clone(), cfg.clone()).unwrap(),
            &params,
        );
        let on_gpu = manager(Arc::clone(&t.memory_device));
        let engine = Engine::on_gpu(on_gpu, Arc::clone(&t.gpu), model, cfg).unwrap();
        let mut gpu = load(engine, &params);
        let prompts = prompts();
        let want = cpu.generate(&prompts, &greedy(1, 10)).unwrap();
        let got = gpu.generate(&prompts, &greedy(1, 10)).unwrap();

        // Logits step by step along the GPU's greedy paths.
        let paths = paths_of(&got.completions);
        let cpu_logits = forced_logits(&mut cpu, &prompts, &paths);
        let gpu_logits = forced_logits(&mut gpu, &prompts, &paths);
        let mut worst_rel = 0.0f32;
        let mut deltas: Vec<Vec<f32>> = Vec::new();
        for (c, g) in cpu_logits.iter().zip(&gpu_logits) {
            let mut per_step = Vec::new();
            for (cs, gs) in c.iter().zip(g) {
                let (rel, abs) = worst(gs, cs);
                worst_rel = worst_rel.max(rel);
                per_step.push(abs);
            }
            deltas.push(per_step);
        }
        eprintln!(
            "{model_type}: gpu vs cpu logits: worst relative difference {worst_rel:.3e} (tolerance {LOGIT_TOLERANCE:.1e})"
        );
        assert!(worst_rel <= LOGIT_TOLERANCE, "{model_type}");
        assert_near_greedy(&paths, &cpu_logits);

        // Greedy tokens are the CPU's wherever its choice is clear of the GPU's rounding (a
        // top-2 margin over four times the largest logit difference at that step).
        let mut compared = 0;
        for (i, (c, g)) in want.completions.iter().zip(&got.completions).enumerate() {
            assert_eq!(c.prompt_index, g.prompt_index);
            for (j, (&cpu_token, &gpu_token)) in c.tokens.iter().zip(&g.tokens).enumerate() {
                let (best, margin) = argmax_and_margin(&cpu_logits[i][j]);
                assert_eq!(best as u32, cpu_token, "the cpu repeats its own choice");
                if margin <= 4.0 * deltas[i][j] {
                    break;
                }
                assert_eq!(
                    gpu_token, cpu_token,
                    "{model_type} prompt {} token {j}: cpu margin {margin}",
                    c.prompt_index
                );
                compared += 1;
            }
        }
        eprintln!("{model_type}: greedy tokens compared: {compared}");
        assert!(
            compared >= prompts.len(),
            "{model_type}: too few clear greedy choices to compare ({compared})"
        );
    }
}

#[test]
fn products_split_into_whole_words_of_at_least_the_least_slice() {
    // The 1B preset's o (k 2048) and down (k 8192), the tiny preset's (64, 128), and inner
    // dimensions no slice count divides into whole 16-byte words.
    for (k, parts) in [
        (2048, 4),
        (8192, 4),
        (64, 2),
        (128, 4),
        (40, 1),
        (3090, 1),
        (8, 1),
    ] {
        assert_eq!(super::split_of(k), parts, "k = {k}");
    }
}

#[test]
fn own_products_split_into_whole_tiles() {
    // The 1B preset's o and down, the tiny preset's (one tile, two), three tiles.
    for (k, parts) in [(2048, 4), (8192, 4), (64, 1), (128, 2), (192, 3)] {
        assert_eq!(super::own_split_of(k), parts, "k = {k}");
    }
}
