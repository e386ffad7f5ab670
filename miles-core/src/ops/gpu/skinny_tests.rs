//! Tests of the skinny products (`kernels/skinny.cu`): against a float64 product of the same
//! bf16 inputs at every row count up to the most, at one slice and at several, with column and
//! inner dimensions that are not whole tiles; the split sums against the plain kernels bit for
//! bit; and the shapes they refuse. On a GPU machine: `MILES_TEST_DEVICE=cuda cargo test -p
//! miles-core skinny -- --test-threads=1`; elsewhere they skip.

use half::bf16;

use super::testing::{TestGpu, assert_close};
use super::{SKINNY_MAX_ROWS, Skinny, SkinnyOut};
use crate::device::DeviceError;
use crate::ops::testing::seeded_vec as seeded;

/// fp32 sums of up to a few hundred products of bf16 values in another order than float64's,
/// relative to `max(1, |sum|)`.
const SUM_TOLERANCE: f32 = 1e-4;

/// One bf16 rounding on top of [`SUM_TOLERANCE`].
const BF16_TOLERANCE: f32 = 1e-2;

const ARENA: usize = 64 << 20;

fn ok<T>(result: Result<T, DeviceError>) -> T {
    result.unwrap_or_else(|e| panic!("{e}"))
}

/// `x (rows, inp) w^T` for `w (out, inp)`, summed in float64.
fn product(x: &[f32], w: &[f32], rows: usize, out: usize, inp: usize) -> Vec<f32> {
    let mut y = vec![0.0f32; rows * out];
    for r in 0..rows {
        for o in 0..out {
            let dot: f64 = (0..inp)
                .map(|k| f64::from(x[r * inp + k]) * f64::from(w[o * inp + k]))
                .sum();
            y[r * out + o] = dot as f32;
        }
    }
    y
}

#[test]
fn gpu_skinny_products_match_a_float64_product_at_every_slicing_and_row_count() {
    let test = "gpu_skinny_products_match_a_float64_product_at_every_slicing_and_row_count";
    let Some(mut t) = TestGpu::open(test, ARENA) else {
        return;
    };
    // 130 columns: two whole blocks of 64 and a part; inner 200: three tiles of 64 and a part.
    // 512 x 320: whole tiles, sliced up to 5 ways.
    for (out, inp) in [(130, 200), (512, 320)] {
        let (w, w_host) = t.put_bf16(&seeded(201, out * inp));
        for rows in [1, 5, 16, 33, 100, SKINNY_MAX_ROWS] {
            let (x, x_host) = t.put_bf16(&seeded(202 + rows as u64, rows * inp));
            let want = product(&x_host, &w_host, rows, out, inp);
            let what = |how: &str| format!("{rows} x {inp} times ({out}, {inp})^T, {how}");

            let whole = Skinny::with_splits(rows, out, inp, 1).unwrap();
            let logits = t.alloc::<f32>(rows * out);
            ok(t.gpu.skinny_gemm(whole, SkinnyOut::F32(logits), x, w));
            assert_close(&what("fp32"), &t.get(logits), &want, SUM_TOLERANCE);

            let (y, y_host) = t.put_bf16(&seeded(203, rows * out));
            let y_out = SkinnyOut::Bf16 {
                y,
                accumulate: true,
            };
            ok(t.gpu.skinny_gemm(whole, y_out, x, w));
            let added: Vec<f32> = want.iter().zip(&y_host).map(|(p, y)| p + y).collect();
            assert_close(
                &what("added to bf16"),
                &t.get_bf16(y),
                &added,
                BF16_TOLERANCE,
            );

            for splits in [2, 5] {
                let sliced = Skinny::with_splits(rows, out, inp, splits).unwrap();
                assert!(sliced.splits > 1, "{sliced:?}");
                let part = t.alloc::<f32>(sliced.partial_len());
                ok(t.gpu.skinny_gemm(sliced, SkinnyOut::Partials(part), x, w));
                let y = t.alloc::<bf16>(rows * out);
                ok(t.gpu.split_sum(y, part, sliced.splits, false));
                let how = format!("{} slices", sliced.splits);
                assert_close(&what(&how), &t.get_bf16(y), &want, BF16_TOLERANCE);
            }
        }
    }
}

#[test]
fn gpu_split_sum_rmsnorm_is_the_split_sum_then_rmsnorm_bit_for_bit_and_repeats() {
    let test = "gpu_split_sum_rmsnorm_is_the_split_sum_then_rmsnorm_bit_for_bit_and_repeats";
    let Some(mut t) = TestGpu::open(test, ARENA) else {
        return;
    };
    let (rows, c, inp) = (37, 320, 512);
    let (w, _) = t.put_bf16(&seeded(211, c * inp));
    let (x, _) = t.put_bf16(&seeded(212, rows * inp));
    let (norm, _) = t.put_bf16(&seeded(213, c));
    let residual = seeded(214, rows * c);
    let p = Skinny::plan(rows, c, inp, 132).unwrap();
    assert!(p.splits > 1, "{p:?}");
    let part = t.alloc::<f32>(p.partial_len());
    ok(t.gpu.skinny_gemm(p, SkinnyOut::Partials(part), x, w));

    let (plain, _) = t.put_bf16(&residual);
    let plain_ln = t.alloc::<bf16>(rows * c);
    ok(t.gpu.split_sum(plain, part, p.splits, true));
    ok(t.gpu.rmsnorm_forward(plain_ln, None, plain, norm, 1e-5));

    let mut runs = Vec::new();
    for _ in 0..2 {
        let (fused, _) = t.put_bf16(&residual);
        let fused_ln = t.alloc::<bf16>(rows * c);
        ok(t.gpu
            .split_sum_rmsnorm(fused, fused_ln, part, norm, p.splits, 1e-5));
        runs.push((t.get(fused), t.get(fused_ln)));
    }
    assert!(runs[0] == runs[1], "two runs gave different bits");
    assert!(runs[0].0 == t.get(plain), "the residual stream differs");
    assert!(runs[0].1 == t.get(plain_ln), "the norm differs");
}

#[test]
fn skinny_products_refuse_shapes_the_kernel_does_not_take() {
    assert_eq!(Skinny::plan(SKINNY_MAX_ROWS + 1, 64, 64, 132), None);
    assert_eq!(Skinny::plan(0, 64, 64, 132), None);
    assert_eq!(Skinny::plan(4, 63, 64, 132), None, "an odd column count");
    assert_eq!(
        Skinny::plan(4, 64, 60, 132),
        None,
        "inner not a multiple of 8"
    );
    // A narrow product over a long inner dimension is sliced, each slice at least 4 tiles;
    // a wide one is cuBLAS's.
    let narrow = Skinny::plan(128, 2048, 8192, 132).unwrap();
    assert_eq!(narrow.splits, 8);
    assert_eq!(Skinny::plan(128, 3072, 2048, 132).unwrap().splits, 6);
    assert_eq!(Skinny::plan(128, 16384, 2048, 132), None);
    assert_eq!(Skinny::plan(128, 2048, 256, 132).unwrap().splits, 1);
    assert_eq!(narrow.partial_len(), 8 * 128 * 2048);
    // Many SMs: at most SKINNY_MAX_SPLITS slices, within the bound whatever the GPU.
    for sms in [40, 132, 10_000] {
        let p = Skinny::plan(100, 2048, 8192, sms).unwrap();
        assert!(p.splits <= super::SKINNY_MAX_SPLITS, "{p:?}");
        assert!(p.partial_len() <= Skinny::partial_bound(100, 2048, 8192));
    }
}

#[test]
fn gpu_skinny_products_refuse_bad_operands() {
    let test = "gpu_skinny_products_refuse_bad_operands";
    let Some(mut t) = TestGpu::open(test, ARENA) else {
        return;
    };
    let (rows, out, inp) = (8, 128, 256);
    let x = t.alloc::<bf16>(rows * inp);
    let w = t.alloc::<bf16>(out * inp);
    let sliced = Skinny::with_splits(rows, out, inp, 2).unwrap();
    let y = t.alloc::<bf16>(rows * out);
    let refused = |r: Result<(), DeviceError>| matches!(r, Err(DeviceError::ShapeMismatch { .. }));
    let bf16_out = SkinnyOut::Bf16 {
        y,
        accumulate: false,
    };
    assert!(refused(t.gpu.skinny_gemm(sliced, bf16_out, x, w)));
    let short = t.alloc::<f32>(sliced.partial_len() - 1);
    assert!(refused(t.gpu.skinny_gemm(
        sliced,
        SkinnyOut::Partials(short),
        x,
        w
    )));
    let whole = Skinny::with_splits(rows, out, inp, 1).unwrap();
    assert!(refused(t.gpu.skinny_gemm(
        whole,
        bf16_out,
        x,
        ok(w.sub(0, out * inp - 1))
    )));
    let odd = ok(ok(t.alloc::<bf16>(rows * inp + 1).sub(1, rows * inp)).reinterpret::<bf16>());
    assert!(refused(t.gpu.skinny_gemm(whole, bf16_out, odd, w)));
}
