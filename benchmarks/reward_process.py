"""What the reward process costs: a batch scored by the reward terms in their own process (what a run does,
``rollout.rewards.isolation``) against the same terms built and called in this process, interleaved.

Run::

    .venv/bin/python benchmarks/reward_process.py [--samples 256] [--reps 30]

Prints the CPU model, ``uptime`` before and after, and per term (exact match, math-verify, a plain python function):
median [range] milliseconds a batch either way and their ratio, plus the process's start-up seconds (its terms'
imports) and resident memory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=256, help="samples a batch (the default recipe's step)")
    parser.add_argument("--reps", type=int, default=30, help="batches scored each way, interleaved")
    args = parser.parse_args()

    import psutil

    from rollout.rewards import (
        ExactMatchRewardConfig,
        FunctionRewardConfig,
        MathRewardConfig,
        RewardConfig,
        RewardScorer,
    )
    from rollout.rewards.scorer import build_term
    from rollout.tasks import Problem

    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown")  # fmt: skip
    print(f"CPU: {model}; load before: {_uptime()}")
    problems = [Problem(prompt=[{"role": "user", "content": f"What is {i} + 34?"}], answer=str(i + 34),
                        problem_id=f"p{i}") for i in range(args.samples)]  # fmt: skip
    completions = [str(i + 34 if i % 2 else i) for i in range(args.samples)]
    labels = [f"problem {p.problem_id!r}" for p in problems]
    terms = [("exact_match", ExactMatchRewardConfig()), ("math", MathRewardConfig()),
             ("function", FunctionRewardConfig(function="benchmarks.reward_process:length"))]  # fmt: skip
    print(f"\n{'term':12} {'own process ms':>22} {'in process ms':>22} {'ratio':>6} {'start s':>8} {'RSS MB':>7}")
    for name, config in terms:
        before = {c.pid for c in psutil.Process().children()}
        start = time.perf_counter()
        scorer = RewardScorer.from_config(RewardConfig(terms=[config]))
        started = time.perf_counter() - start
        (child,) = [c for c in psutil.Process().children() if c.pid not in before]
        term = build_term(config, "fail")
        scorer.score(completions, problems)
        term.score(completions, problems, labels)
        isolated, local = [], []
        for _ in range(args.reps):
            t = time.perf_counter()
            scorer.score(completions, problems)
            isolated.append(time.perf_counter() - t)
            t = time.perf_counter()
            term.score(completions, problems, labels)
            local.append(time.perf_counter() - t)
        rss = child.memory_info().rss / 1e6
        scorer.close()
        a, b = statistics.median(isolated) * 1e3, statistics.median(local) * 1e3
        print(f"{name:12} {a:8.2f} [{min(isolated) * 1e3:.2f}-{max(isolated) * 1e3:.2f}] "
              f"{b:8.2f} [{min(local) * 1e3:.2f}-{max(local) * 1e3:.2f}] {a / b:6.2f} {started:8.2f} {rss:7.0f}")
    print(f"\nload after: {_uptime()}")


def length(completion: str, problem: object) -> float:
    """The plain python reward the benchmark times: the completion's length."""
    return float(len(completion))


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip() or str(os.getloadavg())


if __name__ == "__main__":
    main()
