#!/usr/bin/env bash
# Round 8 of issue 9 on one H200, in one call: the variants of release, commit pieces, pipelined
# resume and first-touch that could close the three missed figures (pause of 8 GiB without
# backup <= 5 ms; resume to host >= 50 GB/s and >= 0.9x plain cuMemcpy; both directions at once
# >= 90 GB/s), old defaults first and again last, then the GPU test suite once.
#
# Builds nothing. Run from the repository root with the binaries in $GPU_DIR (default .gpu),
# built on the development machine with
#   cargo build --release -p miles-cli; cargo test --release -p miles-core --no-run
# and copied as `.gpu/miles` and `.gpu/miles_core_tests`. Writes under $OUT (default ./out):
# runs/<variant>.<bench>.json|log, steps.log, tests.log, summary.txt; the summary is printed
# last. Each run: `miles bench offload --device cuda --size 8GiB --cycles 5 --json
# --no-disk-baseline` with --target none, --target host, or --target host --both-directions.
# Benches stop starting once BENCH_BUDGET_S seconds have gone (default 270), so the tests
# always run. ONLY=regex runs only the variants whose name matches.
set -o pipefail
dir=${GPU_DIR:-.gpu}
miles="$dir/miles"
out=${OUT:-out}
runs="$out/runs"
mkdir -p "$runs"
size=${SIZE:-8GiB}
cycles=${CYCLES:-5}
budget=${BENCH_BUDGET_S:-270}
only=${ONLY:-.}
started=$SECONDS
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.mem --format=csv
  nproc; free -g | head -2
} 2>&1 | tee "$out/machine.txt"

# run VARIANT BENCH [flags...]: one bench of one variant, JSON to stdout, log (with the CUDA
# device's debug lines: one per release, with unmap_ms and release_ms) to stderr.
run() {
  local variant=$1 bench=$2 target
  shift 2
  case $bench in
    none) target=(--target none) ;;
    host) target=(--target host) ;;
    both) target=(--target host --both-directions) ;;
  esac
  if (( SECONDS - started > budget )); then
    echo "skipped $variant $bench: bench budget of $budget s spent" | tee -a "$out/steps.log"
    return
  fi
  local t0=$SECONDS rc
  RUST_LOG=info,miles_core::device::cuda=debug timeout 120 "$miles" bench offload --device cuda \
    --size "$size" --cycles "$cycles" --no-disk-baseline --json "${target[@]}" "$@" \
    >"$runs/$variant.$bench.json" 2>"$runs/$variant.$bench.log"
  rc=$?
  echo "$variant $bench: rc $rc, $((SECONDS - t0)) s (at $((SECONDS - started)) s) $*" | tee -a "$out/steps.log"
  (( rc == 0 )) || tail -3 "$runs/$variant.$bench.log"
}

# variant NAME BENCHES [flags...]: BENCHES is a comma list of none, host, both.
variant() {
  local name=$1 benches=$2
  shift 2
  [[ $name =~ $only ]] || return 0
  echo "$name" >>"$runs/order"
  local bench
  for bench in ${benches//,/ }; do
    run "$name" "$bench" "$@"
  done
}

owns=(--cuda-release mapping-owns)
# The reference: defaults of rounds 6-7 (1 GiB pieces, unmap + release per piece).
variant old none,host,both
# Release: one cuMemUnmap over the tag, then its handles (on 1 or 8 threads), or handles
# released at commit so that the unmap frees (NVIDIA's vectorAddMMAP pattern).
variant unmap none,host,both --cuda-release unmap-then-release
variant unmap-t8 none,both --cuda-release unmap-then-release --cuda-release-threads 8
variant owns none,host,both "${owns[@]}"
# Commit pieces with the one-unmap release: larger (fewer handles), smaller (fresh memory
# copies faster in round 6's probe, at more commit time).
variant owns-2g none,host,both "${owns[@]}" --cuda-commit-chunk-mib 2048
variant owns-8g none,host,both "${owns[@]}" --cuda-commit-chunk-mib 8192
variant owns-256 none,host,both "${owns[@]}" --cuda-commit-chunk-mib 256
# (Round 8's pipelined-resume variants, --resume-piece-mib, went with that flag in round 13.)
# First touch on the device at commit (a memset of the fresh memory) before the copy in.
variant owns-touch none,host,both "${owns[@]}" --cuda-touch-on-commit
# Diagnostics: is resume's loss the driver's work right after a release (a 200 ms gap, not
# timed, between pause and resume)? does copy cutting matter into fresh memory?
variant old-gap host --pause-gap-ms 200
variant old-copy32x4 host --cuda-copy-chunk-mib 32 --cuda-streams 4
# Round 6's 96 GB/s both-directions reference (8 GiB pieces, old release), then the old
# defaults again, for drift over the call.
variant old-8g both --cuda-commit-chunk-mib 8192
variant old-again none,host,both

echo "benches done at $((SECONDS - started)) s" | tee -a "$out/steps.log"
MILES_TEST_DEVICE=cuda timeout 200 "$dir/miles_core_tests" --test-threads=1 >"$out/tests.log" 2>&1
echo "gpu tests: rc $?, $(grep -E '^test result' "$out/tests.log" | tail -1)" | tee -a "$out/steps.log"
grep -E "^test .*FAILED|panicked" "$out/tests.log" | head -20
python3 "$(dirname "$0")/offload_summary.py" "$runs" | tee "$out/summary.txt"
echo "total $((SECONDS - started)) s"
