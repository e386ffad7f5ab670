"""TorchMemorySaver: torch_memory_saver's public API over the miles memory manager."""

import ctypes
import os
from contextlib import contextmanager
from typing import Optional

from . import _library
from ._library import MemorySaverError, check, encode

DEFAULT_TAG = "default"
HOOK_MODES = ("preload", "torch")


def _import_torch():
    try:
        import torch
    except ImportError as error:
        raise MemorySaverError(
            "miles_memory_saver needs PyTorch for regions, CUDA graphs and CPU backups: "
            f"install torch ({error})"
        ) from error
    return torch


class TorchMemorySaver:
    """Pause and resume tagged PyTorch GPU memory, as torch_memory_saver.TorchMemorySaver.

    Tensors made inside `region(tag=...)` live in that tag's own address arenas; `pause(tag)`
    backs them up (CPU: a pinned pool reused across cycles; disk: checksummed chunk files;
    neither: dropped) and releases the GPU memory, keeping the addresses; `resume(tag)` maps
    memory at the same addresses and restores the bytes. Errors raise MemorySaverError with
    the library's message; nothing ends the process.
    """

    def __init__(self):
        self._hook_mode = "preload"
        self._cdll = None
        self._torch_state = None

    # -- configuration -------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        """Always True (torch_memory_saver keeps it for compatibility)."""
        return True

    @property
    def hook_mode(self) -> str:
        """How allocations reach the library: "preload" (LD_PRELOAD interposes cudaMalloc,
        the default) or "torch" (a PyTorch pluggable allocator). Set before first use."""
        return self._hook_mode

    @hook_mode.setter
    def hook_mode(self, hook_mode: str):
        if hook_mode not in HOOK_MODES:
            raise ValueError(f"hook_mode must be one of {HOOK_MODES}, not {hook_mode!r}")
        if self._cdll is not None:
            raise MemorySaverError(
                "hook_mode cannot change once the memory saver is in use: set it before the "
                "first region() or other call"
            )
        self._hook_mode = hook_mode

    @property
    def memory_margin_bytes(self) -> int:
        """Device memory that must stay free after an allocation in a region or a resume."""
        return getattr(self, "_margin", 0)

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value: int):
        if value < 0:
            raise ValueError(f"memory_margin_bytes must be >= 0, not {value}")
        self._library().set_memory_margin_bytes(int(value))
        self._margin = int(value)

    @property
    def retain_cpu_backup(self) -> bool:
        """Whether CPU backups stay pinned for reuse after a resume (default True; False
        gives the host memory back after each resume, as torch_memory_saver's default)."""
        return bool(self._library().tms_get_retain_cpu_backup())

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool):
        self._library().tms_set_retain_cpu_backup(bool(value))

    def set_disk_backup_dir(self, path: str):
        """Set the directory of disk backups (created if needed); call it before the first
        allocation in a region."""
        os.makedirs(path, exist_ok=True)
        cdll = self._library()
        check(cdll, cdll.tms_set_disk_backup_dir(encode(str(path))), "set_disk_backup_dir")

    # -- regions ---------------------------------------------------------------------------

    @contextmanager
    def region(
        self,
        tag: str = DEFAULT_TAG,
        enable_cpu_backup: bool = False,
        enable_disk_backup: bool = False,
        cpu_backup_backend: Optional[str] = None,
    ):
        """Tensors allocated inside go to `tag`; paused, they are backed up to host memory
        (`enable_cpu_backup`), to disk (`enable_disk_backup`) or dropped."""
        _check_backup_choice(enable_cpu_backup, enable_disk_backup, cpu_backup_backend)
        state = self._torch()
        torch = state.torch
        key = (
            tag,
            enable_cpu_backup,
            enable_disk_backup,
            cpu_backup_backend or "pinned",
            torch.cuda.current_device(),
        )
        pool = state.pool(key)
        with torch.cuda.use_mem_pool(pool):
            with self._configured(tag, enable_cpu_backup, enable_disk_backup, cpu_backup_backend):
                yield
        if enable_cpu_backup:
            self._prepare_cpu_backup(tag)

    @contextmanager
    def cuda_graph(
        self,
        cuda_graph,
        pool=None,
        stream=None,
        capture_error_mode="global",
        tag: str = DEFAULT_TAG,
        enable_cpu_backup: bool = False,
        cpu_backup_backend: Optional[str] = None,
    ):
        """As torch.cuda.graph, with the graph's memory in `tag`, so pausing the tag frees it
        and a resume brings it back at the same addresses (replay needs no recapture)."""
        _check_backup_choice(enable_cpu_backup, False, cpu_backup_backend)
        state = self._torch()
        if self._hook_mode != "preload":
            raise MemorySaverError(
                "pauseable CUDA graphs need hook_mode='preload' (as in torch_memory_saver): "
                "the graph's private pool allocates through cudaMalloc"
            )
        with state.torch.cuda.graph(
            cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode
        ):
            with self._configured(tag, enable_cpu_backup, False, cpu_backup_backend):
                yield
        if enable_cpu_backup:
            self._prepare_cpu_backup(tag)

    @contextmanager
    def disable(self):
        """Inside a region: allocate outside every tag (in a pool of its own, dropped after)."""
        state = self._torch()
        cdll = self._library()
        if not cdll.tms_get_interesting_region():
            raise MemorySaverError("disable() works only inside a region()")
        cdll.tms_set_interesting_region(False)
        try:
            pool = state.torch.cuda.MemPool()
            with state.torch.cuda.use_mem_pool(pool):
                yield
            del pool
        finally:
            cdll.tms_set_interesting_region(True)

    # -- pause and resume ------------------------------------------------------------------

    def pause(self, tag: Optional[str] = None):
        """Pause `tag`, or every tag when None."""
        cdll = self._library()
        check(cdll, cdll.tms_pause(encode(tag)), f"pause(tag={tag!r})")

    def resume(self, tag: Optional[str] = None):
        """Resume `tag`, or every paused tag when None; without room for it (plus the margin)
        it raises and the tag stays paused and intact."""
        cdll = self._library()
        check(cdll, cdll.tms_resume(encode(tag)), f"resume(tag={tag!r})")

    def get_cpu_backup(self, x, zero_copy: bool = False):
        """The CPU backup of tensor `x` while its tag is paused with a CPU backup (a copy,
        or a view of the pinned backup with `zero_copy`), else None."""
        torch = _import_torch()
        if not x.is_cuda:
            raise ValueError(f"get_cpu_backup needs a CUDA tensor, not one on {x.device}")
        if not x.is_contiguous():
            raise ValueError("get_cpu_backup needs a contiguous tensor")
        nbytes = x.numel() * x.element_size()
        address = self._library().tms_get_cpu_backup_pointer(x.data_ptr(), nbytes)
        if not address:
            return None
        raw = (ctypes.c_uint8 * nbytes).from_address(address)
        backup = torch.frombuffer(raw, dtype=torch.uint8).view(x.dtype).view(x.shape)
        return backup if zero_copy else backup.clone()

    # -- internals -------------------------------------------------------------------------

    def _library(self) -> ctypes.CDLL:
        if self._cdll is None:
            if self._hook_mode == "preload":
                path = _library.preloaded_path()
            else:
                path = _library.library_path()
            self._cdll = _library.load(str(path))
        return self._cdll

    def _torch(self) -> "_TorchState":
        if self._torch_state is None:
            self._torch_state = _TorchState(self._hook_mode, self._library())
        return self._torch_state

    def _prepare_cpu_backup(self, tag):
        # Pins the host memory of the tag's CPU backup once its tensors exist, so that the
        # first pause copies at the link's speed instead of pinning on the way.
        cdll = self._library()
        check(cdll, cdll.tms_prepare_cpu_backup(encode(tag)), f"region(tag={tag!r})")

    @contextmanager
    def _configured(self, tag, enable_cpu_backup, enable_disk_backup, cpu_backup_backend):
        cdll = self._library()
        before = (
            cdll.tms_get_current_tag().decode("utf-8"),
            cdll.tms_get_interesting_region(),
            cdll.tms_get_enable_cpu_backup(),
            cdll.tms_get_enable_disk_backup(),
            cdll.tms_get_cpu_backup_backend().decode("utf-8"),
        )
        self._set(tag, True, enable_cpu_backup, enable_disk_backup, cpu_backup_backend)
        try:
            yield
        finally:
            self._set(*before)

    def _set(self, tag, interesting, cpu_backup, disk_backup, backend):
        cdll = self._library()
        check(cdll, cdll.tms_set_current_tag(encode(tag)), f"region(tag={tag!r})")
        if backend is not None:
            check(cdll, cdll.tms_set_cpu_backup_backend(encode(backend)), "cpu_backup_backend")
        cdll.tms_set_interesting_region(bool(interesting))
        cdll.tms_set_enable_cpu_backup(bool(cpu_backup))
        cdll.tms_set_enable_disk_backup(bool(disk_backup))


def _check_backup_choice(enable_cpu_backup, enable_disk_backup, cpu_backup_backend):
    if enable_cpu_backup and enable_disk_backup:
        raise ValueError("enable_cpu_backup and enable_disk_backup are mutually exclusive")
    if cpu_backup_backend is not None:
        if not enable_cpu_backup:
            raise ValueError("cpu_backup_backend requires enable_cpu_backup=True")
        if cpu_backup_backend != "pinned":
            raise ValueError(
                f"cpu_backup_backend={cpu_backup_backend!r} is not supported: miles keeps CPU "
                "backups in a pool of pinned host memory; use 'pinned' (the default)"
            )


class _TorchState:
    """What regions need of PyTorch: the GPU check, the allocator and one pool per region
    kind, so that a region's blocks are never handed to tensors outside it."""

    def __init__(self, hook_mode, cdll):
        torch = _import_torch()
        if not torch.cuda.is_available():
            raise MemorySaverError(
                "miles_memory_saver needs a CUDA GPU: torch.cuda.is_available() is False "
                "(no NVIDIA driver, no GPU, or a CPU-only PyTorch build)"
            )
        if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
            raise MemorySaverError(
                "PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True, which maps memory "
                "outside the allocator the memory saver sees; unset it"
            )
        self.torch = torch
        self.allocator = None
        if hook_mode == "torch":
            from torch.cuda.memory import CUDAPluggableAllocator

            path = str(_library.library_path())
            self._pluggable = CUDAPluggableAllocator(path, "tms_torch_malloc", "tms_torch_free")
            self.allocator = self._pluggable.allocator()
        self._pools = {}

    def pool(self, key):
        if key not in self._pools:
            self._pools[key] = self.torch.cuda.MemPool(allocator=self.allocator)
        return self._pools[key]
