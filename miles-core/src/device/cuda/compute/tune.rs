//! [`Gpu::gemm`]: a product through the fastest algorithm that gives cuBLAS's own bits.
//!
//! The first time a shape is asked for outside a capture, cuBLASLt's candidates run on the
//! call's own operands; those whose output has exactly the bits of cuBLAS's pick (the ones
//! that differ only in tiling: their sums run in the same order) are timed against cuBLAS, a
//! CUDA graph of [`TUNE_REPS`] products each, and the fastest is kept for the shape. So the
//! choice changes how fast a product runs, never what it computes: two runs, or a tuned and
//! an untuned call, give the same bits whichever candidate won. Split-K candidates sum in
//! another order and are never tried (bench round 22: every one-pass candidate of the 1B
//! model's shapes had cuBLAS's bits, no split-K one did). A shape first seen under a capture
//! runs cuBLAS's pick.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::Instant;

use cudarc::driver::sys::CUstreamCaptureStatus;
use half::{bf16, f16};

use super::{Gemm, GemmAlgo, GemmOutput, Gpu, GpuSlice, Transpose, cuda};
use crate::device::DeviceError;

/// cuBLASLt candidates asked for per shape.
const TUNE_CANDIDATES: usize = 8;
/// Products in one timed graph.
const TUNE_REPS: usize = 20;
/// Timed replays of each graph; the fastest counts.
const TUNE_REPLAYS: usize = 3;

/// What makes two calls the same product for the tuning: the shape, the scalars, the output
/// type and how aligned each operand's address is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct GemmKey {
    dims: [usize; 3],
    transposes: [bool; 2],
    scalars: [u32; 2],
    fp32_out: bool,
    align: [u32; 3],
}

impl GemmKey {
    fn of<C: GemmOutput>(g: &Gemm, c: u64, a: u64, b: u64) -> GemmKey {
        let align = |address: u64| address.trailing_zeros().min(8);
        GemmKey {
            dims: [g.m, g.n, g.k],
            transposes: [g.a == Transpose::Yes, g.b == Transpose::Yes],
            scalars: [g.alpha.to_bits(), g.beta.to_bits()],
            fp32_out: size_of::<C>() == size_of::<f32>(),
            align: [align(c), align(a), align(b)],
        }
    }
}

/// The algorithm kept for each product shape: a cuBLASLt one, or `None` for cuBLAS's own.
#[derive(Debug, Default)]
pub(super) struct Tuned(Mutex<HashMap<GemmKey, Option<GemmAlgo>>>);

impl Tuned {
    fn get(&self, key: &GemmKey) -> Option<Option<GemmAlgo>> {
        let map = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        map.get(key).copied()
    }

    fn insert(&self, key: GemmKey, choice: Option<GemmAlgo>) {
        let mut map = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        map.insert(key, choice);
    }
}

impl Gpu {
    /// Queues the row-major product `g` of bf16 `a` and `b` into `c` (fp32 or bf16),
    /// accumulating in fp32, through the fastest algorithm whose output has cuBLAS's own bits
    /// (see the module's doc). A shape's first call outside a capture tunes it (it waits for
    /// the queued work, and runs the candidates on these operands, restoring `c`).
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`] when an operand is too short for the shape; cuBLAS's or
    /// cuBLASLt's error.
    pub fn gemm<C: GemmOutput>(
        &self,
        g: Gemm,
        c: GpuSlice<C>,
        a: GpuSlice<bf16>,
        b: GpuSlice<bf16>,
    ) -> Result<(), DeviceError> {
        if g.batch != 1 {
            return self.gemm_cublas(g, c, a, b);
        }
        g.check(&c, &a, &b)?;
        let key = GemmKey::of::<C>(&g, c.address(), a.address(), b.address());
        let choice = match self.tuned.get(&key) {
            Some(choice) => choice,
            None if self.capturing()? => None,
            None => {
                let choice = self.tune(g, c, a, b)?;
                self.tuned.insert(key, choice);
                choice
            }
        };
        match choice {
            Some(algo) => self.gemm_with(g, &algo, c, a, b),
            None => self.gemm_cublas(g, c, a, b),
        }
    }

    fn capturing(&self) -> Result<bool, DeviceError> {
        let status = self
            .stream
            .capture_status()
            .map_err(cuda("cuStreamIsCapturing"))?;
        Ok(status != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// The fastest of cuBLAS and the cuBLASLt candidates with its bits, on these operands;
    /// `c` holds its old values again after.
    fn tune<C: GemmOutput>(
        &self,
        g: Gemm,
        c: GpuSlice<C>,
        a: GpuSlice<bf16>,
        b: GpuSlice<bf16>,
    ) -> Result<Option<GemmAlgo>, DeviceError> {
        let started = Instant::now();
        let candidates = self.gemm_algorithms(g, c, a, b, TUNE_CANDIDATES)?;
        let bits = c.reinterpret::<f16>()?;
        let mut start = vec![f16::ZERO; bits.len()];
        self.download(&mut start, bits)?;
        let output = |run: &dyn Fn() -> Result<(), DeviceError>| {
            self.upload(bits, &start)?;
            run()?;
            let mut out = vec![f16::ZERO; bits.len()];
            self.download(&mut out, bits)?;
            Ok::<_, DeviceError>(out)
        };
        let same = |x: &[f16], y: &[f16]| x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits());
        let reference = output(&|| self.gemm_cublas(g, c, a, b))?;
        let mut best = (self.seconds(|| self.gemm_cublas(g, c, a, b))?, None);
        // One pass over the inner dimension (no split-K), so even operands for which every
        // order of summing gives the same bits (zeros, say) cannot let another order in.
        for algo in candidates.into_iter().filter(|algo| algo.split_k() == 1) {
            if !same(&output(&|| self.gemm_with(g, &algo, c, a, b))?, &reference) {
                continue;
            }
            let t = self.seconds(|| self.gemm_with(g, &algo, c, a, b))?;
            if t < best.0 {
                best = (t, Some(algo));
            }
        }
        self.upload(bits, &start)?;
        tracing::debug!(
            m = g.m,
            n = g.n,
            k = g.k,
            us = best.0 * 1e6,
            algo = best.1.map(|algo| algo.describe()),
            tuned_ms = started.elapsed().as_secs_f64() * 1e3,
            "tuned a product's algorithm (cublas's own bits)"
        );
        Ok(best.1)
    }

    /// Seconds of one `product`: the fastest replay of a graph of [`TUNE_REPS`] of them.
    fn seconds(&self, product: impl Fn() -> Result<(), DeviceError>) -> Result<f64, DeviceError> {
        let graph = self.capture(|| (0..TUNE_REPS).try_for_each(|_| product()))?;
        self.replay(&graph)?;
        self.synchronize()?;
        let mut best = f64::INFINITY;
        for _ in 0..TUNE_REPLAYS {
            let started = Instant::now();
            self.replay(&graph)?;
            self.synchronize()?;
            best = best.min(started.elapsed().as_secs_f64() / TUNE_REPS as f64);
        }
        Ok(best)
    }
}
