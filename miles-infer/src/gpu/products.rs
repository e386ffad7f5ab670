//! A pass's products with the weights: skinny products (`Gpu::skinny_gemm`) where the pass has
//! few rows (a decode step), cuBLAS otherwise; and the residual adds with the norm after them,
//! which a sliced skinny product fuses into the sum of its slices.

use half::bf16;
use miles_core::device::{DeviceError, Gemm, Gpu, GpuSlice, Transpose};
use miles_core::ops::gpu::{Skinny, SkinnyOut};

/// `y = x W^T` for an HF weight `W (out, inp)` of `rows` rows, through cuBLAS.
fn linear(rows: usize, out: usize, inp: usize) -> Gemm {
    Gemm::new(rows, out, inp, Transpose::No, Transpose::Yes)
}

/// The norm that follows a residual add: its output, its weight and epsilon.
pub(super) type Norm = (GpuSlice<bf16>, GpuSlice<bf16>, f32);

/// The products of one pass of `rows` rows.
#[derive(Clone, Copy)]
pub(super) struct Products<'a> {
    pub(super) gpu: &'a Gpu,
    pub(super) rows: usize,
    /// The scratch for a sliced product's partial sums.
    pub(super) partials: GpuSlice<f32>,
    pub(super) multiprocessors: usize,
}

impl Products<'_> {
    /// The skinny product of `x W^T` for this pass, where the kernel takes its shape and its
    /// operands' alignment (a weight after a parameter of odd length may not be).
    fn plan(&self, x: GpuSlice<bf16>, w: GpuSlice<bf16>, out: usize, inp: usize) -> Option<Skinny> {
        let aligned = x.address().is_multiple_of(16) && w.address().is_multiple_of(16);
        Skinny::plan(self.rows, out, inp, self.multiprocessors).filter(|_| aligned)
    }

    /// `y = x W^T`, `x` of `rows` rows and `y` of `w.len() / inp` columns.
    pub(super) fn linear(
        &self,
        y: GpuSlice<bf16>,
        x: GpuSlice<bf16>,
        w: GpuSlice<bf16>,
    ) -> Result<(), DeviceError> {
        let (inp, out) = self.shape(x, w)?;
        let g = self.gpu;
        match self.plan(x, w, out, inp) {
            Some(p) if p.splits == 1 => {
                let y = SkinnyOut::Bf16 {
                    y,
                    accumulate: false,
                };
                g.skinny_gemm(p, y, x, w)
            }
            Some(p) => {
                let part = self.partials.sub(0, p.partial_len())?;
                g.skinny_gemm(p, SkinnyOut::Partials(part), x, w)?;
                g.split_sum(y, part, p.splits, false)
            }
            None => g.gemm(linear(self.rows, out, inp), y, x, w),
        }
    }

    /// `y = x W^T` in fp32 (the logits): skinny where it takes one slice, cuBLAS otherwise.
    pub(super) fn fp32(
        &self,
        y: GpuSlice<f32>,
        x: GpuSlice<bf16>,
        w: GpuSlice<bf16>,
    ) -> Result<(), DeviceError> {
        let (inp, out) = self.shape(x, w)?;
        match self.plan(x, w, out, inp) {
            Some(p) if p.splits == 1 => self.gpu.skinny_gemm(p, SkinnyOut::F32(y), x, w),
            _ => self.gpu.gemm(linear(self.rows, out, inp), y, x, w),
        }
    }

    /// `x += a W^T` (the residual stream), then `ln = rmsnorm(x) * weight` where `norm` is
    /// given; sliced, the norm is computed with the sum of the slices.
    pub(super) fn residual(
        &self,
        x: GpuSlice<bf16>,
        a: GpuSlice<bf16>,
        w: GpuSlice<bf16>,
        norm: Option<Norm>,
    ) -> Result<(), DeviceError> {
        let (inp, out) = self.shape(a, w)?;
        let g = self.gpu;
        match self.plan(a, w, out, inp) {
            Some(p) if p.splits > 1 => {
                let part = self.partials.sub(0, p.partial_len())?;
                g.skinny_gemm(p, SkinnyOut::Partials(part), a, w)?;
                return match norm {
                    Some((ln, weight, eps)) => {
                        g.split_sum_rmsnorm(x, ln, part, weight, p.splits, eps)
                    }
                    None => g.split_sum(x, part, p.splits, true),
                };
            }
            Some(p) => {
                let y = SkinnyOut::Bf16 {
                    y: x,
                    accumulate: true,
                };
                g.skinny_gemm(p, y, a, w)?;
            }
            None => g.gemm(linear(self.rows, out, inp).accumulate(), x, a, w)?,
        }
        match norm {
            Some((ln, weight, eps)) => g.rmsnorm_forward(ln, None, x, weight, eps),
            None => Ok(()),
        }
    }

    /// The inner dimension (`x`'s row width) and the output columns of `x W^T`.
    fn shape(&self, x: GpuSlice<bf16>, w: GpuSlice<bf16>) -> Result<(usize, usize), DeviceError> {
        let inp = x.len() / self.rows.max(1);
        if inp == 0 || !w.len().is_multiple_of(inp) {
            return Err(DeviceError::ShapeMismatch {
                what: "product weight (whole rows of the input's width)",
                expected: inp,
                actual: w.len(),
            });
        }
        Ok((inp, w.len() / inp))
    }
}
