//! Matrix products through cuBLASLt with a named algorithm: the candidates its heuristic
//! offers for a shape, and a product run with one of them, for `miles bench gemm` to set
//! against [`Gpu::gemm`] (cuBLAS's own pick). The shapes are [`Gemm`]'s row-major ones,
//! swapped into cuBLAS's column-major order as `blas.rs` does.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublaslt::sys as lt;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use super::blas::op;
use super::{Gemm, GemmOutput, Gpu, GpuSlice, Transpose};
use crate::device::DeviceError;
use half::bf16;

/// Bytes of the device workspace cuBLASLt's split-K algorithms may use. It is allocated once
/// with the handle, outside the memory manager's tags (as cuBLAS's own workspace is), so a
/// captured graph's products keep a workspace at the same address.
pub(super) const LT_WORKSPACE_BYTES: usize = 32 << 20;

/// A cuBLASLt handle and its workspace.
pub(super) struct Lt {
    handle: lt::cublasLtHandle_t,
    /// Held for its address: the algorithms write their split-K partials there.
    _workspace: CudaSlice<u8>,
    /// `workspace`'s device address, taken once (not under a capture).
    workspace_address: u64,
}

// SAFETY: as `Blas`: the handle is used only through `&Gpu` calls that queue on one stream,
// from one thread at a time.
unsafe impl Send for Lt {}
// SAFETY: as above.
unsafe impl Sync for Lt {}

impl Lt {
    pub(super) fn new(stream: &Arc<CudaStream>) -> Result<Lt, DeviceError> {
        let workspace = stream
            .alloc_zeros::<u8>(LT_WORKSPACE_BYTES)
            .map_err(super::cuda("cuMemAlloc (cublasLt workspace)"))?;
        let workspace_address = workspace.device_ptr(stream).0;
        let mut handle = std::ptr::null_mut();
        // SAFETY: an out pointer to a handle.
        check("cublasLtCreate", unsafe { lt::cublasLtCreate(&mut handle) })?;
        Ok(Lt {
            handle,
            _workspace: workspace,
            workspace_address,
        })
    }
}

impl Drop for Lt {
    fn drop(&mut self) {
        // SAFETY: created in `Lt::new` and destroyed once.
        let status = unsafe { lt::cublasLtDestroy(self.handle) };
        if let Err(error) = check("cublasLtDestroy", status) {
            tracing::error!(%error, "cannot destroy the cublasLt handle");
        }
    }
}

fn check(call: &'static str, status: lt::cublasStatus_t) -> Result<(), DeviceError> {
    match status {
        lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS => Ok(()),
        other => Err(DeviceError::Cuda {
            call,
            message: format!("{other:?}"),
        }),
    }
}

/// One algorithm cuBLASLt's heuristic offered for a product shape.
#[derive(Clone, Copy, Debug)]
pub struct GemmAlgo {
    algo: lt::cublasLtMatmulAlgo_t,
    waves: f32,
}

impl GemmAlgo {
    /// The heuristic's estimate of the waves of blocks it runs on the device.
    pub fn waves(&self) -> f32 {
        self.waves
    }

    /// One 4-byte attribute of its configuration; -1 when cuBLASLt does not say.
    fn config(&self, attr: lt::cublasLtMatmulAlgoConfigAttributes_t) -> i64 {
        let mut value = 0u32;
        let mut written = 0usize;
        // SAFETY: a live algorithm value and a 4-byte buffer for a 4-byte attribute.
        let status = unsafe {
            lt::cublasLtMatmulAlgoConfigGetAttribute(
                &self.algo,
                attr,
                (&mut value as *mut u32).cast(),
                size_of::<u32>(),
                &mut written,
            )
        };
        check("cublasLtMatmulAlgoConfigGetAttribute", status).map_or(-1, |()| i64::from(value))
    }

    /// Its configuration, as cuBLASLt names it: algorithm id, tile, stages, split-K count,
    /// reduction scheme and cluster shape ids.
    pub fn describe(&self) -> String {
        let get = |attr| self.config(attr);
        use lt::cublasLtMatmulAlgoConfigAttributes_t as A;
        format!(
            "id {} tile {} stages {} split-k {} reduction {} cluster {}",
            get(A::CUBLASLT_ALGO_CONFIG_ID),
            get(A::CUBLASLT_ALGO_CONFIG_TILE_ID),
            get(A::CUBLASLT_ALGO_CONFIG_STAGES_ID),
            get(A::CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
            get(A::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
            get(A::CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID),
        )
    }
}

/// The descriptors of one product shape, destroyed on drop.
struct Plan {
    desc: lt::cublasLtMatmulDesc_t,
    /// Column-major layouts of cuBLAS's A (our `b`), B (our `a`) and C = D (our `c`).
    layouts: [lt::cublasLtMatrixLayout_t; 3],
}

impl Plan {
    fn new(g: &Gemm, out: lt::cudaDataType) -> Result<Plan, DeviceError> {
        if g.batch != 1 || g.split != 1 {
            return Err(DeviceError::ShapeMismatch {
                what: "cublasLt products are single (batch 1, k whole)",
                expected: 1,
                actual: g.batch.max(g.split),
            });
        }
        let mut plan = Plan {
            desc: std::ptr::null_mut(),
            layouts: [std::ptr::null_mut(); 3],
        };
        // SAFETY: an out pointer to a descriptor; fp32 compute and scale types.
        check("cublasLtMatmulDescCreate", unsafe {
            lt::cublasLtMatmulDescCreate(
                &mut plan.desc,
                lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                lt::cudaDataType::CUDA_R_32F,
            )
        })?;
        use lt::cublasLtMatmulDescAttributes_t as D;
        for (attr, t) in [
            (D::CUBLASLT_MATMUL_DESC_TRANSA, g.b),
            (D::CUBLASLT_MATMUL_DESC_TRANSB, g.a),
        ] {
            let value = op(t) as i32;
            // SAFETY: a live descriptor and a 4-byte value for a 4-byte attribute.
            check("cublasLtMatmulDescSetAttribute", unsafe {
                lt::cublasLtMatmulDescSetAttribute(
                    plan.desc,
                    attr,
                    (&value as *const i32).cast(),
                    size_of::<i32>(),
                )
            })?;
        }
        // cuBLAS's A is our `b` as (n, k) under its op, B our `a` as (k, m); stored dims
        // and leading dimensions of the row-major operands read column-major.
        let stored = |t: Transpose, rows: usize, cols: usize, ld: usize| match t {
            Transpose::No => (rows, cols, ld),
            Transpose::Yes => (cols, rows, ld),
        };
        let [lda, ldb, _] = g.leading_dims();
        let bf = lt::cudaDataType::CUDA_R_16BF;
        let shapes = [
            (bf, stored(g.b, g.n, g.k, ldb)),
            (bf, stored(g.a, g.k, g.m, lda)),
            (out, (g.n, g.m, g.n)),
        ];
        for (layout, (ty, (rows, cols, ld))) in plan.layouts.iter_mut().zip(shapes) {
            // SAFETY: an out pointer to a layout.
            check("cublasLtMatrixLayoutCreate", unsafe {
                lt::cublasLtMatrixLayoutCreate(layout, ty, rows as u64, cols as u64, ld as i64)
            })?;
        }
        Ok(plan)
    }
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each was created by `Plan::new` (or is null where creation stopped) and is
        // destroyed once.
        unsafe {
            for layout in self.layouts {
                if !layout.is_null() {
                    lt::cublasLtMatrixLayoutDestroy(layout);
                }
            }
            if !self.desc.is_null() {
                lt::cublasLtMatmulDescDestroy(self.desc);
            }
        }
    }
}

impl Gpu {
    /// Up to `count` cuBLASLt algorithms for the product `g` of these operands (their
    /// addresses' alignment counts), in the order of its heuristic (its first is its own
    /// pick), each within the handle's 32 MiB workspace.
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`] for operands too short or a batched product;
    /// cuBLASLt's error.
    pub fn gemm_algorithms<C: GemmOutput>(
        &self,
        g: Gemm,
        c: GpuSlice<C>,
        a: GpuSlice<bf16>,
        b: GpuSlice<bf16>,
        count: usize,
    ) -> Result<Vec<GemmAlgo>, DeviceError> {
        g.check(&c, &a, &b)?;
        let plan = Plan::new(&g, C::LT_TYPE)?;
        // The largest power of two (up to 256) each address is a multiple of.
        let align = |address: u64| 1u32 << address.trailing_zeros().min(8);
        let (c, a, b) = (c.address(), a.address(), b.address());
        use lt::cublasLtMatmulPreferenceAttributes_t as P;
        let prefs = [
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align(b)),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align(a)),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align(c)),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align(c)),
        ];
        let mut pref = std::ptr::null_mut();
        // SAFETY: an out pointer to a preference.
        check("cublasLtMatmulPreferenceCreate", unsafe {
            lt::cublasLtMatmulPreferenceCreate(&mut pref)
        })?;
        let bytes = LT_WORKSPACE_BYTES as u64;
        let mut results = vec![
            lt::cublasLtMatmulHeuristicResult_t {
                algo: lt::cublasLtMatmulAlgo_t { data: [0; 8] },
                workspaceSize: 0,
                state: lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS,
                wavesCount: 0.0,
                reserved: [0; 4],
            };
            count
        ];
        let mut returned = 0i32;
        // SAFETY: live descriptors; attribute values of their attributes' sizes; `results`
        // holds `count` entries for the heuristic to fill.
        let status = unsafe {
            let mut set = lt::cublasLtMatmulPreferenceSetAttribute(
                pref,
                P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&bytes as *const u64).cast(),
                size_of::<u64>(),
            );
            for (attr, value) in prefs {
                if set == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                    set = lt::cublasLtMatmulPreferenceSetAttribute(
                        pref,
                        attr,
                        (&value as *const u32).cast(),
                        size_of::<u32>(),
                    );
                }
            }
            let [a, b, c] = plan.layouts;
            let found = match set {
                lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS => lt::cublasLtMatmulAlgoGetHeuristic(
                    self.lt.handle,
                    plan.desc,
                    a,
                    b,
                    c,
                    c,
                    pref,
                    count as i32,
                    results.as_mut_ptr(),
                    &mut returned,
                ),
                failed => failed,
            };
            lt::cublasLtMatmulPreferenceDestroy(pref);
            found
        };
        check("cublasLtMatmulAlgoGetHeuristic", status)?;
        Ok(results
            .into_iter()
            .take(returned.max(0) as usize)
            .filter(|r| r.state == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
            .map(|r| GemmAlgo {
                algo: r.algo,
                waves: r.wavesCount,
            })
            .collect())
    }

    /// Queues the product `g` as [`Gpu::gemm`] does, through cuBLASLt with `algo` (one of
    /// [`gemm_algorithms`](Self::gemm_algorithms)' for this shape and operands, or others of
    /// the same alignment).
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`] when an operand is too short or the product is batched;
    /// cuBLASLt's error (an algorithm of another shape, say).
    pub fn gemm_with<C: GemmOutput>(
        &self,
        g: Gemm,
        algo: &GemmAlgo,
        c: GpuSlice<C>,
        a: GpuSlice<bf16>,
        b: GpuSlice<bf16>,
    ) -> Result<(), DeviceError> {
        g.check(&c, &a, &b)?;
        let plan = Plan::new(&g, C::LT_TYPE)?;
        self.stream
            .context()
            .bind_to_thread()
            .map_err(super::cuda("cuCtxSetCurrent"))?;
        let (alpha, beta) = (g.alpha, g.beta);
        let [a_layout, b_layout, c_layout] = plan.layouts;
        // SAFETY: `check` made sure every operand spans the elements the shape reaches; the
        // pointers are device addresses; alpha and beta are host scalars read before the call
        // returns; the workspace is the handle's own, `LT_WORKSPACE_BYTES` long, which bounds
        // every algorithm `gemm_algorithms` returns.
        let status = unsafe {
            lt::cublasLtMatmul(
                self.lt.handle,
                plan.desc,
                (&alpha as *const f32).cast(),
                b.address() as *const c_void,
                a_layout,
                a.address() as *const c_void,
                b_layout,
                (&beta as *const f32).cast(),
                c.address() as *const c_void,
                c_layout,
                c.address() as *mut c_void,
                c_layout,
                &algo.algo,
                self.lt.workspace_address as *mut c_void,
                LT_WORKSPACE_BYTES,
                self.stream.cu_stream() as lt::cudaStream_t,
            )
        };
        check("cublasLtMatmul", status)
    }
}
