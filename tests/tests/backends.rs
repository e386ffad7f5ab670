//! The two training backends against each other: the fsdp backend at several data-parallel
//! sizes against the megatron backend at TP=1, DP=1, and checkpoints passed between them at
//! any data-parallel size.
//!
//! Both start from the same seeded weights (`init_weights`, Hugging Face's initialisation) with
//! the same AdamW settings and train on the same seeded batches through
//! [`TrainBackend`], so any difference is the backends' own.

// Helpers of a test crate are test code: they may unwrap and panic.
#![allow(clippy::unwrap_used, clippy::panic, clippy::expect_used)]

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use miles_core::backend::TrainBackend;
use miles_core::config::{Settings, TrainBackendKind};
use miles_core::model::LlamaConfig;
use miles_core::ops::AdamWConfig;
use miles_core::{Batch, CpuDevice, Device};
use miles_fsdp::FsdpBackend;
use miles_megatron::{MegatronOptions, MegatronTrainer, init_weights};

const STEPS: usize = 5;
const SEED: u64 = 5;
const LR: f64 = 3e-3;
const ROWS: usize = 4;
const SEQ: usize = 9;

fn tiny() -> LlamaConfig {
    LlamaConfig::preset("tiny").unwrap()
}

/// The fsdp backend at `dp` ranks, one CPU device each, initialised from [`SEED`].
fn fsdp(dp: usize) -> FsdpBackend {
    fsdp_in_micro_batches(dp, None)
}

/// [`fsdp`] with each rank's share of a step in micro-batches of `micro` sequences.
fn fsdp_in_micro_batches(dp: usize, micro: Option<usize>) -> FsdpBackend {
    let settings = Settings {
        train_backend: TrainBackendKind::Fsdp,
        data_parallel_size: dp,
        micro_batch_size: micro,
        lr: LR,
        seed: SEED,
        device_memory_gib: 0.5,
        train_memory_margin_bytes: 0,
        ..Settings::default()
    };
    let devices = (0..dp)
        .map(|_| Arc::new(CpuDevice::new(settings.device_memory_bytes())) as Arc<dyn Device>)
        .collect();
    FsdpBackend::new(tiny(), &settings, devices).unwrap()
}

/// The megatron backend at TP=1 and `dp` ranks, from the weights [`SEED`] gives, with the
/// fsdp backend's AdamW settings.
fn megatron(dp: usize) -> MegatronTrainer {
    megatron_in_micro_batches(dp, None)
}

/// [`megatron`] with each rank's share of a step in micro-batches of `micro` sequences.
fn megatron_in_micro_batches(dp: usize, micro: Option<usize>) -> MegatronTrainer {
    let config = tiny();
    let params = init_weights(&config, SEED).unwrap();
    let options = MegatronOptions {
        tensor_parallel: 1,
        data_parallel: dp,
        adamw: AdamWConfig {
            lr: LR as f32,
            ..AdamWConfig::default()
        },
        device_bytes: 256 << 20,
        micro_batch_size: micro,
        ..MegatronOptions::default()
    };
    MegatronTrainer::new(config, &params, options).unwrap()
}

/// Step `step`'s batch (see [`miles_tests::seeded_batch`]).
fn batch(step: usize) -> Batch {
    miles_tests::seeded_batch(&tiny(), step, ROWS, SEQ)
}

/// The losses of `steps` on `backend`.
fn train(backend: &mut dyn TrainBackend, steps: Range<usize>) -> Vec<f32> {
    steps
        .map(|s| backend.train_step(&batch(s)).unwrap().loss)
        .collect()
}

fn worst_relative(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - f64::from(*y)).abs() / f64::from(y.abs()).max(1e-12))
        .fold(0.0, f64::max)
}

#[test]
fn fsdp_at_dp_1_2_and_4_gives_the_megatron_losses_at_tp1_dp1_over_five_steps() {
    let reference = train(&mut megatron(1), 0..STEPS);
    assert!(
        reference[STEPS - 1] < reference[0],
        "megatron must learn: {reference:?}"
    );
    for dp in [1, 2, 4] {
        let losses = train(&mut fsdp(dp), 0..STEPS);
        let worst = worst_relative(&losses, &reference);
        eprintln!("fsdp dp {dp} vs megatron tp 1 dp 1: worst relative loss difference {worst:e}");
        // Tolerance 1e-5 relative (issue 7): the backends reduce gradients in other orders.
        assert!(
            worst < 1e-5,
            "fsdp dp {dp}: losses {losses:?} vs megatron {reference:?}, worst relative {worst:e}"
        );
    }
}

/// The full weights of `backend`, in layout order.
fn weights(backend: &mut dyn TrainBackend) -> Vec<f32> {
    let mut all = Vec::new();
    backend
        .export_weights(usize::MAX, &mut |bucket| {
            all.extend(bucket.tensors.into_iter().flat_map(|t| t.data));
            Ok(())
        })
        .unwrap();
    all
}

/// A backend behind the contract.
type Backend = Box<dyn TrainBackend>;

#[test]
fn a_step_in_micro_batches_gives_the_whole_batch_step_on_megatron_and_fsdp() {
    // The response tokens (the weighted targets) carry an entropy bonus, so its gradient is
    // accumulated over the micro-batches too.
    let mut step = batch(0);
    step.entropy_mask = Some(step.weights.iter().map(|&w| f32::from(w != 0.0)).collect());
    step.entropy_coef = 0.05;
    let next = batch(1);
    let cases: [(&str, Backend, Backend); 4] = [
        (
            "megatron dp 1, micro-batches of 1",
            Box::new(megatron(1)),
            Box::new(megatron_in_micro_batches(1, Some(1))),
        ),
        (
            "megatron dp 2, micro-batches of 1",
            Box::new(megatron(2)),
            Box::new(megatron_in_micro_batches(2, Some(1))),
        ),
        (
            "fsdp dp 1, micro-batches of 3 (3 + 1)",
            Box::new(fsdp(1)),
            Box::new(fsdp_in_micro_batches(1, Some(3))),
        ),
        (
            "fsdp dp 2, micro-batches of 1",
            Box::new(fsdp(2)),
            Box::new(fsdp_in_micro_batches(2, Some(1))),
        ),
    ];
    for (what, mut whole, mut micro) in cases {
        let (a, b) = (
            whole.train_step(&step).unwrap(),
            micro.train_step(&step).unwrap(),
        );
        let (ea, eb) = (a.entropy.unwrap(), b.entropy.unwrap());
        assert!(
            ea > 1.0,
            "{what}: the tiny model's entropy is near ln V, got {ea}"
        );
        let (wa, wb) = (weights(&mut *whole), weights(&mut *micro));
        let moved = wa
            .iter()
            .zip(&weights(&mut megatron(1)))
            .filter(|(x, y)| x != y)
            .count();
        assert!(
            moved > wa.len() / 2,
            "{what}: the step moved {moved} weights"
        );
        // fp32 sums in other orders: 1e-5 relative on the loss, the entropy and the gradient
        // norm. On a weight, AdamW's first step is lr * g / (|g| + eps): where |g| is near eps
        // (1e-8) the rounding of a sum that cancels to near 0 moves it by up to lr * dg / eps,
        // so weights are held to lr * 1e-2 (a lost or doubled micro-batch moves them by ~lr).
        let worst_weight = wa
            .iter()
            .zip(&wb)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        eprintln!(
            "{what}: loss {} vs {}, entropy {ea} vs {eb}, gradient norm {} vs {}, largest weight difference {worst_weight:e}",
            a.loss, b.loss, a.grad_norm, b.grad_norm
        );
        assert!(
            worst_relative(&[b.loss, eb, b.grad_norm], &[a.loss, ea, a.grad_norm]) < 1e-5,
            "{what}: loss {} vs {}, entropy {eb} vs {ea}, gradient norm {} vs {}",
            b.loss,
            a.loss,
            b.grad_norm,
            a.grad_norm
        );
        assert!(
            worst_weight < (LR as f32) * 1e-2,
            "{what}: largest weight difference {worst_weight:e}"
        );
        let (lp_whole, loss_whole) = whole.logprobs(&next).unwrap();
        let (lp_micro, loss_micro) = micro.logprobs(&next).unwrap();
        let worst_lp = worst_relative(&lp_micro, &lp_whole);
        assert!(
            worst_lp < 1e-4 && worst_relative(&[loss_micro], &[loss_whole]) < 1e-5,
            "{what}: log-probs after the step differ by {worst_lp:e} relative"
        );
    }
}

/// Trains steps 0..3 on `backend` and saves it into `dir`.
fn save_after_three_steps(backend: &mut dyn TrainBackend, dir: &Path) {
    train(backend, 0..3);
    backend.save(dir).unwrap();
}

/// Loads `dir` into `backend`, checks the checkpoint's step and returns the losses of steps
/// 3..5 after the load.
fn resume(backend: &mut dyn TrainBackend, dir: &Path) -> Vec<f32> {
    backend.load(dir).unwrap();
    assert_eq!(backend.step(), 3, "{} after loading", backend.name());
    train(backend, 3..STEPS)
}

/// Asserts `got` within `tolerance` relative of `expected`; returns the worst difference.
fn check(what: &str, got: &[f32], expected: &[f32], tolerance: f64) -> f64 {
    let worst = worst_relative(got, expected);
    assert!(
        worst <= tolerance,
        "{what}: steps 4-5 {got:?} vs uninterrupted megatron {expected:?}, worst relative {worst:e} (tolerance {tolerance:e})"
    );
    worst
}

#[test]
fn checkpoints_are_interchangeable_between_megatron_and_fsdp() {
    let straight = train(&mut megatron(1), 0..STEPS);
    let expected = &straight[3..];

    // Megatron saves at TP=1, DP=1; a fresh megatron and a fresh fsdp load the same files.
    let dir = tempfile::tempdir().unwrap();
    save_after_three_steps(&mut megatron(1), dir.path());
    let again = resume(&mut megatron(1), dir.path());
    // Same backend, same layout, the same bytes back: bit-exact.
    let worst = check("megatron dp 1 -> megatron dp 1", &again, expected, 0.0);
    eprintln!("megatron dp 1 -> megatron dp 1: worst relative loss difference {worst:e}");
    let got = resume(&mut fsdp(2), dir.path());
    // Tolerance 1e-6 relative: the loaded weights and moments are the saved fp32 values, and
    // only steps 4-5 differ, by two ranks summing their gradients in another order than one
    // rank does (the whole five-step trajectory at DP=2 stays near 1e-7).
    let worst = check("megatron dp 1 -> fsdp dp 2", &got, expected, 1e-6);
    eprintln!("megatron dp 1 -> fsdp dp 2: worst relative loss difference {worst:e}");

    // The reverse: fsdp saves, megatron loads, at any data-parallel size: megatron joins the
    // rank files into the full moments and cuts its own slices.
    let dir = tempfile::tempdir().unwrap();
    save_after_three_steps(&mut fsdp(1), dir.path());
    let got = resume(&mut megatron(1), dir.path());
    // Bit-exact: fsdp at DP=1 computes the megatron TP=1, DP=1 operations in the same order,
    // and the checkpoint carries the exact fp32 state.
    let worst = check("fsdp dp 1 -> megatron dp 1", &got, expected, 0.0);
    eprintln!("fsdp dp 1 -> megatron dp 1: worst relative loss difference {worst:e}");
    let dir = tempfile::tempdir().unwrap();
    save_after_three_steps(&mut fsdp(2), dir.path());
    for dp in [1, 2] {
        let got = resume(&mut megatron(dp), dir.path());
        // Tolerance 1e-6 relative, as megatron -> fsdp at DP=2: steps 1-3 ran on two ranks.
        let what = format!("fsdp dp 2 -> megatron dp {dp}");
        let worst = check(&what, &got, expected, 1e-6);
        eprintln!("{what}: worst relative loss difference {worst:e}");
    }
}

#[test]
fn a_megatron_checkpoint_saved_at_dp_2_resumes_at_dp_1_and_4() {
    let straight = train(&mut megatron(1), 0..STEPS);
    let expected = &straight[3..];
    let dir = tempfile::tempdir().unwrap();
    save_after_three_steps(&mut megatron(2), dir.path());
    // The batches' four rows allow DP=4 at most, and the tiny model's 90624 parameters divide
    // by 2, 3 and 4: trimming padding is covered by the megatron crate's checkpoint tests.
    for dp in [1, 4] {
        let got = resume(&mut megatron(dp), dir.path());
        // Tolerance 1e-6 relative: the moments are the saved fp32 values re-sliced (no
        // arithmetic), so the only differences from the uninterrupted DP=1 run are the
        // gradient sums in another order over several ranks (near 1e-7 over five steps).
        let what = format!("megatron dp 2 -> megatron dp {dp}");
        let worst = check(&what, &got, expected, 1e-6);
        eprintln!("{what}: worst relative loss difference {worst:e}");
    }

    // A corrupt rank file, then a missing one: the load fails naming the file.
    let file = dir.path().join("megatron/optimizer-rank-00001.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    bytes.truncate(bytes.len() / 2);
    std::fs::write(&file, bytes).unwrap();
    let err = megatron(1).load(dir.path()).unwrap_err().to_string();
    assert!(err.contains("optimizer-rank-00001.safetensors"), "{err}");
    std::fs::remove_file(&file).unwrap();
    let err = megatron(4).load(dir.path()).unwrap_err().to_string();
    assert!(err.contains("optimizer-rank-00001.safetensors"), "{err}");
}
