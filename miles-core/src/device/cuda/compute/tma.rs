//! TMA descriptors (Hopper's tensor memory accelerator) of row-major bf16 matrices, for the
//! kernels that fetch tiles of a matrix into shared memory (`kernels/product.cu`).

use std::ffi::c_void;
use std::mem::MaybeUninit;

use cudarc::driver::{DeviceRepr, sys};
use half::bf16;

use super::{Gpu, GpuSlice, cuda};
use crate::device::DeviceError;

/// Columns of a tile: 64 bf16, the 128 bytes of the 128-byte swizzle.
pub const TILE_COLUMNS: usize = 64;

/// A TMA descriptor of a row-major bf16 matrix read in tiles of [`TILE_COLUMNS`] columns by
/// `box_rows` rows, swizzled in 128-byte mode in shared memory, rows and columns past the end
/// read as zeros: a kernel argument passed by value (`TensorMap` in the kernels).
#[derive(Clone, Copy, Debug)]
pub struct TensorMap(
    #[expect(
        dead_code,
        reason = "read by the kernel, through the address the launch passes"
    )]
    sys::CUtensorMap,
);

// SAFETY: 128 plain bytes that the kernel takes by value; the driver copies them at the launch.
unsafe impl DeviceRepr for TensorMap {}

impl Gpu {
    /// The descriptor of `matrix`, row-major with `columns` columns, in tiles of `box_rows`
    /// rows (1 to 256).
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`] where `matrix` is not whole rows, a row is not whole
    /// 16-byte words, `box_rows` is out of range or the address is not 16-byte aligned; the
    /// driver's error.
    pub fn tensor_map(
        &self,
        matrix: GpuSlice<bf16>,
        columns: usize,
        box_rows: u32,
    ) -> Result<TensorMap, DeviceError> {
        let shape = |what, expected, actual| DeviceError::ShapeMismatch {
            what,
            expected,
            actual,
        };
        if columns == 0 || !columns.is_multiple_of(8) || !matrix.len().is_multiple_of(columns) {
            return Err(shape(
                "tensor map columns (a multiple of 8 dividing the matrix)",
                columns.next_multiple_of(8),
                matrix.len(),
            ));
        }
        if !(1..=256).contains(&box_rows) {
            return Err(shape(
                "tensor map box rows (1 to 256)",
                256,
                box_rows as usize,
            ));
        }
        if !matrix.address().is_multiple_of(16) {
            return Err(shape(
                "tensor map address (16-byte aligned)",
                16,
                (matrix.address() % 16) as usize,
            ));
        }
        let dims = [columns as u64, (matrix.len() / columns) as u64];
        let strides = [(columns * 2) as u64];
        let boxes = [TILE_COLUMNS as u32, box_rows];
        let steps = [1u32, 1];
        self.stream
            .context()
            .bind_to_thread()
            .map_err(cuda("cuCtxSetCurrent"))?;
        let mut map = MaybeUninit::<sys::CUtensorMap>::zeroed();
        // SAFETY: every array holds the rank's (2) entries, the strides rank - 1; `map` is
        // written whole by a successful call and read only then; the address is the matrix's
        // device address, which the descriptor only names.
        unsafe {
            sys::cuTensorMapEncodeTiled(
                map.as_mut_ptr(),
                sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                2,
                matrix.address() as *mut c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                steps.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
            .result()
            .map_err(cuda("cuTensorMapEncodeTiled"))?;
            Ok(TensorMap(map.assume_init()))
        }
    }
}
