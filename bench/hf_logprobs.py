#!/usr/bin/env python3
"""Score a text with Hugging Face transformers, as `miles model score --json` does.

Loads a checkpoint directory (config.json + model.safetensors) with
`transformers.LlamaForCausalLM.from_pretrained`, encodes the text with the byte tokenizer
(BOS first, then the UTF-8 bytes), and prints one JSON object with the same keys as
`miles model score --json`: `tokens`, `logprobs` (log p of each token after the first given
those before it) and `mean_loss`.

With `--compare FILE` (the output of `miles model score --json` for the same checkpoint and
text) it also checks that the tokens are equal and every log-prob agrees within `--tol`
(default 1e-4), prints the largest difference to stderr, and exits 1 when they do not agree.

    miles model init --preset tiny --seed 1 --out D
    miles model score --checkpoint D --text "hello world" --json > miles.json
    python3 bench/hf_logprobs.py D --text "hello world" --compare miles.json
"""

import argparse
import json
import sys

import torch
from transformers import LlamaForCausalLM


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="checkpoint directory")
    parser.add_argument("--text", required=True, help="text to score")
    parser.add_argument("--compare", help="JSON output of `miles model score --json` to check")
    parser.add_argument("--tol", type=float, default=1e-4, help="largest allowed log-prob difference")
    parser.add_argument(
        "--dtype",
        choices=["float32", "float64"],
        default="float32",
        help="precision HF computes in (float64 shows how far float32 itself drifts)",
    )
    args = parser.parse_args()

    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(
        args.checkpoint, dtype=getattr(torch, args.dtype), attn_implementation="eager"
    )
    model.eval()
    bos = model.config.bos_token_id
    tokens = [bos] + list(args.text.encode("utf-8"))
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    targets = torch.tensor(tokens[1:])
    logprobs = logp[torch.arange(len(tokens) - 1), targets].tolist()
    result = {
        "tokens": tokens,
        "logprobs": logprobs,
        "mean_loss": -sum(logprobs) / len(logprobs),
    }
    print(json.dumps(result))
    if args.compare is None:
        return 0
    with open(args.compare) as f:
        ours = json.load(f)
    if ours["tokens"] != tokens:
        print(f"tokens differ: miles {ours['tokens']} hf {tokens}", file=sys.stderr)
        return 1
    worst = max(abs(a - b) for a, b in zip(ours["logprobs"], logprobs))
    loss_diff = abs(ours["mean_loss"] - result["mean_loss"])
    ok = worst <= args.tol and loss_diff <= args.tol
    print(
        f"{'OK' if ok else 'MISMATCH'}: largest log-prob difference {worst:.3e}, "
        f"mean loss difference {loss_diff:.3e} (tolerance {args.tol:g}, "
        f"{len(logprobs)} tokens)",
        file=sys.stderr,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
