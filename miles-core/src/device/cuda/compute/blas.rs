//! Matrix products through cuBLAS: bf16 inputs, fp32 accumulation, row-major shapes.
//!
//! cuBLAS is column-major; a row-major `C = op(A) op(B)` is the column-major
//! `C^T = op(B)^T op(A)^T`, so each call swaps the operands and passes the row-major leading
//! dimensions unchanged.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::{result, sys};
use cudarc::cublaslt::sys as lt;
use cudarc::driver::CudaStream;
use half::bf16;

use super::{Gpu, GpuElement, GpuSlice};
use crate::device::DeviceError;

/// Whether an operand is used as stored or transposed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transpose {
    /// As stored.
    No,
    /// Transposed.
    Yes,
}

/// One row-major product `C (m, n) = alpha * op(A) (m, k) * op(B) (k, n) + beta * C`, repeated
/// `batch` times over operands `stride_*` elements apart, or split along `k` into `split`
/// partial products written one after another.
#[derive(Clone, Copy, Debug)]
pub struct Gemm {
    /// Rows of `C`.
    pub m: usize,
    /// Columns of `C`.
    pub n: usize,
    /// The inner dimension.
    pub k: usize,
    /// `A` is stored `(m, k)` for [`Transpose::No`], `(k, m)` for [`Transpose::Yes`].
    pub a: Transpose,
    /// `B` is stored `(k, n)` for [`Transpose::No`], `(n, k)` for [`Transpose::Yes`].
    pub b: Transpose,
    /// Scale of the product.
    pub alpha: f32,
    /// Scale of `C`'s old value: 0 overwrites, 1 accumulates.
    pub beta: f32,
    /// Products in the batch (1 for a plain product).
    pub batch: usize,
    /// Elements between consecutive `A`s, `B`s and `C`s of a batch.
    pub stride_a: usize,
    /// As `stride_a`, for `B`.
    pub stride_b: usize,
    /// As `stride_a`, for `C`.
    pub stride_c: usize,
    /// Slices of `k` (1 for a whole product); see [`Gemm::split_k`].
    pub split: usize,
}

impl Gemm {
    /// A single product `C (m, n) = op(A) op(B)` that overwrites `C`.
    pub fn new(m: usize, n: usize, k: usize, a: Transpose, b: Transpose) -> Gemm {
        Gemm {
            m,
            n,
            k,
            a,
            b,
            alpha: 1.0,
            beta: 0.0,
            batch: 1,
            stride_a: 0,
            stride_b: 0,
            stride_c: 0,
            split: 1,
        }
    }

    /// The same product, adding into `C` (`beta = 1`).
    pub fn accumulate(self) -> Gemm {
        Gemm { beta: 1.0, ..self }
    }

    /// The same product scaled by `alpha`.
    pub fn scaled(self, alpha: f32) -> Gemm {
        Gemm { alpha, ..self }
    }

    /// `batch` products, each operand's consecutive matrices `stride_*` elements apart.
    pub fn batched(self, batch: usize, stride_a: usize, stride_b: usize, stride_c: usize) -> Gemm {
        Gemm {
            batch,
            stride_a,
            stride_b,
            stride_c,
            ..self
        }
    }

    /// The same single product with `k` cut into `parts` equal slices: `C` holds `parts`
    /// fp32 partial products `(m, n)` one after another, slice `i` of `k` giving partial `i`,
    /// which the caller sums. Where `C` has few columns a product keeps few multiprocessors
    /// busy; its slices run side by side.
    pub fn split_k(self, parts: usize) -> Gemm {
        Gemm {
            split: parts,
            ..self
        }
    }

    /// The row-major leading dimensions of `a`, `b` and `c`: an `a` stored `(m, k)` has rows
    /// of `k`, and so on.
    pub(super) fn leading_dims(&self) -> [usize; 3] {
        let lda = if self.a == Transpose::No {
            self.k
        } else {
            self.m
        };
        let ldb = if self.b == Transpose::No {
            self.n
        } else {
            self.k
        };
        [lda, ldb, self.n]
    }

    pub(super) fn check<C>(
        &self,
        c: &GpuSlice<C>,
        a: &GpuSlice<bf16>,
        b: &GpuSlice<bf16>,
    ) -> Result<(), DeviceError>
    where
        C: GpuElement,
    {
        let need = |stride: usize, one: usize| (self.batch.max(1) - 1) * stride + one;
        for (what, len, needed) in [
            ("gemm A", a.len(), need(self.stride_a, self.m * self.k)),
            ("gemm B", b.len(), need(self.stride_b, self.k * self.n)),
            (
                "gemm C",
                c.len(),
                need(self.stride_c, self.m * self.n) * self.split.max(1),
            ),
        ] {
            if len < needed {
                return Err(DeviceError::ShapeMismatch {
                    what,
                    expected: needed,
                    actual: len,
                });
            }
        }
        let fits = [self.m, self.n, self.k, self.batch, self.split]
            .iter()
            .all(|&d| i32::try_from(d).is_ok());
        if !fits || self.batch == 0 {
            return Err(DeviceError::ShapeMismatch {
                what: "gemm dimension",
                expected: i32::MAX as usize,
                actual: self.m.max(self.n).max(self.k).max(self.batch),
            });
        }
        let single = self.batch == 1 && self.beta == 0.0;
        if self.split == 0 || !self.k.is_multiple_of(self.split) || self.split > 1 && !single {
            return Err(DeviceError::ShapeMismatch {
                what: "gemm split of k (a divisor of k, in a single product that overwrites C)",
                expected: self.k,
                actual: self.split,
            });
        }
        Ok(())
    }

    /// The split product as the batch cuBLAS runs: each slice's inner dimension and the
    /// elements between consecutive slices of `A`, of `B` and of `C`.
    fn slices(&self) -> (usize, [usize; 3]) {
        let k = self.k / self.split;
        let stride_a = if self.a == Transpose::No {
            k
        } else {
            k * self.m
        };
        let stride_b = if self.b == Transpose::Yes {
            k
        } else {
            k * self.n
        };
        (k, [stride_a, stride_b, self.m * self.n])
    }
}

/// An fp32 or bf16 output type of a product.
pub trait GemmOutput: GpuElement {
    /// Its cuBLAS data type.
    const TYPE: sys::cudaDataType;
    /// The same, as cuBLASLt spells it.
    const LT_TYPE: lt::cudaDataType;
}

impl GemmOutput for f32 {
    const TYPE: sys::cudaDataType = sys::cudaDataType::CUDA_R_32F;
    const LT_TYPE: lt::cudaDataType = lt::cudaDataType::CUDA_R_32F;
}

impl GemmOutput for bf16 {
    const TYPE: sys::cudaDataType = sys::cudaDataType::CUDA_R_16BF;
    const LT_TYPE: lt::cudaDataType = lt::cudaDataType::CUDA_R_16BF;
}

/// A cuBLAS handle bound to the compute stream.
pub(super) struct Blas {
    handle: sys::cublasHandle_t,
    _stream: Arc<CudaStream>,
}

// SAFETY: the handle is used only through `&Gpu` calls that queue on one stream; cuBLAS handles
// may be used from any thread as long as calls do not overlap, which `Gpu`'s users guarantee by
// driving one GPU from one thread at a time.
unsafe impl Send for Blas {}
// SAFETY: as above.
unsafe impl Sync for Blas {}

impl Blas {
    pub(super) fn new(stream: &Arc<CudaStream>) -> Result<Blas, DeviceError> {
        stream
            .context()
            .bind_to_thread()
            .map_err(super::cuda("cuCtxSetCurrent"))?;
        let handle = result::create_handle().map_err(blas_error("cublasCreate"))?;
        // SAFETY: a live handle and a live stream of the current context.
        unsafe { result::set_stream(handle, stream.cu_stream() as sys::cudaStream_t) }
            .map_err(blas_error("cublasSetStream"))?;
        Ok(Blas {
            handle,
            _stream: Arc::clone(stream),
        })
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: created in `Blas::new` and destroyed once.
        if let Err(error) = unsafe { result::destroy_handle(self.handle) } {
            tracing::error!(?error, "cannot destroy the cublas handle");
        }
    }
}

fn blas_error(call: &'static str) -> impl Fn(result::CublasError) -> DeviceError {
    move |error| DeviceError::Cuda {
        call,
        message: format!("{error:?}"),
    }
}

pub(super) fn op(t: Transpose) -> sys::cublasOperation_t {
    match t {
        Transpose::No => sys::cublasOperation_t::CUBLAS_OP_N,
        Transpose::Yes => sys::cublasOperation_t::CUBLAS_OP_T,
    }
}

impl Gpu {
    /// Makes the cuBLAS products queued on this stream from now on leave `spare` of the GPU's
    /// multiprocessors to other streams (cuBLAS's SM count target); 0 gives them all back.
    /// Products of all the multiprocessors fill every one of them for their whole run, so a
    /// memory-bound kernel of another stream gets none while they run; with some spare, it
    /// runs beside them.
    ///
    /// # Errors
    /// cuBLAS's error.
    pub fn spare_multiprocessors(&self, spare: usize) -> Result<(), DeviceError> {
        let target = match spare {
            0 => 0,
            n => self.multiprocessors.saturating_sub(n).max(1) as i32,
        };
        // SAFETY: a live handle; the target is an int cuBLAS reads at the call.
        unsafe { sys::cublasSetSmCountTarget(self.blas.handle, target) }
            .result()
            .map_err(blas_error("cublasSetSmCountTarget"))
    }

    /// Queues the row-major product `g` of bf16 `a` and `b` into `c` (fp32 or bf16), accumulating
    /// in fp32, with cuBLAS's own pick of algorithm.
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`] when an operand is too short for the shape or a split of
    /// `k` is refused ([`Gemm::split_k`]: a divisor of `k`, in a single product that overwrites
    /// `C`); cuBLAS's error.
    pub fn gemm<C: GemmOutput>(
        &self,
        g: Gemm,
        c: GpuSlice<C>,
        a: GpuSlice<bf16>,
        b: GpuSlice<bf16>,
    ) -> Result<(), DeviceError> {
        g.check(&c, &a, &b)?;
        self.stream
            .context()
            .bind_to_thread()
            .map_err(super::cuda("cuCtxSetCurrent"))?;
        let [lda, ldb, ldc] = g.leading_dims().map(|ld| ld as i32);
        let (alpha, beta) = (g.alpha, g.beta);
        let alpha_ptr = (&alpha as *const f32).cast::<c_void>();
        let beta_ptr = (&beta as *const f32).cast::<c_void>();
        let bf = sys::cudaDataType::CUDA_R_16BF;
        let compute = sys::cublasComputeType_t::CUBLAS_COMPUTE_32F;
        let algo = sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP;
        // SAFETY: `check` made sure every operand spans the elements the shape and strides
        // reach; the pointers are device addresses; alpha and beta are host scalars that live
        // through the call (cuBLAS reads them before returning in host pointer mode).
        let status = unsafe {
            if g.batch == 1 && g.split == 1 {
                result::gemm_ex(
                    self.blas.handle,
                    op(g.b),
                    op(g.a),
                    g.n as i32,
                    g.m as i32,
                    g.k as i32,
                    alpha_ptr,
                    b.address() as *const c_void,
                    bf,
                    ldb,
                    a.address() as *const c_void,
                    bf,
                    lda,
                    beta_ptr,
                    c.address() as *mut c_void,
                    C::TYPE,
                    ldc,
                    compute,
                    algo,
                )
            } else {
                let (k, [stride_a, stride_b, stride_c], batch) = if g.split > 1 {
                    let (k, strides) = g.slices();
                    (k, strides, g.split)
                } else {
                    (g.k, [g.stride_a, g.stride_b, g.stride_c], g.batch)
                };
                result::gemm_strided_batched_ex(
                    self.blas.handle,
                    op(g.b),
                    op(g.a),
                    g.n as i32,
                    g.m as i32,
                    k as i32,
                    alpha_ptr,
                    b.address() as *const c_void,
                    bf,
                    ldb,
                    stride_b as i64,
                    a.address() as *const c_void,
                    bf,
                    lda,
                    stride_a as i64,
                    beta_ptr,
                    c.address() as *mut c_void,
                    C::TYPE,
                    ldc,
                    stride_c as i64,
                    batch as i32,
                    compute,
                    algo,
                )
            }
        };
        status.map_err(blas_error("cublasGemmEx"))
    }
}
