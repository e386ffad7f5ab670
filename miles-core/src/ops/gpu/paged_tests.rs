//! Tests of the paged KV cache kernels against the CPU ops (bias, RMSNorm, RoPE) and
//! `ops::attention_forward_naive`, on seeded inputs rounded to bf16: several sequences of
//! different lengths, blocks scattered over the cache, a block size that does not divide the
//! lengths, grouped-query heads (more heads than one attention block serves too), prefill and
//! decode. On a GPU machine: `MILES_TEST_DEVICE=cuda cargo test -p miles-core paged --
//! --test-threads=1`; elsewhere they skip.

use half::bf16;

use super::paged::grid_side;
use super::testing::{TestGpu, assert_close};
use super::{PagedCache, PagedTokens, QkvHeads, TokenPlaces};
use crate::device::GpuSlice;
use crate::ops::testing::seeded_vec as seeded;
use crate::ops::{
    AttentionShape, RopeTable, attention_forward_naive, bias_forward, rmsnorm_forward, rope_forward,
};

/// bf16 rounding of the output plus fp32 accumulation order: 1% of the value's size.
const BF16_TOLERANCE: f32 = 1e-2;

/// Sequence lengths of the tests: none a multiple of the block size 8, one a single position,
/// one whose last position opens the second 64-position tile (65), one of three tiles (150).
/// They take 30 of the tests' 32 blocks of 8.
const LENGTHS: [usize; 4] = [5, 65, 1, 150];

/// Each sequence's blocks, handed out in a scattered order (7 is coprime to the block count,
/// 32 in every test, and the lengths take 24 blocks).
fn block_tables(shape: &PagedCache, lengths: &[usize]) -> Vec<Vec<usize>> {
    let mut next = 0;
    lengths
        .iter()
        .map(|&len| {
            (0..len.div_ceil(shape.block_size))
                .map(|_| {
                    next += 1;
                    (next * 7) % shape.num_blocks
                })
                .collect()
        })
        .collect()
}

/// The sequences' keys and values `(T, K*D)` each, rounded to bf16, and the cache holding
/// them at their slots of `layer` (over seeded values elsewhere), uploaded from the host.
struct Filled {
    cache: crate::device::GpuSlice<bf16>,
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    tables: Vec<Vec<usize>>,
}

/// Rounds `values` to bf16.
fn rounded(values: &[f32]) -> Vec<f32> {
    values.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
}

/// Each token's (sequence, position, slot) for every position of every sequence.
fn every_slot(shape: &PagedCache, tables: &[Vec<usize>]) -> Vec<(usize, usize, usize)> {
    let p = shape.block_size;
    tables
        .iter()
        .zip(&LENGTHS)
        .enumerate()
        .flat_map(|(s, (table, &len))| (0..len).map(move |pos| (s, pos, table[pos / p])))
        .map(|(s, pos, block)| (s, pos, block * p + pos % p))
        .collect()
}

/// `cache` with each token's key and value rows `(N, K*D)` at its slot of `layer`.
fn place(shape: &PagedCache, cache: &mut [f32], layer: usize, slots: &[usize], kv: [&[f32]; 2]) {
    let kvd = shape.kv_dim();
    for (i, &slot) in slots.iter().enumerate() {
        let (block, within) = (slot / shape.block_size, slot % shape.block_size);
        for (half, rows) in kv.iter().enumerate() {
            let at = shape.offset(block, layer, half, within);
            cache[at..at + kvd].copy_from_slice(&rows[i * kvd..(i + 1) * kvd]);
        }
    }
}

fn fill(t: &mut TestGpu, shape: &PagedCache, layer: usize, seed: u64) -> Filled {
    let kvd = shape.kv_dim();
    let tables = block_tables(shape, &LENGTHS);
    let tokens = every_slot(shape, &tables);
    let k_host = rounded(&seeded(seed + 1, tokens.len() * kvd));
    let v_host = rounded(&seeded(seed + 2, tokens.len() * kvd));
    let mut cache_host = rounded(&seeded(seed, shape.elems()));
    let slots: Vec<usize> = tokens.iter().map(|&(_, _, slot)| slot).collect();
    place(shape, &mut cache_host, layer, &slots, [&k_host, &v_host]);
    let (cache, _) = t.put_bf16(&cache_host);
    let (mut keys, mut values) = (Vec::new(), Vec::new());
    let mut first = 0;
    for &len in &LENGTHS {
        keys.push(k_host[first * kvd..(first + len) * kvd].to_vec());
        values.push(v_host[first * kvd..(first + len) * kvd].to_vec());
        first += len;
    }
    Filled {
        cache,
        keys,
        values,
        tables,
    }
}

/// The block tables as the kernel reads them, `(S, max_blocks)`.
fn table_rows(tables: &[Vec<usize>], max_blocks: usize) -> Vec<u32> {
    let mut rows = vec![0u32; tables.len() * max_blocks];
    for (s, table) in tables.iter().enumerate() {
        for (i, &block) in table.iter().enumerate() {
            rows[s * max_blocks + i] = block as u32;
        }
    }
    rows
}

/// The columns `first..first + width` of each row of `rows (N, row)`.
fn columns(rows: &[f32], row: usize, first: usize, width: usize) -> Vec<f32> {
    rows.chunks_exact(row)
        .flat_map(|r| r[first..first + width].to_vec())
        .collect()
}

/// The fused rows `qkv` of `heads` query heads, with qwen's biases and q/k norms (`extras`) or
/// without them.
fn qkv_heads(
    qkv: GpuSlice<bf16>,
    heads: usize,
    extras: Option<[GpuSlice<bf16>; 3]>,
    eps: f32,
) -> QkvHeads {
    QkvHeads {
        qkv,
        heads,
        bias: extras.map(|[bias, _, _]| bias),
        q_norm: extras.map(|[_, q_norm, _]| q_norm),
        k_norm: extras.map(|[_, _, k_norm]| k_norm),
        eps,
    }
}

/// Checks `qkv_rotary_cache` against the CPU ops, with the biases and q/k norms of qwen or
/// without them.
fn check_qkv_rotary_cache(what: &str, with_extras: bool, seed: u64) {
    let Some(mut t) = TestGpu::open(what, 16 << 20) else {
        return;
    };
    // 24 channels: fewer than a warp's lanes, and not a multiple of them.
    let shape = PagedCache {
        num_blocks: 32,
        num_layers: 3,
        block_size: 8,
        kv_heads: 2,
        head_dim: 24,
    };
    let (heads, d, layer, eps) = (6, shape.head_dim, 1, 1e-6);
    let (qd, kvd) = (heads * d, shape.kv_dim());
    let width = qd + 2 * kvd;
    let tokens = every_slot(&shape, &block_tables(&shape, &LENGTHS));
    let n = tokens.len();
    let table = RopeTable::new(d, 10000.0, 256);
    let (qkv, qkv_host) = t.put_bf16(&seeded(seed, n * width));
    let (bias, bias_host) = t.put_bf16(&seeded(seed + 1, width));
    let (q_norm, q_norm_host) = t.put_bf16(&seeded(seed + 2, d));
    let (k_norm, k_norm_host) = t.put_bf16(&seeded(seed + 3, d));
    let background = rounded(&seeded(seed + 4, shape.elems()));
    let (cache, _) = t.put_bf16(&background);
    let positions: Vec<u32> = tokens.iter().map(|&(_, pos, _)| pos as u32).collect();
    let slots: Vec<usize> = tokens.iter().map(|&(_, _, slot)| slot).collect();
    let slot_words: Vec<u32> = slots.iter().map(|&slot| slot as u32).collect();
    let places = TokenPlaces {
        positions: t.put(&positions),
        slots: t.put(&slot_words),
        cos: t.put(table.cos()),
        sin: t.put(table.sin()),
    };
    let q = t.alloc::<bf16>(n * qd);
    let fused = qkv_heads(
        qkv,
        heads,
        with_extras.then_some([bias, q_norm, k_norm]),
        eps,
    );
    t.gpu
        .qkv_rotary_cache(q, cache, &shape, layer, &fused, &places)
        .unwrap_or_else(|e| panic!("{e}"));

    // The CPU's steps, each rounded to bf16 as the separate kernels round.
    let mut biased = qkv_host;
    if with_extras {
        bias_forward(&mut biased, &bias_host);
        biased = rounded(&biased);
    }
    let positions: Vec<usize> = tokens.iter().map(|&(_, pos, _)| pos).collect();
    let prepare = |first: usize, count: usize, norm: &[f32]| {
        let mut x = columns(&biased, width, first, count * d);
        if with_extras {
            let (mut normed, mut rstd) = (vec![0.0; x.len()], vec![0.0; x.len() / d]);
            rmsnorm_forward(&mut normed, &mut rstd, &x, norm, eps);
            x = rounded(&normed);
        }
        rope_forward(&mut x, &positions, count, &table);
        x
    };
    let want_q = prepare(0, heads, &q_norm_host);
    let want_k = prepare(qd, shape.kv_heads, &k_norm_host);
    let want_v = columns(&biased, width, qd + kvd, kvd);
    let mut want_cache = background;
    place(&shape, &mut want_cache, layer, &slots, [&want_k, &want_v]);
    assert_close(what, &t.get_bf16(q), &want_q, BF16_TOLERANCE);
    // Everything but the new rows is untouched (bit for bit: the tolerance is relative to
    // max(1, |want|), and a bf16 copy is exact).
    assert_close(what, &t.get_bf16(cache), &want_cache, BF16_TOLERANCE);
}

#[test]
fn qkv_rotary_cache_prepares_queries_and_stores_keys_and_values_at_their_slots() {
    check_qkv_rotary_cache(
        "qkv_rotary_cache_prepares_queries_and_stores_keys_and_values_at_their_slots",
        false,
        40,
    );
}

#[test]
fn qkv_rotary_cache_adds_the_biases_and_norms_the_heads_as_qwen_needs() {
    check_qkv_rotary_cache(
        "qkv_rotary_cache_adds_the_biases_and_norms_the_heads_as_qwen_needs",
        true,
        45,
    );
}

/// Runs the attention kernel for `queries` (sequence, position) pairs against the filled cache
/// and compares each output row with `attention_forward_naive` over that sequence.
fn check_attention(what: &str, shape: PagedCache, heads: usize, decode: bool, seed: u64) {
    let Some(mut t) = TestGpu::open(what, 32 << 20) else {
        return;
    };
    let (d, kvd, qd) = (shape.head_dim, shape.kv_dim(), heads * shape.head_dim);
    let layer = shape.num_layers - 1;
    let f = fill(&mut t, &shape, layer, seed);
    let queries: Vec<(usize, usize)> = LENGTHS
        .iter()
        .enumerate()
        .flat_map(|(s, &len)| {
            let first = if decode { len - 1 } else { 0 };
            (first..len).map(move |pos| (s, pos))
        })
        .collect();
    let n = queries.len();
    let (q, q_host) = t.put_bf16(&seeded(seed + 3, n * qd));
    let out = t.alloc::<bf16>(n * qd);
    let max_blocks = LENGTHS
        .iter()
        .max()
        .map_or(1, |l| l.div_ceil(shape.block_size))
        + 1;
    let positions: Vec<u32> = queries.iter().map(|&(_, p)| p as u32).collect();
    let rows: Vec<u32> = queries.iter().map(|&(s, _)| s as u32).collect();
    let tokens = PagedTokens {
        positions: t.put(&positions),
        seq_rows: t.put(&rows),
        tables: t.put(&table_rows(&f.tables, max_blocks)),
        max_blocks,
    };
    t.gpu
        .paged_attention(out, q, f.cache, &shape, layer, &tokens)
        .unwrap_or_else(|e| panic!("{e}"));
    let mut want = vec![0.0; n * qd];
    for (i, &(s, pos)) in queries.iter().enumerate() {
        // Causal attention over the sequence's first pos + 1 positions, this query last.
        let len = pos + 1;
        let mut qs = vec![0.0; len * qd];
        qs[pos * qd..].copy_from_slice(&q_host[i * qd..(i + 1) * qd]);
        let mut o = vec![0.0; len * qd];
        let mut att = vec![0.0; len * heads * len];
        let shape_naive = AttentionShape {
            batch: 1,
            seq: len,
            heads,
            kv_heads: shape.kv_heads,
            head_dim: d,
        };
        attention_forward_naive(
            &mut o,
            &mut att,
            &qs,
            &f.keys[s][..len * kvd],
            &f.values[s][..len * kvd],
            shape_naive,
        );
        want[i * qd..(i + 1) * qd].copy_from_slice(&o[pos * qd..]);
    }
    assert_close(what, &t.get_bf16(out), &want, BF16_TOLERANCE);
}

#[test]
fn paged_attention_prefill_matches_causal_attention_with_grouped_heads() {
    let shape = PagedCache {
        num_blocks: 32,
        num_layers: 2,
        block_size: 8,
        kv_heads: 2,
        head_dim: 64,
    };
    check_attention(
        "paged_attention_prefill_matches_causal_attention_with_grouped_heads",
        shape,
        6,
        false,
        50,
    );
}

#[test]
fn paged_attention_decode_matches_the_last_row_at_the_largest_head_dim() {
    let shape = PagedCache {
        num_blocks: 32,
        num_layers: 2,
        block_size: 8,
        kv_heads: 2,
        head_dim: 128,
    };
    check_attention(
        "paged_attention_decode_matches_the_last_row_at_the_largest_head_dim",
        shape,
        8,
        true,
        60,
    );
}

#[test]
fn paged_attention_handles_a_head_dim_that_is_not_a_multiple_of_the_warp() {
    let shape = PagedCache {
        num_blocks: 32,
        num_layers: 1,
        block_size: 8,
        kv_heads: 1,
        head_dim: 40,
    };
    check_attention(
        "paged_attention_handles_a_head_dim_that_is_not_a_multiple_of_the_warp",
        shape,
        3,
        false,
        70,
    );
}

#[test]
fn paged_attention_serves_a_group_of_more_query_heads_than_one_block_takes() {
    // 12 query heads on one kv head: two blocks of the group, the second with 4.
    let shape = PagedCache {
        num_blocks: 32,
        num_layers: 1,
        block_size: 8,
        kv_heads: 1,
        head_dim: 64,
    };
    check_attention(
        "paged_attention_serves_a_group_of_more_query_heads_than_one_block_takes",
        shape,
        12,
        true,
        80,
    );
}

#[test]
fn paged_attention_reads_the_table_of_blocks_that_do_not_divide_a_tile() {
    // A kernel reads a tile's table entries ahead of its rows: one entry a position (blocks of
    // 1, 64 entries a tile), blocks of 5 (a tile starts and ends inside one) and blocks longer
    // than a tile (two tiles share an entry). Block counts coprime to 7 and holding the lengths.
    let what = "paged_attention_reads_the_table_of_blocks_that_do_not_divide_a_tile";
    for (seed, (num_blocks, block_size)) in [(223, 1), (47, 5), (8, 128)].into_iter().enumerate() {
        let shape = PagedCache {
            num_blocks,
            num_layers: 2,
            block_size,
            kv_heads: 2,
            head_dim: 64,
        };
        let seed = 100 + 10 * seed as u64;
        check_attention(what, shape, 4, false, seed);
        check_attention(what, shape, 4, true, seed + 1);
        check_decode(what, shape, 4, false, seed + 2);
    }
}

#[test]
fn an_attention_grid_side_past_cudas_65535_blocks_is_refused() {
    // The kv heads and the query head chunks are the grid's y and z sides.
    assert_eq!(grid_side("kv heads", 65_535).ok(), Some(65_535));
    let refused = grid_side("kv heads", 65_536);
    assert!(
        matches!(
            refused,
            Err(crate::device::DeviceError::ShapeMismatch {
                what: "kv heads",
                expected: 65_535,
                actual: 65_536
            })
        ),
        "{refused:?}"
    );
}

#[test]
fn paged_attention_refuses_a_head_dim_that_is_not_a_multiple_of_8() {
    let what = "paged_attention_refuses_a_head_dim_that_is_not_a_multiple_of_8";
    let Some(mut t) = TestGpu::open(what, 16 << 20) else {
        return;
    };
    let shape = PagedCache {
        num_blocks: 4,
        num_layers: 1,
        block_size: 8,
        kv_heads: 1,
        head_dim: 36,
    };
    let (cache, q, out) = (
        t.alloc::<bf16>(shape.elems()),
        t.alloc::<bf16>(2 * shape.head_dim),
        t.alloc::<bf16>(2 * shape.head_dim),
    );
    let tokens = PagedTokens {
        positions: t.put(&[0u32]),
        seq_rows: t.put(&[0u32]),
        tables: t.put(&[0u32]),
        max_blocks: 1,
    };
    let refused = t.gpu.paged_attention(out, q, cache, &shape, 0, &tokens);
    assert!(
        matches!(refused, Err(crate::device::DeviceError::ShapeMismatch { what, .. }) if what.contains("multiple of 8")),
        "{refused:?}"
    );
}

#[test]
fn paged_attention_refuses_a_cache_or_queries_that_are_not_16_byte_aligned() {
    let what = "paged_attention_refuses_a_cache_or_queries_that_are_not_16_byte_aligned";
    let Some(mut t) = TestGpu::open(what, 16 << 20) else {
        return;
    };
    let shape = PagedCache {
        num_blocks: 4,
        num_layers: 1,
        block_size: 8,
        kv_heads: 1,
        head_dim: 40,
    };
    let tokens = PagedTokens {
        positions: t.put(&[0u32]),
        seq_rows: t.put(&[0u32]),
        tables: t.put(&[0u32]),
        max_blocks: 1,
    };
    // One element (2 bytes) past an aligned start: the tiles and the queries are copied 16
    // bytes at a time.
    let d = shape.head_dim;
    let (cache, cache_off) = (
        t.alloc::<bf16>(shape.elems()),
        t.alloc::<bf16>(shape.elems() + 1)
            .sub(1, shape.elems())
            .unwrap(),
    );
    let (q, q_off) = (
        t.alloc::<bf16>(d),
        t.alloc::<bf16>(d + 1).sub(1, d).unwrap(),
    );
    let out = t.alloc::<bf16>(d);
    for (q, cache, named) in [(q, cache_off, "cache"), (q_off, cache, "queries")] {
        let refused = t.gpu.paged_attention(out, q, cache, &shape, 0, &tokens);
        assert!(
            matches!(refused, Err(crate::device::DeviceError::ShapeMismatch { what, .. }) if what.contains(named) && what.contains("16-byte aligned")),
            "{refused:?}"
        );
    }
}

/// Runs the decode kernel and, on a copy of the cache, `qkv_rotary_cache` then
/// `paged_attention`, for the last position of each sequence of [`LENGTHS`] (its earlier
/// positions cached, the new one not yet), and checks the outputs and the caches are the same
/// bits.
fn check_decode(what: &str, shape: PagedCache, heads: usize, with_extras: bool, seed: u64) {
    let Some(mut t) = TestGpu::open(what, 32 << 20) else {
        return;
    };
    let (d, kv, layer) = (shape.head_dim, shape.kv_heads, shape.num_layers - 1);
    let f = fill(&mut t, &shape, layer, seed);
    let (n, width) = (LENGTHS.len(), (heads + 2 * kv) * d);
    let slots: Vec<u32> = f
        .tables
        .iter()
        .zip(&LENGTHS)
        .map(|(table, &len)| shape.slot(table[(len - 1) / shape.block_size], len - 1))
        .collect::<Result<_, _>>()
        .unwrap_or_else(|e| panic!("{e}"));
    let positions: Vec<u32> = LENGTHS.iter().map(|&len| len as u32 - 1).collect();
    let rows: Vec<u32> = (0..n as u32).collect();
    let max_blocks = LENGTHS
        .iter()
        .max()
        .map_or(1, |l| l.div_ceil(shape.block_size));
    let rope = RopeTable::new(d, 10000.0, 256);
    let (qkv, _) = t.put_bf16(&seeded(seed + 5, n * width));
    let (bias, _) = t.put_bf16(&seeded(seed + 6, width));
    let (q_norm, _) = t.put_bf16(&seeded(seed + 7, d));
    let (k_norm, _) = t.put_bf16(&seeded(seed + 8, d));
    let fused = qkv_heads(
        qkv,
        heads,
        with_extras.then_some([bias, q_norm, k_norm]),
        1e-6,
    );
    let positions = t.put(&positions);
    let places = TokenPlaces {
        positions,
        slots: t.put(&slots),
        cos: t.put(rope.cos()),
        sin: t.put(rope.sin()),
    };
    let tokens = PagedTokens {
        positions,
        seq_rows: t.put(&rows),
        tables: t.put(&table_rows(&f.tables, max_blocks)),
        max_blocks,
    };
    let before = t.get_bf16(f.cache);
    let (cache_apart, _) = t.put_bf16(&before);
    let (q, out_apart, out) = (
        t.alloc::<bf16>(n * heads * d),
        t.alloc::<bf16>(n * heads * d),
        t.alloc::<bf16>(n * heads * d),
    );
    let run =
        |result: Result<(), crate::device::DeviceError>| result.unwrap_or_else(|e| panic!("{e}"));
    run(t
        .gpu
        .qkv_rotary_cache(q, cache_apart, &shape, layer, &fused, &places));
    run(t
        .gpu
        .paged_attention(out_apart, q, cache_apart, &shape, layer, &tokens));
    run(t
        .gpu
        .paged_decode_attention(out, f.cache, &shape, layer, &fused, (&places, &tokens)));
    let bits = |values: Vec<f32>| values.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let (got, want) = (t.get_bf16(out), t.get_bf16(out_apart));
    assert!(
        got.iter().any(|&x| x != 0.0),
        "{what}: the output is all zeros"
    );
    assert_eq!(bits(got), bits(want), "{what}: outputs");
    let cache = t.get_bf16(f.cache);
    assert_ne!(
        bits(cache.clone()),
        bits(before),
        "{what}: no key or value was stored"
    );
    assert_eq!(bits(cache), bits(t.get_bf16(cache_apart)), "{what}: caches");
}

#[test]
fn paged_decode_attention_gives_the_bits_of_the_two_kernels_it_fuses() {
    let shape = |kv_heads, head_dim| PagedCache {
        num_blocks: 32,
        num_layers: 2,
        block_size: 8,
        kv_heads,
        head_dim,
    };
    let what = "paged_decode_attention_gives_the_bits_of_the_two_kernels_it_fuses";
    // Each padded instance and the smallest head dim; 150 positions cross three tiles, the new
    // one in the third, and 65 put it first in the second; 12 query heads on one kv head take
    // two blocks, both of which need the new key and value; one query head a kv head; qwen's
    // biases and q/k norms.
    check_decode(what, shape(2, 64), 8, false, 90);
    check_decode(what, shape(2, 24), 6, true, 91);
    check_decode(what, shape(1, 128), 12, true, 92);
    check_decode(what, shape(2, 16), 4, false, 93);
    check_decode(what, shape(2, 8), 2, true, 94);
}

#[test]
fn paged_decode_attention_refuses_unaligned_rows_or_tables_and_positions_of_another_pass() {
    let what =
        "paged_decode_attention_refuses_unaligned_rows_or_tables_and_positions_of_another_pass";
    let Some(mut t) = TestGpu::open(what, 16 << 20) else {
        return;
    };
    let shape = PagedCache {
        num_blocks: 4,
        num_layers: 1,
        block_size: 8,
        kv_heads: 1,
        head_dim: 16,
    };
    let (d, width) = (shape.head_dim, 3 * shape.head_dim);
    let cache = t.alloc::<bf16>(shape.elems());
    let out = t.alloc::<bf16>(d);
    // One element past an aligned start: the rows and the rotary rows are copied 16 bytes at
    // a time.
    let qkv = t.alloc::<bf16>(width);
    let qkv_off = t.alloc::<bf16>(width + 1).sub(1, width).unwrap();
    let rope = RopeTable::new(d, 10000.0, 8);
    let cos = t.put(rope.cos());
    let mut shifted = vec![0.0f32];
    shifted.extend_from_slice(rope.cos());
    let cos_off = t.put(&shifted).sub(1, rope.cos().len()).unwrap();
    let sin = t.put(rope.sin());
    let tokens = PagedTokens {
        positions: t.put(&[0u32]),
        seq_rows: t.put(&[0u32]),
        tables: t.put(&[0u32]),
        max_blocks: 1,
    };
    let slots = t.put(&[0u32]);
    let places = |cos, positions| TokenPlaces {
        positions,
        slots,
        cos,
        sin,
    };
    for (rows, cos, named) in [
        (qkv_off, cos, "q/k/v rows"),
        (qkv, cos_off, "rotary tables"),
    ] {
        let at = places(cos, tokens.positions);
        let refused = t.gpu.paged_decode_attention(
            out,
            cache,
            &shape,
            0,
            &qkv_heads(rows, 1, None, 1e-6),
            (&at, &tokens),
        );
        assert!(
            matches!(refused, Err(crate::device::DeviceError::ShapeMismatch { what, .. }) if what.contains(named) && what.contains("16-byte aligned")),
            "{refused:?}"
        );
    }
    let other_positions = t.put(&[0u32]);
    let other = places(cos, other_positions);
    let refused = t.gpu.paged_decode_attention(
        out,
        cache,
        &shape,
        0,
        &qkv_heads(qkv, 1, None, 1e-6),
        (&other, &tokens),
    );
    assert!(
        matches!(refused, Err(crate::device::DeviceError::ShapeMismatch { what, .. }) if what.contains("decode attention positions")),
        "{refused:?}"
    );
}
