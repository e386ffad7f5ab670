#!/usr/bin/env python3
"""Writes the small arithmetic word-problem dataset of examples/math/ (seeded, no download).

Each line is {"question": ..., "answer": ..., "metadata": {"op": ...}}: a one-digit count
and one more or one less of it, in a short sentence ("Ann has 3 pens. One more?" -> "4"). The
problems are this small so that the tiny preset, reading bytes, learns them with RL on a CPU
in under a minute: with two digits to add, it stays near chance for hundreds of steps. Run
from the repository root:

    python3 examples/make_math_data.py

and it rewrites examples/math/train.jsonl (240 rows) and examples/math/test.jsonl (48 rows).
"""

import json
import random
from pathlib import Path

NAMES = ["Ann", "Bob", "Sue", "Tom"]
ITEMS = ["pens", "cups", "cats", "eggs"]


def problems():
    """Every problem the templates make, in a fixed order."""
    out = []
    for name in NAMES:
        for item in ITEMS:
            for a in range(10):
                if a + 1 <= 9:
                    out.append((f"{name} has {a} {item}. One more?", a + 1, "add"))
                if a >= 1:
                    out.append((f"{name} has {a} {item}. One less?", a - 1, "sub"))
    return out


def main():
    rng = random.Random(20)
    rows = rng.sample(problems(), 288)
    here = Path(__file__).resolve().parent / "math"
    here.mkdir(exist_ok=True)
    for name, part in [("train.jsonl", rows[:240]), ("test.jsonl", rows[240:])]:
        with open(here / name, "w") as f:
            for question, answer, op in part:
                f.write(json.dumps({"question": question, "answer": str(answer), "metadata": {"op": op}}) + "\n")
        print(f"wrote {len(part)} rows to {here / name}")


if __name__ == "__main__":
    main()
