//! A batch-invariant linear layer for decoding: a row's result does not depend on how many rows
//! share the call.
//!
//! The `gemm` crate picks its kernel and blocking from the whole shape (one row takes a
//! matrix-vector path, more rows a tiled one), so a sequence decoded alone and the same sequence
//! decoded in a batch of eight would round differently and, after sampling, could diverge. The
//! rollout engine needs the same tokens whatever the batch, and after a preempted sequence is
//! recomputed. So rows go through `gemm` in chunks of always [`ROWS`] rows (the last chunk padded
//! with zero rows): every call has the same shape, and within one shape an output element's sum
//! runs over the shared dimension in an order that depends on its row's data only (the kernels
//! split work across rows and columns, never along the sum). The tests check a row alone against
//! the same row in a batch, bit for bit.

use crate::device::{GemmShapeError, MatrixView, sgemm};

/// Rows of every product: large enough that a chunk reads the weights efficiently, small
/// enough that a batch of one pays little for the padding (decoding is bound by reading the
/// weights).
const ROWS: usize = 16;

/// `out (B, OC) = inp (B, IC) · weight (OC, IC)ᵀ`, each row's result independent of `B`.
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
    let mut lhs = vec![0.0f32; ROWS * ic]; // (ROWS, IC), zero-padded
    let mut dst = vec![0.0f32; ROWS * oc]; // (ROWS, OC)
    for first in (0..b).step_by(ROWS) {
        let rows = ROWS.min(b - first);
        lhs[..rows * ic].copy_from_slice(&inp[first * ic..(first + rows) * ic]);
        lhs[rows * ic..].fill(0.0);
        sgemm(
            ROWS,
            oc,
            ic,
            &mut dst,
            MatrixView::row_major(oc),
            &lhs,
            MatrixView::row_major(ic),
            weight,
            MatrixView::transposed(ic),
            false,
        )?;
        out[first * oc..(first + rows) * oc].copy_from_slice(&dst[..rows * oc]);
    }
    Ok(())
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
        for (seed, (b, ic, oc)) in [(1, (1, 13, 5)), (2, (7, 96, 130)), (3, (37, 301, 259))] {
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
                assert_eq!(
                    alone,
                    out[r * oc..(r + 1) * oc],
                    "row {r} of ({b},{ic},{oc})"
                );
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
