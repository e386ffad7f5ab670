//! GPU compute handles: programs of kernels compiled at start-up by NVRTC (for `compute_90`, and
//! on a Hopper GPU a program for `compute_90a`),
//! matrix products through cuBLAS, NCCL, all queued on one compute stream of the device's primary
//! context. The kernels themselves and their typed launch wrappers live in
//! [`crate::ops::gpu`]; this module holds the raw launch, copies and library calls.
//!
//! Tensors are [`GpuSlice`]s: a device address and an element count, typically carved out of a
//! memory-manager buffer (`Buffer::address`). A kernel that reaches past a committed range faults
//! on the GPU and comes back as [`DeviceError::Cuda`] from the next synchronising call; it cannot
//! touch host memory. Activations and parameters are bf16 ([`half::bf16`]); arithmetic, norms'
//! statistics, gradients of weights and optimizer state are fp32.
//!
//! Every call only queues work; [`Gpu::synchronize`] (or a download) waits for it, and
//! [`Gpu::record_fence`] hands the memory manager a fence after the last use of a tag.

mod blas;
mod lt;
mod nccl;
mod staging;
mod tma;

use std::collections::HashMap;
use std::ffi::c_void;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use cudarc::driver::{CudaContext, CudaFunction, CudaGraph, CudaStream, sys};
use half::bf16;

pub use blas::{Gemm, GemmOutput, Transpose};
pub use cudarc::driver::LaunchConfig;
pub use lt::GemmAlgo;
pub use nccl::{Collectives, ID_BYTES, NcclComm};
pub use tma::{TILE_COLUMNS, TensorMap};

pub use self::staging::Mailbox;
use self::staging::{COPY_KERNEL, COPY_SOURCE, STAGED_MAX_BYTES, Staging, StagingSlot};
use super::CudaDevice;
use crate::device::{AddressRange, DeviceError, Fence};

/// The architecture kernels are compiled for: Hopper (H100, H200), as PTX that newer GPUs
/// compile too.
const ARCH: &str = "compute_90";

/// The architecture of a [`KernelProgram::hopper_only`] program: Hopper's own features (warpgroup
/// MMA, the tensor memory accelerator), which no other GPU runs.
const HOPPER_ARCH: &str = "compute_90a";

/// A program of CUDA C++ kernels: compiled as one translation unit, each named kernel looked up
/// once when a [`Gpu`] starts.
#[derive(Clone, Copy, Debug)]
pub struct KernelProgram {
    /// The program's name in compiler messages.
    pub name: &'static str,
    /// The sources, concatenated in order (shared headers first).
    pub sources: &'static [&'static str],
    /// Every `extern "C"` kernel the program defines, in groups (one a source file, say).
    pub kernels: &'static [&'static [&'static str]],
    /// Compiled for [`HOPPER_ARCH`] and loaded only on a GPU of compute capability 9.0;
    /// elsewhere its kernels are absent ([`Gpu::has_kernel`]).
    pub hopper_only: bool,
}

/// Element types a [`GpuSlice`] may hold.
pub trait GpuElement: Copy + Send + Sync + 'static {}
impl GpuElement for f32 {}
impl GpuElement for bf16 {}
impl GpuElement for u32 {}
impl GpuElement for half::f16 {}

/// `len` elements of `T` at a device address: a view, owning nothing.
#[derive(Debug)]
pub struct GpuSlice<T> {
    addr: u64,
    len: usize,
    element: PhantomData<T>,
}

impl<T> Clone for GpuSlice<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for GpuSlice<T> {}

impl<T: GpuElement> GpuSlice<T> {
    /// The elements of `range`.
    ///
    /// # Errors
    /// [`DeviceError::OutOfRange`] when the range's start is not aligned to `T` or its length is
    /// not a whole number of elements.
    pub fn of(range: AddressRange) -> Result<GpuSlice<T>, DeviceError> {
        let size = std::mem::size_of::<T>();
        if !range.start.is_multiple_of(size as u64) || !range.len.is_multiple_of(size) {
            return Err(DeviceError::OutOfRange {
                offset: (range.start % size as u64) as usize,
                len: range.len,
                range_len: range.len - range.len % size,
            });
        }
        Ok(GpuSlice {
            addr: range.start,
            len: range.len / size,
            element: PhantomData,
        })
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address of the first element.
    pub fn address(&self) -> u64 {
        self.addr
    }

    /// Elements `[start, start + len)`.
    ///
    /// # Errors
    /// [`DeviceError::OutOfRange`] when they do not lie inside the slice.
    pub fn sub(&self, start: usize, len: usize) -> Result<GpuSlice<T>, DeviceError> {
        match start.checked_add(len) {
            Some(end) if end <= self.len => Ok(GpuSlice {
                addr: self.addr + (start * std::mem::size_of::<T>()) as u64,
                len,
                element: PhantomData,
            }),
            _ => Err(DeviceError::OutOfRange {
                offset: start,
                len,
                range_len: self.len,
            }),
        }
    }

    /// The same bytes as elements of `U` (one scratch serving buffers of several types).
    ///
    /// # Errors
    /// [`DeviceError::OutOfRange`] when the start is not aligned to `U` or the bytes are not a
    /// whole number of `U`s.
    pub fn reinterpret<U: GpuElement>(&self) -> Result<GpuSlice<U>, DeviceError> {
        GpuSlice::of(AddressRange {
            start: self.addr,
            len: self.bytes(),
        })
    }

    /// Bytes it spans.
    pub fn bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// Checks it holds exactly `len` elements; `what` names it in the error.
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`] otherwise.
    pub fn expect_len(&self, what: &'static str, len: usize) -> Result<(), DeviceError> {
        if self.len == len {
            Ok(())
        } else {
            Err(DeviceError::ShapeMismatch {
                what,
                expected: len,
                actual: self.len,
            })
        }
    }
}

/// Where a stream's kernels stand when several streams have blocks waiting for the
/// multiprocessors.
#[derive(Clone, Copy)]
enum Priority {
    /// The device's greatest priority: every compute stream.
    Compute,
    /// Its least: work that only fills what the compute streams leave.
    Background,
}

/// A non-blocking stream of `context` at `priority`.
fn new_stream(
    context: &Arc<CudaContext>,
    priority: Priority,
) -> Result<Arc<CudaStream>, DeviceError> {
    context.bind_to_thread().map_err(cuda("cuCtxSetCurrent"))?;
    let (least, greatest) = cudarc::driver::result::stream::get_priority_range()
        .map_err(cuda("cuCtxGetStreamPriorityRange"))?;
    let level = match priority {
        Priority::Compute => greatest,
        Priority::Background => least,
    };
    context
        .new_stream_with_priority(level)
        .map_err(cuda("cuStreamCreateWithPriority"))
}

/// Compute on one GPU: the compiled kernels, a cuBLAS handle and the compute stream.
pub struct Gpu {
    stream: Arc<CudaStream>,
    kernels: HashMap<&'static str, CudaFunction>,
    blas: blas::Blas,
    lt: lt::Lt,
    device: Arc<CudaDevice>,
    /// The GPU's streaming multiprocessors.
    multiprocessors: usize,
    /// The mapped host buffer of staged uploads and downloads, made at the first, grown as
    /// needed.
    staging: Mutex<StagingSlot>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("device", &self.device)
            .field("kernels", &self.kernels.len())
            .finish_non_exhaustive()
    }
}

impl Gpu {
    /// Compute on `device`'s GPU: compiles `programs` with NVRTC (a
    /// [`KernelProgram::hopper_only`] one only on a Hopper GPU), loads their kernels, and opens
    /// cuBLAS on a new compute stream.
    ///
    /// # Errors
    /// [`DeviceError::CudaUnavailable`] when NVRTC or cuBLAS cannot be loaded;
    /// [`DeviceError::Cuda`] with the compiler's log when the kernels do not compile.
    pub fn new(device: Arc<CudaDevice>, programs: &[&KernelProgram]) -> Result<Gpu, DeviceError> {
        for library in ["nvrtc", "cublas", "cublasLt"] {
            crate::device::probe::cudarc_library_ready(library)
                .map_err(DeviceError::CudaUnavailable)?;
        }
        let context = CudaContext::new(device.ordinal() as usize).map_err(cuda("cuCtxRetain"))?;
        let stream = new_stream(&context, Priority::Compute)?;
        let attribute = |what| {
            context
                .attribute(what)
                .map_err(cuda("cuDeviceGetAttribute"))
        };
        let multiprocessors =
            attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let hopper = (
            attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ) == (9, 0);
        let mut kernels = HashMap::new();
        for program in programs {
            if program.hopper_only && !hopper {
                continue;
            }
            let ptx = compile(program)?;
            let module = context.load_module(ptx).map_err(cuda("cuModuleLoadData"))?;
            // Every program carries the copy kernel; the first one loaded gives it.
            let copy = (!kernels.contains_key(COPY_KERNEL)).then_some(&COPY_KERNEL);
            for &name in program
                .kernels
                .iter()
                .flat_map(|group| group.iter())
                .chain(copy)
            {
                let function = module
                    .load_function(name)
                    .map_err(cuda("cuModuleGetFunction"))?;
                kernels.insert(name, function);
            }
        }
        let blas = blas::Blas::new(&stream)?;
        let lt = lt::Lt::new(&stream)?;
        tracing::info!(kernels = kernels.len(), hopper, "compiled the gpu kernels");
        Ok(Gpu {
            stream,
            kernels,
            blas,
            lt,
            device,
            multiprocessors: multiprocessors.max(1) as usize,
            staging: Mutex::new(StagingSlot::default()),
        })
    }

    /// Compute on the same GPU with the same kernels (nothing compiled again) on a compute
    /// stream of its own, with its own cuBLAS handles and staging buffer: for a second user of
    /// the GPU (the trainer beside the rollout engine) whose work may be queued from another
    /// thread while this one captures a graph, which would otherwise take that work in (or be
    /// broken by it). Work on the two streams is ordered only by fences. Like every compute
    /// stream it runs at the device's greatest priority.
    ///
    /// # Errors
    /// The driver's or cuBLAS's error creating the stream or the handles.
    pub fn with_own_stream(&self) -> Result<Gpu, DeviceError> {
        self.with_stream(Priority::Compute)
    }

    /// As [`with_own_stream`](Self::with_own_stream), on a stream of the device's least
    /// priority: its kernels' blocks go to the multiprocessors only where the compute
    /// streams' pending blocks leave room (the trainer's optimizer step behind its next
    /// forward pass).
    ///
    /// # Errors
    /// As [`with_own_stream`](Self::with_own_stream).
    pub fn with_background_stream(&self) -> Result<Gpu, DeviceError> {
        self.with_stream(Priority::Background)
    }

    fn with_stream(&self, priority: Priority) -> Result<Gpu, DeviceError> {
        let stream = new_stream(self.stream.context(), priority)?;
        Ok(Gpu {
            blas: blas::Blas::new(&stream)?,
            lt: lt::Lt::new(&stream)?,
            stream,
            kernels: self.kernels.clone(),
            device: Arc::clone(&self.device),
            multiprocessors: self.multiprocessors,
            staging: Mutex::new(StagingSlot::default()),
        })
    }

    /// The device whose memory the tensors live in.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }

    /// The GPU's streaming multiprocessors: what a kernel's grid must fill.
    pub fn multiprocessors(&self) -> usize {
        self.multiprocessors
    }

    /// The compute stream, for libraries (NCCL) that queue on it.
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Waits for every kernel queued so far.
    ///
    /// # Errors
    /// The first error a queued kernel hit.
    pub fn synchronize(&self) -> Result<(), DeviceError> {
        self.stream
            .synchronize()
            .map_err(cuda("cuStreamSynchronize"))
    }

    /// A fence after the work queued so far: hand it to the memory manager as a tag's last use.
    ///
    /// # Errors
    /// The driver's error.
    pub fn record_fence(&self) -> Result<Fence, DeviceError> {
        self.device.record_fence(&self.stream)
    }

    /// Makes later kernels wait, on the device, for `fence` (a resume's, say).
    ///
    /// # Errors
    /// The driver's error.
    pub fn wait_for(&self, fence: &Fence) -> Result<(), DeviceError> {
        self.device.stream_wait(&self.stream, fence)
    }

    /// Copies `src` into `dst` (same length) and waits for it. Up to [`STAGED_MAX_BYTES`] the
    /// bytes go through mapped host memory and a kernel, never queued behind the copy engines'
    /// work (`staging.rs`); larger uploads are a copy on a copy engine.
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`] for lengths that differ; the driver's error.
    pub fn upload<T: GpuElement>(&self, dst: GpuSlice<T>, src: &[T]) -> Result<(), DeviceError> {
        dst.expect_len("upload destination", src.len())?;
        self.bind()?;
        let bytes = dst.bytes();
        if bytes == 0 {
            return self.synchronize();
        }
        if bytes > STAGED_MAX_BYTES {
            // SAFETY: `dst` spans exactly `src`'s bytes; the stream is synchronised before
            // `src`'s borrow ends, so the pageable source outlives the copy.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(dst.addr, src, self.stream.cu_stream())
            }
            .map_err(cuda("cuMemcpyHtoDAsync"))?;
            return self.synchronize();
        }
        let mut slot = self.staging();
        let staging = slot.at_least(bytes, self.stream.context())?;
        // SAFETY: `src` is plain data of `bytes` bytes (a `GpuElement`).
        let src = unsafe { std::slice::from_raw_parts(src.as_ptr().cast::<u8>(), bytes) };
        let offset = staging::staged_offset(dst.addr);
        // SAFETY: the buffer holds `bytes` from any offset below `ALIGN`
        // (`StagingSlot::at_least`), and no kernel uses it: the lock is held, and a staged
        // transfer lets go of it only once its kernel is done, or, where the wait failed, could
        // not run (a capture) or died with the context.
        unsafe { staging.fill(offset, src) };
        self.copy_bytes(dst.addr, staging.device_at(offset), bytes)?;
        self.synchronize()
    }

    /// Copies `src` into `dst` (same length) after the queued work, and waits for it; staged as
    /// [`upload`](Self::upload) is.
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`] for lengths that differ; the driver's error, or the first
    /// error a queued kernel hit.
    pub fn download<T: GpuElement>(
        &self,
        dst: &mut [T],
        src: GpuSlice<T>,
    ) -> Result<(), DeviceError> {
        src.expect_len("download source", dst.len())?;
        self.bind()?;
        let bytes = src.bytes();
        if bytes == 0 {
            return self.synchronize();
        }
        if bytes > STAGED_MAX_BYTES {
            // SAFETY: `src` spans exactly `dst`'s bytes; the stream is synchronised before
            // `dst`'s borrow ends.
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(dst, src.addr, self.stream.cu_stream())
            }
            .map_err(cuda("cuMemcpyDtoHAsync"))?;
            return self.synchronize();
        }
        let mut slot = self.staging();
        let staging = slot.at_least(bytes, self.stream.context())?;
        let offset = staging::staged_offset(src.addr);
        self.copy_bytes(staging.device_at(offset), src.addr, bytes)?;
        self.synchronize()?;
        // SAFETY: `dst` is `bytes` bytes of plain data (a `GpuElement`), every bit pattern of
        // which the copied bytes of the same type are.
        let dst = unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<u8>(), bytes) };
        // SAFETY: the kernel that filled the buffer is done (synchronised above) and no other
        // runs: the lock is held; the buffer holds `bytes` from any offset below `ALIGN`.
        unsafe { staging.drain(offset, dst) };
        Ok(())
    }

    /// A [`Mailbox`] for queued transfers of up to `bytes` (at most [`STAGED_MAX_BYTES`]).
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`] past the limit; the driver's error.
    pub fn mailbox(&self, bytes: usize) -> Result<Mailbox, DeviceError> {
        if bytes > STAGED_MAX_BYTES {
            return Err(DeviceError::ShapeMismatch {
                what: "mailbox bytes (at most the staged limit)",
                expected: STAGED_MAX_BYTES,
                actual: bytes,
            });
        }
        self.bind()?;
        Ok(Mailbox {
            staging: Staging::new(
                bytes.max(1) + staging::ALIGN,
                Arc::clone(self.stream.context()),
            )?,
            fence: None,
            held: None,
        })
    }

    /// Copies `src` into `dst` (same length) after the queued work, through `mailbox`, and
    /// returns without waiting for the copy: only for the mailbox's last copy, so that its
    /// bytes are rewritten once the device has read them.
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`] for lengths that differ or past the mailbox's capacity;
    /// the driver's error, or the error of the work the last copy followed.
    pub fn upload_queued<T: GpuElement>(
        &self,
        mailbox: &mut Mailbox,
        dst: GpuSlice<T>,
        src: &[T],
    ) -> Result<(), DeviceError> {
        dst.expect_len("queued upload destination", src.len())?;
        let bytes = dst.bytes();
        check_capacity(mailbox, bytes)?;
        self.bind()?;
        mailbox.settle()?;
        mailbox.held = None;
        // SAFETY: `src` is plain data of `bytes` bytes (a `GpuElement`).
        let src = unsafe { std::slice::from_raw_parts(src.as_ptr().cast::<u8>(), bytes) };
        let offset = staging::staged_offset(dst.addr);
        // SAFETY: the mailbox's last copy is done (settled), `&mut` keeps any other transfer
        // away, and the capacity holds `bytes` from any offset below `ALIGN`.
        unsafe { mailbox.staging.fill(offset, src) };
        self.copy_bytes(dst.addr, mailbox.staging.device_at(offset), bytes)?;
        mailbox.fence = Some(self.record_fence()?);
        Ok(())
    }

    /// Queues a copy of `src` into `mailbox` after the queued work and returns; the bytes are
    /// [`Mailbox::read`] once the copy is done.
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`] past the mailbox's capacity; the driver's error, or the
    /// error of the work the mailbox's last copy followed.
    pub fn download_queued<T: GpuElement>(
        &self,
        mailbox: &mut Mailbox,
        src: GpuSlice<T>,
    ) -> Result<(), DeviceError> {
        let bytes = src.bytes();
        check_capacity(mailbox, bytes)?;
        self.bind()?;
        mailbox.settle()?;
        let offset = staging::staged_offset(src.addr);
        self.copy_bytes(mailbox.staging.device_at(offset), src.addr, bytes)?;
        mailbox.fence = Some(self.record_fence()?);
        mailbox.held = Some((offset, bytes));
        Ok(())
    }

    /// Makes the stream's context current on this thread.
    fn bind(&self) -> Result<(), DeviceError> {
        self.stream
            .context()
            .bind_to_thread()
            .map_err(cuda("cuCtxSetCurrent"))
    }

    /// The staging buffer's slot, locked: one staged transfer at a time.
    fn staging(&self) -> MutexGuard<'_, StagingSlot> {
        self.staging.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues the copy kernel: `bytes` bytes from device address `src` to `dst` (either may be
    /// mapped host memory).
    fn copy_bytes(&self, dst: u64, src: u64, bytes: usize) -> Result<(), DeviceError> {
        if bytes == 0 {
            return Ok(());
        }
        let config = staging::copy_launch(bytes);
        self.launch(COPY_KERNEL, config, &[&dst, &src, &(bytes as u64)])
    }

    /// Sets every byte of `dst` to zero (queued).
    ///
    /// # Errors
    /// The driver's error.
    pub fn zero<T: GpuElement>(&self, dst: GpuSlice<T>) -> Result<(), DeviceError> {
        self.bind()?;
        // SAFETY: `dst` is a view of device memory the caller holds; zero bytes are a valid value
        // of every `GpuElement`.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                dst.addr,
                0,
                dst.bytes(),
                self.stream.cu_stream(),
            )
        }
        .map_err(cuda("cuMemsetD8Async"))
    }

    /// Copies `src` into `dst` (same length, not overlapping) on the device (queued), as a
    /// kernel: a copy engine's copy would wait for the memory manager's copies queued before it.
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`]; the launch's error.
    pub fn copy<T: GpuElement>(
        &self,
        dst: GpuSlice<T>,
        src: GpuSlice<T>,
    ) -> Result<(), DeviceError> {
        dst.expect_len("copy destination", src.len())?;
        self.copy_bytes(dst.addr, src.addr, src.bytes())
    }

    /// Records the work `queue` puts on the compute stream into a graph instead of running
    /// it, and instantiates the graph. Nothing that waits (an upload, a download, a
    /// synchronize) may be queued meanwhile. The capture ends whatever `queue` returns.
    ///
    /// # Errors
    /// `queue`'s error; the driver's (a call the capture does not allow, say).
    pub fn capture(
        &self,
        queue: impl FnOnce() -> Result<(), DeviceError>,
    ) -> Result<GpuGraph, DeviceError> {
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(cuda("cuStreamBeginCapture"))?;
        let queued = queue();
        let graph = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(cuda("cuStreamEndCapture"));
        queued?;
        let graph = graph?.ok_or_else(|| DeviceError::Cuda {
            call: "cuStreamEndCapture",
            message: "the capture recorded no work".into(),
        })?;
        graph.upload().map_err(cuda("cuGraphUpload"))?;
        Ok(GpuGraph { graph })
    }

    /// Queues one replay of `graph` on the compute stream.
    ///
    /// # Errors
    /// The driver's error.
    pub fn replay(&self, graph: &GpuGraph) -> Result<(), DeviceError> {
        graph.graph.launch().map_err(cuda("cuGraphLaunch"))
    }

    /// Whether `name` was compiled and loaded here (a [`KernelProgram::hopper_only`] kernel is
    /// not, on another GPU).
    pub fn has_kernel(&self, name: &str) -> bool {
        self.kernels.contains_key(name)
    }

    fn kernel(&self, name: &'static str) -> Result<&CudaFunction, DeviceError> {
        self.kernels.get(name).ok_or_else(|| DeviceError::Cuda {
            call: "cuModuleGetFunction",
            message: format!("kernel {name} is not in the compiled module"),
        })
    }

    /// Queues `name` with `args` (each a `DeviceRepr` value: device addresses as `u64`, sizes
    /// as `i32`/`i64`, scalars as `f32`) on the compute stream. Only the typed wrappers of
    /// [`crate::ops::gpu`] call it, each passing exactly its kernel's parameters.
    pub(crate) fn launch(
        &self,
        name: &'static str,
        config: LaunchConfig,
        args: &[&dyn KernelArg],
    ) -> Result<(), DeviceError> {
        let function = self.kernel(name)?;
        if config.shared_mem_bytes > STATIC_SHARED_LIMIT {
            function
                .set_attribute(
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    config.shared_mem_bytes as i32,
                )
                .map_err(cuda("cuFuncSetAttribute"))?;
        }
        let mut params: Vec<*mut c_void> = args.iter().map(|arg| arg.param()).collect();
        // Programmatic dependent launch: the kernel may be scheduled before the one ahead of
        // it on the stream has finished; its first statement waits for that one
        // ([`GRID_BEGIN`], which `compile` checks every kernel starts with).
        // SAFETY: a plain integer field of the attribute's union, the rest zeroed.
        let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
        value.programmaticStreamSerializationAllowed = 1;
        let mut attribute = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value,
        };
        let launch = sys::CUlaunchConfig {
            gridDimX: config.grid_dim.0,
            gridDimY: config.grid_dim.1,
            gridDimZ: config.grid_dim.2,
            blockDimX: config.block_dim.0,
            blockDimY: config.block_dim.1,
            blockDimZ: config.block_dim.2,
            sharedMemBytes: config.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut attribute,
            numAttrs: 1,
        };
        self.stream
            .context()
            .bind_to_thread()
            .map_err(cuda("cuCtxSetCurrent"))?;
        // SAFETY: every kernel of the program takes exactly the arguments its wrapper in
        // `crate::ops::gpu` passes, in order and of the same C types (u64 for pointers), and
        // `params` points at them for the length of the call; the pointers are views of device
        // memory (a kernel that strays faults on the GPU, not on the host).
        unsafe {
            sys::cuLaunchKernelEx(
                &launch,
                function.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(cuda("cuLaunchKernelEx"))
    }
}

/// Dynamic shared memory a kernel may take without opting in (48 KiB); past it, a launch first
/// raises the kernel's limit.
const STATIC_SHARED_LIMIT: u32 = 48 << 10;

/// Work captured from the compute stream by [`Gpu::capture`], replayed by [`Gpu::replay`]:
/// the same kernels with the same arguments (device addresses included) each time.
pub struct GpuGraph {
    graph: CudaGraph,
}

impl std::fmt::Debug for GpuGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuGraph").finish_non_exhaustive()
    }
}

// SAFETY: the driver's graph objects must not be used by two threads at once. A `GpuGraph` is
// `Send` but not `Sync`: it moves between threads whole, and only its owner launches it (through
// `&self` on one thread at a time) or drops it.
unsafe impl Send for GpuGraph {}

/// A kernel argument: a plain value passed by reference.
pub(crate) trait KernelArg {
    /// The address of the value, as the launch's parameter array holds it.
    fn param(&self) -> *mut c_void;
}

impl<T: cudarc::driver::DeviceRepr> KernelArg for T {
    fn param(&self) -> *mut c_void {
        std::ptr::from_ref(self).cast_mut().cast()
    }
}

/// [`DeviceError::ShapeMismatch`] where `bytes` exceed what a transfer through `mailbox` moves.
fn check_capacity(mailbox: &Mailbox, bytes: usize) -> Result<(), DeviceError> {
    if bytes > mailbox.capacity() {
        return Err(DeviceError::ShapeMismatch {
            what: "queued transfer bytes (the mailbox's capacity)",
            expected: mailbox.capacity(),
            actual: bytes,
        });
    }
    Ok(())
}

/// What every kernel's body starts with: the prelude's [`GRID_PRELUDE`] function.
const GRID_BEGIN: &str = "grid_begin();";

/// Or this, in a kernel that reads only what no kernel writes before it calls `grid_begin()`.
const GRID_BEGIN_LATER: &str = "grid_begin_later();";

/// Put ahead of every program. Kernels are launched with programmatic dependent launch
/// (Hopper): the driver may schedule a kernel's blocks before the kernel ahead of it on the
/// stream has finished, so each kernel first waits for that kernel to finish and its writes to
/// be visible, and touches no memory before. Only the kernels a decode product follows let the
/// one behind them start early (`grid_release`, `griddepcontrol.launch_dependents`): in every
/// kernel, a training step at 1B took 2% longer on an H100, where waiting alone made it about
/// 1% shorter (bench/RESULTS.md, round 32).
const GRID_PRELUDE: &str = r#"
__device__ __forceinline__ void grid_begin() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
}
// Lets the kernel behind this one start before this one ends: only in the kernels a decode
// product follows, which fetches its weights (written by no kernel) while they run.
__device__ __forceinline__ void grid_release() {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
// Opens a kernel that reads nothing before it calls grid_begin() itself but what no kernel
// writes (a decode product's weights).
__device__ __forceinline__ void grid_begin_later() {}
"#;

/// The first kernel of `source` whose body does not start with [`GRID_BEGIN`]: its text from
/// `__global__` to the body's brace.
fn kernel_without_grid_begin(source: &str) -> Option<&str> {
    source.match_indices("__global__").find_map(|(at, _)| {
        let rest = &source[at..];
        let open = rest.find('{')?;
        let body = rest[open + 1..].trim_start_matches(|c: char| c.is_whitespace() || c == '\\');
        (!body.starts_with(GRID_BEGIN) && !body.starts_with(GRID_BEGIN_LATER))
            .then(|| rest[..open].trim_end())
    })
}

/// Compiles `program` to PTX for [`ARCH`] ([`HOPPER_ARCH`] where it is Hopper's only).
///
/// # Errors
/// [`DeviceError::Cuda`] with the compiler's log.
pub fn compile(program: &KernelProgram) -> Result<cudarc::nvrtc::Ptx, DeviceError> {
    let options = cudarc::nvrtc::CompileOptions {
        arch: Some(if program.hopper_only {
            HOPPER_ARCH
        } else {
            ARCH
        }),
        options: vec!["--std=c++17".into()],
        name: Some(format!("{}.cu", program.name)),
        ..Default::default()
    };
    let source = [GRID_PRELUDE]
        .iter()
        .chain(program.sources)
        .chain([&COPY_SOURCE])
        .copied()
        .collect::<String>();
    if let Some(kernel) = kernel_without_grid_begin(&source) {
        return Err(DeviceError::Cuda {
            call: "nvrtcCompileProgram",
            message: format!(
                "kernel `{kernel}` of {} does not start with `{GRID_BEGIN}`, which every kernel must (it is launched before the kernel ahead of it has finished)",
                program.name
            ),
        });
    }
    cudarc::nvrtc::compile_ptx_with_opts(source, options).map_err(|error| {
        let message = match &error {
            cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                log.to_string_lossy().into_owned()
            }
            other => format!("{other:?}"),
        };
        DeviceError::Cuda {
            call: "nvrtcCompileProgram",
            message,
        }
    })
}

/// Maps a cudarc driver error to ours, naming the call.
fn cuda(call: &'static str) -> impl Fn(cudarc::driver::DriverError) -> DeviceError {
    move |error| DeviceError::Cuda {
        call,
        message: error.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::{GRID_PRELUDE, KernelProgram, compile, kernel_without_grid_begin};
    use crate::ops::gpu::{HOPPER_PROGRAM, PROGRAM};

    #[test]
    fn compile_refuses_a_kernel_that_does_not_start_with_grid_begin_naming_it() {
        // Refused before NVRTC is asked: no library needed.
        let bad = KernelProgram {
            name: "bad",
            sources: &["extern \"C\" __global__ void early(float* x) { x[0] = 1.0f; }\n"],
            kernels: &[&["early"]],
            hopper_only: false,
        };
        let err = compile(&bad).unwrap_err().to_string();
        assert!(
            err.contains("early(float* x)") && err.contains("grid_begin();") && err.contains("bad"),
            "{err}"
        );
    }

    #[test]
    fn every_kernel_of_the_programs_starts_with_grid_begin() {
        for program in [PROGRAM, HOPPER_PROGRAM] {
            let source: String = program.sources.concat() + super::COPY_SOURCE;
            assert_eq!(kernel_without_grid_begin(&source), None, "{}", program.name);
        }
    }

    #[test]
    fn a_kernel_touching_memory_before_grid_begin_is_named() {
        let good =
            "extern \"C\" __global__ void a(float* x) {\n    grid_begin();\n    x[0] = 1.0f;\n}\n";
        let macro_kernel = "#define K(N) extern \"C\" __global__ void k_##N(float* x) { \\\n        grid_begin(); \\\n    }\n";
        let bad = "extern \"C\" __global__ void __launch_bounds__(128)\n    b(float* x) {\n    x[0] = 1.0f;\n    grid_begin();\n}\n";
        assert_eq!(
            kernel_without_grid_begin(&(GRID_PRELUDE.to_owned() + good)),
            None
        );
        assert_eq!(kernel_without_grid_begin(macro_kernel), None);
        assert_eq!(
            kernel_without_grid_begin(&(good.to_owned() + bad)),
            Some("__global__ void __launch_bounds__(128)\n    b(float* x)")
        );
    }
}
