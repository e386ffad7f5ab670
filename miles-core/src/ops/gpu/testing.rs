//! A GPU test harness: the GPU (when `MILES_TEST_DEVICE=cuda`), one committed arena carved
//! bump-style into tensors, and host <-> device helpers that round through bf16 as the kernels
//! do. Shared by the kernel tests here and the GPU model tests.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use half::bf16;

use crate::device::{AddressRange, CudaDevice, Device};
use crate::device::{Gpu, GpuElement, GpuSlice};

static GPU_LOCK: Mutex<()> = Mutex::new(());

/// One GPU and a committed arena, to one test at a time.
pub(crate) struct TestGpu {
    pub gpu: Gpu,
    range: AddressRange,
    used: usize,
    _lock: MutexGuard<'static, ()>,
}

impl TestGpu {
    /// The GPU with an arena of `bytes`, when `MILES_TEST_DEVICE=cuda`; `None` with a skip note
    /// otherwise.
    pub fn open(test: &str, bytes: usize) -> Option<TestGpu> {
        if std::env::var("MILES_TEST_DEVICE").as_deref() != Ok("cuda") {
            eprintln!("skipping {test}: set MILES_TEST_DEVICE=cuda to run it on a gpu");
            return None;
        }
        let lock = GPU_LOCK.lock().unwrap_or_else(PoisonError::into_inner);
        let device =
            Arc::new(CudaDevice::open(0).unwrap_or_else(|e| panic!("cuda:0 cannot open: {e}")));
        let len = bytes.max(1).next_multiple_of(device.granularity());
        let range = device
            .reserve(len)
            .unwrap_or_else(|e| panic!("reserve: {e}"));
        device
            .commit(range)
            .unwrap_or_else(|e| panic!("commit: {e}"));
        let gpu = super::open_gpu(device).unwrap_or_else(|e| panic!("gpu compute: {e}"));
        Some(TestGpu {
            gpu,
            range,
            used: 0,
            _lock: lock,
        })
    }

    /// `len` fresh elements of the arena (256-byte aligned), zeroed.
    pub fn alloc<T: GpuElement>(&mut self, len: usize) -> GpuSlice<T> {
        let bytes = (len * std::mem::size_of::<T>()).max(1);
        let range = self
            .range
            .slice(self.used, bytes)
            .unwrap_or_else(|e| panic!("test arena too small: {e}"));
        self.used = (self.used + bytes).next_multiple_of(256);
        let slice = GpuSlice::of(AddressRange {
            start: range.start,
            len: len * std::mem::size_of::<T>(),
        })
        .unwrap_or_else(|e| panic!("slice: {e}"));
        self.gpu.zero(slice).unwrap_or_else(|e| panic!("zero: {e}"));
        slice
    }

    /// A device copy of `values`.
    pub fn put<T: GpuElement>(&mut self, values: &[T]) -> GpuSlice<T> {
        let slice = self.alloc(values.len());
        self.gpu
            .upload(slice, values)
            .unwrap_or_else(|e| panic!("upload: {e}"));
        slice
    }

    /// A device bf16 copy of `values`, and the fp32 values it holds (rounded to bf16), which a
    /// CPU reference must start from.
    pub fn put_bf16(&mut self, values: &[f32]) -> (GpuSlice<bf16>, Vec<f32>) {
        let rounded: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
        let slice = self.put(&rounded);
        (slice, rounded.iter().map(|v| v.to_f32()).collect())
    }

    /// The values of `slice`, after the queued work.
    pub fn get<T: GpuElement + Default>(&self, slice: GpuSlice<T>) -> Vec<T> {
        let mut out = vec![T::default(); slice.len()];
        self.gpu
            .download(&mut out, slice)
            .unwrap_or_else(|e| panic!("download: {e}"));
        out
    }

    /// The values of a bf16 `slice` as fp32, after the queued work.
    pub fn get_bf16(&self, slice: GpuSlice<bf16>) -> Vec<f32> {
        self.get(slice).iter().map(|v| v.to_f32()).collect()
    }
}

/// Checks `got` against `want` elementwise within `rel * max(1, |want|)`, printing the worst
/// difference; NaN never passes.
pub(crate) fn assert_close(what: &str, got: &[f32], want: &[f32], rel: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let mut worst = (0usize, 0.0f32);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let diff = (g - w).abs() / w.abs().max(1.0);
        assert!(
            g.is_finite() == w.is_finite(),
            "{what}: element {i} is {g}, want {w}"
        );
        if diff > worst.1 {
            worst = (i, diff);
        }
    }
    eprintln!(
        "{what}: worst relative difference {:.3e} at {} (tolerance {rel:.1e})",
        worst.1, worst.0
    );
    assert!(
        worst.1 <= rel,
        "{what}: element {} is {}, want {} (tolerance {rel})",
        worst.0,
        got[worst.0],
        want[worst.0]
    );
}
