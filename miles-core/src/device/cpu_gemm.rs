//! A safe wrapper over the `gemm` crate's single-precision matrix product for the CPU device.
//!
//! `gemm::gemm` takes raw pointers and strides; this is the one place that calls it. Every
//! operand is a slice whose length is checked against its shape and strides before the call, so
//! the kernels in `ops/` never touch a pointer.

/// How a matrix operand sits in its slice: element `(i, j)` is at `i * row_stride + j * col_stride`.
///
/// A row-major `(rows, cols)` matrix has `row_stride = cols, col_stride = 1`; its transpose is
/// the same slice with the two strides swapped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatrixView {
    /// Distance between consecutive rows, in elements.
    pub row_stride: usize,
    /// Distance between consecutive columns, in elements.
    pub col_stride: usize,
}

impl MatrixView {
    /// A row-major matrix with `cols` columns.
    pub fn row_major(cols: usize) -> Self {
        Self {
            row_stride: cols,
            col_stride: 1,
        }
    }

    /// The transpose of a row-major matrix with `cols` columns (so it has `cols` rows).
    pub fn transposed(cols: usize) -> Self {
        Self {
            row_stride: 1,
            col_stride: cols,
        }
    }

    /// Elements a `(rows, cols)` matrix in this view needs in its slice.
    fn required_len(&self, rows: usize, cols: usize) -> usize {
        if rows == 0 || cols == 0 {
            return 0;
        }
        (rows - 1) * self.row_stride + (cols - 1) * self.col_stride + 1
    }
}

/// A matrix operand too short for its shape and strides.
#[derive(Debug, thiserror::Error)]
#[error(
    "matrix product operand {operand} of shape ({rows}, {cols}) needs {need} elements, its slice has {len}; check the caller's shapes"
)]
pub struct GemmShapeError {
    /// Which operand (`dst`, `lhs`, `rhs`).
    pub operand: &'static str,
    /// Rows of the operand.
    pub rows: usize,
    /// Columns of the operand.
    pub cols: usize,
    /// Elements the shape needs.
    pub need: usize,
    /// Elements the slice has.
    pub len: usize,
}

fn check(
    operand: &'static str,
    len: usize,
    view: MatrixView,
    rows: usize,
    cols: usize,
) -> Result<(), GemmShapeError> {
    let need = view.required_len(rows, cols);
    if len < need {
        return Err(GemmShapeError {
            operand,
            rows,
            cols,
            need,
            len,
        });
    }
    Ok(())
}

/// Computes `dst (m, n) = lhs (m, k) · rhs (k, n)`, or adds the product to `dst` when `accumulate`.
///
/// Runs on rayon's thread pool when the product is large enough to gain from it.
///
/// # Errors
/// [`GemmShapeError`] when a slice is shorter than its shape and strides need; nothing is written.
#[allow(clippy::too_many_arguments)]
pub fn sgemm(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    dst_view: MatrixView,
    lhs: &[f32],
    lhs_view: MatrixView,
    rhs: &[f32],
    rhs_view: MatrixView,
    accumulate: bool,
) -> Result<(), GemmShapeError> {
    check("dst", dst.len(), dst_view, m, n)?;
    check("lhs", lhs.len(), lhs_view, m, k)?;
    check("rhs", rhs.len(), rhs_view, k, n)?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                for j in 0..n {
                    dst[i * dst_view.row_stride + j * dst_view.col_stride] = 0.0;
                }
            }
        }
        return Ok(());
    }
    // Threads pay off from about a million multiply-adds; below that the fork costs more.
    let parallelism = if m * n * k >= 1 << 20 {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the three slices were checked above to hold every element their shape and strides
    // address (`required_len`), strides fit in isize because they index inside those slices,
    // `dst` is a unique borrow so it aliases neither operand, and gemm only reads `lhs`/`rhs`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            dst_view.col_stride as isize,
            dst_view.row_stride as isize,
            accumulate,
            lhs.as_ptr(),
            lhs_view.col_stride as isize,
            lhs_view.row_stride as isize,
            rhs.as_ptr(),
            rhs_view.col_stride as isize,
            rhs_view.row_stride as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_operand_is_refused_naming_it() {
        let mut dst = vec![0.0f32; 4];
        let lhs = vec![1.0f32; 3];
        let rhs = vec![1.0f32; 4];
        let err = sgemm(
            2,
            2,
            2,
            &mut dst,
            MatrixView::row_major(2),
            &lhs,
            MatrixView::row_major(2),
            &rhs,
            MatrixView::row_major(2),
            false,
        )
        .err();
        assert!(
            matches!(err, Some(GemmShapeError { operand: "lhs", .. })),
            "{err:?}"
        );
    }

    #[test]
    fn transposed_views_multiply_as_transposes() {
        // lhs^T where lhs is (2, 3) row-major; rhs (2, 2).
        let lhs = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let rhs = [1.0f32, 0.5, -1.0, 2.0];
        let mut dst = vec![0.0f32; 6];
        sgemm(
            3,
            2,
            2,
            &mut dst,
            MatrixView::row_major(2),
            &lhs,
            MatrixView::transposed(3),
            &rhs,
            MatrixView::row_major(2),
            false,
        )
        .unwrap();
        // lhs^T = [[1,4],[2,5],[3,6]]
        let want = [-3.0f32, 8.5, -3.0, 11.0, -3.0, 13.5];
        assert_eq!(dst, want);
    }
}
