#!/usr/bin/env bash
# One GPU round of the memory manager on the CUDA device: the GPU tests, `miles bench offload`
# on every target, both directions at once, and torch_memory_saver side by side.
# Run from the repository root with the binaries in a folder (default .gpu) built here with
#   cargo build -p miles-cli; cargo test -p miles-core --no-run
# and copied as `miles`, `miles_core_tests`, `pause_cycles`, plus the torch_memory_saver wheel.
# Logs go to $OUT (or ./out); the last lines summarise.
set -o pipefail
dir=${GPU_DIR:-.gpu}
out=${OUT:-out}; mkdir -p "$out"
disk=${DISK_DIR:-/var/tmp/miles-bench}; mkdir -p "$disk"
miles="$dir/miles"
export RUST_LOG=${RUST_LOG:-info}
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
  df -hT "$disk" /tmp; nproc; free -g
} 2>&1 | tee "$out/machine.txt"
step() { echo "== $*" | tee -a "$out/steps.log"; }
step tests
( MILES_TEST_DEVICE=cuda timeout 240 "$dir/miles_core_tests" --test-threads=1 2>&1 | grep -E "^test |test result|panicked|FAILED" ;
  MILES_TEST_DEVICE=cuda timeout 120 "$dir/pause_cycles" 2>&1 | grep -E "^test |test result|panicked" ) | tee "$out/tests.log"
step host
"$miles" bench offload --device cuda --size 8GiB --target host --cycles 5 --no-disk-baseline 2>&1 | tee "$out/host.log"
"$miles" bench offload --device cuda --size 8GiB --target host --cycles 5 --no-disk-baseline --json 2>/dev/null | tee "$out/host.json"
step none
for chunk in 1024 2048 8192 1024; do
  echo "-- commit chunk $chunk MiB" | tee -a "$out/none.log"
  "$miles" bench offload --device cuda --size 8GiB --target none --cycles 7 --no-disk-baseline --cuda-commit-chunk-mib $chunk 2>/dev/null | tee -a "$out/none.log"
done
step both
"$miles" bench offload --device cuda --size 8GiB --target host --both-directions --cycles 5 2>/dev/null | tee "$out/both.log"
step disk
"$miles" bench offload --device cuda --size ${DISK_SIZE:-4GiB} --target disk --disk-dir "$disk" --cycles 3 2>/dev/null | tee "$out/disk.log"
step tms
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$dir"/*.whl \
  && PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 timeout 300 python3 "$(dirname "$0")/compare_tms.py" --miles "$miles" --json "$out/tms.json" 2>&1 | grep -v "INFO" | tee "$out/tms.log"
step done
