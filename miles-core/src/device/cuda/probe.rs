//! A check, with libloading, that the CUDA driver library loads and has every symbol the CUDA
//! device calls, made before anything touches cudarc (which panics on a missing library or
//! symbol).

use std::sync::OnceLock;

/// Every driver symbol that `driver.rs` reaches through cudarc, by the name cudarc loads.
const SYMBOLS: &[&str] = &[
    "cuGetErrorName",
    "cuGetErrorString",
    "cuInit",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuMemGetInfo_v2",
    "cuMemGetAllocationGranularity",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemMap",
    "cuMemSetAccess",
    "cuMemUnmap",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuEventQuery",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuMemcpyHtoD_v2",
];

/// Whether cudarc's driver calls are safe to make: `Ok` when the library cudarc would load opens
/// and has every symbol of [`SYMBOLS`], else why not. Checked once per process.
pub(crate) fn probe_driver() -> Result<(), String> {
    static RESULT: OnceLock<Result<(), String>> = OnceLock::new();
    RESULT.get_or_init(check_library).clone()
}

fn check_library() -> Result<(), String> {
    // The same names, in the same order, as cudarc's own loader tries, so the library checked
    // here is the one cudarc opens.
    let candidates = cudarc::get_lib_name_candidates("cuda");
    for candidate in &candidates {
        // SAFETY: loading the CUDA driver library runs its initialisers, which have no
        // preconditions; the handle is dropped at the end of this block.
        let Ok(library) = (unsafe { libloading::Library::new(candidate) }) else {
            continue;
        };
        let missing: Vec<&str> = SYMBOLS
            .iter()
            .copied()
            // SAFETY: only the symbol's presence is read; it is never called through this type.
            .filter(|name| unsafe { library.get::<*const ()>(name.as_bytes()) }.is_err())
            .collect();
        return if missing.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "{candidate} lacks {}; update the nvidia driver",
                missing.join(", ")
            ))
        };
    }
    Err(format!(
        "no cuda driver library found (tried {})",
        candidates.join(", ")
    ))
}
