//! Tests of the paged KV cache kernels against plain loops and `ops::attention_forward_naive`,
//! on seeded inputs rounded to bf16: several sequences of different lengths, blocks scattered
//! over the cache, a block size that does not divide the lengths, grouped-query heads, prefill
//! and decode. On a GPU machine: `MILES_TEST_DEVICE=cuda cargo test -p miles-core paged --
//! --test-threads=1`; elsewhere they skip.

use half::bf16;

use super::testing::{TestGpu, assert_close};
use super::{PagedCache, PagedTokens};
use crate::ops::testing::seeded_vec as seeded;
use crate::ops::{AttentionShape, attention_forward_naive};

/// bf16 rounding of the output plus fp32 accumulation order: 1% of the value's size.
const BF16_TOLERANCE: f32 = 1e-2;

/// Sequence lengths of the tests: none a multiple of the block size 8, one a single position.
const LENGTHS: [usize; 4] = [5, 17, 1, 33];

/// Each sequence's blocks, handed out in a scattered order (7 is coprime to the block count).
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

/// The sequences' keys and values `(T, K*D)` each, rounded to bf16, and the cache filled with
/// them through `paged_kv_write` of `layer` (one call for every token of every sequence).
struct Filled {
    cache: crate::device::GpuSlice<bf16>,
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    tables: Vec<Vec<usize>>,
}

fn fill(t: &mut TestGpu, shape: &PagedCache, layer: usize, seed: u64) -> Filled {
    let kvd = shape.kv_dim();
    let (cache, _) = t.put_bf16(&seeded(seed, shape.elems()));
    let tables = block_tables(shape, &LENGTHS);
    let total: usize = LENGTHS.iter().sum();
    let (k, k_host) = t.put_bf16(&seeded(seed + 1, total * kvd));
    let (v, v_host) = t.put_bf16(&seeded(seed + 2, total * kvd));
    let mut slots = Vec::with_capacity(total);
    let (mut keys, mut values) = (Vec::new(), Vec::new());
    let mut first = 0;
    for (table, &len) in tables.iter().zip(&LENGTHS) {
        for pos in 0..len {
            slots.push(
                shape
                    .slot(table[pos / shape.block_size], pos)
                    .unwrap_or_else(|e| panic!("{e}")),
            );
        }
        keys.push(k_host[first * kvd..(first + len) * kvd].to_vec());
        values.push(v_host[first * kvd..(first + len) * kvd].to_vec());
        first += len;
    }
    let slots = t.put(&slots);
    t.gpu
        .paged_kv_write(cache, shape, layer, k, v, slots)
        .unwrap_or_else(|e| panic!("{e}"));
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

#[test]
fn paged_kv_write_stores_each_token_at_its_slot_and_nothing_else() {
    let Some(mut t) = TestGpu::open(
        "paged_kv_write_stores_each_token_at_its_slot_and_nothing_else",
        16 << 20,
    ) else {
        return;
    };
    let shape = PagedCache {
        num_blocks: 16,
        num_layers: 3,
        block_size: 8,
        kv_heads: 2,
        head_dim: 24,
    };
    let layer = 1;
    let before: Vec<f32> = seeded(40, shape.elems())
        .iter()
        .map(|&x| bf16::from_f32(x).to_f32())
        .collect();
    let f = fill(&mut t, &shape, layer, 40);
    let mut want = before;
    let kvd = shape.kv_dim();
    for (s, table) in f.tables.iter().enumerate() {
        for pos in 0..LENGTHS[s] {
            let (block, slot) = (table[pos / shape.block_size], pos % shape.block_size);
            let row = pos * kvd..(pos + 1) * kvd;
            let k = shape.offset(block, layer, 0, slot);
            want[k..k + kvd].copy_from_slice(&f.keys[s][row.clone()]);
            let v = shape.offset(block, layer, 1, slot);
            want[v..v + kvd].copy_from_slice(&f.values[s][row]);
        }
    }
    // A copy of bf16 values is exact.
    assert_close("paged kv write", &t.get_bf16(f.cache), &want, 0.0);
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
        num_blocks: 16,
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
        num_blocks: 16,
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
        num_blocks: 16,
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
