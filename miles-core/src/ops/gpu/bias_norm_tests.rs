//! Tests of the kernels of qwen2's q/k/v biases and qwen3's per-head q/k norms: each against the
//! CPU op (`crate::ops`) on seeded random inputs rounded to bf16, within the tolerance each
//! states, and the gradients' column sums repeating bit for bit. On a GPU machine:
//! `MILES_TEST_DEVICE=cuda cargo test -p miles-core ops::gpu -- --test-threads=1`; elsewhere
//! they skip.

use half::bf16;

use super::testing::{TestGpu, assert_close};
use super::{COLUMN_SUM_CHUNKS, GradWrite};
use crate::device::DeviceError;
use crate::ops::testing::seeded_vec as seeded;
use crate::ops::{bias_backward, bias_forward, rmsnorm_backward, rmsnorm_forward};

/// One bf16 rounding of a result computed in fp32 (at most 2^-8 of its size) plus fp32
/// summation order: 1% of the value's size.
const BF16_TOLERANCE: f32 = 1e-2;

/// fp32 sums of a few hundred terms in another order (and one bf16 product rounding of none:
/// the terms are products of bf16 inputs, exact in fp32 up to the last bit), relative to
/// `max(1, |sum|)`.
const SUM_TOLERANCE: f32 = 1e-4;

/// Each test's arena: every tensor here is well under a MiB.
const ARENA: usize = 64 << 20;

fn ok<T>(result: Result<T, DeviceError>) -> T {
    result.unwrap_or_else(|e| panic!("{e}"))
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn gpu_bias_add_adds_the_bias_to_every_row_as_the_cpu_does() {
    let Some(mut t) = TestGpu::open(
        "gpu_bias_add_adds_the_bias_to_every_row_as_the_cpu_does",
        ARENA,
    ) else {
        return;
    };
    // 300 columns: more than a block of the elementwise launch, not a multiple of it.
    let (rows, c) = (37, 300);
    let (x, mut want) = t.put_bf16(&seeded(101, rows * c));
    let (b, b_host) = t.put_bf16(&seeded(102, c));
    ok(t.gpu.bias_add(x, b));
    bias_forward(&mut want, &b_host);
    assert_close("bias add", &t.get_bf16(x), &want, BF16_TOLERANCE);
    let ragged = t.alloc::<bf16>(rows * c + 1);
    assert!(
        matches!(
            t.gpu.bias_add(ragged, b),
            Err(DeviceError::ShapeMismatch { .. })
        ),
        "an input that is not whole rows of the bias is refused"
    );
}

#[test]
fn gpu_per_head_rmsnorm_forward_matches_the_cpu_in_place_or_not() {
    let Some(mut t) = TestGpu::open(
        "gpu_per_head_rmsnorm_forward_matches_the_cpu_in_place_or_not",
        ARENA,
    ) else {
        return;
    };
    // 29 tokens of 3 heads of 24 channels: 87 rows of one head each.
    let (n, heads, d) = (29, 3, 24);
    let (x, x_host) = t.put_bf16(&seeded(103, n * heads * d));
    let (w, w_host) = t.put_bf16(&seeded(104, d));
    let out = t.alloc::<bf16>(n * heads * d);
    let rstd = t.alloc::<f32>(n * heads);
    ok(t.gpu.rmsnorm_forward(out, Some(rstd), x, w, 1e-6));
    let (mut want, mut want_rstd) = (vec![0.0; n * heads * d], vec![0.0; n * heads]);
    rmsnorm_forward(&mut want, &mut want_rstd, &x_host, &w_host, 1e-6);
    let normed = t.get_bf16(out);
    assert_close("per-head rmsnorm", &normed, &want, BF16_TOLERANCE);
    assert_close("per-head rmsnorm rstd", &t.get(rstd), &want_rstd, 1e-4);
    // In place (the engine norms q and k where they are): the same values, bit for bit.
    ok(t.gpu.rmsnorm_forward(x, None, x, w, 1e-6));
    assert_close("per-head rmsnorm in place", &t.get_bf16(x), &normed, 0.0);
}

#[test]
fn gpu_bias_backward_adds_the_cpu_column_sums_and_repeats_bit_for_bit() {
    let Some(mut t) = TestGpu::open(
        "gpu_bias_backward_adds_the_cpu_column_sums_and_repeats_bit_for_bit",
        ARENA,
    ) else {
        return;
    };
    // 300 rows (more than the chunks, not a multiple of them), 5 rows (fewer than the chunks)
    // and 1; 70 columns (not a multiple of a block's 32).
    let c = 70;
    let partials = t.alloc::<f32>(COLUMN_SUM_CHUNKS * c);
    for (rows, seed) in [(300, 105), (5, 107), (1, 109)] {
        let (dout, dout_host) = t.put_bf16(&seeded(seed, rows * c));
        let start = seeded(seed + 1, c);
        let (first, second) = (t.put(&start), t.put(&start));
        let written = t.put(&vec![f32::NAN; c]);
        ok(t.gpu.bias_backward(first, dout, partials, GradWrite::Add));
        ok(t.gpu.bias_backward(second, dout, partials, GradWrite::Add));
        ok(t.gpu
            .bias_backward(written, dout, partials, GradWrite::Overwrite));
        let mut want = start.clone();
        bias_backward(&mut want, &dout_host);
        let got = t.get(first);
        assert_close(
            &format!("bias backward over {rows} rows (+=)"),
            &got,
            &want,
            SUM_TOLERANCE,
        );
        let mut want_written = vec![0.0; c];
        bias_backward(&mut want_written, &dout_host);
        assert_close(
            &format!("bias backward over {rows} rows (=, over NaNs)"),
            &t.get(written),
            &want_written,
            SUM_TOLERANCE,
        );
        assert_eq!(
            bits(&got),
            bits(&t.get(second)),
            "bias backward over {rows} rows differs between two runs"
        );
    }
    // No rows: their sum is zero, written over what the gradient held or added to it.
    let (none, _) = t.put_bf16(&[]);
    let start = seeded(110, c);
    let (kept, written) = (t.put(&start), t.put(&start));
    ok(t.gpu.bias_backward(kept, none, partials, GradWrite::Add));
    ok(t.gpu
        .bias_backward(written, none, partials, GradWrite::Overwrite));
    assert_eq!(bits(&t.get(kept)), bits(&start), "no rows added nothing");
    assert_eq!(t.get(written), vec![0.0; c], "no rows wrote zeros");
    let (dout, _) = t.put_bf16(&seeded(111, 300 * c));
    let dbias = t.alloc::<f32>(c);
    let short = t.alloc::<f32>(COLUMN_SUM_CHUNKS * c - 1);
    assert!(
        matches!(
            t.gpu.bias_backward(dbias, dout, short, GradWrite::Add),
            Err(DeviceError::ShapeMismatch { .. })
        ),
        "partials smaller than COLUMN_SUM_CHUNKS x columns are refused"
    );
}

#[test]
fn gpu_per_head_rmsnorm_backward_matches_the_cpu_and_its_weight_gradient_repeats_bit_for_bit() {
    let Some(mut t) = TestGpu::open(
        "gpu_per_head_rmsnorm_backward_matches_the_cpu_and_its_weight_gradient_repeats",
        ARENA,
    ) else {
        return;
    };
    // 37 tokens of 4 heads of 48 channels: 148 rows of one head, more than the chunks.
    let (n, heads, d) = (37, 4, 48);
    let len = n * heads * d;
    let (x, x_host) = t.put_bf16(&seeded(112, len));
    let (w, w_host) = t.put_bf16(&seeded(113, d));
    let (dout, dout_host) = t.put_bf16(&seeded(114, len));
    let dx_start = seeded(115, len);
    let (dx, mut want_dx) = t.put_bf16(&dx_start);
    let (dx_again, _) = t.put_bf16(&dx_start);
    let dw_start = seeded(116, d);
    let (dw, dw_again) = (t.put(&dw_start), t.put(&dw_start));
    let (mut normed, mut rstd_host) = (vec![0.0; len], vec![0.0; n * heads]);
    rmsnorm_forward(&mut normed, &mut rstd_host, &x_host, &w_host, 1e-6);
    let rstd = t.put(&rstd_host);
    let partials = t.alloc::<f32>(COLUMN_SUM_CHUNKS * d);
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
    let mut want_dw = dw_start.clone();
    rmsnorm_backward(
        &mut want_dx,
        &mut want_dw,
        &dout_host,
        &x_host,
        &w_host,
        &rstd_host,
    );
    let (got_dx, got_dw) = (t.get_bf16(dx), t.get(dw));
    assert_close(
        "per-head rmsnorm dx (+=)",
        &got_dx,
        &want_dx,
        BF16_TOLERANCE,
    );
    // Sums of 148 products dout * x * rstd in another order.
    assert_close("per-head rmsnorm dw (+=)", &got_dw, &want_dw, SUM_TOLERANCE);
    assert_eq!(
        bits(&got_dw),
        bits(&t.get(dw_again)),
        "the norm weight gradient differs between two runs"
    );
    assert_close(
        "per-head rmsnorm dx again",
        &t.get_bf16(dx_again),
        &got_dx,
        0.0,
    );
}
