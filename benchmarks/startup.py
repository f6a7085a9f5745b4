"""Where a run's start-up goes: each part of it timed in a fresh process of its own, beside what TRL's process does
before its first step.

Run: ``.venv/bin/python -m benchmarks.startup [--reps 3] [--recipe recipes/grpo_tiny.toml]``

A run reaches its first RL step after, in order: the driver's imports, Ray's embedded start
(``driver.session.ray_session``: the GCS, the raylet and its runtime-env and dashboard agents), then, in the rollout
actor, the import of vLLM and the engine's build (``rollout.engine.vllm_engine.VLLMEngine`` on the recipe's model and
``[rollout.engine]``; the trainer's start runs beside it on the other cores). The engine's chain is the longest path.
Each part is timed here alone in a fresh process, ``--reps`` times, the parts interleaved; the engine process gets
what a colocated engine gets (the actors' environment, ``driver.session.worker_env_vars``, with one thread per
core). For comparison, TRL's start on the same model: importing torch and transformers and
``AutoModelForCausalLM.from_pretrained`` (what ``benchmarks/trl_e2e_side.py`` does before its first step, TRL's own
import aside). Printed: the CPU model, the load before and after, and median [min-max] seconds per part.

Alone, the parts sum to less than a run's start-up: in a run they share the cores with each other and with the
trainer's start (``benchmarks/e2e_vs_trl.py`` prints a run's start-up as a whole).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.machine import load_avg, machine_line, med_range

REPO = Path(__file__).resolve().parents[1]

_DRIVER = """
import json, time
t0 = time.perf_counter()
import rl_align  # noqa: F401  (the driver's entry point and what it imports before Ray starts)
from driver.session import ray_session
from recipe import load_recipe
recipe = load_recipe({recipe!r}, {{"model.path": {model!r}}})
t1 = time.perf_counter()
with ray_session(None, recipe.trainer.device):
    t2 = time.perf_counter()
print(json.dumps({{"driver imports": t1 - t0, "Ray's embedded start": t2 - t1}}))
"""

_ENGINE = """
import json, time
t0 = time.perf_counter()
import vllm  # noqa: F401
from vllm import LLM  # noqa: F401
from rollout.engine.vllm_engine import VLLMEngine
t1 = time.perf_counter()
from recipe import load_recipe
recipe = load_recipe({recipe!r}, {{"model.path": {model!r}}})
t2 = time.perf_counter()
engine = VLLMEngine({model!r}, recipe.rollout.engine)
t3 = time.perf_counter()
engine.shutdown()
print(json.dumps({{"engine: import vLLM": t1 - t0, "engine: build": t3 - t2}}))
"""

_HF = """
import json, time
t0 = time.perf_counter()
import torch  # noqa: F401
import transformers  # noqa: F401
from transformers import AutoModelForCausalLM
t1 = time.perf_counter()
AutoModelForCausalLM.from_pretrained({model!r})
t2 = time.perf_counter()
print(json.dumps({{"HF: import torch + transformers": t1 - t0, "HF: from_pretrained": t2 - t1}}))
"""


def _timed(code: str, env: dict[str, str]) -> dict[str, float]:
    """Run ``code`` in a fresh interpreter from the repository root; its last stdout line, a JSON dict of seconds."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"a timed part failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--recipe", default="recipes/grpo_tiny.toml")
    args = parser.parse_args()
    print(machine_line(), flush=True)

    from driver.run import ensure_model
    from driver.session import worker_env_vars
    from recipe import load_recipe

    cores = str(len(os.sched_getaffinity(0)))
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        model = str(Path(tmp) / "model")
        recipe = load_recipe(args.recipe, {"model.path": model}, check_paths=False)
        ensure_model(recipe)
        base = {**os.environ, "RAY_AUTH_MODE": "disabled", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
        actor_env = {**base, **worker_env_vars(recipe.trainer.device), "OMP_NUM_THREADS": cores,
                     "MKL_NUM_THREADS": cores}  # fmt: skip
        hf_env = {**base, "OMP_NUM_THREADS": cores, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        parts: dict[str, list[float]] = {}
        for _ in range(args.reps):
            for code, env in ((_DRIVER, base), (_ENGINE, actor_env), (_HF, hf_env)):
                for name, seconds in _timed(code.format(recipe=args.recipe, model=model), env).items():
                    parts.setdefault(name, []).append(seconds)
    print(f"{args.recipe}, {args.reps} rep(s) of each part, each in a fresh process, interleaved")
    print(f"{'part':<36}{'seconds: median [min-max]':>28}")
    for name, values in parts.items():
        print(f"{name:<36}{med_range(values):>28}")
    ours = sum(statistics.median(v) for k, v in parts.items() if not k.startswith("HF"))
    theirs = sum(statistics.median(v) for k, v in parts.items() if k.startswith("HF"))
    print(f"sum of medians: ours {ours:.1f} s (driver, Ray, engine chain), HF's {theirs:.1f} s")
    print(f"load after: {load_avg()}")


if __name__ == "__main__":
    main()
