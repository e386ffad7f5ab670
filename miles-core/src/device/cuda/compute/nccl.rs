//! Collectives between GPUs through NCCL, queued on a [`Gpu`]'s compute stream.
//!
//! One process drives one GPU and holds one [`NcclComm`] per group it belongs to. Rank 0 makes
//! the id with [`NcclComm::unique_id`], hands it to the other ranks (`crate::comm::exchange_id`),
//! and every rank opens the communicator with [`NcclComm::new`].
//!
//! # Offload cycles
//! A communicator survives any number of pauses and resumes of the memory its buffers live in,
//! without being destroyed and rebuilt: NCCL keeps no registration of our buffers. Each
//! collective takes the raw device addresses at the call and NCCL copies through its own
//! internal buffers (allocated by NCCL, never paused by us); only `ncclCommRegister` or
//! `ncclMemAlloc`/window registration would pin a mapping of ours inside NCCL, and miles calls
//! neither. A resume commits memory again at the same addresses, so the next collective simply
//! sees the restored bytes. NVLink multicast (NVLS) buffers are NCCL's own as well; no
//! multicast API is used here.
//!
//! NCCL's own buffers can leave the device for the other phase too: [`NcclComm::suspend`]
//! releases them (`ncclCommSuspend`, NCCL 2.29.7 and later, checked at run time) and
//! [`NcclComm::resume`] brings them back, the communicator and its connections kept; both are
//! collective. Where NCCL cannot release them they stay on the device, and `suspend` says so by
//! returning `None`.

use std::ffi::{CStr, c_int};
use std::sync::{Arc, OnceLock};

use cudarc::nccl::result::{self, NcclError};
use cudarc::nccl::sys;
use half::bf16;

use super::{Gpu, GpuSlice, cuda};
use crate::device::{DeviceError, GpuElement};

/// Bytes of a communicator id (NCCL's `ncclUniqueId`).
pub const ID_BYTES: usize = 128;

/// `ncclCommSuspend`'s flag that releases the communicator's device memory (`nccl.h`).
const SUSPEND_MEM: c_int = 0x01;

/// The calls [`NcclComm::suspend`] and [`NcclComm::resume`] need, absent before NCCL 2.29.7.
const SUSPEND_SYMBOLS: [&str; 3] = ["ncclCommSuspend", "ncclCommResume", "ncclCommMemStats"];

/// One rank's NCCL communicator over f32 buffers of its GPU.
///
/// Every call only queues work on the GPU's compute stream, in order with the kernels queued
/// there; [`Gpu::synchronize`] (or a fence for the memory manager, [`Gpu::record_fence`]) waits
/// for it. Every rank must issue the same collectives in the same order with matching lengths,
/// or NCCL hangs.
pub struct NcclComm {
    comm: sys::ncclComm_t,
    gpu: Arc<Gpu>,
    rank: usize,
    world: usize,
    /// One f32 of device memory (`cuMemAlloc`, outside the memory manager) for
    /// [`NcclComm::barrier`].
    scratch: u64,
    /// The bytes NCCL released, while its buffers are released ([`NcclComm::suspend`]).
    suspended: Option<u64>,
}

// SAFETY: an NCCL communicator may be used from any thread as long as two threads never call
// it at once; `NcclComm` is not `Sync`, so a shared reference never crosses threads, and every
// call binds the GPU's context to the calling thread first.
unsafe impl Send for NcclComm {}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("gpu", &self.gpu.device().ordinal())
            .finish_non_exhaustive()
    }
}

impl NcclComm {
    /// A fresh communicator id (`ncclGetUniqueId`): rank 0 makes it and hands it to the
    /// others. It also names rank 0's bootstrap address, so it is made on rank 0's host.
    ///
    /// # Errors
    /// [`DeviceError::CudaUnavailable`] when NCCL cannot be loaded; [`DeviceError::Cuda`] with
    /// NCCL's words otherwise.
    pub fn unique_id() -> Result<[u8; ID_BYTES], DeviceError> {
        nccl_ready()?;
        let id = result::get_uniqueid().map_err(nccl("ncclGetUniqueId"))?;
        Ok(id.internal.map(|byte| byte as u8))
    }

    /// Opens rank `rank` of a group of `world` on `gpu` (`ncclCommInitRank`); blocks until
    /// every rank of the group has called it with the same `id`.
    ///
    /// # Errors
    /// [`DeviceError::BadRank`] for a rank not below `world`; [`DeviceError::CudaUnavailable`]
    /// when NCCL cannot be loaded; [`DeviceError::Cuda`] when NCCL fails (a mismatched id or
    /// world, two ranks on one GPU, a peer that never joins).
    pub fn new(
        gpu: Arc<Gpu>,
        id: [u8; ID_BYTES],
        rank: usize,
        world: usize,
    ) -> Result<NcclComm, DeviceError> {
        if rank >= world {
            return Err(DeviceError::BadRank {
                what: "rank",
                rank,
                world,
            });
        }
        let too_many = || DeviceError::BadRank {
            what: "rank",
            rank,
            world: c_int::MAX as usize,
        };
        let nranks = c_int::try_from(world).map_err(|_| too_many())?;
        let my_rank = c_int::try_from(rank).map_err(|_| too_many())?;
        nccl_ready()?;
        bind(&gpu)?;
        // SAFETY: the GPU's context is current on this thread; 4 bytes is a valid size.
        let scratch = unsafe { cudarc::driver::result::malloc_sync(size_of::<f32>()) }
            .map_err(cuda("cuMemAlloc"))?;
        let unique = sys::ncclUniqueId {
            internal: id.map(|byte| byte as std::ffi::c_char),
        };
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-pointer; rank and size are in range; the GPU's context
        // is current, so NCCL binds the communicator to this GPU.
        let init = unsafe { result::comm_init_rank(&mut comm, nranks, unique, my_rank) };
        if let Err(error) = init {
            // SAFETY: `scratch` came from cuMemAlloc above and nothing uses it.
            if let Err(free) = unsafe { cudarc::driver::result::free_sync(scratch) } {
                tracing::warn!(%free, "could not free the barrier scratch");
            }
            return Err(nccl("ncclCommInitRank")(error));
        }
        tracing::info!(
            rank,
            world,
            gpu = gpu.device().ordinal(),
            "opened the nccl communicator"
        );
        Ok(NcclComm {
            comm,
            gpu,
            rank,
            world,
            scratch,
            suspended: None,
        })
    }

    /// Whether the NCCL loaded can release a communicator's buffers (`ncclCommSuspend` and
    /// its companions, from 2.29.7 on).
    pub fn can_suspend() -> bool {
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| crate::device::probe::cudarc_library_has("nccl", &SUSPEND_SYMBOLS))
    }

    /// Releases the device memory NCCL holds for this communicator until
    /// [`resume`](Self::resume): its internal buffers go, the communicator and its connections
    /// stay. Collective: every rank of the group calls it (NCCL waits for all of them). Waits
    /// for the queued work first (no collective may be in flight). Returns the bytes released,
    /// or `None` where NCCL cannot release them (before 2.29.7, its memory manager switched off
    /// by `NCCL_DISABLE_MEM_MANAGER`, or a communicator sharing its resources): they stay on
    /// the device. A suspended communicator refuses collectives; suspending it again does
    /// nothing. Destroying a suspended communicator is NCCL's to handle (it brings the buffers
    /// back to free them).
    ///
    /// # Errors
    /// [`DeviceError::Cuda`] from the queued work or from NCCL; after one, the communicator
    /// may be half released: rebuild it.
    pub fn suspend(&mut self) -> Result<Option<u64>, DeviceError> {
        if !Self::can_suspend() {
            return Ok(None);
        }
        if let Some(bytes) = self.suspended {
            return Ok(Some(bytes));
        }
        bind(&self.gpu)?;
        self.gpu.synchronize()?;
        let cannot = |error: &NcclError| error.0 == sys::ncclResult_t::ncclInvalidUsage;
        let bytes = match self.memory_stat(sys::ncclCommMemStat_t::ncclStatGpuMemSuspend) {
            Ok(bytes) => bytes,
            Err(error) if cannot(&error) => return Ok(None),
            Err(error) => return Err(nccl("ncclCommMemStats")(error)),
        };
        // SAFETY: the communicator is alive and idle (the stream it queues on is synchronised);
        // the flag is one nccl.h defines.
        match unsafe { sys::ncclCommSuspend(self.comm, SUSPEND_MEM) }.result() {
            Ok(_) => {}
            Err(error) if cannot(&error) => return Ok(None),
            Err(error) => return Err(nccl("ncclCommSuspend")(error)),
        }
        self.suspended = Some(bytes);
        Ok(Some(bytes))
    }

    /// Brings back what [`suspend`](Self::suspend) released. Collective: every rank of the
    /// group calls it (NCCL exchanges the buffers' handles). Does nothing on a communicator
    /// that is not suspended; after a failure (no memory for the buffers) it may be called
    /// again.
    ///
    /// # Errors
    /// [`DeviceError::Cuda`] from NCCL (no memory for its buffers, a peer that is gone).
    pub fn resume(&mut self) -> Result<(), DeviceError> {
        if self.suspended.is_none() {
            return Ok(());
        }
        bind(&self.gpu)?;
        // SAFETY: the communicator is alive and suspended.
        unsafe { sys::ncclCommResume(self.comm) }
            .result()
            .map_err(nccl("ncclCommResume"))?;
        self.suspended = None;
        Ok(())
    }

    /// Whether NCCL's buffers are released ([`suspend`](Self::suspend)).
    pub fn is_suspended(&self) -> bool {
        self.suspended.is_some()
    }

    /// Device bytes NCCL holds for this communicator (`ncclStatGpuMemTotal`), or `None` when
    /// the NCCL loaded cannot say (before 2.29.7).
    ///
    /// # Errors
    /// [`DeviceError::Cuda`] from NCCL.
    pub fn device_bytes(&self) -> Result<Option<u64>, DeviceError> {
        if !Self::can_suspend() {
            return Ok(None);
        }
        self.memory_stat(sys::ncclCommMemStat_t::ncclStatGpuMemTotal)
            .map(Some)
            .map_err(nccl("ncclCommMemStats"))
    }

    /// One of `ncclCommMemStats`'s figures; only called once [`can_suspend`](Self::can_suspend)
    /// found the call.
    fn memory_stat(&self, stat: sys::ncclCommMemStat_t) -> Result<u64, NcclError> {
        let mut value = 0u64;
        // SAFETY: the communicator is alive; `value` is a valid out-pointer.
        unsafe { sys::ncclCommMemStats(self.comm, stat, &mut value) }.result()?;
        Ok(value)
    }

    /// This rank, `0..world_size()`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the group.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// The GPU whose stream the collectives queue on.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Replaces `buf` on every rank with the element-wise sum over the ranks, in place.
    ///
    /// # Errors
    /// [`DeviceError::Cuda`] with NCCL's words.
    pub fn all_reduce_sum(&self, buf: GpuSlice<f32>) -> Result<(), DeviceError> {
        self.all_reduce_in_place(buf.address(), buf.len(), sys::ncclDataType_t::ncclFloat32)
    }

    /// As [`all_reduce_sum`](Self::all_reduce_sum) on bf16 elements (summed in bf16 by NCCL):
    /// the tensor-parallel activations.
    ///
    /// # Errors
    /// [`DeviceError::Cuda`] with NCCL's words.
    pub fn all_reduce_sum_bf16(&self, buf: GpuSlice<bf16>) -> Result<(), DeviceError> {
        self.all_reduce_in_place(buf.address(), buf.len(), sys::ncclDataType_t::ncclBfloat16)
    }

    fn all_reduce_in_place(
        &self,
        address: u64,
        len: usize,
        datatype: sys::ncclDataType_t,
    ) -> Result<(), DeviceError> {
        let stream = self.queue("ncclAllReduce")?;
        // SAFETY: `address` holds `len` elements of `datatype` in device memory of this GPU
        // that the caller holds (a `GpuSlice`), read and written in place (allowed by NCCL);
        // the communicator is alive.
        unsafe {
            result::all_reduce(
                address as *const _,
                address as *mut _,
                len,
                datatype,
                sys::ncclRedOp_t::ncclSum,
                self.comm,
                stream,
            )
        }
        .map(drop)
        .map_err(nccl("ncclAllReduce"))
    }

    /// Concatenates every rank's `send` in rank order into `recv` (`world_size * send.len()`
    /// elements). `send` and `recv` must not overlap, except `send` being block `rank` of
    /// `recv` (NCCL's in-place form).
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`] for a `recv` of the wrong length; [`DeviceError::Cuda`].
    pub fn all_gather(&self, send: GpuSlice<f32>, recv: GpuSlice<f32>) -> Result<(), DeviceError> {
        recv.expect_len("all_gather receive buffer", self.world * send.len())?;
        self.all_gather_raw(send, recv, sys::ncclDataType_t::ncclFloat32)
    }

    /// Fills every block of `all` (`world_size` equal blocks of bf16) with that rank's block,
    /// in place: the bf16 weights after each rank updated its own block.
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`] for a length the world size does not divide;
    /// [`DeviceError::Cuda`].
    pub fn all_gather_bf16_in_place(&self, all: GpuSlice<bf16>) -> Result<(), DeviceError> {
        let block = all.len() / self.world;
        all.expect_len("all_gather buffer", self.world * block)?;
        let send = all.sub(self.rank * block, block)?;
        self.all_gather_raw(send, all, sys::ncclDataType_t::ncclBfloat16)
    }

    fn all_gather_raw<T: GpuElement>(
        &self,
        send: GpuSlice<T>,
        recv: GpuSlice<T>,
        datatype: sys::ncclDataType_t,
    ) -> Result<(), DeviceError> {
        let stream = self.queue("ncclAllGather")?;
        // SAFETY: the callers checked that `recv` holds world * send.len() elements of
        // `datatype`, as NCCL writes; both are device memory of this GPU the caller holds, and
        // `send` is either apart from `recv` or block `rank` of it (NCCL's in-place form).
        unsafe {
            result::all_gather(
                send.address() as *const _,
                recv.address() as *mut _,
                send.len(),
                datatype,
                self.comm,
                stream,
            )
        }
        .map(drop)
        .map_err(nccl("ncclAllGather"))
    }

    /// Sums `send` (`world_size * recv.len()` elements) over the ranks and leaves block `rank`
    /// of the sum in `recv`. They must not overlap, except `recv` being block `rank` of `send`.
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`] for a `send` of the wrong length; [`DeviceError::Cuda`].
    pub fn reduce_scatter_sum(
        &self,
        send: GpuSlice<f32>,
        recv: GpuSlice<f32>,
    ) -> Result<(), DeviceError> {
        send.expect_len("reduce_scatter send buffer", self.world * recv.len())?;
        self.reduce_scatter_raw(send, recv, sys::ncclDataType_t::ncclFloat32)
    }

    /// Sums `all` (`world_size` equal blocks of bf16) over the ranks, in bf16, leaving block
    /// `rank` of the sum in block `rank` of `all`.
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`] for a length the world size does not divide;
    /// [`DeviceError::Cuda`].
    pub fn reduce_scatter_bf16_in_place(&self, all: GpuSlice<bf16>) -> Result<(), DeviceError> {
        let block = all.len() / self.world;
        all.expect_len("reduce_scatter buffer", self.world * block)?;
        let recv = all.sub(self.rank * block, block)?;
        self.reduce_scatter_raw(all, recv, sys::ncclDataType_t::ncclBfloat16)
    }

    fn reduce_scatter_raw<T: GpuElement>(
        &self,
        send: GpuSlice<T>,
        recv: GpuSlice<T>,
        datatype: sys::ncclDataType_t,
    ) -> Result<(), DeviceError> {
        let stream = self.queue("ncclReduceScatter")?;
        // SAFETY: the callers checked that `send` holds world * recv.len() elements of
        // `datatype`, as NCCL reads; both are device memory of this GPU the caller holds, and
        // `recv` is either apart from `send` or block `rank` of it (NCCL's in-place form).
        unsafe {
            result::reduce_scatter(
                send.address() as *const _,
                recv.address() as *mut _,
                recv.len(),
                datatype,
                sys::ncclRedOp_t::ncclSum,
                self.comm,
                stream,
            )
        }
        .map(drop)
        .map_err(nccl("ncclReduceScatter"))
    }

    /// Copies `buf` of rank `root` into `buf` of every rank, in place.
    ///
    /// # Errors
    /// [`DeviceError::BadRank`] for a root not below the world size; [`DeviceError::Cuda`].
    pub fn broadcast(&self, buf: GpuSlice<f32>, root: usize) -> Result<(), DeviceError> {
        Collectives::check_root(self, "broadcast root", root)?;
        let stream = self.queue("ncclBroadcast")?;
        // SAFETY: `buf` is device memory of this GPU the caller holds, read on the root and
        // written elsewhere, in place; `root` is below the world size, which fits a c_int.
        unsafe {
            result::broadcast(
                buf.address() as *const _,
                buf.address() as *mut _,
                buf.len(),
                sys::ncclDataType_t::ncclFloat32,
                root as c_int,
                self.comm,
                stream,
            )
        }
        .map(drop)
        .map_err(nccl("ncclBroadcast"))
    }

    /// Copies `send` of rank `root` into `recv` of every rank (the root's own included); `send`
    /// is read on the root alone. They hold the same number of bf16 elements, apart or the same.
    ///
    /// # Errors
    /// [`DeviceError::ShapeMismatch`] for lengths that differ; as
    /// [`broadcast`](Self::broadcast).
    pub fn broadcast_bf16(
        &self,
        send: GpuSlice<bf16>,
        recv: GpuSlice<bf16>,
        root: usize,
    ) -> Result<(), DeviceError> {
        recv.expect_len("broadcast receive buffer", send.len())?;
        Collectives::check_root(self, "broadcast root", root)?;
        let stream = self.queue("ncclBroadcast")?;
        // SAFETY: `send` and `recv` hold the same number of bf16 elements in device memory of
        // this GPU the caller holds, `send` read on the root and `recv` written everywhere
        // (apart, or the same: NCCL's in-place form); `root` is below the world size.
        unsafe {
            result::broadcast(
                send.address() as *const _,
                recv.address() as *mut _,
                recv.len(),
                sys::ncclDataType_t::ncclBfloat16,
                root as c_int,
                self.comm,
                stream,
            )
        }
        .map(drop)
        .map_err(nccl("ncclBroadcast"))
    }

    /// Sums `buf` over the ranks into rank `root`'s `buf`, in place; the others' `buf` stay as
    /// they were.
    ///
    /// # Errors
    /// As [`broadcast`](Self::broadcast).
    pub fn reduce_sum(&self, buf: GpuSlice<f32>, root: usize) -> Result<(), DeviceError> {
        Collectives::check_root(self, "reduce root", root)?;
        let stream = self.queue("ncclReduce")?;
        // SAFETY: `buf` is device memory of this GPU the caller holds, read everywhere and
        // written on the root, in place (allowed by NCCL); `root` is below the world size.
        unsafe {
            result::reduce(
                buf.address() as *const _,
                buf.address() as *mut _,
                buf.len(),
                sys::ncclDataType_t::ncclFloat32,
                sys::ncclRedOp_t::ncclSum,
                root as c_int,
                self.comm,
                stream,
            )
        }
        .map(drop)
        .map_err(nccl("ncclReduce"))
    }

    /// Returns once every rank has reached it and this GPU's queued work is done: an
    /// all-reduce of one float, then a synchronize of the compute stream.
    ///
    /// # Errors
    /// [`DeviceError::Cuda`] from NCCL or from queued work.
    pub fn barrier(&self) -> Result<(), DeviceError> {
        let scratch = GpuSlice::of(crate::device::AddressRange {
            start: self.scratch,
            len: size_of::<f32>(),
        })?;
        self.all_reduce_sum(scratch)?;
        self.gpu.synchronize()
    }

    /// Binds the GPU's context and returns the compute stream as NCCL takes it, for `call`;
    /// refused while suspended.
    fn queue(&self, call: &'static str) -> Result<sys::cudaStream_t, DeviceError> {
        if self.suspended.is_some() {
            return Err(DeviceError::CommSuspended { call });
        }
        bind(&self.gpu)?;
        Ok(self.gpu.stream().cu_stream() as sys::cudaStream_t)
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if let Err(error) = bind(&self.gpu).and_then(|()| self.gpu.synchronize()) {
            tracing::warn!(%error, "queued work failed before the nccl communicator closed");
        }
        // SAFETY: `comm` came from ncclCommInitRank, is finalized and destroyed once, here,
        // with no collective of it left on the stream.
        let closed = unsafe { result::comm_finalize(self.comm) }
            .map_err(nccl("ncclCommFinalize"))
            .and_then(|_| {
                // SAFETY: as above; finalize has flushed the communicator.
                unsafe { result::comm_destroy(self.comm) }.map_err(nccl("ncclCommDestroy"))
            });
        if let Err(error) = closed {
            tracing::warn!(%error, "could not close the nccl communicator");
        }
        // SAFETY: `scratch` came from cuMemAlloc in `new`; the stream is synchronised and the
        // communicator gone, so nothing uses it.
        if let Err(error) = unsafe { cudarc::driver::result::free_sync(self.scratch) } {
            tracing::warn!(%error, "could not free the barrier scratch");
        }
    }
}

/// Makes the GPU's context current on this thread (NCCL finds its device through it).
fn bind(gpu: &Gpu) -> Result<(), DeviceError> {
    gpu.stream()
        .context()
        .bind_to_thread()
        .map_err(cuda("cuCtxSetCurrent"))
}

/// Whether cudarc can load NCCL: checked before cudarc touches it, since cudarc panics
/// otherwise.
fn nccl_ready() -> Result<(), DeviceError> {
    crate::device::probe::cudarc_library_ready("nccl")
        .map_err(|why| DeviceError::CudaUnavailable(format!("nccl cannot be loaded: {why}")))
}

/// Maps an NCCL error to ours, naming the call, with NCCL's own description.
fn nccl(call: &'static str) -> impl Fn(NcclError) -> DeviceError {
    move |error| {
        // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
        let text = unsafe { sys::ncclGetErrorString(error.0) };
        let message = if text.is_null() {
            format!("{:?}", error.0)
        } else {
            // SAFETY: non-null, static and NUL-terminated, as above.
            let text = unsafe { CStr::from_ptr(text) };
            format!("{} ({:?})", text.to_string_lossy(), error.0)
        };
        DeviceError::Cuda { call, message }
    }
}

/// The collectives a parallel group of GPU trainers runs, whatever carries them: NCCL between
/// GPUs ([`NcclComm`]), or in tests the host between ranks on one GPU. Each call queues its work
/// on the GPU's compute stream (or finishes it there), in order with the kernels queued before
/// it; every rank must call the same collectives in the same order with matching lengths.
pub trait Collectives: Send {
    /// This rank, `0..world_size()`.
    fn rank(&self) -> usize;

    /// Ranks in the group.
    fn world_size(&self) -> usize;

    /// The GPU whose stream the collectives queue on.
    fn gpu(&self) -> &Arc<Gpu>;

    /// An error naming `what` unless `root` is a rank of the group.
    ///
    /// # Errors
    /// [`DeviceError::BadRank`].
    fn check_root(&self, what: &'static str, root: usize) -> Result<(), DeviceError> {
        let world = self.world_size();
        if root >= world {
            return Err(DeviceError::BadRank {
                what,
                rank: root,
                world,
            });
        }
        Ok(())
    }

    /// `buf` on every rank becomes the element-wise sum over the ranks.
    ///
    /// # Errors
    /// As [`NcclComm::all_reduce_sum`].
    fn all_reduce_sum(&self, buf: GpuSlice<f32>) -> Result<(), DeviceError>;

    /// As [`all_reduce_sum`](Self::all_reduce_sum) on bf16 elements.
    ///
    /// # Errors
    /// As [`NcclComm::all_reduce_sum_bf16`].
    fn all_reduce_sum_bf16(&self, buf: GpuSlice<bf16>) -> Result<(), DeviceError>;

    /// `recv` (`world_size` blocks of `send`'s length) becomes every rank's `send` in rank
    /// order.
    ///
    /// # Errors
    /// As [`NcclComm::all_gather`].
    fn all_gather(&self, send: GpuSlice<f32>, recv: GpuSlice<f32>) -> Result<(), DeviceError>;

    /// Every block of `all` becomes that rank's block.
    ///
    /// # Errors
    /// As [`NcclComm::all_gather_bf16_in_place`].
    fn all_gather_bf16_in_place(&self, all: GpuSlice<bf16>) -> Result<(), DeviceError>;

    /// `recv` becomes block `rank` of the sum over the ranks of `send` (`world_size` blocks of
    /// `recv`'s length).
    ///
    /// # Errors
    /// As [`NcclComm::reduce_scatter_sum`].
    fn reduce_scatter_sum(
        &self,
        send: GpuSlice<f32>,
        recv: GpuSlice<f32>,
    ) -> Result<(), DeviceError>;

    /// Block `rank` of `all` becomes block `rank` of the sum over the ranks, in bf16.
    ///
    /// # Errors
    /// As [`NcclComm::reduce_scatter_bf16_in_place`].
    fn reduce_scatter_bf16_in_place(&self, all: GpuSlice<bf16>) -> Result<(), DeviceError>;

    /// `buf` on every rank becomes rank `root`'s.
    ///
    /// # Errors
    /// As [`NcclComm::broadcast`].
    fn broadcast(&self, buf: GpuSlice<f32>, root: usize) -> Result<(), DeviceError>;

    /// `recv` on every rank becomes rank `root`'s `send` (bf16, the same length; apart or the
    /// same).
    ///
    /// # Errors
    /// As [`NcclComm::broadcast_bf16`].
    fn broadcast_bf16(
        &self,
        send: GpuSlice<bf16>,
        recv: GpuSlice<bf16>,
        root: usize,
    ) -> Result<(), DeviceError>;

    /// `buf` on rank `root` becomes the element-wise sum over the ranks; the others' stay.
    ///
    /// # Errors
    /// As [`NcclComm::reduce_sum`].
    fn reduce_sum(&self, buf: GpuSlice<f32>, root: usize) -> Result<(), DeviceError>;

    /// Releases the group's own device buffers where it can; their bytes, `None` where they
    /// stay (or there are none). Collective.
    ///
    /// # Errors
    /// As [`NcclComm::suspend`].
    fn suspend(&mut self) -> Result<Option<u64>, DeviceError>;

    /// Brings back what [`suspend`](Self::suspend) released. Collective.
    ///
    /// # Errors
    /// As [`NcclComm::resume`].
    fn resume(&mut self) -> Result<(), DeviceError>;
}

impl Collectives for NcclComm {
    fn rank(&self) -> usize {
        NcclComm::rank(self)
    }

    fn world_size(&self) -> usize {
        NcclComm::world_size(self)
    }

    fn gpu(&self) -> &Arc<Gpu> {
        NcclComm::gpu(self)
    }

    fn all_reduce_sum(&self, buf: GpuSlice<f32>) -> Result<(), DeviceError> {
        NcclComm::all_reduce_sum(self, buf)
    }

    fn all_reduce_sum_bf16(&self, buf: GpuSlice<bf16>) -> Result<(), DeviceError> {
        NcclComm::all_reduce_sum_bf16(self, buf)
    }

    fn all_gather(&self, send: GpuSlice<f32>, recv: GpuSlice<f32>) -> Result<(), DeviceError> {
        NcclComm::all_gather(self, send, recv)
    }

    fn all_gather_bf16_in_place(&self, all: GpuSlice<bf16>) -> Result<(), DeviceError> {
        NcclComm::all_gather_bf16_in_place(self, all)
    }

    fn reduce_scatter_sum(
        &self,
        send: GpuSlice<f32>,
        recv: GpuSlice<f32>,
    ) -> Result<(), DeviceError> {
        NcclComm::reduce_scatter_sum(self, send, recv)
    }

    fn reduce_scatter_bf16_in_place(&self, all: GpuSlice<bf16>) -> Result<(), DeviceError> {
        NcclComm::reduce_scatter_bf16_in_place(self, all)
    }

    fn broadcast(&self, buf: GpuSlice<f32>, root: usize) -> Result<(), DeviceError> {
        NcclComm::broadcast(self, buf, root)
    }

    fn broadcast_bf16(
        &self,
        send: GpuSlice<bf16>,
        recv: GpuSlice<bf16>,
        root: usize,
    ) -> Result<(), DeviceError> {
        NcclComm::broadcast_bf16(self, send, recv, root)
    }

    fn reduce_sum(&self, buf: GpuSlice<f32>, root: usize) -> Result<(), DeviceError> {
        NcclComm::reduce_sum(self, buf, root)
    }

    fn suspend(&mut self) -> Result<Option<u64>, DeviceError> {
        NcclComm::suspend(self)
    }

    fn resume(&mut self) -> Result<(), DeviceError> {
        NcclComm::resume(self)
    }
}

#[cfg(test)]
#[allow(clippy::panic, clippy::print_stderr)]
mod tests {
    use super::*;
    use crate::device::Device;
    use crate::memory::{
        BackupPolicy, Buffer, ManagerSettings, MemoryManager, MemoryTag, RegionState,
    };
    use crate::ops::gpu::testing::TestGpu;
    use crate::ops::testing::seeded_vec;

    const N: usize = 4099;

    /// A manager over `gpu`'s device with a host-backed region `nccl`, and a communicator of
    /// one rank on `gpu`.
    fn setup(gpu: &Arc<Gpu>) -> (MemoryManager, NcclComm) {
        let device: Arc<dyn Device> = Arc::clone(gpu.device()) as Arc<dyn Device>;
        let settings = ManagerSettings {
            margin_bytes: 0,
            disk: None,
        };
        let memory = MemoryManager::new(device, settings).unwrap();
        memory
            .create_region(tag(), BackupPolicy::Host, 4 * 4 * N + (1 << 20))
            .unwrap();
        let id = NcclComm::unique_id().unwrap();
        let comm = NcclComm::new(Arc::clone(gpu), id, 0, 1).unwrap();
        (memory, comm)
    }

    fn tag() -> MemoryTag {
        MemoryTag::Named("nccl".into())
    }

    fn f32s(memory: &MemoryManager, len: usize) -> (Buffer, GpuSlice<f32>) {
        let buffer = memory.alloc(&tag(), len * 4).unwrap();
        let slice = GpuSlice::of(buffer.range()).unwrap();
        (buffer, slice)
    }

    fn get(gpu: &Gpu, slice: GpuSlice<f32>) -> Vec<f32> {
        let mut out = vec![0.0; slice.len()];
        gpu.download(&mut out, slice).unwrap();
        out
    }

    #[test]
    fn a_unique_id_is_made_or_nccl_is_named_as_missing() {
        match NcclComm::unique_id() {
            Ok(id) => assert!(id.iter().any(|&b| b != 0), "ncclGetUniqueId gave zeros"),
            Err(DeviceError::CudaUnavailable(why)) => {
                eprintln!("no nccl here: {why}");
                assert!(why.contains("nccl"), "{why}");
            }
            Err(other) => panic!("ncclGetUniqueId: {other}"),
        }
    }

    #[test]
    fn gpu_nccl_collectives_of_one_rank_are_the_identity() {
        let test = "gpu_nccl_collectives_of_one_rank_are_the_identity";
        let Some(t) = TestGpu::open(test, 1) else {
            return;
        };
        // The test's lock stays in `t` to the end; the communicator takes the gpu.
        let gpu = Arc::new(t.gpu);
        let (memory, comm) = setup(&gpu);
        assert_eq!((comm.rank(), comm.world_size()), (0, 1));
        let data = seeded_vec(71, N);
        let (_a, a) = f32s(&memory, N);
        let (_b, b) = f32s(&memory, N);

        gpu.upload(a, &data).unwrap();
        comm.all_reduce_sum(a).unwrap();
        assert_eq!(
            get(&gpu, a),
            data,
            "all-reduce over one rank changed the data"
        );

        gpu.zero(b).unwrap();
        comm.all_gather(a, b).unwrap();
        assert_eq!(get(&gpu, b), data, "all-gather over one rank");

        gpu.zero(b).unwrap();
        comm.reduce_scatter_sum(a, b).unwrap();
        assert_eq!(get(&gpu, b), data, "reduce-scatter over one rank");

        comm.broadcast(a, 0).unwrap();
        assert_eq!(get(&gpu, a), data, "broadcast from the only rank");
        comm.barrier().unwrap();
    }

    #[test]
    fn gpu_nccl_collectives_refuse_bad_shapes_and_roots() {
        let test = "gpu_nccl_collectives_refuse_bad_shapes_and_roots";
        let Some(t) = TestGpu::open(test, 1) else {
            return;
        };
        // The test's lock stays in `t` to the end; the communicator takes the gpu.
        let gpu = Arc::new(t.gpu);
        let (memory, comm) = setup(&gpu);
        let (_a, a) = f32s(&memory, N);
        let (_b, b) = f32s(&memory, N - 1);
        assert!(matches!(
            comm.all_gather(a, b),
            Err(DeviceError::ShapeMismatch { expected: N, actual, .. }) if actual == N - 1
        ));
        assert!(matches!(
            comm.reduce_scatter_sum(a, b),
            Err(DeviceError::ShapeMismatch { actual: N, .. })
        ));
        assert!(matches!(
            comm.broadcast(a, 1),
            Err(DeviceError::BadRank {
                rank: 1,
                world: 1,
                ..
            })
        ));
        assert!(matches!(
            NcclComm::new(Arc::clone(&gpu), [7; ID_BYTES], 2, 2),
            Err(DeviceError::BadRank {
                rank: 2,
                world: 2,
                ..
            })
        ));
        comm.barrier().unwrap();
    }

    #[test]
    fn gpu_nccl_communicator_survives_an_offload_cycle_of_its_buffers() {
        let test = "gpu_nccl_communicator_survives_an_offload_cycle_of_its_buffers";
        let Some(t) = TestGpu::open(test, 1) else {
            return;
        };
        // The test's lock stays in `t` to the end; the communicator takes the gpu.
        let gpu = Arc::new(t.gpu);
        let (memory, comm) = setup(&gpu);
        let data = seeded_vec(72, N);
        let (a_buf, a) = f32s(&memory, N);
        let (b_buf, b) = f32s(&memory, N);
        gpu.upload(a, &data).unwrap();
        comm.all_reduce_sum(a).unwrap();
        comm.all_gather(a, b).unwrap();
        let fence = gpu.record_fence().unwrap();
        a_buf.record_use(fence.clone());
        b_buf.record_use(fence);

        memory.pause(&tag()).unwrap();
        assert_eq!(memory.state(&tag()).unwrap(), RegionState::Paused);
        memory.resume(&tag()).unwrap();
        assert_eq!(a_buf.address(), a.address(), "the resume moved the buffer");
        assert_eq!(get(&gpu, a), data, "the resume lost the all-reduced data");
        assert_eq!(get(&gpu, b), data, "the resume lost the gathered data");

        // The same communicator, no rebuild: in place on the restored bytes, then out of place
        // from fresh data into the re-committed memory.
        comm.all_reduce_sum(a).unwrap();
        assert_eq!(get(&gpu, a), data, "all-reduce after the resume");
        let fresh = seeded_vec(73, N);
        gpu.upload(a, &fresh).unwrap();
        comm.all_gather(a, b).unwrap();
        assert_eq!(get(&gpu, b), fresh, "all-gather after the resume");
        comm.barrier().unwrap();
    }

    #[test]
    fn gpu_nccl_suspend_releases_buffers_refuses_collectives_and_resume_brings_them_back() {
        let test =
            "gpu_nccl_suspend_releases_buffers_refuses_collectives_and_resume_brings_them_back";
        let Some(t) = TestGpu::open(test, 1) else {
            return;
        };
        let gpu = Arc::new(t.gpu);
        let (memory, mut comm) = setup(&gpu);
        let data = seeded_vec(74, N);
        let (_a, a) = f32s(&memory, N);
        gpu.upload(a, &data).unwrap();
        comm.all_reduce_sum(a).unwrap();
        if !NcclComm::can_suspend() {
            assert_eq!(comm.suspend().unwrap(), None);
            assert!(!comm.is_suspended());
            eprintln!("{test}: skipped, this nccl lacks ncclCommSuspend (before 2.29.7)");
            return;
        }
        let total = comm.device_bytes().unwrap().unwrap();
        let Some(released) = comm.suspend().unwrap() else {
            eprintln!("{test}: skipped, this nccl cannot release its buffers (memory manager off)");
            return;
        };
        eprintln!("{test}: nccl held {total} bytes on the device, released {released}");
        assert!(released <= total, "released {released} of {total} bytes");
        let flag = comm
            .memory_stat(sys::ncclCommMemStat_t::ncclStatGpuMemSuspended)
            .unwrap();
        assert_eq!(flag, 1, "nccl does not call itself suspended");
        assert!(comm.is_suspended());
        assert_eq!(comm.suspend().unwrap(), Some(released), "a second suspend");
        assert!(matches!(
            comm.all_reduce_sum(a),
            Err(DeviceError::CommSuspended {
                call: "ncclAllReduce"
            })
        ));
        assert!(matches!(
            comm.barrier(),
            Err(DeviceError::CommSuspended { .. })
        ));
        comm.resume().unwrap();
        assert!(!comm.is_suspended());
        comm.resume().unwrap();
        comm.all_reduce_sum(a).unwrap();
        assert_eq!(get(&gpu, a), data, "all-reduce after the resume");
        comm.barrier().unwrap();
    }
}
