#!/usr/bin/env python3
"""Summarise `miles bench offload --json` runs, one row per variant, against issue 9's goals.

Usage: offload_summary.py RUNS_DIR

RUNS_DIR holds `<variant>.<bench>.json` (stdout of one run; bench is `none`, `host` or `both`),
`<variant>.<bench>.log` (its stderr; with RUST_LOG=miles_core::device::cuda=debug it has one
"released device memory" line per release, with unmap_ms and release_ms), and `order` (variant
names, one a line, in the order they ran). Steady cycles are cycles 1.. (cycle 0 apart).
GB = 10^9 bytes; ms = milliseconds.
"""

import json
import re
import statistics
import sys
from pathlib import Path

PAUSE_MS_GOAL = 5.0
RESUME_MS_GOAL = 5.0
HOST_GBPS_GOAL = 50.0
HOST_RATIO_GOAL = 0.9
BOTH_GBPS_GOAL = 90.0


def load(runs, variant, bench):
    """The run's JSON report, or a string saying why there is none."""
    path = runs / f"{variant}.{bench}.json"
    if not path.exists():
        return "not run"
    text = path.read_text().strip()
    if not text:
        return "failed (see log)"
    try:
        return json.loads(text.splitlines()[-1])
    except json.JSONDecodeError:
        return "unreadable"


def release_split(runs, variant, bench, size):
    """Medians of unmap_ms and release_ms over the releases of the whole tag, from the log."""
    path = runs / f"{variant}.{bench}.log"
    if not path.exists():
        return None
    unmaps, releases = [], []
    for line in path.read_text(errors="replace").splitlines():
        if "released device memory" not in line:
            continue
        fields = dict(re.findall(r"(\w+)=([^\s]+)", line))
        if fields.get("bytes") != str(size):
            continue
        unmaps.append(float(fields["unmap_ms"]))
        releases.append(float(fields["release_ms"]))
    if not unmaps:
        return None
    return statistics.median(unmaps), statistics.median(releases)


def short_settings(report):
    settings = report.get("settings") or {}
    cuda = settings.get("cuda") or {}
    mib = 1 << 20
    parts = []
    if cuda:
        mode = {"EachMapping": "each", "UnmapThenRelease": "unmap+rel", "MappingOwns": "owns"}
        parts.append(f"c{cuda['commit_chunk'] // mib}")
        parts.append(mode.get(cuda["release"], cuda["release"]))
        if cuda["release_threads"] > 1:
            parts.append(f"t{cuda['release_threads']}")
        if cuda["touch_on_commit"]:
            parts.append("touch")
        if cuda["copy_chunk"] != 64 * mib or cuda["streams_per_direction"] != 2:
            parts.append(f"copy{cuda['copy_chunk'] // mib}x{cuda['streams_per_direction']}")
    if settings.get("resume_piece"):
        parts.append(f"pipe{settings['resume_piece'] // mib}")
    if settings.get("pause_gap_ms"):
        parts.append(f"gap{settings['pause_gap_ms']}ms")
    return " ".join(parts)


def steady(cycles):
    return cycles[1:] if len(cycles) > 1 else cycles


def freed_pct(report):
    size = report["size_bytes"]
    return min(
        (c["resident_before_pause"] - c["resident_after_pause"]) / size * 100
        for c in report["cycles"]
    )


def table(title, header, rows):
    print(f"\n## {title}")
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    for row in [header] + rows:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())


def fmt(values, digits):
    return " ".join(f"{v:.{digits}f}" for v in values)


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: offload_summary.py RUNS_DIR")
    runs = Path(sys.argv[1])
    order_file = runs / "order"
    variants = []
    if order_file.exists():
        for name in order_file.read_text().split():
            if name not in variants:
                variants.append(name)
    goals = {}
    none_rows, host_rows, both_rows = [], [], []
    for variant in variants:
        verdict = goals.setdefault(variant, {})
        report = load(runs, variant, "none")
        if isinstance(report, dict):
            pauses = [c["pause_s"] * 1e3 for c in report["cycles"]]
            resumes = [c["resume_s"] * 1e3 for c in report["cycles"]]
            split = release_split(runs, variant, "none", report["size_bytes"])
            split_text = f"{split[0]:.2f} / {split[1]:.2f}" if split else "-"
            steady_pauses = steady(pauses)
            met = sum(p <= PAUSE_MS_GOAL for p in steady_pauses)
            none_rows.append([
                variant, short_settings(report), f"[{pauses[0]:.2f}] {fmt(steady_pauses, 2)}",
                f"{statistics.median(steady_pauses):.2f}", f"{max(steady_pauses):.2f}",
                f"{met}/{len(steady_pauses)}", f"{max(steady(resumes)):.2f}", split_text,
                f"{freed_pct(report):.2f}",
            ])
            verdict["none"] = (
                f"pause<=5ms {met}/{len(steady_pauses)}, "
                f"resume<=5ms {'yes' if max(steady(resumes)) <= RESUME_MS_GOAL else 'NO'}"
            )
        elif report != "not run":
            none_rows.append([variant, report] + [""] * 7)
        report = load(runs, variant, "host")
        if isinstance(report, dict):
            cycles = report["cycles"]
            base = report["baseline"]
            pause = [c["pause_gbps"] for c in steady(cycles)]
            resume = [c["resume_gbps"] for c in steady(cycles)]
            ratio = report["ratio"]
            host_rows.append([
                variant, short_settings(report),
                f"{statistics.mean(pause):.2f} [{min(pause):.2f}]",
                f"{statistics.mean(resume):.2f} [{min(resume):.2f}]",
                f"{base['copy_out_gbps']:.2f} / {base['copy_in_gbps']:.2f}",
                f"{ratio['pause']:.3f} / {ratio['resume']:.3f}",
                f"{cycles[0]['pause_gbps']:.1f} / {cycles[0]['resume_gbps']:.1f}",
                f"{freed_pct(report):.2f}",
            ])
            ok = (
                statistics.mean(resume) >= HOST_GBPS_GOAL
                and ratio["resume"] >= HOST_RATIO_GOAL
                and statistics.mean(pause) >= HOST_GBPS_GOAL
                and ratio["pause"] >= HOST_RATIO_GOAL
            )
            verdict["host"] = f"host pause&resume>=50GB/s&0.9x {'yes' if ok else 'NO'}"
        elif report != "not run":
            host_rows.append([variant, report] + [""] * 6)
        report = load(runs, variant, "both")
        if isinstance(report, dict):
            per_cycle = [c["combined_gbps"] for c in report["cycles"]]
            steady_both = steady(per_cycle)
            both_rows.append([
                variant, short_settings(report), f"[{per_cycle[0]:.1f}] {fmt(steady_both, 1)}",
                f"{report['combined_gbps']:.2f}", f"{min(steady_both):.2f}",
                f"{report['baseline']['copy_out_plus_in_gbps']:.2f}", f"{report['ratio']:.3f}",
            ])
            verdict["both"] = (
                f"both>=90GB/s {'yes' if report['combined_gbps'] >= BOTH_GBPS_GOAL else 'NO'}"
            )
        elif report != "not run":
            both_rows.append([variant, report] + [""] * 5)
    table(
        "--target none: pause (release) and resume (commit), ms",
        ["variant", "settings", "pause ms [cycle 0] steady", "median", "max", "<=5ms",
         "resume max", "unmap / release ms", "freed % min"],
        none_rows,
    )
    table(
        "--target host: steady GB/s mean [min]",
        ["variant", "settings", "pause GB/s", "resume GB/s", "plain out / in",
         "ratio pause / resume", "cycle 0 out / in", "freed % min"],
        host_rows,
    )
    table(
        "--both-directions: GB/s together",
        ["variant", "settings", "per cycle [cycle 0] steady", "steady mean", "min",
         "plain out + in", "ratio"],
        both_rows,
    )
    print("\n## goals (steady cycles)")
    for variant in variants:
        verdict = goals.get(variant, {})
        parts = [verdict[key] for key in ("none", "host", "both") if key in verdict]
        print(f"{variant}: {'; '.join(parts) if parts else 'no report'}")


if __name__ == "__main__":
    main()
