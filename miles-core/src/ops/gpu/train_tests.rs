//! Training kernels' tests: each against the CPU implementation (`crate::ops`) on seeded random
//! inputs rounded to bf16, within the tolerance each states. On a GPU machine:
//! `MILES_TEST_DEVICE=cuda cargo test -p miles-core compute -- --test-threads=1`; elsewhere they
//! skip.

use half::bf16;

use super::testing::{TestGpu, assert_close};
use super::{AdamWStep, COLUMN_SUM_CHUNKS, GpuMoments, GradWrite, SQUARE_PARTIALS};
use crate::device::DeviceError;
use crate::ops::testing::seeded_vec as seeded;
use crate::ops::{
    AdamWConfig, RopeTable, adamw_update, clip_scale, crossentropy_backward, crossentropy_forward,
    embedding_backward, embedding_rows, global_grad_norm, rmsnorm_backward, rmsnorm_forward,
    rope_backward, swiglu_backward,
};

/// One bf16 rounding of a result computed in fp32 (at most 2^-8, 0.39%, of its size) plus fp32
/// summation order: 1% of the value's size.
const BF16_TOLERANCE: f32 = 1e-2;

/// A chain of up to four bf16 roundings (2^-8 each) through fp32 arithmetic: 2%.
const BF16_CHAIN_TOLERANCE: f32 = 2e-2;

/// Each test's arena: every tensor here is well under a MiB.
const ARENA: usize = 64 << 20;

fn ok<T>(result: Result<T, DeviceError>) -> T {
    result.unwrap_or_else(|e| panic!("{e}"))
}

/// `values` times `factor`.
fn scaled(values: Vec<f32>, factor: f32) -> Vec<f32> {
    values.into_iter().map(|v| v * factor).collect()
}

/// Checks `|got - want| <= rel * max(|want|, floor)` elementwise (through [`assert_close`], so
/// the worst difference is printed and NaN never passes): for probabilities and loss gradients,
/// whose small values an absolute floor of 1 would wave through.
fn assert_close_relative(what: &str, got: &[f32], want: &[f32], rel: f32, floor: f32) {
    let unit = |x: f32, w: f32| x / w.abs().max(floor);
    let got: Vec<f32> = got.iter().zip(want).map(|(&g, &w)| unit(g, w)).collect();
    let want: Vec<f32> = want.iter().map(|&w| unit(w, w)).collect();
    assert_close(what, &got, &want, rel);
}

#[test]
fn gpu_rmsnorm_backward_adds_the_cpu_gradients_and_repeats_bit_for_bit() {
    let Some(mut t) = TestGpu::open(
        "gpu_rmsnorm_backward_adds_the_cpu_gradients_and_repeats_bit_for_bit",
        ARENA,
    ) else {
        return;
    };
    // 320 columns, 8 at a time, more than a block's 256 threads; 100 columns one at a time.
    for (rows, c) in [(37, 320), (9, 100)] {
        rmsnorm_backward_case(&mut t, rows, c);
    }
}

fn rmsnorm_backward_case(t: &mut TestGpu, rows: usize, c: usize) {
    let (x, x_host) = t.put_bf16(&seeded(21, rows * c));
    let (w, w_host) = t.put_bf16(&seeded(22, c));
    let (dout, dout_host) = t.put_bf16(&seeded(23, rows * c));
    let (dx, mut want_dx) = t.put_bf16(&seeded(24, rows * c));
    let mut want_dw = seeded(25, c);
    let dw = t.put(&want_dw);
    let (mut normed, mut rstd_host) = (vec![0.0; rows * c], vec![0.0; rows]);
    rmsnorm_forward(&mut normed, &mut rstd_host, &x_host, &w_host, 1e-5);
    let rstd = t.put(&rstd_host);
    let partials = t.alloc::<f32>(COLUMN_SUM_CHUNKS * c);
    let (dx_again, dw_again) = (t.put_bf16(&want_dx).0, t.put(&want_dw));
    ok(t.gpu
        .rmsnorm_backward(dx, dw, dout, x, w, rstd, partials, GradWrite::Add));
    ok(t.gpu.rmsnorm_backward(
        dx_again,
        dw_again,
        dout,
        x,
        w,
        rstd,
        partials,
        GradWrite::Add,
    ));
    rmsnorm_backward(
        &mut want_dx,
        &mut want_dw,
        &dout_host,
        &x_host,
        &w_host,
        &rstd_host,
    );
    assert_close("rmsnorm dx (+=)", &t.get_bf16(dx), &want_dx, BF16_TOLERANCE);
    // fp32 sums of 37 rows in another order.
    assert_close("rmsnorm dw (+=)", &t.get(dw), &want_dw, 1e-4);
    let bits = |x: Vec<f32>| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(t.get(dw_again)),
        bits(t.get(dw)),
        "dw repeats bit for bit ({c} columns)"
    );
    assert_eq!(
        bits(t.get_bf16(dx_again)),
        bits(t.get_bf16(dx)),
        "dx repeats bit for bit ({c} columns)"
    );
}

#[test]
fn gpu_rope_backward_rotates_back_as_the_cpu_does() {
    let Some(mut t) = TestGpu::open("gpu_rope_backward_rotates_back_as_the_cpu_does", ARENA) else {
        return;
    };
    // 96 pairs a row, fewer than a block's threads; 640, more.
    for (n, heads, d) in [(29, 3, 64), (7, 10, 128)] {
        rope_backward_case(&mut t, n, heads, d);
    }
}

fn rope_backward_case(t: &mut TestGpu, n: usize, heads: usize, d: usize) {
    let table = RopeTable::new(d, 10000.0, 128);
    let positions: Vec<u32> = (0..n as u32).map(|i| (i * 7 + 3) % 128).collect();
    let host_positions: Vec<usize> = positions.iter().map(|&p| p as usize).collect();
    let pos = t.put(&positions);
    let (cos, sin) = (t.put(table.cos()), t.put(table.sin()));

    let (dx, mut want) = t.put_bf16(&seeded(26, n * heads * d));
    ok(t.gpu.rope_backward(dx, pos, cos, sin, heads, d));
    rope_backward(&mut want, &host_positions, heads, &table);
    assert_close("rope backward", &t.get_bf16(dx), &want, BF16_TOLERANCE);

    // Forward then backward is the identity, up to two bf16 roundings, the second of a pair's
    // rotated (rounded) values.
    let (x, x_host) = t.put_bf16(&seeded(27, n * heads * d));
    ok(t.gpu.rope_forward(x, pos, cos, sin, heads, d));
    ok(t.gpu.rope_backward(x, pos, cos, sin, heads, d));
    assert_close(
        "rope round trip",
        &t.get_bf16(x),
        &x_host,
        BF16_CHAIN_TOLERANCE,
    );
}

#[test]
fn gpu_swiglu_backward_leaves_the_cpu_gradients_and_the_forward_output_in_place() {
    let Some(mut t) = TestGpu::open(
        "gpu_swiglu_backward_leaves_the_cpu_gradients_and_the_forward_output_in_place",
        ARENA,
    ) else {
        return;
    };
    // 1500 values one at a time, 1504 eight at a time.
    for len in [1500, 1504] {
        swiglu_backward_case(&mut t, len);
    }
}

fn swiglu_backward_case(t: &mut TestGpu, len: usize) {
    let (gate, gate_host) = t.put_bf16(&scaled(seeded(28, len), 4.0));
    let (up, up_host) = t.put_bf16(&seeded(29, len));
    let (dout, dout_host) = t.put_bf16(&seeded(30, len));
    let forward = t.alloc::<bf16>(len);
    ok(t.gpu.swiglu_forward(forward, gate, up));
    ok(t.gpu.swiglu_backward(gate, up, dout));
    let (mut want_dgate, mut want_dup) = (vec![0.0; len], vec![0.0; len]);
    swiglu_backward(
        &mut want_dgate,
        &mut want_dup,
        &dout_host,
        &gate_host,
        &up_host,
    );
    assert_close(
        "swiglu dgate",
        &t.get_bf16(gate),
        &want_dgate,
        BF16_TOLERANCE,
    );
    assert_close("swiglu dup", &t.get_bf16(up), &want_dup, BF16_TOLERANCE);
    assert_eq!(
        t.get(dout),
        t.get(forward),
        "the recomputed swiglu output has the forward pass's bits ({len} values)"
    );
}

#[test]
fn gpu_embedding_backward_adds_every_row_of_repeated_ids_and_repeats_bit_for_bit() {
    let Some(mut t) = TestGpu::open(
        "gpu_embedding_backward_adds_every_row_of_repeated_ids_and_repeats_bit_for_bit",
        ARENA,
    ) else {
        return;
    };
    let (vocab, c, n) = (50, 300, 40);
    // 40 rows over 17 ids: most ids come two or three times.
    let ids: Vec<u32> = (0..n as u32).map(|i| (i * 13) % 17).collect();
    let mut want = seeded(33, vocab * c);
    let dtable = t.put(&want);
    let (dout, dout_host) = t.put_bf16(&seeded(34, n * c));
    let ids_dev = t.put(&ids);
    let (order_host, starts_host) = embedding_rows(&ids);
    let (order, starts) = (t.put(&order_host), t.put(&starts_host));
    let again = t.put(&want);
    ok(t.gpu
        .embedding_backward(dtable, dout, ids_dev, order, starts, c));
    ok(t.gpu
        .embedding_backward(again, dout, ids_dev, order, starts, c));
    embedding_backward(&mut want, &dout_host, &ids, c);
    // At most three fp32 additions per value, in another order.
    assert_close("embedding dtable (+=)", &t.get(dtable), &want, 1e-6);
    let bits = |x: Vec<f32>| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(t.get(again)),
        bits(t.get(dtable)),
        "repeats bit for bit"
    );
    let short = t.put(&order_host[1..]);
    assert!(matches!(
        t.gpu
            .embedding_backward(dtable, dout, ids_dev, short, starts, c),
        Err(DeviceError::ShapeMismatch { .. })
    ));
}

#[test]
fn gpu_crossentropy_matches_the_cpu_logprobs_and_gradients() {
    let Some(mut t) = TestGpu::open(
        "gpu_crossentropy_matches_the_cpu_logprobs_and_gradients",
        ARENA,
    ) else {
        return;
    };
    // 1003 logits a row one at a time, 1000 four at a time.
    for v in [1003, 1000] {
        crossentropy_case(&mut t, 13, v);
    }
}

fn crossentropy_case(t: &mut TestGpu, n: usize, v: usize) {
    let logits_host = scaled(seeded(45, n * v), 8.0);
    let targets_host: Vec<u32> = (0..n as u32).map(|i| (i * 379 + 11) % v as u32).collect();
    let mut weights_host: Vec<f32> = seeded(46, n).iter().map(|w| w.abs() + 0.1).collect();
    weights_host[4] = 0.0; // a masked token: a log-prob, no gradient
    let normaliser = 7.5;
    let (logits, targets, weights) = (
        t.put(&logits_host),
        t.put(&targets_host),
        t.put(&weights_host),
    );
    let logprobs = t.alloc::<f32>(n);
    let (dlogits, _) = t.put_bf16(&seeded(47, n * v)); // stale values
    ok(t.gpu.crossentropy(
        logprobs,
        Some(dlogits),
        logits,
        targets,
        weights,
        normaliser,
    ));
    let (mut probs, mut want_lp) = (vec![0.0; n * v], vec![0.0; n]);
    crossentropy_forward(
        &mut probs,
        &mut want_lp,
        &mut vec![0.0; n],
        &logits_host,
        &targets_host,
        &weights_host,
        normaliser,
    );
    let mut want_d = vec![0.0; n * v];
    crossentropy_backward(
        &mut want_d,
        &probs,
        &targets_host,
        &weights_host,
        normaliser,
    );
    // Log-probs near -10: fp32 sums of 1003 exponentials in another order.
    assert_close("crossentropy logprobs", &t.get(logprobs), &want_lp, 1e-5);
    assert_close_relative(
        "crossentropy dlogits",
        &t.get_bf16(dlogits),
        &want_d,
        BF16_TOLERANCE,
        1e-30,
    );

    // Without dlogits: the same log-probs.
    let logprobs_only = t.alloc::<f32>(n);
    ok(t.gpu
        .crossentropy(logprobs_only, None, logits, targets, weights, normaliser));
    assert_close(
        "crossentropy logprobs without gradients",
        &t.get(logprobs_only),
        &want_lp,
        1e-5,
    );
}

#[test]
fn gpu_crossentropy_turns_a_nan_logit_or_a_bad_target_into_nan() {
    let Some(mut t) = TestGpu::open(
        "gpu_crossentropy_turns_a_nan_logit_or_a_bad_target_into_nan",
        ARENA,
    ) else {
        return;
    };
    let (n, v) = (4, 300);
    let mut logits_host = scaled(seeded(48, n * v), 4.0);
    logits_host[v + 7] = f32::NAN; // row 1
    let targets_host: Vec<u32> = vec![3, 250, 17, v as u32]; // row 3 past the vocabulary
    let weights_host = vec![1.0; n];
    let (logits, targets, weights) = (
        t.put(&logits_host),
        t.put(&targets_host),
        t.put(&weights_host),
    );
    let logprobs = t.alloc::<f32>(n);
    let dlogits = t.alloc::<bf16>(n * v);
    ok(t.gpu
        .crossentropy(logprobs, Some(dlogits), logits, targets, weights, 2.0));
    let (lp, d) = (t.get(logprobs), t.get_bf16(dlogits));
    for bad in [1, 3] {
        assert!(
            lp[bad].is_nan(),
            "row {bad}: log-prob {} is not NaN",
            lp[bad]
        );
        assert!(
            d[bad * v..(bad + 1) * v].iter().all(|x| x.is_nan()),
            "row {bad}: a gradient is not NaN"
        );
    }
    // Rows 0 and 2 are untouched by the others' NaN.
    let good = [0, 2];
    let good_logits: Vec<f32> = good
        .iter()
        .flat_map(|&r| logits_host[r * v..(r + 1) * v].to_vec())
        .collect();
    let good_targets: Vec<u32> = good.iter().map(|&r| targets_host[r]).collect();
    let (mut probs, mut want_lp) = (vec![0.0; 2 * v], vec![0.0; 2]);
    crossentropy_forward(
        &mut probs,
        &mut want_lp,
        &mut [0.0; 2],
        &good_logits,
        &good_targets,
        &[1.0, 1.0],
        2.0,
    );
    let mut want_d = vec![0.0; 2 * v];
    crossentropy_backward(&mut want_d, &probs, &good_targets, &[1.0, 1.0], 2.0);
    let got_lp: Vec<f32> = good.iter().map(|&r| lp[r]).collect();
    let got_d: Vec<f32> = good
        .iter()
        .flat_map(|&r| d[r * v..(r + 1) * v].to_vec())
        .collect();
    assert_close("crossentropy good rows' logprobs", &got_lp, &want_lp, 1e-5);
    assert_close_relative(
        "crossentropy good rows' dlogits",
        &got_d,
        &want_d,
        BF16_TOLERANCE,
        1e-30,
    );
}

#[test]
fn gpu_sum_of_squares_adds_the_squared_global_norm_and_repeats_bit_for_bit() {
    let Some(mut t) = TestGpu::open(
        "gpu_sum_of_squares_adds_the_squared_global_norm_and_repeats_bit_for_bit",
        ARENA,
    ) else {
        return;
    };
    let n = 300_001;
    let mut x_host = seeded(49, n);
    let x = t.put(&x_host);
    let start = 2.5f32;
    let (acc, again) = (t.put(&[start]), t.put(&[start]));
    let partials = t.alloc::<f32>(SQUARE_PARTIALS);
    ok(t.gpu.sum_of_squares(acc, x, partials));
    ok(t.gpu.sum_of_squares(again, x, partials));
    let norm = f64::from(global_grad_norm(&x_host));
    let want = (f64::from(start) + norm * norm) as f32;
    // 1024 block partials of about 300 squares each, summed in a tree: a total near 1e5.
    assert_close("sum of squares (+=)", &t.get(acc), &[want], 1e-4);
    assert_eq!(t.get(again)[0].to_bits(), t.get(acc)[0].to_bits());
    let short = t.alloc::<f32>(SQUARE_PARTIALS - 1);
    assert!(matches!(
        t.gpu.sum_of_squares(acc, x, short),
        Err(DeviceError::ShapeMismatch { .. })
    ));

    // A NaN gradient shows in the norm, never clipped away.
    x_host[123_457] = f32::NAN;
    ok(t.gpu.upload(x, &x_host));
    ok(t.gpu.upload(acc, &[0.0]));
    ok(t.gpu.sum_of_squares(acc, x, partials));
    let got = t.get(acc)[0];
    assert!(
        got.is_nan(),
        "a NaN gradient gave a sum of squares of {got}"
    );
}

#[test]
fn gpu_adamw_three_steps_match_the_cpu_with_clipping_and_weight_decay() {
    let Some(mut t) = TestGpu::open(
        "gpu_adamw_three_steps_match_the_cpu_with_clipping_and_weight_decay",
        ARENA,
    ) else {
        return;
    };
    let cfg = AdamWConfig {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        max_grad_norm: Some(30.0),
    };
    // Four elements a thread on aligned buffers; one at a time from an odd start, with a tail.
    for (offset, n) in [(0, 5000), (1, 4999)] {
        // A state some steps in: moments not zero.
        let mut master_host = seeded(50, n);
        let mut m_host = scaled(seeded(51, n), 0.1);
        let mut v_host: Vec<f32> = seeded(52, n).iter().map(|x| x * x * 0.01).collect();
        let shifted = |t: &mut TestGpu, host: &[f32]| {
            let mut padded = vec![0.0; offset];
            padded.extend_from_slice(host);
            t.put(&padded).sub(offset, n).unwrap()
        };
        let (master, m, v) = (
            shifted(&mut t, &master_host),
            shifted(&mut t, &m_host),
            shifted(&mut t, &v_host),
        );
        let params = t.alloc::<bf16>(n + offset).sub(offset, n).unwrap();
        let grads = t.alloc::<f32>(n + offset).sub(offset, n).unwrap();
        // Gradient norms near 41, 20 and 82 against a clip of 30: clipped, not, clipped.
        for (step, size) in [(1u64, 1.0f32), (2, 0.5), (3, 2.0)] {
            let g = scaled(seeded(52 + step, n), size);
            ok(t.gpu.upload(grads, &g));
            let scale = clip_scale(&cfg, global_grad_norm(&g));
            adamw_update(
                &mut master_host,
                &g,
                &mut m_host,
                &mut v_host,
                step,
                &cfg,
                scale,
            );
            ok(t.gpu.adamw_update(
                master,
                params,
                GpuMoments::Fp32(m, v),
                grads,
                AdamWStep::new(&cfg, step, scale),
            ));
            // The kernel does the CPU's fp32 operations in the CPU's order, unfused, so it should
            // agree to the bit; 1e-6 (of max(1, |value|) for the weights and the first moment,
            // which may cancel; of the value for the second moment, a sum of positives) allows a
            // few ulps.
            let what = |x: &str| format!("adamw step {step} {x} (from element {offset})");
            assert_close(&what("master"), &t.get(master), &master_host, 1e-6);
            assert_close(&what("m"), &t.get(m), &m_host, 1e-6);
            assert_close_relative(&what("v"), &t.get(v), &v_host, 1e-6, 1e-30);
            // One bf16 rounding of the master weights: at most 2^-8 (0.39%) of each.
            assert_close_relative(
                &what("bf16 params"),
                &t.get_bf16(params),
                &master_host,
                5e-3,
                1e-30,
            );
        }
    }
}
