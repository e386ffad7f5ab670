//! Kernel tests: each against the CPU implementation (`crate::ops`) on seeded random inputs
//! rounded to bf16, within bf16 tolerance. On a GPU machine: `MILES_TEST_DEVICE=cuda cargo test
//! -p miles-core ops::gpu -- --test-threads=1`; elsewhere they skip, except the compile check,
//! which needs only NVRTC (`libnvrtc.so.13` on the library path), and the attention kernels'
//! run on the CPU, which needs g++.

use std::path::Path;
use std::process::Command;

use super::testing::{TestGpu, assert_close};
use super::*;
use half::bf16;

use crate::device::{DeviceError, Gemm, GpuSlice, Transpose, compile};
use crate::ops::testing::seeded_vec as seeded;
use crate::ops::{RopeTable, rmsnorm_forward, rope_forward, swiglu_forward};

/// bf16 rounding of one result plus fp32 accumulation order: 1% of the value's size.
const BF16_TOLERANCE: f32 = 1e-2;

#[test]
fn kernels_compile_with_nvrtc_for_hopper() {
    if let Err(why) = crate::device::probe::cudarc_library_ready("nvrtc") {
        eprintln!("skipping kernels_compile_with_nvrtc_for_hopper: {why}");
        return;
    }
    for program in [PROGRAM, HOPPER_PROGRAM] {
        let ptx = compile(&program).unwrap_or_else(|e| panic!("{e}"));
        let text = ptx.to_src();
        for name in program.kernels.iter().flat_map(|group| group.iter()) {
            assert!(
                text.contains(&format!(".entry {name}(")),
                "kernel {name} is missing from {}'s ptx",
                program.name
            );
        }
    }
}

/// The attention kernels (training's flash forward and backward, the engine's paged attention
/// and decode step) compiled for the CPU against an emulation of the instructions they use
/// (`bench/attention_emu/check.py`), against a float64 reference: their indices, masks, tiles,
/// sums and block tables checked where no GPU is. Skipped without python3 (and by check.py
/// without g++).
#[test]
fn attention_kernels_run_on_the_cpu_match_a_float64_reference() {
    let check = Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/attention_emu/check.py");
    let run = match Command::new("python3").arg(&check).output() {
        Ok(run) => run,
        Err(e) => {
            eprintln!(
                "skipped attention_kernels_run_on_the_cpu_match_a_float64_reference: python3: {e}"
            );
            return;
        }
    };
    let report = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{report}{}",
        String::from_utf8_lossy(&run.stderr)
    );
    eprintln!("{report}");
}

const TRANSPOSES: [(Transpose, Transpose); 4] = [
    (Transpose::No, Transpose::No),
    (Transpose::No, Transpose::Yes),
    (Transpose::Yes, Transpose::No),
    (Transpose::Yes, Transpose::Yes),
];

/// `alpha * op(a) op(b) + beta * c` of row-major host operands, as the single product `g` reads
/// them.
fn host_product(g: Gemm, a: &[f32], b: &[f32], c: &[f32]) -> Vec<f32> {
    host_product_over(g, a, b, c, 0..g.k)
}

/// As [`host_product`], the inner dimension only over `inner`.
fn host_product_over(
    g: Gemm,
    a: &[f32],
    b: &[f32],
    c: &[f32],
    inner: std::ops::Range<usize>,
) -> Vec<f32> {
    let (m, n, k) = (g.m, g.n, g.k);
    let at = |i: usize, p: usize| match g.a {
        Transpose::No => a[i * k + p],
        Transpose::Yes => a[p * m + i],
    };
    let bt = |p: usize, j: usize| match g.b {
        Transpose::No => b[p * n + j],
        Transpose::Yes => b[j * k + p],
    };
    (0..m * n)
        .map(|ij| {
            let dot: f32 = inner.clone().map(|p| at(ij / n, p) * bt(p, ij % n)).sum();
            g.alpha * dot + g.beta * c[ij]
        })
        .collect()
}

#[test]
fn gpu_gemm_matches_the_cpu_in_every_transpose() {
    let Some(mut t) = TestGpu::open("gpu_gemm_matches_the_cpu_in_every_transpose", 64 << 20) else {
        return;
    };
    let (m, n, k) = (67, 45, 129);
    for (ta, tb) in TRANSPOSES {
        let (a, a_host) = t.put_bf16(&seeded(1, m * k));
        let (b, b_host) = t.put_bf16(&seeded(2, k * n));
        let c = t.alloc::<f32>(m * n);
        let g = Gemm::new(m, n, k, ta, tb);
        t.gpu.gemm(g, c, a, b).unwrap_or_else(|e| panic!("{e}"));
        let want = host_product(g, &a_host, &b_host, &vec![0.0; m * n]);
        assert_close(&format!("gemm {ta:?} {tb:?}"), &t.get(c), &want, 1e-4);
    }
}

#[test]
fn gpu_gemm_split_along_k_gives_each_slice_s_product_in_every_transpose() {
    let Some(mut t) = TestGpu::open(
        "gpu_gemm_split_along_k_gives_each_slice_s_product_in_every_transpose",
        64 << 20,
    ) else {
        return;
    };
    let (m, n, k, parts) = (67, 45, 128, 4);
    for (ta, tb) in TRANSPOSES {
        let (a, a_host) = t.put_bf16(&seeded(1, m * k));
        let (b, b_host) = t.put_bf16(&seeded(2, k * n));
        let c = t.alloc::<f32>(parts * m * n);
        let g = Gemm::new(m, n, k, ta, tb).split_k(parts);
        t.gpu.gemm(g, c, a, b).unwrap_or_else(|e| panic!("{e}"));
        let got = t.get(c);
        let slice = k / parts;
        for (i, part) in got.chunks_exact(m * n).enumerate() {
            let zeros = vec![0.0; m * n];
            let want = host_product_over(g, &a_host, &b_host, &zeros, i * slice..(i + 1) * slice);
            assert_close(&format!("split {i} {ta:?} {tb:?}"), part, &want, 1e-4);
        }
    }
    // A split that does not divide k, or that would add into C, is refused by name.
    let (a, b, c) = (t.alloc(m * k), t.alloc(k * n), t.alloc::<f32>(3 * m * n));
    let plain = Gemm::new(m, n, k, Transpose::No, Transpose::Yes);
    for g in [plain.split_k(3), plain.accumulate().split_k(2)] {
        let refused = t.gpu.gemm(g, c, a, b);
        assert!(
            matches!(refused, Err(crate::device::DeviceError::ShapeMismatch { what, .. }) if what.contains("split of k")),
            "{refused:?}"
        );
    }
}

#[test]
fn gpu_cublaslt_algorithms_each_compute_the_cpu_product_in_every_transpose() {
    let Some(mut t) = TestGpu::open(
        "gpu_cublaslt_algorithms_each_compute_the_cpu_product_in_every_transpose",
        64 << 20,
    ) else {
        return;
    };
    let (m, n, k) = (67, 48, 136);
    for (ta, tb) in TRANSPOSES {
        let (a, a_host) = t.put_bf16(&seeded(1, m * k));
        let (b, b_host) = t.put_bf16(&seeded(2, k * n));
        let (c, c_host) = t.put_bf16(&seeded(3, m * n));
        let g = Gemm::new(m, n, k, ta, tb).scaled(0.5).accumulate();
        let want = host_product(g, &a_host, &b_host, &c_host);
        let algos = t
            .gpu
            .gemm_algorithms(g, c, a, b, 8)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(!algos.is_empty(), "no cublasLt algorithm for {ta:?} {tb:?}");
        for algo in &algos {
            let start: Vec<bf16> = c_host.iter().map(|&v| bf16::from_f32(v)).collect();
            t.gpu.upload(c, &start).unwrap_or_else(|e| panic!("{e}"));
            t.gpu
                .gemm_with(g, algo, c, a, b)
                .unwrap_or_else(|e| panic!("{}: {e}", algo.describe()));
            let what = format!("cublasLt {ta:?} {tb:?} [{}]", algo.describe());
            assert_close(&what, &t.get_bf16(c), &want, BF16_TOLERANCE);
        }
    }
    let (a, b, c) = (t.alloc(m * k), t.alloc(k * n), t.alloc::<f32>(m * n));
    let batched = Gemm::new(m, n, k, Transpose::No, Transpose::No).batched(2, 0, 0, 0);
    assert!(matches!(
        t.gpu.gemm_algorithms(batched, c, a, b, 4),
        Err(crate::device::DeviceError::ShapeMismatch { .. })
    ));
}

#[test]
fn gpu_batched_gemm_accumulates_into_bf16() {
    let Some(mut t) = TestGpu::open("gpu_batched_gemm_accumulates_into_bf16", 64 << 20) else {
        return;
    };
    let (batch, m, n, k) = (3, 16, 24, 40);
    let (a, a_host) = t.put_bf16(&seeded(3, batch * m * k));
    let (b, b_host) = t.put_bf16(&seeded(4, batch * k * n));
    let (c, c_host) = t.put_bf16(&seeded(5, batch * m * n));
    let g = Gemm::new(m, n, k, Transpose::No, Transpose::No)
        .scaled(0.5)
        .accumulate()
        .batched(batch, m * k, k * n, m * n);
    t.gpu.gemm(g, c, a, b).unwrap_or_else(|e| panic!("{e}"));
    let want: Vec<f32> = (0..batch * m * n)
        .map(|x| {
            let (z, i, j) = (x / (m * n), (x / n) % m, x % n);
            let dot: f32 = (0..k)
                .map(|p| a_host[z * m * k + i * k + p] * b_host[z * k * n + p * n + j])
                .sum();
            c_host[x] + 0.5 * dot
        })
        .collect();
    assert_close("batched gemm", &t.get_bf16(c), &want, BF16_TOLERANCE);
}

#[test]
fn gpu_rmsnorm_forward_matches_the_cpu() {
    let Some(mut t) = TestGpu::open("gpu_rmsnorm_forward_matches_the_cpu", 64 << 20) else {
        return;
    };
    // 320 and 2048 take the kernel's 8-at-a-time reads (2048 with every thread's values in
    // one read), 100 the one-at-a-time path.
    for (rows, c) in [(37, 320), (5, 2048), (7, 100)] {
        let (x, x_host) = t.put_bf16(&seeded(6, rows * c));
        let (w, w_host) = t.put_bf16(&seeded(7, c));
        let out = t.alloc::<bf16>(rows * c);
        let rstd = t.alloc::<f32>(rows);
        t.gpu
            .rmsnorm_forward(out, Some(rstd), x, w, 1e-5)
            .unwrap_or_else(|e| panic!("{e}"));
        let (mut want, mut want_rstd) = (vec![0.0; rows * c], vec![0.0; rows]);
        rmsnorm_forward(&mut want, &mut want_rstd, &x_host, &w_host, 1e-5);
        assert_close("rmsnorm out", &t.get_bf16(out), &want, BF16_TOLERANCE);
        assert_close("rmsnorm rstd", &t.get(rstd), &want_rstd, 1e-4);
    }
}

#[test]
fn gpu_residual_rmsnorm_adds_the_partials_once_then_norms_as_the_cpu() {
    let Some(mut t) = TestGpu::open(
        "gpu_residual_rmsnorm_adds_the_partials_once_then_norms_as_the_cpu",
        64 << 20,
    ) else {
        return;
    };
    // 320 to 4096: a word of the row a thread; 8208 (over 512 words): the threads loop over
    // the words; 100: one value at a time. 5 partials: more than one batch of loads.
    for (rows, c, parts) in [
        (37, 320, 2),
        (5, 2048, 4),
        (3, 4096, 5),
        (2, 8208, 2),
        (7, 100, 3),
        (3, 64, 1),
    ] {
        let (x, x_host) = t.put_bf16(&seeded(6, rows * c));
        let partials_host = seeded(8, parts * rows * c);
        let partials = t.put(&partials_host);
        let (w, w_host) = t.put_bf16(&seeded(7, c));
        let out = t.alloc::<bf16>(rows * c);
        t.gpu
            .residual_rmsnorm(out, x, partials, w, 1e-5)
            .unwrap_or_else(|e| panic!("{e}"));
        // The partials summed in order, added to x, rounded once: bit for bit.
        let summed: Vec<f32> = (0..rows * c)
            .map(|i| {
                let sum = (0..parts).fold(0.0f32, |acc, p| acc + partials_host[p * rows * c + i]);
                bf16::from_f32(sum + x_host[i]).to_f32()
            })
            .collect();
        assert_eq!(
            t.get_bf16(x),
            summed,
            "residual stream, {rows} x {c}, {parts} parts"
        );
        let (mut want, mut rstd) = (vec![0.0; rows * c], vec![0.0; rows]);
        rmsnorm_forward(&mut want, &mut rstd, &summed, &w_host, 1e-5);
        assert_close(
            "residual rmsnorm out",
            &t.get_bf16(out),
            &want,
            BF16_TOLERANCE,
        );
    }
    let (x, w, out) = (
        t.alloc::<bf16>(64),
        t.alloc::<bf16>(64),
        t.alloc::<bf16>(64),
    );
    let partials = t.alloc::<f32>(100);
    let refused = t.gpu.residual_rmsnorm(out, x, partials, w, 1e-5);
    assert!(
        matches!(refused, Err(crate::device::DeviceError::ShapeMismatch { what, .. }) if what.contains("partials")),
        "{refused:?}"
    );
}

#[test]
fn gpu_rope_swiglu_residual_and_embedding_match_the_cpu() {
    let Some(mut t) = TestGpu::open("gpu_rope_swiglu_residual_and_embedding", 64 << 20) else {
        return;
    };
    // 96 pairs a row, fewer than a block's threads; 640, more.
    for (n, heads, d) in [(29, 3, 64), (7, 10, 128)] {
        let table = RopeTable::new(d, 10000.0, 128);
        let positions: Vec<u32> = (0..n as u32).map(|i| (i * 7) % 128).collect();
        let (x, mut want) = t.put_bf16(&seeded(8, n * heads * d));
        let pos = t.put(&positions);
        let (cos, sin) = (t.put(table.cos()), t.put(table.sin()));
        t.gpu
            .rope_forward(x, pos, cos, sin, heads, d)
            .unwrap_or_else(|e| panic!("{e}"));
        let host_positions: Vec<usize> = positions.iter().map(|&p| p as usize).collect();
        rope_forward(&mut want, &host_positions, heads, &table);
        assert_close("rope", &t.get_bf16(x), &want, BF16_TOLERANCE);
    }

    let len = 1000;
    let (gate, gate_host) = t.put_bf16(&seeded(9, len));
    let (up, up_host) = t.put_bf16(&seeded(10, len));
    let out = t.alloc::<bf16>(len);
    t.gpu
        .swiglu_forward(out, gate, up)
        .unwrap_or_else(|e| panic!("{e}"));
    let mut want = vec![0.0; len];
    swiglu_forward(&mut want, &gate_host, &up_host);
    assert_close("swiglu", &t.get_bf16(out), &want, BF16_TOLERANCE);
    // 1000 aligned values go 8 at a time; one value past alignment, one at a time, with the
    // same bits.
    let skewed = |s: GpuSlice<bf16>| s.sub(1, len - 1).unwrap_or_else(|e| panic!("{e}"));
    let one_by_one = t.alloc::<bf16>(len);
    t.gpu
        .swiglu_forward(skewed(one_by_one), skewed(gate), skewed(up))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_close(
        "swiglu one value at a time",
        &t.get_bf16(one_by_one)[1..],
        &t.get_bf16(out)[1..],
        0.0,
    );

    // The fused rows (gate then up in each row) give the same values bit for bit: 10 rows of
    // 100 one value at a time, 5 rows of 200 eight at a time.
    for f in [100, 200] {
        let gate_up: Vec<bf16> = gate_host
            .chunks_exact(f)
            .zip(up_host.chunks_exact(f))
            .flat_map(|(g, u)| g.iter().chain(u).map(|&x| bf16::from_f32(x)))
            .collect();
        let gate_up = t.put(&gate_up);
        let rows = t.alloc::<bf16>(len);
        t.gpu
            .swiglu_rows(rows, gate_up, f)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_close("swiglu rows", &t.get_bf16(rows), &t.get_bf16(out), 0.0);
    }

    t.gpu
        .residual_add(out, gate)
        .unwrap_or_else(|e| panic!("{e}"));
    let summed: Vec<f32> = want.iter().zip(&gate_host).map(|(a, b)| a + b).collect();
    assert_close("residual", &t.get_bf16(out), &summed, BF16_TOLERANCE);
    t.gpu
        .residual_add(skewed(one_by_one), skewed(gate))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_close(
        "residual one value at a time",
        &t.get_bf16(one_by_one)[1..],
        &t.get_bf16(out)[1..],
        0.0,
    );

    let (vocab, c) = (50, 96);
    let (emb, emb_host) = t.put_bf16(&seeded(11, vocab * c));
    let ids: Vec<u32> = (0..17u32).map(|i| (i * 13) % vocab as u32).collect();
    let ids_dev = t.put(&ids);
    let rows = t.alloc::<bf16>(ids.len() * c);
    t.gpu
        .embedding_forward(rows, ids_dev, emb, c)
        .unwrap_or_else(|e| panic!("{e}"));
    let want: Vec<f32> = ids
        .iter()
        .flat_map(|&id| emb_host[id as usize * c..(id as usize + 1) * c].to_vec())
        .collect();
    assert_close("embedding", &t.get_bf16(rows), &want, 0.0);

    // Rows fed from tokens drawn on the device take them in place of their ids.
    let picked = t.put(&[7u32, 44, 3]);
    let mut feed = vec![FEED_HOST; ids.len()];
    feed[2] = 1;
    feed[16] = 0;
    let fed = FedIds {
        feed: t.put(&feed),
        picked,
    };
    let (fed_rows, fed_normed) = (
        t.alloc::<bf16>(ids.len() * c),
        t.alloc::<bf16>(ids.len() * c),
    );
    let (norm, _) = t.put_bf16(&seeded(13, c));
    t.gpu
        .embedding_norm_fed((fed_rows, fed_normed), ids_dev, fed, emb, (norm, 1e-5))
        .unwrap_or_else(|e| panic!("{e}"));
    let fed_ids: Vec<u32> = ids
        .iter()
        .zip(&feed)
        .map(|(&id, &f)| {
            if f == FEED_HOST {
                id
            } else {
                [7, 44, 3][f as usize]
            }
        })
        .collect();
    let want: Vec<f32> = fed_ids
        .iter()
        .flat_map(|&id| emb_host[id as usize * c..(id as usize + 1) * c].to_vec())
        .collect();
    assert_close("fed embedding", &t.get_bf16(fed_rows), &want, 0.0);
    // The fused norm gives the bits of the norm's own kernel over the rows.
    let normed = t.alloc::<bf16>(ids.len() * c);
    t.gpu
        .rmsnorm_forward(normed, None, fed_rows, norm, 1e-5)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_close(
        "fed embedding's norm",
        &t.get_bf16(fed_normed),
        &t.get_bf16(normed),
        0.0,
    );
    let short = FedIds {
        feed: t.put(&feed[1..]),
        picked,
    };
    assert!(
        t.gpu
            .embedding_norm_fed((fed_rows, fed_normed), ids_dev, short, emb, (norm, 1e-5))
            .is_err(),
        "a feed shorter than the ids was taken"
    );
    let whole = FedIds {
        feed: t.put(&feed),
        picked,
    };
    let short_normed = fed_normed.sub(0, fed_normed.len() - 1).unwrap();
    assert!(
        t.gpu
            .embedding_norm_fed((fed_rows, short_normed), ids_dev, whole, emb, (norm, 1e-5))
            .is_err(),
        "a norm output shorter than the rows was taken"
    );
}

#[test]
fn gpu_casts_round_trip_through_bf16() {
    let Some(mut t) = TestGpu::open("gpu_casts_round_trip_through_bf16", 16 << 20) else {
        return;
    };
    let mut values = seeded(12, 4097);
    values[0] = f32::NAN;
    let x = t.put(&values);
    let half = t.alloc::<bf16>(values.len());
    let back = t.alloc::<f32>(values.len());
    t.gpu
        .cast_to_bf16(half, x)
        .unwrap_or_else(|e| panic!("{e}"));
    t.gpu
        .cast_to_f32(back, half)
        .unwrap_or_else(|e| panic!("{e}"));
    let got = t.get(back);
    assert!(got[0].is_nan(), "NaN must stay NaN through bf16");
    let want: Vec<f32> = values[1..]
        .iter()
        .map(|&v| bf16::from_f32(v).to_f32())
        .collect();
    assert_close("cast round trip", &got[1..], &want, 0.0);
}

#[test]
fn gpu_add_f32_adds_in_place_as_the_host_does() {
    let Some(mut t) = TestGpu::open("gpu_add_f32_adds_in_place_as_the_host_does", 16 << 20) else {
        return;
    };
    let (a, b) = (seeded(13, 70_001), seeded(14, 70_001));
    let (out, x) = (t.put(&a), t.put(&b));
    t.gpu.add_f32(out, x).unwrap_or_else(|e| panic!("{e}"));
    let want: Vec<f32> = a.iter().zip(&b).map(|(p, q)| p + q).collect();
    assert_close("add_f32", &t.get(out), &want, 0.0);
    assert!(t.gpu.add_f32(out, x.sub(0, 7).unwrap()).is_err());
}

#[test]
fn gpu_slices_reinterpret_their_bytes_and_refuse_a_partial_or_misaligned_element() {
    let range = |start: u64, len: usize| crate::device::AddressRange { start, len };
    let halves = GpuSlice::<bf16>::of(range(4096, 64)).unwrap();
    let floats = halves.reinterpret::<f32>().unwrap();
    assert_eq!((floats.address(), floats.len()), (4096, 16));
    assert_eq!(floats.reinterpret::<bf16>().unwrap().len(), 32);
    let odd = halves.sub(0, 31).unwrap();
    assert!(odd.reinterpret::<f32>().is_err(), "a partial fp32");
    let skewed = halves.sub(1, 2).unwrap();
    assert!(skewed.reinterpret::<f32>().is_err(), "a misaligned start");
}

#[test]
fn gpu_slices_refuse_unaligned_ranges_and_views_outside_themselves() {
    let range = |start: u64, len: usize| crate::device::AddressRange { start, len };
    let floats = GpuSlice::<f32>::of(range(4096, 64)).unwrap();
    assert_eq!(floats.len(), 16);
    assert!(
        GpuSlice::<f32>::of(range(4098, 64)).is_err(),
        "misaligned start"
    );
    assert!(
        GpuSlice::<f32>::of(range(4096, 62)).is_err(),
        "partial element"
    );
    let tail = floats.sub(10, 6).unwrap();
    assert_eq!(tail.address(), 4096 + 40);
    assert!(floats.sub(10, 7).is_err(), "past the end");
    assert!(floats.sub(usize::MAX, 2).is_err(), "overflowing start");
    let err = floats
        .expect_len("a test tensor", 15)
        .unwrap_err()
        .to_string();
    assert!(err.contains("a test tensor holds 16 elements"), "{err}");
}

#[test]
fn gpu_uploads_downloads_and_device_copies_are_bit_exact_at_every_size_and_alignment() {
    let test = "gpu_uploads_downloads_and_device_copies_are_bit_exact_at_every_size_and_alignment";
    let Some(mut t) = TestGpu::open(test, 600 << 20) else {
        return;
    };
    // Staged through mapped host memory, growing its buffer, with element offsets that leave
    // both addresses off 16 bytes, and one past the staging limit (a copy-engine copy).
    for (seed, len) in [1usize, 7, 8, 9, 4097, (1 << 20) + 3, 40 << 20]
        .into_iter()
        .enumerate()
    {
        let values: Vec<bf16> = seeded(seed as u64, len)
            .iter()
            .map(|&v| bf16::from_f32(v))
            .collect();
        for offset in [0, 1] {
            let src = t.alloc::<bf16>(len + offset).sub(offset, len).unwrap();
            t.gpu.upload(src, &values).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(t.get(src), values, "{len} elements at offset {offset}");
            // To the source's own offset within 16 bytes (whole words after a byte head) and to
            // another (one byte at a time).
            for at in [offset, 3 - offset] {
                let dst = t.alloc::<bf16>(len + 3).sub(at, len).unwrap();
                t.gpu.copy(dst, src).unwrap_or_else(|e| panic!("{e}"));
                assert_eq!(
                    t.get(dst),
                    values,
                    "device copy of {len} from {offset} to {at}"
                );
            }
        }
    }
    let words: Vec<u32> = seeded(9, 1000).iter().map(|v| v.to_bits()).collect();
    let small = t.put(&words);
    assert_eq!(t.get(small), words, "a small transfer after a large one");
}

#[test]
fn gpu_queued_transfers_through_a_mailbox_are_bit_exact_in_stream_order_and_refuse_misuse() {
    let test = "gpu_queued_transfers_through_a_mailbox_are_bit_exact_in_stream_order";
    let Some(mut t) = TestGpu::open(test, 64 << 20) else {
        return;
    };
    let mut inbox = t.gpu.mailbox(4096 * 4).unwrap_or_else(|e| panic!("{e}"));
    let mut outbox = t.gpu.mailbox(4096 * 4).unwrap_or_else(|e| panic!("{e}"));
    // Rounds queued back to back without a wait between them: each upload lands before the
    // kernel behind it reads, each download holds what the kernel before it wrote, and the
    // host's next bytes wait for the mailbox's last copy, not for the stream.
    for (round, len) in [1usize, 7, 4096, 33].into_iter().enumerate() {
        let values: Vec<f32> = seeded(20 + round as u64, len);
        let (a, b) = (t.alloc::<f32>(len + 1), t.alloc::<f32>(len + 1));
        let (a, b) = (a.sub(round % 2, len).unwrap(), b.sub(1, len).unwrap());
        t.gpu
            .upload_queued(&mut inbox, a, &values)
            .unwrap_or_else(|e| panic!("{e}"));
        t.gpu.zero(b).unwrap_or_else(|e| panic!("{e}"));
        t.gpu.add_f32(b, a).unwrap_or_else(|e| panic!("{e}"));
        t.gpu.add_f32(b, a).unwrap_or_else(|e| panic!("{e}"));
        t.gpu
            .download_queued(&mut outbox, b)
            .unwrap_or_else(|e| panic!("{e}"));
        let mut got = vec![0.0f32; len];
        outbox.read(&mut got).unwrap_or_else(|e| panic!("{e}"));
        let want: Vec<f32> = values.iter().map(|v| v + v).collect();
        assert_eq!(got, want, "round {round} of {len} values");
    }
    let big = t.alloc::<f32>(4097);
    assert!(
        t.gpu.upload_queued(&mut inbox, big, &[0.0; 4097]).is_err(),
        "an upload past the mailbox's capacity was taken"
    );
    let mut none = [0.0f32; 3];
    assert!(
        outbox.read(&mut none).is_err(),
        "a read with no download queued was taken"
    );
    let small = t.alloc::<f32>(4);
    t.gpu
        .download_queued(&mut outbox, small)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        outbox.read(&mut none).is_err(),
        "a read of another length than the download was taken"
    );
}

#[test]
fn gpu_a_capture_takes_only_its_own_stream_while_another_thread_queues_on_a_stream_of_its_own() {
    // The loop's mover thread queues a trainer's work while the engine captures its decode
    // graph: on a stream of its own (`Gpu::with_own_stream`) that work runs, and stays out of
    // the graph.
    let test = "gpu_a_capture_takes_only_its_own_stream_while_another_thread_queues";
    let Some(mut t) = TestGpu::open(test, 64 << 20) else {
        return;
    };
    let n = 1 << 20;
    let (x, x_host) = t.put_bf16(&seeded(11, n));
    let (y, y_host) = t.put_bf16(&seeded(12, n));
    let other = t.put(&vec![1.0f32; n]);
    let trainer = t.gpu.with_own_stream().unwrap_or_else(|e| panic!("{e}"));
    let (inside, queued) = (std::sync::Barrier::new(2), std::sync::Barrier::new(2));
    let graph = std::thread::scope(|scope| {
        scope.spawn(|| {
            inside.wait();
            for _ in 0..50 {
                trainer.zero(other).unwrap_or_else(|e| panic!("{e}"));
                trainer.record_fence().unwrap_or_else(|e| panic!("{e}"));
            }
            queued.wait();
        });
        t.gpu
            .capture(|| {
                inside.wait();
                queued.wait();
                t.gpu.residual_add(x, y)
            })
            .unwrap_or_else(|e| panic!("the capture broke: {e}"))
    });
    trainer.synchronize().unwrap_or_else(|e| panic!("{e}"));
    assert!(
        t.get(other).iter().all(|&v| v == 0.0),
        "the other stream's work ran"
    );
    t.gpu
        .upload(other, &vec![1.0f32; n])
        .unwrap_or_else(|e| panic!("{e}"));
    t.gpu.replay(&graph).unwrap_or_else(|e| panic!("{e}"));
    t.gpu.synchronize().unwrap_or_else(|e| panic!("{e}"));
    assert!(
        t.get(other).iter().all(|&v| v == 1.0),
        "the graph holds the other stream's work"
    );
    let want: Vec<f32> = x_host
        .iter()
        .zip(&y_host)
        .map(|(a, b)| bf16::from_f32(a + b).to_f32())
        .collect();
    assert_close(
        "the captured add, replayed once",
        &t.get_bf16(x),
        &want,
        BF16_TOLERANCE,
    );
}

#[test]
fn gpu_decode_products_match_the_cpu_product_in_bf16_and_in_fp32_slices() {
    let Some(mut t) = TestGpu::open(
        "gpu_decode_products_match_the_cpu_product_in_bf16_and_in_fp32_slices",
        64 << 20,
    ) else {
        return;
    };
    if !runs_decode_product(
        &t,
        "gpu_decode_products_match_the_cpu_product_in_bf16_and_in_fp32_slices",
    ) {
        return;
    }
    // (rows, columns, k, block columns, slices): past the ring's stages (6 of 128 columns, 8
    // of 64), rows short of the two warpgroups', one row.
    for (m, n, k, block, slices) in [
        (128, 256, 2048, 128, 1),
        (77, 192, 384, 64, 1),
        (1, 128, 256, 128, 1),
        (128, 128, 2048, 64, 2),
        (100, 256, 512, 128, 8),
        (3, 64, 1024, 64, 4),
    ] {
        let (x, x_host) = t.put_bf16(&seeded(11, m * k));
        let (w, w_host) = t.put_bf16(&seeded(12, n * k));
        let g = Gemm::new(m, n, k, Transpose::No, Transpose::Yes);
        let zeros = vec![0.0; m * n];
        let what = format!("decode product {m} x {n} x {k}, blocks of {block}, {slices} slices");
        if slices == 1 {
            let y = t.alloc::<bf16>(m * n);
            t.gpu
                .decode_product(ProductOut::Bf16(y), x, w, k, block)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let want = host_product(g, &x_host, &w_host, &zeros);
            assert_close(&what, &t.get_bf16(y), &want, BF16_TOLERANCE);
        } else {
            let y = t.alloc::<f32>(slices * m * n);
            t.gpu
                .decode_product(ProductOut::Partials(y), x, w, k, block)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let got = t.get(y);
            let part = k / slices;
            for (s, got) in got.chunks(m * n).enumerate() {
                let want = host_product_over(g, &x_host, &w_host, &zeros, s * part..(s + 1) * part);
                assert_close(&format!("{what}, slice {s}"), got, &want, 1e-4);
            }
        }
    }
    let (x, w) = (t.alloc::<bf16>(129 * 64), t.alloc::<bf16>(64 * 64));
    let y = t.alloc::<bf16>(129 * 64);
    let short = |len| x.sub(0, len).unwrap_or_else(|e| panic!("{e}"));
    for (x, k, block) in [
        (x, 64, 64),
        (short(100 * 64), 64, 96),
        (short(96 * 64), 96, 64),
    ] {
        assert!(matches!(
            t.gpu.decode_product(ProductOut::Bf16(y), x, w, k, block),
            Err(DeviceError::ShapeMismatch { .. })
        ));
    }
}

/// Whether the decode product runs on `t`'s GPU (Hopper); if not, says that `test` skipped.
fn runs_decode_product(t: &TestGpu, test: &str) -> bool {
    let runs = t.gpu.has_decode_product();
    if !runs {
        eprintln!("skipped {test}: not a Hopper GPU");
    }
    runs
}

#[test]
fn gpu_decode_product_swiglu_is_the_bf16_product_then_swiglu_rows_bit_for_bit() {
    let Some(mut t) = TestGpu::open(
        "gpu_decode_product_swiglu_is_the_bf16_product_then_swiglu_rows_bit_for_bit",
        64 << 20,
    ) else {
        return;
    };
    if !runs_decode_product(
        &t,
        "gpu_decode_product_swiglu_is_the_bf16_product_then_swiglu_rows_bit_for_bit",
    ) {
        return;
    }
    // (rows, f, k): the engine's gate/up shape past the ring, rows short of a warpgroup, one
    // block.
    for (m, f, k) in [(128, 192, 2048), (77, 128, 384), (1, 64, 128)] {
        let (x, x_host) = t.put_bf16(&seeded(21, m * k));
        let (w, w_host) = t.put_bf16(&seeded(22, 2 * f * k));
        let what = format!("decode product swiglu {m} x {f} x {k}");
        let y = t.alloc::<bf16>(m * f);
        t.gpu
            .decode_product(
                ProductOut::Swiglu(y),
                x,
                w,
                k,
                DECODE_PRODUCT_SWIGLU_COLUMNS,
            )
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let (gate_up, apart) = (t.alloc::<bf16>(m * 2 * f), t.alloc::<bf16>(m * f));
        t.gpu
            .decode_product(
                ProductOut::Bf16(gate_up),
                x,
                w,
                k,
                DECODE_PRODUCT_SWIGLU_COLUMNS,
            )
            .and_then(|()| t.gpu.swiglu_rows(apart, gate_up, f))
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let got = t.get_bf16(y);
        assert_close(&what, &got, &t.get_bf16(apart), 0.0);
        // Against the host: the bf16 product, then SwiGLU of the GPU's bf16 product (SwiGLU of
        // the host's product rounded anew would move some of g and u by a bf16 step, which
        // SwiGLU magnifies where g is below zero).
        let product = t.get_bf16(gate_up);
        let g = Gemm::new(m, 2 * f, k, Transpose::No, Transpose::Yes);
        let exact = host_product(g, &x_host, &w_host, &vec![0.0; m * 2 * f]);
        assert_close(
            &format!("{what}, product"),
            &product,
            &exact,
            BF16_TOLERANCE,
        );
        let (gate, up): (Vec<f32>, Vec<f32>) = product
            .chunks_exact(2 * f)
            .flat_map(|row| (0..f).map(move |j| (row[j], row[f + j])))
            .unzip();
        let mut want = vec![0.0; m * f];
        swiglu_forward(&mut want, &gate, &up);
        assert_close(
            &format!("{what} against the host"),
            &got,
            &want,
            BF16_TOLERANCE,
        );
    }
}

#[test]
fn gpu_decode_products_and_tensor_maps_refuse_what_they_do_not_fit() {
    let Some(mut t) = TestGpu::open(
        "gpu_decode_products_and_tensor_maps_refuse_what_they_do_not_fit",
        16 << 20,
    ) else {
        return;
    };
    if !runs_decode_product(
        &t,
        "gpu_decode_products_and_tensor_maps_refuse_what_they_do_not_fit",
    ) {
        return;
    }
    let refused = |r: Result<(), DeviceError>| matches!(r, Err(DeviceError::ShapeMismatch { .. }));
    let (x, w) = (t.alloc::<bf16>(8 * 192), t.alloc::<bf16>(64 * 192));
    let (short, slices) = (t.alloc::<bf16>(8 * 64 - 8), t.alloc::<f32>(2 * 8 * 64));
    let (gate_up, long) = (t.alloc::<bf16>(128 * 192), t.alloc::<bf16>(8 * 128));
    let g = &t.gpu;
    // An output one row short; two slices of k's three tiles.
    assert!(refused(g.decode_product(
        ProductOut::Bf16(short),
        x,
        w,
        192,
        64
    )));
    assert!(refused(g.decode_product(
        ProductOut::Partials(slices),
        x,
        w,
        192,
        64
    )));
    // SwiGLU: blocks of 64, an output as long as the product's.
    assert!(refused(g.decode_product(
        ProductOut::Swiglu(short),
        x,
        w,
        192,
        64
    )));
    assert!(refused(g.decode_product(
        ProductOut::Swiglu(long),
        x,
        gate_up,
        192,
        DECODE_PRODUCT_SWIGLU_COLUMNS
    )));
    // Tensor maps: rows not whole 16-byte words, a box of no rows or too many, an address off
    // 16 bytes.
    let off = w.sub(1, 64 * 64).unwrap_or_else(|e| panic!("{e}"));
    assert!(refused(g.tensor_map(w, 12, 64).map(drop)));
    assert!(refused(g.tensor_map(w, 192, 0).map(drop)));
    assert!(refused(g.tensor_map(w, 192, 257).map(drop)));
    assert!(refused(g.tensor_map(off, 64, 64).map(drop)));
    assert!(g.tensor_map(w, 192, 256).is_ok());
}
