"""The native library (the miles-torch cdylib) through ctypes: where it lies, its C
signatures, and status codes turned into exceptions carrying the library's message."""

import ctypes
import os
from functools import lru_cache
from pathlib import Path

#: Set to the library's path to load another build of it (tests, a development tree).
PATH_VARIABLE = "MILES_MEMORY_SAVER_LIBRARY"


class MemorySaverError(RuntimeError):
    """A pause, resume or configuration call the library refused; the message says why and
    what to do. Nothing was lost: a failed pause leaves the tag active and intact, a failed
    resume leaves it paused with its backup."""


def packaged_path() -> Path:
    """The library shipped inside this package."""
    return Path(__file__).resolve().parent / "_native" / "lib_native.so"


def library_path() -> Path:
    """The library to load: `$MILES_MEMORY_SAVER_LIBRARY` if set, else the packaged one."""
    override = os.environ.get(PATH_VARIABLE)
    return Path(override) if override else packaged_path()


def preloaded_path() -> Path:
    """The library in `LD_PRELOAD`, for hook mode `preload`: exactly one entry must be ours."""
    entries = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p]
    ours = [p for p in entries if "miles_memory_saver" in p or "miles_torch" in p]
    if len(ours) != 1:
        raise MemorySaverError(
            "hook_mode='preload' needs the miles memory saver in LD_PRELOAD exactly once "
            f"(LD_PRELOAD={os.environ.get('LD_PRELOAD', '')!r}, pid {os.getpid()}): start the "
            "process inside miles_memory_saver.configure_subprocess(), or run it as "
            f"LD_PRELOAD={library_path()} python ..., or set hook_mode = 'torch' before "
            "the first region()"
        )
    return Path(ours[0])


_SIGNATURES = {
    "tms_set_interesting_region": ([ctypes.c_bool], None),
    "tms_get_interesting_region": ([], ctypes.c_bool),
    "tms_set_current_tag": ([ctypes.c_char_p], ctypes.c_int),
    "tms_get_current_tag": ([], ctypes.c_char_p),
    "tms_set_enable_cpu_backup": ([ctypes.c_bool], None),
    "tms_get_enable_cpu_backup": ([], ctypes.c_bool),
    "tms_set_cpu_backup_backend": ([ctypes.c_char_p], ctypes.c_int),
    "tms_get_cpu_backup_backend": ([], ctypes.c_char_p),
    "tms_set_enable_disk_backup": ([ctypes.c_bool], None),
    "tms_get_enable_disk_backup": ([], ctypes.c_bool),
    "tms_set_disk_backup_dir": ([ctypes.c_char_p], ctypes.c_int),
    "set_memory_margin_bytes": ([ctypes.c_uint64], None),
    "tms_set_retain_cpu_backup": ([ctypes.c_bool], None),
    "tms_get_retain_cpu_backup": ([], ctypes.c_bool),
    "tms_pause": ([ctypes.c_char_p], ctypes.c_int),
    "tms_resume": ([ctypes.c_char_p], ctypes.c_int),
    "tms_prepare_cpu_backup": ([ctypes.c_char_p], ctypes.c_int),
    "tms_get_cpu_backup_pointer": ([ctypes.c_void_p, ctypes.c_uint64], ctypes.c_void_p),
    "tms_last_error": ([], ctypes.c_char_p),
    "tms_torch_malloc": ([ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p], ctypes.c_void_p),
    "tms_torch_free": (
        [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p],
        None,
    ),
}


@lru_cache(maxsize=None)
def load(path: str) -> ctypes.CDLL:
    """The library at `path` with its C signatures set (loaded once per path)."""
    if not Path(path).exists():
        raise MemorySaverError(
            f"the miles memory saver library {path} does not exist: reinstall the "
            f"miles_memory_saver wheel or point {PATH_VARIABLE} at a build of miles-torch"
        )
    cdll = ctypes.CDLL(path)
    for name, (argtypes, restype) in _SIGNATURES.items():
        function = getattr(cdll, name)
        function.argtypes = argtypes
        function.restype = restype
    return cdll


def last_error(cdll: ctypes.CDLL) -> str:
    """The message of the calling thread's last failed call (cleared by reading it)."""
    message = cdll.tms_last_error()
    return message.decode("utf-8", "replace") if message else "no message from the library"


def check(cdll: ctypes.CDLL, status: int, what: str) -> None:
    """Raise MemorySaverError with the library's message when `status` is not 0."""
    if status != 0:
        raise MemorySaverError(f"{what} failed: {last_error(cdll)}")


def encode(text):
    """A str as the UTF-8 bytes a C string argument takes; None stays NULL."""
    return None if text is None else text.encode("utf-8")
