"""The package without a GPU: import, API surface, the library's configuration calls and clear
errors. These run in CI; the GPU scenarios are in test_gpu.py."""

import ctypes
import os

import pytest

import miles_memory_saver
from miles_memory_saver import MemorySaverError, TorchMemorySaver, configure_subprocess
from miles_memory_saver import _library


@pytest.fixture
def cdll():
    return _library.load(str(_library.library_path()))


def test_the_package_has_torch_memory_saver_s_public_api():
    saver = miles_memory_saver.torch_memory_saver
    assert isinstance(saver, TorchMemorySaver)
    for name in ["region", "cuda_graph", "disable", "pause", "resume", "get_cpu_backup",
                 "set_disk_backup_dir", "hook_mode", "memory_margin_bytes",
                 "retain_cpu_backup", "enabled"]:
        assert hasattr(TorchMemorySaver, name), name
    assert callable(miles_memory_saver.configure_subprocess)
    assert saver.enabled is True


def test_the_import_line_is_all_a_torch_memory_saver_program_changes():
    import miles_memory_saver as torch_memory_saver

    singleton = torch_memory_saver.torch_memory_saver
    assert isinstance(singleton, torch_memory_saver.TorchMemorySaver)
    for name in ["region", "cuda_graph", "disable", "pause", "resume", "get_cpu_backup",
                 "set_disk_backup_dir"]:
        assert getattr(torch_memory_saver, name) == getattr(singleton, name), name
    assert callable(torch_memory_saver.configure_subprocess)


def test_the_packaged_library_exports_every_entry_point(cdll):
    for name in _library._SIGNATURES:
        assert hasattr(cdll, name), name
    whole = ctypes.CDLL(str(_library.library_path()))
    assert hasattr(whole, "cudaMalloc") and hasattr(whole, "cudaFree")


def test_thread_configuration_round_trips_with_torch_memory_saver_s_defaults(cdll):
    assert cdll.tms_get_current_tag() == b"default"
    assert cdll.tms_get_interesting_region() is False
    assert cdll.tms_set_current_tag(b"kv_cache") == 0
    assert cdll.tms_get_current_tag() == b"kv_cache"
    cdll.tms_set_enable_cpu_backup(True)
    assert cdll.tms_get_enable_cpu_backup() is True
    cdll.tms_set_enable_cpu_backup(False)
    assert cdll.tms_get_cpu_backup_backend() == b"pinned"
    assert cdll.tms_set_current_tag(b"default") == 0


def test_bad_configuration_is_a_status_with_a_message(cdll):
    assert cdll.tms_set_current_tag(None) == 1
    assert b"tag" in cdll.tms_last_error()
    assert cdll.tms_last_error() is None, "reading the error clears it"
    assert cdll.tms_set_cpu_backup_backend(b"mmap") == 1
    assert b"pinned" in cdll.tms_last_error()


def test_pause_and_resume_of_tags_never_allocated_do_nothing():
    saver = TorchMemorySaver()
    saver.hook_mode = "torch"
    saver.pause()
    saver.resume()
    saver.pause("weights")
    saver.resume("weights")


def test_preparing_the_cpu_backup_of_a_tag_never_allocated_does_nothing(cdll):
    assert cdll.tms_prepare_cpu_backup(b"weights") == 0
    assert cdll.tms_prepare_cpu_backup(None) == 1
    assert b"tag" in cdll.tms_last_error()


def test_retain_margin_and_disk_directory_are_set_through_the_library(tmp_path):
    saver = TorchMemorySaver()
    saver.hook_mode = "torch"
    assert saver.retain_cpu_backup is True
    saver.retain_cpu_backup = False
    assert saver.retain_cpu_backup is False
    saver.retain_cpu_backup = True
    saver.memory_margin_bytes = 1 << 30
    assert saver.memory_margin_bytes == 1 << 30
    saver.memory_margin_bytes = 0
    saver.set_disk_backup_dir(str(tmp_path / "offload"))
    assert (tmp_path / "offload").is_dir()


def test_an_allocation_without_a_gpu_fails_with_a_message_naming_the_gpu(cdll):
    cdll.tms_set_interesting_region(True)
    try:
        address = cdll.tms_torch_malloc(1 << 20, 0, None)
        if address:
            cdll.tms_torch_free(address, 1 << 20, 0, None)
            pytest.skip("skipped: a GPU is present, so the allocation succeeds")
        message = cdll.tms_last_error()
        assert b"cuda:0" in message and b"gpu" in message, message
    finally:
        cdll.tms_set_interesting_region(False)


def test_regions_need_pytorch_and_a_gpu_and_say_so():
    saver = TorchMemorySaver()
    saver.hook_mode = "torch"
    try:
        import torch
        if torch.cuda.is_available():
            pytest.skip("skipped: a GPU is present (test_gpu.py covers regions)")
    except ImportError:
        pass
    with pytest.raises(MemorySaverError, match="PyTorch|CUDA GPU"):
        with saver.region():
            pass


def test_preload_mode_without_ld_preload_says_how_to_start_the_process(monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    saver = TorchMemorySaver()
    with pytest.raises(MemorySaverError, match="configure_subprocess"):
        saver.pause()


def test_hook_mode_is_checked_and_fixed_once_in_use():
    saver = TorchMemorySaver()
    with pytest.raises(ValueError, match="preload"):
        saver.hook_mode = "cuda"
    saver.hook_mode = "torch"
    saver.pause()
    with pytest.raises(MemorySaverError, match="before"):
        saver.hook_mode = "preload"


def test_backup_choices_are_checked_before_anything_is_allocated():
    saver = TorchMemorySaver()
    saver.hook_mode = "torch"
    with pytest.raises(ValueError, match="mutually exclusive"):
        with saver.region(enable_cpu_backup=True, enable_disk_backup=True):
            pass
    with pytest.raises(ValueError, match="pinned"):
        with saver.region(enable_cpu_backup=True, cpu_backup_backend="mmap"):
            pass


def test_configure_subprocess_puts_the_library_first_in_ld_preload_and_restores_it(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/lib/other.so")
    with configure_subprocess():
        first, rest = os.environ["LD_PRELOAD"].split(":", 1)
        assert first == str(_library.library_path()) and rest == "/lib/other.so"
        assert os.path.exists(first)
    assert os.environ["LD_PRELOAD"] == "/lib/other.so"
