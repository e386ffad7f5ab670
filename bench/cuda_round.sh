#!/usr/bin/env bash
# One GPU round for the CUDA device: the GPU tests, then the device-level copy benchmark.
# Run from a folder holding the two binaries (`miles_core_tests`, `cuda_copy_bench`), built here with
#   cargo test -p miles-core --no-run; cargo build -p miles-core --examples
# Logs go to $OUT (or ./out).
set -o pipefail
dir=$(dirname "$0")
out=${OUT:-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv | tee "$out/gpu.txt"
MILES_TEST_DEVICE=cuda "$dir/miles_core_tests" cuda --nocapture 2>&1 | tee "$out/tests.log"
"$dir/cuda_copy_bench" --gib "${GIB:-8}" --reps "${REPS:-3}" 2>&1 | tee "$out/bench.log"
