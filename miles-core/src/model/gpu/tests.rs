//! GPU model tests: the GPU transformer and trainer against the CPU model run on the same
//! bf16-rounded parameters. On a GPU machine: `MILES_TEST_DEVICE=cuda cargo test -p miles-core
//! model::gpu -- --test-threads=1`; elsewhere they skip. The two-GPU tests of the parallel groups
//! live with the groups: `miles-megatron`'s tensor-parallel one, core's data-parallel one
//! (`backend/data_parallel.rs`).

use std::collections::HashMap;
use std::sync::Arc;

use super::testing::{
    B, Batch, T, bf16_params, family_params, gentle, manager, spec, tiny, tiny_family,
};
use super::*;
use crate::memory::{BackupPolicy, MemoryTag, RegionState};
use crate::model::{
    LlamaConfig, ModelError, ParamKind, ParamLayout, TrainBatch, Trainer, Transformer,
};
use crate::ops::gpu::GradWrite;
use crate::ops::gpu::testing::TestGpu;

/// Loss: bf16 weights, activations and probabilities against fp32 throughout, 2% of it.
const LOSS_TOLERANCE: f32 = 2e-2;
/// Per-token log-probs, absolute: logits of a few units off by bf16's 0.4% steps.
const LOGPROB_TOLERANCE: f32 = 5e-2;
/// Gradients, per tensor kind: direction (cosine) and size (relative norm difference).
const GRAD_COSINE: f64 = 0.99;
const GRAD_NORM_TOLERANCE: f64 = 0.05;
/// Loss after each of ten AdamW steps, relative to the CPU's.
const TRAJECTORY_TOLERANCE: f32 = 0.05;

/// Grouped-query attention with one key/value head for all four query heads, and an LM head of
/// its own (the tiny preset ties it and has two kv heads).
fn tiny_one_kv_head_untied() -> LlamaConfig {
    let mut v: serde_json::Value =
        serde_json::from_str(include_str!("../../../presets/tiny.json")).unwrap();
    v["num_key_value_heads"] = 1.into();
    v["tie_word_embeddings"] = false.into();
    LlamaConfig::from_json_str(&v.to_string()).unwrap()
}

/// The worst absolute difference of two equally long slices, printed; NaN never passes.
fn assert_within(what: &str, got: &[f32], want: &[f32], tolerance: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let (worst, at) = got
        .iter()
        .zip(want)
        .enumerate()
        .map(|(i, (g, w))| ((g - w).abs(), i))
        .fold((0.0f32, 0), |acc, x| {
            if x.0 > acc.0 || x.0.is_nan() { x } else { acc }
        });
    eprintln!("{what}: worst absolute difference {worst:.3e} at {at} (tolerance {tolerance:.1e})");
    assert!(
        worst <= tolerance,
        "{what}: element {at} is {}, want {}",
        got[at],
        want[at]
    );
}

/// Compares gradients per tensor kind (all layers together): cosine similarity and the
/// relative difference of the norms, each printed.
fn assert_grads_agree(
    what: &str,
    layout: &ParamLayout,
    got: &[f32],
    want: &[f32],
    cosine: f64,
    norm_tolerance: f64,
) {
    let mut kinds: HashMap<ParamKind, [f64; 3]> = HashMap::new();
    for spec in layout.specs() {
        let acc = kinds.entry(spec.kind).or_default();
        for (&g, &w) in got[spec.range()].iter().zip(&want[spec.range()]) {
            let (g, w) = (f64::from(g), f64::from(w));
            acc[0] += g * w;
            acc[1] += g * g;
            acc[2] += w * w;
        }
    }
    for (kind, [dot, gg, ww]) in kinds {
        let cos = dot / (gg.sqrt() * ww.sqrt());
        let norm = (gg.sqrt() - ww.sqrt()).abs() / ww.sqrt();
        eprintln!("{what} {kind:?}: cosine {cos:.6}, norm difference {norm:.3e}");
        assert!(ww > 0.0, "{what} {kind:?}: the reference gradient is zero");
        assert!(
            cos > cosine,
            "{what} {kind:?}: cosine {cos} (want > {cosine})"
        );
        assert!(
            norm < norm_tolerance,
            "{what} {kind:?}: norms differ by {norm} (want < {norm_tolerance})"
        );
    }
}

/// One forward and backward pass of `config` on the GPU and on the CPU, compared, on a batch of
/// `B x T` tokens.
fn forward_and_backward_match_the_cpu(test: &str, config: LlamaConfig) {
    forward_and_backward_match_the_cpu_on(test, config, B, T);
}

/// As [`forward_and_backward_match_the_cpu`] on `batch x seq` tokens.
fn forward_and_backward_match_the_cpu_on(
    test: &str,
    config: LlamaConfig,
    batch: usize,
    seq: usize,
) {
    let Some(mut t) = TestGpu::open(test, 64 << 20) else {
        return;
    };
    let model = GpuTransformer::new(config.clone());
    let cpu = Transformer::new(config.clone());
    // Random biases and q/k norm weights where the family has them.
    let params = family_params(&config, 21);
    let data = Batch::random_of(22, config.vocab_size, batch, seq);
    let batch = data.view();
    let (logprobs, loss, grads) = model_pass(&mut t, &model, &params, &batch);

    let al = cpu.activation_layout(batch.batch, batch.seq).unwrap();
    let mut cpu_acts = vec![0.0; al.len()];
    let mut cpu_grads = vec![0.0; params.len()];
    let cpu_loss = cpu.forward(&params, &mut cpu_acts, &al, &batch).unwrap();
    cpu.backward(&params, &mut cpu_grads, &mut cpu_acts, &al, &batch)
        .unwrap();

    let rel = (loss - cpu_loss).abs() / cpu_loss.abs();
    eprintln!("{test}: loss {loss} vs cpu {cpu_loss} (relative {rel:.3e})");
    assert!(rel < LOSS_TOLERANCE, "loss {loss} vs cpu {cpu_loss}");
    let cpu_logprobs = Transformer::logprobs(&al, &cpu_acts);
    assert_within("logprobs", &logprobs, cpu_logprobs, LOGPROB_TOLERANCE);
    assert_grads_agree(
        test,
        model.layout(),
        &grads,
        &cpu_grads,
        GRAD_COSINE,
        GRAD_NORM_TOLERANCE,
    );
}

/// The log-probs, loss and gradients of one forward and backward pass of `model` on the bf16
/// rounding of `params`, over activations of their own.
fn model_pass(
    t: &mut TestGpu,
    model: &GpuTransformer,
    params: &[f32],
    batch: &TrainBatch<'_>,
) -> (Vec<f32>, f32, Vec<f32>) {
    let (dev_params, _) = t.put_bf16(params);
    // A step's first pass writes every gradient: what the buffer held must not show.
    let dev_grads = t.put(&vec![f32::NAN; params.len()]);
    let layout = model.activation_layout(batch.batch, batch.seq).unwrap();
    let (bf, fl, ids) = (
        t.alloc(layout.bf16_len()),
        t.alloc(layout.f32_len()),
        t.alloc(layout.u32_len()),
    );
    let acts = GpuActivations::new(layout, bf, fl, ids).unwrap();
    let weights = WholeWeights(dev_params);
    model
        .forward(&t.gpu, &weights, &acts, batch, ForwardMode::Train, None)
        .unwrap();
    let grads = WholeGrads {
        grads: dev_grads,
        write: GradWrite::Overwrite,
    };
    model
        .backward(&t.gpu, &weights, &grads, &acts, batch, None)
        .unwrap();
    let logprobs = model.logprobs(&t.gpu, &acts).unwrap();
    let loss = GpuTransformer::loss(&logprobs, batch);
    (logprobs, loss, t.get(dev_grads))
}

/// A step of one pass keeps the gate and up outputs of every layer past the first in the
/// gradients of the layer before (`gate_up_home_ranges`); its loss and gradients are those of
/// the model over activations of its own, bit for bit; a scoring pass, whose layers share the
/// first layer's, gives its log-probs. (The next steps' forward passes write
/// those homes while the optimizer step behind them reads the gradients: the test of the
/// optimizer in line or behind covers that race.)
#[test]
fn gpu_trainer_lending_gate_and_up_to_the_gradients_gives_the_bits_of_activations_of_their_own() {
    let test = "gpu_trainer_lending_gate_and_up_to_the_gradients_gives_the_bits_of_activations_of_their_own";
    let Some(mut t) = TestGpu::open(test, 64 << 20) else {
        return;
    };
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let mut runs = Vec::new();
    for config in [tiny(), tiny_family("qwen3")] {
        let model = GpuTransformer::new(config.clone());
        let homes = layout::gate_up_home_ranges(
            model.layout(),
            config.num_layers,
            2 * B * T * config.intermediate_size,
        );
        assert!(
            homes.is_some_and(|h| h.len() == config.num_layers - 1),
            "the test's batch must fit the gradients"
        );
        let params = family_params(&config, 91);
        let data = Batch::random(92, config.vocab_size);
        let (logprobs, loss, grads) = model_pass(&mut t, &model, &params, &data.view());
        runs.push((config, params, data, logprobs, loss, grads));
    }
    let gpu = Arc::new(t.gpu);
    for (config, params, data, logprobs, loss, grads) in runs {
        let family = config.family.model_type();
        let mut trainer =
            GpuTrainer::new(Arc::clone(&gpu), manager(&gpu), gentle(config), &params).unwrap();
        let got = trainer.compute_grads(&data.view()).unwrap();
        assert_eq!(
            got.to_bits(),
            loss.to_bits(),
            "{family}: loss {got} vs {loss}"
        );
        let differing = |trainer: &GpuTrainer| {
            bits(&trainer.grads().unwrap())
                .iter()
                .zip(bits(&grads))
                .filter(|(a, b)| **a != *b)
                .count()
        };
        assert_eq!(differing(&trainer), 0, "{family}: gradients differ");
        // Scoring writes every layer's gate and up over the first layer's, and leaves the
        // gradients alone.
        let (scored, _) = trainer.logprobs(&data.view()).unwrap();
        assert_within(
            &format!("{family}: scored log-probs"),
            &scored,
            &logprobs,
            1e-2,
        );
        assert_eq!(
            differing(&trainer),
            0,
            "{family}: scoring changed the gradients"
        );
    }
}

#[test]
fn gpu_forward_and_backward_match_the_cpu_on_tiny() {
    forward_and_backward_match_the_cpu("gpu_forward_and_backward_match_the_cpu_on_tiny", tiny());
}

#[test]
fn gpu_backward_refuses_a_batch_of_another_shape_than_its_activations() {
    let Some(mut t) = TestGpu::open(
        "gpu_backward_refuses_a_batch_of_another_shape_than_its_activations",
        64 << 20,
    ) else {
        return;
    };
    let config = tiny();
    let model = GpuTransformer::new(config.clone());
    let params = family_params(&config, 21);
    let (dev_params, _) = t.put_bf16(&params);
    let dev_grads = t.alloc::<f32>(params.len());
    let layout = model.activation_layout(B, T).unwrap();
    let (bf, fl, ids) = (
        t.alloc(layout.bf16_len()),
        t.alloc(layout.f32_len()),
        t.alloc(layout.u32_len()),
    );
    let acts = GpuActivations::new(layout, bf, fl, ids).unwrap();
    let other = Batch::random_of(23, config.vocab_size, B, T + 1);
    let result = model.backward(
        &t.gpu,
        &WholeWeights(dev_params),
        &WholeGrads {
            grads: dev_grads,
            write: GradWrite::Add,
        },
        &acts,
        &other.view(),
        None,
    );
    assert!(
        matches!(result, Err(ModelError::Batch(ref why)) if why.contains("build them for this batch")),
        "{result:?}"
    );
}

/// 600 rows: the LM head's logits in two chunks, the last one short, its backward products
/// over one block of their gradients.
#[test]
fn gpu_forward_and_backward_match_the_cpu_over_several_head_chunks_in_one_block() {
    const { assert!(600 > layout::HEAD_ROWS && 600 < layout::HEAD_GRAD_ROWS) };
    forward_and_backward_match_the_cpu_on(
        "gpu_forward_and_backward_match_the_cpu_over_several_head_chunks_in_one_block",
        tiny(),
        3,
        200,
    );
}

/// 2400 rows: the LM head's logits in chunks, its backward products over two blocks of their
/// gradients, the second one short (one short chunk).
#[test]
fn gpu_forward_and_backward_match_the_cpu_over_several_head_chunks() {
    const { assert!(2400 > layout::HEAD_GRAD_ROWS && 2400 < 2 * layout::HEAD_GRAD_ROWS) };
    const { assert!((2400 - layout::HEAD_GRAD_ROWS) < layout::HEAD_ROWS) };
    forward_and_backward_match_the_cpu_on(
        "gpu_forward_and_backward_match_the_cpu_over_several_head_chunks",
        tiny(),
        12,
        200,
    );
}

#[test]
fn gpu_forward_and_backward_match_the_cpu_with_one_kv_head_and_an_untied_head() {
    forward_and_backward_match_the_cpu(
        "gpu_forward_and_backward_match_the_cpu_with_one_kv_head_and_an_untied_head",
        tiny_one_kv_head_untied(),
    );
}

#[test]
fn gpu_forward_and_backward_match_the_cpu_with_qwen2_biases() {
    forward_and_backward_match_the_cpu(
        "gpu_forward_and_backward_match_the_cpu_with_qwen2_biases",
        tiny_family("qwen2"),
    );
}

#[test]
fn gpu_forward_and_backward_match_the_cpu_with_qwen3_qk_norms_and_head_dim() {
    forward_and_backward_match_the_cpu(
        "gpu_forward_and_backward_match_the_cpu_with_qwen3_qk_norms_and_head_dim",
        tiny_family("qwen3"),
    );
}

/// The GPU trainer on `config` (random biases and q/k norm weights) against the CPU model: the
/// loss and every tensor kind's gradient of one batch, then the loss over five AdamW steps at
/// lr 1e-3.
fn gpu_trainer_follows_the_cpu(test: &str, config: LlamaConfig) {
    let Some(t) = TestGpu::open(test, 1) else {
        return;
    };
    let gpu = Arc::new(t.gpu);
    let params = family_params(&config, 71);
    let data = Batch::random(72, config.vocab_size);
    let batch = data.view();
    let spec = gentle(config.clone());
    let mut trainer =
        GpuTrainer::new(Arc::clone(&gpu), manager(&gpu), spec.clone(), &params).unwrap();
    let loss = trainer.compute_grads(&batch).unwrap();
    let grads = trainer.grads().unwrap();

    let model = Transformer::new(config);
    let al = model.activation_layout(B, T).unwrap();
    let mut acts = vec![0.0; al.len()];
    let mut cpu_grads = vec![0.0; params.len()];
    let cpu_loss = model.forward(&params, &mut acts, &al, &batch).unwrap();
    model
        .backward(&params, &mut cpu_grads, &mut acts, &al, &batch)
        .unwrap();
    let rel = (loss - cpu_loss).abs() / cpu_loss.abs();
    eprintln!("{test}: loss {loss} vs cpu {cpu_loss} (relative {rel:.3e})");
    assert!(rel < LOSS_TOLERANCE, "loss {loss} vs cpu {cpu_loss}");
    assert_grads_agree(
        test,
        trainer.layout(),
        &grads,
        &cpu_grads,
        GRAD_COSINE,
        GRAD_NORM_TOLERANCE,
    );

    let mut cpu = Trainer::new(model, params.clone(), spec.adamw).unwrap();
    let mut losses = Vec::new();
    for step in 1..=5 {
        let want = cpu.train_step(&batch).unwrap();
        let got = trainer.train_step(&batch, step).unwrap();
        let rel = (got.loss - want.loss).abs() / want.loss.abs();
        eprintln!(
            "{test} step {step}: loss {} vs cpu {} (relative {rel:.3e})",
            got.loss, want.loss
        );
        assert!(
            rel < TRAJECTORY_TOLERANCE,
            "step {step}: loss {} vs cpu {}",
            got.loss,
            want.loss
        );
        losses.push(got.loss);
    }
    assert!(
        losses[4] < losses[0],
        "five steps on one batch did not lower the loss: {losses:?}"
    );
}

#[test]
fn gpu_trainer_follows_the_cpu_on_a_qwen2_model() {
    gpu_trainer_follows_the_cpu(
        "gpu_trainer_follows_the_cpu_on_a_qwen2_model",
        tiny_family("qwen2"),
    );
}

#[test]
fn gpu_trainer_follows_the_cpu_on_a_qwen3_model() {
    gpu_trainer_follows_the_cpu(
        "gpu_trainer_follows_the_cpu_on_a_qwen3_model",
        tiny_family("qwen3"),
    );
}

#[test]
fn gpu_trainer_loss_follows_the_cpu_over_ten_adamw_steps() {
    let test = "gpu_trainer_loss_follows_the_cpu_over_ten_adamw_steps";
    let Some(t) = TestGpu::open(test, 1) else {
        return;
    };
    // The test's lock lives in `t` to the end; the trainer takes the gpu.
    let gpu = Arc::new(t.gpu);
    let config = tiny();
    let params = bf16_params(&config, 31);
    let data = Batch::random(32, config.vocab_size);
    let batch = data.view();
    let spec = spec(config.clone(), BackupPolicy::None, 64);
    let mut cpu = Trainer::new(Transformer::new(config), params.clone(), spec.adamw).unwrap();
    let mut trainer = GpuTrainer::new(Arc::clone(&gpu), manager(&gpu), spec, &params).unwrap();
    let mut losses = Vec::new();
    for step in 1..=10 {
        let want = cpu.train_step(&batch).unwrap();
        let got = trainer.train_step(&batch, step).unwrap();
        let rel = (got.loss - want.loss).abs() / want.loss.abs();
        eprintln!(
            "step {step}: loss {} vs cpu {} (relative {rel:.3e}), grad norm {} vs {}",
            got.loss, want.loss, got.optimizer.grad_norm, want.optimizer.grad_norm
        );
        assert!(
            rel < TRAJECTORY_TOLERANCE,
            "step {step}: loss {} vs cpu {}",
            got.loss,
            want.loss
        );
        assert_eq!(got.optimizer.step, step);
        losses.push(got.loss);
    }
    assert!(
        losses[9] < losses[0],
        "ten steps on one batch did not lower the loss: {losses:?}"
    );
}

#[test]
fn gpu_trainer_offload_round_trip_keeps_master_weights_and_moments_bit_exact() {
    let test = "gpu_trainer_offload_round_trip_keeps_master_weights_and_moments_bit_exact";
    let Some(t) = TestGpu::open(test, 1) else {
        return;
    };
    let gpu = Arc::new(t.gpu);
    let config = tiny();
    let params = bf16_params(&config, 41);
    let data = Batch::random(42, config.vocab_size);
    let batch = data.view();
    let memory = manager(&gpu);
    let spec = spec(config.clone(), BackupPolicy::Host, 64);
    let mut trainer =
        GpuTrainer::new(Arc::clone(&gpu), Arc::clone(&memory), spec, &params).unwrap();
    for step in 1..=2 {
        trainer.train_step(&batch, step).unwrap();
    }
    let (logprobs, loss) = trainer.logprobs(&batch).unwrap();
    let master = trainer.master_params().unwrap();
    let (m, v) = trainer.moments().unwrap();
    assert!(
        m.iter().any(|&x| x != 0.0),
        "two steps left the moments at zero"
    );

    let reports = trainer.offload().unwrap();
    let tags: Vec<MemoryTag> = reports.iter().map(|r| r.tag.clone()).collect();
    assert_eq!(
        tags,
        [
            MemoryTag::Params,
            MemoryTag::Optimizer,
            MemoryTag::Grads,
            MemoryTag::Activations
        ]
    );
    assert!(reports.iter().all(|r| r.bytes > 0), "{reports:?}");
    let policies: Vec<BackupPolicy> = reports.iter().map(|r| r.policy).collect();
    assert_eq!(
        policies,
        [
            BackupPolicy::None,
            BackupPolicy::Host,
            BackupPolicy::None,
            BackupPolicy::None
        ],
        "only the optimizer state moves: the bf16 weights are rounded again from the master weights"
    );
    assert!(trainer.is_offloaded());
    assert_eq!(
        memory.state(&MemoryTag::Optimizer).unwrap(),
        RegionState::Paused
    );
    assert!(matches!(
        trainer.train_step(&batch, 3),
        Err(ModelError::Offloaded { .. })
    ));
    assert!(matches!(
        trainer.logprobs(&batch),
        Err(ModelError::Offloaded { .. })
    ));
    assert!(matches!(
        trainer.master_params(),
        Err(ModelError::Offloaded { .. })
    ));
    assert!(matches!(
        trainer.offload(),
        Err(ModelError::Offloaded { .. })
    ));

    assert_eq!(trainer.onload().unwrap().len(), 4);
    assert!(matches!(trainer.onload(), Err(ModelError::NotOffloaded)));
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&trainer.master_params().unwrap()), bits(&master));
    let (m_back, v_back) = trainer.moments().unwrap();
    assert_eq!(bits(&m_back), bits(&m));
    assert_eq!(bits(&v_back), bits(&v));
    assert!(
        trainer.grads().unwrap().iter().all(|&g| g == 0.0),
        "onload zeroes the gradients"
    );
    // The bf16 weights rounded again from the same master weights, the same kernels: the
    // forward pass repeats bit for bit.
    let (again, loss_again) = trainer.logprobs(&batch).unwrap();
    assert_eq!(bits(&again), bits(&logprobs), "logprobs after onload");
    assert_eq!(loss_again.to_bits(), loss.to_bits());
    let report = trainer.train_step(&batch, 3).unwrap();
    eprintln!(
        "loss before offload {loss}, after onload {loss_again}, step 3 {}",
        report.loss
    );
    assert!(
        (report.loss - loss).abs() <= 1e-5 * loss.abs(),
        "{} vs {loss}",
        report.loss
    );
    let (_, loss_after) = trainer.logprobs(&batch).unwrap();
    assert!(
        loss_after < loss,
        "training after onload: {loss_after} vs {loss}"
    );
}

#[test]
fn gpu_trainer_with_its_optimizer_on_the_host_follows_the_device_step_in_no_optimizer_memory() {
    let test = "gpu_trainer_with_its_optimizer_on_the_host_follows_the_device_step";
    let Some(t) = TestGpu::open(test, 1) else {
        return;
    };
    let gpu = Arc::new(t.gpu);
    let config = tiny();
    let params = bf16_params(&config, 61);
    let data = Batch::random(62, config.vocab_size);
    let batch = data.view();
    let spec = |optimizer_on_host| GpuTrainerSpec {
        optimizer_on_host,
        backup: BackupPolicy::Host,
        ..gentle(config.clone())
    };
    let mut device =
        GpuTrainer::new(Arc::clone(&gpu), manager(&gpu), spec(false), &params).unwrap();
    let host_memory = manager(&gpu);
    let mut host = GpuTrainer::new(
        Arc::clone(&gpu),
        Arc::clone(&host_memory),
        spec(true),
        &params,
    )
    .unwrap();
    assert_eq!(host.optimizer_device_bytes(), 0);
    for step in 1..=5 {
        let want = device.train_step(&batch, step).unwrap().loss;
        let got = host.train_step(&batch, step).unwrap().loss;
        if step == 1 {
            assert_eq!(got.to_bits(), want.to_bits(), "the same weights and tokens");
        }
        let rel = (got - want).abs() / want.abs();
        assert!(
            rel < 1e-3,
            "step {step}: loss {got} on the host, {want} on the device"
        );
        if step == 3 {
            // The bf16 weights are rounded again from the host's master weights.
            host.offload().unwrap();
            assert!(host.master_params().is_err(), "offloaded");
            host.onload().unwrap();
        }
    }
    // The host's AdamW rounds its f32 formulas apart from the kernel's (no fused multiply-add),
    // and a master weight that lands on the other side of a bf16 rounding boundary changes
    // the next gradients a little: a step missed or taken twice moves weights by about the
    // learning rate (1e-3), moments by a tenth.
    let largest = |x: &[f32]| x.iter().fold(0.0f32, |a, &b| a.max(b.abs()));
    let (got, want) = (
        host.master_params().unwrap(),
        device.master_params().unwrap(),
    );
    let scale = largest(&want);
    assert_within(
        "master weights, host step against device step",
        &got,
        &want,
        2e-4 * scale,
    );
    let (m, v) = host.moments().unwrap();
    let (dm, dv) = device.moments().unwrap();
    assert_within("adamw m", &m, &dm, 1e-2 * largest(&dm));
    assert_within("adamw v", &v, &dv, 1e-2 * largest(&dv));
    let optimizer = host_memory
        .resident_bytes()
        .into_iter()
        .find(|(tag, _)| *tag == MemoryTag::Optimizer)
        .map_or(0, |(_, bytes)| bytes);
    assert_eq!(optimizer, 0, "the optimizer state stays on the host");
}

#[test]
fn gpu_trainer_micro_batches_give_the_gradients_of_one_batch_and_refuse_bad_batches() {
    let test = "gpu_trainer_micro_batches_give_the_gradients_of_one_batch";
    let Some(t) = TestGpu::open(test, 1) else {
        return;
    };
    let gpu = Arc::new(t.gpu);
    let config = tiny();
    let params = bf16_params(&config, 51);
    let data = Batch::random(52, config.vocab_size);
    let batch = data.view();
    let trainer = |max_tokens| {
        let spec = spec(config.clone(), BackupPolicy::None, max_tokens);
        GpuTrainer::new(Arc::clone(&gpu), manager(&gpu), spec, &params).unwrap()
    };
    // 3 x 17 tokens: one batch, and micro-batches of two sequences then one.
    let (mut whole, mut split) = (trainer(B * T), trainer(2 * T + 1));
    let loss = whole.compute_grads(&batch).unwrap();
    let split_loss = split.compute_grads(&batch).unwrap();
    // The same sums; cuBLAS may pick other kernels for other row counts, whose bf16 outputs
    // round differently: 1e-3 on the loss, cosine > 0.9999 and norms within 1% per kind.
    eprintln!("loss {loss}, micro-batched {split_loss}");
    assert!(
        (loss - split_loss).abs() <= 1e-3 * loss.abs(),
        "{split_loss} vs {loss}"
    );
    assert_grads_agree(
        "micro-batched",
        &ParamLayout::new(&config),
        &split.grads().unwrap(),
        &whole.grads().unwrap(),
        0.9999,
        0.01,
    );
    let (lp, _) = whole.logprobs(&batch).unwrap();
    let (split_lp, _) = split.logprobs(&batch).unwrap();
    assert_within("micro-batched logprobs", &split_lp, &lp, 1e-2);

    let mut bad = data.inputs.clone();
    bad[5] = config.vocab_size as u32;
    let bad_batch = TrainBatch {
        inputs: &bad,
        ..batch
    };
    assert!(matches!(
        whole.train_step(&bad_batch, 1),
        Err(ModelError::TokenOutOfRange { position: 5, .. })
    ));
    // One sequence longer than the split trainer's 35 tokens.
    let long = vec![1u32; 40];
    let long_weights = vec![1.0; 40];
    let long_batch = TrainBatch {
        batch: 1,
        seq: 40,
        inputs: &long,
        targets: &long,
        weights: &long_weights,
        normaliser: 1.0,
        entropy_mask: None,
        entropy_coef: 0.0,
    };
    assert!(
        matches!(split.train_step(&long_batch, 1), Err(ModelError::Batch(m)) if m.contains("max_batch_tokens"))
    );
    assert!(matches!(
        whole.train_step(&batch, 0),
        Err(ModelError::InvalidStep { step: 0 })
    ));
}

/// Two runs give the same bits, and so does a run whose optimizer steps run in line (a timed
/// trainer's) rather than behind the next forward pass: a pass that read a unit before its
/// update, or gradients zeroed under the update, would change them.
#[test]
fn gpu_trainers_give_bit_identical_gradients_losses_and_weights_with_the_optimizer_in_line_or_behind()
 {
    let test = "gpu_trainers_give_bit_identical_gradients_losses_and_weights_with_the_optimizer_in_line_or_behind";
    let Some(gpu) = super::testing::one_gpu(test) else {
        return;
    };
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    // Llama, and qwen3 with its per-head norms; the batch repeats ids (a vocabulary of 64).
    for config in [tiny(), tiny_family("qwen3")] {
        let params = family_params(&config, 47);
        let data = Batch::random(48, config.vocab_size);
        let run = |in_line: bool| {
            let spec = gentle(config.clone());
            let mut trainer =
                GpuTrainer::new(Arc::clone(&gpu), manager(&gpu), spec, &params).unwrap();
            if in_line {
                trainer.time_steps().unwrap();
            }
            let mut seen = Vec::new();
            for step in 1..=3 {
                let report = trainer.train_step(&data.view(), step).unwrap();
                seen.push((report.loss.to_bits(), bits(&trainer.grads().unwrap())));
                // Scoring right after a step reads the weights its update writes.
                let (logprobs, loss) = trainer.logprobs(&data.view()).unwrap();
                seen.push((loss.to_bits(), bits(&logprobs)));
            }
            (seen, bits(&trainer.master_params().unwrap()))
        };
        let first = run(true);
        for second in [run(false), run(false)] {
            for (at, (a, b)) in first.0.iter().zip(&second.0).enumerate() {
                let what = if at % 2 == 0 {
                    "step"
                } else {
                    "scoring after step"
                };
                assert_eq!(
                    a.0,
                    b.0,
                    "{}: loss of {what} {}",
                    config.family.model_type(),
                    at / 2 + 1
                );
                let differ = a.1.iter().zip(&b.1).filter(|(x, y)| x != y).count();
                assert_eq!(
                    differ,
                    0,
                    "{}: {differ} gradients or log-probs differ at {what} {}",
                    config.family.model_type(),
                    at / 2 + 1
                );
            }
            assert!(
                first.1 == second.1,
                "{}: master weights differ",
                config.family.model_type()
            );
        }
    }
}

/// A spec like `gentle`'s, backed up to the host (so offload cycles keep the weights), whose
/// moments (and, with `master_weights`, master weights) stream through `dir` in `dtype`,
/// buckets of 64 KiB.
fn streamed_spec(
    config: LlamaConfig,
    dtype: crate::choice::MomentDtype,
    master_weights: bool,
    dir: &std::path::Path,
) -> GpuTrainerSpec {
    GpuTrainerSpec {
        stream: Some(MomentStream {
            dtype,
            master_weights,
            disk: crate::memory::DiskSettings {
                dir: dir.to_path_buf(),
                rank: 0,
                chunk_bytes: 64 << 10,
                host_budget_bytes: 0,
            },
        }),
        backup: BackupPolicy::Host,
        ..super::testing::gentle(config)
    }
}

#[test]
fn streamed_optimizer_step_is_bit_exact_in_fp32_and_close_in_half_moments() {
    use crate::choice::MomentDtype;
    let test = "streamed_optimizer_step_is_bit_exact_in_fp32_and_close_in_half_moments";
    let Some(gpu) = super::testing::one_gpu(test) else {
        return;
    };
    let config = tiny();
    let params = bf16_params(&config, 43);
    let data = Batch::random(44, config.vocab_size);
    let batch = data.view();
    let steps = 4u64;
    let spec = super::testing::gentle(config.clone());
    let mut resident = GpuTrainer::new(Arc::clone(&gpu), manager(&gpu), spec, &params).unwrap();
    let want: Vec<f32> = (1..=steps)
        .map(|step| resident.train_step(&batch, step).unwrap().loss)
        .collect();
    let want_master = resident.master_params().unwrap();
    let (want_m, want_v) = resident.moments().unwrap();
    let resident_bytes = resident.optimizer_device_bytes();
    drop(resident);
    // bf16 moments round each update's moments to 8 bits, the weights to bf16: at lr 1e-3 over
    // four steps the losses stay within the parallel tests' 1e-2 relative.
    // Without offload cycles first: a difference there is the walk's, not the cycles'.
    // The master weights streaming too: still bit-exact, and none of them on the device.
    for (dtype, tolerance, cycles, master_weights) in [
        (MomentDtype::Fp32, 0.0f32, false, false),
        (MomentDtype::Fp32, 0.0, true, false),
        (MomentDtype::Fp32, 0.0, true, true),
        (MomentDtype::Bf16, 1e-2, true, false),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let spec = streamed_spec(config.clone(), dtype, master_weights, dir.path());
        let memory = manager(&gpu);
        let mut streamed =
            GpuTrainer::new(Arc::clone(&gpu), Arc::clone(&memory), spec, &params).unwrap();
        let mut got = Vec::new();
        for step in 1..=steps {
            let report = streamed.train_step(&batch, step).unwrap();
            let Some(moved) = report.optimizer_stream else {
                panic!("step {step}: a streamed step reports its disk traffic");
            };
            assert!(
                moved.bytes_read > 0 && moved.bytes_read == moved.bytes_written,
                "{moved:?}"
            );
            got.push(report.loss);
            // Offload cycles between steps, as a colocated run does: the slots are dropped.
            if cycles {
                streamed.offload().unwrap();
                streamed.onload().unwrap();
            }
        }
        for (step, (g, w)) in got.iter().zip(&want).enumerate() {
            let rel = (g - w).abs() / w.abs();
            eprintln!(
                "{dtype} step {}: streamed loss {g} vs resident {w} (relative {rel:.3e})",
                step + 1
            );
            assert!(rel <= tolerance, "{dtype} step {}: {g} vs {w}", step + 1);
        }
        if dtype == MomentDtype::Fp32 {
            let (m, v) = streamed.moments().unwrap();
            for (what, got, want) in [
                (
                    "master weights",
                    streamed.master_params().unwrap(),
                    want_master.clone(),
                ),
                ("first moments", m, want_m.clone()),
                ("second moments", v, want_v.clone()),
            ] {
                let differ: Vec<usize> = (0..want.len())
                    .filter(|&i| got[i].to_bits() != want[i].to_bits())
                    .collect();
                // Elements per 64 KiB bucket of fp32 state: 8192 (m and v), 5461 (and master).
                let per_bucket = if master_weights { 5461 } else { 8192 };
                let mut buckets: Vec<usize> = differ.iter().map(|&i| i / per_bucket).collect();
                buckets.dedup();
                let worst = differ
                    .iter()
                    .map(|&i| (got[i] - want[i]).abs() / want[i].abs().max(1e-30))
                    .fold(0.0f32, f32::max);
                assert!(
                    differ.is_empty(),
                    "{what} (offload cycles: {cycles}, master streamed: {master_weights}): {} of {} differ (indices {:?}..{:?}, in buckets {buckets:?}, worst relative {worst:.3e})",
                    differ.len(),
                    want.len(),
                    differ.first(),
                    differ.last()
                );
            }
        }
        // The device holds the master weights (unless they stream) and three 64 KiB slots,
        // never all.
        let master = if master_weights {
            0
        } else {
            want_master.len() * 4
        };
        let device = streamed.optimizer_device_bytes();
        eprintln!(
            "{dtype} (master streamed: {master_weights}): optimizer state on the device {device} bytes, resident {resident_bytes}"
        );
        assert!(
            device <= master + 3 * (64 << 10),
            "{device} bytes on the device"
        );
        let slots = memory
            .resident_bytes()
            .into_iter()
            .find(|(tag, _)| *tag == MemoryTag::Named("optimizer-stream".into()))
            .map(|(_, bytes)| bytes)
            .unwrap();
        assert!(
            slots <= 3 * (64 << 10) + (4 << 20),
            "{slots} bytes of slots resident"
        );
        if master_weights {
            // New master weights go to disk and leave the moments as they were.
            let (m, v) = streamed.moments().unwrap();
            streamed.set_params(&params).unwrap();
            assert!(
                streamed.master_params().unwrap() == params,
                "master weights set"
            );
            assert!(streamed.moments().unwrap() == (m, v), "moments kept");
        }
    }
}

#[test]
fn a_corrupted_streamed_bucket_fails_the_step_naming_the_checksum_and_changes_no_weight() {
    let test =
        "a_corrupted_streamed_bucket_fails_the_step_naming_the_checksum_and_changes_no_weight";
    let Some(gpu) = super::testing::one_gpu(test) else {
        return;
    };
    let config = tiny();
    let params = bf16_params(&config, 45);
    let data = Batch::random(46, config.vocab_size);
    let batch = data.view();
    let dir = tempfile::tempdir().unwrap();
    let spec = streamed_spec(config, crate::choice::MomentDtype::Fp32, false, dir.path());
    let mut trainer = GpuTrainer::new(Arc::clone(&gpu), manager(&gpu), spec, &params).unwrap();
    trainer.train_step(&batch, 1).unwrap();
    let master = trainer.master_params().unwrap();
    let (logprobs, _) = trainer.logprobs(&batch).unwrap();
    let file = dir
        .path()
        .join("offload/rank-0/named-optimizer-bucket-00000/data.bin");
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[100] ^= 0x40;
    std::fs::write(&file, bytes).unwrap();
    let err = trainer.train_step(&batch, 2).unwrap_err();
    assert!(matches!(err, ModelError::Store(_)), "{err}");
    assert!(err.to_string().contains("checksum mismatch"), "{err}");
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&trainer.master_params().unwrap()), bits(&master));
    let (again, _) = trainer.logprobs(&batch).unwrap();
    assert_within("logprobs after the failed step", &again, &logprobs, 1e-5);
}
