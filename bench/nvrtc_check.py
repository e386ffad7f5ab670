#!/usr/bin/env python3
"""Compiles miles' CUDA kernel program with NVRTC on a machine without a GPU, as the engine does
at start-up (compute_90 PTX), or to sm_90 machine code with ptxas' report of each kernel's
registers, stack and spills: check kernels here before spending device time.

NVRTC comes from the `nvidia-cuda-nvrtc` wheel; `.ci/run` unpacks one under target/ci-nvrtc.

  python3 bench/nvrtc_check.py                       # PTX for compute_90, errors and warnings
  python3 bench/nvrtc_check.py --arch sm_90 --kernels flash   # registers and spills of flash_*
"""

import argparse
import ctypes
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPU = ROOT / "miles-core/src/ops/gpu"
COMPUTE = ROOT / "miles-core/src/device/cuda/compute/mod.rs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lib", default=str(ROOT / "target/ci-nvrtc/nvidia/cu13/lib/libnvrtc.so.13"))
    parser.add_argument("--arch", default="compute_90", help="compute_90 (PTX) or sm_90 (with ptxas' report)")
    parser.add_argument("--kernels", default="", help="with sm_90: report only kernels whose name contains this")
    args = parser.parse_args()
    nvrtc = ctypes.CDLL(args.lib)
    # The sources in the order of `PROGRAM` in ops/gpu/mod.rs.
    names = re.findall(r'include_str!\("kernels/([^"]+)"\)', (GPU / "mod.rs").read_text())
    # The device module puts its prelude (`grid_begin`) ahead of every program.
    prelude = re.search(r'const GRID_PRELUDE: &str = r#"(.*?)"#;', COMPUTE.read_text(), re.S)
    if not prelude:
        raise SystemExit(f"no GRID_PRELUDE in {COMPUTE}")
    source = (prelude.group(1) + "".join((GPU / "kernels" / n).read_text() for n in names)).encode()
    program = ctypes.c_void_p()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(program), source, b"miles_kernels.cu", 0, None, None):
        raise SystemExit("nvrtcCreateProgram failed")
    options = [b"--std=c++17", f"--gpu-architecture={args.arch}".encode()]
    if args.arch.startswith("sm_"):
        options.append(b"--ptxas-options=-v")
    status = nvrtc.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(program, log)
    kernel = None
    for line in log.value.decode().splitlines():
        entry = re.search(r"Compiling entry function '(\w+)'", line)
        if entry:
            kernel = entry.group(1)
        report = re.search(r"(\d+ bytes stack frame.*|Used \d+ registers.*)", line)
        if report and kernel and args.kernels in kernel:
            print(f"{kernel}: {report.group(1)}")
        elif not report and not entry and "ptxas" not in line and line.strip():
            print(line)
    print(f"{len(names)} sources, nvrtcCompileProgram status {status}")
    raise SystemExit(1 if status else 0)


if __name__ == "__main__":
    main()
