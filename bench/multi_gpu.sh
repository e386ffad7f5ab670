#!/usr/bin/env bash
# Issue 25's acceptance on one host with several GPUs, in one go: fsdp sharded over two GPUs
# against one (memory per rank, losses, scaling), data-parallel scaling, `miles train` with
# Megatron's tensor parallelism (2, and 2 x 2 where there are 4 GPUs) and with fsdp across
# processes, reward curves against one GPU's, Ctrl-C across two processes, and the offload
# benchmark on every GPU at once.
#
# Run from the repository root (the examples are read from there):
#   bench/multi_gpu.sh PATH/TO/miles
# The binary is built with `cargo build -p miles-cli` (or `--release`). Each command's whole
# output goes to $OUT (default ./out) as NAME.log; the lines that carry its figures are printed.
# Set LIMIT to change the seconds each command may run (default 300).
set -u -o pipefail
miles=${1:?usage: bench/multi_gpu.sh PATH/TO/miles}
gpus=$(nvidia-smi -L | wc -l)
out=${OUT:-out}
limit=${LIMIT:-300}
mkdir -p "$out"
# NVLink multicast stays off on the lent machines.
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
if [ "$gpus" -lt 2 ]; then
    echo "skipped: $gpus GPU(s) here, this round needs at least 2"
    exit 0
fi

# run NAME PATTERN COMMAND...: runs COMMAND into NAME.log, prints its status and the lines
# matching PATTERN.
run() {
    local name=$1 pattern=$2
    shift 2
    echo "== $name: $*"
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    echo "exit $?"
    grep -E "$pattern" "$out/$name.log" | tail -n 12
}

# rewards NAME: a run's mean reward at each step, from its log.
rewards() {
    grep -E "rl step" "$out/$1.log" | sed -E 's/.*reward ([0-9.]+).*step=([0-9]+).*/\2:\1/' |
        tr '\n' ' '
    echo
}

bench='tokens/s|scaling|loss|per rank|GiB|error'
one_b=(--device cuda --preset 1b --batch 16 --seq 512 --steps 10 --warmup 2 --nproc-per-node 2)
run fsdp2 "$bench" "$miles" bench train "${one_b[@]}" --fully-shard
run fsdp2_ahead "$bench" "$miles" bench train "${one_b[@]}" --fully-shard --overlap-grad-reduce
run dp2 "$bench" "$miles" bench train "${one_b[@]}"
run dp2_behind "$bench" "$miles" bench train "${one_b[@]}" --overlap-grad-reduce
run tp2 "$bench" "$miles" bench train "${one_b[@]}" --tensor-parallel

# The colocated loop on a model that learns (the tiny preset on the repeat task), one GPU
# against several processes; then the 1B example with every offload flag.
loop='finished|error|captured'
learn=(train --config examples/colocate-repeat-cpu.toml --device cuda)
run loop_one "$loop" "$miles" "${learn[@]}"
run loop_tp2 "$loop" "$miles" "${learn[@]}" --tensor-model-parallel-size 2 --nproc-per-node 2
run loop_fsdp2 "$loop" "$miles" "${learn[@]}" --train-backend fsdp --data-parallel-size 2 \
    --nproc-per-node 2 --overlap-grad-reduce
if [ "$gpus" -ge 4 ]; then
    run loop_tp2dp2 "$loop" "$miles" "${learn[@]}" --tensor-model-parallel-size 2 \
        --data-parallel-size 2 --nproc-per-node 4
fi
for name in loop_one loop_tp2 loop_fsdp2 loop_tp2dp2; do
    [ -f "$out/$name.log" ] && echo "$name rewards: $(rewards "$name")"
done
big=(train --config examples/colocate-cuda.toml --steps 3)
run big_tp2_cpu "$loop" "$miles" "${big[@]}" --tensor-model-parallel-size 2 --nproc-per-node 2
run big_tp2_disk "$loop" "$miles" "${big[@]}" --tensor-model-parallel-size 2 --nproc-per-node 2 \
    --offload-train-target disk --offload-train-disk-dir "$out/offload-disk"
run big_fsdp2 "$loop" "$miles" "${big[@]}" --train-backend fsdp --data-parallel-size 2 \
    --nproc-per-node 2 --overlap-grad-reduce
rm -rf "$out/offload-disk"

# Ctrl-C during a two-process run: SIGINT to the launcher once step 4 is logged; both ranks
# should stop after the same step, save one checkpoint together and exit 130.
echo "== ctrl_c: ${big[*]} --steps 40 --tensor-model-parallel-size 2 --nproc-per-node 2 --save"
rm -rf "$out/ctrl-c-save"
"$miles" "${big[@]}" --steps 40 --tensor-model-parallel-size 2 --nproc-per-node 2 \
    --save "$out/ctrl-c-save" >"$out/ctrl_c.log" 2>&1 &
launcher=$!
for _ in $(seq "$limit"); do
    grep -qE "rl step.* step=4$" "$out/ctrl_c.log" && break
    sleep 1
done
kill -INT "$launcher"
wait "$launcher"
echo "exit $? (130 expected)"
grep -E "stopped|saved|error" "$out/ctrl_c.log" | tail -n 6
echo "checkpoints: $(ls "$out/ctrl-c-save" 2>/dev/null | tr '\n' ' ')"
rm -rf "$out/ctrl-c-save"

run offload_all 'GB/s|error' "$miles" bench offload --device cuda --size 8GiB --cycles 3 \
    --target host --nproc-per-node "$gpus"
