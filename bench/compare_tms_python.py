"""miles_memory_saver against torch_memory_saver 0.0.10 through the same Python code.

For each size (GiB) and backup (cpu, disk, none) and package, a fresh process allocates the
size in one tag (tensors of 64 MiB, filled with random bytes), then pauses and resumes it
`--cycles` times, timing each call, checking the bytes freed (torch.cuda.mem_get_info) and,
with a backup, that the first and last tensor come back bit-exact. A plain pinned copy of
the same bytes (tensor.copy_ into pinned host tensors, both ways) runs in the miles process
as the link's baseline. Both packages run in hook mode `torch` (no LD_PRELOAD needed).

    python3 bench/compare_tms_python.py                      # 1, 8, 16 GiB, all backups
    python3 bench/compare_tms_python.py --sizes 8 --backups cpu --cycles 3

Prints one line per run, then a table of GB/s (first cycle and best later cycle) and the
ratios miles / torch_memory_saver.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

GIB = 1 << 30
CHUNK = 64 << 20
PACKAGES = {"miles": "miles_memory_saver", "tms": "torch_memory_saver"}


def child(package: str, size_gib: float, backup: str, cycles: int, disk_dir: str) -> dict:
    import torch

    module = __import__(PACKAGES[package])
    saver = module.torch_memory_saver
    saver.hook_mode = "torch"
    if backup == "disk":
        saver.set_disk_backup_dir(disk_dir)
    total = int(size_gib * GIB)
    with saver.region(
        tag="bench",
        enable_cpu_backup=backup == "cpu",
        enable_disk_backup=backup == "disk",
    ):
        tensors = [
            torch.empty((min(CHUNK, total - offset),), dtype=torch.uint8, device="cuda")
            for offset in range(0, total, CHUNK)
        ]
    for tensor in tensors:
        tensor.random_(0, 256)
    checked = {0: tensors[0].cpu(), len(tensors) - 1: tensors[-1].cpu()}
    torch.cuda.synchronize()
    result = {"package": package, "gib": size_gib, "backup": backup, "cycles": []}
    for _ in range(cycles):
        free_before = torch.cuda.mem_get_info()[0]
        start = time.perf_counter()
        saver.pause("bench")
        paused = time.perf_counter()
        free_paused = torch.cuda.mem_get_info()[0]
        saver.resume("bench")
        torch.cuda.synchronize()
        resumed = time.perf_counter()
        exact = all(torch.equal(tensors[i].cpu(), want) for i, want in checked.items())
        result["cycles"].append(
            {
                "pause_s": paused - start,
                "resume_s": resumed - paused,
                "freed": free_paused - free_before,
                "exact": exact if backup != "none" else None,
            }
        )
    if package == "miles":
        result["pinned_copy"] = pinned_copy(torch, tensors)
    result["bytes"] = total
    return result


def pinned_copy(torch, tensors) -> dict:
    """GB/s of plain pinned copies of the tensors out and back (the link's baseline)."""
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    total = sum(t.numel() for t in tensors)
    speeds = {}
    for name, pairs in (("out", zip(host, tensors)), ("in", zip(tensors, host))):
        pairs = list(pairs)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        speeds[name] = total / (time.perf_counter() - start) / 1e9
    return speeds


def run(package, size, backup, cycles, disk_dir):
    own_dir = tempfile.mkdtemp(prefix=f"{package}-", dir=disk_dir)
    command = [
        sys.executable, os.path.abspath(__file__), "--child", package,
        "--sizes", str(size), "--backups", backup, "--cycles", str(cycles),
        "--disk-dir", own_dir,
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    finally:
        shutil.rmtree(own_dir, ignore_errors=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stdout + done.stderr)[-2000:]
        print(f"{package} {size} GiB {backup}: failed (exit {done.returncode})\n{tail}")
        return None
    return json.loads(lines[-1])


def speeds(result):
    """(first pause, best later pause, first resume, best later resume) in GB/s."""
    gb = result["bytes"] / 1e9
    pauses = [gb / c["pause_s"] for c in result["cycles"]]
    resumes = [gb / c["resume_s"] for c in result["cycles"]]
    later = lambda xs: max(xs[1:]) if len(xs) > 1 else xs[0]
    return pauses[0], later(pauses), resumes[0], later(resumes)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,8,16", help="GiB, comma-separated")
    parser.add_argument("--backups", default="cpu,disk,none", help="cpu, disk, none")
    parser.add_argument("--cycles", type=int, default=3, help="pause/resume cycles per run")
    parser.add_argument("--disk-cycles", type=int, default=1, help="cycles of disk runs")
    parser.add_argument("--packages", default="miles,tms", help="miles, tms")
    parser.add_argument(
        "--disk-dir", default=None,
        help="directory of disk backups, on a real disk (default: a new one under $TMPDIR)",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    disk_dir = args.disk_dir or tempfile.mkdtemp(prefix="tms-bench-")
    if args.child:
        print(json.dumps(child(args.child, float(args.sizes), args.backups, args.cycles, disk_dir)),
              flush=True)
        # The figures are out: skip the interpreter's teardown, whose frees of the region's
        # tensors torch_memory_saver 0.0.10 refuses by exiting 1 ("only support interesting
        # region"), which would hide its figures.
        os._exit(0)
        return
    results = {}
    for size in args.sizes.split(","):
        for backup in args.backups.split(","):
            cycles = args.disk_cycles if backup == "disk" else args.cycles
            for package in args.packages.split(","):
                result = run(package, size, backup, cycles, disk_dir)
                if result is None:
                    continue
                results[(size, backup, package)] = result
                p1, p, r1, r = speeds(result)
                cycle = result["cycles"][0]
                exact = {c["exact"] for c in result["cycles"]}
                print(
                    f"{package:5} {size:>3} GiB {backup:4}: pause {p1:6.2f} GB/s first, "
                    f"{p:6.2f} best; resume {r1:6.2f} first, {r:6.2f} best; freed "
                    f"{cycle['freed'] / GIB:6.2f} GiB ({cycle['pause_s'] * 1e3:.1f} ms / "
                    f"{cycle['resume_s'] * 1e3:.1f} ms first); bit-exact {exact}",
                    flush=True,
                )
                if "pinned_copy" in result:
                    copy = result["pinned_copy"]
                    print(f"      plain pinned copy: out {copy['out']:.2f} GB/s, "
                          f"in {copy['in']:.2f} GB/s", flush=True)
    print("\nratios miles / torch_memory_saver (first cycle; best later cycle):")
    for size in args.sizes.split(","):
        for backup in args.backups.split(","):
            ours, theirs = results.get((size, backup, "miles")), results.get((size, backup, "tms"))
            if not ours or not theirs:
                continue
            a, b = speeds(ours), speeds(theirs)
            freed = ours["cycles"][0]["freed"] / max(theirs["cycles"][0]["freed"], 1)
            print(
                f"{size:>3} GiB {backup:4}: pause {a[0] / b[0]:6.1f}x; {a[1] / b[1]:6.1f}x   "
                f"resume {a[2] / b[2]:6.1f}x; {a[3] / b[3]:6.1f}x   bytes freed {freed:.3f}x"
            )


if __name__ == "__main__":
    main()
