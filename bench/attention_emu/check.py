#!/usr/bin/env python3
"""Runs the attention's CUDA kernels on the CPU and checks them against a float64 reference: the
training attention (miles-core/src/ops/gpu/kernels/flash.cu: forward, dq, dk/dv) and the
engine's paged attention and decode step (kernels/paged.cu), a way to test a change to them
where no GPU is.

Their inline assembly (mma.sync, ldmatrix, cp.async, ex2, cvt) is rewritten into calls of
cuda_on_cpu.hpp, which gives the same fragments to the same lanes as the PTX ISA says; the
result is compiled with g++ and run on shapes that reach every head-dim instance, partial tiles,
head dims that are not a multiple of 8, query groups of 1 to 4 and cache blocks of several
sizes. It checks the kernels' logic (indices, masks, tiles, sums, block tables), not their speed
or the hardware's rounding. Prints "skipped" and exits 0 where g++ is missing or too old for
C++20's <barrier> (GCC 11).

  python3 bench/attention_emu/check.py                          # every shape
  python3 bench/attention_emu/check.py flash 1 200 8 2 64       # one: B T H KH D
  python3 bench/attention_emu/check.py paged 2 100 8 2 64 16    # one: B T H KH D, block size P
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
KERNELS = ROOT / "miles-core/src/ops/gpu/kernels"
BUILD = ROOT / "target/attention-emu"

# flash: B, T, H, KH, D: every padded head dim, T on and off tile edges, groups of 1 to 4 (dk and
# dv in every number of pieces dividing the group). paged: and the cache's block size; a group of
# 12 takes two blocks a kv head (8 query heads a block); a prefill block takes 16 / min(8, group)
# tokens, here across the end of a sequence, and three of one-token sequences; the 1B's group of
# 4 over three tiles.
SHAPES = [
    ("flash", 1, 70, 2, 1, 64),
    ("flash", 2, 130, 4, 2, 64),
    ("flash", 1, 200, 4, 1, 64),
    ("flash", 1, 128, 2, 1, 64),
    ("flash", 2, 67, 4, 4, 40),
    ("flash", 1, 130, 2, 1, 128),
    ("flash", 1, 100, 2, 1, 16),
    ("flash", 1, 90, 3, 1, 32),
    ("flash", 1, 5, 2, 1, 12),
    ("flash", 1, 1, 2, 1, 64),
    ("paged", 2, 70, 4, 2, 64, 16),
    ("paged", 1, 130, 12, 1, 32, 64),
    ("paged", 2, 40, 2, 1, 128, 8),
    ("paged", 1, 65, 2, 2, 16, 32),
    ("paged", 3, 1, 2, 1, 64, 16),
    ("paged", 2, 150, 8, 2, 64, 16),
]

# (pattern, replacement) over flash.cu and paged.cu: each form of inline assembly they hold.
REWRITES = [
    (r'asm volatile\(\s*"mma\.sync.*?\);', "emu_mma(c, a, b0, b1);"),
    (
        r'asm volatile\("ldmatrix\.sync\.aligned\.m8n8\.x4(\.trans)?\.shared\.b16 \{%0,%1,%2,%3\}, \[%4\];\\n"'
        r'\s*:\s*"=r"\((.*?)\),\s*"=r"\((.*?)\),\s*"=r"\((.*?)\),\s*"=r"\((.*?)\)\s*:\s*"r"\((.*?)\)\);',
        lambda m: "emu_ldmatrix({}, &({}), &({}), &({}), &({}), {});".format(
            "true" if m.group(1) else "false", *m.group(2, 3, 4, 5, 6)
        ),
    ),
    (
        r'asm volatile\("cp\.async\.cg\.shared\.global \[%0\], \[%1\], 16, %2;\\n" ::"r"\((.*?)\),'
        r'\s*"l"\((.*?)\),\s*"r"\((.*?)\)\);',
        r"emu_cp_async(\1, \2, \3);",
    ),
    (r'asm volatile\("cp\.async\.(commit_group|wait_group \d);\\n" ::\);', ";"),
    (r'asm\("ex2\.approx\.ftz\.f32 %0, %1;" : "=f"\((\w+)\) : "f"\((\w+)\)\);', r"\1 = emu_ex2_ftz(\2);"),
    # cvt.rn.bf16x2.f32 d, hi, lo: f2bf's rounding (to nearest even) of both.
    (
        r'asm\("cvt\.rn\.bf16x2\.f32 %0, %1, %2;" : "=r"\((\w+)\) : "f"\((\w+)\), "f"\((\w+)\)\);',
        r"\1 = (unsigned)f2bf(\3) | ((unsigned)f2bf(\2) << 16);",
    ),
    (r"extern __shared__ uint4 (\w+)\[\];", r"uint4* \1 = (uint4*)emu_smem;"),
]


def build() -> Path:
    source = "".join((KERNELS / name).read_text() for name in ("common.cuh", "flash.cu", "paged.cu"))
    for pattern, replacement in REWRITES:
        source = re.sub(pattern, replacement, source, flags=re.S)
    left = [line.strip() for line in source.splitlines() if "asm" in line]
    if left:
        raise SystemExit(f"the kernels have inline assembly check.py does not rewrite: {left}")
    BUILD.mkdir(parents=True, exist_ok=True)
    program = BUILD / "attention_emu.cpp"
    program.write_text(
        '#include "cuda_on_cpu.hpp"\n'
        + source
        + '\n#include "check.cpp"\n'
    )
    binary = BUILD / "attention_emu"
    subprocess.run(
        ["g++", "-std=c++20", "-O1", "-pthread", "-w", "-iquote", str(HERE), str(program), "-o", str(binary)],
        check=True,
    )
    return binary


def cxx20_barrier() -> bool:
    """Whether g++ compiles C++20's std::barrier, which the emulation's warps and blocks wait on."""
    BUILD.mkdir(parents=True, exist_ok=True)
    probe = BUILD / "probe.cpp"
    probe.write_text("#include <barrier>\nint main() { std::barrier<> b(1); b.arrive_and_wait(); }\n")
    run = subprocess.run(
        ["g++", "-std=c++20", "-pthread", str(probe), "-o", str(BUILD / "probe")], capture_output=True
    )
    return run.returncode == 0


def main() -> None:
    if shutil.which("g++") is None:
        print("attention kernels on the CPU: skipped (no g++)")
        return
    if not cxx20_barrier():
        print("attention kernels on the CPU: skipped (g++ without C++20's <barrier>; GCC 11 or later has it)")
        return
    shapes = [(sys.argv[1], *map(int, sys.argv[2:]))] if len(sys.argv) > 1 else SHAPES
    binary = build()
    failed = []
    for shape in shapes:
        run = subprocess.run([str(binary), *map(str, shape)], capture_output=True, text=True)
        verdict = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else f"exit {run.returncode}"
        print(f"{' '.join(map(str, shape))}: {verdict}")
        if run.returncode:
            print(run.stdout + run.stderr)
            failed.append(shape)
    if failed:
        raise SystemExit(f"attention kernels on the CPU: {len(failed)} of {len(shapes)} shapes failed: {failed}")
    print(f"attention kernels on the CPU: {len(shapes)} shapes match the float64 reference")


if __name__ == "__main__":
    main()
