//! Linear layers as matrix products: `out = inp · weightᵀ` with weights stored `(out, in)` as
//! Hugging Face stores them.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Instant;

use crate::device::{GemmShapeError, MatrixView, sgemm};

/// One matrix product's shape as the model calls it: `(m, k) · (k, n)`, with whether each operand
/// is read transposed from its row-major storage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GemmCall {
    /// Rows of the output.
    pub m: usize,
    /// Columns of the output.
    pub n: usize,
    /// Shared dimension.
    pub k: usize,
    /// Whether the left operand is read transposed.
    pub lhs_transposed: bool,
    /// Whether the right operand is read transposed.
    pub rhs_transposed: bool,
    /// Whether the product is added to the output.
    pub accumulate: bool,
}

impl GemmCall {
    /// Floating-point operations of one call (two per multiply-add).
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64
    }

    /// Runs this product on row-major operands: `lhs` holds `(m, k)` (or `(k, m)` when transposed),
    /// `rhs` holds `(k, n)` (or `(n, k)` when transposed).
    ///
    /// # Errors
    /// [`GemmShapeError`] when a slice is too short for the shape.
    pub fn run(&self, dst: &mut [f32], lhs: &[f32], rhs: &[f32]) -> Result<(), GemmShapeError> {
        let lhs_view = if self.lhs_transposed {
            MatrixView::transposed(self.m)
        } else {
            MatrixView::row_major(self.k)
        };
        let rhs_view = if self.rhs_transposed {
            MatrixView::transposed(self.k)
        } else {
            MatrixView::row_major(self.n)
        };
        sgemm(
            self.m,
            self.n,
            self.k,
            dst,
            MatrixView::row_major(self.n),
            lhs,
            lhs_view,
            rhs,
            rhs_view,
            self.accumulate,
        )
    }
}

/// Calls and seconds spent per matrix-product shape, filled in when the model runs with a profile.
#[derive(Debug, Default)]
pub struct MatmulProfile {
    shapes: Mutex<BTreeMap<GemmCall, (u64, f64)>>,
}

impl MatmulProfile {
    /// Every shape seen, with its number of calls and total seconds.
    pub fn shapes(&self) -> Vec<(GemmCall, u64, f64)> {
        match self.shapes.lock() {
            Ok(map) => map.iter().map(|(c, (n, s))| (*c, *n, *s)).collect(),
            Err(poisoned) => poisoned
                .get_ref()
                .iter()
                .map(|(c, (n, s))| (*c, *n, *s))
                .collect(),
        }
    }

    /// Total seconds spent in matrix products.
    pub fn seconds(&self) -> f64 {
        self.shapes().iter().map(|(_, _, s)| s).sum()
    }

    /// Forgets everything recorded.
    pub fn clear(&self) {
        match self.shapes.lock() {
            Ok(mut map) => map.clear(),
            Err(poisoned) => poisoned.into_inner().clear(),
        }
    }

    fn record(&self, call: GemmCall, seconds: f64) {
        let mut map = match self.shapes.lock() {
            Ok(map) => map,
            Err(poisoned) => poisoned.into_inner(),
        };
        let entry = map.entry(call).or_insert((0, 0.0));
        entry.0 += 1;
        entry.1 += seconds;
    }
}

fn run_profiled(
    call: GemmCall,
    dst: &mut [f32],
    lhs: &[f32],
    rhs: &[f32],
    profile: Option<&MatmulProfile>,
) -> Result<(), GemmShapeError> {
    match profile {
        None => call.run(dst, lhs, rhs),
        Some(p) => {
            let start = Instant::now();
            call.run(dst, lhs, rhs)?;
            p.record(call, start.elapsed().as_secs_f64());
            Ok(())
        }
    }
}

/// `out (N, OC) = inp (N, IC) · weight (OC, IC)ᵀ`.
///
/// # Errors
/// [`GemmShapeError`] when a slice is too short for `n`, `ic`, `oc`.
pub fn matmul_forward(
    out: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    n: usize,
    ic: usize,
    oc: usize,
    profile: Option<&MatmulProfile>,
) -> Result<(), GemmShapeError> {
    let call = GemmCall {
        m: n,
        n: oc,
        k: ic,
        lhs_transposed: false,
        rhs_transposed: true,
        accumulate: false,
    };
    run_profiled(call, out, inp, weight, profile)
}

/// Backward of [`matmul_forward`]: `dinp (N, IC) += dout · weight`, `dweight (OC, IC) += doutᵀ · inp`.
///
/// # Errors
/// [`GemmShapeError`] when a slice is too short for `n`, `ic`, `oc`.
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward(
    dinp: &mut [f32],
    dweight: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    n: usize,
    ic: usize,
    oc: usize,
    profile: Option<&MatmulProfile>,
) -> Result<(), GemmShapeError> {
    let dinp_call = GemmCall {
        m: n,
        n: ic,
        k: oc,
        lhs_transposed: false,
        rhs_transposed: false,
        accumulate: true,
    };
    run_profiled(dinp_call, dinp, dout, weight, profile)?;
    let dweight_call = GemmCall {
        m: oc,
        n: ic,
        k: n,
        lhs_transposed: true,
        rhs_transposed: false,
        accumulate: true,
    };
    run_profiled(dweight_call, dweight, dout, inp, profile)
}

/// The plain-loop twin of [`matmul_forward`], the reference its tests compare against.
pub fn matmul_forward_naive(
    out: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    n: usize,
    ic: usize,
    oc: usize,
) {
    for i in 0..n {
        for o in 0..oc {
            let mut acc = 0.0f64;
            for c in 0..ic {
                acc += f64::from(inp[i * ic + c]) * f64::from(weight[o * ic + c]);
            }
            out[i * oc + o] = acc as f32;
        }
    }
}

/// The plain-loop twin of [`matmul_backward`].
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward_naive(
    dinp: &mut [f32],
    dweight: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    n: usize,
    ic: usize,
    oc: usize,
) {
    for i in 0..n {
        for c in 0..ic {
            let mut acc = 0.0f64;
            for o in 0..oc {
                acc += f64::from(dout[i * oc + o]) * f64::from(weight[o * ic + c]);
            }
            dinp[i * ic + c] += acc as f32;
        }
    }
    for o in 0..oc {
        for c in 0..ic {
            let mut acc = 0.0f64;
            for i in 0..n {
                acc += f64::from(dout[i * oc + o]) * f64::from(inp[i * ic + c]);
            }
            dweight[o * ic + c] += acc as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::{max_abs_diff, seeded_vec};

    #[test]
    fn matmul_matches_its_naive_twin_forward_and_backward() {
        // Tolerance: f32 sums of up to 300 products of O(1) terms against an f64 reference.
        let tol = 1e-4;
        for (seed, (n, ic, oc)) in [(1, (7, 13, 5)), (2, (64, 96, 130)), (3, (300, 64, 259))] {
            let inp = seeded_vec(seed, n * ic);
            let weight = seeded_vec(seed + 100, oc * ic);
            let dout = seeded_vec(seed + 200, n * oc);
            let mut out = vec![0.0; n * oc];
            let mut out_ref = vec![0.0; n * oc];
            matmul_forward(&mut out, &inp, &weight, n, ic, oc, None).unwrap();
            matmul_forward_naive(&mut out_ref, &inp, &weight, n, ic, oc);
            let d = max_abs_diff(&out, &out_ref);
            assert!(d < tol, "forward ({n},{ic},{oc}) worst difference {d}");

            let base_dinp = seeded_vec(seed + 300, n * ic);
            let base_dw = seeded_vec(seed + 400, oc * ic);
            let (mut dinp, mut dw) = (base_dinp.clone(), base_dw.clone());
            let (mut dinp_ref, mut dw_ref) = (base_dinp, base_dw);
            let profile = MatmulProfile::default();
            matmul_backward(
                &mut dinp,
                &mut dw,
                &dout,
                &inp,
                &weight,
                n,
                ic,
                oc,
                Some(&profile),
            )
            .unwrap();
            matmul_backward_naive(&mut dinp_ref, &mut dw_ref, &dout, &inp, &weight, n, ic, oc);
            let d = max_abs_diff(&dinp, &dinp_ref).max(max_abs_diff(&dw, &dw_ref));
            assert!(d < tol, "backward ({n},{ic},{oc}) worst difference {d}");
            assert_eq!(profile.shapes().len(), 2);
        }
    }
}
