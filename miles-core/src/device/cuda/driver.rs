//! The raw CUDA driver calls of the CUDA device, one small wrapper per call, named after it.
//!
//! Every wrapper turns the driver's status into a `Result` whose error names the call; nothing
//! above this file calls `cudarc::driver::sys` directly. The wrappers are `unsafe fn` where the
//! call's safety depends on what the caller passes (pointers, handles the caller must own); the
//! owning types in `context.rs` and `memory.rs` uphold those conditions.
//!
//! None of these may be called before [`crate::device::probe::cudarc_driver_ready`] has said that the driver
//! library loads and has every symbol listed there: cudarc panics on a missing library or symbol.

use std::ffi::{CStr, c_void};
use std::ptr;

use cudarc::driver::sys;

use crate::device::DeviceError;

/// A driver call's status as a `Result`; the error names the call and the driver's description.
fn check(call: &'static str, status: sys::CUresult) -> Result<(), DeviceError> {
    if status == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    Err(DeviceError::Cuda {
        call,
        message: error_message(status),
    })
}

/// Whether a driver error is the driver being out of device memory.
pub(crate) fn is_out_of_memory(error: &DeviceError) -> bool {
    matches!(error, DeviceError::Cuda { message, .. } if message.starts_with("CUDA_ERROR_OUT_OF_MEMORY"))
}

fn error_message(status: sys::CUresult) -> String {
    let mut name: *const std::ffi::c_char = ptr::null();
    let mut text: *const std::ffi::c_char = ptr::null();
    // SAFETY: both calls write a pointer to a static string owned by the driver (or leave it null
    // for an unknown status), which outlives this function.
    let (name_status, text_status) = unsafe {
        (
            sys::cuGetErrorName(status, &mut name),
            sys::cuGetErrorString(status, &mut text),
        )
    };
    let read = |ok: sys::CUresult, p: *const std::ffi::c_char| {
        if ok == sys::CUresult::CUDA_SUCCESS && !p.is_null() {
            // SAFETY: the driver returned a non-null pointer to a NUL-terminated static string.
            Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        } else {
            None
        }
    };
    match (read(name_status, name), read(text_status, text)) {
        (Some(name), Some(text)) => format!("{name}: {text}"),
        (Some(name), None) => name,
        _ => format!("cuda driver status {}", status as u32),
    }
}

/// `cuInit`: initialise the driver once per process.
pub(crate) fn init() -> Result<(), DeviceError> {
    // SAFETY: cuInit takes no pointers and may be called any number of times.
    check("cuInit", unsafe { sys::cuInit(0) })
}

/// `cuDeviceGetCount`: how many CUDA devices the driver sees.
pub(crate) fn device_get_count() -> Result<i32, DeviceError> {
    let mut count = 0;
    // SAFETY: writes one int to a live local.
    check("cuDeviceGetCount", unsafe {
        sys::cuDeviceGetCount(&mut count)
    })?;
    Ok(count)
}

/// `cuDeviceGet`: the device handle of an ordinal.
pub(crate) fn device_get(ordinal: i32) -> Result<sys::CUdevice, DeviceError> {
    let mut device = 0;
    // SAFETY: writes one device handle to a live local.
    check("cuDeviceGet", unsafe {
        sys::cuDeviceGet(&mut device, ordinal)
    })?;
    Ok(device)
}

/// `cuDeviceGetName`: the marketing name of a device.
pub(crate) fn device_get_name(device: sys::CUdevice) -> Result<String, DeviceError> {
    let mut buffer = [0 as std::ffi::c_char; 256];
    // SAFETY: the driver writes at most `len` bytes, NUL-terminated, into the live buffer.
    check("cuDeviceGetName", unsafe {
        sys::cuDeviceGetName(buffer.as_mut_ptr(), buffer.len() as i32, device)
    })?;
    // SAFETY: the buffer is NUL-terminated (the driver writes the terminator; it was zeroed).
    Ok(unsafe { CStr::from_ptr(buffer.as_ptr()) }
        .to_string_lossy()
        .into_owned())
}

/// `cuDevicePrimaryCtxRetain`: the device's primary context, shared with cudarc and PyTorch.
pub(crate) fn device_primary_ctx_retain(
    device: sys::CUdevice,
) -> Result<sys::CUcontext, DeviceError> {
    let mut context = ptr::null_mut();
    // SAFETY: writes one context handle to a live local.
    check("cuDevicePrimaryCtxRetain", unsafe {
        sys::cuDevicePrimaryCtxRetain(&mut context, device)
    })?;
    Ok(context)
}

/// `cuDevicePrimaryCtxRelease`: drop one retain of the primary context.
///
/// # Safety
/// Once per successful [`device_primary_ctx_retain`], after the last use of the context.
pub(crate) unsafe fn device_primary_ctx_release(device: sys::CUdevice) -> Result<(), DeviceError> {
    // SAFETY: the caller pairs this with one retain.
    check("cuDevicePrimaryCtxRelease", unsafe {
        sys::cuDevicePrimaryCtxRelease_v2(device)
    })
}

/// `cuCtxSetCurrent`: make a context current on the calling thread.
///
/// # Safety
/// `context` is a live context (retained by the caller).
pub(crate) unsafe fn ctx_set_current(context: sys::CUcontext) -> Result<(), DeviceError> {
    // SAFETY: the caller keeps the context alive.
    check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(context) })
}

/// `cuMemGetInfo`: free and total memory of the current context's device.
pub(crate) fn mem_get_info() -> Result<(usize, usize), DeviceError> {
    let (mut free, mut total) = (0, 0);
    // SAFETY: writes two sizes to live locals.
    check("cuMemGetInfo", unsafe {
        sys::cuMemGetInfo_v2(&mut free, &mut total)
    })?;
    Ok((free, total))
}

/// `cuCtxSynchronize`: wait until all work queued in the current context is done (every
/// stream's, including work the caller did not queue, such as PyTorch's kernels).
pub(crate) fn ctx_synchronize() -> Result<(), DeviceError> {
    // SAFETY: takes no pointers; waits on the calling thread's current context.
    check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
}

/// `cuCtxGetDevice`: the device of the calling thread's current context; `None` when no
/// context is current.
pub(crate) fn ctx_get_device() -> Result<Option<sys::CUdevice>, DeviceError> {
    let mut device = 0;
    // SAFETY: writes one device handle to a live local.
    let status = unsafe { sys::cuCtxGetDevice(&mut device) };
    if status == sys::CUresult::CUDA_ERROR_INVALID_CONTEXT {
        return Ok(None);
    }
    check("cuCtxGetDevice", status)?;
    Ok(Some(device))
}

/// `cuMemAlloc`: `len` bytes of ordinary device memory in the current context.
pub(crate) fn mem_alloc(len: usize) -> Result<sys::CUdeviceptr, DeviceError> {
    let mut start = 0;
    // SAFETY: writes one address to a live local.
    check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut start, len) })?;
    Ok(start)
}

/// `cuMemFree`: free memory from [`mem_alloc`].
///
/// # Safety
/// `start` came from [`mem_alloc`], is freed once, and no queued work uses it.
pub(crate) unsafe fn mem_free(start: sys::CUdeviceptr) -> Result<(), DeviceError> {
    // SAFETY: the caller owns the allocation and frees it once.
    check("cuMemFree", unsafe { sys::cuMemFree_v2(start) })
}

/// Properties of pinned device memory on `device`, for [`mem_create`] and the granularity.
pub(crate) fn device_allocation_prop(device: sys::CUdevice) -> sys::CUmemAllocationProp {
    // SAFETY: CUmemAllocationProp is a plain C struct for which all-zero is the documented
    // default (no handle types, no compression, no flags).
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
    prop.location = sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: device,
    };
    prop
}

/// `cuMemGetAllocationGranularity` (minimum): the granule of reservations and mappings.
pub(crate) fn mem_get_allocation_granularity(
    prop: &sys::CUmemAllocationProp,
) -> Result<usize, DeviceError> {
    let mut granularity = 0;
    // SAFETY: reads the live `prop`, writes one size to a live local.
    check("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut granularity,
            prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    })?;
    Ok(granularity)
}

/// `cuMemAddressReserve`: reserve `len` bytes of virtual addresses aligned to `alignment`.
pub(crate) fn mem_address_reserve(
    len: usize,
    alignment: usize,
) -> Result<sys::CUdeviceptr, DeviceError> {
    let mut start = 0;
    // SAFETY: writes one address to a live local; reserving maps nothing.
    check("cuMemAddressReserve", unsafe {
        sys::cuMemAddressReserve(&mut start, len, alignment, 0, 0)
    })?;
    Ok(start)
}

/// `cuMemAddressFree`: give a reservation back.
///
/// # Safety
/// `[start, start + len)` is exactly one reservation of the caller, with nothing mapped in it.
pub(crate) unsafe fn mem_address_free(
    start: sys::CUdeviceptr,
    len: usize,
) -> Result<(), DeviceError> {
    // SAFETY: the caller owns the whole, unmapped reservation.
    check("cuMemAddressFree", unsafe {
        sys::cuMemAddressFree(start, len)
    })
}

/// `cuMemCreate`: `len` bytes of physical device memory, as a handle.
pub(crate) fn mem_create(
    len: usize,
    prop: &sys::CUmemAllocationProp,
) -> Result<sys::CUmemGenericAllocationHandle, DeviceError> {
    let mut handle = 0;
    // SAFETY: reads the live `prop`, writes one handle to a live local.
    check("cuMemCreate", unsafe {
        sys::cuMemCreate(&mut handle, len, prop, 0)
    })?;
    Ok(handle)
}

/// `cuMemRelease`: drop a physical memory handle; the memory goes once nothing maps it.
///
/// # Safety
/// `handle` came from [`mem_create`] and is released once.
pub(crate) unsafe fn mem_release(
    handle: sys::CUmemGenericAllocationHandle,
) -> Result<(), DeviceError> {
    // SAFETY: the caller owns the handle and releases it once.
    check("cuMemRelease", unsafe { sys::cuMemRelease(handle) })
}

/// `cuMemMap`: map the whole of `handle` (`len` bytes) at `start`.
///
/// # Safety
/// `[start, start + len)` lies in a reservation of the caller with nothing mapped there.
pub(crate) unsafe fn mem_map(
    start: sys::CUdeviceptr,
    len: usize,
    handle: sys::CUmemGenericAllocationHandle,
) -> Result<(), DeviceError> {
    // SAFETY: the caller owns the unmapped addresses and the handle.
    check("cuMemMap", unsafe {
        sys::cuMemMap(start, len, 0, handle, 0)
    })
}

/// `cuMemSetAccess`: make `[start, start + len)` readable and writable from `device`.
///
/// # Safety
/// The range is fully mapped by the caller.
pub(crate) unsafe fn mem_set_access(
    start: sys::CUdeviceptr,
    len: usize,
    device: sys::CUdevice,
) -> Result<(), DeviceError> {
    let access = sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: device,
        },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: the caller owns the mapped range; `access` is a live local read once.
    check("cuMemSetAccess", unsafe {
        sys::cuMemSetAccess(start, len, &access, 1)
    })
}

/// `cuMemUnmap`: unmap exactly one whole earlier mapping.
///
/// # Safety
/// `[start, start + len)` is one whole mapping of the caller, and no work uses it any more.
pub(crate) unsafe fn mem_unmap(start: sys::CUdeviceptr, len: usize) -> Result<(), DeviceError> {
    // SAFETY: the caller owns the mapping and has waited for its users.
    check("cuMemUnmap", unsafe { sys::cuMemUnmap(start, len) })
}

/// `cuMemHostAlloc` with `CU_MEMHOSTALLOC_PORTABLE` only: pinned host memory that every context
/// can copy with, cached for CPU reads (not write-combined).
pub(crate) fn mem_host_alloc(len: usize) -> Result<*mut u8, DeviceError> {
    let mut host = ptr::null_mut::<c_void>();
    // SAFETY: writes one pointer to a live local.
    check("cuMemHostAlloc", unsafe {
        sys::cuMemHostAlloc(&mut host, len, sys::CU_MEMHOSTALLOC_PORTABLE)
    })?;
    Ok(host.cast())
}

/// `cuMemHostAlloc` with `CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP`, then
/// `cuMemHostGetDevicePointer`: pinned host memory that kernels read and write directly; returns
/// its host pointer and its device address. Freed with [`mem_free_host`].
pub(crate) fn mem_host_alloc_mapped(len: usize) -> Result<(*mut u8, u64), DeviceError> {
    let mut host = ptr::null_mut::<c_void>();
    let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
    // SAFETY: writes one pointer to a live local.
    check("cuMemHostAlloc", unsafe {
        sys::cuMemHostAlloc(&mut host, len, flags)
    })?;
    let mut device: sys::CUdeviceptr = 0;
    // SAFETY: `host` is a live mapped allocation made just above; writes one address to a local.
    let mapped = check("cuMemHostGetDevicePointer", unsafe {
        sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0)
    });
    if let Err(error) = mapped {
        // SAFETY: allocated above, used by nothing yet.
        if let Err(cleanup) = unsafe { mem_free_host(host.cast()) } {
            tracing::error!(error = %cleanup, "cannot free pinned host memory that could not be mapped");
        }
        return Err(error);
    }
    Ok((host.cast(), device))
}

/// `cuMemFreeHost`: free pinned host memory.
///
/// # Safety
/// `host` came from [`mem_host_alloc`], is freed once, and no copy uses it any more.
pub(crate) unsafe fn mem_free_host(host: *mut u8) -> Result<(), DeviceError> {
    // SAFETY: the caller owns the allocation and has waited for its copies.
    check("cuMemFreeHost", unsafe { sys::cuMemFreeHost(host.cast()) })
}

/// `cuMemHostRegister` with `CU_MEMHOSTREGISTER_PORTABLE`: pin `len` bytes of existing host
/// memory for every context.
///
/// # Safety
/// `host..host + len` is page-aligned memory of the caller that stays mapped until
/// [`mem_host_unregister`].
pub(crate) unsafe fn mem_host_register(host: *mut u8, len: usize) -> Result<(), DeviceError> {
    // SAFETY: the caller owns the mapped memory.
    check("cuMemHostRegister", unsafe {
        sys::cuMemHostRegister_v2(host.cast(), len, sys::CU_MEMHOSTREGISTER_PORTABLE)
    })
}

/// `cuMemHostUnregister`: unpin memory pinned by [`mem_host_register`].
///
/// # Safety
/// `host` was registered and no copy uses it any more.
pub(crate) unsafe fn mem_host_unregister(host: *mut u8) -> Result<(), DeviceError> {
    // SAFETY: the caller has waited for the copies of the registered memory.
    check("cuMemHostUnregister", unsafe {
        sys::cuMemHostUnregister(host.cast())
    })
}

/// `cuStreamCreate` with `CU_STREAM_NON_BLOCKING`: a stream that never waits on the legacy
/// default stream.
pub(crate) fn stream_create() -> Result<sys::CUstream, DeviceError> {
    let mut stream = ptr::null_mut();
    // SAFETY: writes one stream handle to a live local.
    check("cuStreamCreate", unsafe {
        sys::cuStreamCreate(
            &mut stream,
            sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
        )
    })?;
    Ok(stream)
}

/// `cuStreamDestroy`: destroy a stream; work queued on it still completes.
///
/// # Safety
/// `stream` came from [`stream_create`] and is destroyed once.
pub(crate) unsafe fn stream_destroy(stream: sys::CUstream) -> Result<(), DeviceError> {
    // SAFETY: the caller owns the stream and destroys it once.
    check("cuStreamDestroy", unsafe {
        sys::cuStreamDestroy_v2(stream)
    })
}

/// `cuStreamWaitEvent`: make later work on `stream` wait, on the device, for `event`.
///
/// # Safety
/// Both handles are live.
pub(crate) unsafe fn stream_wait_event(
    stream: sys::CUstream,
    event: sys::CUevent,
) -> Result<(), DeviceError> {
    // SAFETY: the caller keeps both handles alive.
    check("cuStreamWaitEvent", unsafe {
        sys::cuStreamWaitEvent(stream, event, 0)
    })
}

/// `cuEventCreate` with `CU_EVENT_DISABLE_TIMING`, the cheapest event for ordering.
pub(crate) fn event_create() -> Result<sys::CUevent, DeviceError> {
    let mut event = ptr::null_mut();
    // SAFETY: writes one event handle to a live local.
    check("cuEventCreate", unsafe {
        sys::cuEventCreate(
            &mut event,
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
        )
    })?;
    Ok(event)
}

/// `cuEventDestroy`: destroy an event.
///
/// # Safety
/// `event` came from [`event_create`] and is destroyed once.
pub(crate) unsafe fn event_destroy(event: sys::CUevent) -> Result<(), DeviceError> {
    // SAFETY: the caller owns the event and destroys it once.
    check("cuEventDestroy", unsafe { sys::cuEventDestroy_v2(event) })
}

/// `cuEventRecord`: mark the point in `stream`'s work that `event` completes at.
///
/// # Safety
/// Both handles are live.
pub(crate) unsafe fn event_record(
    event: sys::CUevent,
    stream: sys::CUstream,
) -> Result<(), DeviceError> {
    // SAFETY: the caller keeps both handles alive.
    check("cuEventRecord", unsafe {
        sys::cuEventRecord(event, stream)
    })
}

/// `cuEventSynchronize`: block until `event` completes.
///
/// # Safety
/// `event` is live.
pub(crate) unsafe fn event_synchronize(event: sys::CUevent) -> Result<(), DeviceError> {
    // SAFETY: the caller keeps the event alive.
    check("cuEventSynchronize", unsafe {
        sys::cuEventSynchronize(event)
    })
}

/// `cuEventQuery`: whether `event` has completed, without blocking.
///
/// # Safety
/// `event` is live.
pub(crate) unsafe fn event_query(event: sys::CUevent) -> Result<bool, DeviceError> {
    // SAFETY: the caller keeps the event alive.
    match unsafe { sys::cuEventQuery(event) } {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        status => check("cuEventQuery", status).map(|()| false),
    }
}

/// `cuMemcpyDtoHAsync`: queue a copy of `len` device bytes at `src` into host memory at `dst`.
///
/// # Safety
/// `src..src + len` is mapped and `dst..dst + len` is writable host memory; both stay so until
/// the copy completes (pageable `dst` makes the call return only after the copy).
pub(crate) unsafe fn memcpy_dtoh_async(
    dst: *mut u8,
    src: sys::CUdeviceptr,
    len: usize,
    stream: sys::CUstream,
) -> Result<(), DeviceError> {
    // SAFETY: the caller keeps both sides valid until the copy completes.
    check("cuMemcpyDtoHAsync", unsafe {
        sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, len, stream)
    })
}

/// `cuMemcpyHtoDAsync`: queue a copy of `len` host bytes at `src` into device memory at `dst`.
///
/// # Safety
/// `dst..dst + len` is mapped and `src..src + len` is readable host memory; both stay so until
/// the copy completes.
pub(crate) unsafe fn memcpy_htod_async(
    dst: sys::CUdeviceptr,
    src: *const u8,
    len: usize,
    stream: sys::CUstream,
) -> Result<(), DeviceError> {
    // SAFETY: the caller keeps both sides valid until the copy completes.
    check("cuMemcpyHtoDAsync", unsafe {
        sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), len, stream)
    })
}

/// `cuMemcpyDtoD`: queue a copy of `len` device bytes on the legacy default stream (used when
/// a mapping is split). A device-to-device `cuMemcpy` does not wait for the copy on the host:
/// the caller waits (an event on the null stream) before it unmaps either range.
///
/// # Safety
/// Both ranges are mapped and no other work writes them meanwhile.
pub(crate) unsafe fn memcpy_dtod(
    dst: sys::CUdeviceptr,
    src: sys::CUdeviceptr,
    len: usize,
) -> Result<(), DeviceError> {
    // SAFETY: the caller owns both mapped ranges.
    check("cuMemcpyDtoD", unsafe {
        sys::cuMemcpyDtoD_v2(dst, src, len)
    })
}

/// `cuMemcpyDtoH`: one plain synchronous copy, the baseline the benchmarks compare against.
///
/// # Safety
/// As [`memcpy_dtoh_async`].
pub(crate) unsafe fn memcpy_dtoh(
    dst: *mut u8,
    src: sys::CUdeviceptr,
    len: usize,
) -> Result<(), DeviceError> {
    // SAFETY: the caller keeps both sides valid; the call returns after the copy.
    check("cuMemcpyDtoH", unsafe {
        sys::cuMemcpyDtoH_v2(dst.cast(), src, len)
    })
}

/// `cuMemcpyHtoD`: one plain synchronous copy, the baseline the benchmarks compare against.
///
/// # Safety
/// As [`memcpy_htod_async`].
pub(crate) unsafe fn memcpy_htod(
    dst: sys::CUdeviceptr,
    src: *const u8,
    len: usize,
) -> Result<(), DeviceError> {
    // SAFETY: the caller keeps both sides valid; the call returns after the copy.
    check("cuMemcpyHtoD", unsafe {
        sys::cuMemcpyHtoD_v2(dst, src.cast(), len)
    })
}
