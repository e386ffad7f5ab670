//! The training attention's tests: forward and backward against the CPU attention
//! (`crate::ops`) on bf16-rounded inputs, the backward against a float64 reference, repeats bit
//! for bit, and its refusals. On a GPU machine: `MILES_TEST_DEVICE=cuda cargo test -p
//! miles-core flash`; elsewhere they skip (`ops::gpu::tests` runs the kernels on the CPU through
//! `bench/attention_emu/check.py`).

use half::bf16;

use super::testing::{TestGpu, assert_close};
use crate::device::{DeviceError, GpuSlice};
use crate::ops::testing::seeded_vec as seeded;
use crate::ops::{AttentionShape, attention_backward, attention_forward};

const ARENA: usize = 64 << 20;

/// bf16 probabilities through fp32 products, each result rounded to bf16 (and dk, dv summed
/// over a query group in fp32 before their one rounding): 2%.
const BF16_CHAIN_TOLERANCE: f32 = 2e-2;

fn shape(batch: usize, seq: usize, heads: usize, kv_heads: usize, d: usize) -> AttentionShape {
    AttentionShape {
        batch,
        seq,
        heads,
        kv_heads,
        head_dim: d,
    }
}

/// One test's tensors: inputs as bf16-rounded host values, and the device slices.
struct Case {
    s: AttentionShape,
    host: [Vec<f32>; 4], // q, k, v, dout
    dev: [GpuSlice<bf16>; 4],
}

impl Case {
    /// Seeded inputs (queries scaled by 3 for a peaked softmax), each slice starting `skew`
    /// elements past an aligned address (1 takes the kernels' unaligned path).
    fn new(t: &mut TestGpu, s: AttentionShape, seed: u64, skew: usize) -> Case {
        let n = s.batch * s.seq;
        let (qd, kvd) = (n * s.heads * s.head_dim, n * s.kv_heads * s.head_dim);
        let mut put = |values: Vec<f32>| {
            let rounded: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
            let slice = t
                .alloc::<bf16>(values.len() + skew)
                .sub(skew, values.len())
                .unwrap_or_else(|e| panic!("{e}"));
            t.gpu
                .upload(slice, &rounded)
                .unwrap_or_else(|e| panic!("{e}"));
            (
                slice,
                rounded.iter().map(|v| v.to_f32()).collect::<Vec<_>>(),
            )
        };
        let q = put(seeded(seed, qd).into_iter().map(|x| 3.0 * x).collect());
        let k = put(seeded(seed + 1, kvd));
        let v = put(seeded(seed + 2, kvd));
        let dout = put(seeded(seed + 3, qd));
        Case {
            s,
            host: [q.1, k.1, v.1, dout.1],
            dev: [q.0, k.0, v.0, dout.0],
        }
    }

    /// The forward pass's output and log-sum-exp, then the backward's dq, dk, dv.
    fn run(&self, t: &mut TestGpu) -> [Vec<f32>; 5] {
        let s = self.s;
        let n = s.batch * s.seq;
        let (qd, kvd) = (n * s.heads * s.head_dim, n * s.kv_heads * s.head_dim);
        let [q, k, v, dout] = self.dev;
        let (out, lse, delta) = (
            t.alloc::<bf16>(qd),
            t.alloc::<f32>(s.batch * s.heads * s.seq),
            t.alloc::<f32>(s.batch * s.heads * s.seq),
        );
        let (dq, dk, dv) = (t.alloc::<bf16>(qd), t.alloc(kvd), t.alloc(kvd));
        let partials = t.alloc::<f32>(2 * qd);
        ok(t.gpu.flash_attention_forward(out, lse, [q, k, v], s));
        ok(t.gpu.flash_attention_backward(
            [dq, dk, dv],
            [delta, partials],
            [q, k, v],
            out,
            dout,
            lse,
            s,
        ));
        [
            t.get_bf16(out),
            t.get(lse),
            t.get_bf16(dq),
            t.get_bf16(dk),
            t.get_bf16(dv),
        ]
    }
}

fn ok<T>(result: Result<T, DeviceError>) -> T {
    result.unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn gpu_flash_attention_matches_the_cpu_forward_and_backward_over_tiles_groups_and_head_dims() {
    let Some(mut t) = TestGpu::open(
        "gpu_flash_attention_matches_the_cpu_forward_and_backward_over_tiles_groups_and_head_dims",
        ARENA,
    ) else {
        return;
    };
    // (shape, skew): one tile with padding; five tiles; a head dim below 16 read one value at
    // a time; 40 padded to 64; 128; a group of 6; a single position; unaligned rows.
    let cases = [
        (shape(2, 37, 4, 2, 64), 0),
        (shape(1, 300, 4, 1, 64), 0),
        (shape(2, 70, 4, 2, 12), 0),
        (shape(1, 129, 2, 2, 40), 0),
        (shape(1, 130, 2, 1, 128), 0),
        (shape(1, 64, 6, 1, 32), 0),
        (shape(3, 1, 2, 2, 64), 0),
        (shape(1, 100, 4, 2, 64), 1),
    ];
    for (i, (s, skew)) in cases.into_iter().enumerate() {
        let case = Case::new(&mut t, s, 70 + 4 * i as u64, skew);
        let [out, lse, dq, dk, dv] = case.run(&mut t);
        let [q, k, v, dout] = &case.host;
        let n = s.batch * s.seq;
        let (qd, kvd) = (n * s.heads * s.head_dim, n * s.kv_heads * s.head_dim);
        let (mut want_out, mut att) = (vec![0.0; qd], vec![0.0; n * s.heads * s.seq]);
        attention_forward(&mut want_out, &mut att, q, k, v, s).unwrap_or_else(|e| panic!("{e}"));
        let what = |x: &str| format!("{x} of {s:?} skew {skew}");
        assert_close(&what("output"), &out, &want_out, BF16_CHAIN_TOLERANCE);
        assert!(lse.iter().all(|x| x.is_finite()), "{}", what("lse"));
        let (mut want_dq, mut want_dk, mut want_dv) =
            (vec![0.0; qd], vec![0.0; kvd], vec![0.0; kvd]);
        let mut datt = vec![0.0; att.len()];
        attention_backward(
            &mut want_dq,
            &mut want_dk,
            &mut want_dv,
            &mut datt,
            dout,
            q,
            k,
            v,
            &att,
            s,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_close(&what("dq"), &dq, &want_dq, BF16_CHAIN_TOLERANCE);
        assert_close(&what("dk"), &dk, &want_dk, BF16_CHAIN_TOLERANCE);
        assert_close(&what("dv"), &dv, &want_dv, BF16_CHAIN_TOLERANCE);
    }
}

/// Causal attention and its gradients in float64, the plain way: `[out, dq, dk, dv]`.
fn float64_attention(s: AttentionShape, [q, k, v, dout]: &[Vec<f32>; 4]) -> [Vec<f64>; 4] {
    let (t, d, heads, kvh) = (s.seq, s.head_dim, s.heads, s.kv_heads);
    let scale = 1.0 / (d as f64).sqrt();
    let qi = |b: usize, i: usize, h: usize| ((b * t + i) * heads + h) * d;
    let ki = |b: usize, j: usize, g: usize| ((b * t + j) * kvh + g) * d;
    let dot = |x: &[f32], xa: usize, y: &[f32], ya: usize| {
        (0..d)
            .map(|c| f64::from(x[xa + c]) * f64::from(y[ya + c]))
            .sum::<f64>()
    };
    let mut out = vec![0.0; q.len()];
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; k.len()]);
    for b in 0..s.batch {
        for h in 0..heads {
            let g = h / (heads / kvh);
            for i in 0..t {
                let scores: Vec<f64> = (0..=i)
                    .map(|j| scale * dot(q, qi(b, i, h), k, ki(b, j, g)))
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = scores.iter().map(|x| (x - max).exp()).sum();
                let p: Vec<f64> = scores.iter().map(|x| (x - max).exp() / sum).collect();
                let dp: Vec<f64> = (0..=i)
                    .map(|j| dot(dout, qi(b, i, h), v, ki(b, j, g)))
                    .collect();
                let delta: f64 = p.iter().zip(&dp).map(|(p, dp)| p * dp).sum();
                for j in 0..=i {
                    let ds = p[j] * (dp[j] - delta);
                    for c in 0..d {
                        out[qi(b, i, h) + c] += p[j] * f64::from(v[ki(b, j, g) + c]);
                        dq[qi(b, i, h) + c] += scale * ds * f64::from(k[ki(b, j, g) + c]);
                        dk[ki(b, j, g) + c] += scale * ds * f64::from(q[qi(b, i, h) + c]);
                        dv[ki(b, j, g) + c] += p[j] * f64::from(dout[qi(b, i, h) + c]);
                    }
                }
            }
        }
    }
    [out, dq, dk, dv]
}

#[test]
fn gpu_flash_attention_backward_matches_a_float64_reference_on_small_shapes() {
    let Some(mut t) = TestGpu::open(
        "gpu_flash_attention_backward_matches_a_float64_reference_on_small_shapes",
        ARENA,
    ) else {
        return;
    };
    for (i, s) in [shape(1, 70, 2, 1, 16), shape(2, 20, 4, 2, 8)]
        .into_iter()
        .enumerate()
    {
        let case = Case::new(&mut t, s, 90 + 4 * i as u64, 0);
        let [out, _, dq, dk, dv] = case.run(&mut t);
        let want = float64_attention(s, &case.host);
        for (name, got, want) in [
            ("output", &out, &want[0]),
            ("dq", &dq, &want[1]),
            ("dk", &dk, &want[2]),
            ("dv", &dv, &want[3]),
        ] {
            // Within 2% of the tensor's largest value: the small gradients are not waved
            // through by a floor of 1.
            let top = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
            let worst = got
                .iter()
                .zip(want)
                .map(|(&g, w)| (f64::from(g) - w).abs())
                .fold(0.0f64, f64::max);
            eprintln!("{name} of {s:?}: worst {worst:.3e} of largest {top:.3e}");
            assert!(
                top > 0.0 && worst <= 2e-2 * top,
                "{name} of {s:?}: {worst} > 2% of {top}"
            );
        }
    }
}

#[test]
fn gpu_flash_attention_repeats_bit_for_bit() {
    let Some(mut t) = TestGpu::open("gpu_flash_attention_repeats_bit_for_bit", ARENA) else {
        return;
    };
    let case = Case::new(&mut t, shape(2, 200, 8, 2, 64), 110, 0);
    let bits =
        |runs: [Vec<f32>; 5]| runs.map(|x| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
    let first = bits(case.run(&mut t));
    let second = bits(case.run(&mut t));
    for (i, name) in ["output", "lse", "dq", "dk", "dv"].iter().enumerate() {
        assert_eq!(first[i], second[i], "{name} differs between two runs");
    }
}

#[test]
fn gpu_flash_attention_refuses_heads_that_do_not_group_and_a_head_dim_past_128() {
    let Some(mut t) = TestGpu::open(
        "gpu_flash_attention_refuses_heads_that_do_not_group_and_a_head_dim_past_128",
        ARENA,
    ) else {
        return;
    };
    for (s, field) in [
        (shape(1, 8, 3, 2, 16), "query heads"),
        (shape(1, 8, 2, 2, 136), "head dim"),
    ] {
        let n = s.seq * s.heads * s.head_dim;
        let x = t.alloc::<bf16>(n);
        let kv = t.alloc::<bf16>(s.seq * s.kv_heads * s.head_dim);
        let lse = t.alloc::<f32>(s.heads * s.seq);
        match t.gpu.flash_attention_forward(x, lse, [x, kv, kv], s) {
            Err(DeviceError::ShapeMismatch { what, .. }) => {
                assert!(what.contains(field), "{what} should name {field}")
            }
            other => panic!("{s:?}: {other:?}, want a shape mismatch naming {field}"),
        }
    }
}
