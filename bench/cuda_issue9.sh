#!/usr/bin/env bash
# Issue 9's acceptance on one H200, in one device call (round 13 of bench/RESULTS.md): the GPU
# test suites, then `miles bench offload --device cuda` at 8 GiB with --target host, none and
# host --both-directions (twice each), 4 GiB to disk, and torch_memory_saver side by side.
#
# Builds nothing. Run from the repository root with the binaries in $GPU_DIR (default .gpu),
# built on the development machine with
#   cargo build --release -p miles-cli
#   cargo test --release -p miles-core -p miles-infer -p miles-tests --no-run
# and copied as miles, miles_core_tests, pause_cycles, miles_infer_tests, infer_tests (the
# unit tests of miles-core and miles-infer, tests/pause_cycles.rs and tests/infer.rs), with the
# torch_memory_saver 0.0.10 wheel beside them. Writes logs and JSON under $OUT (default ./out)
# and prints one summary line per bench.
set -o pipefail
dir=${GPU_DIR:-.gpu}
out=${OUT:-out}
mkdir -p "$out"
libs=$(find / -path /proc -prune -o \( -name 'libnvrtc.so.13' -o -name 'libcublas.so.13' -o -name 'libcublasLt.so.13' \) -print 2>/dev/null | xargs -r -n1 dirname | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH}"
t0=$SECONDS
step() { echo "== [$((SECONDS - t0)) s] $*"; }
suite() {
  local name=$1; shift
  MILES_TEST_DEVICE=cuda timeout 150 "$dir/$name" --test-threads=1 "$@" >"$out/$name.log" 2>&1
  echo "$name: rc $?, $(grep -E '^test result' "$out/$name.log" | tail -1)"
  grep -E '^test .*FAILED|panicked' "$out/$name.log" | head -5
}
step "GPU tests"
for binary in miles_core_tests pause_cycles miles_infer_tests infer_tests; do suite "$binary"; done
bench() {
  local name=$1; shift
  timeout 120 "$dir/miles" bench offload --device cuda --json "$@" >"$out/$name.json" 2>"$out/$name.log"
  echo "$name: rc $? ($((SECONDS - t0)) s)"
}
step "offload benches"
for round in 1 2; do
  bench "host$round" --size 8GiB --cycles 5 --target host
  bench "none$round" --size 8GiB --cycles 5 --target none
  bench "both$round" --size 8GiB --cycles 5 --target host --both-directions
done
mkdir -p /var/tmp/miles-bench
bench disk --size 4GiB --cycles 3 --target disk --disk-dir /var/tmp/miles-bench
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
def row(cycles, key, scale=1.0):
    return " ".join("%.2f" % (c[key] * scale) for c in cycles)
for name in ("host1", "host2", "none1", "none2", "disk"):
    report = json.load(open(f"{out}/{name}.json"))
    cycles = report["cycles"]
    print(name, "| pause ms", row(cycles, "pause_s", 1e3), "| resume ms", row(cycles, "resume_s", 1e3),
          "| pause GB/s", row(cycles, "pause_gbps"), "| resume GB/s", row(cycles, "resume_gbps"),
          "| baseline", json.dumps(report["baseline"]), "| ratio", json.dumps(report["ratio"]),
          "| device used", cycles[-1]["resident_before_pause"], "->", cycles[-1]["resident_after_pause"])
for name in ("both1", "both2"):
    report = json.load(open(f"{out}/{name}.json"))
    print(name, "| GB/s together", " ".join("%.1f" % c["combined_gbps"] for c in report["cycles"]),
          "| steady %.1f" % report["combined_gbps"], "| baseline", json.dumps(report["baseline"]))
PY
echo "left in the disk directory: $(ls -A /var/tmp/miles-bench | head -3)"
step "torch_memory_saver side by side"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$dir"/torch_memory_saver-*.whl \
  && PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 timeout 300 python3 "$(dirname "$0")/compare_tms.py" --miles "$dir/miles" --json "$out/tms.json" 2>&1 | grep -v INFO | tee "$out/tms.log"
step done
