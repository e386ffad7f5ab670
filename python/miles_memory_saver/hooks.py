"""Hook mode preload: start subprocesses with the library in LD_PRELOAD."""

import os
from contextlib import contextmanager

from ._library import library_path


@contextmanager
def configure_subprocess():
    """Inside, LD_PRELOAD names the miles memory saver first, so that subprocesses started
    here (with hook_mode='preload') have their cudaMalloc and cudaFree go through it."""
    previous = os.environ.get("LD_PRELOAD")
    path = str(library_path())
    os.environ["LD_PRELOAD"] = f"{path}:{previous}" if previous else path
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = previous
