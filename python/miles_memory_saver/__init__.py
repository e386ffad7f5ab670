"""miles_memory_saver: torch_memory_saver's API on the miles memory manager.

A program written for torch_memory_saver changes one line::

    import miles_memory_saver as torch_memory_saver
    from miles_memory_saver import torch_memory_saver   # the singleton, as before

Tensors made in `torch_memory_saver.region(tag=...)` pause and resume by tag; CPU backups
go to a pinned pool reused across cycles and copy at the PCIe link's speed.
"""

from ._library import MemorySaverError
from .entrypoint import TorchMemorySaver
from .hooks import configure_subprocess

__all__ = ["MemorySaverError", "TorchMemorySaver", "configure_subprocess", "torch_memory_saver"]

#: The process's memory saver.
torch_memory_saver = TorchMemorySaver()

# The singleton's calls at module level too, for code that calls them on the module.
region = torch_memory_saver.region
cuda_graph = torch_memory_saver.cuda_graph
disable = torch_memory_saver.disable
pause = torch_memory_saver.pause
resume = torch_memory_saver.resume
get_cpu_backup = torch_memory_saver.get_cpu_backup
set_disk_backup_dir = torch_memory_saver.set_disk_backup_dir
