//! A batch-invariant linear layer for decoding: every output element is one dot product summed
//! in a fixed order, so a row's result does not depend on how many rows share the call.
//!
//! The `gemm` crate picks its kernel and its blocking from the whole shape (one row takes a
//! matrix-vector path, more rows a tiled one), so a sequence decoded alone and the same sequence
//! decoded in a batch of eight would round differently and, after sampling, could diverge. The
//! rollout engine needs the same tokens whatever the batch, and after a preempted sequence is
//! recomputed, so decoding runs on this kernel.

use rayon::prelude::*;

use crate::device::GemmShapeError;

/// Output columns one task computes; a tile of weight rows stays in cache across the batch.
const COLUMN_TILE: usize = 32;
/// Independent accumulators of a dot product (a vector register's worth of lanes).
const LANES: usize = 8;

/// `out (B, OC) = inp (B, IC) · weight (OC, IC)ᵀ`, with each element's sum in a fixed order.
///
/// Columns are split in tiles across rayon's threads; within a tile each weight row is read
/// once for the whole batch.
///
/// # Errors
/// [`GemmShapeError`] when a slice is too short for `b`, `ic`, `oc`; nothing is written.
pub fn matmul_rows_forward(
    out: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    b: usize,
    ic: usize,
    oc: usize,
) -> Result<(), GemmShapeError> {
    for (operand, len, rows, cols) in [
        ("dst", out.len(), b, oc),
        ("lhs", inp.len(), b, ic),
        ("rhs", weight.len(), oc, ic),
    ] {
        if len < rows * cols {
            return Err(GemmShapeError {
                operand,
                rows,
                cols,
                need: rows * cols,
                len,
            });
        }
    }
    if b == 0 || oc == 0 {
        return Ok(());
    }
    // (OC/tile, B, tile): each task writes one contiguous block, scattered into `out` below.
    let mut tiles = vec![0.0f32; oc.div_ceil(COLUMN_TILE) * b * COLUMN_TILE];
    tiles
        .par_chunks_mut(b * COLUMN_TILE)
        .enumerate()
        .for_each(|(t, block)| {
            let first = t * COLUMN_TILE;
            let cols = COLUMN_TILE.min(oc - first);
            for c in 0..cols {
                let w = &weight[(first + c) * ic..(first + c + 1) * ic];
                for r in 0..b {
                    block[r * COLUMN_TILE + c] = dot(&inp[r * ic..(r + 1) * ic], w);
                }
            }
        });
    for (t, block) in tiles.chunks(b * COLUMN_TILE).enumerate() {
        let first = t * COLUMN_TILE;
        let cols = COLUMN_TILE.min(oc - first);
        for r in 0..b {
            out[r * oc + first..r * oc + first + cols]
                .copy_from_slice(&block[r * COLUMN_TILE..r * COLUMN_TILE + cols]);
        }
    }
    Ok(())
}

/// `x · y` over [`LANES`] interleaved partial sums, then the remainder, then the lanes in order.
fn dot(x: &[f32], y: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let (xc, yc) = (x.chunks_exact(LANES), y.chunks_exact(LANES));
    let (xr, yr) = (xc.remainder(), yc.remainder());
    for (a, b) in xc.zip(yc) {
        for i in 0..LANES {
            acc[i] += a[i] * b[i];
        }
    }
    let tail: f32 = xr.iter().zip(yr).map(|(a, b)| a * b).sum();
    acc.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::matmul_forward_naive;
    use crate::ops::testing::{max_abs_diff, seeded_vec};

    #[test]
    fn rows_match_the_naive_product_and_do_not_depend_on_the_batch() {
        // Tolerance: f32 sums of up to 300 products of O(1) terms against an f64 reference.
        let tol = 1e-4;
        for (seed, (b, ic, oc)) in [(1, (1, 13, 5)), (2, (7, 96, 130)), (3, (12, 300, 259))] {
            let inp = seeded_vec(seed, b * ic);
            let weight = seeded_vec(seed + 100, oc * ic);
            let mut out = vec![0.0; b * oc];
            let mut out_ref = vec![0.0; b * oc];
            matmul_rows_forward(&mut out, &inp, &weight, b, ic, oc).unwrap();
            matmul_forward_naive(&mut out_ref, &inp, &weight, b, ic, oc);
            let d = max_abs_diff(&out, &out_ref);
            assert!(d < tol, "({b},{ic},{oc}) worst difference {d}");
            for r in 0..b {
                let mut alone = vec![0.0; oc];
                matmul_rows_forward(&mut alone, &inp[r * ic..(r + 1) * ic], &weight, 1, ic, oc)
                    .unwrap();
                assert_eq!(alone, out[r * oc..(r + 1) * oc], "row {r} of ({b},{ic},{oc})");
            }
        }
    }

    #[test]
    fn a_short_operand_is_refused_naming_it() {
        let mut out = vec![0.0; 4];
        let err = matmul_rows_forward(&mut out, &[1.0; 3], &[1.0; 4], 2, 2, 2).err();
        assert!(
            matches!(err, Some(GemmShapeError { operand: "lhs", .. })),
            "{err:?}"
        );
    }
}
