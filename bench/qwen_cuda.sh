#!/usr/bin/env bash
# Issue 19's H200 acceptance: a random Qwen2.5-0.5B-shaped checkpoint (vocab 151,936, q/k/v
# biases, tied embeddings) made here by transformers trains and generates with --device cuda
# through `miles train --hf-checkpoint`.
#
#   bench/qwen_cuda.sh MILES_BINARY SCRATCH_DIR
#
# Needs python3 with torch, transformers and tokenizers (no internet: the tokenizer is a BPE
# trained here on a small corpus, with a chat template). Steps, each printing its exit code and
# key lines (full logs under SCRATCH_DIR/logs):
#   1. the checkpoint: Qwen2Config with the real 0.5B shape (hidden 896, 24 layers, 14 heads, 2 kv
#      heads, intermediate 4864, vocab 151936, rope_theta 1e6, tied), random weights (biases
#      drawn too, so they matter), bf16, save_pretrained in 500MB shards;
#   2. `miles model inspect` (its "cuda" field must be null);
#   3. `miles model score --device cuda` against `--device cpu` on one text: the largest
#      log-prob difference (bf16 compute against fp32);
#   4. `miles train --hf-checkpoint DIR --device cuda` on examples/math/train.jsonl for 3 steps
#      (one supervised warm-up step, then RL), saved to SCRATCH_DIR/trained;
#   5. `miles generate --hf-checkpoint DIR --device cuda --apply-chat-template`, from the
#      checkpoint and from what train saved (the random model samples mostly ids past the small
#      tokenizer's vocabulary, which decode to nothing: the token counts are what to read).
# Exits 0 when every step exits 0, 1 otherwise. About two minutes on one H200.
set -uo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 MILES_BINARY SCRATCH_DIR" >&2
    exit 2
fi
miles=$(realpath "$1")
scratch=$2
repo=$(cd "$(dirname "$0")/.." && pwd)
ck=$scratch/qwen2.5-0.5b-random
logs=$scratch/logs
mkdir -p "$logs"
status=0
TEXT="Bob has 3 pens. One more? The answer is 4."

# Runs a named step, its output to logs/NAME.log; prints its exit code and the lines matching
# PATTERN (the last 15 lines when it fails).
step() {
    local name=$1 pattern=$2
    shift 2
    local start=$SECONDS
    "$@" > "$logs/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc ($((SECONDS - start)) s)"
    if [ $rc -ne 0 ]; then
        status=1
        tail -n 15 "$logs/$name.log"
    else
        grep -E "$pattern" "$logs/$name.log" | tail -n 12
    fi
    return $rc
}

make_checkpoint() {
    python3 - "$ck" <<'EOF'
import inspect, json, os, sys
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
print(f"torch {torch.__version__}, transformers {transformers.__version__}")

specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
tk = Tokenizer(models.BPE())
tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tk.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(
    vocab_size=2000,
    special_tokens=specials,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
)
rows = [json.loads(line) for line in open(os.environ["TRAIN_JSONL"]) if line.strip()]
corpus = [f"{row['question']} {row['answer']}" for row in rows]
corpus += [
    "the quick brown fox jumps over the lazy dog",
    "system user assistant: you are a helpful assistant",
] * 8
tk.train_from_iterator(corpus, trainer)
fast = transformers.PreTrainedTokenizerFast(
    tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>"
)
fast.chat_template = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
fast.save_pretrained(out)
eos = tk.token_to_id("<|im_end|>")
print(f"tokenizer: {tk.get_vocab_size()} tokens, eos {eos}")

# transformers 5 takes the rotary base inside rope_parameters; 4.x as rope_theta.
if "rope_parameters" in inspect.signature(transformers.Qwen2Config.__init__).parameters:
    rope = {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}
else:
    rope = {"rope_theta": 1000000.0}
config = transformers.Qwen2Config(
    **rope,
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    use_sliding_window=False,
    eos_token_id=eos,
    pad_token_id=tk.token_to_id("<|endoftext|>"),
)
torch.manual_seed(0)
model = transformers.Qwen2ForCausalLM(config)
with torch.no_grad():
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            p.normal_(0, 0.1)
model.to(torch.bfloat16).save_pretrained(out, max_shard_size="500MB")
params = sum(p.numel() for p in model.parameters())
written = json.load(open(os.path.join(out, "config.json")))
rope_written = {k: written.get(k) for k in ("rope_theta", "rope_parameters") if k in written}
print(f"checkpoint: {params} parameters, files {sorted(os.listdir(out))}, {rope_written}")
EOF
}

compare_scores() {
    python3 - "$logs/score_cuda.json" "$logs/score_cpu.json" <<'EOF'
import json, sys
gpu, cpu = (json.load(open(p)) for p in sys.argv[1:3])
assert gpu["tokens"] == cpu["tokens"], "the two devices tokenized differently"
worst = max(abs(a - b) for a, b in zip(gpu["logprobs"], cpu["logprobs"]))
print(f"cuda vs cpu: {len(cpu['tokens'])} tokens, mean loss {gpu['mean_loss']:.4f} vs "
      f"{cpu['mean_loss']:.4f}, largest log-prob difference {worst:.3e}")
EOF
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -n 2
export TRAIN_JSONL=$repo/examples/math/train.jsonl
if ! step checkpoint "torch|tokenizer|checkpoint" make_checkpoint; then
    echo "no checkpoint: nothing else to run"
    exit 1
fi

step inspect "^(model_type|parameters|qkv_bias|dtypes|cuda) " \
    "$miles" model inspect "$ck"

"$miles" model score --hf-checkpoint "$ck" --text "$TEXT" --json --device cuda \
    > "$logs/score_cuda.json" 2> "$logs/score_cuda.err"
rc_gpu=$?
"$miles" model score --hf-checkpoint "$ck" --text "$TEXT" --json --device cpu \
    > "$logs/score_cpu.json" 2> "$logs/score_cpu.err"
rc_cpu=$?
echo "== score: exit $rc_gpu (cuda), $rc_cpu (cpu)"
if [ $rc_gpu -ne 0 ] || [ $rc_cpu -ne 0 ]; then
    status=1
    tail -n 5 "$logs/score_cuda.err" "$logs/score_cpu.err"
else
    compare_scores || status=1
fi

step train "step|loss|reward|saved|error|warn" \
    "$miles" train --hf-checkpoint "$ck" --device cuda \
    --prompt-data "$repo/examples/math/train.jsonl" --input-key question --label-key answer \
    --rm-type math --steps 3 --sft-warmup-steps 1 \
    --rollout-batch-size 4 --n-samples-per-prompt 4 --global-batch-size 16 \
    --rollout-max-response-len 32 --rollout-mem-fraction 0.3 --lr 1e-5 \
    --metrics "$scratch/train-metrics.jsonl" --save "$scratch/trained"

step generate "prompt|sample|error" \
    "$miles" generate --hf-checkpoint "$ck" --device cuda --apply-chat-template \
    --prompt "Bob has 3 pens. One more?" --prompt "Ann has 8 cats. One less?" \
    -n 2 --max-new-tokens 16 --seed 1

if [ -f "$scratch/trained/latest" ]; then
    trained=$scratch/trained/$(cat "$scratch/trained/latest")/actor
    step generate_trained "prompt|sample|error" \
        "$miles" generate --hf-checkpoint "$trained" --device cuda --apply-chat-template \
        --prompt "Sue has 3 cups. One more?" -n 1 --max-new-tokens 16
else
    echo "== generate_trained: train saved no checkpoint under $scratch/trained"
    status=1
fi

echo "== qwen_cuda: $([ $status -eq 0 ] && echo 'every step passed' || echo 'some steps failed')"
exit $status
