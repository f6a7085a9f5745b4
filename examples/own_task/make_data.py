"""Write the worked example's data: subtraction word problems as JSONL (a training file and a held-out file).

    python examples/own_task/make_data.py          # -> examples/own_task/data/{train,eval}.jsonl

Each line is one problem: ``{"id": ..., "prompt": ..., "answer": ...}``; ``prompt`` may also be a list of chat
messages (``[{"role": "system", ...}, {"role": "user", ...}]``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent / "data"


def problems(num: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    out = []
    for i in range(num):
        a = rng.randint(10, 99)
        b = rng.randint(0, a)
        out.append({"id": f"sub-{seed}-{i}", "prompt": f"Take {b} away from {a}. What is left?", "answer": str(a - b)})
    return out


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, num, seed in (("train", 2000, 1), ("eval", 300, 2)):
        with open(OUT / f"{name}.jsonl", "w") as f:
            for problem in problems(num, seed):
                f.write(json.dumps(problem) + "\n")
    print(f"wrote {OUT}/train.jsonl and {OUT}/eval.jsonl")


if __name__ == "__main__":
    main()
