#!/usr/bin/env python3
"""PyTorch baseline for `miles bench rollout --device cuda`: Hugging Face transformers'
`generate` on the same Llama shapes (a miles preset's config.json, random weights in bf16, sdpa
attention), the same batch of prompts x samples, the same new tokens per sample (no stop token),
sampling at temperature 1 with no top-p / top-k cut.

`--cache static` is transformers' static KV cache (which lets `generate` compile the forward);
`--cache dynamic` its default cache. Prints one JSON object: generated tokens per second over the
timed call (after one untimed call of the same shapes), seconds, cache, and the shapes.

  python3 bench/hf_generate.py --config miles-core/presets/1b.json --batch 128 --prompt-len 32 --new-tokens 128
"""

import argparse
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a miles preset's config.json")
    parser.add_argument("--batch", type=int, default=128, help="sequences (prompts x samples)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--cache", choices=["static", "dynamic"], default="static")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("torch sees no cuda device")

    with open(args.config) as f:
        raw = json.load(f)
    raw["torch_dtype"] = "bfloat16"
    config = LlamaConfig(**raw)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).eval()

    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(32, 127, (args.batch, args.prompt_len), generator=generator)
    prompts[:, 0] = config.bos_token_id
    prompts = prompts.cuda()
    mask = torch.ones_like(prompts)

    def generate() -> int:
        with torch.no_grad():
            out = model.generate(
                input_ids=prompts,
                attention_mask=mask,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                cache_implementation=args.cache,
                pad_token_id=config.pad_token_id,
            )
        torch.cuda.synchronize()
        return (out.shape[1] - args.prompt_len) * out.shape[0]

    generate()
    start = time.perf_counter()
    tokens = generate()
    seconds = time.perf_counter() - start
    print(
        json.dumps(
            {
                "tokens_per_second": tokens / seconds,
                "seconds": seconds,
                "generated_tokens": tokens,
                "cache": args.cache,
                "batch": args.batch,
                "prompt_len": args.prompt_len,
                "new_tokens": args.new_tokens,
                "torch": torch.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
