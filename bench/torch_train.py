#!/usr/bin/env python3
"""PyTorch baseline for `miles bench train --device cuda`: the same Llama shapes (a miles
preset's config.json) trained with forward + backward + AdamW, fp32 master weights and moments,
bf16 autocast for the compute, on the same batch of B sequences of T tokens. Eager by default;
`--compile` runs the model and its cross-entropy under one `torch.compile` (so the fp32 logits of
the loss need not be stored whole) with `AdamW(fused=True)`: the setup a user tuning PyTorch
would pick. Compiling the loss with the model made this baseline 2.4-3.4% faster and 1.35 GiB
smaller at 1B than compiling the model alone (bench/RESULTS.md round 36).

Prints one JSON object: tokens/s over the timed steps (after untimed warm-up steps, which also
compile), seconds per step, the attention implementation, whether compiled, the parameter
count, the peak device memory PyTorch allocated and the last loss.

  python3 bench/torch_train.py --config miles-core/presets/1b.json --batch 8 --seq 512 --attn sdpa
  python3 bench/torch_train.py --config miles-core/presets/1b.json --attn sdpa --compile
"""

import argparse
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a miles preset's config.json")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--attn",
        choices=["eager", "sdpa"],
        default="sdpa",
        help="eager: matmul + softmax + matmul (scores in memory); sdpa: PyTorch's fused kernels",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model with its loss and use AdamW(fused=True)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("torch sees no cuda device")

    with open(args.config) as f:
        raw = json.load(f)
    raw["torch_dtype"] = "float32"
    config = LlamaConfig(**raw)
    config._attn_implementation = args.attn
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).cuda().train()
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=args.lr,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        fused=args.compile,
    )

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=generator).cuda()
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def forward_loss(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=inputs).logits
        return torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1)
        )

    loss_of = torch.compile(forward_loss) if args.compile else forward_loss

    def step() -> float:
        loss = loss_of(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    loss = 0.0
    for _ in range(args.steps):
        loss = step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    print(
        json.dumps(
            {
                "tokens_per_s": args.steps * args.batch * args.seq / seconds,
                "step_s": seconds / args.steps,
                "attn": args.attn,
                "compiled": args.compile,
                "peak_memory_bytes": torch.cuda.max_memory_allocated(),
                "params": params,
                "loss": loss,
                "torch": torch.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
