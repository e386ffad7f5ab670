#!/usr/bin/env python3
"""Side by side on one GPU: `miles bench offload` against torch_memory_saver 0.0.10.

Pause and resume with a CPU (pinned host) backup, at the same sizes, in the same call.
For each size: ours (the `miles` binary, one process per size) and theirs (torch_memory_saver
through PyTorch's pluggable allocator, in this process), each with a first cycle and steady
cycles; prints GB/s of each and the ratio ours / theirs. GB = 10^9 bytes.

Usage (on the GPU machine, torch_memory_saver installed or on PYTHONPATH):
    python3 bench/compare_tms.py --miles .gpu/miles [--sizes 256MiB,1GiB,4GiB,8GiB,16GiB]
        [--cycles 3] [--json OUT.json]
"""

import argparse
import json
import subprocess
import sys
import time

UNITS = {"MiB": 1 << 20, "GiB": 1 << 30}


def parse_size(text):
    for unit, scale in UNITS.items():
        if text.endswith(unit):
            return int(text[: -len(unit)]) * scale
    return int(text)


def ours(miles, size_text, cycles):
    """Run our bench for one size; the first and the mean steady pause/resume GB/s."""
    command = [
        miles, "bench", "offload", "--device", "cuda", "--target", "host",
        "--size", size_text, "--cycles", str(cycles), "--json", "--no-disk-baseline",
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    runs = report["cycles"]
    steady = runs[1:] or runs
    mean = lambda key: sum(c[key] for c in steady) / len(steady)
    return {
        "first_pause_gbps": runs[0]["pause_gbps"],
        "first_resume_gbps": runs[0]["resume_gbps"],
        "pause_gbps": mean("pause_gbps"),
        "resume_gbps": mean("resume_gbps"),
        "freed_bytes": runs[-1]["resident_before_pause"] - runs[-1]["resident_after_pause"],
        "pin_s": report["host_pool_pin_s"],
    }


def theirs(size, cycles, index):
    """torch_memory_saver at one size: a tensor in a region with CPU backup, paused and
    resumed `cycles` times, each timed to a device synchronize; bytes checked after."""
    import torch
    from torch_memory_saver import torch_memory_saver as tms

    tag = f"compare{index}"
    with tms.region(tag=tag, enable_cpu_backup=True):
        x = torch.empty(size, dtype=torch.uint8, device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(1234 + index)
    x.random_(0, 256, generator=generator)
    words = x.view(torch.int32)
    checksum = int(words.sum(dtype=torch.int64))
    torch.cuda.synchronize()
    pauses, resumes, freed = [], [], 0
    for _ in range(cycles):
        free_before = torch.cuda.mem_get_info()[0]
        start = time.perf_counter()
        tms.pause(tag)
        torch.cuda.synchronize()
        pauses.append(size / (time.perf_counter() - start) / 1e9)
        freed = torch.cuda.mem_get_info()[0] - free_before
        start = time.perf_counter()
        tms.resume(tag)
        torch.cuda.synchronize()
        resumes.append(size / (time.perf_counter() - start) / 1e9)
    same = int(words.sum(dtype=torch.int64)) == checksum
    del words, x
    torch.cuda.empty_cache()
    steady = lambda values: sum(values[1:] or values) / len(values[1:] or values)
    return {
        "first_pause_gbps": pauses[0],
        "first_resume_gbps": resumes[0],
        "pause_gbps": steady(pauses),
        "resume_gbps": steady(resumes),
        "freed_bytes": freed,
        "bytes_back_intact": same,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--miles", required=True, help="path of the miles binary")
    parser.add_argument("--sizes", default="256MiB,1GiB,4GiB,8GiB,16GiB")
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--json", help="write every figure to this file")
    args = parser.parse_args()

    from torch_memory_saver import torch_memory_saver as tms

    tms.hook_mode = "torch"
    rows = []
    for index, size_text in enumerate(args.sizes.split(",")):
        size = parse_size(size_text)
        row = {"size": size_text, "bytes": size}
        row["ours"] = ours(args.miles, size_text, args.cycles)
        row["theirs"] = theirs(size, args.cycles, index)
        rows.append(row)
        print(f"{size_text}: ours {row['ours']}\n  theirs {row['theirs']}", flush=True)

    print()
    print("GB/s, pause / resume with pinned host backup; first cycle, then mean of steady cycles")
    header = (
        f"{'size':>7} | {'what':>12} | {'ours':>8} | {'tms':>8} | {'ours/tms':>8}"
    )
    print(header)
    print("-" * len(header))
    faster_everywhere = True
    for row in rows:
        for key, label in [
            ("first_pause_gbps", "first pause"),
            ("first_resume_gbps", "first resume"),
            ("pause_gbps", "pause"),
            ("resume_gbps", "resume"),
        ]:
            a, b = row["ours"][key], row["theirs"][key]
            faster_everywhere &= a > b
            print(f"{row['size']:>7} | {label:>12} | {a:8.2f} | {b:8.2f} | {a / b:8.2f}")
        print(
            f"{row['size']:>7} | {'freed bytes':>12} | {row['ours']['freed_bytes']} | "
            f"{row['theirs']['freed_bytes']} | tms bytes intact: {row['theirs']['bytes_back_intact']}"
        )
    print(f"ours faster at every size and cycle: {faster_everywhere}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
