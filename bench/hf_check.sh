#!/usr/bin/env bash
# Checks `miles model score` against Hugging Face transformers on fresh checkpoints.
#
#   bench/hf_check.sh MILES_BINARY [OUT_DIR]
#
# Needs python3 with torch and transformers (the GPU machine has them). For each case it writes a
# checkpoint with `miles model init`, scores a text with miles and with bench/hf_logprobs.py, and
# fails when any log-prob differs by more than 1e-4. Cases with a large --init-std have sharp
# distributions, so a wrong rotary convention or norm shows far above the tolerance (sharper
# still, and float32 itself drifts past 1e-4: with --init-std 0.2 the small preset's HF float32
# and float64 log-probs differ by 2.6e-4, and miles lies as close to float64 as HF float32 does). The HF
# outputs of the two "hello world" cases are the golden fixtures in miles-cli/tests/fixtures/.
# Then bench/hf_families.py checks Llama-3, Qwen2 and Qwen3 directories made by transformers.
set -euo pipefail
miles=$1
out=${2:-$(mktemp -d)}
here=$(cd "$(dirname "$0")" && pwd)
long="The quick brown fox jumps over the lazy dog; $(printf 'pack my box with five dozen liquor jugs %.0s' 1 2 3 4 5)"
status=0
run_case() {
  local preset=$1 seed=$2 text=$3 name=$4
  shift 4
  local dir=$out/$name
  "$miles" model init --preset "$preset" --seed "$seed" --out "$dir" "$@" > /dev/null
  "$miles" model score --checkpoint "$dir" --text "$text" --json > "$dir/miles.json"
  echo "== $name ($preset, seed $seed, ${#text} bytes)"
  python3 "$here/hf_logprobs.py" "$dir" --text "$text" --compare "$dir/miles.json" > "$dir/hf.json" || status=1
}
run_case tiny 1 "hello world" tiny_seed1_hello
run_case tiny 1 "hello world" tiny_seed1_std05_hello --init-std 0.5
run_case tiny 2 "$long" tiny_seed2_std05_long --init-std 0.5
run_case small 3 "$long" small_seed3_long
run_case small 4 "$long" small_seed4_std01_long --init-std 0.1
# Hugging Face directories of each family made by transformers: score, generate, train --save.
python3 "$here/hf_families.py" "$miles" "$out/families" || status=1
exit $status
