#!/usr/bin/env python3
"""Bring-your-own-model check of miles against Hugging Face transformers, per family.

For a random Llama-3 (llama3 rope scaling, untied, eos_token_id list), Qwen2 (q/k/v biases,
tied) and Qwen3 (q/k norm, head_dim != hidden/heads) model made here with transformers, saved
sharded in bf16 with a BPE tokenizer.json trained here and a chat template, it checks:

1. `miles model score --hf-checkpoint DIR --text T --json`: the tokenizer's ids, and log-probs
   within --tol (1e-4) of transformers (float32 compute on the bf16 weights);
2. `miles generate --hf-checkpoint DIR --prompt T --apply-chat-template` runs;
3. `miles train --hf-checkpoint DIR --steps 2 --save OUT`: transformers loads the saved actor
   directory and gives the log-probs miles gives for it, within --tol.

    python3 bench/hf_families.py target/release/miles [OUT_DIR]

Exits 0 when every check holds, 1 otherwise; without torch/transformers it prints "skipped"
and exits 0.
"""

import json
import os
import subprocess
import sys
import tempfile

TEXT = "hello world, the quick brown fox jumps over the lazy dog"

try:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
except ImportError as e:  # pragma: no cover - depends on the machine
    print(f"skipped: python has no torch/transformers/tokenizers ({e})")
    sys.exit(0)

CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_end|>"]


def write_tokenizer(d, bos):
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [
        "the quick brown fox jumps over the lazy dog",
        "hello world, hello miles; byte-level pairs of a chat",
        "repeat after me: abc def, reverse 123 and add 4 + 5",
    ] * 16
    tk.train_from_iterator(corpus, trainer)
    if bos:
        tk.post_processor = processors.TemplateProcessing(
            single=f"{SPECIALS[0]} $A", special_tokens=[(SPECIALS[0], 0)]
        )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token=SPECIALS[0] if bos else None,
        eos_token=SPECIALS[2],
        pad_token=SPECIALS[1],
    )
    fast.chat_template = CHAT
    fast.save_pretrained(d)


def make(family, d):
    common = dict(
        vocab_size=448,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
    )
    if family == "llama":
        config = transformers.LlamaConfig(
            **common,
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=[1, 2],
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        cls = transformers.LlamaForCausalLM
    elif family == "qwen2":
        config = transformers.Qwen2Config(**common, tie_word_embeddings=True, eos_token_id=2)
        cls = transformers.Qwen2ForCausalLM
    else:
        config = transformers.Qwen3Config(
            **common, head_dim=24, tie_word_embeddings=True, eos_token_id=2
        )
        cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(len(family))
    model = cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
            elif "norm" in name:
                p.uniform_(0.6, 1.4)
    model.to(torch.bfloat16).save_pretrained(d, max_shard_size="100KB")
    write_tokenizer(d, bos=family == "llama")


def miles(binary, *args):
    out = subprocess.run([binary, *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"miles {' '.join(args)} failed: {out.stderr}")
    return out.stdout


def hf_logprobs(d, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    return logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()


def compare(what, d, ours, tol):
    tok = transformers.AutoTokenizer.from_pretrained(d)
    ids = tok(TEXT)["input_ids"]
    if ours["tokens"] != ids:
        print(f"MISMATCH {what}: tokens miles {ours['tokens']} hf {ids}")
        return False
    theirs = hf_logprobs(d, ids)
    worst = max(abs(a - b) for a, b in zip(ours["logprobs"], theirs))
    ok = worst <= tol
    print(f"{'OK' if ok else 'MISMATCH'} {what}: largest log-prob difference {worst:.3e} ({len(theirs)} tokens)")
    return ok


def main():
    binary = sys.argv[1]
    out = sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp()
    tol = 1e-4
    ok = True
    for family in ["llama", "qwen2", "qwen3"]:
        d = os.path.join(out, family)
        make(family, d)
        score = lambda ck: json.loads(
            miles(binary, "model", "score", "--hf-checkpoint", ck, "--text", TEXT, "--json")
        )
        ok &= compare(f"{family} score", d, score(d), tol)
        miles(binary, "generate", "--hf-checkpoint", d, "--prompt", "hello", "--apply-chat-template",
              "--max-new-tokens", "8", "-n", "1", "--device", "cpu")
        save = os.path.join(out, f"{family}-trained")
        miles(binary, "train", "--hf-checkpoint", d, "--steps", "2", "--save", save, "--device", "cpu",
              "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
              "--sft-warmup-steps", "1", "--lr", "1e-2", "--save-shard-size", "100000")
        with open(os.path.join(save, "latest")) as f:
            actor = os.path.join(save, f.read().strip(), "actor")
        ok &= compare(f"{family} saved by miles train", actor, score(actor), tol)
    print("all families agree" if ok else "some families disagree")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
