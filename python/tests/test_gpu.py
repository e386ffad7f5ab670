"""The GPU scenarios of scenarios.py, each in a fresh process, in both hook modes (or those
MILES_TMS_HOOK_MODES names, comma-separated). They skip, saying so, without PyTorch or a GPU.

On the GPU machine, after `pip install` of the wheel:
    python3 -m pytest -rs -v python/tests
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles_memory_saver import _library
from scenarios import SCENARIOS

HERE = Path(__file__).resolve().parent
MODES = [m for m in os.environ.get("MILES_TMS_HOOK_MODES", "torch,preload").split(",") if m]


def _why_no_gpu():
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)"
    try:
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "probing PyTorch for a GPU timed out"
    if done.returncode == 3:
        return "PyTorch sees no CUDA GPU"
    if done.returncode != 0:
        return "PyTorch is not installed"
    return None


WHY_NO_GPU = _why_no_gpu()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_scenario(scenario, mode):
    if WHY_NO_GPU:
        pytest.skip(f"skipped: {WHY_NO_GPU}")
    env = dict(os.environ, MILES_TMS_HOOK_MODE=mode, PYTHONUNBUFFERED="1")
    if mode == "preload":
        previous = env.get("LD_PRELOAD")
        library = str(_library.library_path())
        env["LD_PRELOAD"] = f"{library}:{previous}" if previous else library
    done = subprocess.run(
        [sys.executable, str(HERE / "scenarios.py"), scenario],
        env=env, capture_output=True, text=True, timeout=600,
    )
    output = f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    if done.returncode == 77:
        pytest.skip(f"skipped: {done.stdout.strip().splitlines()[-1]}")
    assert done.returncode == 0, f"{scenario} ({mode}) exited {done.returncode}\n{output}"
