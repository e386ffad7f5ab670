#!/usr/bin/env bash
# Issues 22 and 24's acceptance figures on one GPU, the one nearest its bar first, then the GPU
# tests of the training kernels and of the rollout engine. Run from the repository root with the
# binaries in $BIN (default .gpu), built here with
#   cargo build -p miles-cli
#   cargo test --no-run -p miles-core -p miles-infer --lib
# and copied (stripped) to $BIN/miles, $BIN/core_tests, $BIN/infer_tests. The whole output goes
# to $OUT/acceptance.log (or ./out). Each figure has a time limit, so a call that is cut short
# still reports the ones before it.
set -o pipefail
bin=${BIN:-.gpu}
out=${OUT:-out}; mkdir -p "$out"
exec > >(tee "$out/acceptance.log") 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
SECONDS=0
train() {
    echo "== issue 24: batch $1, seq $2"
    timeout 120 "$bin/miles" bench train --device cuda --preset 1b --batch "$1" --seq "$2" \
        --steps 10 --warmup 3 --baselines compiled
    echo "at $SECONDS s"
}
train 8 512
echo "== issue 22"
timeout 120 "$bin/miles" bench rollout --device cuda --preset 1b --prompts 32 \
    --max-new-tokens 128 --cycles 1
echo "at $SECONDS s"
train 2 2048
train 1 4096
export MILES_TEST_DEVICE=cuda
for run in "core_tests ops::gpu" "infer_tests gpu"; do
    echo "== $run"
    # shellcheck disable=SC2086 # the binary and its filter
    timeout 80 "$bin"/$run --test-threads=1 2>&1 | grep -E "test result|FAIL|panick" | head -5
    echo "at $SECONDS s"
done
