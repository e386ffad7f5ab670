//! The Megatron backend end to end: parallel layouts against one rank, offload cycles,
//! optimizer streaming, checkpoints and error paths, on the tiny preset.

// Helpers of an integration test are test code too (clippy only exempts `#[test]` functions).
#![allow(clippy::unwrap_used)]

use miles_megatron::{
    BackendError, Batch, LlamaConfig, MegatronOptions, MegatronTrainer, MomentDtype,
    OptimizerStream, TrainBackend, TrainOffload, init_weights,
};

const STEPS: usize = 5;

/// A seeded batch of `b` sequences of `t` tokens with per-token weights (advantages) in
/// `[0.5, 1.5)` (positive, so the loss stays far from zero and relative differences mean
/// something).
fn batch(seed: u64, b: usize, t: usize) -> Batch {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut next = || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) as u32
    };
    let tokens: Vec<u32> = (0..b * (t + 1)).map(|_| next() % 256).collect();
    let (mut inputs, mut targets) = (Vec::new(), Vec::new());
    for row in tokens.chunks_exact(t + 1) {
        inputs.extend_from_slice(&row[..t]);
        targets.extend_from_slice(&row[1..]);
    }
    let weights = (0..b * t)
        .map(|_| next() as f32 / (1u64 << 31) as f32 + 0.5)
        .collect();
    Batch {
        batch: b,
        seq: t,
        inputs,
        targets,
        weights,
        normaliser: (b * t) as f32,
        entropy_mask: None,
        entropy_coef: 0.0,
    }
}

fn options(tp: usize, dp: usize) -> MegatronOptions {
    MegatronOptions {
        tensor_parallel: tp,
        data_parallel: dp,
        device_bytes: 256 << 20,
        ..MegatronOptions::default()
    }
}

fn trainer(opts: MegatronOptions) -> MegatronTrainer {
    let config = LlamaConfig::preset("tiny").unwrap();
    let params = init_weights(&config, 11).unwrap();
    MegatronTrainer::new(config, &params, opts).unwrap()
}

/// Losses of `STEPS` steps, running `between` after each step.
fn losses(
    trainer: &mut MegatronTrainer,
    mut between: impl FnMut(&mut MegatronTrainer),
) -> Vec<f32> {
    (0..STEPS)
        .map(|s| {
            let loss = trainer.train_step(&batch(s as u64, 4, 16)).unwrap().loss;
            between(trainer);
            loss
        })
        .collect()
}

fn worst_relative(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| ((x - y) / y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn tensor_and_data_parallel_layouts_give_the_single_rank_losses() {
    // Tolerance 1e-5 relative: the layouts only reorder fp32 sums.
    let reference = losses(&mut trainer(options(1, 1)), |_| {});
    for (tp, dp) in [(2, 1), (1, 2), (2, 2)] {
        let got = losses(&mut trainer(options(tp, dp)), |_| {});
        let worst = worst_relative(&got, &reference);
        eprintln!("tp {tp} x dp {dp}: worst relative loss difference {worst}");
        assert!(
            worst < 1e-5,
            "tp {tp} x dp {dp}: worst relative loss difference {worst}\n{got:?}\n{reference:?}"
        );
    }
    assert!(reference[STEPS - 1] != reference[0]);
}

#[test]
fn an_offload_cycle_between_steps_leaves_the_trajectory_bit_exact() {
    let dir = tempfile::tempdir().unwrap();
    // The disk in line, and copied to host memory first with the write behind the pause.
    let disk = |name: &str, host_budget_bytes| TrainOffload::Disk {
        dir: dir.path().join(name),
        chunk_bytes: 64 << 10,
        host_budget_bytes,
    };
    for (target, offload) in [
        ("host", TrainOffload::Host),
        ("disk", disk("disk", 0)),
        ("disk written behind", disk("behind", 256 << 20)),
    ] {
        let opts = MegatronOptions {
            offload,
            ..options(2, 2)
        };
        let reference = losses(&mut trainer(opts.clone()), |_| {});
        let got = losses(&mut trainer(opts), |t| {
            let out = t.offload().unwrap();
            assert_eq!(out.ranks.len(), 4);
            assert!(out.ranks.iter().all(|r| r.bytes > 0));
            let back = t.onload().unwrap();
            assert_eq!(back.ranks.len(), 4);
        });
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&got),
            bits(&reference),
            "{target}: {got:?} vs {reference:?}"
        );
    }
}

#[test]
fn after_offload_the_resident_bytes_of_the_tags_are_near_zero() {
    let mut t = trainer(options(2, 1));
    t.train_step(&batch(1, 2, 16)).unwrap();
    let before = t.resident_bytes().unwrap();
    t.offload().unwrap();
    let during = t.resident_bytes().unwrap();
    t.onload().unwrap();
    for (rank, (b, d)) in before.iter().zip(&during).enumerate() {
        // Near zero: under 1% of what was resident (page-table rounding only).
        assert!(*b > 100_000, "rank {rank}: only {b} bytes resident before");
        assert!(
            *d * 100 < *b,
            "rank {rank}: {d} of {b} bytes still resident"
        );
    }
    t.train_step(&batch(2, 2, 16)).unwrap();
}

#[test]
fn streaming_the_optimizer_state_is_exact_in_fp32_and_close_in_bf16() {
    let dir = tempfile::tempdir().unwrap();
    let reference = losses(&mut trainer(options(2, 2)), |_| {});
    // fp32 read ahead within a budget that holds the whole state, bf16 with the fewest buffers.
    for (dtype, tolerance, host_budget_bytes) in [
        (MomentDtype::Fp32, 0.0, 1 << 30),
        (MomentDtype::Bf16, 1e-5, 0),
    ] {
        let disk = dir.path().join(dtype.to_string());
        let opts = MegatronOptions {
            stream_optimizer: Some(OptimizerStream {
                dtype,
                master_weights: false,
                dir: disk.clone(),
                bucket_bytes: 16 << 10,
                host_budget_bytes,
            }),
            offload: TrainOffload::Disk {
                dir: disk,
                chunk_bytes: 16 << 10,
                host_budget_bytes: 0,
            },
            ..options(2, 2)
        };
        // Offload cycles between the steps, as a colocated run streaming its optimizer does.
        let got = losses(&mut trainer(opts), |t| {
            t.offload().unwrap();
            t.onload().unwrap();
        });
        let worst = worst_relative(&got, &reference);
        eprintln!("{dtype} moments: worst relative loss difference {worst}");
        // fp32 moments: bit-exact. bf16 moments (8-bit mantissas): 1e-5 relative over 5 steps at lr 1e-3.
        assert!(
            worst <= tolerance,
            "{dtype}: worst relative loss difference {worst}"
        );
    }
}

#[test]
fn exported_weights_and_checkpoints_match_across_layouts() {
    let mut single = trainer(options(1, 1));
    let mut sharded = trainer(options(2, 2));
    for s in 0..2 {
        single.train_step(&batch(s, 4, 16)).unwrap();
        sharded.train_step(&batch(s, 4, 16)).unwrap();
    }
    let export = |t: &mut MegatronTrainer| {
        let mut tensors = Vec::new();
        let mut buckets = 0;
        t.export_weights(64 << 10, &mut |bucket| {
            buckets += 1;
            tensors.extend(bucket.tensors);
            Ok(())
        })
        .unwrap();
        (tensors, buckets)
    };
    let (a, buckets) = export(&mut single);
    let (b, _) = export(&mut sharded);
    assert!(buckets > 1);
    assert_eq!(a.len(), b.len());
    let mut worst = 0.0f32;
    for (x, y) in a.iter().zip(&b) {
        assert_eq!((&x.name, &x.shape), (&y.name, &y.shape));
        for (p, q) in x.data.iter().zip(&y.data) {
            worst = worst.max((p - q).abs());
        }
    }
    // Two steps at lr 1e-3 differ by fp32 reordering only: 1e-5 absolute.
    assert!(worst < 1e-5, "worst weight difference {worst}");

    let dir = tempfile::tempdir().unwrap();
    sharded.save(dir.path()).unwrap();
    let next = sharded.train_step(&batch(9, 4, 16)).unwrap();
    let mut restored = trainer(options(2, 2));
    restored.load(dir.path()).unwrap();
    assert_eq!(restored.step(), 2);
    let again = restored.train_step(&batch(9, 4, 16)).unwrap();
    assert_eq!(again.loss.to_bits(), next.loss.to_bits());
    assert_eq!(again.grad_norm.to_bits(), next.grad_norm.to_bits());

    let (logprobs, loss) = restored.logprobs(&batch(3, 4, 16)).unwrap();
    assert_eq!(logprobs.len(), 64);
    assert!(logprobs.iter().all(|&l| l < 0.0) && loss.is_finite());
}

#[test]
fn a_checkpoint_saved_at_tp_2_dp_2_resumes_at_other_tensor_and_data_parallel_sizes() {
    let mut saved = trainer(options(2, 2));
    for s in 0..3 {
        saved.train_step(&batch(s, 4, 16)).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    saved.save(dir.path()).unwrap();
    let after = |t: &mut MegatronTrainer| -> Vec<f32> {
        (10..13)
            .map(|s| t.train_step(&batch(s, 4, 16)).unwrap().loss)
            .collect()
    };
    let reference = after(&mut saved);
    // Tolerance 1e-5 relative, as between layouts: the moments are re-sliced exactly, the
    // layouts only reorder fp32 sums.
    for (tp, dp) in [(1, 1), (2, 1), (1, 4)] {
        let mut t = trainer(options(tp, dp));
        t.load(dir.path()).unwrap();
        assert_eq!(t.step(), 3);
        let got = after(&mut t);
        let worst = worst_relative(&got, &reference);
        eprintln!("tp 2 x dp 2 -> tp {tp} x dp {dp}: worst relative loss difference {worst}");
        assert!(
            worst < 1e-5,
            "tp {tp} x dp {dp}: {got:?} vs {reference:?}, worst relative {worst}"
        );
    }
    // The moments matter: the same weights with fresh moments leave the tolerance.
    std::fs::remove_dir_all(dir.path().join("megatron")).unwrap();
    let mut fresh = trainer(options(1, 1));
    fresh.load(dir.path()).unwrap();
    let worst = worst_relative(&after(&mut fresh), &reference);
    eprintln!("weights alone: worst relative loss difference {worst}");
    assert!(worst > 1e-4, "fresh moments: worst relative {worst}");
}

#[test]
fn misuse_and_failures_are_clear_errors() {
    let mut t = trainer(options(2, 1));
    assert!(matches!(t.onload(), Err(BackendError::NotOffloaded)));
    t.offload().unwrap();
    let err = t.train_step(&batch(0, 2, 8)).unwrap_err();
    assert!(matches!(err, BackendError::Offloaded { .. }), "{err}");
    t.onload().unwrap();
    let err = t.train_step(&batch(0, 0, 8)).unwrap_err();
    assert!(matches!(err, BackendError::Batch(_)), "{err}");
    let mut bad_token = batch(0, 2, 8);
    bad_token.targets[11] = 259;
    let err = t.train_step(&bad_token).unwrap_err();
    assert!(err.to_string().contains("token id 259"), "{err}");
    t.train_step(&batch(0, 2, 8)).unwrap();

    let config = LlamaConfig::preset("tiny").unwrap();
    let params = init_weights(&config, 1).unwrap();
    let err = MegatronTrainer::new(config, &params, options(3, 1)).unwrap_err();
    assert!(err.to_string().contains("does not divide"), "{err}");

    // A disk that cannot take the files: the offload fails, the trainer stays usable.
    let dir = tempfile::tempdir().unwrap();
    let mut t = trainer(MegatronOptions {
        offload: TrainOffload::Disk {
            dir: dir.path().to_path_buf(),
            chunk_bytes: 64 << 10,
            host_budget_bytes: 0,
        },
        ..options(1, 1)
    });
    let rank_dir = dir.path().join("offload").join("rank-0");
    std::fs::remove_dir_all(&rank_dir).unwrap();
    std::fs::write(&rank_dir, b"not a directory").unwrap();
    let err = t.offload().unwrap_err();
    assert!(matches!(err, BackendError::Memory(_)), "{err}");
    assert!(!t.is_offloaded());
    t.train_step(&batch(5, 2, 8)).unwrap();
}

#[test]
fn a_corrupted_optimizer_bucket_on_disk_fails_the_step_naming_the_checksum() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = trainer(MegatronOptions {
        stream_optimizer: Some(OptimizerStream {
            dtype: MomentDtype::Fp32,
            master_weights: false,
            dir: dir.path().to_path_buf(),
            bucket_bytes: 16 << 10,
            host_budget_bytes: 0,
        }),
        ..options(1, 2)
    });
    t.train_step(&batch(0, 2, 8)).unwrap();
    let data = dir
        .path()
        .join("offload/rank-1/named-optimizer-bucket-00001/data.bin");
    let mut bytes = std::fs::read(&data).unwrap();
    bytes[100] ^= 0x40;
    std::fs::write(&data, bytes).unwrap();
    let err = t.train_step(&batch(1, 2, 8)).unwrap_err();
    assert!(matches!(err, BackendError::Store(_)), "{err}");
    assert!(err.to_string().contains("checksum mismatch"), "{err}");
}
