#!/usr/bin/env python3
"""Compiles miles' CUDA kernels with NVRTC on a machine without a GPU, as the engine does at
start-up (PTX; the default compute_90a takes both programs, PROGRAM and HOPPER_PROGRAM, as one),
or to sm_90a machine code with ptxas' report of each kernel's registers, stack and spills: check
kernels here before spending device time.

NVRTC comes from the `nvidia-cuda-nvrtc` wheel; `.ci/run` unpacks one under target/ci-nvrtc.

  python3 bench/nvrtc_check.py                       # PTX for compute_90a, errors and warnings
  python3 bench/nvrtc_check.py --arch sm_90a --kernels flash   # registers and spills of flash_*
  python3 bench/nvrtc_check.py --arch sm_90a --kernels flash_forward_64 --loops   # and its loops

--loops disassembles the machine code (nvdisasm, from the `nvidia-cuda-nvdisasm` wheel:
  python3 -m pip download --no-deps --dest target/ci-nvdisasm nvidia-cuda-nvdisasm
  python3 -m zipfile -e target/ci-nvdisasm/nvidia_cuda_nvdisasm-*.whl target/ci-nvdisasm
) and prints each kernel's instructions and its largest loop's, by opcode: a kernel's main loop,
counted statically (every branch of its body, taken or not), to compare two versions of a kernel
where no GPU is. Static counts are not time: what runs, and how it overlaps, only a GPU says.
"""

import argparse
import collections
import ctypes
import re
import shutil
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPU = ROOT / "miles-core/src/ops/gpu"
COMPUTE = ROOT / "miles-core/src/device/cuda/compute/mod.rs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lib", default=str(ROOT / "target/ci-nvrtc/nvidia/cu13/lib/libnvrtc.so.13"))
    parser.add_argument("--arch", default="compute_90a", help="compute_90a (PTX) or sm_90a (with ptxas' report)")
    parser.add_argument("--kernels", default="", help="with sm_90a: report only kernels whose name contains this")
    parser.add_argument("--loops", action="store_true", help="with sm_90a: each kernel's largest loop, by opcode")
    parser.add_argument(
        "--nvdisasm",
        default=str(ROOT / "target/ci-nvdisasm/nvidia/cu13/bin/nvdisasm"),
        help="nvdisasm for --loops (else the one on PATH)",
    )
    args = parser.parse_args()
    if args.loops and not args.arch.startswith("sm_"):
        raise SystemExit("--loops needs machine code: add --arch sm_90a")
    nvrtc = ctypes.CDLL(args.lib)
    # The sources in the order of `PROGRAM` in ops/gpu/mod.rs.
    # Both programs' sources (PROGRAM's and HOPPER_PROGRAM's), each file once.
    names = list(dict.fromkeys(re.findall(r'include_str!\("kernels/([^"]+)"\)', (GPU / "mod.rs").read_text())))
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
    if status:
        raise SystemExit(1)
    if args.loops:
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetCUBIN(program, cubin)
        print_loops(cubin.raw, nvdisasm_path(args.nvdisasm), args.kernels)


def nvdisasm_path(given: str) -> str:
    """The nvdisasm to run: `given` (made executable: wheels unpack without the bit), else PATH's."""
    path = Path(given)
    if path.is_file():
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
        return str(path)
    found = shutil.which("nvdisasm")
    if not found:
        raise SystemExit(f"no nvdisasm at {given} or on PATH: see this script's header for the wheel")
    return found


def print_loops(cubin: bytes, nvdisasm: str, kernels: str) -> None:
    """Each kernel's static instructions, and its largest loop's (from a label to the furthest
    branch back to it) by opcode."""
    out = ROOT / "target/nvrtc-check"
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels.cubin").write_bytes(cubin)
    sass = subprocess.run([nvdisasm, str(out / "kernels.cubin")], capture_output=True, text=True, check=True).stdout
    sections = re.split(r"\n\s*\.section\s+\.text\.(\w+),", sass)
    for name, body in sorted(zip(sections[1::2], sections[2::2])):
        if kernels not in name:
            continue
        code, labels = [], {}
        for line in body.splitlines():
            label = re.match(r"\s*\.(L_x_\d+):", line)
            if label:
                labels[label.group(1)] = len(code)
            instruction = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
            if instruction:
                code.append(instruction.group(1).strip())
        loops = [
            (labels[target.group(1)], at)
            for at, text in enumerate(code)
            if (target := re.search(r"BRA\s+`?\(?\.?(L_x_\d+)", text)) and labels.get(target.group(1), at + 1) <= at
        ]
        first, last = max(loops, key=lambda loop: loop[1] - loop[0], default=(0, len(code) - 1))
        ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0] for text in code[first : last + 1])
        top = ", ".join(f"{op} {count}" for op, count in ops.most_common(12))
        print(f"{name}: {len(code)} instructions; largest loop {last - first + 1}: {top}")


if __name__ == "__main__":
    main()
