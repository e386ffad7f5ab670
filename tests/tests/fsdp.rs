//! The fsdp backend against a single-rank reference, through offload cycles, under native CPU
//! offload, with rule 6, and through checkpoints.
//!
//! The reference is `miles_core::model::Trainer` on the full model with the same seeded
//! initialisation and AdamW settings: what the megatron backend computes at TP=1, DP=1.

// Helpers of a test crate are test code: they may unwrap and panic.
#![allow(clippy::unwrap_used, clippy::panic, clippy::expect_used)]

use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};

use miles_core::backend::TrainBackend;
use miles_core::config::{OffloadTarget, RawSettings, Settings, TrainBackendKind as BackendChoice};
use miles_core::model::{LlamaConfig, Trainer, Transformer, init_params};
use miles_core::ops::AdamWConfig;
use miles_core::{Batch, CpuDevice, Device, MemoryTag};
use miles_fsdp::FsdpBackend;

const STEPS: usize = 5;
const MIB: u64 = 1 << 20;

fn settings(dp: usize) -> Settings {
    Settings {
        train_backend: BackendChoice::Fsdp,
        data_parallel_size: dp,
        lr: 3e-3,
        seed: 5,
        device_memory_gib: 0.5,
        train_memory_margin_bytes: 0,
        ..Settings::default()
    }
}

fn devices(dp: usize, settings: &Settings) -> Vec<Arc<dyn Device>> {
    (0..dp)
        .map(|_| Arc::new(CpuDevice::new(settings.device_memory_bytes())) as Arc<dyn Device>)
        .collect()
}

fn backend(config: &LlamaConfig, settings: &Settings) -> FsdpBackend {
    let dp = settings.data_parallel_size;
    FsdpBackend::new(config.clone(), settings, devices(dp, settings)).unwrap()
}

fn tiny() -> LlamaConfig {
    LlamaConfig::preset("tiny").unwrap()
}

/// Step `step`'s batch (see [`miles_tests::seeded_batch`]).
fn batch(config: &LlamaConfig, step: usize, b: usize, t: usize) -> Batch {
    miles_tests::seeded_batch(config, step, b, t)
}

/// The single-rank reference: the whole model, `Trainer`, same init and AdamW; its losses over
/// [`STEPS`] steps and then the log-probs of the next batch.
fn reference(
    config: &LlamaConfig,
    settings: &Settings,
    b: usize,
    t: usize,
) -> (Vec<f32>, Vec<f32>) {
    let model = Transformer::new(config.clone());
    let mut params = vec![0.0; model.layout().len()];
    init_params(model.layout(), config, settings.seed, &mut params).unwrap();
    let adamw = AdamWConfig {
        lr: settings.lr as f32,
        ..AdamWConfig::default()
    };
    let mut trainer = Trainer::new(model, params, adamw).unwrap();
    let losses = (0..STEPS)
        .map(|s| {
            trainer
                .train_step(&batch(config, s, b, t).view())
                .unwrap()
                .loss
        })
        .collect();
    let mut logprobs = Vec::new();
    trainer
        .evaluate(&batch(config, STEPS, b, t).view(), &mut logprobs)
        .unwrap();
    (losses, logprobs)
}

fn worst_relative(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - f64::from(*y)).abs() / f64::from(y.abs()).max(1e-12))
        .fold(0.0, f64::max)
}

fn train(
    backend: &mut FsdpBackend,
    config: &LlamaConfig,
    steps: std::ops::Range<usize>,
    b: usize,
    t: usize,
) -> Vec<f32> {
    steps
        .map(|s| backend.train_step(&batch(config, s, b, t)).unwrap().loss)
        .collect()
}

fn weights(backend: &mut FsdpBackend) -> Vec<(String, Vec<f32>)> {
    let mut out = Vec::new();
    backend
        .export_weights(64 << 10, &mut |bucket| {
            out.extend(bucket.tensors.into_iter().map(|t| (t.name, t.data)));
            Ok(())
        })
        .unwrap();
    out
}

#[test]
fn data_parallel_1_2_and_4_give_the_single_rank_reference_losses_over_five_steps() {
    let config = tiny();
    let (b, t) = (4, 9);
    let (reference, reference_logprobs) = reference(&config, &settings(1), b, t);
    for dp in [1, 2, 4] {
        let s = settings(dp);
        let mut fsdp = backend(&config, &s);
        let losses = train(&mut fsdp, &config, 0..STEPS, b, t);
        let worst = worst_relative(&losses, &reference);
        // Tolerance 1e-5 relative: the ranks sum gradients in another order than one rank does.
        assert!(
            worst < 1e-5,
            "dp {dp}: losses {losses:?} vs {reference:?}, worst relative {worst}"
        );
        assert_eq!(fsdp.step(), STEPS as u64);
        let (logprobs, _) = fsdp.logprobs(&batch(&config, STEPS, b, t)).unwrap();
        let worst = worst_relative(&logprobs, &reference_logprobs);
        // Same tolerance for the log-probs after the five steps; scoring takes no step.
        assert!(worst < 1e-5, "dp {dp}: log-probs worst relative {worst}");
        assert_eq!(fsdp.step(), STEPS as u64);
        assert!(
            reference[STEPS - 1] < reference[0],
            "the reference must learn: {reference:?}"
        );
    }
}

fn offload_trajectory(target: OffloadTarget, dir: Option<&Path>) {
    let config = tiny();
    let (b, t) = (4, 6);
    let mut s = settings(2);
    s.offload_train = true;
    s.offload_train_target = target;
    s.offload_train_disk_dir = dir.map(Path::to_path_buf);
    s.offload_train_disk_chunk_mb = 1;
    let mut plain = backend(&config, &s);
    let expected = train(&mut plain, &config, 0..STEPS, b, t);
    let mut cycled = backend(&config, &s);
    let mut losses = Vec::new();
    for step in 0..STEPS {
        losses.extend(train(&mut cycled, &config, step..step + 1, b, t));
        let out = cycled.offload().unwrap();
        assert!(cycled.is_offloaded());
        assert_eq!(out.ranks.len(), 2);
        for rank in &out.ranks {
            let moved: u64 = rank
                .tags
                .iter()
                .filter(|r| matches!(r.tag, MemoryTag::Params | MemoryTag::Optimizer))
                .map(|r| r.bytes)
                .sum();
            assert!(
                moved > 0,
                "rank {} moved nothing: {:?}",
                rank.rank,
                rank.tags
            );
        }
        assert!(cycled.train_step(&batch(&config, 0, b, t)).is_err());
        assert!(
            cycled.device_bytes().unwrap().iter().all(|&d| d == 0),
            "device memory left after offload"
        );
        if let Some(dir) = dir {
            assert!(files_under(dir) > 0, "no disk backup written");
        }
        let back = cycled.onload().unwrap();
        assert_eq!(back.bytes(), out.bytes());
        if let Some(dir) = dir {
            assert_eq!(files_under(dir), 0, "disk backups left after onload");
        }
    }
    let same = losses
        .iter()
        .zip(&expected)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(same, "{target}: {losses:?} vs {expected:?}");
    assert_eq!(weights(&mut cycled), weights(&mut plain));
    drop(cycled);
    if let Some(dir) = dir {
        assert_eq!(
            files_in(dir, true),
            0,
            "files left once the backend is gone"
        );
    }
}

#[test]
fn offload_cycles_to_cpu_between_steps_leave_the_trajectory_bit_exact() {
    offload_trajectory(OffloadTarget::Host, None);
}

#[test]
fn offload_cycles_to_disk_between_steps_leave_the_trajectory_bit_exact() {
    let dir = tempfile::tempdir().unwrap();
    offload_trajectory(OffloadTarget::Disk, Some(dir.path()));
}

/// Regular files under `dir` but the rank directories' lock files, leaving out the backups the
/// store is still unlinking in the background (renamed `.removing-*` once consumed) unless `all`.
fn files_in(dir: &Path, all: bool) -> usize {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .filter(|e| all || !e.file_name().to_string_lossy().starts_with(".removing-"))
                .filter(|e| e.file_name() != "lock")
                .map(|e| {
                    if e.path().is_dir() {
                        files_in(&e.path(), all)
                    } else {
                        1
                    }
                })
                .sum()
        })
        .unwrap_or(0)
}

fn files_under(dir: &Path) -> usize {
    files_in(dir, false)
}

/// Tiny widened so that a decoder layer spans several 2 MiB granules and the device bound means
/// something: 4 layers of about 3.9 MB each.
fn wide() -> LlamaConfig {
    let mut v: serde_json::Value = serde_json::from_str(&tiny().to_json_string()).unwrap();
    v["hidden_size"] = 256.into();
    v["intermediate_size"] = 1024.into();
    v["num_hidden_layers"] = 4.into();
    LlamaConfig::from_json_str(&v.to_string()).unwrap()
}

#[test]
fn native_cpu_offload_trains_to_the_same_losses_holding_one_unit_and_activations_on_the_device() {
    let config = wide();
    let (b, t) = (2, 8);
    let dp = 2;
    let mut s = settings(dp);
    let mut on_device = backend(&config, &s);
    let expected = train(&mut on_device, &config, 0..3, b, t);
    s.fsdp_cpu_offload = true;
    let mut native = backend(&config, &s);
    assert!(native.native_cpu_offload());
    let losses = train(&mut native, &config, 0..3, b, t);
    // The same f32 operations on the same values, wherever they live: bit for bit.
    let same = losses
        .iter()
        .zip(&expected)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(same, "{losses:?} vs {expected:?}");

    let plan = native.plan().clone();
    let granule = 2 * MIB;
    let round = |bytes: usize| (bytes as u64).next_multiple_of(granule);
    let largest_shard = plan.units().iter().map(|u| u.shard_len).max().unwrap();
    let gather_bytes =
        4 * (plan.gathered_len() + plan.gathered_grad_len() + largest_shard) + 3 * 256;
    let rows = b / dp;
    let acts = 4 * Transformer::new(config.clone())
        .activation_layout(rows, t)
        .unwrap()
        .len();
    let bound = round(gather_bytes) + round(acts);
    let params_bytes = 4 * Transformer::new(config.clone()).layout().len() as u64;
    let largest_unit = plan.units().iter().map(|u| u.range.len()).max().unwrap() as u64 * 4;
    for (rank, (&peak, &resident)) in native
        .peak_device_bytes()
        .iter()
        .zip(&on_device.peak_device_bytes())
        .enumerate()
    {
        println!(
            "rank {rank}: native peak {peak} bytes (bound {bound}), on-device peak {resident}, full params {params_bytes}, largest unit {largest_unit}"
        );
        assert!(
            peak > 0 && peak <= bound,
            "rank {rank}: native offload held {peak} bytes, bound {bound}"
        );
        // The bound is about one unit's parameters and gradient: far below the model.
        assert!(
            bound < params_bytes,
            "bound {bound} vs params {params_bytes}"
        );
        // Without native offload the shards, gradients and moments (4 x params / dp) sit there too.
        assert!(
            resident >= peak + 4 * params_bytes / dp as u64 - granule,
            "{resident} vs {peak}"
        );
    }
    // Its state already lives on the host: an offload frees the device's transient buffers only.
    native.offload().unwrap();
    assert!(native.device_bytes().unwrap().iter().all(|&d| d == 0));
    native.onload().unwrap();
    let next = train(&mut native, &config, 3..4, b, t);
    assert_eq!(next, train(&mut on_device, &config, 3..4, b, t));
    assert!(
        native.region_bytes(&MemoryTag::Params).is_err(),
        "no params region under native offload"
    );
}

/// A `tracing` writer that keeps what it is given.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn warnings_about(&self, what: &str) -> usize {
        let text = String::from_utf8(self.0.lock().unwrap().clone()).unwrap();
        text.lines()
            .filter(|l| l.contains("WARN") && l.contains(what))
            .count()
    }
}

fn capturing(f: impl FnOnce()) -> Captured {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, f);
    captured
}

#[test]
fn fsdp_cpu_offload_with_offload_train_warns_once_end_to_end_and_native_offload_is_off() {
    let mut built = None;
    let captured = capturing(|| {
        let flags = RawSettings {
            train_backend: Some(BackendChoice::Fsdp),
            offload_train: Some(true),
            fsdp_cpu_offload: Some(true),
            preset: Some("tiny".into()),
            device_memory_gib: Some(0.25),
            train_memory_margin_bytes: Some(0),
            data_parallel_size: Some(2),
            ..RawSettings::default()
        };
        let settings = Settings::resolve(flags, RawSettings::default()).unwrap();
        let mut fsdp = FsdpBackend::from_settings(&settings).unwrap();
        fsdp.train_step(&batch(&tiny(), 0, 2, 4)).unwrap();
        built = Some(fsdp);
    });
    assert_eq!(captured.warnings_about("--fsdp-cpu-offload"), 1);
    let mut fsdp = built.unwrap();
    assert!(!fsdp.native_cpu_offload());
    // Core offload moves the shards and the optimizer state instead.
    assert!(
        fsdp.region_bytes(&MemoryTag::Params)
            .unwrap()
            .iter()
            .all(|&b| b > 0)
    );
    let out = fsdp.offload().unwrap();
    assert!(out.bytes() > 0);

    // Settings that skipped validation still get the rule (warned once, where settings resolve).
    let s = Settings {
        offload_train: true,
        fsdp_cpu_offload: true,
        ..settings(1)
    };
    assert!(!backend(&tiny(), &s).native_cpu_offload());
}

#[test]
fn a_checkpoint_saved_at_two_ranks_resumes_the_trajectory_at_one_and_four() {
    let config = tiny();
    let (b, t) = (4, 5);
    let mut straight = backend(&config, &settings(2));
    let expected = train(&mut straight, &config, 0..STEPS, b, t);
    let dir = tempfile::tempdir().unwrap();
    let mut first = backend(&config, &settings(2));
    train(&mut first, &config, 0..3, b, t);
    first.save(dir.path()).unwrap();
    for file in [
        "model.safetensors",
        "config.json",
        "megatron/optimizer-rank-00000.safetensors",
        "megatron/optimizer-rank-00001.safetensors",
    ] {
        assert!(dir.path().join(file).exists(), "{file} missing");
    }
    for dp in [1, 4] {
        let mut resumed = backend(&config, &settings(dp));
        resumed.load(dir.path()).unwrap();
        assert_eq!(resumed.step(), 3);
        let losses = train(&mut resumed, &config, 3..STEPS, b, t);
        let worst = worst_relative(&losses, &expected[3..]);
        // Tolerance 1e-5 relative, as between rank counts.
        assert!(
            worst < 1e-5,
            "dp {dp}: {losses:?} vs {:?}, worst {worst}",
            &expected[3..]
        );
    }
    // Weights alone (a plain Hugging Face checkpoint) load with fresh moments at step 0.
    std::fs::remove_dir_all(dir.path().join("megatron")).unwrap();
    let mut plain = backend(&config, &settings(2));
    plain.load(dir.path()).unwrap();
    assert_eq!(plain.step(), 0);
    let (saved, _) = miles_core::model::load_checkpoint(dir.path()).unwrap();
    assert_eq!(saved, config);
}

#[test]
fn exported_weights_are_the_full_tensors_by_hugging_face_name_in_buckets() {
    let config = tiny();
    let mut fsdp = backend(&config, &settings(4));
    train(&mut fsdp, &config, 0..2, 4, 5);
    let dir = tempfile::tempdir().unwrap();
    fsdp.save(dir.path()).unwrap();
    let (_, params) = miles_core::model::load_checkpoint(dir.path()).unwrap();
    let layout = Transformer::new(config.clone()).layout().clone();
    let mut buckets = Vec::new();
    fsdp.export_weights(100_000, &mut |bucket| {
        buckets.push(bucket);
        Ok(())
    })
    .unwrap();
    assert!(buckets.len() > 1);
    let tensors: Vec<_> = buckets.iter().flat_map(|b| &b.tensors).collect();
    assert_eq!(tensors.len(), layout.specs().len());
    for (tensor, spec) in tensors.iter().zip(layout.specs()) {
        assert_eq!(tensor.name, spec.name);
        assert_eq!(tensor.shape, spec.shape);
        assert_eq!(tensor.data, params[spec.range()], "{}", spec.name);
    }
    for bucket in &buckets {
        assert!(bucket.tensors.len() == 1 || bucket.bytes() <= 100_000);
    }
    let err = fsdp.export_weights(1 << 20, &mut |_| {
        Err(miles_core::BackendError::Sink("full".into()))
    });
    assert!(err.is_err());
}
